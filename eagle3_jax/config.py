"""Frozen configs parsed from Hugging Face ``config.json`` files.

Both the transformers-5 ``rope_parameters`` block and the older ``rope_theta`` /
``rope_scaling`` keys are understood.  Anything we cannot compute exactly raises a
``ValueError`` naming the file and key, never a silently different model.  Every value
is type-checked before anything is sized from it: integers must be JSON integers (not
booleans, floats or strings) within the bounds below, floats finite and positive,
flags JSON booleans.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Upper bounds on config sizes, far above any released model, so that a corrupt or
# hostile config.json cannot make us allocate before the weights are checked.
MAX_VOCAB = 1 << 24
MAX_WIDTH = 1 << 20  # hidden_size, intermediate_size, target_hidden_size
MAX_HEAD_DIM = 4096
MAX_HEADS = 4096
MAX_LAYERS = 4096
MAX_POSITIONS = (1 << 31) - 1
MAX_CONFIG_BYTES = 16 << 20

_REQUIRED = object()


def host_scalar(value):
    """A 0-d numpy or JAX array as its numpy scalar (``np.array(5)``, ``jnp.int32(5)`` and
    ``np.int32(5)`` read alike); anything else as it is."""
    if isinstance(value, np.generic) or not hasattr(value, "__array__"):
        return value  # numpy scalars (a prompt's ids, often) and plain Python values: no conversion
    return np.asarray(value)[()] if np.ndim(value) == 0 else value


def integer(value) -> int | None:
    """``value`` as an ``int`` when it is an integer argument (a Python or numpy integer, or a
    0-d array of one; not a bool), else ``None``."""
    value = host_scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


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


def _int(d: dict, key: str, source: str, default=_REQUIRED, *, lo: int = 1, hi: int = MAX_WIDTH,
         hi_name: str = "", dicts=None) -> int | None:
    value, name = _lookup(dicts or [("", d)], key, source, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: key {name!r} must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise ValueError(f"{source}: key {name!r} = {value} is outside [{lo}, {hi_name or hi}]")
    return value


def _float(d: dict, key: str, source: str, default=_REQUIRED, *, dicts=None) -> float:
    """A finite, strictly positive number."""
    value, name = _lookup(dicts or [("", d)], key, source, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{source}: key {name!r} must be a number, got {_show(value)}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{source}: key {name!r} = {value} must be finite and positive")
    return float(value)


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


def _layer_ids(value, what: str, num_layers: int = MAX_LAYERS, exc=ValueError, note: str = "", count: int | None = 3):
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


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (``default``, ``linear`` or ``llama3`` scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies ``[head_dim // 2]`` in float32, as transformers computes them."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
        if self.rope_type == "linear":
            inv = inv / self.factor
        elif self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)


def parse_rope(d: dict[str, Any], source: str, default_theta: float = 10000.0) -> RopeConfig:
    """Reads RoPE settings from a config dict (transformers 5 or older layout)."""
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
                                                      hi=MAX_POSITIONS, dicts=dicts[:2])
    return RopeConfig(**kw)


def _decoder_dims(d: dict[str, Any], source: str, default_eps: float, default_max_pos: int) -> dict[str, Any]:
    """Sizes shared by targets and drafters, each type- and range-checked."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={_show(act)} is not supported (only silu)")
    hidden = _int(d, "hidden_size", source)
    heads = _int(d, "num_attention_heads", source, hi=MAX_HEADS)
    kv_heads = _int(d, "num_key_value_heads", source, heads, hi=MAX_HEADS)
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if d.get("head_dim") is None and hidden // heads < 2:
        raise ValueError(f"{source}: hidden_size={hidden} // num_attention_heads={heads} leaves no head_dim")
    head_dim = _int(d, "head_dim", source, hidden // heads, lo=2, hi=MAX_HEAD_DIM)
    if head_dim % 2:
        raise ValueError(f"{source}: head_dim={head_dim} must be even (rotary embeddings rotate pairs)")
    return dict(hidden_size=hidden, intermediate_size=_int(d, "intermediate_size", source), num_heads=heads,
                num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=_float(d, "rms_norm_eps", source, default_eps),
                max_position_embeddings=_int(d, "max_position_embeddings", source, default_max_pos, hi=MAX_POSITIONS))


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's captured decoder-layer *inputs*: layers 2, L//2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, Qwen3)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    capture_layers: tuple[int, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @property
    def feature_width(self) -> int:
        """Width of the EAGLE-3 features: the captured layers' inputs side by side."""
        return len(self.capture_layers) * self.hidden_size

    def __post_init__(self):
        layers = default_capture_layers(self.num_layers) if self.capture_layers is None else self.capture_layers
        shallow = f" (a target with {self.num_layers} layers is too shallow for EAGLE-3 if the defaults collide)"
        layers = _layer_ids(layers, "capture_layers", self.num_layers, TypeError, shallow, count=None)
        object.__setattr__(self, "capture_layers", layers)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json", capture_layers=None) -> "TargetConfig":
        """Parses a Hugging Face ``config.json`` dict; ``ValueError`` naming ``source`` and the key
        for any missing, mistyped or out-of-range value."""
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
            window = _int(d, "sliding_window", source, None, hi=MAX_POSITIONS)
        attention_bias = _bool(d, "attention_bias", source, False)
        num_layers = _int(d, "num_hidden_layers", source, hi=MAX_LAYERS)
        if capture_layers is None:
            _layer_ids(default_capture_layers(num_layers), f"{source}: num_hidden_layers={num_layers} gives the "
                       f"default capture_layers", num_layers, note=" (too shallow for EAGLE-3)")
        else:
            capture_layers = _layer_ids(capture_layers, "capture_layers", num_layers, TypeError, count=None)
        dtype = _str(d, "torch_dtype", source, None) or _str(d, "dtype", source, None) or "float32"
        return cls(
            family=family,
            vocab_size=_int(d, "vocab_size", source, hi=MAX_VOCAB),
            num_layers=num_layers,
            **_decoder_dims(d, source, 1e-6, 4096),
            rope=parse_rope(d, source),
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


# Drafter checkpoint layouts: the official EAGLE-3 / SpecForge / SGLang / vLLM-Llama one, and
# vLLM's ``speculators`` library's (``speculators_model_type: "eagle3"``).
LAYOUTS = ("official", "speculators")
DRAFTER_LAYER_FAMILIES = ("llama", "qwen3")
SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

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


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """An EAGLE-3 drafter: ``fc`` fusion of the captured target features, then
    ``num_layers`` decoder layers, the first over ``[embed ; hidden]``.

    The official EAGLE-3 drafter is the default: one Llama layer, three captured layers,
    every switch off.  vLLM's ``speculators`` checkpoints add (``layout="speculators"``):
    ``num_layers`` ≥ 1, Qwen3 layers (``layer_family="qwen3"``: q/k RMSNorm), sliding-window
    layers (``layer_types`` / ``sliding_window``), any number of captured layers, and four
    switches: ``norm_before_residual`` (the first layer's residual is the normed hidden),
    ``norm_before_fc`` (one RMSNorm over the concatenated features before ``fc``),
    ``fc_norm`` (an RMSNorm per captured layer before the concatenation) and ``norm_output``
    (the final norm applied to the output hidden, which is fed back across draft steps).
    ``layout`` is the layout the configuration was read from (what ``save_drafter`` writes
    by default)."""

    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    target_hidden_size: int
    capture_layers: tuple[int, ...] | None = None
    max_position_embeddings: int = 2048
    num_layers: int = 1
    layer_family: str = "llama"
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    layout: str = "official"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: expected one of {LAYOUTS}")
        if self.layer_family not in DRAFTER_LAYER_FAMILIES:
            raise ValueError(f"layer_family={self.layer_family!r}: expected one of {DRAFTER_LAYER_FAMILIES}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or not 1 <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers={self.num_layers!r}: expected an integer in [1, {MAX_LAYERS}]")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}: expected True or False")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm: mutually exclusive (one norm over the concatenated "
                             "features, or one per captured layer), as in speculators")
        if self.capture_layers is not None:
            object.__setattr__(self, "capture_layers", _layer_ids(self.capture_layers, "capture_layers", count=None))
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_layers or any(t not in ("full_attention", "sliding_attention") for t in types):
                raise ValueError(f"layer_types={_show(self.layer_types)}: need one of 'full_attention' / "
                                 f"'sliding_attention' per layer ({self.num_layers})")
            object.__setattr__(self, "layer_types", types)
        if self.fused_width == self.hidden_size:
            raise ValueError(f"{self.num_captured} captured layers of width {self.target_hidden_size} make the fused "
                             f"features as wide as the drafter's hidden ({self.hidden_size}): the two inputs of a "
                             f"draft step could not be told apart")

    @property
    def has_vocab_map(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def num_captured(self) -> int:
        """How many target layers the features concatenate (three unless ``capture_layers`` says)."""
        return 3 if self.capture_layers is None else len(self.capture_layers)

    @property
    def fused_width(self) -> int:
        """Width of the target features ``fc`` takes: ``num_captured × target_hidden_size``."""
        return self.num_captured * self.target_hidden_size

    @property
    def qk_norm(self) -> bool:
        """Qwen3 layers: RMSNorm over each query and key head before RoPE."""
        return self.layer_family == "qwen3"

    def window(self, layer: int) -> int | None:
        """The attention window of decoder layer ``layer`` (``None``: full attention)."""
        sliding = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @property
    def is_official(self) -> bool:
        """Whether the official layout can hold this drafter: one Llama layer, three captured
        layers, full attention, every switch off."""
        return (self.num_layers == 1 and self.layer_family == "llama" and self.num_captured == 3
                and self.window(0) is None and not any(getattr(self, n) for n in SWITCHES))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        """Parses an EAGLE-3 drafter ``config.json`` dict, official or speculators layout
        (``speculators_model_type``); ``ValueError`` naming ``source`` and the key for any
        missing, mistyped or out-of-range value, and for checkpoints of other speculative
        heads (EAGLE-1/2, MTP) offered as EAGLE-3."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        _refuse_not_eagle3(d, source)
        if "speculators_model_type" in d:
            return cls._from_speculators(d, source)
        vocab = _int(d, "vocab_size", source, hi=MAX_VOCAB)
        dims = _decoder_dims(d, source, 1e-6, 2048)
        layers = _dict(d, "eagle_config", source).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            vocab_size=vocab,
            draft_vocab_size=_int(d, "draft_vocab_size", source, vocab, hi=vocab, hi_name=f"vocab_size={vocab}"),
            **dims,
            # The drafter's own RoPE: an absent rope_theta means 10000, never the target's.
            rope=parse_rope(d, source, default_theta=10000.0),
            target_hidden_size=_int(d, "target_hidden_size", source, dims["hidden_size"]),
            capture_layers=None if layers is None else _layer_ids(
                layers, f"{source}: key 'eagle_config.eagle_aux_hidden_state_layer_ids'"),
        )

    @classmethod
    def _from_speculators(cls, d: dict[str, Any], source: str) -> "DrafterConfig":
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
        num_layers = _int(tl, "num_hidden_layers", sub, hi=MAX_LAYERS)
        vocab = _int(tl, "vocab_size", sub, hi=MAX_VOCAB)
        window, types = None, None
        if family == "qwen3" and _bool(tl, "use_sliding_window", sub, False):
            window = _int(tl, "sliding_window", sub, 4096, hi=MAX_POSITIONS)
        elif family == "llama" and tl.get("sliding_window") is not None:
            window = _int(tl, "sliding_window", sub, hi=MAX_POSITIONS)
        raw_types = tl.get("layer_types")
        if raw_types is not None:
            if not isinstance(raw_types, list) or len(raw_types) != num_layers or any(
                    t not in ("full_attention", "sliding_attention") for t in raw_types):
                raise ValueError(f"{source}: key 'transformer_layer_config.layer_types' = {_show(raw_types)}: need "
                                 f"'full_attention' or 'sliding_attention' for each of the {num_layers} layers")
            types = tuple(raw_types)
        elif window is not None and family == "qwen3":
            first = _int(tl, "max_window_layers", sub, lo=0, hi=MAX_LAYERS)
            types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
        if window is None and types is not None and "sliding_attention" in types:
            types = None  # speculators: a sliding layer without a window attends to everything
        ids = d.get("eagle_aux_hidden_state_layer_ids")
        switches = {name: _bool(d, name, source, False) for name in SWITCHES}
        if switches["norm_before_fc"] and switches["fc_norm"]:
            raise ValueError(f"{source}: keys 'norm_before_fc' and 'fc_norm' are both true; speculators refuses the "
                             f"pair (one norm over the concatenated features, or one per captured layer)")
        return cls(
            vocab_size=vocab,
            draft_vocab_size=_int(d, "draft_vocab_size", source, 32000, hi=vocab, hi_name=f"vocab_size={vocab}"),
            **{k: v for k, v in dims.items()},
            rope=parse_rope(tl, sub, default_theta=10000.0),
            target_hidden_size=_int(d, "target_hidden_size", source, dims["hidden_size"]),
            capture_layers=None if ids is None else _layer_ids(
                ids, f"{source}: key 'eagle_aux_hidden_state_layer_ids'", count=None),
            num_layers=num_layers, layer_family=family, sliding_window=window, layer_types=types,
            layout="speculators", **switches,
        )

    @classmethod
    def for_target(cls, tcfg: TargetConfig, draft_vocab_size: int, **options) -> "DrafterConfig":
        """A fresh drafter's configuration shaped after target ``tcfg`` (its sizes, RoPE and
        captured layers); ``options``: the other fields (``num_layers``, ``layer_family``, the
        switches).  Its layout is the official one where that can hold it, else speculators."""
        cfg = cls(vocab_size=tcfg.vocab_size, draft_vocab_size=draft_vocab_size, hidden_size=tcfg.hidden_size,
                  intermediate_size=tcfg.intermediate_size, num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads,
                  head_dim=tcfg.head_dim, rms_norm_eps=tcfg.rms_norm_eps, rope=tcfg.rope,
                  target_hidden_size=tcfg.hidden_size, capture_layers=tcfg.capture_layers,
                  max_position_embeddings=tcfg.max_position_embeddings, **options)
        return cfg if cfg.is_official else dataclasses.replace(cfg, layout="speculators")

    def to_dict(self) -> dict[str, Any]:
        """The official / SGLang / vLLM EAGLE-3 ``config.json`` for this drafter."""
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope.theta,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
        if self.rope.rope_type != "default":
            d["rope_scaling"] = {
                "rope_type": self.rope.rope_type,
                "factor": self.rope.factor,
                "low_freq_factor": self.rope.low_freq_factor,
                "high_freq_factor": self.rope.high_freq_factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
            }
        if self.capture_layers is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.capture_layers)}
        return d

    def to_speculators_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The ``config.json`` vLLM's ``speculators`` library writes for this drafter
        (``Eagle3SpeculatorConfig``): the decoder in ``transformer_layer_config`` with every
        key written out, the switches and captured-layer ids at the top level."""
        tl: dict[str, Any] = {
            "model_type": self.layer_family,
            "architectures": ["Qwen3ForCausalLM" if self.qk_norm else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta},
        }
        if self.rope.rope_type != "default":
            tl["rope_parameters"]["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            tl["rope_parameters"].update(low_freq_factor=self.rope.low_freq_factor,
                                         high_freq_factor=self.rope.high_freq_factor,
                                         original_max_position_embeddings=self.rope.original_max_position_embeddings)
        if not self.qk_norm:
            tl["mlp_bias"] = False
        if self.layer_types is not None:
            tl["layer_types"] = list(self.layer_types)
        if self.qk_norm:
            tl["use_sliding_window"] = self.sliding_window is not None
        tl["sliding_window"] = self.sliding_window
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": tl,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": None if self.capture_layers is None else list(self.capture_layers),
            **{name: getattr(self, name) for name in SWITCHES},
            "embed_requires_grad": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": []},
            },
            "torch_dtype": torch_dtype,
        }


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
