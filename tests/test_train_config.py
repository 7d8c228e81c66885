"""The training pipeline's config (eagle3_jax.train.config, read by eagle3_jax.configfile):
every malformed key, value or file is a clear error naming the key, the file and the problem;
overrides and YAML values take the fields' types."""

import dataclasses
from typing import ClassVar
from pathlib import Path

import pytest

from helpers import assert_refused
from eagle3_jax import configfile
from eagle3_jax.train.config import PipelineConfig, load_config
from eagle3_jax.train.trainer import FitConfig

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "tiny.yaml"


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
        load_config(TINY, [override])
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
    assert_refused(ValueError, load_config, path, named)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        load_config(tmp_path)


def test_overrides_take_the_schema_types(tmp_path):
    cfg = load_config(TINY, ["fit.lr=1e-4", "fit.steps=10", "fit.buckets=8,16", "regenerate.enabled=false",
                             "regenerate.temperature=1", "drafter.init=null", "seq_len=1_024"])
    assert type(cfg.fit.lr) is float and cfg.fit.lr == 1e-4
    assert type(cfg.fit.steps) is int and cfg.fit.steps == 10
    assert cfg.fit.buckets == (8, 16) and cfg.regenerate.enabled is False
    assert type(cfg.regenerate.temperature) is float and cfg.drafter.init is None
    assert cfg.seq_len == 1024
    assert isinstance(cfg.fit, FitConfig)
    path = tmp_path / "c.yaml"  # YAML 1.1 reads a bare 1e-4 as a string: the schema makes it a float
    path.write_text("fit: {lr: 1e-4, steps: 7}\n")
    got = load_config(path).fit
    assert type(got.lr) is float and got.lr == 1e-4 and got.steps == 7


def test_config_paths_expand_the_home_directory(tmp_path, monkeypatch):
    """``~/…`` in a path key (YAML or override) is the user's home, as a shell reads it; a
    bare ``~`` is YAML's null."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("target: ~/models/t\ndata: ~/data.jsonl\ntokenizer: ~\nwork_dir: runs/x\n")
    cfg = load_config(path, ["drafter.init=~/init"])
    assert cfg.target == str(tmp_path / "models" / "t") and cfg.data == str(tmp_path / "data.jsonl")
    assert cfg.drafter.init == str(tmp_path / "init")
    assert cfg.tokenizer is None and cfg.work_dir == "runs/x"




def test_every_shipped_config_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if path.name != "builtin_recipe.yaml":
            assert isinstance(load_config(path), PipelineConfig), path
    cfg = load_config(ROOT / "configs" / "llama33_70b.yaml")
    assert cfg.mesh.sizes() == {"data": -1, "fsdp": 8, "tensor": 4} and cfg.regenerate.tensor == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_len = 3


# ------------------------------------------------------------------ the loader itself (any dataclass)
@dataclasses.dataclass(frozen=True)
class _Inner:
    size: int
    rate: float | None = None

    LIMITS: ClassVar[dict] = {"size": configfile.limits.POSITIVE}


@dataclasses.dataclass(frozen=True)
class _Outer:
    name: str
    inner: _Inner = _Inner(1)
    where: str | None = configfile.path()


def test_loader_builds_nested_dataclasses(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    got = configfile.build(_Outer, {"name": "a", "inner": {"size": 3}}, "x.yaml", ["inner.rate=2", "where=~/w"])
    assert got == _Outer("a", _Inner(3, 2.0), str(tmp_path / "w"))
    assert configfile.build(_Outer, {"name": "a"}, "x.yaml", ["inner.rate=null"]).inner.rate is None
    for tree, overrides, named in [({}, (), ["x.yaml", "'name' is required"]),
                                   ({"name": "a", "inner": {"size": 0}}, (), ["inner.size=0 (x.yaml)", ">= 1"]),
                                   ({"name": "a"}, ["inner.size=0"], ["inner.size=0 (command-line override)"]),
                                   ({"name": "a", "inner": {"sise": 2}}, (), ["x.yaml", "did you mean 'inner.size'"]),
                                   ({"name": 3}, (), ["name=3 (x.yaml)", "expected a string"]),
                                   ({"name": "a", "where": 3}, (), ["where=3", "a path or null"])]:
        with pytest.raises(ValueError) as e:
            configfile.build(_Outer, tree, "x.yaml", overrides)
        for part in named:
            assert part in str(e.value), str(e.value)
