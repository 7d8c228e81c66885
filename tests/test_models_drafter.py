"""Drafter: golden parity with the official implementation, checkpoint interop, vocab map, errors."""

import json
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import eagle3_jax
from eagle3_jax.kv_cache import advance
from helpers import FIXTURES


@pytest.fixture(scope="module")
def target():
    return eagle3_jax.load_target(FIXTURES / "target_tiny")


@pytest.mark.parametrize("name", ["drafter_tiny", "drafter_tiny_trained"])
def test_forward_matches_official(target, name):
    drafter = eagle3_jax.load_drafter(FIXTURES / name, target=target)
    gold = np.load(FIXTURES / ("drafter_forward.npz" if name == "drafter_tiny" else "drafter_forward_trained.npz"))
    feats = jnp.asarray(gold["fused_features"])[None]
    ids = jnp.asarray(gold["drafter_input_ids"])[None]
    pos = jnp.arange(40)[None]
    cache = drafter.init_cache(1, 48)
    out, cache = drafter(feats, ids, pos, cache=cache)
    np.testing.assert_allclose(out[0], gold["out_hidden"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(feats[0] @ drafter.fc[...], gold["fc_out"], atol=1e-4, rtol=0)
    logits = drafter.logits(out[0])
    np.testing.assert_allclose(logits, gold["draft_logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(cache.k[0, 0, :40].transpose(1, 0, 2), gold["kv_key"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(cache.v[0, 0, :40].transpose(1, 0, 2), gold["kv_value"], atol=1e-4, rtol=0)
    top = np.argsort(-np.asarray(logits), axis=-1)[:, :10]
    np.testing.assert_array_equal(top, gold["draft_top10_draft_ids"])
    np.testing.assert_array_equal(drafter.to_target_ids(jnp.asarray(top)), gold["draft_top10_target_ids"])
    np.testing.assert_array_equal(drafter.d2t[...], gold["d2t"])
    np.testing.assert_array_equal(drafter.t2d, gold["t2d"])

    # incremental: positions 0..31, commit, then 32..39 on top of the cache
    split = int(gold["incremental_split"])
    cache = drafter.init_cache(1, 48)
    first, cache = drafter(feats[:, :split], ids[:, :split], pos[:, :split], cache=cache)
    second, _ = drafter(feats[:, split:], ids[:, split:], pos[:, split:], cache=advance(cache, jnp.array([split])))
    np.testing.assert_allclose(jnp.concatenate([first, second], 1)[0], gold["incremental_out_hidden"], atol=1e-4, rtol=0)


def test_official_bin_is_read_without_torch():
    code = (
        "import sys, eagle3_jax\n"
        f"t = eagle3_jax.load_target({str(FIXTURES / 'target_tiny')!r})\n"
        f"d = eagle3_jax.load_drafter({str(FIXTURES / 'drafter_tiny')!r}, target=t)\n"
        "assert d.fc[...].shape == (384, 128)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


def test_safetensors_export_round_trips_bit_exactly(target, tmp_path):
    original = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    eagle3_jax.save_drafter(original, tmp_path / "a")
    again = eagle3_jax.load_drafter(tmp_path / "a", target=target)
    eagle3_jax.save_drafter(again, tmp_path / "b")
    for name in ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "norm", "lm_head",
                 "hidden_norm", "input_norm", "post_norm", "d2t"):
        np.testing.assert_array_equal(getattr(original, name)[...], getattr(again, name)[...])
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_export_is_official_format(target, tmp_path):
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    eagle3_jax.save_drafter(drafter, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    ref = eagle3_jax.checkpoint.TorchPickleSource(FIXTURES / "drafter_tiny" / "pytorch_model.bin").tensors
    assert set(tensors) == set(ref)  # same names, no embed_tokens
    for name, arr in ref.items():
        assert tensors[name].dtype == arr.dtype and tensors[name].shape == arr.shape, name
        np.testing.assert_array_equal(tensors[name], arr)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # target_hidden_size equals hidden_size here: omitted, as in the published configs (see README, Exports)
    assert cfg["draft_vocab_size"] == 256 and "target_hidden_size" not in cfg and cfg["num_hidden_layers"] == 1
    assert cfg["rope_theta"] == 10000.0


def test_drafter_uses_its_own_rope_not_the_targets(target):
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    assert drafter.config.rope.theta == 10000.0 and target.config.rope.theta == 500000.0


def test_no_mapping_when_draft_vocab_is_full(target, tmp_path):
    shutil.copytree(FIXTURES / "drafter_tiny", tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["draft_vocab_size"] = 1024
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    src = eagle3_jax.checkpoint.TorchPickleSource(FIXTURES / "drafter_tiny" / "pytorch_model.bin").tensors
    tensors = {k: v for k, v in src.items() if k not in ("d2t", "t2d")}
    tensors["lm_head.weight"] = np.zeros((1024, 128), np.float32)
    (tmp_path / "d" / "pytorch_model.bin").unlink()
    save_file(tensors, tmp_path / "d" / "model.safetensors")
    drafter = eagle3_jax.load_drafter(tmp_path / "d", target=target)
    assert not drafter.config.has_vocab_map
    np.testing.assert_array_equal(drafter.to_target_ids(jnp.arange(5)), np.arange(5))


# ------------------------------------------------------------------ errors
def _safetensors_copy(tmp_path, edit_tensors=None, edit_config=None):
    d = tmp_path / "d"
    d.mkdir()
    tensors = dict(eagle3_jax.checkpoint.TorchPickleSource(FIXTURES / "drafter_tiny" / "pytorch_model.bin").tensors)
    cfg = json.loads((FIXTURES / "drafter_tiny" / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(cfg)
    save_file(tensors, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_mismatched_target_hidden(target, tmp_path):
    d = _safetensors_copy(tmp_path, edit_config=lambda c: c.update(target_hidden_size=64))
    with pytest.raises(ValueError, match="target hidden size 64"):
        eagle3_jax.load_drafter(d, target=target)


def test_mismatched_vocab(target, tmp_path):
    d = _safetensors_copy(tmp_path, edit_config=lambda c: c.update(vocab_size=2048))
    with pytest.raises(ValueError, match="vocab_size 2048 != target vocab_size 1024"):
        eagle3_jax.load_drafter(d, target=target)


def test_mismatched_capture_layers(target, tmp_path):
    d = _safetensors_copy(tmp_path, edit_config=lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}))
    with pytest.raises(ValueError, match=r"capture_layers=\[1, 3, 6\]"):
        eagle3_jax.load_drafter(d, target=target)


def test_bad_d2t(target, tmp_path):
    def edit(t):
        t["d2t"] = t["d2t"].copy()
        t["d2t"][-1] = 5000
    with pytest.raises(ValueError, match="'d2t' maps draft ids outside"):
        eagle3_jax.load_drafter(_safetensors_copy(tmp_path, edit), target=target)


def test_inconsistent_t2d(target, tmp_path):
    def edit(t):
        t["t2d"] = np.zeros_like(t["t2d"])
    with pytest.raises(ValueError, match="'t2d' disagrees"):
        eagle3_jax.load_drafter(_safetensors_copy(tmp_path, edit), target=target)


def test_misshaped_and_missing_tensor(target, tmp_path):
    d = _safetensors_copy(tmp_path, lambda t: t.update({"fc.weight": np.zeros((128, 256), np.float32)}))
    with pytest.raises(ValueError, match=r"'fc.weight': expected shape \(384, 128\)"):
        eagle3_jax.load_drafter(d, target=target)
    shutil.rmtree(d)
    d = _safetensors_copy(tmp_path, lambda t: t.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(KeyError, match="midlayer.hidden_norm.weight"):
        eagle3_jax.load_drafter(d, target=target)


def test_no_embedding_source(tmp_path):
    with pytest.raises(ValueError, match="no embed_tokens.weight; pass target="):
        eagle3_jax.load_drafter(FIXTURES / "drafter_tiny")


def test_corrupt_bin(tmp_path):
    d = tmp_path / "d"
    shutil.copytree(FIXTURES / "drafter_tiny", d)
    (d / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="pytorch_model.bin: corrupt"):
        eagle3_jax.load_drafter(d, embed=np.zeros((1024, 128), np.float32))
