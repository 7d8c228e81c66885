"""The EAGLE-3 drafter: ``fc`` fusion of the target's three features, then one
decoder layer whose attention input is ``[input_layernorm(embed) ; hidden_norm(h)]``
(embedding first), with the residual taken from the un-normed ``h``.

Step 0 of a draft feeds fused target features (width ``3·H_target``, through ``fc``);
later steps feed the drafter's own pre-norm output (width ``H``, no ``fc``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax import layers
from eagle3_jax.config import DrafterConfig, RopeConfig
from eagle3_jax.kv_cache import KVCache, by_rows, init_cache, storage_dtype, write
from eagle3_jax.params import Declaration, ParamInfo, fan_in_normal, ones


class Frozen(nnx.Variable):
    """Arrays the drafter uses but never trains: the shared embedding and the vocab map."""


def declare(cfg: DrafterConfig) -> Declaration:
    """Every parameter of the drafter, declared once, in the official EAGLE-3 state-dict
    names (Flax layout); init, ``eval_shape``, sharding, loading and saving derive from it.
    ``embed`` is the target's table unless the checkpoint brings ``embed_tokens.weight``."""
    H, I, F = cfg.hidden_size, cfg.intermediate_size, 3 * cfg.target_hidden_size
    NQ, NK, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    w, m = fan_in_normal, "midlayer."
    return Declaration(units={"heads": D, "kv_heads": D}, params={
        "fc": ParamInfo((F, H), ("fused", "embed"), "fc.weight", w, True),
        "hidden_norm": ParamInfo((H,), ("norm",), m + "hidden_norm.weight", ones),
        "input_norm": ParamInfo((H,), ("norm",), m + "input_layernorm.weight", ones),
        "post_norm": ParamInfo((H,), ("norm",), m + "post_attention_layernorm.weight", ones),
        "wq": ParamInfo((2 * H, NQ), ("fused", "heads"), m + "self_attn.q_proj.weight", w, True),
        "wk": ParamInfo((2 * H, NK), ("fused", "kv_heads"), m + "self_attn.k_proj.weight", w, True),
        "wv": ParamInfo((2 * H, NK), ("fused", "kv_heads"), m + "self_attn.v_proj.weight", w, True),
        "wo": ParamInfo((NQ, H), ("heads", "embed"), m + "self_attn.o_proj.weight", w, True),
        "w_gate": ParamInfo((H, I), ("embed", "mlp"), m + "mlp.gate_proj.weight", w, True),
        "w_up": ParamInfo((H, I), ("embed", "mlp"), m + "mlp.up_proj.weight", w, True),
        "w_down": ParamInfo((I, H), ("mlp", "embed"), m + "mlp.down_proj.weight", w, True),
        "norm": ParamInfo((H,), ("norm",), "norm.weight", ones),
        "lm_head": ParamInfo((H, cfg.draft_vocab_size), ("embed", "draft_vocab"), "lm_head.weight", w, True),
        "embed": ParamInfo((cfg.vocab_size, H), ("vocab", "embed"), "embed_tokens.weight", None, frozen=True),
    })


def param_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The trainable parameters' shapes (from :func:`declare`)."""
    return {n: p.shape for n, p in declare(cfg).present() if not p.frozen}


def logical_axes() -> dict[str, tuple[str, ...]]:
    """``{parameter: logical axes}`` of the drafter (from :func:`declare`)."""
    cfg = DrafterConfig(vocab_size=8, draft_vocab_size=8, hidden_size=8, intermediate_size=8, num_heads=1,
                        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(), target_hidden_size=8)
    return {n: p.axes for n, p in declare(cfg).present()}


