"""Decoding on a simulated 8-device mesh: the tokens of one device, weights and KV caches
really sharded, and a batch in phases on a data-parallel mesh (the full matrix, with the
built-in pair and vanilla decoding, is ``scripts/mesh_decode.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_generate_on_meshes_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "mesh_decode.py"), "--quick"], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if "tokens identical" in line and not line.startswith("phases")]
    assert len(lines) == 4, res.stdout
    assert lines[3].startswith("tiny-2l  tree8,2,3 {'data': 2, 'tensor': 4}"), res.stdout  # a two-layer drafter
    assert "-> (8, 2, 60, 1, 16) per device" in lines[0]  # data=2, tensor=4: batch and KV heads split
    assert "-> (8, 1, 60, 4, 16) per device" in lines[2]  # data=8: one row per device
    assert any(line.startswith("phases (8, 4, 2)") and "tokens identical" in line for line in res.stdout.splitlines()), \
        res.stdout
