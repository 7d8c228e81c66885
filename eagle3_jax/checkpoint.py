"""Checkpoint I/O: Hugging Face safetensors targets, official / SpecForge / vLLM
EAGLE-3 drafters (``pytorch_model.bin`` read without torch, or safetensors), and
drafter export in the official format.

Tensors are read one at a time straight onto the device (or the sharding given);
PyTorch ``Linear`` weights ``[out, in]`` become Flax ``[in, out]``.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype, default: str = "float32"):
    name = dtype if isinstance(dtype, str) else None
    if dtype is None:
        name = default
    if name is not None:
        if name not in DTYPES:
            raise ValueError(f"dtype={name!r}: expected one of {sorted(DTYPES)}")
        return DTYPES[name]
    return jnp.dtype(dtype).type


# --------------------------------------------------------------------------- sources
class SafetensorsSource:
    """Tensor-by-tensor reader over ``model.safetensors`` or an indexed shard set."""

    def __init__(self, directory: Path, prefix: str = "model"):
        self.directory = directory
        index = directory / f"{prefix}.safetensors.index.json"
        single = directory / f"{prefix}.safetensors"
        if index.exists():
            try:
                self.weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: malformed safetensors index ({e!r})") from None
        elif single.exists():
            self.weight_map = {name: single.name for name in self._open(single).keys()}
        else:
            raise FileNotFoundError(f"{directory}: no {single.name} or {index.name}")

    def _open(self, file: Path):
        if not file.exists():
            raise FileNotFoundError(f"{file}: shard listed in the index is missing")
        try:
            return safe_open(str(file), framework="flax")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: corrupt or unreadable safetensors file ({e})") from None

    def names(self):
        return self.weight_map.keys()

    def get(self, name: str) -> jax.Array:
        if name not in self.weight_map:
            raise KeyError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        file = self.directory / self.weight_map[name]
        try:
            return self._open(file).get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from None


class TorchPickleSource:
    """Reads a ``torch.save`` zip checkpoint (``pytorch_model.bin``) *without torch*.

    The unpickler only rebuilds plain tensors and ordered dicts; any other global in
    the pickle is refused, so a malicious file cannot run code.
    """

    _STORAGE_DTYPES = {
        "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
        "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
        "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    }

    def __init__(self, file: Path):
        self.file = file
        try:
            with zipfile.ZipFile(file) as zf:
                pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
                if pkl is None:
                    raise ValueError(f"{file}: not a torch zip checkpoint (no data.pkl)")
                root = pkl[: -len("data.pkl")]
                blobs = {n[len(root) + len("data/"):]: zf.read(n) for n in zf.namelist() if n.startswith(root + "data/")}
                self.tensors = self._unpickle(zf.read(pkl), blobs)
        except zipfile.BadZipFile:
            raise ValueError(f"{file}: corrupt or legacy (non-zip) torch checkpoint") from None
        if not isinstance(self.tensors, dict):
            raise ValueError(f"{file}: expected a state dict, got {type(self.tensors).__name__}")

    def _unpickle(self, data: bytes, blobs: dict[str, bytes]):
        file, dtypes = self.file, self._STORAGE_DTYPES

        def rebuild_tensor(storage, offset, size, stride, *_):
            itemsize = storage.dtype.itemsize
            return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                                   strides=tuple(s * itemsize for s in stride)).copy()

        class Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) in {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")}:
                    return rebuild_tensor
                if module == "torch._utils" and name == "_rebuild_parameter":
                    return lambda tensor, *_: tensor
                if module == "collections" and name == "OrderedDict":
                    import collections

                    return collections.OrderedDict
                if module == "torch" and name in dtypes:
                    return name
                raise pickle.UnpicklingError(f"{file}: refusing to load global {module}.{name}")

            def persistent_load(self, pid):
                _, storage_type, key, _location, _numel = pid
                dtype = dtypes.get(storage_type if isinstance(storage_type, str) else "")
                if dtype is None:
                    raise pickle.UnpicklingError(f"{file}: unsupported storage {storage_type!r}")
                if dtype == "bfloat16":
                    dtype = jnp.bfloat16
                return np.frombuffer(blobs[str(key)], dtype=dtype)

        import io

        return Unpickler(io.BytesIO(data)).load()

    def names(self):
        return self.tensors.keys()

    def get(self, name: str) -> jax.Array:
        if name not in self.tensors:
            raise KeyError(f"{self.file}: tensor {name!r} is missing from the checkpoint")
        return jnp.asarray(self.tensors[name])


def open_weights(directory: Path):
    """The weight source of a checkpoint directory (safetensors first, then pytorch_model.bin)."""
    if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        return SafetensorsSource(directory)
    if (directory / "pytorch_model.bin").exists():
        return TorchPickleSource(directory / "pytorch_model.bin")
    raise FileNotFoundError(f"{directory}: no model.safetensors(.index.json) or pytorch_model.bin")


def _fetch(source, name: str, shape, transpose: bool, dtype, sharding=None):
    arr = source.get(name)
    if transpose:
        arr = arr.T
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r}: expected shape {tuple(shape)} (after [out,in]→[in,out]), got {tuple(arr.shape)}")
    arr = arr.astype(dtype)
    return jax.device_put(arr, sharding) if sharding is not None else arr


# --------------------------------------------------------------------------- target
_TARGET_LAYER_NAMES = {
    "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False), "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "attn_norm": ("input_layernorm.weight", False), "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True), "b_gate": ("mlp.gate_proj.bias", False),
    "b_up": ("mlp.up_proj.bias", False), "b_down": ("mlp.down_proj.bias", False),
}
_TARGET_TOP_NAMES = {"embed": ("model.embed_tokens.weight", False), "norm": ("model.norm.weight", False),
                     "lm_head": ("lm_head.weight", True)}


def load_target(path, *, dtype=None, capture_layers=None, attention_impl: str = "xla",
                shardings: dict[str, jax.sharding.Sharding] | None = None):
    """Loads a Hugging Face Llama / Mistral / Qwen2 / Qwen3 checkpoint directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``).
      dtype: ``"float32"`` / ``"bfloat16"`` / a jnp dtype; default: the checkpoint's.
      capture_layers: three decoder-layer ids whose *inputs* form the EAGLE-3
        features; default ``(2, L//2, L-3)``.
      attention_impl: ``"xla"``, ``"pallas"`` (the tree-attention kernel on a TPU, or on a
        Hopper GPU for bfloat16/float16; the XLA reference elsewhere), or
        ``"pallas_interpret"`` / ``"pallas_interpret_gpu"`` (the TPU / GPU kernel in its
        CPU interpreter).
      shardings: optional per-parameter shardings (see ``eagle3_jax.sharding``).

    Returns:
      A :class:`~eagle3_jax.models.target.Target`.
    """
    from eagle3_jax.models.target import Target, param_shapes

    from eagle3_jax.layers import ATTENTION_IMPLS

    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={attention_impl!r}: expected one of {ATTENTION_IMPLS}")
    path = Path(path)
    raw = read_config_json(path)
    cfg = TargetConfig.from_dict(raw, source=str(path / "config.json"), capture_layers=capture_layers)
    dtype = resolve_dtype(dtype, cfg.torch_dtype)
    source = open_weights(path)
    model = nnx.eval_shape(lambda: Target(cfg, dtype=dtype, attention_impl=attention_impl))
    shardings = shardings or {}
    for name, shape in param_shapes(cfg).items():
        if shape is None:
            continue
        if name in _TARGET_TOP_NAMES:
            hf, transpose = _TARGET_TOP_NAMES[name]
            value = _fetch(source, hf, shape, transpose, dtype, shardings.get(name))
        else:
            hf, transpose = _TARGET_LAYER_NAMES[name]
            per_layer = [_fetch(source, f"model.layers.{i}.{hf}", shape[1:], transpose, dtype)
                         for i in range(cfg.num_layers)]
            value = jnp.stack(per_layer)
            del per_layer
            if name in shardings:
                value = jax.device_put(value, shardings[name])
        getattr(model, name).set_value(value)
    model.inv_freq.set_value(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)))
    return model


# --------------------------------------------------------------------------- drafter
# Our name -> (official state-dict name, transpose)
_DRAFTER_NAMES = {
    "fc": ("fc.weight", True),
    "hidden_norm": ("midlayer.hidden_norm.weight", False),
    "input_norm": ("midlayer.input_layernorm.weight", False),
    "post_norm": ("midlayer.post_attention_layernorm.weight", False),
    "wq": ("midlayer.self_attn.q_proj.weight", True), "wk": ("midlayer.self_attn.k_proj.weight", True),
    "wv": ("midlayer.self_attn.v_proj.weight", True), "wo": ("midlayer.self_attn.o_proj.weight", True),
    "w_gate": ("midlayer.mlp.gate_proj.weight", True), "w_up": ("midlayer.mlp.up_proj.weight", True),
    "w_down": ("midlayer.mlp.down_proj.weight", True),
    "norm": ("norm.weight", False), "lm_head": ("lm_head.weight", True),
}


def is_drafter_config(raw: dict) -> bool:
    archs = raw.get("architectures") or []
    return "draft_vocab_size" in raw or any("Eagle" in a for a in archs)


class _Renamed:
    """Accepts exports that prefix names with ``model.`` or call the layer ``layers.0``."""

    def __init__(self, source):
        self.source = source
        self.alias = {}
        for name in source.names():
            canon = name[len("model."):] if name.startswith("model.") else name
            canon = canon.replace("layers.0.", "midlayer.", 1) if canon.startswith("layers.0.") else canon
            self.alias[canon] = name

    def names(self):
        return self.alias.keys()

    def get(self, name):
        if name not in self.alias:
            return self.source.get(name)  # raises the source's "missing tensor" error
        return self.source.get(self.alias[name])


def load_drafter(path, *, target=None, embed=None, dtype=None):
    """Loads an EAGLE-3 drafter checkpoint directory.

    Reads the official release layout (``config.json`` + ``pytorch_model.bin``, read
    without torch) and safetensors exports (SpecForge / SGLang / vLLM
    ``LlamaForCausalLMEagle3``).  The drafter shares ``target``'s embedding (frozen)
    unless the checkpoint carries ``embed_tokens.weight``; pass ``embed`` instead of a
    target to give the table directly.  The pair is validated: hidden sizes, vocab
    size, ``d2t`` range and ``t2d`` consistency, captured-layer ids.
    """
    from eagle3_jax.models.drafter import Drafter, param_shapes

    path = Path(path)
    raw = read_config_json(path)
    cfg = DrafterConfig.from_dict(raw, source=str(path / "config.json"))
    source = _Renamed(open_weights(path))
    dtype = resolve_dtype(dtype, "float32" if target is None else jnp.dtype(target.dtype).name)
    if target is not None:
        _check_pair(cfg, target.config, path)
    own = "embed_tokens.weight" in source.names()
    if own:
        embed = _fetch(source, "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), False, dtype)
    elif target is not None:
        embed = target.embed[...]
    elif embed is None:
        raise ValueError(f"{path}: the checkpoint has no embed_tokens.weight; pass target= (or embed=) to share the target's")
    if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"{path}: embedding shape {tuple(embed.shape)} does not match the drafter's "
                         f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})")

    d2t = None
    if cfg.has_vocab_map:
        d2t = np.asarray(source.get("d2t")).astype(np.int64)
        _check_vocab_map(d2t, np.asarray(source.get("t2d")) if "t2d" in source.names() else None, cfg, path)
    model = nnx.eval_shape(lambda: Drafter(cfg, jnp.zeros((cfg.vocab_size, cfg.hidden_size)), dtype=dtype))
    for name, shape in param_shapes(cfg).items():
        hf, transpose = _DRAFTER_NAMES[name]
        getattr(model, name).set_value(_fetch(source, hf, shape, transpose, dtype))
    model.embed.set_value(jnp.asarray(embed, dtype))
    model.d2t.set_value(jnp.zeros((cfg.draft_vocab_size,), jnp.int32) if d2t is None else jnp.asarray(d2t, jnp.int32))
    model.inv_freq.set_value(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)))
    model.own_embedding = own
    return model


def _check_pair(cfg: DrafterConfig, tcfg: TargetConfig, path: Path):
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(f"{path}: drafter expects target hidden size {cfg.target_hidden_size} "
                         f"(fc takes {3 * cfg.target_hidden_size}), the target has {tcfg.hidden_size}")
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"{path}: drafter vocab_size {cfg.vocab_size} != target vocab_size {tcfg.vocab_size}")
    if cfg.capture_layers is not None and tuple(cfg.capture_layers) != tuple(tcfg.capture_layers):
        raise ValueError(f"{path}: drafter was trained on target layers {list(cfg.capture_layers)}, the target "
                         f"captures {list(tcfg.capture_layers)}; load it with load_target(..., "
                         f"capture_layers={list(cfg.capture_layers)})")


def _check_vocab_map(d2t: np.ndarray, t2d, cfg: DrafterConfig, path: Path):
    if d2t.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"{path}: tensor 'd2t' has shape {d2t.shape}, expected ({cfg.draft_vocab_size},)")
    target_ids = np.arange(cfg.draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size or np.any(np.diff(target_ids) <= 0):
        raise ValueError(f"{path}: tensor 'd2t' maps draft ids outside [0, {cfg.vocab_size}) or not strictly increasing")
    if t2d is not None:
        if t2d.shape != (cfg.vocab_size,) or not np.array_equal(np.flatnonzero(t2d), target_ids):
            raise ValueError(f"{path}: tensor 't2d' disagrees with 'd2t' (it must mark exactly the mapped target ids)")


def save_drafter(drafter, path, *, dtype="float32") -> Path:
    """Writes ``config.json`` + ``model.safetensors`` in the official EAGLE-3 layout
    (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` as PyTorch
    ``[out, in]`` in ``dtype``, ``d2t`` int64, ``t2d`` bool), loadable by SGLang and vLLM.
    ``embed_tokens.weight`` is written only when the drafter owns its embedding.
    """
    from eagle3_jax.models.drafter import param_shapes

    cfg = drafter.config
    dtype = resolve_dtype(dtype)
    tensors = {}
    for name in param_shapes(cfg):
        hf, transpose = _DRAFTER_NAMES[name]
        arr = getattr(drafter, name)[...].astype(dtype)
        tensors[hf] = arr.T if transpose else arr
    if cfg.has_vocab_map:
        tensors["d2t"] = np.asarray(drafter.d2t[...]).astype(np.int64)  # numpy: int64 even without jax x64
        tensors["t2d"] = np.asarray(drafter.t2d)
    if drafter.own_embedding:
        tensors["embed_tokens.weight"] = drafter.embed[...].astype(dtype)
    return _write(path, tensors, {**cfg.to_dict(), "torch_dtype": jnp.dtype(dtype).name})


def save_target(target, path, *, dtype="float32", tokenizer=None) -> Path:
    """Writes a Hugging Face checkpoint (``config.json``, ``model.safetensors`` with
    ``LlamaForCausalLM`` names, and the tokenizer when given) that both
    :func:`load_target` and transformers load.  Llama-architecture targets only."""
    from eagle3_jax.models.target import param_shapes

    cfg = target.config
    if cfg.family != "llama" or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm:
        raise ValueError(f"save_target writes plain Llama checkpoints; this target is {cfg.family!r}")
    dtype = resolve_dtype(dtype)
    tensors = {}
    for name, shape in param_shapes(cfg).items():
        if shape is None:
            continue
        value = getattr(target, name)[...].astype(dtype)
        if name in _TARGET_TOP_NAMES:
            hf, transpose = _TARGET_TOP_NAMES[name]
            tensors[hf] = value.T if transpose else value
        else:
            hf, transpose = _TARGET_LAYER_NAMES[name]
            for i in range(cfg.num_layers):
                tensors[f"model.layers.{i}.{hf}"] = value[i].T if transpose else value[i]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": jnp.dtype(dtype).name,
    }
    path = _write(path, tensors, config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def _write(path, tensors: dict, config: dict) -> Path:
    """``model.safetensors`` (written atomically: never a half-written checkpoint) + ``config.json``."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "model.safetensors.tmp"
    save_file({k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
