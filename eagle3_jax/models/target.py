"""The target model: a Llama-family decoder in Flax NNX that returns logits and the
fused EAGLE-3 features ``[low | mid | high]`` (inputs of the three captured layers).

Decoder layers are stored stacked (leading axis = layer) and run under ``lax.scan``;
the captured layer inputs are picked up inside the scan, so no per-layer hidden
stack is materialised.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import layers
from eagle3_jax.config import RopeConfig, TargetConfig, integer
from eagle3_jax.kv_cache import KVCache, advance, capacity, init_cache, storage_dtype, write
from eagle3_jax.params import Declaration, ParamInfo, normal, ones, zeros


def declare(cfg: TargetConfig) -> Declaration:
    """Every parameter of the target, declared once (Flax layout, stacked layers first;
    ``None`` for parameters this family does not have): init, ``eval_shape``, sharding,
    loading and saving all derive from this table."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    NQ, NK, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    w, layer = normal(0.02), "model.layers.{layer}."
    opt = lambda flag, *a, **k: ParamInfo(*a, **k) if flag else None
    return Declaration(units={"heads": D, "kv_heads": D}, params={
        "embed": ParamInfo((V, H), ("vocab", "embed"), "model.embed_tokens.weight", w),
        "wq": ParamInfo((L, H, NQ), ("layers", "embed", "heads"), layer + "self_attn.q_proj.weight", w, True),
        "wk": ParamInfo((L, H, NK), ("layers", "embed", "kv_heads"), layer + "self_attn.k_proj.weight", w, True),
        "wv": ParamInfo((L, H, NK), ("layers", "embed", "kv_heads"), layer + "self_attn.v_proj.weight", w, True),
        "wo": ParamInfo((L, NQ, H), ("layers", "heads", "embed"), layer + "self_attn.o_proj.weight", w, True),
        "bq": opt(cfg.qkv_bias, (L, NQ), ("layers", "heads"), layer + "self_attn.q_proj.bias", zeros),
        "bk": opt(cfg.qkv_bias, (L, NK), ("layers", "kv_heads"), layer + "self_attn.k_proj.bias", zeros),
        "bv": opt(cfg.qkv_bias, (L, NK), ("layers", "kv_heads"), layer + "self_attn.v_proj.bias", zeros),
        "bo": opt(cfg.o_bias, (L, H), ("layers", "norm"), layer + "self_attn.o_proj.bias", zeros),
        "q_norm": opt(cfg.qk_norm, (L, D), ("layers", "norm"), layer + "self_attn.q_norm.weight", ones),
        "k_norm": opt(cfg.qk_norm, (L, D), ("layers", "norm"), layer + "self_attn.k_norm.weight", ones),
        "attn_norm": ParamInfo((L, H), ("layers", "norm"), layer + "input_layernorm.weight", ones),
        "mlp_norm": ParamInfo((L, H), ("layers", "norm"), layer + "post_attention_layernorm.weight", ones),
        "w_gate": ParamInfo((L, H, I), ("layers", "embed", "mlp"), layer + "mlp.gate_proj.weight", w, True),
        "w_up": ParamInfo((L, H, I), ("layers", "embed", "mlp"), layer + "mlp.up_proj.weight", w, True),
        "w_down": ParamInfo((L, I, H), ("layers", "mlp", "embed"), layer + "mlp.down_proj.weight", w, True),
        "b_gate": opt(cfg.mlp_bias, (L, I), ("layers", "mlp"), layer + "mlp.gate_proj.bias", zeros),
        "b_up": opt(cfg.mlp_bias, (L, I), ("layers", "mlp"), layer + "mlp.up_proj.bias", zeros),
        "b_down": opt(cfg.mlp_bias, (L, H), ("layers", "norm"), layer + "mlp.down_proj.bias", zeros),
        "norm": ParamInfo((H,), ("norm",), "model.norm.weight", ones),
        "lm_head": opt(not cfg.tie_word_embeddings, (H, V), ("embed", "vocab"), "lm_head.weight", w, True),
    })


def param_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...] | None]:
    """Every parameter's shape, ``None`` for parameters this family does not have (from :func:`declare`)."""
    return declare(cfg).shapes()


def logical_axes() -> dict[str, tuple[str, ...]]:
    """``{parameter: logical axes}`` for every parameter any target may have (from :func:`declare`)."""
    every = TargetConfig(family="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=1,
                         num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(), qkv_bias=True, o_bias=True,
                         mlp_bias=True, qk_norm=True)
    return {n: p.axes for n, p in declare(every).present()}


