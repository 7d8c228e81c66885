"""EAGLE-3 training-time test (TTT): the drafter is unrolled ``length`` steps on its own
outputs, exactly as it will be used at inference, and every step is supervised by the
target's distribution.

Alignment (drafter index ``t``, step ``s``): the drafter sees token ``t + 1 + s``, its
query sits at RoPE position ``t + s`` and it predicts token ``t + 2 + s``, whose target
distribution is the target's softmax at position ``t + 1 + s`` restricted to the draft
vocabulary.  Step 0's hidden is ``fc(features_t)``; step ``s`` feeds step ``s-1``'s pre-norm
output (through every decoder layer of the drafter, each with its own keys; the hidden fed
back is ``drafter.finish``'s, normed with ``norm_output``).  Attention at step ``s``: step-0
keys at positions ``<= t`` plus the keys of steps ``1..s`` at index ``t`` only, in one joint
softmax.

The loss of step ``s`` is the soft cross-entropy, masked by ``loss_mask`` of the predicted
token and by "the target's argmax is in the draft vocabulary", normalised by the mask
count; the total is ``Σ 0.8**s · loss_s``.

Memory: nothing vocabulary-sized is made for the whole sequence at once.  The labels come
from the target's final-normed hidden, not its logits: "the target's argmax is in the draft
vocabulary" is computed over sequence chunks (:func:`in_draft_vocab`), and each step's label
logits (the hidden times the target's head on the draft vocabulary's columns), the drafter's
logits and the soft cross-entropy are made chunk by chunk and recomputed in the backward
pass (:func:`ttt_sums`).  The loss is returned as unnormalised sums and counts so that
micro-batches add up to exactly the full batch's loss and gradients.  (Suffix ``_L``: one
entry per TTT step.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from eagle3_jax import layers


def shift_left(x_BxTx, n: int):
    """``x[:, n:]`` zero-padded back to length ``T``."""
    if n == 0:
        return x_BxTx
    pad = [(0, 0), (0, n)] + [(0, 0)] * (x_BxTx.ndim - 2)
    return jnp.pad(x_BxTx[:, n:], pad)


def ttt_attention(q_BxTxNxD, keys, values, scale: float, window: int | None = None):
    """``keys[0]``/``values[0]``: step-0 ``[B, T, K, D]`` (causal; with ``window``, only the
    ``window`` latest positions, as speculators' sliding-window layers); ``keys[j]``, j ≥ 1:
    steps 1..s, each visible to the query at the same index only."""
    B, T, N, D = q_BxTxNxD.shape
    K = keys[0].shape[2]
    q = q_BxTxNxD.reshape(B, T, K, N // K, D)
    causal = jnp.tril(jnp.ones((T, T), bool))
    if window is not None:
        causal = causal & ~jnp.tril(jnp.ones((T, T), bool), -window)
    s0 = jnp.einsum("btkgd,bukd->bkgtu", q, keys[0], preferred_element_type=jnp.float32) * scale
    s0 = jnp.where(causal, s0, layers.NEG_INF)
    diag = [jnp.einsum("btkgd,btkd->bkgt", q, k, preferred_element_type=jnp.float32)[..., None] * scale for k in keys[1:]]
    probs = jax.nn.softmax(jnp.concatenate([s0, *diag], -1), axis=-1)
    out = jnp.einsum("bkgtu,bukd->btkgd", probs[..., :T].astype(values[0].dtype), values[0])
    for j, v in enumerate(values[1:]):
        out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., T + j].astype(v.dtype), v)
    return out.reshape(B, T, N, D)


def draft_head(drafter, target_head_HxV):
    """The target's output projection restricted to the draft vocabulary's columns: ``[H, Vd]``."""
    return target_head_HxV[:, drafter.to_target_ids(jnp.arange(drafter.config.draft_vocab_size))]


def seq_chunks(x_BxTx, chunk: int):
    """``x`` cut along the sequence into ``ceil(T / chunk)`` chunks ``[n, B, chunk, ...]``
    (the last zero-padded)."""
    B, T = x_BxTx.shape[:2]
    n = -(-T // chunk)
    x = jnp.pad(x_BxTx, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (x_BxTx.ndim - 2))
    return jnp.moveaxis(x.reshape(B, n, chunk, *x_BxTx.shape[2:]), 1, 0)


def in_draft_vocab(drafter, target_hidden_BxTxH, target_head_HxV, *, chunk: int):
    """Boolean ``[B, T]``: whether the target's argmax (over its whole vocabulary) lies in
    the draft vocabulary.  The float32 logits are made ``chunk`` positions at a time:
    ``[B, chunk, V]``, never ``[B, T, V]``."""
    B, T = target_hidden_BxTxH.shape[:2]
    t2d_V = drafter.t2d

    def one(hidden_BxCxH):
        logits_BxCxV = jnp.einsum("bch,hv->bcv", hidden_BxCxH, target_head_HxV, preferred_element_type=jnp.float32)
        return t2d_V[jnp.argmax(logits_BxCxV, -1)]

    in_vocab_NxBxC = jax.lax.map(one, seq_chunks(jax.lax.stop_gradient(target_hidden_BxTxH), min(chunk, T)))
    return jnp.moveaxis(in_vocab_NxBxC, 0, 1).reshape(B, -1)[:, :T]


def step_counts(loss_mask_BxT, in_vocab_BxT, length: int):
    """``(count_L, predicted_L)`` per TTT step: the positions its loss averages over (the
    predicted token in ``loss_mask``, the target's argmax in the draft vocabulary) and
    those its accuracy divides by (the predicted token in ``loss_mask``)."""
    loss_mask, in_vocab = loss_mask_BxT.astype(jnp.float32), in_vocab_BxT.astype(jnp.float32)
    predicted = [shift_left(loss_mask, 2 + s) for s in range(length)]
    counts = [(p * shift_left(in_vocab, 1 + s)).sum() for s, p in enumerate(predicted)]
    return jnp.stack(counts), jnp.stack([p.sum() for p in predicted])


def weighted_loss(ce_sum_L, count_L, step_weight: float):
    """``Σ_s step_weight**s · ce_sum_s / count_s``: the training objective."""
    return (step_weight ** jnp.arange(ce_sum_L.shape[0]) * ce_sum_L / jnp.maximum(count_L, 1.0)).sum()


def ttt_metrics(ce_sum_L, hit_L, count_L, predicted_L, step_weight: float):
    """``(loss, metrics)`` from the summed cross-entropies and hits of :func:`ttt_sums`
    and the counts of :func:`step_counts`; metrics: ``loss``, ``loss_s`` and ``acc_s`` per
    step and the simulated acceptance length ``Σ_k Π_{i<=k} acc_i``."""
    losses, accs = ce_sum_L / jnp.maximum(count_L, 1.0), hit_L / jnp.maximum(predicted_L, 1.0)
    total = weighted_loss(ce_sum_L, count_L, step_weight)
    return total, {"loss": total, "loss_s": losses, "acc_s": accs, "sim_accept_len": jnp.cumprod(accs).sum()}


def ttt_sums(drafter, features_BxTx3H, input_ids_BxT, target_hidden_BxTxH, label_head_HxVd, loss_mask_BxT,
             in_vocab_BxT, *, length: int, chunk: int, remat: bool = True):
    """The unnormalised per-step sums ``(ce_sum_L, hit_L)`` of the TTT unroll: the masked
    soft cross-entropies and the masked hits (drafter argmax == label argmax).  Being sums,
    they add up exactly over micro-batches; :func:`ttt_metrics` normalises them.

    ``target_hidden_BxTxH``: the target's final-normed hidden; the labels are its logits
    on the draft vocabulary (``@ label_head_HxVd``, see :func:`draft_head`), made inside
    each step's loss ``chunk`` positions at a time together with the drafter's logits and
    recomputed in the backward pass (``jax.checkpoint``): no ``[B, T, Vd]`` array is kept
    for the backward pass.  ``remat``: also recompute each step's layer (attention
    probabilities ``[B, heads, T, T]`` and the MLP) in the backward pass instead of storing it."""
    cfg = drafter.config
    B, T = input_ids_BxT.shape
    C = min(chunk, T)
    n = -(-T // C)
    loss_mask, in_vocab = loss_mask_BxT.astype(jnp.float32), in_vocab_BxT.astype(jnp.float32)
    # step s's label at drafter index t is the target's position t + 1 + s: zero-padded past the
    # end once, sliced per chunk (no shifted copy per step)
    label_hidden_BxUxH = jnp.pad(jax.lax.stop_gradient(target_hidden_BxTxH), [(0, 0), (0, n * C - T + length), (0, 0)])
    label_head_HxVd = jax.lax.stop_gradient(label_head_HxVd)

    def vocab_loss(s: int, h_BxTxH):
        """``(ce_sum, hits)`` of step ``s`` over the chunks of its output hidden."""
        mask_BxT = shift_left(loss_mask, 2 + s) * shift_left(in_vocab, 1 + s)

        def one(carry, xs):
            c, h_BxCxH, mask_BxC = xs
            label_BxCxH = jax.lax.dynamic_slice_in_dim(label_hidden_BxUxH, c * C + 1 + s, C, axis=1)
            label_BxCxVd = jnp.einsum("bch,hv->bcv", label_BxCxH, label_head_HxVd, preferred_element_type=jnp.float32)
            logits_BxCxVd = drafter.logits(h_BxCxH)
            soft_ce_BxC = -(jax.nn.softmax(label_BxCxVd, -1) * jax.nn.log_softmax(logits_BxCxVd, -1)).sum(-1)
            hit_BxC = (jnp.argmax(logits_BxCxVd, -1) == jnp.argmax(label_BxCxVd, -1)).astype(jnp.float32)
            return (carry[0] + (soft_ce_BxC * mask_BxC).sum(), carry[1] + (hit_BxC * mask_BxC).sum()), None

        zero = jnp.zeros((), jnp.float32)
        xs = (jnp.arange(n), seq_chunks(h_BxTxH, C), seq_chunks(mask_BxT, C))
        return jax.lax.scan(jax.checkpoint(one, prevent_cse=False), (zero, zero), xs)[0]

    def step(s: int, h_BxTxH, keys, values):
        """TTT step ``s``: ``(h, k, v, ce_sum, hits)``, its output hidden, new keys/values (a
        tuple over the drafter's layers) and loss sums."""
        h_BxTxH, k, v = ttt_step(drafter, s, h_BxTxH, input_ids_BxT, keys, values)
        return (h_BxTxH, k, v, *vocab_loss(s, h_BxTxH))

    h = drafter.fuse(features_BxTx3H)
    keys, values = ((),) * cfg.num_layers, ((),) * cfg.num_layers  # per layer: the keys of each step so far
    ce_sums, hits = [], []
    for s in range(length):
        run = functools.partial(step, s)
        h, k, v, ce_sum, hit = (jax.checkpoint(run) if remat else run)(h, keys, values)
        keys = tuple((*ks, kl) for ks, kl in zip(keys, k))
        values = tuple((*vs, vl) for vs, vl in zip(values, v))
        ce_sums.append(ce_sum)
        hits.append(hit)
    return jnp.stack(ce_sums), jnp.stack(hits)


def ttt_step(drafter, s: int, h_BxTxH, input_ids_BxT, keys, values):
    """The drafter's TTT step ``s`` through all its layers: ``(out_hidden, k, v)``, the hidden
    it feeds back (``drafter.finish``) and each layer's new keys/values (tuples over layers).
    ``keys[l]`` / ``values[l]``: layer ``l``'s keys/values of steps ``0..s-1``."""
    cfg = drafter.config
    B, T = input_ids_BxT.shape
    cos, sin = drafter.rope(jnp.broadcast_to(jnp.arange(T) + s, (B, T)))
    tokens = shift_left(input_ids_BxT, 1 + s)
    ks, vs = [], []
    for i in range(cfg.num_layers):
        p = drafter.attn_params(i)
        q, k, v = layers.qkv(p, drafter.attn_input(i, h_BxTxH, tokens), cos, sin, num_heads=cfg.num_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
        attn = ttt_attention(q, (*keys[i], k), (*values[i], v), cfg.head_dim ** -0.5, cfg.window(i))
        h_BxTxH = drafter.attn_output(i, h_BxTxH, attn.reshape(B, T, -1) @ p["wo"])
        ks.append(k)
        vs.append(v)
    return drafter.finish(h_BxTxH), tuple(ks), tuple(vs)


def ttt_loss(drafter, features_BxTx3H, input_ids_BxT, target_hidden_BxTxH, target_head_HxV, loss_mask_BxT, *,
             length: int = 7, step_weight: float = 0.8, chunk: int = 256, remat: bool = True):
    """The TTT loss of one batch: ``(loss, metrics)`` (see :func:`ttt_metrics`).
    ``target_hidden_BxTxH``: the target's final-normed hidden; ``target_head_HxV``: its
    output projection (logits = hidden @ head); ``chunk``/``remat``: see :func:`ttt_sums`."""
    in_vocab_BxT = in_draft_vocab(drafter, target_hidden_BxTxH, target_head_HxV, chunk=chunk)
    ce_sum_L, hit_L = ttt_sums(drafter, features_BxTx3H, input_ids_BxT, target_hidden_BxTxH,
                               draft_head(drafter, target_head_HxV), loss_mask_BxT, in_vocab_BxT,
                               length=length, chunk=chunk, remat=remat)
    return ttt_metrics(ce_sum_L, hit_L, *step_counts(loss_mask_BxT, in_vocab_BxT, length), step_weight)
