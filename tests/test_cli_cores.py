"""``--mesh auto``, the default of ``eagle3-jax generate`` and ``bench``: on a CPU, one JAX
device per core, and a batch split over them as a ``data`` mesh (``cli._core_mesh``)."""

import argparse
import json
import os
import subprocess
import sys
import types

import jax
import pytest

from eagle3_jax import cli, sharding


def _args(**kw):
    base = dict(mesh=None, rules=None, target=None, drafter=None, dtype=None, batch_size=1, cost=False)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def three_cpus(monkeypatch):
    """Three CPU devices as ``_core_mesh`` sees them; the meshes it would build, recorded."""
    made = []
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="cpu")] * 3)
    monkeypatch.setattr(sharding, "make_mesh", lambda **kw: made.append(kw) or kw)
    return made


def test_mesh_flag_reads_auto_none_and_axes():
    assert cli._mesh_arg("auto") == "auto" and cli._mesh_arg(" None ") == "none"
    assert cli._mesh_arg("data=2") == {"data": 2, "fsdp": 1, "tensor": 1}
    with pytest.raises(argparse.ArgumentTypeError):
        cli._mesh_arg("data=two")
    assert cli._mesh(_args(mesh="none", batch_size=32)) is None


def test_auto_splits_a_batch_over_the_cpu_devices(three_cpus):
    assert cli._mesh(_args(batch_size=1)) is None  # one row: one device
    assert cli._mesh(_args(batch_size=2)) == {"data": 2, "devices": [three_cpus[0]["devices"][0]] * 2}
    assert cli._mesh(_args(mesh="auto", batch_size=32))["data"] == 3
    assert cli._mesh(_args(batch_size=1, cost=True))["data"] == 3  # --cost steps batches of 8 and 32 too
    assert cli._batch(_args(batch_size=64, cost=True)) == 64


def test_auto_keeps_one_device_where_the_copies_would_not_fit_or_off_the_cpu(three_cpus, monkeypatch):
    monkeypatch.setattr(os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 1000)  # 4 MB of memory
    assert cli._mesh(_args(batch_size=32)) is None  # the built-in pair's weights are 13 MB
    monkeypatch.undo()
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="gpu")] * 3)
    assert cli._mesh(_args(batch_size=32)) is None


def test_rules_still_need_a_mesh():
    with pytest.raises(ValueError, match="--rules needs --mesh"):
        cli._mesh(_args(rules={"vocab": None}, batch_size=32))
    with pytest.raises(ValueError, match="--rules needs --mesh"):
        cli._mesh(_args(mesh="none", rules={"vocab": None}))


def _bench(tmp_path, *flags, env=None):
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "JAX_NUM_CPU_DEVICES"}
    js = tmp_path / "b.json"
    res = subprocess.run([sys.executable, "-m", "eagle3_jax.cli", "bench", "--num-prompts", "3", "--tree", "chain2",
                          "--temperature", "0", "--max-new-tokens", "8", "--json", str(js), "--figure",
                          str(tmp_path / "b.png"), *flags], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    doc = json.loads(js.read_text())
    assert doc["reports"][0]["eagle3"][0]["identical_to_vanilla"]
    return doc, res.stdout


def test_the_program_splits_a_batch_over_the_cores(tmp_path):
    """The program gives JAX one CPU device per core; a batch of 3 rows is split over them."""
    cores = cli._cores()
    doc, out = _bench(tmp_path, "--batch-size", "3")
    n = min(cores, 3)
    assert doc["mesh"] == (None if n < 2 else {"data": n, "fsdp": 1, "tensor": 1})
    assert ("batches split over" in out) == (n >= 2)


def test_the_program_keeps_a_device_count_the_environment_names(tmp_path):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    doc, _ = _bench(tmp_path, "--batch-size", "3", env={"XLA_FLAGS": flags})
    assert doc["mesh"] == {"data": 3, "fsdp": 1, "tensor": 1}  # four devices, three rows
