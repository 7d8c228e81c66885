"""Static-shape KV cache: preallocated to ``max_len`` slots, per-sequence lengths.

A forward writes its ``T`` new keys/values right after the committed prefix without
advancing ``lengths``; :func:`commit` then keeps the chosen new slots, moved to
contiguous positions, and advances ``lengths``.  Slots at or beyond ``lengths`` are
scratch: never visible except through a forward's region mask.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from eagle3_jax import sharding


# Logical axes of a cache's keys and values [L, B, S, K, D] (see ``eagle3_jax.sharding.RULES``):
# the batch over the data axes, KV heads over the tensor axis (replicated when fewer).
CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, D]
    v: jax.Array  # [L, B, S, K, D]
    lengths: jax.Array  # [B] int32: committed slots per sequence
    # the keys' and values' layout on a mesh (set by ``constrain``; static): writes and moves
    # then run on each device's own rows
    sharding: jax.sharding.NamedSharding | None = dataclasses.field(default=None, metadata=dict(static=True))
    # the layout of the hidden states of a forward over this cache (``sharding.hidden_sharding``;
    # static), which the drafter keeps its activations in
    hidden: jax.sharding.NamedSharding | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def storage_dtype(dtype, attention_impl: str = "xla"):
    """The dtype a model computing in ``dtype`` stores its cache's keys and values in:
    ``dtype`` itself, except 16-bit floats read by the XLA attention path on the CPU backend,
    stored as float32 (the keys and values exactly: every bfloat16 or float16 value is a
    float32 one; attention then weighs the values by unrounded probabilities).  The Pallas
    kernels, interpreted or not, get the dtype they run on an accelerator.

    XLA:CPU updates a 16-bit float buffer by converting all of it to float32 and back: every
    cache write (a dynamic-update-slice or scatter) would cost the cache's capacity, not the
    tokens written (the built-in target in bfloat16, batch 1: a decode step of 3.5 ms with
    256 slots, 79 ms with 16 384)."""
    dtype = jnp.dtype(dtype)
    if (attention_impl == "xla" and dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
            and jax.default_backend() == "cpu"):
        return jnp.dtype(jnp.float32)
    return dtype


KERNEL_SLOTS = 128  # a multiple of both kernels' cache blocks (Mosaic GPU 64, Mosaic TPU 128)


def capacity(max_len: int, attention_impl: str = "xla") -> int:
    """The slots a cache for ``max_len`` tokens has: ``max_len`` itself, rounded up to a
    multiple of :data:`KERNEL_SLOTS` where a Pallas kernel reads it (``attention_impl``
    ``pallas*``): Mosaic GPU tiles the cache's slots by 8 (on an H200, caches of 150 and 1193
    slots failed to compile, 1024 and 4096 matched the reference), and whole blocks are what
    both kernels walk.  The slots past ``max_len`` are never written or visible."""
    if attention_impl.startswith("pallas"):
        return -(-max_len // KERNEL_SLOTS) * KERNEL_SLOTS
    return max_len


def init_cache(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of ``[num_layers, batch, max_len, num_kv_heads, head_dim]`` ``dtype``
    keys and values (a model's :func:`storage_dtype`).

    The keys start as -0.0 and the values as 0.0: the same to every use (an unwritten slot is
    never visible), but two different constants, which XLA does not merge into one buffer that
    a loop updating both in place would then copy twice (a transient 1.5x the cache when a
    decode program starts, and two passes over it)."""
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return KVCache(jnp.full(shape, -0.0, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def constrain(cache: KVCache, sharding, hidden=None) -> KVCache:
    """``cache`` with its keys and values laid out by ``sharding`` (``None``: as they are),
    which it keeps (see :func:`write`), and ``hidden``, the layout of the hidden states of a
    forward over it (see :func:`constrain_hidden`)."""
    if sharding is None:
        return cache
    return KVCache(jax.lax.with_sharding_constraint(cache.k, sharding),
                   jax.lax.with_sharding_constraint(cache.v, sharding), cache.lengths, sharding, hidden)


def constrain_hidden(x_BxTxX, cache: KVCache | None):
    """Hidden states ``[B, T, X]`` of a forward over ``cache`` in the layout it names
    (``KVCache.hidden``), or as they are where it names none."""
    if cache is None or cache.hidden is None:
        return x_BxTxX
    return jax.lax.with_sharding_constraint(x_BxTxX, cache.hidden)


def layout(shape, mesh, rules=None, *, name: str = "KV cache") -> jax.sharding.NamedSharding:
    """The layout of a cache's keys or values of ``shape`` (``[L, B, S, K, D]``) on ``mesh``, by
    :data:`CACHE_AXES` and the sharding ``rules`` (batch over data, KV heads over tensor,
    replicated when there are fewer KV heads than tensor devices); ``name`` in its errors."""
    return jax.sharding.NamedSharding(mesh, sharding.spec(shape, CACHE_AXES, mesh, rules, name=name))


def _batch_axes(sharding) -> tuple:
    """The mesh axes a cache layout splits the batch over (none without a layout)."""
    if sharding is None:
        return ()
    axes = (tuple(sharding.spec) + (None,) * len(CACHE_AXES))[CACHE_AXES.index("batch")]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def row_shards(sharding) -> int:
    """How many devices a cache laid out by ``sharding`` (``None``: one device) splits its
    batch over, each holding a block of consecutive rows."""
    return math.prod(sharding.mesh.shape[a] for a in _batch_axes(sharding))


def by_rows(cache: KVCache, fn, *args):
    """``fn(*args)`` on each device's own rows when ``cache.sharding`` splits the batch, else
    as it is.  ``args`` and the results are arrays laid out as the cache (``[L, B, ...]``,
    five dimensions) or per row (``[B, ...]``).

    A scatter into (or gather from) rows picked by index is not local to XLA's partitioner,
    which would send every row's data to every device first (a decode step's new keys and
    values, all rows, to each device)."""
    sh = cache.sharding
    rows = _batch_axes(sh)
    if not rows:
        return fn(*args)
    P = jax.sharding.PartitionSpec
    spec = tuple(sh.spec) + (None,) * (len(CACHE_AXES) - len(sh.spec))

    def specs(tree):
        return jax.tree.map(lambda x: P(*spec) if x.ndim == len(CACHE_AXES) else P(rows), tree)

    out = jax.eval_shape(fn, *args)
    return jax.shard_map(fn, mesh=sh.mesh, in_specs=specs(args), out_specs=specs(out))(*args)


def write(cache: KVCache, k_new_LxBxTxKxD, v_new_LxBxTxKxD, at_B) -> KVCache:
    """Writes ``T`` new rows per layer and sequence at slots ``at[b] + [0, T)`` (lengths
    unchanged), updating the cache in place when it is donated or carried by a loop (on a
    mesh, each device its own rows)."""
    k, v = by_rows(cache, lambda k, v, k_new, v_new, at: (_put(k, k_new, at), _put(v, v_new, at)),
                   cache.k, cache.v, k_new_LxBxTxKxD, v_new_LxBxTxKxD, at_B)
    return dataclasses.replace(cache, k=k, v=v)


def _put(c_LxBxSxKxD, new_LxBxTxKxD, at_B):
    B, T = new_LxBxTxKxD.shape[1:3]
    new = new_LxBxTxKxD.astype(c_LxBxSxKxD.dtype)
    if B == 1:  # one contiguous window: a dynamic-update-slice
        return jax.lax.dynamic_update_slice(c_LxBxSxKxD, new, (0, 0, at_B[0], 0, 0))
    slots_BxT = at_B[:, None] + jnp.arange(T)[None, :]
    return c_LxBxSxKxD.at[:, jnp.arange(B)[:, None], slots_BxT].set(new, unique_indices=True)


def commit(cache: KVCache, src_BxA, count_B, new_kv=None) -> KVCache:
    """Keeps new slots ``src[b, :count[b]]`` at ``lengths + [0, count[b])`` and advances
    ``lengths``.

    ``src`` indexes the new tokens of the last forward (0 = first new token): read from
    ``new_kv = (k_LxBxTxKxD, v_LxBxTxKxD)`` when given (a forward that did not write the
    cache, ``Target.forward``), else from the region the forward wrote after the prefix.
    Entries past ``count`` are ignored.  Sources are gathered before any write, so
    overlapping moves are safe; only the ``A`` kept rows are written.
    """
    def move(k, v, lengths, src_BxA, *new):
        b = jnp.arange(src_BxA.shape[0])[:, None]
        if new:
            moved_k, moved_v = new[0][:, b, src_BxA], new[1][:, b, src_BxA]
        else:
            src = lengths[:, None] + src_BxA
            moved_k, moved_v = k[:, b, src], v[:, b, src]  # [L, B, A, K, D]
        return _put(k, moved_k, lengths), _put(v, moved_v, lengths)

    k, v = by_rows(cache, move, cache.k, cache.v, cache.lengths, src_BxA, *(new_kv or ()))
    return advance(dataclasses.replace(cache, k=k, v=v), count_B)


def advance(cache: KVCache, count_B) -> KVCache:
    """Keeps the first ``count[b]`` new slots as they are (prefill, decode, drafter extend)."""
    return dataclasses.replace(cache, lengths=cache.lengths + count_B.astype(jnp.int32))
