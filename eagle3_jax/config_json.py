"""Reading Hugging Face / EAGLE-3 / speculators ``config.json`` files into the fields of
``eagle3_jax.config``'s frozen configs (``TargetConfig.from_dict`` and
``DrafterConfig.from_dict`` build them from these).

Both the transformers-5 ``rope_parameters`` block and the older ``rope_theta`` /
``rope_scaling`` keys are understood.  Anything we cannot compute exactly raises a
``ValueError`` naming the file and key, never a silently different model.  Every value
is type-checked before anything is sized from it: integers must be JSON integers (not
booleans, floats or strings) within their ranges in ``eagle3_jax.limits`` (``VOCAB_SIZE``,
``WIDTH``, ``HEAD_DIM``, ``HEADS``, ``LAYERS``, ``POSITIONS``: far above any released model),
floats finite and positive, flags JSON booleans.  Drafters of other speculative heads
(EAGLE-1/2, multi-token prediction) offered as EAGLE-3 are refused by name.
"""

from __future__ import annotations

import json
import reprlib
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_jax import limits

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DRAFTER_LAYER_FAMILIES = limits.DRAFTER_FAMILY.choices  # ("llama", "qwen3")
SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
MAX_CONFIG_BYTES = 16 << 20

_REQUIRED = object()


def _show(value) -> str:
    return reprlib.repr(value)


def _lookup(dicts, key: str, source: str, default):
    """``(value, name)`` of ``key`` in the first of ``dicts`` (``(prefix, dict)`` pairs) that
    sets it to a non-null value; ``default`` when none does (``ValueError`` if required)."""
    for prefix, d in dicts:
        if d.get(key) is not None:
            return d[key], prefix + key
    if default is _REQUIRED:
        raise ValueError(f"{source}: missing required key " + " or ".join(repr(p + key) for p, _ in dicts))
    return default, dicts[0][0] + key


def _int(d: dict, key: str, source: str, default=_REQUIRED, *, rng: limits.Range = limits.WIDTH,
         hi_name: str = "", dicts=None) -> int | None:
    """A JSON integer within ``rng`` (a range of limits' table, its bounds included; ``hi_name``:
    how the message names its upper bound)."""
    value, name = _lookup(dicts or [("", d)], key, source, default)
    if value is None and default is None:
        return None
    checked, error = limits.problem(value, rng)
    if isinstance(error, TypeError):
        raise ValueError(f"{source}: key {name!r} must be an integer, got {_show(value)}")
    if error:
        raise ValueError(f"{source}: key {name!r} = {value} is outside [{rng.lo}, {hi_name or rng.hi}]")
    return checked


def _float(d: dict, key: str, source: str, default=_REQUIRED, *, dicts=None) -> float:
    """A finite, strictly positive number (``limits.POSITIVE_FLOAT``)."""
    value, name = _lookup(dicts or [("", d)], key, source, default)
    checked, error = limits.problem(value, limits.POSITIVE_FLOAT)
    if isinstance(error, TypeError):
        raise ValueError(f"{source}: key {name!r} must be a number, got {_show(value)}")
    if error:
        raise ValueError(f"{source}: key {name!r} = {value} must be finite and positive")
    return checked


def _typed(d: dict, key: str, source: str, kind: type, what: str, default):
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ValueError(f"{source}: key {key!r} must be {what}, got {_show(value)}")
    return value


def _bool(d: dict, key: str, source: str, default: bool) -> bool:
    return _typed(d, key, source, bool, "true or false", default)


def _dict(d: dict, key: str, source: str) -> dict:
    return _typed(d, key, source, dict, "an object", {})


def _str(d: dict, key: str, source: str, default: str | None) -> str | None:
    return _typed(d, key, source, str, "a string", default)


