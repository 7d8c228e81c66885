"""Loading: :func:`load_target` (Hugging Face Llama / Mistral / Qwen2 / Qwen3 directories)
and :func:`load_drafter` (official / SpecForge / vLLM / speculators EAGLE-3 drafters), each parameter
read as its model's declaration (``declare(cfg)``) says, and the pair validated."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.checkpoint.fetch import fetch_ids, fetch_param, fetch_sharded, fetch_weight, param_shardings, replicated
from eagle3_jax.checkpoint.formats import DTYPES, resolve_dtype
from eagle3_jax.checkpoint.sources import open_weights
from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json
from eagle3_jax.layers import ATTENTION_IMPLS
from eagle3_jax.models import drafter as drafter_mod, target as target_mod
from eagle3_jax.models.drafter import Drafter
from eagle3_jax.models.target import Target


def load_target(path, *, dtype=None, capture_layers=None, attention_impl: str = "xla",
                shardings: dict[str, jax.sharding.Sharding] | None = None, mesh=None, rules=None):
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
      shardings: optional ``{parameter: Sharding}``; those parameters are built from
        per-device blocks as with ``mesh``.
      mesh: a ``jax.sharding.Mesh``: every parameter is sharded by its declared logical axes
        (:func:`eagle3_jax.models.target.declare`) and ``rules`` (entries over
        ``eagle3_jax.sharding.RULES``), each global array assembled from per-device blocks
        read straight from the safetensors files (stacked layers one layer at a time), so no
        host or device holds more than its share plus one block in flight.  A dimension the
        mesh cannot split raises before anything is read.  Without a mesh (and without
        ``shardings``) every tensor goes to the default device.
      rules: logical-axis rules overriding ``eagle3_jax.sharding.RULES`` (with ``mesh``).

    Returns:
      A :class:`~eagle3_jax.models.target.Target`.
    """
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={attention_impl!r}: expected one of {ATTENTION_IMPLS}")
    path = Path(path)
    raw = read_config_json(path)
    cfg = TargetConfig.from_dict(raw, source=str(path / "config.json"), capture_layers=capture_layers)
    if dtype is None and cfg.torch_dtype not in DTYPES:
        raise ValueError(f"{path / 'config.json'}: key 'torch_dtype' = {cfg.torch_dtype!r} is not one of "
                         f"{sorted(DTYPES)}; pass dtype= to choose one")
    dtype = resolve_dtype(dtype, cfg.torch_dtype)
    decl = target_mod.declare(cfg)
    mesh, shardings = param_shardings(decl, path, mesh, rules, shardings)
    source = open_weights(path)
    model = nnx.eval_shape(lambda: Target(cfg, dtype=dtype, attention_impl=attention_impl))
    for name, info in decl.present():
        getattr(model, name).set_value(fetch_param(source, info, decl.dtype_of(name, dtype), shardings.get(name)))
    model.inv_freq.set_value(replicated(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)), mesh))
    return model


def read_target_embedding(path):
    """The embedding table of the Hugging Face target directory ``path`` (a numpy array),
    read alone: what a drafter without its own shares, without loading the target."""
    path = Path(path)
    tcfg = TargetConfig.from_dict(read_config_json(path), source=str(path / "config.json"))
    return open_weights(path).get(target_mod.declare(tcfg).params["embed"].checkpoint)


class _Renamed:
    """Accepts exports that prefix names with ``model.`` or call the layer ``layers.0``
    (two stored names for one tensor are refused)."""

    def __init__(self, source):
        self.source = source
        self.alias = {}
        for name in source.names():
            canon = name[len("model."):] if name.startswith("model.") else name
            canon = canon.replace("layers.0.", "midlayer.", 1) if canon.startswith("layers.0.") else canon
            if canon in self.alias:
                raise ValueError(f"{source.path_of(name)}: tensors {self.alias[canon]!r} and {name!r} "
                                 f"both name {canon!r}")
            self.alias[canon] = name

    def names(self):
        return self.alias.keys()

    def path_of(self, name):  # a name not stored raises the source's "missing tensor" error
        return self.source.path_of(self.alias.get(name, name))

    def shape(self, name):
        return self.source.shape(self.alias.get(name, name))

    def get(self, name):
        return self.source.get(self.alias.get(name, name))

    def read(self, name, index):
        return self.source.read(self.alias.get(name, name), index)


