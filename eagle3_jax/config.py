"""The frozen configs: RoPE (``RopeConfig``), the target (``TargetConfig``) and the EAGLE-3
drafter (``DrafterConfig``), each checked when made.

``TargetConfig.from_dict`` / ``DrafterConfig.from_dict`` read Hugging Face / EAGLE-3 /
speculators ``config.json`` dicts through ``eagle3_jax.config_json`` (which reads the file,
type- and range-checks every value and refuses drafters that are not EAGLE-3);
``DrafterConfig.to_dict`` / ``to_speculators_dict`` write them back.  ``read_config_json``,
``FAMILIES``, ``SWITCHES``, ``default_capture_layers`` (from ``config_json``) and
``host_scalar`` / ``integer`` (from ``limits``) are importable from here too.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any

import numpy as np

from eagle3_jax import limits
from eagle3_jax.config_json import (  # noqa: F401 - FAMILIES, read_config_json: re-exported
    DRAFTER_LAYER_FAMILIES, FAMILIES, SWITCHES, default_capture_layers, drafter_fields, layer_ids, read_config_json,
    rope_fields, target_fields)
from eagle3_jax.limits import host_scalar, integer  # noqa: F401 - re-exported: callers read them here too


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
    """Reads RoPE settings from a config dict (transformers 5 or older layout; ``config_json.rope_fields``)."""
    return RopeConfig(**rope_fields(d, source, default_theta))


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
        layers = layer_ids(layers, "capture_layers", self.num_layers, TypeError, shallow, count=None)
        object.__setattr__(self, "capture_layers", layers)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json", capture_layers=None) -> "TargetConfig":
        """Parses a Hugging Face ``config.json`` dict (``config_json.target_fields``); ``ValueError``
        naming ``source`` and the key for any missing, mistyped or out-of-range value."""
        fields = target_fields(d, source, capture_layers)
        return cls(**{**fields, "rope": RopeConfig(**fields["rope"])})


# Drafter checkpoint layouts: the official EAGLE-3 / SpecForge / SGLang / vLLM-Llama one, and
# vLLM's ``speculators`` library's (``speculators_model_type: "eagle3"``).
LAYOUTS = ("official", "speculators")


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
        num_layers, error = limits.problem(self.num_layers, limits.LAYERS)
        if error:
            raise ValueError(f"num_layers={self.num_layers!r}: expected an integer in [{limits.LAYERS.lo}, "
                             f"{limits.LAYERS.hi}]")
        object.__setattr__(self, "num_layers", num_layers)
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}: expected True or False")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm: mutually exclusive (one norm over the concatenated "
                             "features, or one per captured layer), as in speculators")
        if self.capture_layers is not None:
            object.__setattr__(self, "capture_layers", layer_ids(self.capture_layers, "capture_layers", count=None))
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_layers or any(t not in ("full_attention", "sliding_attention") for t in types):
                raise ValueError(f"layer_types={reprlib.repr(self.layer_types)}: need one of 'full_attention' / "
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
        (``speculators_model_type``; ``config_json.drafter_fields``); ``ValueError`` naming
        ``source`` and the key for any missing, mistyped or out-of-range value, and for
        checkpoints of other speculative heads (EAGLE-1/2, MTP) offered as EAGLE-3."""
        fields = drafter_fields(d, source)
        return cls(**{**fields, "rope": RopeConfig(**fields["rope"])})

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