def layer_ids(value, what: str, num_layers: int = limits.LAYERS.hi, exc=ValueError, note: str = "", count: int | None = 3):
    """``count`` (``None``: one or more) distinct decoder-layer ids in ``[0, num_layers)``
    (``exc`` for a value of the wrong type)."""
    n = "three" if count == 3 else "one or more"
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) != (count or len(value)) or not len(value) or any(
            isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in value):
        raise exc(f"{what}={_show(value)}: need {n} integer decoder-layer ids")
    ids = tuple(int(i) for i in value)
    if any(not 0 <= i < num_layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{what}={list(ids)}: need {n} distinct decoder-layer ids in [0, {num_layers}){note}")
    return ids


def rope_fields(d: dict[str, Any], source: str, default_theta: float = 10000.0) -> dict[str, Any]:
    """RoPE settings (``RopeConfig``'s fields) from a config dict (transformers 5 or older layout)."""
    params, scaling = _dict(d, "rope_parameters", source), _dict(d, "rope_scaling", source)
    dicts = [("rope_parameters.", params), ("rope_scaling.", scaling), ("", d)]
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"{source}: unsupported rope type {_show(rope_type)} (supported: default, linear, llama3)")
    kw: dict[str, Any] = {"theta": _float(d, "rope_theta", source, default_theta, dicts=dicts), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        kw["factor"] = _float(d, "factor", source, dicts=dicts[:2])
    if rope_type == "llama3":
        kw["low_freq_factor"] = _float(d, "low_freq_factor", source, dicts=dicts[:2])
        kw["high_freq_factor"] = _float(d, "high_freq_factor", source, dicts=dicts[:2])
        if kw["high_freq_factor"] <= kw["low_freq_factor"]:
            raise ValueError(f"{source}: rope high_freq_factor={kw['high_freq_factor']} must exceed "
                             f"low_freq_factor={kw['low_freq_factor']}")
        kw["original_max_position_embeddings"] = _int(d, "original_max_position_embeddings", source,
                                                      rng=limits.POSITIONS, dicts=dicts[:2])
    return kw


def _decoder_dims(d: dict[str, Any], source: str, default_eps: float, default_max_pos: int) -> dict[str, Any]:
    """Sizes shared by targets and drafters, each type- and range-checked."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={_show(act)} is not supported (only silu)")
    hidden = _int(d, "hidden_size", source)
    heads = _int(d, "num_attention_heads", source, rng=limits.HEADS)
    kv_heads = _int(d, "num_key_value_heads", source, heads, rng=limits.HEADS)
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if d.get("head_dim") is None and hidden // heads < 2:
        raise ValueError(f"{source}: hidden_size={hidden} // num_attention_heads={heads} leaves no head_dim")
    head_dim = _int(d, "head_dim", source, hidden // heads, rng=limits.HEAD_DIM)
    if head_dim % 2:
        raise ValueError(f"{source}: head_dim={head_dim} must be even (rotary embeddings rotate pairs)")
    return dict(hidden_size=hidden, intermediate_size=_int(d, "intermediate_size", source), num_heads=heads,
                num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=_float(d, "rms_norm_eps", source, default_eps),
                max_position_embeddings=_int(d, "max_position_embeddings", source, default_max_pos, rng=limits.POSITIONS))


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's captured decoder-layer *inputs*: layers 2, L//2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)


def target_fields(d: dict[str, Any], source: str = "config.json", capture_layers=None) -> dict[str, Any]:
    """``TargetConfig``'s fields (``rope``: ``RopeConfig``'s) from a Hugging Face ``config.json``
    dict; ``ValueError`` naming ``source`` and the key for any missing, mistyped or
    out-of-range value."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
    family = d.get("model_type")
    if family not in FAMILIES:
        archs = d.get("architectures")
        raise ValueError(f"{source}: unknown model_type {_show(family)} (architectures={_show(archs)}); "
                         f"supported: {FAMILIES}")
    eos = d.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in eos):
        raise ValueError(f"{source}: key 'eos_token_id' must be a non-negative integer or a list of them, "
                         f"got {_show(d.get('eos_token_id'))}")
    window = None
    if family != "qwen2" or _bool(d, "use_sliding_window", source, False):
        window = _int(d, "sliding_window", source, None, rng=limits.POSITIONS)
    attention_bias = _bool(d, "attention_bias", source, False)
    num_layers = _int(d, "num_hidden_layers", source, rng=limits.LAYERS)
    if capture_layers is None:
        layer_ids(default_capture_layers(num_layers), f"{source}: num_hidden_layers={num_layers} gives the "
                  f"default capture_layers", num_layers, note=" (too shallow for EAGLE-3)")
    else:
        capture_layers = layer_ids(capture_layers, "capture_layers", num_layers, TypeError, count=None)
    dtype = _str(d, "torch_dtype", source, None) or _str(d, "dtype", source, None) or "float32"
    return dict(
        family=family,
        vocab_size=_int(d, "vocab_size", source, rng=limits.VOCAB_SIZE),
        num_layers=num_layers,
        **_decoder_dims(d, source, 1e-6, 4096),
        rope=rope_fields(d, source),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", source, False),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=_bool(d, "mlp_bias", source, False),
        qk_norm=family == "qwen3",
        sliding_window=window,
        capture_layers=capture_layers,
        eos_token_ids=tuple(eos),
        torch_dtype=dtype,
    )


