"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU and
attention over a static KV cache.

Attention has one visibility rule used everywhere (prefill, decode, tree verify,
draft-tree expansion): key slot ``s`` of sequence ``b`` is visible to query ``t`` iff

* ``s < prefix_len[b]`` (committed context, always visible), or
* ``0 <= s - prefix_len[b] < R`` and ``region_mask[b, t, s - prefix_len[b]]``

where the region is the ``R`` slots right after the committed prefix.  A causal
region mask gives prefill/decode, a tree mask gives verification.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.pallas_kernels import tree_attention

NEG_INF = float(jnp.finfo(jnp.float32).min)


def row_get(x_BxN, at_B):
    """``x[b, at[b]]`` for each row ``b`` (a negative index counts from the row's end, one out
    of range is clamped, as JAX's indexing does): a gather whose batch is the rows, which XLA's
    partitioner keeps on each row's device (one indexed by ``arange(B)`` it is not: it sends
    every row's indices and data to every device first)."""
    return jax.vmap(lambda x, at: x[at])(x_BxN, at_B)


def row_set(x_BxW, at_B, value_B):
    """``x[b, at[b]] = value[b]`` for each row ``b`` (``at``, ``value``: ``[B]`` or ``[B, P]``;
    an index past the row's end is dropped, a negative one counts from its end): a scatter
    whose batch is the rows (see :func:`row_get`)."""
    return jax.vmap(lambda x, at, value: x.at[at].set(value, mode="drop"))(x_BxW, at_B, value_B)


