"""Target wrapper: parity with transformers, the golden features, cache semantics, bad input."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import kv_cache
from eagle3_jax.layers import causal_mask
from helpers import FIXTURES, build_hf_model, hf_forward


@pytest.mark.parametrize("kind,shard", [("llama3_scaled", None), ("llama_tied", None), ("qwen2", None),
                                        ("qwen3", None), ("mistral", None), ("llama3_scaled", "150KB")])
def test_parity_with_transformers(kind, shard, tmp_path):
    hf = build_hf_model(kind, tmp_path, max_shard_size=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    target = eagle3_jax.load_target(tmp_path)
    ids = np.random.default_rng(1).integers(0, 256, size=(2, 23))
    ref_logits, hidden = hf_forward(hf, ids)
    logits, feats = target.features(ids)
    L = target.config.num_layers
    assert target.config.capture_layers == (2, L // 2, L - 3)
    ref_feats = np.concatenate([hidden[2], hidden[L // 2], hidden[L - 3]], -1)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(feats), ref_feats, atol=1e-4, rtol=0)


def test_golden_target_features():
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    gold = np.load(FIXTURES / "target_features.npz")
    assert tuple(gold["captured_layer_inputs"]) == target.config.capture_layers
    for i in range(3):
        logits, feats = target.features(gold[f"s{i}_input_ids"])
        ref = np.concatenate([gold[f"s{i}_low"], gold[f"s{i}_mid"], gold[f"s{i}_high"]], -1)
        np.testing.assert_allclose(np.asarray(feats), ref, atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.asarray(logits), gold[f"s{i}_logits"], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def golden_target():
    return eagle3_jax.load_target(FIXTURES / "target_tiny")


def test_prefill_then_decode_equals_full_forward(golden_target):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1024, size=(3, 20))
    full_logits, full_feats = golden_target.features(ids)
    lengths = np.array([5, 9, 12])
    prompt = np.where(np.arange(20)[None] < lengths[:, None], ids, 0)  # right padded
    logits, feats, cache = golden_target.prefill(prompt[:, :12], lengths, max_len=32)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], full_logits[b, :n], atol=1e-4)
    # decode each sequence from its own length onwards
    for step in range(6):
        tok = ids[np.arange(3), lengths + step]
        logits, feats, cache = golden_target.decode_step(cache, tok)
        want = np.asarray(full_logits)[np.arange(3), lengths + step]
        np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4)
        want_f = np.asarray(full_feats)[np.arange(3), lengths + step]
        np.testing.assert_allclose(np.asarray(feats), want_f, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + 6)


def test_tree_forward_with_chain_mask_equals_causal(golden_target):
    ids = np.random.default_rng(2).integers(0, 1024, size=(2, 16))
    full_logits, _ = golden_target.features(ids)
    _, _, cache = golden_target.prefill(ids[:, :10], np.array([10, 10]), max_len=24)
    chain = causal_mask(2, 6)
    depth = jnp.broadcast_to(jnp.arange(6), (2, 6))
    logits, _, cache = golden_target.tree_forward(cache, ids[:, 10:], depth, chain)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits)[:, 10:], atol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [10, 10])  # tree is not committed


def test_tree_forward_respects_branches(golden_target):
    """Two siblings under one root see the root but not each other: each equals its own chain."""
    ids = np.random.default_rng(3).integers(0, 1024, size=(1, 12))
    _, _, cache = golden_target.prefill(ids[:, :8], np.array([8]), max_len=16)
    root, a, b = ids[0, 8], ids[0, 9], ids[0, 10]
    mask = jnp.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
    logits, _, _ = golden_target.tree_forward(cache, [[root, a, b]], jnp.array([[0, 1, 1]]), mask)
    for tok, node in ((a, 1), (b, 2)):
        ref, _ = golden_target.features(np.array([[*ids[0, :8], root, tok]]))
        np.testing.assert_allclose(np.asarray(logits)[0, node], np.asarray(ref)[0, -1], atol=1e-4)


def test_commit_moves_exactly_the_selected_slots():
    L, B, S, K, D = 2, 2, 12, 1, 1
    k = jnp.arange(L * B * S, dtype=jnp.float32).reshape(L, B, S, K, D)
    cache = kv_cache.KVCache(k, -k, jnp.array([3, 5], jnp.int32))
    src = jnp.array([[0, 2, 4, 0], [1, 3, 0, 0]])
    out = kv_cache.commit(cache, src, jnp.array([3, 2]))
    np.testing.assert_array_equal(np.asarray(out.lengths), [6, 7])
    for l in range(L):
        np.testing.assert_array_equal(out.k[l, 0, 3:6, 0, 0], k[l, 0, [3, 5, 7], 0, 0])
        np.testing.assert_array_equal(out.k[l, 1, 5:7, 0, 0], k[l, 1, [6, 8], 0, 0])
        np.testing.assert_array_equal(out.k[l, 0, :3], k[l, 0, :3])  # prefix untouched
        np.testing.assert_array_equal(out.v[l, 1, 5:7, 0, 0], -k[l, 1, [6, 8], 0, 0])


# ------------------------------------------------------------------ bad input
def _copy_golden(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(FIXTURES / "target_tiny", d)
    return d


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        eagle3_jax.load_target(tmp_path)


def test_unknown_architecture(tmp_path):
    d = _copy_golden(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown model_type 'gpt2'"):
        eagle3_jax.load_target(d)


def test_corrupt_safetensors(tmp_path):
    d = _copy_golden(tmp_path)
    (d / "model.safetensors.index.json").unlink()
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="model.safetensors: corrupt"):
        eagle3_jax.load_target(d)


def test_missing_and_misshaped_tensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy_golden(tmp_path)
    (d / "model.safetensors.index.json").unlink()
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.3.mlp.up_proj.weight"):
        eagle3_jax.load_target(d)
    tensors["model.layers.3.mlp.up_proj.weight"] = np.zeros((352, 100), np.float32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.3.mlp.up_proj.weight.*expected shape \(128, 352\)"):
        eagle3_jax.load_target(d)


def test_missing_shard(tmp_path):
    d = _copy_golden(tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        eagle3_jax.load_target(d)


def test_prefill_argument_errors(golden_target):
    with pytest.raises(ValueError, match="does not fit a cache"):
        golden_target.prefill(np.zeros((1, 40), int), np.array([40]), max_len=32)
    with pytest.raises(ValueError, match="lengths: expected shape"):
        golden_target.prefill(np.zeros((2, 4), int), np.array([4]), max_len=32)
    with pytest.raises(ValueError, match="token ids must be in"):
        golden_target.features(np.array([5, 2000]))


def test_bfloat16_weights_run_close_to_float32():
    f32 = eagle3_jax.load_target(FIXTURES / "target_tiny")
    bf16 = eagle3_jax.load_target(FIXTURES / "target_tiny", dtype="bfloat16")
    assert bf16.wq[...].dtype == jnp.bfloat16
    ids = np.random.default_rng(0).integers(0, 1024, size=(1, 12))
    a, fa = f32.features(ids)
    b, fb = bf16.features(ids)
    assert b.dtype == jnp.float32 and fb.dtype == jnp.bfloat16
    a, b, fa, fb = (np.asarray(x, np.float32) for x in (a, b, fa, fb))

    def rel(x, y):
        return np.linalg.norm(x - y) / np.linalg.norm(x)

    # bfloat16 keeps 8 bits of mantissa: the logits and the captured features differ by ~2-3%
    # (2.8% and 2.1% on this CPU); a bf16 path that drops or mis-casts anything is far off
    assert rel(a, b) < 0.08 and rel(fa, fb) < 0.06, (rel(a, b), rel(fa, fb))
    # the top token is kept wherever float32's lead over the second is clear: 0.5, twice the
    # largest logit change measured here (0.25); nearer ties may flip on other hardware
    top2 = np.sort(a, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 0.5
    assert clear.sum() >= 4 and (a.argmax(-1) == b.argmax(-1))[clear].all()


def test_low_level_calls_refuse_bad_input_clearly(golden_target):
    """features / prefill / decode_step / tree_forward: non-integer ids are refused (not
    truncated), as are ragged or empty inputs, positions past the model's context, a float
    cache size, and a cache that an earlier call consumed (its buffers are donated)."""
    t = golden_target
    cases = [
        (lambda: t.features(np.array([[1.7, 2.2, 3.9]])), TypeError, "input_ids: token ids must be integers"),
        (lambda: t.features(np.array([[True, False]])), TypeError, "input_ids: token ids must be integers"),
        (lambda: t.features([[]]), ValueError, "input_ids is empty"),
        (lambda: t.features([[1, 2, 3], [4, 5]]), ValueError, "input_ids: expected a rectangular array"),
        (lambda: t.features(np.ones((1, t.config.max_position_embeddings + 1), np.int32)), ValueError,
         "exceed the target's max_position_embeddings"),
        (lambda: t.prefill([[1, 2, 3]], [2.5], 16), TypeError, "lengths must be integers"),
        (lambda: t.prefill([[1, 2, 3]], [3], 16.0), TypeError, "max_len must be an integer"),
        (lambda: t.prefill([[1.0, 2.0]], [2], 16), TypeError, "tokens: token ids must be integers"),
    ]
    for call, exc, words in cases:
        with pytest.raises(exc, match=words):
            call()
    _, _, cache = t.prefill([[1, 2, 3]], [3], 16)
    with pytest.raises(ValueError, match=r"tokens: token ids must be in \[0, 1024\)"):
        t.decode_step(cache, [5000])
    with pytest.raises(TypeError, match="tokens: token ids must be integers"):
        t.decode_step(cache, [5.5])
    with pytest.raises(TypeError, match="tokens: token ids must be integers"):
        t.decode_step(cache, jnp.array([5.0]))
    logits, _, fresh = t.decode_step(cache, jnp.array([5]))  # a device array (e.g. an argmax) is taken as is
    for reuse in (lambda: t.decode_step(cache, [6]),
                  lambda: t.tree_forward(cache, [[6]], np.zeros((1, 1), np.int32), np.ones((1, 1, 1), bool))):
        with pytest.raises(ValueError, match="consumed by an earlier"):
            reuse()
    np.testing.assert_array_equal(np.asarray(fresh.lengths), [4])


def test_load_drafter_needs_a_loaded_target():
    with pytest.raises(TypeError, match="target: expected a loaded Target"):
        eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=str(FIXTURES / "target_tiny"))
