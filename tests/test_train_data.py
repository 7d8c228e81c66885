"""``eagle3_jax.train.data``: conversations and records files (every malformed one a clear,
early error naming the file and the record), length buckets, and the shards of a run on several
processes (the split of the items, the joining of the shards)."""

import json

import numpy as np
import pytest

from eagle3_jax.train import data
from helpers import assert_refused, random_records, row_records


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
    assert_refused(error, data.load_conversations, path, named)


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


# ------------------------------------------------------------------ length buckets
def test_length_buckets_cut_batches():
    recs = random_records(n=32, T=40)
    recs["lengths"] = np.array([10] * 16 + [35] * 16, np.int32)
    it = data.dataset(recs, batch_size=4, seed=0, buckets=(16, 32))
    shapes = {next(it)["input_ids"].shape for _ in range(16)}
    assert shapes == {(4, 16), (4, 40)}


# ------------------------------------------------------------------ shards of a run on several processes
@pytest.mark.parametrize("n", [0, 1, 5, 24, 101])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_shard_range_covers_every_item_once_in_order(n, count):
    blocks = [data.shard_range(n, i, count) for i in range(count)]
    assert [i for b in blocks for i in b] == list(range(n))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    with pytest.raises(ValueError, match="process index 3"):
        data.shard_range(n, 3, 3)


def test_merge_shards_joins_in_process_order(tmp_path):
    path = tmp_path / "regenerated.npz"
    data.save_records(row_records([9, 9]), path)  # an earlier run's output: replaced
    data.save_records(row_records([7]), data.shard_path(path, 0, 3))  # a killed 3-process run's shard: removed
    blocks = [data.shard_range(7, i, 2) for i in range(2)]
    for i in (1, 0):  # written in any order
        data.save_records(row_records(list(blocks[i])), data.shard_path(path, i, 2))
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
    data.save_records(row_records([1]), path)
    data.save_records(row_records([0]), data.shard_path(path, 0, 2))
    with pytest.raises(FileNotFoundError, match=r"regenerated\.shard-00001-of-00002\.npz.*process 1 of 2"):
        data.merge_shards(path, 2)
    data.save_records(row_records([1], seq_len=8), data.shard_path(path, 1, 2))
    with pytest.raises(ValueError, match=r"shard-00001-of-00002\.npz.*seq_len 8"):
        data.merge_shards(path, 2)
    assert data.load_records(path)["input_ids"][:, 0].tolist() == [1]  # untouched
    assert data.shard_path(path, 0, 2).exists() and data.shard_path(path, 1, 2).exists()
