"""Frozen configs parsed from Hugging Face ``config.json`` files.

Both the transformers-5 ``rope_parameters`` block and the older ``rope_theta`` /
``rope_scaling`` keys are understood.  Anything we cannot compute exactly raises a
``ValueError`` naming the file and key, never a silently different model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


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
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", default_theta))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"{source}: unsupported rope type {rope_type!r} (supported: default, linear, llama3)")
    kw: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        kw["factor"] = float(merged["factor"])
    if rope_type == "llama3":
        kw["low_freq_factor"] = float(merged["low_freq_factor"])
        kw["high_freq_factor"] = float(merged["high_freq_factor"])
        kw["original_max_position_embeddings"] = int(merged["original_max_position_embeddings"])
    return RopeConfig(**kw)


def _decoder_dims(d: dict[str, Any], source: str, default_eps: float, default_max_pos: int) -> dict[str, Any]:
    """Sizes shared by targets and drafters (``KeyError`` on a missing required key)."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is not supported (only silu)")
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    return dict(hidden_size=hidden, intermediate_size=int(d["intermediate_size"]), num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", default_eps)),
                max_position_embeddings=int(d.get("max_position_embeddings", default_max_pos)))


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
    capture_layers: tuple[int, int, int] | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    def __post_init__(self):
        if self.capture_layers is None:
            object.__setattr__(self, "capture_layers", default_capture_layers(self.num_layers))
        layers = self.capture_layers
        if len(layers) != 3 or any(not 0 <= i < self.num_layers for i in layers) or len(set(layers)) != 3:
            raise ValueError(
                f"capture_layers={layers}: need three distinct decoder-layer ids in [0, {self.num_layers}) "
                f"(a target with {self.num_layers} layers is too shallow for EAGLE-3 if the defaults collide)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json", capture_layers=None) -> "TargetConfig":
        family = d.get("model_type")
        if family not in FAMILIES:
            archs = d.get("architectures")
            raise ValueError(f"{source}: unknown model_type {family!r} (architectures={archs}); supported: {FAMILIES}")
        try:
            eos = d.get("eos_token_id")
            eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
            window = d.get("sliding_window")
            if family == "qwen2" and not d.get("use_sliding_window", False):
                window = None
            return cls(
                family=family,
                vocab_size=int(d["vocab_size"]),
                num_layers=int(d["num_hidden_layers"]),
                **_decoder_dims(d, source, 1e-6, 4096),
                rope=parse_rope(d, source),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
                o_bias=family != "qwen2" and bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                qk_norm=family == "qwen3",
                sliding_window=None if window is None else int(window),
                capture_layers=tuple(capture_layers) if capture_layers is not None else None,
                eos_token_ids=eos,
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required key {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """An EAGLE-3 drafter: ``fc`` fusion plus one decoder layer over ``[embed ; hidden]``."""

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
    capture_layers: tuple[int, int, int] | None = None
    max_position_embeddings: int = 2048

    @property
    def has_vocab_map(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        try:
            vocab = int(d["vocab_size"])
            dims = _decoder_dims(d, source, 1e-6, 2048)
            layers = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            return cls(
                vocab_size=vocab,
                draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
                **dims,
                # The drafter's own RoPE: an absent rope_theta means 10000, never the target's.
                rope=parse_rope(d, source, default_theta=10000.0),
                target_hidden_size=int(d.get("target_hidden_size") or dims["hidden_size"]),
                capture_layers=tuple(int(i) for i in layers) if layers else None,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required key {e.args[0]!r}") from None

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


def read_config_json(path: str | Path) -> dict[str, Any]:
    """Reads ``PATH/config.json`` (or PATH itself if it is a file) with clear errors."""
    path = Path(path)
    file = path if path.is_file() else path / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file}: no config.json (is {path} a Hugging Face checkpoint directory?)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