class Target(nnx.Module):
    """A Hugging Face Llama/Mistral/Qwen2/Qwen3 causal LM with EAGLE-3 feature capture.

    Build it with :func:`eagle3_jax.load_target`; ``Target(cfg, rngs=...)`` gives a
    randomly initialised model (tests, tiny experiments).
    """

    def declaration(self) -> Declaration:
        """This model's parameter declaration (shapes, logical axes, init), as :func:`declare` gives it."""
        return declare(self.config)

    def __init__(self, cfg: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 attention_impl: str = "xla", unroll_layers: bool = False):
        self.config = cfg
        self.dtype = dtype
        self.attention_impl = attention_impl
        # the layer scan unrolled: for cost analysis, which counts a loop's body once
        # (``eagle3_jax.topology``); the same computation either way
        self.unroll_layers = bool(unroll_layers)
        self.inv_freq = nnx.Variable(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)))
        rngs = rngs or nnx.Rngs(0)
        for name, value in declare(cfg).initial_values(dtype, rngs.params).items():
            setattr(self, name, None if value is None else nnx.Param(value))

    # ------------------------------------------------------------------ forward
    def __call__(self, tokens_BxT, positions_BxT, *, cache: KVCache | None = None, region_mask_BxTxR=None,
                 logits_at_B=None):
        """Runs ``T`` new tokens.

        Without a cache: plain causal forward over the tokens.  With a cache: the new
        keys/values are written at ``cache.lengths`` (not committed), the committed
        prefix is visible, and ``region_mask[b, t, j]`` says whether query ``t`` sees
        new token ``j`` (causal for prefill/decode, the tree mask for verification).

        Returns ``(logits_BxTxV float32, features_BxTx3H, cache)``; with ``logits_at_B``, the
        logits of token ``logits_at_B[b]`` of each sequence only (``[B, V]``: a prefill needs
        its last token's).
        """
        logits, features, new_kv = self.forward(tokens_BxT, positions_BxT, cache=cache, region_mask_BxTxR=region_mask_BxTxR,
                                                logits_at_B=logits_at_B)
        if cache is not None:
            cache = write(cache, *new_kv, cache.lengths)
        return logits, features, cache

    def forward(self, tokens_BxT, positions_BxT, *, cache: KVCache | None = None, region_mask_BxTxR=None,
                logits_at_B=None):
        """As ``__call__``, but the cache is only read: returns ``(logits_BxTxV, features_BxTx3H,
        (k_new_LxBxTxKxD, v_new_LxBxTxKxD))``, the new keys/values for the caller to write or
        commit (``kv_cache.write`` / ``kv_cache.commit``)."""
        hidden, features, new_kv = self.trunk(tokens_BxT, positions_BxT, cache=cache, region_mask_BxTxR=region_mask_BxTxR)
        if logits_at_B is not None:
            hidden = layers.row_get(hidden, logits_at_B)  # [B, H]
        return self.head(hidden), features, new_kv

    def trunk(self, tokens_BxT, positions_BxT, *, cache: KVCache | None = None, region_mask_BxTxR=None):
        """The decoder stack (the cache only read): ``(final-normed hidden_BxTxH, features_BxTx3H,
        (k_new_LxBxTxKxD, v_new_LxBxTxKxD))``."""
        cfg = self.config
        B, T = tokens_BxT.shape
        if region_mask_BxTxR is None:
            region_mask_BxTxR = layers.causal_mask(B, T)
        prefix = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
        cos, sin = layers.rope_cos_sin(positions_BxT, self.inv_freq[...])

        h = self.embed[...][tokens_BxT].astype(self.dtype)
        stacked = {n: getattr(self, n)[...] for n, p in declare(cfg).present() if p.stacked}
        # a captured layer (hit_L) writes its input into its slot of feats (slot_L), in place; the
        # others rewrite slot 0 as it is: one [B, T, H] slot a layer, not a select over all of them
        n = len(cfg.capture_layers)
        hit_L, slot_L = np.zeros(cfg.num_layers, bool), np.zeros(cfg.num_layers, np.int32)
        hit_L[list(cfg.capture_layers)], slot_L[list(cfg.capture_layers)] = True, np.arange(n)
        feats = jnp.zeros((n, B, T, cfg.hidden_size), self.dtype)
        kv = (cache.k, cache.v) if cache is not None else None  # read only inside the scan

        def layer(carry, xs):
            h, feats = carry
            i, hit, slot, p = xs
            kept = jax.lax.dynamic_index_in_dim(feats, slot, 0, keepdims=False)
            feats = jax.lax.dynamic_update_index_in_dim(feats, jnp.where(hit, h, kept), slot, 0)
            x = layers.rms_norm(h, p["attn_norm"], cfg.rms_norm_eps)
            a, new_kv = layers.self_attention(
                p, x, cos, sin, kv, i, prefix, region_mask_BxTxR, num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, impl=self.attention_impl)
            h = h + a
            x = layers.rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps)
            h = h + layers.swiglu(x, p["w_gate"], p["w_up"], p["w_down"], p.get("b_gate"), p.get("b_up"), p.get("b_down"))
            return (h, feats), new_kv

        xs = (jnp.arange(cfg.num_layers), jnp.asarray(hit_L), jnp.asarray(slot_L), stacked)
        (h, feats), (k_new, v_new) = jax.lax.scan(layer, (h, feats), xs, unroll=self.unroll_layers or 1)
        h = layers.rms_norm(h, self.norm[...], cfg.rms_norm_eps)
        features = jnp.concatenate(list(feats), axis=-1)
        return h, features, (k_new, v_new)

    def head(self, hidden_BxTxH):
        """float32 logits from the final-normed hidden (tied embeddings when there is no lm_head)."""
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("...h,hv->...v", hidden_BxTxH, head, preferred_element_type=jnp.float32)

    # ------------------------------------------------------------------ helpers
    def _check_positions(self, n: int, name: str):
        """``ValueError`` naming ``name`` when ``n`` positions pass the model's context."""
        if n > self.config.max_position_embeddings:
            raise ValueError(f"{name}: {n} positions exceed the target's max_position_embeddings "
                             f"({self.config.max_position_embeddings})")

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache with room for ``max_len`` tokens per sequence (more slots where a
        Pallas kernel reads it: ``kv_cache.capacity``)."""
        cfg = self.config
        if cfg.sliding_window is not None and max_len > cfg.sliding_window:
            raise ValueError(f"max_len={max_len} exceeds the model's sliding_window={cfg.sliding_window}; "
                             "sliding-window attention is not implemented")
        return init_cache(cfg.num_layers, batch, capacity(max_len, self.attention_impl), cfg.num_kv_heads,
                          cfg.head_dim, self.cache_dtype)

    @property
    def cache_dtype(self):
        """The dtype of this model's KV cache (``kv_cache.storage_dtype``)."""
        return storage_dtype(self.dtype, self.attention_impl)

    def prefill(self, tokens_BxT, lengths_B, max_len: int):
        """Runs right-padded prompts into a fresh cache of ``max_len`` slots.

        Returns ``(logits_BxTxV, features_BxTx3H, cache)`` with ``cache.lengths = lengths``.
        """
        tokens = _host_ids(tokens_BxT, "tokens")
        lengths = _host_ids(lengths_B, "lengths")
        if integer(max_len) is None:
            raise TypeError(f"max_len must be an integer, got {type(max_len).__name__} {max_len!r}")
        max_len = integer(max_len)
        if tokens.ndim != 2 or not tokens.size:
            raise ValueError(f"tokens: expected a non-empty [B, T], got shape {tokens.shape}")
        if not np.issubdtype(lengths.dtype, np.integer):
            raise TypeError(f"lengths must be integers, got dtype {lengths.dtype}")
        if lengths.shape != tokens.shape[:1]:
            raise ValueError(f"lengths: expected shape ({tokens.shape[0]},) to match tokens' batch, got {lengths.shape}")
        if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
            raise ValueError(f"lengths: each must be in [1, {tokens.shape[1]}], got {lengths.tolist()}")
        if tokens.shape[1] > max_len:
            raise ValueError(f"prompt of {tokens.shape[1]} tokens does not fit a cache of max_len={max_len}")
        self._check_positions(tokens.shape[1], "tokens")
        check_token_ids(tokens, self.config.vocab_size, "tokens")
        cache = self.init_cache(tokens.shape[0], max_len)
        return _prefill_jit(*nnx.split(self), cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32))

    def decode_step(self, cache: KVCache, tokens_B):
        """Appends one token per sequence (position = current length); returns ``(logits_BxV, features_Bx3H, cache)``.

        ``cache`` is consumed (its buffers are donated: the step writes it in place): pass the
        returned cache to the next call.  The caller keeps every length below the cache's
        ``max_len``: the lengths live on the device, so a step on a full cache is not checked
        (``generate`` sizes its caches for the whole request)."""
        _check_live(cache)
        tokens = _token_arg(tokens_B, self.config.vocab_size, "tokens")
        if tokens.shape != (cache.batch,):
            raise ValueError(f"tokens: expected shape ({cache.batch},), got {tokens.shape}")
        return _decode_jit(*nnx.split(self), cache, tokens)

    def tree_forward(self, cache: KVCache, tokens_BxN, depth_BxN, tree_mask_BxNxN):
        """Runs a draft tree at positions ``lengths + depth`` under ``tree_mask`` (not committed).

        The new slots hold the tree's keys/values; :func:`eagle3_jax.kv_cache.commit`
        keeps the accepted ones.  Returns ``(logits_BxNxV, features_BxNx3H, cache)``; ``cache``
        is consumed, as in :meth:`decode_step`.
        """
        _check_live(cache)
        tokens = _token_arg(tokens_BxN, self.config.vocab_size, "tokens")
        if tokens.shape[0] != cache.batch or depth_BxN.shape != tokens.shape or tree_mask_BxNxN.shape != tokens.shape + tokens.shape[-1:]:
            raise ValueError(f"tree_forward: tokens {tokens.shape}, depth {depth_BxN.shape} and mask "
                             f"{tree_mask_BxNxN.shape} must be [B, N], [B, N], [B, N, N] with B={cache.batch}")
        return _tree_jit(*nnx.split(self), cache, tokens, jnp.asarray(depth_BxN, jnp.int32), jnp.asarray(tree_mask_BxNxN, bool))

    def features(self, input_ids):
        """Full causal forward over ``input_ids`` ``[T]`` or ``[B, T]``.

        Returns ``(logits, features)``: float32 logits ``[..., T, V]`` and the fused
        EAGLE-3 features ``[..., T, 3H]`` (inputs of the captured layers, low first).
        """
        ids = _host_ids(input_ids, "input_ids")
        squeeze = ids.ndim == 1
        ids = ids[None] if squeeze else ids
        if ids.ndim != 2:
            raise ValueError(f"input_ids: expected [T] or [B, T], got shape {ids.shape}")
        if not ids.size:
            raise ValueError(f"input_ids is empty (shape {ids.shape})")
        self._check_positions(ids.shape[1], "input_ids")
        check_token_ids(ids, self.config.vocab_size, "input_ids")
        logits, feats = _features_jit(*nnx.split(self), jnp.asarray(ids, jnp.int32))
        return (logits[0], feats[0]) if squeeze else (logits, feats)


