"""The host's probes (:mod:`eagle3_jax.host`) and ``--mesh auto``, the default of ``eagle3-jax
bench``: on a CPU, one JAX device per core, and a batch split over them as a ``data`` mesh
(``host.core_mesh``, through the command line's ``cli.common.mesh``)."""

import argparse
import json
import os
import subprocess
import sys
import types

import jax
import pytest

from eagle3_jax import host, sharding
from eagle3_jax.cli import common
from helpers import cpu_devices_env


def _args(**kw):
    base = dict(mesh=None, rules=None, target=None, drafter=None, dtype=None, cores=True)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def three_cpus(monkeypatch):
    """Three CPU devices as ``host.core_mesh`` sees them; the meshes it would build, recorded."""
    made = []
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="cpu", id=i) for i in range(3)])
    monkeypatch.setattr(sharding, "make_mesh", lambda **kw: made.append(kw) or kw)
    return made


def test_auto_splits_a_batch_over_the_most_devices_that_divide_it(three_cpus):
    assert common.mesh(_args(), 1) is None  # one row: one device
    mesh = common.mesh(_args(), 2)
    assert mesh["data"] == 2 and [d.id for d in mesh["devices"]] == [0, 1]
    assert common.mesh(_args(mesh="auto"), 3)["data"] == 3
    assert common.mesh(_args(), 32)["data"] == 2  # 3 does not divide 32
    assert common.mesh(_args(), 7) is None  # nor 2 nor 3 divides 7
    assert common.mesh(_args(mesh="none"), 32) is None
    assert common.mesh(_args(cores=False), 32) is None  # generate: one device


def test_auto_keeps_one_device_where_the_copies_would_not_fit_or_off_the_cpu(three_cpus, monkeypatch, tmp_path):
    for name, size in (("target", 12 << 20), ("drafter", 4 << 20)):  # 16 MiB of 16-bit weights
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "model.safetensors", "wb") as f:
            f.truncate(size)
    pair = dict(target=tmp_path / "target", drafter=tmp_path / "drafter", dtype="bfloat16")
    monkeypatch.setattr(host, "memory", lambda: 128 << 20)  # a quarter: 32 MiB, two copies of the weights
    assert common.mesh(_args(**pair), 2)["data"] == 2
    assert common.mesh(_args(**pair), 3) is None  # three copies would not fit
    assert common.mesh(_args(**{**pair, "dtype": "float32"}), 2) is None  # read as float32: 32 MiB a copy
    monkeypatch.setattr(host, "memory", lambda: None)  # unknown: one device
    assert common.mesh(_args(**pair), 2) is None
    monkeypatch.setattr(host, "memory", lambda: 1 << 40)
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="gpu", id=i) for i in range(3)])
    assert common.mesh(_args(**pair), 2) is None


def test_rules_need_mesh_axes():
    for mesh in (None, "auto", "none"):
        with pytest.raises(ValueError, match="--rules needs --mesh AXES"):
            common.mesh(_args(mesh=mesh, rules={"vocab": None}), 32)


def _bench(tmp_path, *flags, env=None):
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "JAX_NUM_CPU_DEVICES"}
    js = tmp_path / "b.json"
    res = subprocess.run([sys.executable, "-m", "eagle3_jax.cli", "bench", "--tree", "chain2", "--temperature", "0",
                          "--max-new-tokens", "8", "--json", str(js), "--figure", str(tmp_path / "b.png"), *flags],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    doc = json.loads(js.read_text())
    assert doc["reports"][0]["eagle3"][0]["identical_to_vanilla"]
    return doc, res.stdout


def test_the_program_splits_a_batch_over_the_cores(tmp_path):
    """The program gives JAX one CPU device per core; a batch of 2 rows is split over two."""
    doc, out = _bench(tmp_path, "--batch-size", "2", "--num-prompts", "2")
    split = host.cores() >= 2
    assert doc["mesh"] == ({"data": 2, "fsdp": 1, "tensor": 1} if split else None)
    assert ("batches split over 2 CPU devices" in out) == split


def test_the_program_keeps_a_device_count_the_environment_names(tmp_path):
    n = host.cores() + 1  # more devices than cores: only the environment's count gives them
    doc, _ = _bench(tmp_path, "--batch-size", str(n), "--num-prompts", str(n), env=cpu_devices_env(n))
    assert doc["mesh"] == {"data": n, "fsdp": 1, "tensor": 1}


def test_compile_cache_is_per_user_bounded_and_overridable(tmp_path, monkeypatch, capsys):
    """serve, replay, generate, bench and experiment keep compiled programs in a per-user
    directory by default (bounded, so JAX locks it between processes); $JAX_COMPILATION_CACHE_DIR
    and --compile-cache choose another, off none; a default that cannot be made only warns."""
    keys = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size", "jax_persistent_cache_min_compile_time_secs",
            "jax_enable_compilation_cache")
    saved = {k: getattr(jax.config, k) for k in keys}
    for var in ("JAX_COMPILATION_CACHE_MAX_SIZE", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        default = tmp_path / "xdg" / "eagle3-jax" / "xla"
        assert host.use_compile_cache(None) == default and default.is_dir()
        assert (jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size,
                jax.config.jax_persistent_cache_min_compile_time_secs) == \
            (str(default), host.COMPILE_CACHE_BYTES, host.COMPILE_CACHE_MIN_SECONDS)
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "env"))  # as $JAX_COMPILATION_CACHE_DIR sets it
        assert host.use_compile_cache(None) == tmp_path / "env"
        assert host.use_compile_cache(str(tmp_path / "flag")) == tmp_path / "flag"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "flag")
        assert host.use_compile_cache("off") is None and not jax.config.jax_enable_compilation_cache
        (tmp_path / "afile").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "afile"))
        jax.config.update("jax_compilation_cache_dir", None)
        assert host.use_compile_cache(None) is None
        assert "warning: no compilation cache" in capsys.readouterr().err
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
