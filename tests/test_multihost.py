"""The pipeline on several processes: the split of the items, the joining of the shards, and
a real two-process run (JAX's multi-controller runtime, loopback coordinator) against one
process with as many devices (scripts/multihost_pipeline.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle3_jax.train import data

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("n", [0, 1, 5, 24, 101])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_shard_range_covers_every_item_once_in_order(n, count):
    blocks = [data.shard_range(n, i, count) for i in range(count)]
    assert [i for b in blocks for i in b] == list(range(n))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    with pytest.raises(ValueError, match="process index 3"):
        data.shard_range(n, 3, 3)


def _records(rows, seq_len=6):
    ids = np.asarray(rows, np.int32)[:, None] + np.zeros((1, seq_len), np.int32)
    return {"input_ids": ids, "loss_mask": ids % 2 == 0, "lengths": np.full(len(rows), seq_len, np.int32)}


def test_merge_shards_joins_in_process_order(tmp_path):
    path = tmp_path / "regenerated.npz"
    data.save_records(_records([9, 9]), path)  # an earlier run's output: replaced
    data.save_records(_records([7]), data.shard_path(path, 0, 3))  # a killed 3-process run's shard: removed
    blocks = [data.shard_range(7, i, 2) for i in range(2)]
    for i in (1, 0):  # written in any order
        data.save_records(_records(list(blocks[i])), data.shard_path(path, i, 2))
        data.write_json([f"conv {j}" for j in blocks[i]], data.shard_path(tmp_path / "regenerated.json", i, 2))
    assert data.shard_path(path, 1, 2).name == "regenerated.shard-00001-of-00002.npz"
    data.merge_shards(path, 2)
    data.merge_shards(tmp_path / "regenerated.json", 2)
    got = data.load_records(path)
    np.testing.assert_array_equal(got["input_ids"][:, 0], np.arange(7))
    np.testing.assert_array_equal(got["loss_mask"], got["input_ids"] % 2 == 0)
    assert got["lengths"].tolist() == [6] * 7
    assert json.loads((tmp_path / "regenerated.json").read_text()) == [f"conv {j}" for j in range(7)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regenerated.json", "regenerated.npz"]


def test_merge_shards_refuses_missing_or_mismatched_shards(tmp_path):
    path = tmp_path / "regenerated.npz"
    data.save_records(_records([1]), path)
    data.save_records(_records([0]), data.shard_path(path, 0, 2))
    with pytest.raises(FileNotFoundError, match=r"regenerated\.shard-00001-of-00002\.npz.*process 1 of 2"):
        data.merge_shards(path, 2)
    data.save_records(_records([1], seq_len=8), data.shard_path(path, 1, 2))
    with pytest.raises(ValueError, match=r"shard-00001-of-00002\.npz.*seq_len 8"):
        data.merge_shards(path, 2)
    assert data.load_records(path)["input_ids"][:, 0].tolist() == [1]  # untouched
    assert data.shard_path(path, 0, 2).exists() and data.shard_path(path, 1, 2).exists()


def test_two_processes_run_the_pipeline_like_one(tmp_path):
    """train all on 2 processes × 2 CPU devices: regeneration split without duplicates or
    loss, one export, and fit losses equal to 1 process × 4 devices (rtol 1e-5)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "multihost_pipeline.py"), "--work-dir", str(tmp_path),
                          "--conversations", "16", "--steps", "3", "--timeout", "240"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.splitlines()[-1] == "ok", res.stdout[-3000:]