def rms_norm(x, weight, eps: float):
    """RMSNorm with the variance in float32 (as transformers' LlamaRMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(positions_BxT, inv_freq_D2):
    """cos/sin tables ``[B, T, D]`` in float32 for integer positions."""
    freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_D2
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BxTxNxD, cos_BxTxD, sin_BxTxD):
    """Rotate-half RoPE (the Hugging Face convention)."""
    half = x_BxTxNxD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxNxD[..., half:], x_BxTxNxD[..., :half]], axis=-1)
    cos = cos_BxTxD[:, :, None, :].astype(x_BxTxNxD.dtype)
    sin = sin_BxTxD[:, :, None, :].astype(x_BxTxNxD.dtype)
    return x_BxTxNxD * cos + rotated * sin


def swiglu(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None):
    gate = x @ w_gate + (0 if b_gate is None else b_gate)
    up = x @ w_up + (0 if b_up is None else b_up)
    out = (jax.nn.silu(gate) * up) @ w_down
    return out + (0 if b_down is None else b_down)


def visibility(prefix_len_B, region_mask_BxTxR, num_slots: int):
    """Boolean ``[B, T, S]``: which of ``num_slots`` key slots each query sees (see module doc).

    The reference statement of the rule; :func:`attention` computes the same attention
    without materialising it (tests compare the two)."""
    R = region_mask_BxTxR.shape[-1]
    rel_BxS = jnp.arange(num_slots)[None, :] - prefix_len_B[:, None]
    in_region = (rel_BxS >= 0) & (rel_BxS < R)
    idx = jnp.broadcast_to(jnp.clip(rel_BxS, 0, R - 1)[:, None, :], region_mask_BxTxR.shape[:2] + (num_slots,))
    region = jnp.take_along_axis(region_mask_BxTxR, idx, axis=2)
    return (rel_BxS < 0)[:, None, :] | (in_region[:, None, :] & region)


def attention_ref(q_BxTxNxD, k_BxSxKxD, v_BxSxKxD, visible_BxTxS, scale: float):
    """Grouped-query attention with an explicit visibility mask over all ``S`` slots; softmax
    in float32.  The reference twin of :func:`attention` (cost grows with ``S``)."""
    B, T, N, D = q_BxTxNxD.shape
    K = k_BxSxKxD.shape[2]
    q = q_BxTxNxD.reshape(B, T, K, N // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxD, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible_BxTxS[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxD)
    return out.reshape(B, T, N, D)


# Cache slots per step of the prefix walk: large enough that the loop's per-step cost is
# small next to its work, small enough that a short prefix reads little past its end
# (`eagle3-jax bench --cost` on 2 CPU cores: 64 beat 128 and 256 at batch 32, tied at batch 1).
PREFIX_BLOCK = 64
# On a GPU a step of the walk costs far more than its bytes: on an H200 (jax 0.11.2, batch 1,
# 8 KV heads of 128, bfloat16, 16 new tokens) the walk took 0.57 ms over 1024 slots (16 steps)
# and 1.59 ms over 4096 (64 steps), ~21 µs a step, against 0.14 ms for one pass over all 4096
# (scripts/device_check.sh, `bench` part).  21 µs is the time HBM (4.8 TB/s) reads
# ~100 MB in, so there a step moves that many bytes (keys, values and the float32 scores): a
# step's overhead then costs at most what its bytes do, and a small cache is read in one pass
# (a prefill, whose scores are large, still walks, in short steps: none for an empty prefix).
GPU_BLOCK_BYTES = 96 * 2 ** 20


def prefix_block(batch: int, kv_heads: int, head_dim: int, itemsize: int, rows: int = 1) -> int:
    """Cache slots per step of the prefix walk on the default backend: :data:`PREFIX_BLOCK`,
    or on a GPU as many as move :data:`GPU_BLOCK_BYTES`: per slot, a key and a value per KV
    head and a float32 score for each of its ``rows`` queries (new tokens × heads per KV head)."""
    if jax.default_backend() != "gpu":
        return PREFIX_BLOCK
    per_slot = batch * kv_heads * (2 * head_dim * itemsize + 4 * rows)
    return max(PREFIX_BLOCK, GPU_BLOCK_BYTES // per_slot)


def attention(q_BxTxNxD, kv, layer, prefix_len_B, k_new_BxTxKxD, v_new_BxTxKxD, region_mask_BxTxR, *,
              scale: float, region_kv=None, block: int | None = None):
    """Attention of ``T`` new queries over the committed prefix plus the region, computed
    blockwise: the cost follows the longest prefix in the batch (rounded up to ``block``
    slots, by default :func:`prefix_block`'s), not the cache's capacity.

    ``kv`` is the stacked ``(k_LxBxSxKxD, v_LxBxSxKxD)`` cache (read only: slots
    ``[0, prefix_len[b])`` of ``layer``) or ``None`` (no prefix).  The region is ``region_kv``
    (``(k_BxOxKxD, v_BxOxKxD)``: earlier draft-tree expansions, or ``None``) followed by the
    ``T`` new keys/values, which are passed in, not read back; ``region_mask[b, t, j]``
    (``R >= O + T`` columns; later ones are unused) says whether query ``t`` sees region
    slot ``j``.  Same result as :func:`attention_ref`
    under :func:`visibility`; one float32 online softmax over the prefix blocks and the region.
    """
    B, T, N, D = q_BxTxNxD.shape
    K = k_new_BxTxKxD.shape[2]
    q_BxTxKxGxD = q_BxTxNxD.reshape(B, T, K, N // K, D)
    k_reg, v_reg = k_new_BxTxKxD, v_new_BxTxKxD
    if region_kv is not None:
        k_reg = jnp.concatenate([region_kv[0], k_reg.astype(region_kv[0].dtype)], 1)
        v_reg = jnp.concatenate([region_kv[1], v_reg.astype(region_kv[1].dtype)], 1)
    mask_BxTxR = region_mask_BxTxR[..., : k_reg.shape[1]]

    # [B, K, T, G, ...]: the order XLA's dots produce (batch dims, then the query's free dims
    # as they stand in q), so that neither the scores nor the output need a transpose
    def scores(k_BxSxKxD, visible):  # visible broadcasts to [B, K, T, G, S]
        s = jnp.einsum("btkgd,bskd->bktgs", q_BxTxKxGxD, k_BxSxKxD, preferred_element_type=jnp.float32)
        return jnp.where(visible, s * scale, -jnp.inf)

    def update(state, s_BxKxTxGxS, v_BxSxKxD):
        m, l, acc = state
        m_new = jnp.maximum(m, s_BxKxTxGxS.max(-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing yet
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s_BxKxTxGxS - m_safe)
        pv = jnp.einsum("bktgs,bskd->bktgd", p.astype(v_BxSxKxD.dtype), v_BxSxKxD, preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(-1, keepdims=True), alpha * acc + pv

    G = N // K
    state = (jnp.full((B, K, T, G, 1), -jnp.inf, jnp.float32), jnp.zeros((B, K, T, G, 1), jnp.float32),
             jnp.zeros((B, K, T, G, D), jnp.float32))
    state = update(state, scores(k_reg, mask_BxTxR[:, None, :, None]), v_reg)
    if kv is not None:
        S = kv[0].shape[2]
        blk = min(block or prefix_block(B, K, D, kv[0].dtype.itemsize, rows=T * (N // K)), S)

        def walk_step(j, state):
            start = jnp.minimum(j * blk, S - blk)  # the last block ends at the cache's end
            at = (layer, 0, start, 0, 0)
            size = (1, B, blk) + kv[0].shape[3:]
            k_blk = jax.lax.dynamic_slice(kv[0], at, size)[0]
            v_blk = jax.lax.dynamic_slice(kv[1], at, size)[0]
            slot = start + jnp.arange(blk)
            visible_BxS = (slot[None] >= j * blk) & (slot[None] < prefix_len_B[:, None])  # not the previous block's
            return update(state, scores(k_blk, visible_BxS[:, None, None, None]), v_blk)

        # one pass over the whole cache, no loop, on a GPU only: XLA:CPU ran a one-trip loop
        # faster (tests/test_decode.py's 2000-row sampling test: 24 s, 91 s without the loop)
        if blk == S and jax.default_backend() == "gpu":
            state = walk_step(0, state)
        else:
            n_blocks = (jnp.max(prefix_len_B) + blk - 1) // blk
            state = jax.lax.fori_loop(0, n_blocks, walk_step, state)
    _, l, acc = state
    out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)  # [B, K, T, G, D]
    return out.transpose(0, 2, 1, 3, 4).reshape(B, T, N, D).astype(q_BxTxNxD.dtype)


ATTENTION_IMPLS = ("xla", "pallas", "pallas_interpret", "pallas_interpret_gpu")
_INTERPRET = {"pallas": None, "pallas_interpret": "tpu", "pallas_interpret_gpu": "gpu"}


def qkv(p, x_BxTxE, cos, sin, *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """Query/key/value heads with optional biases and q/k norms, RoPE applied to q and k."""
    B, T, _ = x_BxTxE.shape
    q = (x_BxTxE @ p["wq"] + p.get("bq", 0)).reshape(B, T, num_heads, head_dim)
    k = (x_BxTxE @ p["wk"] + p.get("bk", 0)).reshape(B, T, num_kv_heads, head_dim)
    v = (x_BxTxE @ p["wv"] + p.get("bv", 0)).reshape(B, T, num_kv_heads, head_dim)
    if "q_norm" in p:
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def self_attention(p, x_BxTxE, cos, sin, kv, layer, prefix_len_B, region_mask_BxTxR, *, num_heads: int,
                   num_kv_heads: int, head_dim: int, eps: float, impl: str = "xla", region_kv=None, write=None):
    """Projections (+ optional biases and q/k norms), RoPE and attention over the cache
    prefix plus the region (see :func:`attention`).

    ``kv`` is the stacked ``(k_LxBxSxKxD, v_LxBxSxKxD)`` cache, only read here, or ``None``
    (attend to the new tokens only).  The caller writes the returned new keys/values
    (``kv_cache.write``), after the layer scan, so the cache never travels through it; or
    ``write(kv, k_new, v_new) -> kv`` writes them *before* the prefix is read, and the
    written ``kv`` is returned in their place (a buffer read by a loop and then updated in
    place would be copied by XLA; updated first, it is not).
    ``impl="pallas"`` / ``"pallas_interpret[_gpu]"`` use the tree-attention kernel (no
    ``region_kv``).  Returns ``(out_BxTxH, (k_new_BxTxKxD, v_new_BxTxKxD))``.
    """
    B, T, _ = x_BxTxE.shape
    q, k, v = qkv(p, x_BxTxE, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps)
    if kv is not None:
        k, v = k.astype(kv[0].dtype), v.astype(kv[1].dtype)
        if write is not None:
            kv = write(kv, k, v)
    if impl == "xla":
        out = attention(q, kv, layer, prefix_len_B, k, v, region_mask_BxTxR, scale=head_dim ** -0.5,
                        region_kv=region_kv)
    elif impl in _INTERPRET:
        if region_kv is not None:
            raise ValueError(f"attention_impl={impl!r} does not take region_kv")
        # the kernel reads this layer of the stacked cache in place; without one, an empty prefix
        cache, prefix = ((k, v), jnp.zeros((B,), jnp.int32)) if kv is None else (kv, prefix_len_B)
        out = tree_attention.attention(q, *cache, prefix, k, v, region_mask_BxTxR, scale=head_dim ** -0.5,
                                       layer=None if kv is None else layer, interpret=_INTERPRET[impl])
    else:
        raise ValueError(f"attention_impl={impl!r}: expected one of {ATTENTION_IMPLS}")
    return out.reshape(B, T, -1) @ p["wo"] + p.get("bo", 0), (k, v) if write is None else kv


def causal_mask(batch: int, length: int):
    """``[B, T, T]`` lower-triangular region mask (prefill / chain)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