# What ``transformer_layer_config`` means where a key is absent: speculators writes the
# layer config as transformers' ``to_diff_dict``, which leaves out every value equal to the
# class default (transformers 5: ``LlamaConfig()`` / ``Qwen3Config()``).
_LAYER_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, max_window_layers=28),
}
# Markers of speculative heads that are not EAGLE-3 (refused by name, never read as one).
_NOT_EAGLE3_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


def drafter_fields(d: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """``DrafterConfig``'s fields (``rope``: ``RopeConfig``'s) from an EAGLE-3 drafter
    ``config.json`` dict, official or speculators layout
    (``speculators_model_type``); ``ValueError`` naming ``source`` and the key for any
    missing, mistyped or out-of-range value, and for checkpoints of other speculative
    heads (EAGLE-1/2, MTP) offered as EAGLE-3."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
    _refuse_not_eagle3(d, source)
    if "speculators_model_type" in d:
        return _speculators_fields(d, source)
    vocab = _int(d, "vocab_size", source, rng=limits.VOCAB_SIZE)
    dims = _decoder_dims(d, source, 1e-6, 2048)
    layers = _dict(d, "eagle_config", source).get("eagle_aux_hidden_state_layer_ids")
    return dict(
        vocab_size=vocab,
        draft_vocab_size=_int(d, "draft_vocab_size", source, vocab, rng=limits.VOCAB_SIZE.at_most(vocab),
                              hi_name=f"vocab_size={vocab}"),
        **dims,
        # The drafter's own RoPE: an absent rope_theta means 10000, never the target's.
        rope=rope_fields(d, source, default_theta=10000.0),
        target_hidden_size=_int(d, "target_hidden_size", source, dims["hidden_size"]),
        capture_layers=None if layers is None else layer_ids(
            layers, f"{source}: key 'eagle_config.eagle_aux_hidden_state_layer_ids'"),
    )


def _speculators_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``speculators`` layout: the decoder in ``transformer_layer_config`` (its absent
    keys at transformers' class defaults), the switches and ids at the top level."""
    kind = d.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(f"{source}: key 'speculators_model_type' = {_show(kind)}: not an EAGLE-3 drafter "
                         f"(only 'eagle3' is read)")
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ValueError(f"{source}: key 'transformer_layer_config' must be an object, got {_show(tl)}")
    family = tl.get("model_type", "qwen3")  # speculators' default layer is Qwen3's
    if family not in DRAFTER_LAYER_FAMILIES:
        raise ValueError(f"{source}: key 'transformer_layer_config.model_type' = {_show(family)}: drafter layers "
                         f"of {DRAFTER_LAYER_FAMILIES} are read")
    tl = {**_LAYER_DEFAULTS[family], **{k: v for k, v in tl.items() if v is not None or k == "sliding_window"}}
    sub = f"{source}: transformer_layer_config"
    for key in ("attention_bias", "mlp_bias"):
        if _bool(tl, key, sub, False):
            raise ValueError(f"{source}: key 'transformer_layer_config.{key}' = true: drafter layers with biases "
                             f"are not supported")
    dims = _decoder_dims(tl, sub, 1e-6, tl["max_position_embeddings"])
    num_layers = _int(tl, "num_hidden_layers", sub, rng=limits.LAYERS)
    vocab = _int(tl, "vocab_size", sub, rng=limits.VOCAB_SIZE)
    window, types = None, None
    if family == "qwen3" and _bool(tl, "use_sliding_window", sub, False):
        window = _int(tl, "sliding_window", sub, 4096, rng=limits.POSITIONS)
    elif family == "llama" and tl.get("sliding_window") is not None:
        window = _int(tl, "sliding_window", sub, rng=limits.POSITIONS)
    raw_types = tl.get("layer_types")
    if raw_types is not None:
        if not isinstance(raw_types, list) or len(raw_types) != num_layers or any(
                t not in ("full_attention", "sliding_attention") for t in raw_types):
            raise ValueError(f"{source}: key 'transformer_layer_config.layer_types' = {_show(raw_types)}: need "
                             f"'full_attention' or 'sliding_attention' for each of the {num_layers} layers")
        types = tuple(raw_types)
    elif window is not None and family == "qwen3":
        first = _int(tl, "max_window_layers", sub, rng=limits.LAYERS.at_least(0))
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    if window is None and types is not None and "sliding_attention" in types:
        types = None  # speculators: a sliding layer without a window attends to everything
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    switches = {name: _bool(d, name, source, False) for name in SWITCHES}
    if switches["norm_before_fc"] and switches["fc_norm"]:
        raise ValueError(f"{source}: keys 'norm_before_fc' and 'fc_norm' are both true; speculators refuses the "
                         f"pair (one norm over the concatenated features, or one per captured layer)")
    return dict(
        vocab_size=vocab,
        draft_vocab_size=_int(d, "draft_vocab_size", source, 32000, rng=limits.VOCAB_SIZE.at_most(vocab),
                              hi_name=f"vocab_size={vocab}"),
        **{k: v for k, v in dims.items()},
        rope=rope_fields(tl, sub, default_theta=10000.0),
        target_hidden_size=_int(d, "target_hidden_size", source, dims["hidden_size"]),
        capture_layers=None if ids is None else layer_ids(
            ids, f"{source}: key 'eagle_aux_hidden_state_layer_ids'", count=None),
        num_layers=num_layers, layer_family=family, sliding_window=window, layer_types=types,
        layout="speculators", **switches,
    )


def _refuse_not_eagle3(d: dict[str, Any], source: str):
    """Refuses, naming the key, a config of another speculative head offered as EAGLE-3:
    EAGLE-1/2 (``architectures`` naming Eagle without Eagle3) or multi-token prediction."""
    kind = d.get("speculators_model_type")
    if kind is not None and kind != "eagle3":
        what = "multi-token prediction (MTP)" if "mtp" in str(kind).lower() else f"a {_show(kind)} speculator"
        raise ValueError(f"{source}: key 'speculators_model_type' = {_show(kind)}: {what}, not an EAGLE-3 drafter")
    archs = d.get("architectures") if isinstance(d.get("architectures"), list) else []
    for a in archs:
        if isinstance(a, str) and "mtp" in a.lower():
            raise ValueError(f"{source}: key 'architectures' = {_show(archs)}: a multi-token prediction (MTP) head, "
                             f"not an EAGLE-3 drafter")
        if isinstance(a, str) and "eagle" in a.lower() and "eagle3" not in a.lower():
            raise ValueError(f"{source}: key 'architectures' = {_show(archs)}: an EAGLE-1/EAGLE-2 drafter, not "
                             f"EAGLE-3 (its fc fuses [embedding ; one feature]; EAGLE-3 fuses several target layers)")
    for key in _NOT_EAGLE3_KEYS:
        if d.get(key):
            raise ValueError(f"{source}: key {key!r} = {_show(d[key])}: a multi-token prediction (MTP) checkpoint, "
                             f"not an EAGLE-3 drafter")


def read_config_json(path: str | Path) -> dict[str, Any]:
    """Reads ``PATH/config.json`` (or PATH itself if it is a file) with clear errors: the
    file must exist, hold at most ``MAX_CONFIG_BYTES`` of UTF-8 JSON, and be a JSON object."""
    path = Path(path)
    file = path if path.is_file() else path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file}: no config.json (is {path} a Hugging Face checkpoint directory?)")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{file}: {file.stat().st_size} bytes, more than a config.json can be ({MAX_CONFIG_BYTES})")
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{file}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw
