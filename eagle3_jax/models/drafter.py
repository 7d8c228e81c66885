"""The EAGLE-3 drafter: ``fc`` fusion of the target's captured features, then decoder
layers; the first one's attention input is ``[input_layernorm(embed) ; hidden_norm(h)]``
(embedding first), with the residual taken from the un-normed ``h``.

Step 0 of a draft feeds fused target features (width ``num_captured·H_target``, through
``fc``); later steps feed the drafter's own output (width ``H``, no ``fc``).

The official drafter is the default (one Llama layer, three captured layers).  vLLM's
``speculators`` drafters add, each declared below and switched by its
:class:`~eagle3_jax.config.DrafterConfig` field: more decoder layers (plain ones after the
first, ``layers.1``, ``layers.2``, …), Qwen3 layers (q/k norms), sliding-window layers, any
number of captured layers, ``norm_before_residual`` (the first layer's residual is
``hidden_norm(h)``), ``norm_before_fc`` (one RMSNorm over the concatenated features,
``input_norm``), ``fc_norm`` (an RMSNorm per captured layer, ``fc_norm.{i}``) and
``norm_output`` (the output hidden is ``norm(h)``: it is what is fed back, and the logits are
``lm_head`` of it without a second norm).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from eagle3_jax import layers
from eagle3_jax.config import DrafterConfig, RopeConfig
from eagle3_jax.kv_cache import KVCache, by_rows, constrain_hidden, init_cache, storage_dtype, write
from eagle3_jax.params import Declaration, ParamInfo, fan_in_normal, ones


class Frozen(nnx.Variable):
    """Arrays the drafter uses but never trains: the shared embedding and the vocab map."""


# The decoder layers after the first (stacked, checkpoint ``layers.{i}``, i >= 1): parameter
# name → (the first layer's parameter it mirrors, checkpoint suffix).
_REST = {
    "rest_input_norm": ("input_norm", "input_layernorm.weight"),
    "rest_post_norm": ("post_norm", "post_attention_layernorm.weight"),
    "rest_wq": ("wq", "self_attn.q_proj.weight"),
    "rest_wk": ("wk", "self_attn.k_proj.weight"),
    "rest_wv": ("wv", "self_attn.v_proj.weight"),
    "rest_q_norm": ("q_norm", "self_attn.q_norm.weight"),
    "rest_k_norm": ("k_norm", "self_attn.k_norm.weight"),
    "rest_wo": ("wo", "self_attn.o_proj.weight"),
    "rest_w_gate": ("w_gate", "mlp.gate_proj.weight"),
    "rest_w_up": ("w_up", "mlp.up_proj.weight"),
    "rest_w_down": ("w_down", "mlp.down_proj.weight"),
}
_ATTN = ("wq", "wk", "wv", "q_norm", "k_norm", "wo")


def declare(cfg: DrafterConfig) -> Declaration:
    """Every parameter of the drafter, declared once, in the official EAGLE-3 state-dict
    names (Flax layout); init, ``eval_shape``, sharding, loading and saving derive from it.
    ``embed`` is the target's table unless the checkpoint brings ``embed_tokens.weight``.
    Parameters a configuration lacks are declared ``None`` (the switches' norms, q/k norms
    of Llama layers, the layers after the first of a one-layer drafter)."""
    H, I, F, Ht = cfg.hidden_size, cfg.intermediate_size, cfg.fused_width, cfg.target_hidden_size
    NQ, NK, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    w, m, qk = fan_in_normal, "midlayer.", cfg.qk_norm
    first = {
        "input_norm": ParamInfo((H,), ("norm",), m + "input_layernorm.weight", ones),
        "post_norm": ParamInfo((H,), ("norm",), m + "post_attention_layernorm.weight", ones),
        "wq": ParamInfo((2 * H, NQ), ("fused", "heads"), m + "self_attn.q_proj.weight", w, True),
        "wk": ParamInfo((2 * H, NK), ("fused", "kv_heads"), m + "self_attn.k_proj.weight", w, True),
        "wv": ParamInfo((2 * H, NK), ("fused", "kv_heads"), m + "self_attn.v_proj.weight", w, True),
        "q_norm": ParamInfo((D,), ("head_dim",), m + "self_attn.q_norm.weight", ones) if qk else None,
        "k_norm": ParamInfo((D,), ("head_dim",), m + "self_attn.k_norm.weight", ones) if qk else None,
        "wo": ParamInfo((NQ, H), ("heads", "embed"), m + "self_attn.o_proj.weight", w, True),
        "w_gate": ParamInfo((H, I), ("embed", "mlp"), m + "mlp.gate_proj.weight", w, True),
        "w_up": ParamInfo((H, I), ("embed", "mlp"), m + "mlp.up_proj.weight", w, True),
        "w_down": ParamInfo((I, H), ("mlp", "embed"), m + "mlp.down_proj.weight", w, True),
    }
    rest = {}
    for name, (mirror, suffix) in _REST.items():
        p = first[mirror]
        shape = (H, NQ) if name == "rest_wq" else (H, NK) if name in ("rest_wk", "rest_wv") else None
        rest[name] = None if p is None or cfg.num_layers == 1 else dataclasses.replace(
            p, shape=(cfg.num_layers - 1, *(shape or p.shape)), axes=("layers", "embed" if shape else p.axes[0], *p.axes[1:]),
            checkpoint="layers.{layer}." + suffix, first=1)
    return Declaration(units={"heads": D, "kv_heads": D}, params={
        "in_norm": ParamInfo((F,), ("norm",), "input_norm.weight", ones) if cfg.norm_before_fc else None,
        "fc_norms": ParamInfo((cfg.num_captured, Ht), ("captured", "norm"), "fc_norm.{layer}.weight", ones)
        if cfg.fc_norm else None,
        "fc": ParamInfo((F, H), ("fused", "embed"), "fc.weight", w, True),
        "hidden_norm": ParamInfo((H,), ("norm",), m + "hidden_norm.weight", ones),
        **first,
        **rest,
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
                        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(), target_hidden_size=8,
                        num_layers=2, layer_family="qwen3", fc_norm=True)
    every = {**declare(cfg).params, **declare(dataclasses.replace(cfg, fc_norm=False, norm_before_fc=True)).params}
    return {n: p.axes for n, p in every.items() if p is not None}


class Drafter(nnx.Module):
    """EAGLE-3 draft head.  ``embed`` is the target's (frozen) embedding table unless
    the checkpoint carried its own (``own_embedding``)."""

    def declaration(self) -> Declaration:
        """This model's parameter declaration (shapes, logical axes, init), as :func:`declare` gives it."""
        return declare(self.config)

    def __init__(self, cfg: DrafterConfig, embed_VxH, *, d2t=None, own_embedding: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.config = cfg
        self.dtype = dtype
        self.own_embedding = own_embedding
        rngs = rngs or nnx.Rngs(0)
        decl = declare(cfg)
        for name, value in decl.initial_values(dtype, rngs.params, given={"embed": embed_VxH}).items():
            setattr(self, name, None if value is None else (Frozen if decl.params[name].frozen else nnx.Param)(value))
        d2t = jnp.zeros((cfg.draft_vocab_size,), jnp.int32) if d2t is None else jnp.asarray(d2t, jnp.int32)
        self.d2t = Frozen(d2t)
        self.inv_freq = Frozen(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)))

    def __call__(self, hidden_BxTxF, tokens_BxT, positions_BxT, *, cache: KVCache | None = None,
                 region_mask_BxTxR=None, write_offset: int = 0):
        """One drafter step over ``T`` tokens; returns ``(out_hidden_BxTxH, cache)`` (the
        hidden fed back: pre-norm, or normed with ``norm_output``).

        Attention follows :func:`eagle3_jax.layers.visibility`: the committed drafter
        context is visible, and the region mask covers the slots right after it.  New
        keys are written at ``cache.lengths + write_offset`` (the ``write_offset`` slots
        before them belong to the region; the committed length is not advanced).
        """
        L = self.config.num_layers
        region_kv = write_kv = None
        if cache is not None:
            if write_offset:
                slots_BxO = cache.lengths[:, None] + jnp.arange(write_offset)[None]

                def region(k, v, slots_BxO):  # [L, B, O, K, D]: each sequence's own slots
                    b = jnp.arange(slots_BxO.shape[0])[:, None]
                    return k[:, b, slots_BxO], v[:, b, slots_BxO]

                region_kv = by_rows(cache, region, cache.k, cache.v, slots_BxO)
                region_kv = tuple(x[0] for x in region_kv) if L == 1 else region_kv
            at_B = cache.lengths + write_offset

            def write_kv(kv, k_new, v_new):
                written = write(dataclasses.replace(cache, k=kv[0], v=kv[1]), k_new[None] if L == 1 else k_new,
                                v_new[None] if L == 1 else v_new, at_B)
                return written.k, written.v

        h, kv = self.step(hidden_BxTxF, tokens_BxT, positions_BxT, cache=cache, region_mask_BxTxR=region_mask_BxTxR,
                          region_kv=region_kv, _write=write_kv)
        if cache is not None and L > 1:  # several layers: the new keys/values written after the step
            kv = write_kv((cache.k, cache.v), *kv)
        return h, None if cache is None else dataclasses.replace(cache, k=kv[0], v=kv[1])

    def step(self, hidden_BxTxF, tokens_BxT, positions_BxT, *, cache: KVCache | None = None,
             region_mask_BxTxR=None, region_kv=None, _write=None):
        """The drafter step without a cache write: the committed context of ``cache`` (read
        only), then the region ``region_kv`` (earlier keys/values ``[B, O, K, D]``, e.g. the
        beams of earlier tree expansions; ``[L, B, O, K, D]`` for ``L > 1`` layers) and the
        ``T`` new tokens under ``region_mask``.  Returns ``(out_hidden_BxTxH, (k_new, v_new))``:
        ``[B, T, K, D]`` each (``[L, B, T, K, D]`` for ``L > 1`` layers).  ``_write``
        (one layer only) writes the new keys/values into the cache before its prefix is read
        and gets the written cache back in their place."""
        cfg = self.config
        L = cfg.num_layers
        B, T = tokens_BxT.shape
        # on a mesh, the activations keep the hidden dimension split as the weights do (the cache
        # says how): else each device's rows would gather every weight whole
        h = constrain_hidden(self.fuse(constrain_hidden(hidden_BxTxF, cache)), cache)
        if region_mask_BxTxR is None:
            region_mask_BxTxR = layers.causal_mask(B, T)
        prefix = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
        cos, sin = self.rope(positions_BxT)
        kv = None if cache is None else (cache.k, cache.v)
        new = []
        for i in range(L):
            reg = None if region_kv is None else region_kv if L == 1 else (region_kv[0][i], region_kv[1][i])
            x = constrain_hidden(self.attn_input(i, h, tokens_BxT), cache)
            a, new_kv = layers.self_attention(
                self.attn_params(i), x, cos, sin, kv, i, prefix, region_mask_BxTxR,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
                region_kv=reg, write=_write if L == 1 else None)
            h = self.attn_output(i, h, a)
            new.append(new_kv)
        out = self.finish(h)
        if L == 1:
            return out, new[0]
        return out, (jnp.stack([k for k, _ in new]), jnp.stack([v for _, v in new]))

    # The pieces of the layers, shared with training-time test (train/ttt.py).
    def fuse(self, hidden_BxTxF):
        """``fc`` on fused target features (width ``num_captured·H_target``; first the one
        norm over them with ``norm_before_fc``, or a norm per captured layer with ``fc_norm``);
        the drafter's own output passes as is."""
        cfg = self.config
        h = hidden_BxTxF.astype(self.dtype)
        if h.shape[-1] == cfg.fused_width:
            if self.in_norm is not None:
                h = layers.rms_norm(h, self.in_norm[...], cfg.rms_norm_eps)
            if self.fc_norms is not None:
                parts = jnp.split(h, cfg.num_captured, axis=-1)
                h = jnp.concatenate([layers.rms_norm(x, g, cfg.rms_norm_eps) for x, g in zip(parts, self.fc_norms[...])], -1)
            return h @ self.fc[...]
        if h.shape[-1] != cfg.hidden_size:
            raise ValueError(f"drafter hidden input: width {h.shape[-1]} is neither the fused features' "
                             f"({cfg.num_captured} x {cfg.target_hidden_size} = {cfg.fused_width}) nor hidden "
                             f"({cfg.hidden_size})")
        return h

    def rope(self, positions_BxT):
        return layers.rope_cos_sin(positions_BxT, self.inv_freq[...])

    def attn_params(self, layer: int = 0):
        """Decoder layer ``layer``'s attention parameters (``wq``, ``wk``, ``wv``, ``wo``, and
        ``q_norm``/``k_norm`` for Qwen3 layers), by name."""
        if layer == 0:
            return {n: getattr(self, n)[...] for n in _ATTN if getattr(self, n) is not None}
        return {n: getattr(self, "rest_" + n)[...][layer - 1] for n in _ATTN if getattr(self, "rest_" + n) is not None}

    def layer_input(self, h_BxTxH, tokens_BxT):
        """``[input_layernorm(embed(tokens)) ; hidden_norm(h)]`` — embedding first."""
        eps = self.config.rms_norm_eps
        e = self.embed[...][tokens_BxT]
        return jnp.concatenate([layers.rms_norm(e, self.input_norm[...], eps), layers.rms_norm(h_BxTxH, self.hidden_norm[...], eps)], -1)

    def layer_output(self, h_BxTxH, attn_out_BxTxH):
        """The first layer's residual (the un-normed ``h``, or ``hidden_norm(h)`` with
        ``norm_before_residual``), then the SwiGLU MLP block; returns the layer's output."""
        cfg = self.config
        residual = layers.rms_norm(h_BxTxH, self.hidden_norm[...], cfg.rms_norm_eps) if cfg.norm_before_residual else h_BxTxH
        h = residual + attn_out_BxTxH
        return h + layers.swiglu(layers.rms_norm(h, self.post_norm[...], cfg.rms_norm_eps),
                                 self.w_gate[...], self.w_up[...], self.w_down[...])

    def attn_input(self, layer: int, h_BxTxH, tokens_BxT):
        """Decoder layer ``layer``'s attention input: :meth:`layer_input` for the first, the
        plain ``input_layernorm(h)`` for the others."""
        if layer == 0:
            return self.layer_input(h_BxTxH, tokens_BxT)
        return layers.rms_norm(h_BxTxH, self.rest_input_norm[...][layer - 1], self.config.rms_norm_eps)

    def attn_output(self, layer: int, h_BxTxH, attn_out_BxTxH):
        """Decoder layer ``layer``'s output from its input ``h`` and attention output:
        :meth:`layer_output` for the first, a plain pre-norm decoder layer's for the others."""
        if layer == 0:
            return self.layer_output(h_BxTxH, attn_out_BxTxH)
        i, eps = layer - 1, self.config.rms_norm_eps
        h = h_BxTxH + attn_out_BxTxH
        return h + layers.swiglu(layers.rms_norm(h, self.rest_post_norm[...][i], eps), self.rest_w_gate[...][i],
                                 self.rest_w_up[...][i], self.rest_w_down[...][i])

    def finish(self, h_BxTxH):
        """The hidden a draft step returns (and feeds back): the last layer's output, or its
        final-normed value with ``norm_output``."""
        return layers.rms_norm(h_BxTxH, self.norm[...], self.config.rms_norm_eps) if self.config.norm_output else h_BxTxH

    def logits(self, out_hidden):
        """Draft-vocabulary logits (float32) from the step's output hidden (normed here
        unless ``norm_output`` already did)."""
        h = out_hidden if self.config.norm_output else layers.rms_norm(out_hidden, self.norm[...], self.config.rms_norm_eps)
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
        """An empty cache of ``num_layers`` layers with room for ``max_len`` tokens per
        sequence.  Sliding-window layers attend to their whole context, so a ``max_len``
        past their window is refused."""
        cfg = self.config
        windows = [w for w in map(cfg.window, range(cfg.num_layers)) if w is not None]
        if windows and max_len > min(windows):
            raise ValueError(f"max_len={max_len} exceeds the drafter's sliding_window={min(windows)}; "
                             "sliding-window attention past the window is not implemented")
        return init_cache(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, storage_dtype(self.dtype))
