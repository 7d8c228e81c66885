"""``eagle3_jax.train.ttt``, the training-time test: attention mask and loss against a
brute-force loop reference, and its steps against the inference chain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import layers
from helpers import FIXTURES
from eagle3_jax.train.trainer import target_head
from eagle3_jax.train.ttt import ttt_loss


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _reference(drafter, feats, ids, tlogits, lmask, length, w=0.8):
    cfg = drafter.config
    B, T = ids.shape
    N, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G, scale = N // K, D ** -0.5
    draft_ids = np.asarray(drafter.to_target_ids(jnp.arange(cfg.draft_vocab_size)))
    t2d = np.asarray(drafter.t2d)
    h = drafter.fuse(jnp.asarray(feats))
    keys, vals, total, losses, accs = [], [], 0.0, [], []
    for s in range(length):
        tokens = np.array([[ids[b, t + 1 + s] if t + 1 + s < T else 0 for t in range(T)] for b in range(B)])
        pos = jnp.asarray(np.broadcast_to(np.arange(T) + s, (B, T)))
        cos, sin = drafter.rope(pos)
        q, k, v = (np.asarray(a) for a in layers.qkv(drafter.attn_params(), drafter.layer_input(h, jnp.asarray(tokens)), cos, sin,
                                                     num_heads=N, num_kv_heads=K, head_dim=D, eps=cfg.rms_norm_eps))
        keys.append(k)
        vals.append(v)
        attn = np.zeros((B, T, N, D), np.float32)
        for b in range(B):
            for t in range(T):
                for n in range(N):
                    kv = n // G
                    ks = [keys[0][b, u, kv] for u in range(t + 1)] + [keys[j][b, t, kv] for j in range(1, s + 1)]
                    vs = [vals[0][b, u, kv] for u in range(t + 1)] + [vals[j][b, t, kv] for j in range(1, s + 1)]
                    p = _softmax(np.array([q[b, t, n] @ kk * scale for kk in ks]))
                    attn[b, t, n] = sum(pi * vi for pi, vi in zip(p, vs))
        h = drafter.layer_output(h, jnp.asarray(attn.reshape(B, T, -1)) @ drafter.wo[...])
        logits = np.asarray(drafter.logits(h))
        ce_sum = count = hits = predicted = 0.0
        for b in range(B):
            for t in range(T):
                if t + 2 + s >= T or not lmask[b, t + 2 + s]:
                    continue
                predicted += 1
                label = tlogits[b, t + 1 + s]
                if not t2d[label.argmax()]:
                    continue
                p = _softmax(label[draft_ids])
                logq = logits[b, t] - logits[b, t].max()
                logq = logq - np.log(np.exp(logq).sum())
                ce_sum += -(p * logq).sum()
                count += 1
                hits += float(logits[b, t].argmax() == p.argmax())
        losses.append(ce_sum / max(count, 1))
        accs.append(hits / max(predicted, 1))
        total += w ** s * losses[-1]
    return total, np.array(losses), np.array(accs)


@pytest.mark.parametrize("length, chunk, remat", [(1, 256, True), (4, 256, False), (4, 4, True), (3, 1, False)])
def test_ttt_matches_brute_force(length, chunk, remat):
    """The loss from the target's hidden, in sequence chunks (4 does not divide T = 11: a
    padded last chunk) and with each step rematerialised or not, equals the loop."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)
    rng = np.random.default_rng(length)
    B, T = 2, 11
    ids = rng.integers(0, 1024, size=(B, T))
    feats = rng.normal(size=(B, T, 384)).astype(np.float32) * 3
    hidden = target.trunk(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(T), (B, T)))[0] * 4  # sharper labels:
    tlogits = np.asarray(target.head(hidden))  # the argmax often inside the draft vocab
    lmask = rng.random((B, T)) < 0.8
    loss, metrics = jax.jit(lambda *a: ttt_loss(drafter, *a, length=length, chunk=chunk, remat=remat))(
        feats, ids, hidden, target_head(target), lmask)
    want_total, want_losses, want_accs = _reference(drafter, feats, ids, tlogits, lmask, length)
    np.testing.assert_allclose(np.asarray(metrics["loss_s"]), want_losses, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(float(loss), want_total, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(metrics["acc_s"]), want_accs, atol=1e-6)
    np.testing.assert_allclose(float(metrics["sim_accept_len"]), np.cumprod(want_accs).sum(), atol=1e-6)
    assert want_losses.min() > 0


def test_ttt_steps_equal_the_inference_chain():
    """Training-time test simulates inference exactly: the hidden of TTT step s at index t
    equals the drafter's depth-s draft (teacher-forced) after committed context 0..t."""
    from eagle3_jax.kv_cache import advance
    from eagle3_jax.train.ttt import shift_left, ttt_attention

    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    d = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)
    cfg, T, t = d.config, 12, 6
    ids = np.random.default_rng(0).integers(0, 1024, (1, T))
    _, feats = target.features(ids)
    h, keys, vals, hs = d.fuse(feats), [], [], []
    for s in range(4):
        cos, sin = d.rope(jnp.arange(T)[None] + s)
        q, k, v = layers.qkv(d.attn_params(), d.layer_input(h, shift_left(jnp.asarray(ids), 1 + s)), cos, sin,
                             num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
        keys.append(k)
        vals.append(v)
        h = d.layer_output(h, ttt_attention(q, keys, vals, cfg.head_dim ** -0.5).reshape(1, T, -1) @ d.wo[...])
        hs.append(h)
    out, cache = d(feats[:, : t + 1], jnp.asarray(ids[:, 1: t + 2]), jnp.arange(t + 1)[None], cache=d.init_cache(1, 32))
    cache = advance(cache, jnp.array([t + 1]))
    np.testing.assert_allclose(out[0, t], hs[0][0, t], atol=1e-5)
    hid = out[:, t: t + 1]
    for s in range(1, 4):  # draft step s: sees the context, its s-1 ancestors and itself
        region = jnp.zeros((1, 1, 4), bool).at[0, 0, :s].set(True)
        hid, cache = d(hid, jnp.asarray(ids[:, t + 1 + s: t + 2 + s]), jnp.array([[t + s]]), cache=cache,
                       region_mask_BxTxR=region, write_offset=s - 1)
        np.testing.assert_allclose(hid[0, 0], hs[s][0, t], atol=1e-4)
