"""Training config, overrides, data and --no-resume: every malformed input is a clear,
early error naming the key or file (and the record); typed overrides; no run is lost."""

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import FIXTURES
from eagle3_jax.train import data, pipeline
from eagle3_jax.train.trainer import FitConfig

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "tiny.yaml"


def _refused(error, fn, path, named):
    """``fn(path)`` raises ``error`` whose message names the file and each of ``named``."""
    with pytest.raises(error) as e:
        fn(path)
    assert str(path) in str(e.value)
    for part in named:
        assert part in str(e.value), str(e.value)


# ------------------------------------------------------------------ config and overrides
@pytest.mark.parametrize("override, named", [
    ("fit.lrr=1e-4", ["'fit.lrr'", "did you mean 'fit.lr'"]),  # misspelt key: the closest known one
    ("fti.lr=1e-4", ["'fti.lr'", "'fit.lr'"]),  # misspelt section
    ("seq_len.x=3", ["'seq_len.x'"]),  # sub-key of a plain value
    ("fit=3", ["'fit' is a section", "fit.lr"]),
    ("fit.lr", ["'fit.lr'", "key=value"]),  # no '='
    ("=3", ["'=3'", "key=value"]),
    ("fit.steps=1.5", ["fit.steps", "integer"]),
    ("fit.steps=0", ["fit.steps", ">= 1"]),
    ("fit.lr=nan", ["fit.lr", "finite"]),
    ("fit.lr=-1e-4", ["fit.lr", "> 0"]),
    ("fit.offline=maybe", ["fit.offline", "true or false"]),
    ("fit.buckets=[32,x]", ["fit.buckets[1]", "integer"]),
    ("fit.compute_dtype=int8", ["fit.compute_dtype", "bfloat16"]),
    ("seq_len=many", ["seq_len", "integer"]),
    ("mesh.data=0", ["mesh.data", "-1"]),
    ("dtype=fp8", ["dtype", "float32"]),
    ("regenerate.temperature=-0.5", ["regenerate.temperature", ">= 0"]),
    ("regenerate.enabled=2", ["regenerate.enabled", "true or false"]),
])
def test_bad_override_is_refused(override, named):
    with pytest.raises(ValueError) as e:
        pipeline.load_config(TINY, [override])
    for part in named:
        assert part in str(e.value), str(e.value)


@pytest.mark.parametrize("text, named", [
    ("fitt: {lr: 1.0e-3}\n", ["unknown key 'fitt'", "'fit'"]),
    ("fit: {lrr: 1.0e-3}\n", ["'fit.lrr'", "'fit.lr'"]),
    ("fit: 3\n", ["'fit' must be a mapping"]),
    ("- a\n- b\n", ["expected a mapping", "list"]),
    ("fit: {lr: 1e-4\n", ["invalid YAML", "line 2"]),
    ("seq_len: [1, 2]\n", ["seq_len", "integer"]),
    ("fit: {batch_size: true}\n", ["fit.batch_size", "integer"]),
])
def test_bad_config_file_is_refused(tmp_path, text, named):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    _refused(ValueError, pipeline.load_config, path, named)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        pipeline.load_config(tmp_path / "missing.yaml")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        pipeline.load_config(tmp_path)


def test_overrides_take_the_schema_types(tmp_path):
    cfg = pipeline.load_config(TINY, ["fit.lr=1e-4", "fit.steps=10", "fit.buckets=8,16", "regenerate.enabled=false",
                                      "regenerate.temperature=1", "drafter.init=null", "seq_len=1_024"])
    assert type(cfg["fit"]["lr"]) is float and cfg["fit"]["lr"] == 1e-4
    assert type(cfg["fit"]["steps"]) is int and cfg["fit"]["steps"] == 10
    assert cfg["fit"]["buckets"] == (8, 16) and cfg["regenerate"]["enabled"] is False
    assert type(cfg["regenerate"]["temperature"]) is float and cfg["drafter"]["init"] is None
    assert cfg["seq_len"] == 1024
    FitConfig(**cfg["fit"])
    path = tmp_path / "c.yaml"  # YAML 1.1 reads a bare 1e-4 as a string: the schema makes it a float
    path.write_text("fit: {lr: 1e-4, steps: 7}\n")
    got = pipeline.load_config(path)["fit"]
    assert type(got["lr"]) is float and got["lr"] == 1e-4 and got["steps"] == 7


