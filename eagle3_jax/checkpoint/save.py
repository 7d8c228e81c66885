"""Saving: :func:`save_drafter` (the official EAGLE-3 layout or vLLM's ``speculators`` one) and :func:`save_target` (a
Hugging Face Llama checkpoint), each written whole and atomically
(:func:`eagle3_jax.atomic.write_directory`) into a directory checked to hold nothing but
checkpoint files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError

from eagle3_jax.atomic import check_output_path, write_directory
from eagle3_jax.checkpoint.formats import DTYPES, resolve_dtype
from eagle3_jax.config import SWITCHES, read_config_json
from eagle3_jax.models import drafter as drafter_mod, target as target_mod
from eagle3_jax.models.drafter import Drafter
from eagle3_jax.models.target import Target


FORMATS = ("official", "speculators")


def save_drafter(drafter, path, *, dtype="float32", format: str | None = None, verifier=None) -> Path:
    """Writes ``config.json`` + ``model.safetensors`` in one of two layouts.

    ``format="official"``: the official EAGLE-3 layout (``fc.weight``, ``midlayer.*``,
    ``norm.weight``, ``lm_head.weight`` as PyTorch ``[out, in]`` in ``dtype``, ``d2t`` int64,
    ``t2d`` bool), read alike by the official EAGLE code, SGLang and vLLM.  It holds the
    official drafter only (one Llama layer, three captured layers, no switch); any other is
    refused naming the setting.

    As in the published EAGLE-3 configs, ``target_hidden_size`` is written only where it
    differs from ``hidden_size``: the official runtime takes the key to mean that the
    checkpoint brings its own embedding, and without it loads the target's
    ``model.embed_tokens.weight`` through the target's ``model.safetensors.index.json``
    (which :func:`save_target` writes).  So ``embed_tokens.weight`` is shipped when the
    drafter owns its embedding and whenever ``target_hidden_size`` is written.

    ``format="speculators"``: vLLM's ``speculators`` layout (``Eagle3SpeculatorConfig``'s
    ``config.json``, ``layers.{i}.*`` weights, ``embed_tokens.weight`` always, the switches'
    norms), which that library's ``from_pretrained`` and vLLM load; every drafter fits.

    ``verifier`` (speculators layout only): the target's Hugging Face id or directory,
    written as ``speculators_config.verifier`` (with the directory's ``architectures``);
    the library's ``from_pretrained`` reads the target's config from it, and vLLM may take it
    as the target.

    ``format=None``: the layout the drafter was read from (``config.layout``), or
    ``"speculators"`` where the official one cannot hold it.

    ``path`` is replaced whole and atomically, as described in :func:`save_target`.
    """
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter: expected an eagle3_jax Drafter (e.g. from load_drafter), got {type(drafter).__name__}")
    cfg = drafter.config
    if format is None:
        format = cfg.layout if cfg.is_official else "speculators"
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: expected one of {FORMATS}")
    dtype = _save_dtype(dtype)
    if verifier is not None and format != "speculators":
        raise ValueError(f"verifier={verifier!r}: only the speculators layout names its target (format={format!r})")
    if format == "official" and not cfg.is_official:
        raise ValueError(f"format='official': the official EAGLE-3 layout holds one Llama layer over three captured "
                         f"layers with no norm switch; this drafter has {_beyond_official(cfg)}; save it with "
                         f"format='speculators'")
    _check_output(path)
    if format == "official":
        config = {**cfg.to_dict(), "torch_dtype": jnp.dtype(dtype).name}
        if cfg.target_hidden_size == cfg.hidden_size:
            config.pop("target_hidden_size", None)
        ship_embed = drafter.own_embedding or "target_hidden_size" in config
    else:
        config, ship_embed = cfg.to_speculators_dict(jnp.dtype(dtype).name), True
        if verifier is not None:
            config["speculators_config"]["verifier"] = _verifier(verifier)
    tensors = {}
    for name, info in drafter_mod.declare(cfg).present():
        if name == "embed" and not ship_embed:
            continue
        value = getattr(drafter, name)[...].astype(dtype)
        for stored, block in zip(info.checkpoint_names(), list(value) if info.stacked else [value]):
            if format == "speculators" and stored.startswith("midlayer."):
                stored = "layers.0." + stored[len("midlayer."):]
            tensors[stored] = block.T if info.transpose else block
    if cfg.has_vocab_map:
        tensors["d2t"] = np.asarray(drafter.d2t[...]).astype(np.int64)  # numpy: int64 even without jax x64
        tensors["t2d"] = np.asarray(drafter.t2d)
    return write_checkpoint(path, tensors, {"config.json": config})


def _verifier(verifier) -> dict:
    """speculators' ``verifier`` entry for the target ``verifier`` (an id or a directory)."""
    if not isinstance(verifier, (str, os.PathLike)) or not os.fspath(verifier):
        raise TypeError(f"verifier: expected the target's id or directory (a path or string), got {verifier!r}")
    archs = []
    if Path(verifier).is_dir():
        found = read_config_json(verifier).get("architectures")
        archs = [a for a in found if isinstance(a, str)] if isinstance(found, list) else []
    return {"name_or_path": os.fspath(verifier), "architectures": archs}


def _beyond_official(cfg) -> str:
    """What the official layout cannot hold of drafter config ``cfg``, by setting."""
    what = [f"num_layers={cfg.num_layers}"] if cfg.num_layers != 1 else []
    what += [f"layer_family={cfg.layer_family!r}"] if cfg.layer_family != "llama" else []
    what += [f"{cfg.num_captured} captured layers"] if cfg.num_captured != 3 else []
    what += [f"sliding_window={cfg.sliding_window}"] if cfg.window(0) is not None else []
    return ", ".join(what + [f"{n}=True" for n in SWITCHES if getattr(cfg, n)])


def save_target(target, path, *, dtype="float32", tokenizer=None, generation_config: dict | None = None) -> Path:
    """Writes a Hugging Face checkpoint that :func:`load_target`, transformers and the
    official EAGLE runtime load: ``config.json``, ``model.safetensors`` with
    ``LlamaForCausalLM`` names, ``model.safetensors.index.json`` (for a single file too:
    the official runtime finds the embedding for a drafter without ``target_hidden_size``
    through it), and the tokenizer and ``generation_config.json`` when given.
    Llama-architecture targets only.

    Both savers write atomically: the checkpoint is assembled in a fresh directory beside
    ``path`` (``.NAME.tmp-*``), fsynced, and swapped in whole (one ``renameat2`` exchange
    on Linux; elsewhere rename aside, rename in, restore on failure).  ``path`` never holds
    a partial checkpoint, files of another layout (shards and their index,
    ``pytorch_model.bin``) go with the old directory, and on any failure the previous
    contents stay as they were.  A writer killed mid-swap may leave the previous version
    beside ``path`` (``.NAME.old-*``); the next save into ``path`` restores or removes
    such leftovers.  A ``path`` holding anything but checkpoint files (weights, indexes,
    configs, tokenizer files) is refused before any tensor is converted, naming the
    files.  Files get the mode a plain ``open`` gives (umask); a replaced directory keeps
    its mode.
    """
    if not isinstance(target, Target):
        raise TypeError(f"target: expected an eagle3_jax Target (e.g. from load_target), got {type(target).__name__}")
    cfg = target.config
    if cfg.family != "llama" or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm or cfg.sliding_window:
        raise ValueError(f"target: save_target writes plain Llama checkpoints; this target is {cfg.family!r}"
                         + (" with biases, q/k norms or a sliding window" if cfg.family == "llama" else ""))
    dtype = _save_dtype(dtype)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer: expected a transformers tokenizer (with save_pretrained), got {type(tokenizer).__name__}")
    if generation_config is not None:
        if not isinstance(generation_config, dict):
            raise TypeError(f"generation_config: expected a dict, got {type(generation_config).__name__}")
        try:
            json.dumps(generation_config)
        except (TypeError, ValueError) as e:
            raise TypeError(f"generation_config: not JSON-serialisable ({e})") from None
    _check_output(path)
    tensors = {}
    for name, info in target_mod.declare(cfg).present():
        value = getattr(target, name)[...].astype(dtype)
        blocks = list(value) if info.stacked else [value]
        for hf, block in zip(info.checkpoint_names(), blocks):
            tensors[hf] = block.T if info.transpose else block
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": jnp.dtype(dtype).name,
    }
    if cfg.rope.rope_type != "default":  # without it, transformers would rotate unscaled
        config["rope_scaling"] = {"rope_type": cfg.rope.rope_type, "factor": cfg.rope.factor}
        if cfg.rope.rope_type == "llama3":
            config["rope_scaling"].update(low_freq_factor=cfg.rope.low_freq_factor, high_freq_factor=cfg.rope.high_freq_factor,
                                          original_max_position_embeddings=cfg.rope.original_max_position_embeddings)
    files = {"config.json": config}
    if generation_config is not None:
        files["generation_config.json"] = generation_config
    return write_checkpoint(path, tensors, files, index=True,
                  extra=None if tokenizer is None else lambda d: tokenizer.save_pretrained(str(d)))