class Drafter(nnx.Module):
    """EAGLE-3 draft head.  ``embed`` is the target's (frozen) embedding table unless
    the checkpoint carried its own (``own_embedding``)."""

    def __init__(self, cfg: DrafterConfig, embed_VxH, *, d2t=None, own_embedding: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = cfg
        self.dtype = dtype
        self.own_embedding = own_embedding
        rngs = rngs or nnx.Rngs(0)
        decl = declare(cfg)
        for name, value in decl.initial_values(dtype, rngs.params, given={"embed": embed_VxH}).items():
            setattr(self, name, (Frozen if decl.params[name].frozen else nnx.Param)(value))
        d2t = jnp.zeros((cfg.draft_vocab_size,), jnp.int32) if d2t is None else jnp.asarray(d2t, jnp.int32)
        self.d2t = Frozen(d2t)
        self.inv_freq = Frozen(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)))

    def __call__(self, hidden_BxTxF, tokens_BxT, positions_BxT, *, cache: KVCache | None = None,
                 region_mask_BxTxR=None, write_offset: int = 0):
        """One drafter step over ``T`` tokens; returns ``(out_hidden_BxTxH pre-norm, cache)``.

        Attention follows :func:`eagle3_jax.layers.visibility`: the committed drafter
        context is visible, and the region mask covers the slots right after it.  New
        keys are written at ``cache.lengths + write_offset`` (the ``write_offset`` slots
        before them belong to the region; the committed length is not advanced).
        """
        region_kv = write_kv = None
        if cache is not None:
            if write_offset:
                slots_BxO = cache.lengths[:, None] + jnp.arange(write_offset)[None]

                def region(k, v, slots_BxO):  # [1, B, O, K, D]: each sequence's own slots
                    b = jnp.arange(slots_BxO.shape[0])[:, None]
                    return k[:1, b, slots_BxO], v[:1, b, slots_BxO]

                region_kv = tuple(x[0] for x in by_rows(cache, region, cache.k, cache.v, slots_BxO))
            at_B = cache.lengths + write_offset

            def write_kv(kv, k_new, v_new):
                written = write(dataclasses.replace(cache, k=kv[0], v=kv[1]), k_new[None], v_new[None], at_B)
                return written.k, written.v

        h, kv = self.step(hidden_BxTxF, tokens_BxT, positions_BxT, cache=cache, region_mask_BxTxR=region_mask_BxTxR,
                          region_kv=region_kv, _write=write_kv)
        return h, None if cache is None else dataclasses.replace(cache, k=kv[0], v=kv[1])

    def step(self, hidden_BxTxF, tokens_BxT, positions_BxT, *, cache: KVCache | None = None,
             region_mask_BxTxR=None, region_kv=None, _write=None):
        """The drafter step without a cache write: the committed context of ``cache`` (read
        only), then the region ``region_kv`` (earlier keys/values ``[B, O, K, D]``, e.g. the
        beams of earlier tree expansions) and the ``T`` new tokens under ``region_mask``.
        Returns ``(out_hidden_BxTxH pre-norm, (k_new_BxTxKxD, v_new_BxTxKxD))``."""
        cfg = self.config
        B, T = tokens_BxT.shape
        h = self.fuse(hidden_BxTxF)
        if region_mask_BxTxR is None:
            region_mask_BxTxR = layers.causal_mask(B, T)
        prefix = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
        cos, sin = self.rope(positions_BxT)
        kv = None if cache is None else (cache.k, cache.v)
        a, new_kv = layers.self_attention(
            self.attn_params(), self.layer_input(h, tokens_BxT), cos, sin, kv, 0, prefix, region_mask_BxTxR,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
            region_kv=region_kv, write=_write)
        return self.layer_output(h, a), new_kv

    # The pieces of the layer, shared with training-time test (train/ttt.py).
    def fuse(self, hidden_BxTxF):
        """``fc`` on fused target features (width 3·H_target); the drafter's own output passes as is."""
        cfg = self.config
        h = hidden_BxTxF.astype(self.dtype)
        if h.shape[-1] == 3 * cfg.target_hidden_size and h.shape[-1] != cfg.hidden_size:
            return h @ self.fc[...]
        if h.shape[-1] != cfg.hidden_size:
            raise ValueError(f"drafter hidden input: width {h.shape[-1]} is neither 3*target_hidden "
                             f"({3 * cfg.target_hidden_size}) nor hidden ({cfg.hidden_size})")
        return h

    def rope(self, positions_BxT):
        return layers.rope_cos_sin(positions_BxT, self.inv_freq[...])

    def attn_params(self):
        """The attention block's parameters (those declared under ``midlayer.self_attn.``), by name."""
        return {n: getattr(self, n)[...] for n, p in declare(self.config).present()
                if p.checkpoint.startswith("midlayer.self_attn.")}

    def layer_input(self, h_BxTxH, tokens_BxT):
        """``[input_layernorm(embed(tokens)) ; hidden_norm(h)]`` — embedding first."""
        eps = self.config.rms_norm_eps
        e = self.embed[...][tokens_BxT]
        return jnp.concatenate([layers.rms_norm(e, self.input_norm[...], eps), layers.rms_norm(h_BxTxH, self.hidden_norm[...], eps)], -1)

    def layer_output(self, h_BxTxH, attn_out_BxTxH):
        """Residual from the un-normed ``h``, then the SwiGLU MLP block; returns pre-norm ``h``."""
        h = h_BxTxH + attn_out_BxTxH
        return h + layers.swiglu(layers.rms_norm(h, self.post_norm[...], self.config.rms_norm_eps),
                                 self.w_gate[...], self.w_up[...], self.w_down[...])

    def logits(self, out_hidden):
        """Draft-vocabulary logits (float32) from the pre-norm output."""
        h = layers.rms_norm(out_hidden, self.norm[...], self.config.rms_norm_eps)
        return jnp.einsum("...h,hv->...v", h, self.lm_head[...], preferred_element_type=jnp.float32)

    def to_target_ids(self, draft_ids):
        """``target_id = draft_id + d2t[draft_id]`` (identity when there is no mapping)."""
        return draft_ids + self.d2t[...][draft_ids] if self.config.has_vocab_map else draft_ids

    @property
    def t2d(self):
        """Boolean ``[vocab]``: which target ids the draft vocabulary covers."""
        cfg = self.config
        ids = self.to_target_ids(jnp.arange(cfg.draft_vocab_size))
        return jnp.zeros((cfg.vocab_size,), bool).at[ids].set(True)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.config
        return init_cache(1, batch, max_len, cfg.num_kv_heads, cfg.head_dim, storage_dtype(self.dtype))