@functools.partial(jax.jit, static_argnums=0)
def _features_jit(graphdef, state, ids_BxT):
    model = nnx.merge(graphdef, state)
    pos = jnp.broadcast_to(jnp.arange(ids_BxT.shape[1]), ids_BxT.shape)
    logits, feats, _ = model(ids_BxT, pos)
    return logits, feats


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _prefill_jit(graphdef, state, cache, tokens_BxT, lengths_B):
    pos = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    logits, feats, cache = nnx.merge(graphdef, state)(tokens_BxT, pos, cache=cache)
    return logits, feats, advance(cache, lengths_B)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _decode_jit(graphdef, state, cache, tokens_B):
    logits, feats, cache = nnx.merge(graphdef, state)(tokens_B[:, None], cache.lengths[:, None], cache=cache)
    return logits[:, 0], feats[:, 0], advance(cache, jnp.ones_like(cache.lengths))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _tree_jit(graphdef, state, cache, tokens_BxN, depth_BxN, mask_BxNxN):
    pos = cache.lengths[:, None] + depth_BxN
    return nnx.merge(graphdef, state)(tokens_BxN, pos, cache=cache, region_mask_BxTxR=mask_BxNxN)


def check_token_ids(ids: np.ndarray, vocab_size: int, name: str):
    """``ValueError`` / ``TypeError`` naming ``name`` unless every id is an integer in ``[0, vocab_size)``."""
    if ids.size and not np.issubdtype(ids.dtype, np.integer):  # floats would be truncated, booleans read as 0/1
        raise TypeError(f"{name}: token ids must be integers, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got range [{ids.min()}, {ids.max()}]")


