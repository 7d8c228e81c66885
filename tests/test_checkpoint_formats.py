"""Exports every runtime reads the same way: the drafter config follows the published
EAGLE-3 configs (``target_hidden_size`` only where it differs from ``hidden_size``), the
embedding is shipped where a runtime would otherwise not find it, and ``save_target``
writes the ``model.safetensors.index.json`` through which the official runtime finds the
target's embedding.  The shipped built-in pair follows the same convention."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

import eagle3_jax
from eagle3_jax import builtin
from eagle3_jax.checkpoint import TorchPickleSource
from helpers import FIXTURES, tiny_drafter, tiny_target

# Keys of the published config that the official runtime, SGLang and vLLM read for the drafter.
RUNTIME_KEYS = ("model_type", "hidden_act", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "vocab_size", "draft_vocab_size",
                "max_position_embeddings", "tie_word_embeddings", "torch_dtype")


def official_embedding(drafter_dir, target_dir):
    """The embedding the official EAGLE runtime gives the drafter (``cnets.Model.__init__``
    then ``load_state_dict(strict=False)``): the target's, found through its
    ``model.safetensors.index.json``, unless the config has ``target_hidden_size``; then
    replaced by the checkpoint's ``embed_tokens.weight`` if there is one; None: left at
    random initialisation."""
    config = json.loads((drafter_dir / "config.json").read_text())
    embed = None
    if "target_hidden_size" not in config:
        index = json.loads((target_dir / "model.safetensors.index.json").read_text())
        with safe_open(str(target_dir / index["weight_map"]["model.embed_tokens.weight"]), "np") as f:
            embed = f.get_tensor("model.embed_tokens.weight")
    return load_file(drafter_dir / "model.safetensors").get("embed_tokens.weight", embed)


@pytest.fixture(scope="module")
def golden_target():
    return eagle3_jax.load_target(FIXTURES / "target_tiny")


def test_drafter_export_has_the_published_configs_keys(golden_target, tmp_path):
    golden = json.loads((FIXTURES / "drafter_tiny" / "config.json").read_text())
    golden_tensors = TorchPickleSource(FIXTURES / "drafter_tiny" / "pytorch_model.bin").tensors
    eagle3_jax.save_drafter(eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=golden_target), tmp_path)
    ours = json.loads((tmp_path / "config.json").read_text())
    assert ("target_hidden_size" in ours) == ("target_hidden_size" in golden) == False  # noqa: E712
    assert ("embed_tokens.weight" in load_file(tmp_path / "model.safetensors")) == ("embed_tokens.weight" in golden_tensors)
    assert {k: ours[k] for k in RUNTIME_KEYS} == {k: golden[k] for k in RUNTIME_KEYS}


@pytest.mark.parametrize("hidden, target_hidden, own", [(16, 16, False), (16, 32, False), (16, 16, True)],
                         ids=["shared-embedding", "wider-target", "own-embedding"])
def test_every_runtime_finds_the_drafters_embedding(tmp_path, hidden, target_hidden, own):
    drafter = tiny_drafter(3, hidden=hidden, target_hidden=target_hidden, own_embedding=own)
    target = tiny_target(4)
    if not own and hidden == target_hidden:  # shared: the drafter's table is the target's
        drafter.embed.set_value(target.embed[...])
    eagle3_jax.save_target(target, tmp_path / "target")
    eagle3_jax.save_drafter(drafter, tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    shipped = "embed_tokens.weight" in load_file(tmp_path / "drafter" / "model.safetensors")
    assert ("target_hidden_size" in config) == (hidden != target_hidden)
    assert shipped == (own or hidden != target_hidden)
    if hidden != target_hidden:
        assert config["target_hidden_size"] == target_hidden
    # official: from the target's index or the checkpoint; SGLang / vLLM: the checkpoint's, else the target's
    np.testing.assert_array_equal(official_embedding(tmp_path / "drafter", tmp_path / "target"), np.asarray(drafter.embed[...]))
    back = eagle3_jax.load_drafter(tmp_path / "drafter", embed=None if shipped else target.embed[...])
    assert back.own_embedding == shipped and back.config.target_hidden_size == target_hidden
    np.testing.assert_array_equal(np.asarray(back.embed[...]), np.asarray(drafter.embed[...]))


def test_save_target_writes_the_index_for_a_single_file(tmp_path):
    target = tiny_target(5)
    eagle3_jax.save_target(target, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    tensors = load_file(tmp_path / "model.safetensors")
    assert index["weight_map"] == {name: "model.safetensors" for name in tensors}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], np.asarray(target.embed[...]))


def test_the_shipped_pair_follows_the_convention_and_re_exports_byte_for_byte(tmp_path):
    config = json.loads((builtin.DRAFTER_DIR / "config.json").read_text())
    assert "target_hidden_size" not in config and config["hidden_size"] == 128
    index = json.loads((builtin.TARGET_DIR / "model.safetensors.index.json").read_text())
    with safe_open(str(builtin.TARGET_DIR / "model.safetensors"), "np") as f:
        assert set(index["weight_map"]) == set(f.keys())
    target = eagle3_jax.load_target(builtin.TARGET_DIR, dtype="float32")  # the drafter is stored in float32
    eagle3_jax.save_drafter(eagle3_jax.load_drafter(builtin.DRAFTER_DIR, target=target), tmp_path)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (builtin.DRAFTER_DIR / name).read_bytes(), name
    np.testing.assert_array_equal(official_embedding(builtin.DRAFTER_DIR, builtin.TARGET_DIR),
                                  np.asarray(target.embed[...]))
