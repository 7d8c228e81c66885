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

NEG_INF = float(jnp.finfo(jnp.float32).min)


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
    """Boolean ``[B, T, S]``: which of ``num_slots`` key slots each query sees (see module doc)."""
    R = region_mask_BxTxR.shape[-1]
    rel_BxS = jnp.arange(num_slots)[None, :] - prefix_len_B[:, None]
    in_region = (rel_BxS >= 0) & (rel_BxS < R)
    idx = jnp.broadcast_to(jnp.clip(rel_BxS, 0, R - 1)[:, None, :], region_mask_BxTxR.shape[:2] + (num_slots,))
    region = jnp.take_along_axis(region_mask_BxTxR, idx, axis=2)
    return (rel_BxS < 0)[:, None, :] | (in_region[:, None, :] & region)


def attention_xla(q_BxTxNxD, k_BxSxKxD, v_BxSxKxD, visible_BxTxS, scale: float):
    """Grouped-query attention with an explicit visibility mask; softmax in float32."""
    B, T, N, D = q_BxTxNxD.shape
    K = k_BxSxKxD.shape[2]
    q = q_BxTxNxD.reshape(B, T, K, N // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxD, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible_BxTxS[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxD)
    return out.reshape(B, T, N, D)


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


def self_attention(p, x_BxTxE, cos, sin, visible_BxTxS, kv, layer, write_at_B, *, num_heads: int,
                   num_kv_heads: int, head_dim: int, eps: float, impl: str = "xla", region_mask_BxTxT=None):
    """Projections (+ optional biases and q/k norms), RoPE, cache write and attention.

    ``kv`` is the stacked ``(k_LxBxSxKxD, v_LxBxSxKxD)`` cache, written only at the new
    rows of ``layer``, or ``None`` (attend to the new tokens only).
    ``impl="pallas"`` / ``"pallas_interpret[_gpu]"`` use the tree-attention kernel, which needs
    the new tokens written right after the prefix (``write_at == prefix``) and their
    ``[T, T]`` region mask.  Returns ``(out_BxTxH, kv)``.
    """
    B, T, _ = x_BxTxE.shape
    q, k, v = qkv(p, x_BxTxE, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps)
    if kv is not None:
        kv = (write_kv(kv[0], k, layer, write_at_B), write_kv(kv[1], v, layer, write_at_B))
    if impl == "xla":
        k_all, v_all = (k, v) if kv is None else (kv[0][layer], kv[1][layer])
        out = attention_xla(q, k_all, v_all, visible_BxTxS, head_dim ** -0.5)
    elif impl in _INTERPRET:
        from pallas_kernels import tree_attention

        # the kernel reads this layer of the stacked cache in place; without one, an empty prefix
        cache, prefix = ((k, v), jnp.zeros((B,), jnp.int32)) if kv is None else (kv, write_at_B)
        out = tree_attention.attention(q, *cache, prefix, k, v, region_mask_BxTxT, scale=head_dim ** -0.5,
                                       layer=None if kv is None else layer, interpret=_INTERPRET[impl])
    else:
        raise ValueError(f"attention_impl={impl!r}: expected one of {ATTENTION_IMPLS}")
    return out.reshape(B, T, -1) @ p["wo"] + p.get("bo", 0), kv


def write_kv(cache_LxBxSxKxD, new_BxTxKxD, layer, write_at_B):
    """Writes ``T`` new rows per sequence at ``[layer, b, write_at[b] + [0, T)]``."""
    B, T = new_BxTxKxD.shape[:2]
    slots_BxT = write_at_B[:, None] + jnp.arange(T)[None, :]
    return cache_LxBxSxKxD.at[layer, jnp.arange(B)[:, None], slots_BxT].set(new_BxTxKxD.astype(cache_LxBxSxKxD.dtype))


def causal_mask(batch: int, length: int):
    """``[B, T, T]`` lower-triangular region mask (prefill / chain)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
