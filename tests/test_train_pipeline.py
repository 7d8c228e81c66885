"""``eagle3_jax.train.pipeline``: the steps end to end (prepare → regenerate → vocab → fit →
export), the whole config checked before any step, ``--no-resume`` (it never loses a run), and a
real two-process run (JAX's multi-controller runtime, loopback coordinator) against one process
with as many devices (scripts/multihost_pipeline.py).  The config file and its overrides:
tests/test_train_config.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import eagle3_jax
from eagle3_jax.cli import main
from eagle3_jax.train import pipeline
from eagle3_jax.train.tiny import arithmetic_conversations, arithmetic_corpus, build_tokenizer, held_out_taus
from helpers import FIXTURES

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "tiny.yaml"


def test_end_to_end_pipeline(tmp_path, optimized):
    """prepare → regenerate → vocab → fit → export on the golden target with a BPE tokenizer
    built here; the exported drafter is official-format and beats an untrained one."""
    tok = build_tokenizer(tmp_path / "tok", arithmetic_corpus(), vocab_size=1024)
    assert len(tok) == 1024
    with open(tmp_path / "conv.jsonl", "w") as f:
        for c in arithmetic_conversations(160, seed=0):
            f.write(json.dumps(c) + "\n")
    overrides = [f"tokenizer={tmp_path / 'tok'}", f"data={tmp_path / 'conv.jsonl'}", f"work_dir={tmp_path / 'run'}",
                 f"target={FIXTURES / 'target_tiny'}", "seq_len=64", "regenerate.max_new_tokens=32",
                 "fit.steps=100", "fit.ttt_length=3", "fit.save_every=50", "fit.lr=0.003"]
    assert main(["train", "all", "--config", str(ROOT / "configs" / "tiny.yaml"), *overrides]) == 0

    export = tmp_path / "run" / "export"
    tensors = load_file(export / "model.safetensors")
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == bool and "embed_tokens.weight" not in tensors
    assert tensors["fc.weight"].shape == (128, 384) and tensors["lm_head.weight"].shape == (256, 128)
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 256
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "acc_0", "acc_2", "sim_accept_len", "tokens_per_second"} <= set(metrics[-1])

    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    trained = eagle3_jax.load_drafter(export, target=target)
    untrained = pipeline.new_drafter(target, np.load(tmp_path / "run" / "vocab.npz")["d2t"], draft_vocab_size=256)
    taus = held_out_taus(target, {"trained": trained, "untrained": untrained}, tok, prompts=12, max_new_tokens=32,
                         trees=(eagle3_jax.TreeConfig(16, 4, 4),))
    assert taus["trained 16,4,4"]["tau"] > taus["untrained 16,4,4"]["tau"] + 0.1, taus


# ------------------------------------------------------------------ the whole config, before any step
def _cfg(tmp_path, *overrides):
    return pipeline.load_config(TINY, [f"target={FIXTURES / 'target_tiny'}", f"work_dir={tmp_path / 'run'}",
                                       f"data={tmp_path / 'conv.jsonl'}", *overrides])


def _tokenizer_dir(tmp_path):  # the check looks for the files; no tokenizer is loaded before the first step
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    return tok


@pytest.mark.parametrize("step, overrides, error, named", [
    ("prepare", [], FileNotFoundError, ["conv.jsonl"]),  # no data file
    ("prepare", ["data=null"], ValueError, ["'data' is required"]),
    ("all", ["tokenizer={tok}", "target={tmp}/nowhere"], FileNotFoundError, ["target", "nowhere"]),
    ("all", ["tokenizer={tmp}"], FileNotFoundError, ["tokenizer", "tokenizer.json"]),
    ("all", ["tokenizer={tok}", "draft_vocab_size=5000"], ValueError, ["draft_vocab_size=5000", "1024"]),
    ("all", ["tokenizer={tok}", "seq_len=4096"], ValueError, ["seq_len=4096", "2048"]),
    ("all", ["tokenizer={tok}", "drafter.init={tmp}/nodrafter"], FileNotFoundError, ["drafter.init", "nodrafter"]),
    ("all", ["tokenizer={tok}", "mesh.fsdp=3"], ValueError, ["mesh"]),
    ("all", ["tokenizer={tok}", "work_dir={tmp}/conv.jsonl/run"], NotADirectoryError, ["work_dir", "not a directory"]),
    ("fit", [], FileNotFoundError, ["vocab.npz", "train vocab"]),  # an earlier step's output is missing
    ("export", [], FileNotFoundError, ["best", "train fit"]),
])
def test_run_checks_the_whole_config_first(tmp_path, step, overrides, error, named):
    (tmp_path / "conv.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n")
    tok = _tokenizer_dir(tmp_path)
    if step == "prepare" and not overrides:
        (tmp_path / "conv.jsonl").unlink()
    cfg = _cfg(tmp_path, *[o.format(tok=tok, tmp=tmp_path) for o in overrides])
    with pytest.raises(error) as e:
        pipeline.run(step, cfg)
    for part in named:
        assert part in str(e.value), str(e.value)
    assert not (tmp_path / "run" / "prepared.npz").exists()  # nothing ran


def test_no_resume_only_for_fit(tmp_path):
    with pytest.raises(ValueError, match="--no-resume"):
        pipeline.run("prepare", _cfg(tmp_path), resume=False)


# ------------------------------------------------------------------ --no-resume never loses a run
def _old_run(work: Path, tag: str):
    for d in ("ckpt/6", "best", "export"):
        (work / d).mkdir(parents=True, exist_ok=True)
    (work / "ckpt" / "6" / "state").write_text(tag)
    (work / "best" / "model.safetensors").write_text(f"weights of {tag}")
    (work / "best.json").write_text(json.dumps({"run": tag}))
    (work / "metrics.jsonl").write_text(tag)
    (work / "export" / "config.json").write_text(tag)
    (work / "vocab.npz").write_text(f"vocab of {tag}")
    (work / "regenerated.npz").write_text("records")


def test_fit_no_resume_moves_the_old_run_aside(tmp_path, monkeypatch, capsys):
    """``train fit --no-resume`` over an old run: the old run (best/ included) is moved to
    previous_runs/ and the message says where; the new run never sees it, and a later plain
    ``fit`` resumes the new run, not the old one."""
    work = tmp_path / "run"
    _old_run(work, "A")
    seen = []

    def fake_fit(cfg, work_, *, resume):  # records what fit would find; writes run B's checkpoint
        seen.append((resume, sorted(p.name for p in work_.iterdir())))
        (work_ / "ckpt" / "3").mkdir(parents=True, exist_ok=True)
        (work_ / "best").mkdir(exist_ok=True)
        (work_ / "best" / "model.safetensors").write_text("weights of B")

    monkeypatch.setattr(pipeline, "_fit", fake_fit)
    argv = ["train", "fit", "--config", str(TINY), f"target={FIXTURES / 'target_tiny'}", f"work_dir={work}"]
    assert main(argv + ["--no-resume"]) == 0
    out = capsys.readouterr().out
    (moved,) = (work / "previous_runs").iterdir()
    assert str(moved) in out and "best" in out
    assert (moved / "best" / "model.safetensors").read_text() == "weights of A"
    assert (moved / "ckpt" / "6" / "state").read_text() == "A" and (moved / "export" / "config.json").exists()
    assert (moved / "vocab.npz").read_text() == "vocab of A" and (work / "vocab.npz").exists()
    assert seen[0] == (False, ["previous_runs", "regenerated.npz", "vocab.npz"])
    assert main(argv) == 0  # plain fit: resumes run B (nothing moved)
    assert seen[1][0] is True and "ckpt" in seen[1][1] and len(list((work / "previous_runs").iterdir())) == 1
    assert (work / "best" / "model.safetensors").read_text() == "weights of B"
    assert main(argv + ["--no-resume"]) == 0  # and again: run B goes aside too, beside A
    assert sorted(p.read_text() for p in (work / "previous_runs").glob("*/best/model.safetensors")) == \
        ["weights of A", "weights of B"]


def test_fresh_fit_without_checkpoint_keeps_an_old_best(tmp_path):
    work = tmp_path / "run"
    _old_run(work, "A")
    (work / "ckpt" / "6" / "state").unlink()
    (work / "ckpt" / "6").rmdir()  # killed before its first checkpoint: nothing to resume
    moved = pipeline.set_aside_run(work, resume=True)
    assert moved is not None and not (work / "best").exists() and not (work / "metrics.jsonl").exists()
    assert (moved / "best" / "model.safetensors").read_text() == "weights of A"
    _old_run(work, "B")
    assert pipeline.set_aside_run(work, resume=True) is None and (work / "best").exists()  # resumable: kept


# ------------------------------------------------------------------ several processes
def test_two_processes_run_the_pipeline_like_one(tmp_path):
    """train all on 2 processes × 2 CPU devices: regeneration split without duplicates or
    loss, one export, and fit losses equal to 1 process × 4 devices (rtol 1e-5)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "multihost_pipeline.py"), "--work-dir", str(tmp_path),
                          "--conversations", "16", "--steps", "3", "--timeout", "240"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.splitlines()[-1] == "ok", res.stdout[-3000:]
