"""The layers (``eagle3_jax.layers``): the XLA attention path (blockwise over the live prefix)
against the reference rule (``layers.visibility`` + one softmax over every cache slot), its
block size per backend, and its cost following the live prefix, not the cache's capacity."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax import cost, layers


def _case(seed, B, T, N, K, D, S, prefix, region_extra=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    L = 3
    k_cache = jnp.asarray(rng.normal(size=(L, B, S, K, D)), dtype)
    v_cache = jnp.asarray(rng.normal(size=(L, B, S, K, D)), dtype)
    q = jnp.asarray(rng.normal(size=(B, T, N, D)), dtype)
    k_new = jnp.asarray(rng.normal(size=(B, T, K, D)), dtype)
    v_new = jnp.asarray(rng.normal(size=(B, T, K, D)), dtype)
    R = region_extra + T
    mask = rng.random((B, T, R)) < 0.5
    mask[:, np.arange(T), region_extra + np.arange(T)] = True  # every query sees itself
    return k_cache, v_cache, q, k_new, v_new, jnp.asarray(mask), jnp.asarray(prefix, jnp.int32)


def _reference(q, k_cache, v_cache, layer, prefix, k_new, v_new, mask, region_kv=None):
    """Writes the region into the cache right after each prefix, then one softmax over all slots."""
    k_reg, v_reg = k_new, v_new
    if region_kv is not None:
        k_reg, v_reg = jnp.concatenate([region_kv[0], k_new], 1), jnp.concatenate([region_kv[1], v_new], 1)
    B, R = k_reg.shape[:2]
    slots = prefix[:, None] + jnp.arange(R)[None]
    b = jnp.arange(B)[:, None]
    k = k_cache[layer].at[b, slots].set(k_reg)
    v = v_cache[layer].at[b, slots].set(v_reg)
    visible = layers.visibility(prefix, mask, k.shape[1])
    return layers.attention_ref(q, k, v, visible, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("B,T,N,K,D,S,prefix,block", [
    (1, 1, 2, 1, 16, 300, [0], 64),            # empty prefix: the region alone
    (1, 1, 2, 1, 16, 300, [1], 64),
    (1, 1, 4, 2, 16, 300, [200], 64),          # decode, several blocks, GQA
    (3, 1, 2, 1, 16, 300, [5, 130, 299], 64),  # ragged batch, last block clamped to the cache end
    (2, 7, 8, 2, 32, 150, [97, 64], 32),       # a tree of 7 (matrix-product path)
    (2, 5, 2, 2, 16, 40, [33, 0], 256),        # a block larger than the cache
])
def test_blockwise_attention_equals_the_reference(B, T, N, K, D, S, prefix, block):
    k_cache, v_cache, q, k_new, v_new, mask, prefix = _case(0, B, T, N, K, D, S - T, prefix)
    # the reference writes the region after the prefix, so it needs T free slots past the longest prefix
    k_cache = jnp.pad(k_cache, ((0, 0), (0, 0), (0, T), (0, 0), (0, 0)))
    v_cache = jnp.pad(v_cache, ((0, 0), (0, 0), (0, T), (0, 0), (0, 0)))
    out = layers.attention(q, (k_cache, v_cache), 1, prefix, k_new, v_new, mask, scale=D ** -0.5, block=block)
    ref = _reference(q, k_cache, v_cache, 1, prefix, k_new, v_new, mask)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_region_kv_and_bfloat16():
    B, T, N, K, D, S, O = 2, 3, 4, 2, 16, 200, 6
    k_cache, v_cache, q, k_new, v_new, mask, prefix = _case(1, B, T, N, K, D, S, [70, 150], region_extra=O,
                                                            dtype=jnp.bfloat16)
    rng = np.random.default_rng(2)
    region_kv = tuple(jnp.asarray(rng.normal(size=(B, O, K, D)), jnp.bfloat16) for _ in range(2))
    out = layers.attention(q, (k_cache, v_cache), 0, prefix, k_new, v_new, mask, scale=D ** -0.5,
                           region_kv=region_kv, block=64)
    ref = _reference(q.astype(jnp.float32), k_cache.astype(jnp.float32), v_cache.astype(jnp.float32), 0, prefix,
                     k_new.astype(jnp.float32), v_new.astype(jnp.float32), mask,
                     tuple(r.astype(jnp.float32) for r in region_kv))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2, rtol=3e-2)


def test_prefix_block_by_backend(monkeypatch):
    """64-slot steps on the CPU; on a GPU steps that move GPU_BLOCK_BYTES (keys, values, scores; a step
    there costs ~21 µs whatever it reads), so that a small cache is read in one pass."""
    assert layers.prefix_block(1, 8, 128, 2) == layers.PREFIX_BLOCK  # this machine: the CPU
    k_cache, v_cache, q, k_new, v_new, mask, prefix = _case(0, 2, 3, 4, 2, 16, 120, [100, 7])
    k_cache = jnp.pad(k_cache, ((0, 0), (0, 0), (0, 3), (0, 0), (0, 0)))
    v_cache = jnp.pad(v_cache, ((0, 0), (0, 0), (0, 3), (0, 0), (0, 0)))
    args = (q, (k_cache, v_cache), 1, prefix, k_new, v_new, mask)
    trace = lambda: str(jax.make_jaxpr(lambda *a: layers.attention(*a, scale=0.25, block=123))(*args))
    assert "while" in trace()  # on the CPU even a one-block walk is a loop (faster there)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    # an 8B shape: a decode step (4 query rows per KV head), batch 1 and 32; a 60-token tree
    assert layers.prefix_block(1, 8, 128, 2, rows=4) == layers.GPU_BLOCK_BYTES // (8 * (2 * 128 * 2 + 4 * 4)) == 23831
    assert layers.prefix_block(32, 8, 128, 2, rows=4) == 744
    assert layers.prefix_block(1, 8, 128, 2, rows=240) == 8548
    assert layers.prefix_block(1, 8, 128, 2, rows=4 * 8192) == 95  # an 8k prefill: short steps
    assert layers.prefix_block(4, 8, 128, 2, rows=4 * 8192) == layers.PREFIX_BLOCK  # never below it
    # on a GPU one pass, no loop: a block as large as the cache (the result as the reference's)
    assert "while" not in trace()
    out = layers.attention(*args, scale=0.25)
    np.testing.assert_allclose(out, _reference(q, k_cache, v_cache, 1, prefix, k_new, v_new, mask), atol=2e-5,
                               rtol=2e-5)


def test_cost_follows_the_live_prefix_not_the_capacity():
    """The compiled prefix walk reads `block`-slot windows, never a whole cache layer."""
    B, T, N, K, D, S = 1, 1, 2, 1, 16, 4096
    k_cache, v_cache, q, k_new, v_new, mask, prefix = _case(0, B, T, N, K, D, S, [10])
    f = jax.jit(lambda *a: layers.attention(*a, scale=0.25, block=64), static_argnums=())
    hlo = f.lower(q, (k_cache, v_cache), 0, prefix, k_new, v_new, mask).compile().as_text()
    layer_bytes = S * K * D * 4
    assert cost.large_ops(hlo, layer_bytes) == []