def test_config_paths_expand_the_home_directory(tmp_path, monkeypatch):
    """``~/…`` in a path key (YAML or override) is the user's home, as a shell reads it; a
    bare ``~`` is YAML's null."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("target: ~/models/t\ndata: ~/data.jsonl\ntokenizer: ~\nwork_dir: runs/x\n")
    cfg = pipeline.load_config(path, ["drafter.init=~/init"])
    assert cfg["target"] == str(tmp_path / "models" / "t") and cfg["data"] == str(tmp_path / "data.jsonl")
    assert cfg["drafter"]["init"] == str(tmp_path / "init")
    assert cfg["tokenizer"] is None and cfg["work_dir"] == "runs/x"


def test_fit_config_checks_types_and_ranges():
    with pytest.raises(TypeError, match="fit.lr"):
        FitConfig(lr="1e-4")
    with pytest.raises(TypeError, match="fit.steps"):
        FitConfig(steps=True)
    with pytest.raises(ValueError, match="fit.warmup_steps"):
        FitConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="fit.buckets"):
        FitConfig(buckets=(32, 0))
    assert FitConfig(lr=1, buckets=[32]).lr == 1.0 and FitConfig(buckets=[32]).buckets == (32,)


# ------------------------------------------------------------------ conversations and records
@pytest.mark.parametrize("name, content, error, named", [
    ("c.json", "{not json", ValueError, ["line 1", "invalid JSON"]),
    ("c.json", '{"conversations": []}', ValueError, ["expected a JSON list"]),
    ("c.jsonl", "\n\n", ValueError, ["no conversations"]),
    ("c.jsonl", '{"conversations": [{"from": "human", "value": "a"}]}\n{oops\n', ValueError, ["line 2"]),
    ("c.jsonl", '{"conversations": [{"from": "human", "value": "a"}]}\n{"text": "a"}\n', ValueError,
     ["record 1 (line 2)", "'conversations' or 'messages'"]),
    ("c.json", '[{"conversations": [{"from": "human", "value": "a"}]}, {"conversations": [{"from": "robot", '
               '"value": "b"}]}]', ValueError, ["record 1, turn 0", "'robot'"]),
    ("c.json", '[{"messages": [{"role": "user", "content": 3}]}]', ValueError, ["record 0, turn 0", "'content'"]),
    ("c.json", '[{"messages": []}]', ValueError, ["record 0", "empty conversation"]),
    ("c.json", '[["hello"]]', ValueError, ["record 0, turn 0", "expected an object"]),
    ("c.json", '[{"conversations": "hello"}]', ValueError, ["record 0", "list of turns"]),
    ("c.json", b'[{"messages": [{"role": "user", "content": "\xff"}]}]', ValueError, ["UTF-8"]),
])
def test_bad_conversations_name_file_and_record(tmp_path, name, content, error, named):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    _refused(error, data.load_conversations, path, named)


def test_conversations_file_missing_or_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.jsonl"):
        data.load_conversations(tmp_path / "nothere.jsonl")
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        data.load_conversations(tmp_path)


def test_good_conversations_both_layouts(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]})
                    + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "c"}]}) + "\n")
    assert data.load_conversations(path) == [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                             [{"role": "user", "content": "c"}]]


def test_bad_records_file(tmp_path):
    np.savez(tmp_path / "r.npz", input_ids=np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="'loss_mask'"):
        data.load_records(tmp_path / "r.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="junk.npz"):
        data.load_records(tmp_path / "junk.npz")


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
    from eagle3_jax.cli import main

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


def test_trainer_refuses_to_start_over_an_old_run(tmp_path):
    """The API guard behind it: a Trainer that restores nothing will not write into a
    work_dir holding another run's checkpoints or best/ (no step is compiled)."""
    import eagle3_jax
    from eagle3_jax.train.trainer import Trainer

    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    rng = np.random.default_rng(0)
    records = {"input_ids": rng.integers(0, 1024, (8, 16)).astype(np.int32), "loss_mask": rng.random((8, 16)) < 0.9}

    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)  # the Trainer copies its params

    def trainer():
        return Trainer(target, drafter, records, FitConfig(steps=2, batch_size=4), work_dir=tmp_path)

    old = trainer()
    old.step = 5
    old.save()
    old.ckpt.wait_until_finished()
    with pytest.raises(FileExistsError, match="step 5"):
        trainer().fit()
    (tmp_path / "ckpt").rename(tmp_path / "old_ckpt")
    (tmp_path / "best").mkdir()
    with pytest.raises(FileExistsError, match="best"):
        trainer().fit(resume=True)
