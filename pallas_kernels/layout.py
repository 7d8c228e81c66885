"""The tree-attention kernels' shared views of their operands: query rows grouped by the KV
head they read (and back), and the stacked ``[L, B, S, K, D]`` cache with its layer index.
Used by the Mosaic TPU kernel (:mod:`tree_attention`) and the Mosaic GPU one
(:mod:`tree_attention_mgpu`) alike."""

from __future__ import annotations

import jax.numpy as jnp


def rows_by_kv_head(q_BxTxNxD, kv_heads: int):
    """``[B, T, N, D] → [B, K, G·T, D]``: the query rows sharing each KV head, ``row = g·T + t``."""
    B, T, N, D = q_BxTxNxD.shape
    G = N // kv_heads
    return q_BxTxNxD.reshape(B, T, kv_heads, G, D).transpose(0, 2, 3, 1, 4).reshape(B, kv_heads, G * T, D)


def rows_to_tokens(o_BxKxRxD, T: int):
    """Inverse of ``rows_by_kv_head``."""
    B, K, R, D = o_BxKxRxD.shape
    return o_BxKxRxD.reshape(B, K, R // T, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, K * (R // T), D)


def stacked_cache(k_cache, v_cache, layer, min_len: int = 0):
    """The kernels' cache view: ``[L, B, S, K, D]`` (a ``[B, S, K, D]`` cache is one layer,
    a free reshape) and the layer as int32 ``[1]``.  A cache shorter than ``min_len`` slots
    (the Mosaic GPU kernel's block; the TPU kernel's block shrinks to a short cache instead)
    is the one case that copies: the layer read, padded, so that every block lies inside
    the array."""
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    S = k_cache.shape[2]
    if S < min_len:
        pad = ((0, 0), (0, min_len - S), (0, 0), (0, 0))
        k_cache, v_cache, layer = jnp.pad(k_cache[layer], pad)[None], jnp.pad(v_cache[layer], pad)[None], 0
    return k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(1)
