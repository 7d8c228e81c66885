"""Tree attention: ``T`` new (tree) tokens attend the committed KV-cache prefix
``[0, prefix_len[b])`` in full plus the ``T`` new keys under a boolean tree mask.

``tree_attention`` (Pallas, TPU Mosaic grid/BlockSpec kernel; runs on the CPU with
``interpret=True``) and ``tree_attention_ref`` (pure jnp) share one signature.

Kernel layout and blocking
--------------------------
* grid ``(B, K, S // block_k)``: one program per (sequence, KV head), walking the cache in
  ``block_k`` slots (default 128); the last axis carries the online-softmax state.
* per (b, h) the query block is all ``G·T`` rows of the query heads sharing KV head ``h``
  (``[G·T, D]``, resident in VMEM across the KV walk), so each cache block is read once
  per KV head (GQA-aware: HBM traffic is the cache, not ``G`` times the cache).
* cache blocks ``[block_k, D]`` at or past ``prefix_len[b]`` are skipped (the index map
  clamps to the last needed block, so no new DMA is issued for them); the last grid step
  also folds in the ``T`` new keys with the ``[T, T]`` tree mask.
* accumulators ``m, l [G·T, 1]`` and ``acc [G·T, D]`` are float32 VMEM scratch; inputs
  may be bfloat16 or float32, matmuls accumulate in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def tree_attention_ref(q_BxTxNxD, k_cache_BxSxKxD, v_cache_BxSxKxD, prefix_len_B, k_new_BxTxKxD, v_new_BxTxKxD,
                       tree_mask_BxTxT, *, scale: float):
    """jnp reference: softmax over [cache prefix ; new tokens under the tree mask], float32."""
    B, T, N, D = q_BxTxNxD.shape
    S, K = k_cache_BxSxKxD.shape[1], k_cache_BxSxKxD.shape[2]
    k = jnp.concatenate([k_cache_BxSxKxD, k_new_BxTxKxD.astype(k_cache_BxSxKxD.dtype)], 1)
    v = jnp.concatenate([v_cache_BxSxKxD, v_new_BxTxKxD.astype(v_cache_BxSxKxD.dtype)], 1)
    prefix_vis = jnp.arange(S)[None, None, :] < prefix_len_B[:, None, None]
    visible = jnp.concatenate([jnp.broadcast_to(prefix_vis, (B, T, S)), tree_mask_BxTxT.astype(bool)], -1)
    q = q_BxTxNxD.reshape(B, T, K, N // K, D)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return out.reshape(B, T, N, D).astype(q_BxTxNxD.dtype)


def _online_update(s, v, m_ref, l_ref, acc_ref):
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=-1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_ref[...] = m_new


def _kernel(prefix_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref, *,
            scale: float, block_k: int, groups: int):
    b, j = pl.program_id(0), pl.program_id(2)
    prefix = prefix_ref[b]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = q_ref[...]

    @pl.when(j * block_k < prefix)
    def _prefix_block():
        s = jax.lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        slot = j * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        _online_update(jnp.where(slot < prefix, s, -jnp.inf), v_ref[...], m_ref, l_ref, acc_ref)

    @pl.when(j == pl.num_programs(2) - 1)
    def _tree_block_and_finish():
        s = jax.lax.dot_general(q, kn_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        mask = jnp.tile(mask_ref[...], (groups, 1))  # rows are g-major: row = g*T + t
        _online_update(jnp.where(mask > 0, s, -jnp.inf), vn_ref[...], m_ref, l_ref, acc_ref)
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "interpret"))
def tree_attention(q_BxTxNxD, k_cache_BxSxKxD, v_cache_BxSxKxD, prefix_len_B, k_new_BxTxKxD, v_new_BxTxKxD,
                   tree_mask_BxTxT, *, scale: float, block_k: int = 128, interpret: bool = False):
    """Pallas tree attention (see the module docstring for blocking and layout)."""
    B, T, N, D = q_BxTxNxD.shape
    S, K = k_cache_BxSxKxD.shape[1], k_cache_BxSxKxD.shape[2]
    G = N // K
    S_pad = max(block_k, -(-S // block_k) * block_k)
    # head-major layouts: [B, K, rows, D]
    q = q_BxTxNxD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, D)
    kc = jnp.pad(k_cache_BxSxKxD, ((0, 0), (0, S_pad - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    vc = jnp.pad(v_cache_BxSxKxD, ((0, 0), (0, S_pad - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    kn = k_new_BxTxKxD.astype(kc.dtype).transpose(0, 2, 1, 3)
    vn = v_new_BxTxKxD.astype(vc.dtype).transpose(0, 2, 1, 3)
    mask = tree_mask_BxTxT.astype(jnp.int32)
    prefix = prefix_len_B.astype(jnp.int32)

    def kv_index(b, h, j, prefix_ref):  # clamp: blocks past the prefix re-use the last block (no DMA)
        last = jnp.maximum((prefix_ref[b] + block_k - 1) // block_k - 1, 0)
        return (b, h, jnp.minimum(j, last), 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, K, S_pad // block_k),
        in_specs=[
            pl.BlockSpec((None, None, G * T, D), lambda b, h, j, p: (b, h, 0, 0)),
            pl.BlockSpec((None, None, block_k, D), kv_index),
            pl.BlockSpec((None, None, block_k, D), kv_index),
            pl.BlockSpec((None, None, T, D), lambda b, h, j, p: (b, h, 0, 0)),
            pl.BlockSpec((None, None, T, D), lambda b, h, j, p: (b, h, 0, 0)),
            pl.BlockSpec((None, T, T), lambda b, h, j, p: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, G * T, D), lambda b, h, j, p: (b, h, 0, 0)),
        scratch_shapes=[pltpu.VMEM((G * T, 1), jnp.float32), pltpu.VMEM((G * T, 1), jnp.float32),
                        pltpu.VMEM((G * T, D), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_k=block_k, groups=G),
        out_shape=jax.ShapeDtypeStruct((B, K, G * T, D), q_BxTxNxD.dtype),
        grid_spec=grid_spec,
        interpret=interpret,
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(prefix, q, kc, vc, kn, vn, mask)
    return out.reshape(B, K, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, N, D)


def attention(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask, *, scale: float, interpret: bool | None = None):
    """Dispatcher: the Pallas kernel on TPU (or anywhere with ``interpret=True``), else the
    XLA reference.  GPU has no Mosaic-GPU kernel yet and takes the reference path."""
    if interpret is None:
        interpret = False
        if jax.default_backend() != "tpu":
            return tree_attention_ref(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask, scale=scale)
    return tree_attention(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask, scale=scale, interpret=interpret)