def load_drafter(path, *, target=None, embed=None, dtype=None, mesh=None, rules=None):
    """Loads an EAGLE-3 drafter checkpoint directory.

    Reads the official release layout (``config.json`` + ``pytorch_model.bin``, read
    without torch) and safetensors exports (SpecForge / SGLang / vLLM
    ``LlamaForCausalLMEagle3``), and vLLM's ``speculators`` layout
    (``speculators_model_type: "eagle3"``: any number of Llama or Qwen3 layers, sliding-window
    layers, any number of captured layers and its four norm switches; see
    :class:`~eagle3_jax.config.DrafterConfig`).  The drafter shares ``target``'s embedding
    (frozen) unless the checkpoint carries ``embed_tokens.weight``; pass ``embed`` instead
    of a target to give the table directly.  The pair is validated: hidden sizes, vocab
    size, ``d2t`` range and ``t2d`` consistency, captured-layer ids.  Refused, each naming
    the key or tensor: EAGLE-1/2 and MTP checkpoints, a drafter whose vocabularies differ
    without ``d2t``, captured-layer ids outside the target's layers or inconsistent with
    the width of ``fc.weight``.

    ``mesh`` / ``rules``: as in :func:`load_target` (parameters sharded by their declared
    logical axes, :func:`eagle3_jax.models.drafter.declare`, and built from per-device
    blocks; the shared embedding placed on its declared sharding; the vocabulary map and
    rotary frequencies replicated).
    """
    if target is not None and not isinstance(target, Target):
        raise TypeError(f"target: expected a loaded Target (eagle3_jax.load_target(...)), got {type(target).__name__} "
                        f"{target!r}")
    path = Path(path)
    raw = read_config_json(path)
    cfg = DrafterConfig.from_dict(raw, source=str(path / "config.json"))
    decl = drafter_mod.declare(cfg)
    mesh, shardings = param_shardings(decl, path, mesh, rules, None)
    source = _Renamed(open_weights(path))
    _check_fc(cfg, source, path)
    dtype = resolve_dtype(dtype, "float32" if target is None else jnp.dtype(target.dtype).name)
    if target is not None:
        _check_pair(cfg, target.config, path)
    embed_info = decl.params["embed"]
    own = embed_info.checkpoint in source.names()
    if own:
        embed = (fetch_sharded(source, embed_info, dtype, shardings["embed"]) if mesh is not None
                 else fetch_weight(source, embed_info.checkpoint, embed_info.shape, False, dtype))
    elif target is not None:
        embed = target.embed[...]
    elif embed is None:
        raise ValueError(f"{path}: the checkpoint has no {embed_info.checkpoint}; pass target= (or embed=) to share "
                         f"the target's")
    if tuple(jnp.shape(embed)) != embed_info.shape:
        raise ValueError(f"{path}: embedding shape {tuple(jnp.shape(embed))} does not match the drafter's "
                         f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})")

    d2t = None
    if cfg.has_vocab_map:
        if "d2t" not in source.names():
            raise ValueError(f"{path}: no tensor 'd2t', but key 'draft_vocab_size' = {cfg.draft_vocab_size} differs "
                             f"from vocab_size {cfg.vocab_size}: without the draft-to-target map the draft ids "
                             f"cannot be read as target ids")
        d2t = fetch_ids(source, "d2t", cfg.draft_vocab_size, "iu").astype(np.int64)
        t2d = fetch_ids(source, "t2d", cfg.vocab_size, "biu") if "t2d" in source.names() else None
        _check_vocab_map(d2t, t2d, cfg, path)
    model = nnx.eval_shape(lambda: Drafter(cfg, jnp.zeros(embed_info.shape), dtype=dtype))
    for name, info in decl.present():
        if info.frozen:
            continue
        getattr(model, name).set_value(fetch_param(source, info, decl.dtype_of(name, dtype), shardings.get(name)))
    embed = jnp.asarray(embed, dtype)
    model.embed.set_value(embed if mesh is None else jax.device_put(embed, shardings["embed"]))
    model.d2t.set_value(replicated(jnp.zeros((cfg.draft_vocab_size,), jnp.int32) if d2t is None
                                    else jnp.asarray(d2t, jnp.int32), mesh))
    model.inv_freq.set_value(replicated(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)), mesh))
    model.own_embedding = own
    return model


def _ids_key(cfg: DrafterConfig) -> str:
    """The config key of the captured-layer ids in ``cfg``'s layout."""
    return "eagle_aux_hidden_state_layer_ids" if cfg.layout == "speculators" else "eagle_config.eagle_aux_hidden_state_layer_ids"


def _check_fc(cfg: DrafterConfig, source, path: Path):
    """``fc.weight``'s input width against the configuration, from the file header: an
    EAGLE-1/2 head (``fc`` over ``[embedding ; feature]``, no ``hidden_norm``) or ids that do
    not match the width are refused by name."""
    if "fc.weight" not in source.names():
        return  # the missing-tensor error comes with the weights
    shape = tuple(source.shape("fc.weight"))
    if len(shape) != 2 or shape[0] != cfg.hidden_size or shape[1] == cfg.fused_width:
        return  # as declared, or misshaped otherwise: the shape check names it
    width = shape[1]
    if width == 2 * cfg.hidden_size and "midlayer.hidden_norm.weight" not in source.names():
        raise ValueError(f"{source.path_of('fc.weight')}: tensor 'fc.weight' takes {width} = 2 x hidden_size inputs "
                         f"and there is no hidden_norm: an EAGLE-1/EAGLE-2 drafter, not EAGLE-3")
    if width % cfg.target_hidden_size == 0 and (cfg.capture_layers is not None or cfg.layout == "speculators"):
        raise ValueError(f"{path / 'config.json'}: key {_ids_key(cfg)!r} gives {cfg.num_captured} captured layers "
                         f"({list(cfg.capture_layers) if cfg.capture_layers else 'none given: 3'}), but tensor "
                         f"'fc.weight' takes {width // cfg.target_hidden_size} x target_hidden_size "
                         f"({cfg.target_hidden_size}) = {width} inputs")


def _check_pair(cfg: DrafterConfig, tcfg: TargetConfig, path: Path):
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(f"{path}: drafter expects target hidden size {cfg.target_hidden_size} "
                         f"(fc takes {cfg.fused_width}), the target has {tcfg.hidden_size}")
    if cfg.capture_layers is None and cfg.num_captured != len(tcfg.capture_layers):
        raise ValueError(f"{path}: drafter fuses {cfg.num_captured} captured layers (fc takes {cfg.fused_width}), "
                         f"the target captures {len(tcfg.capture_layers)} ({list(tcfg.capture_layers)})")
    if cfg.capture_layers is not None and max(cfg.capture_layers) >= tcfg.num_layers:
        raise ValueError(f"{path / 'config.json'}: key {_ids_key(cfg)!r} = {list(cfg.capture_layers)} names layers "
                         f"outside the target's {tcfg.num_layers} decoder layers [0, {tcfg.num_layers}) (ids are "
                         f"the inputs of decoder layers; the final layer's output is not captured)")
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