def _host_ids(x, name: str) -> np.ndarray:
    """``x`` as a numpy array; a ragged nesting is a ``ValueError`` naming ``name``."""
    try:
        return np.asarray(x)
    except ValueError:
        raise ValueError(f"{name}: expected a rectangular array of integers (rows of one length)") from None


def _token_arg(x, vocab_size: int, name: str) -> jax.Array:
    """Token ids for a step as int32: host data checked like a prompt's ids; a device array
    (e.g. the previous step's argmax) checked for an integer dtype only (its values would
    need a transfer)."""
    if isinstance(x, jax.Array):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}: token ids must be integers, got dtype {x.dtype}")
        return x.astype(jnp.int32)
    ids = _host_ids(x, name)
    check_token_ids(ids, vocab_size, name)
    return jnp.asarray(ids, jnp.int32)


def _check_live(cache: KVCache):
    """``ValueError`` when ``cache``'s buffers were donated to an earlier call (under a trace,
    as inside a caller's ``jit``, there are no buffers to check)."""
    arrays = (cache.k, cache.v, cache.lengths)
    if any(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.is_deleted() for a in arrays):
        raise ValueError("cache: this cache was consumed by an earlier prefill/decode_step/tree_forward call (its "
                         "buffers are donated and written in place); pass the cache that call returned")