# The files a checkpoint directory may hold (our layout, sharded and torch layouts, tokenizer
# files): saving replaces them together; anything else in the directory makes a save refuse.
_CHECKPOINT_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "model.safetensors.tmp", "pytorch_model.bin", "pytorch_model.bin.index.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
    "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
}
_SHARD = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")


def _save_dtype(dtype):
    msg = f"dtype={dtype!r}: expected one of {sorted(DTYPES)}"
    try:
        resolved = resolve_dtype(dtype)
    except TypeError:
        raise TypeError(msg) from None
    except ValueError:
        raise ValueError(msg) from None
    if jnp.dtype(resolved).name not in DTYPES:
        raise ValueError(msg)
    return resolved


def _check_output(path) -> Path:
    """The export directory ``path`` (symlinks followed), checked before any work: a path,
    not a file, a writable existing ancestor, and no files other than checkpoint files."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise TypeError(f"path: expected a directory path (str or os.PathLike), got {type(path).__name__}")
    if not os.fspath(path):
        raise ValueError("path: empty; expected a directory path")
    path = Path(os.path.realpath(path))
    if path.parent == path:
        raise ValueError(f"path: {path} is the file-system root; cannot replace it")
    check_output_path(path, "path", directory=True)
    if path.is_dir():
        foreign = sorted(p.name for p in path.iterdir()
                         if not (p.is_file() and (p.name in _CHECKPOINT_FILES or _SHARD.fullmatch(p.name))))
        if foreign:
            raise FileExistsError(f"{path}: holds files that are not checkpoint files ({', '.join(foreign)}); saving "
                                  "replaces the directory whole, so move them away or save to another path")
    return path


def write_checkpoint(path, tensors: dict, jsons: dict[str, dict], *, index: bool = False, extra=None) -> Path:
    """Writes the checkpoint directory ``path`` whole and atomically
    (:func:`eagle3_jax.atomic.write_directory`): ``model.safetensors`` of ``tensors`` (+ its
    index), the ``jsons`` and whatever ``extra(dir)`` writes, every file given the mode of
    ``config.json`` (what ``open`` gives).  ``path`` is checked first (:func:`_check_output`);
    a failure is an ``OSError`` naming ``path`` and saying it was left as it was."""
    from safetensors.numpy import save_file

    given, path = Path(path), _check_output(path)

    def fill(tmp: Path):
        if extra is not None:
            extra(tmp)
        arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}
        save_file(arrays, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        files = jsons
        if index:
            files = {**jsons, "model.safetensors.index.json": {
                "metadata": {"total_size": sum(a.nbytes for a in arrays.values())},
                "weight_map": {k: "model.safetensors" for k in sorted(arrays)}}}
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        mode = (tmp / "config.json").stat().st_mode & 0o777  # what open() gave: umask applied
        for f in tmp.iterdir():
            os.chmod(f, mode)  # safetensors writes 0600

    try:
        write_directory(path, fill)
    except BaseException as e:
        if isinstance(e, SafetensorError):
            code = re.search(r"os error (\d+)", str(e))
            e = OSError(*((int(code.group(1)),) if code else ()), str(e))
        if isinstance(e, OSError):
            why = e.strerror or str(e)
            raise OSError(*((e.errno,) if e.errno else ()), f"{path}: writing the checkpoint failed ({why}); "
                          f"{path} was left as it was") from e
        raise
    return given
