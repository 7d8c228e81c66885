"""A checkpoint directory described for people (``eagle3-jax info``): what it holds, read
from its ``config.json``, and its weight and config files."""

from __future__ import annotations

from pathlib import Path

from eagle3_jax.checkpoint.formats import is_drafter_config
from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json


def describe_checkpoint(path: Path) -> dict:
    """A JSON-able description of a target or drafter checkpoint directory."""
    raw = read_config_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{Path(path) / 'config.json'}: expected a JSON object, got a {type(raw).__name__}")
    files = sorted(p.name for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    if is_drafter_config(raw):
        cfg = DrafterConfig.from_dict(raw, source=str(Path(path) / "config.json"))
        return {
            "kind": "EAGLE-3 drafter",
            "architectures": raw.get("architectures"),
            "hidden_size": cfg.hidden_size,
            "layout": cfg.layout,
            "layers": f"{cfg.num_layers} {cfg.layer_family}",
            "switches": [n for n in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
                         if getattr(cfg, n)] or "none",
            "fc_in_features": cfg.fused_width,
            "target_hidden_size": cfg.target_hidden_size,
            "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size,
            "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
            "rope": {"theta": cfg.rope.theta, "type": cfg.rope.rope_type},
            "capture_layers": list(cfg.capture_layers) if cfg.capture_layers else "target default (2, L//2, L-3)",
            "dtype": raw.get("torch_dtype") or raw.get("dtype"),
            "files": files,
        }
    cfg = TargetConfig.from_dict(raw, source=str(Path(path) / "config.json"))
    return {
        "kind": "target",
        "family": cfg.family,
        "architectures": raw.get("architectures"),
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
        "vocab_size": cfg.vocab_size,
        "rope": {"theta": cfg.rope.theta, "type": cfg.rope.rope_type},
        "tied_embeddings": cfg.tie_word_embeddings,
        "capture_layers": list(cfg.capture_layers),
        "feature_width": cfg.feature_width,
        "dtype": cfg.torch_dtype,
        "files": files,
    }
