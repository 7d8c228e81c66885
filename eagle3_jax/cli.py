"""The ``eagle3-jax`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def describe_checkpoint(path: Path) -> dict:
    """A JSON-able description of a target or drafter checkpoint directory."""
    from eagle3_jax.checkpoint import is_drafter_config
    from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json

    raw = read_config_json(path)
    files = sorted(p.name for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    if is_drafter_config(raw):
        cfg = DrafterConfig.from_dict(raw, source=str(Path(path) / "config.json"))
        return {
            "kind": "EAGLE-3 drafter",
            "architectures": raw.get("architectures"),
            "hidden_size": cfg.hidden_size,
            "fc_in_features": 3 * cfg.target_hidden_size,
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
        "feature_width": 3 * cfg.hidden_size,
        "dtype": cfg.torch_dtype,
        "files": files,
    }


def _cmd_info(args) -> int:
    info = describe_checkpoint(Path(args.path))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-jax", description="EAGLE-3 speculative decoding on JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="describe a target or drafter checkpoint directory")
    info.add_argument("path")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"eagle3-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
