"""EAGLE-3 training-time test (TTT): the drafter is unrolled ``length`` steps on its own
outputs, exactly as it will be used at inference, and every step is supervised by the
target's distribution.

Alignment (drafter index ``t``, step ``s``): the drafter sees token ``t + 1 + s``, its
query sits at RoPE position ``t + s`` and it predicts token ``t + 2 + s``, whose target
distribution is the target's softmax at position ``t + 1 + s`` restricted to the draft
vocabulary.  Step 0's hidden is ``fc(features_t)``; step ``s`` feeds step ``s-1``'s pre-norm
output.  Attention at step ``s``: step-0 keys at positions ``<= t`` plus the keys of steps
``1..s`` at index ``t`` only, in one joint softmax.

The loss of step ``s`` is the soft cross-entropy, masked by ``loss_mask`` of the predicted
token and by "the target's argmax is in the draft vocabulary", normalised by the mask
count; the total is ``Σ 0.8**s · loss_s``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax import layers


def shift_left(x_BxTx, n: int):
    """``x[:, n:]`` zero-padded back to length ``T``."""
    if n == 0:
        return x_BxTx
    pad = [(0, 0), (0, n)] + [(0, 0)] * (x_BxTx.ndim - 2)
    return jnp.pad(x_BxTx[:, n:], pad)


def ttt_attention(q_BxTxNxD, keys, values, scale: float):
    """``keys[0]``/``values[0]``: step-0 ``[B, T, K, D]`` (causal); ``keys[j]``, j ≥ 1: steps
    1..s, each visible to the query at the same index only."""
    B, T, N, D = q_BxTxNxD.shape
    K = keys[0].shape[2]
    q = q_BxTxNxD.reshape(B, T, K, N // K, D)
    causal = jnp.tril(jnp.ones((T, T), bool))
    s0 = jnp.einsum("btkgd,bukd->bkgtu", q, keys[0], preferred_element_type=jnp.float32) * scale
    s0 = jnp.where(causal, s0, layers.NEG_INF)
    diag = [jnp.einsum("btkgd,btkd->bkgt", q, k, preferred_element_type=jnp.float32)[..., None] * scale for k in keys[1:]]
    probs = jax.nn.softmax(jnp.concatenate([s0, *diag], -1), axis=-1)
    out = jnp.einsum("bkgtu,bukd->btkgd", probs[..., :T].astype(values[0].dtype), values[0])
    for j, v in enumerate(values[1:]):
        out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., T + j].astype(v.dtype), v)
    return out.reshape(B, T, N, D)


def target_labels(drafter, target_logits_BxTxV):
    """``(label_logits_BxTxVd, in_vocab_BxT)``: the target's logits on the draft vocabulary
    and whether its argmax lies inside it."""
    draft_ids = drafter.to_target_ids(jnp.arange(drafter.config.draft_vocab_size))
    target_logits = jax.lax.stop_gradient(target_logits_BxTxV.astype(jnp.float32))
    return target_logits[..., draft_ids], drafter.t2d[jnp.argmax(target_logits, -1)]


def ttt_loss(drafter, features_BxTx3H, input_ids_BxT, target_logits_BxTxV, loss_mask_BxT, *, length: int = 7,
             step_weight: float = 0.8):
    """Returns ``(loss, metrics)``; metrics: ``loss_s``, ``acc_s`` per step and the simulated
    acceptance length ``Σ_k Π_{i<=k} acc_i``."""
    cfg = drafter.config
    B, T = input_ids_BxT.shape
    label_logits, in_vocab = target_labels(drafter, target_logits_BxTxV)
    loss_mask = loss_mask_BxT.astype(jnp.float32)

    h = drafter.fuse(features_BxTx3H)
    p = drafter.attn_params()
    keys, values, losses, accs = [], [], [], []
    for s in range(length):
        tokens = shift_left(input_ids_BxT, 1 + s)
        label = shift_left(label_logits, 1 + s)
        predicted_mask = shift_left(loss_mask, 2 + s)
        mask = predicted_mask * shift_left(in_vocab.astype(jnp.float32), 1 + s)
        cos, sin = drafter.rope(jnp.broadcast_to(jnp.arange(T) + s, (B, T)))
        q, k, v = layers.qkv(p, drafter.layer_input(h, tokens), cos, sin, num_heads=cfg.num_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
        keys.append(k)
        values.append(v)
        attn = ttt_attention(q, keys, values, cfg.head_dim ** -0.5)
        h = drafter.layer_output(h, attn.reshape(B, T, -1) @ p["wo"])
        logits = drafter.logits(h)
        soft_ce = -(jax.nn.softmax(label, -1) * jax.nn.log_softmax(logits, -1)).sum(-1)
        losses.append((soft_ce * mask).sum() / jnp.maximum(mask.sum(), 1.0))
        hit = (jnp.argmax(logits, -1) == jnp.argmax(label, -1)).astype(jnp.float32)
        accs.append((hit * mask).sum() / jnp.maximum(predicted_mask.sum(), 1.0))
    losses, accs = jnp.stack(losses), jnp.stack(accs)
    total = (step_weight ** jnp.arange(length) * losses).sum()
    metrics = {"loss": total, "loss_s": losses, "acc_s": accs, "sim_accept_len": jnp.cumprod(accs).sum()}
    return total, metrics
