"""``eagle3-jax train STEP --config FILE [key=value ...]``: the training pipeline
prepare → regenerate → vocab → fit → export, each step reading the previous step's
files from ``work_dir`` (so any step can be re-run or resumed on its own).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import yaml

STEPS = ("prepare", "regenerate", "vocab", "fit", "export")

DEFAULTS = {
    "target": None,            # Hugging Face target directory
    "tokenizer": None,         # defaults to the target directory
    "data": None,              # ShareGPT JSON / JSONL
    "work_dir": None,
    "seq_len": 2048,
    "last_turn_only": False,
    "draft_vocab_size": 32000,
    "dtype": "float32",        # target weights
    "distributed": False,      # jax.distributed.initialize() (multi-host pods)
    "regenerate": {"enabled": True, "max_new_tokens": 512, "temperature": 0.0, "batch_size": 8},
    "drafter": {"init": None, "seed": 0},
    "fit": {},                 # train.trainer.FitConfig fields
    "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
    "export_dir": None,        # default: work_dir/export
}


def load_config(path: str | Path, overrides=()) -> dict:
    """YAML config merged over the defaults, then ``a.b=value`` overrides (YAML values)."""
    path = Path(path)
    try:
        user = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read config ({e})") from None
    cfg = _merge(copy.deepcopy(DEFAULTS), user, str(path))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: expected key=value")
        node, *rest = key.split(".")
        target = cfg
        for part in [node, *rest][:-1]:
            if not isinstance(target.get(part), dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
            target = target[part]
        target[key.split(".")[-1]] = yaml.safe_load(value)
    for key in ("target", "data", "work_dir"):
        if not cfg.get(key):
            raise ValueError(f"{path}: '{key}' is required")
    return cfg


def _merge(base: dict, user: dict, source: str) -> dict:
    for k, v in user.items():
        if k not in base:
            raise ValueError(f"{source}: unknown key {k!r} (known: {sorted(base)})")
        base[k] = _merge(base[k], v, f"{source}:{k}") if isinstance(base[k], dict) and base[k] and isinstance(v, dict) else v
    return base


def run(step: str, cfg: dict, *, resume: bool = True):
    if step not in STEPS + ("all",):
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS + ('all',)}")
    if cfg["distributed"]:
        import jax

        jax.distributed.initialize()
    for s in STEPS if step == "all" else (step,):
        print(f"== {s}")
        globals()[f"_{s}"](cfg, Path(cfg["work_dir"]), resume=resume)


def _tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg["tokenizer"] or cfg["target"], local_files_only=True)


def _target(cfg):
    import eagle3_jax

    return eagle3_jax.load_target(cfg["target"], dtype=cfg["dtype"])


def _prepare(cfg, work: Path, **_):
    from train import data

    convs = data.load_conversations(cfg["data"])
    records = data.prepare(convs, _tokenizer(cfg), cfg["seq_len"], last_turn_only=cfg["last_turn_only"])
    data.save_records(records, work / "prepared.npz")
    (work / "conversations.json").write_text(json.dumps(convs))
    print(f"{len(records['input_ids'])} records, {int(records['loss_mask'].sum())} loss tokens")


def _regenerate(cfg, work: Path, **_):
    from train import data

    if not cfg["regenerate"]["enabled"]:
        shutil.copy(work / "prepared.npz", work / "regenerated.npz")
        return
    convs = json.loads((work / "conversations.json").read_text())
    r = cfg["regenerate"]
    new, records = data.regenerate(convs, _tokenizer(cfg), _target(cfg), seq_len=cfg["seq_len"],
                                   max_new_tokens=r["max_new_tokens"], temperature=r["temperature"],
                                   batch_size=r["batch_size"], last_turn_only=cfg["last_turn_only"])
    data.save_records(records, work / "regenerated.npz")
    (work / "regenerated.json").write_text(json.dumps(new))


def _vocab(cfg, work: Path, **_):
    from eagle3_jax.config import read_config_json
    from eagle3_jax.vocab import build_vocab_map
    from train import data

    records = data.load_records(work / "regenerated.npz")
    vocab = int(read_config_json(cfg["target"])["vocab_size"])
    d2t, t2d = build_vocab_map(records["input_ids"], records["loss_mask"], vocab, cfg["draft_vocab_size"])
    np.savez(work / "vocab.npz", d2t=d2t, t2d=t2d)
    print(f"draft vocab {cfg['draft_vocab_size']} of {vocab}")


def new_drafter(target, d2t, *, draft_vocab_size: int, seed: int = 0):
    """A freshly initialised EAGLE-3 drafter shaped after ``target`` (its RoPE settings too)."""
    from flax import nnx

    from eagle3_jax.config import DrafterConfig
    from eagle3_jax.models.drafter import Drafter

    t = target.config
    cfg = DrafterConfig(vocab_size=t.vocab_size, draft_vocab_size=draft_vocab_size, hidden_size=t.hidden_size,
                        intermediate_size=t.intermediate_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
                        head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps, rope=t.rope, target_hidden_size=t.hidden_size,
                        capture_layers=t.capture_layers, max_position_embeddings=t.max_position_embeddings)
    return Drafter(cfg, target.embed[...], d2t=d2t if cfg.has_vocab_map else None, dtype=target.dtype, rngs=nnx.Rngs(seed))


def _fit(cfg, work: Path, *, resume: bool = True):
    import eagle3_jax
    from eagle3_jax.sharding import make_mesh
    from train import data
    from train.trainer import FitConfig, Trainer

    target = _target(cfg)
    vocab = np.load(work / "vocab.npz")
    if cfg["drafter"]["init"]:
        drafter = eagle3_jax.load_drafter(cfg["drafter"]["init"], target=target)
    else:
        drafter = new_drafter(target, vocab["d2t"], draft_vocab_size=cfg["draft_vocab_size"], seed=cfg["drafter"]["seed"])
    known = {f.name for f in dataclasses.fields(FitConfig)}
    unknown = set(cfg["fit"]) - known
    if unknown:
        raise ValueError(f"fit: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    trainer = Trainer(target, drafter, data.load_records(work / "regenerated.npz"), FitConfig(**cfg["fit"]),
                      work_dir=work, mesh=make_mesh(**cfg["mesh"]))
    best = trainer.fit(resume=resume)
    (work / "best.json").write_text(json.dumps(best) + "\n")
    print(f"best simulated acceptance length {best['sim_accept_len']:.3f} at step {best['step']}")


def _export(cfg, work: Path, **_):
    import eagle3_jax

    out = Path(cfg["export_dir"] or work / "export")
    drafter = eagle3_jax.load_drafter(work / "best", target=_target(cfg))
    eagle3_jax.save_drafter(drafter, out)
    print(f"exported {out}")
