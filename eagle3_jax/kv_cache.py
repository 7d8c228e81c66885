"""Static-shape KV cache: preallocated to ``max_len`` slots, per-sequence lengths.

A forward writes its ``T`` new keys/values right after the committed prefix without
advancing ``lengths``; :func:`commit` then keeps the chosen new slots, moved to
contiguous positions, and advances ``lengths``.  Slots at or beyond ``lengths`` are
scratch: never visible except through a forward's region mask.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, D]
    v: jax.Array  # [L, B, S, K, D]
    lengths: jax.Array  # [B] int32: committed slots per sequence

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def commit(cache: KVCache, src_BxA, count_B) -> KVCache:
    """Keeps new slots ``lengths + src[b, :count[b]]`` at ``lengths + [0, count[b])``.

    ``src`` indexes the region written by the last forward (0 = first new token);
    entries past ``count`` are ignored.  Sources are gathered before any write, so
    overlapping moves are safe.
    """
    B, A = src_BxA.shape
    b = jnp.arange(B)[:, None]
    src = cache.lengths[:, None] + src_BxA
    dst = cache.lengths[:, None] + jnp.arange(A)[None, :]
    k = cache.k.at[:, b, dst].set(cache.k[:, b, src])
    v = cache.v.at[:, b, dst].set(cache.v[:, b, src])
    return KVCache(k, v, cache.lengths + count_B.astype(jnp.int32))


def advance(cache: KVCache, count_B) -> KVCache:
    """Keeps the first ``count[b]`` new slots as they are (prefill, decode, drafter extend)."""
    return dataclasses.replace(cache, lengths=cache.lengths + count_B.astype(jnp.int32))
