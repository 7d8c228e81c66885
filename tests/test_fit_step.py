"""The fit step's memory work changes no loss: sequence-chunked vocabulary logits,
rematerialised TTT steps and micro-batches with gradient accumulation give the losses and
gradients of the plain step (the whole ``[B, T, V]`` float32 target logits, every step's
activations kept, one batch), which itself gives the losses the trainer gave before them."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import eagle3_jax
from eagle3_jax import layers
from eagle3_jax.train.trainer import FitConfig, Trainer, fit_step_fn
from eagle3_jax.train.ttt import shift_left, ttt_attention
from helpers import FIXTURES
from test_train import _records

# Trainer losses of the first three steps of ``_trainer_losses`` as the code before the memory
# work (commit ce1e964, the plain step below) gave them
BEFORE = {"float32": [18.37738800048828, 17.926633834838867, 18.14557647705078],
          "bfloat16": [18.37797737121582, 17.924907684326172, 18.14604377746582]}


def _plain_ttt_loss(drafter, features_BxTx3H, input_ids_BxT, target_logits_BxTxV, loss_mask_BxT, *, length,
                    step_weight):
    """The TTT loss as it was: the draft-vocabulary label logits gathered from the whole
    float32 target logits, each step's logits made for the whole sequence."""
    cfg = drafter.config
    B, T = input_ids_BxT.shape
    draft_ids = drafter.to_target_ids(jnp.arange(cfg.draft_vocab_size))
    target_logits = jax.lax.stop_gradient(target_logits_BxTxV.astype(jnp.float32))
    label_logits, in_vocab = target_logits[..., draft_ids], drafter.t2d[jnp.argmax(target_logits, -1)]
    loss_mask = loss_mask_BxT.astype(jnp.float32)
    h = drafter.fuse(features_BxTx3H)
    p = drafter.attn_params()
    keys, values, losses, accs = [], [], [], []
    for s in range(length):
        label = shift_left(label_logits, 1 + s)
        predicted_mask = shift_left(loss_mask, 2 + s)
        mask = predicted_mask * shift_left(in_vocab.astype(jnp.float32), 1 + s)
        cos, sin = drafter.rope(jnp.broadcast_to(jnp.arange(T) + s, (B, T)))
        q, k, v = layers.qkv(p, drafter.layer_input(h, shift_left(input_ids_BxT, 1 + s)), cos, sin,
                             num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             eps=cfg.rms_norm_eps)
        keys.append(k)
        values.append(v)
        h = drafter.layer_output(h, ttt_attention(q, keys, values, cfg.head_dim ** -0.5).reshape(B, T, -1) @ p["wo"])
        logits = drafter.logits(h)
        soft_ce = -(jax.nn.softmax(label, -1) * jax.nn.log_softmax(logits, -1)).sum(-1)
        losses.append((soft_ce * mask).sum() / jnp.maximum(mask.sum(), 1.0))
        hit = (jnp.argmax(logits, -1) == jnp.argmax(label, -1)).astype(jnp.float32)
        accs.append((hit * mask).sum() / jnp.maximum(predicted_mask.sum(), 1.0))
    losses, accs = jnp.stack(losses), jnp.stack(accs)
    return (step_weight ** jnp.arange(length) * losses).sum(), {"loss_s": losses, "acc_s": accs}


def _plain_step_fn(tgraph, dgraph, cfg: FitConfig, opt):
    """The fit step as it was (online): the target's whole logits, one batch."""
    def step(params, opt_state, frozen, tstate, input_ids, loss_mask):
        target = nnx.merge(tgraph, tstate)
        hidden, feats, _ = target.trunk(input_ids, jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape))
        logits = jax.lax.stop_gradient(target.head(hidden))

        def loss_fn(p):
            if cfg.compute_dtype != "float32":
                p = jax.tree.map(lambda x: x.astype(cfg.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
            return _plain_ttt_loss(nnx.merge(dgraph, p, frozen), feats, input_ids, logits, loss_mask,
                                   length=cfg.ttt_length, step_weight=cfg.step_weight)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **metrics}

    return step


def _models():
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    tgraph, tstate = nnx.split(target)
    dgraph, params, frozen = nnx.split(eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target),
                                       nnx.Param, ...)
    return tgraph, tstate, dgraph, params, frozen


def _sgd_keeping_grads(lr: float):
    """SGD whose state is the last step's gradients (compared as they are, not through
    ``params - lr · grads``, which rounds them to the params' precision)."""
    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda grads, state, params=None: (jax.tree.map(lambda g: -lr * g, grads), grads))


def _run(step_fn, opt, steps: int = 2):
    """``steps`` steps on the same rows (batch 4 x 20, three TTT steps): each step's
    metrics and gradients (``opt``: :func:`_sgd_keeping_grads`)."""
    tgraph, tstate, dgraph, params, frozen = _models()
    step = jax.jit(step_fn(tgraph, dgraph, opt))
    records = _records(n=4, T=20, seed=1)
    ids, mask = jnp.asarray(records["input_ids"]), jnp.asarray(records["loss_mask"])
    opt_state, out = opt.init(params), []
    for _ in range(steps):
        params, opt_state, metrics = step(params, opt_state, frozen, tstate, ids, mask)
        out.append((jax.device_get(metrics), jax.device_get(opt_state)))
    return out


@functools.cache
def _plain(compute_dtype: str):
    """The plain step's two SGD steps (they depend on nothing else of the settings below)."""
    cfg = FitConfig(batch_size=4, ttt_length=3, compute_dtype=compute_dtype)
    return _run(lambda tg, dg, o: _plain_step_fn(tg, dg, cfg, o), _sgd_keeping_grads(0.1))


@pytest.mark.parametrize("compute_dtype, micro_batches, loss_chunk, remat", [
    ("float32", 1, 256, False),  # one chunk of the whole sequence, nothing recomputed
    ("float32", 1, 3, True),     # chunks of 3 (20 positions: a padded last chunk), steps recomputed
    ("float32", 2, 7, True),     # two micro-batches of rows 0, 2 and 1, 3
    ("float32", 4, 20, False),   # one row a micro-batch
    ("bfloat16", 2, 6, True),
])
def test_chunked_remat_accumulated_step_equals_plain(compute_dtype, micro_batches, loss_chunk, remat):
    """Two SGD steps from the same drafter: every variant gives the plain step's losses,
    accuracies and gradients."""
    cfg = FitConfig(batch_size=4, ttt_length=3, compute_dtype=compute_dtype, micro_batches=micro_batches,
                    loss_chunk=loss_chunk, remat=remat)
    plain = _plain(compute_dtype)
    new = _run(lambda tg, dg, o: fit_step_fn(tg, dg, cfg, o), _sgd_keeping_grads(0.1))
    tol, grad_tol = {"float32": (2e-5, 2e-5), "bfloat16": (2e-3, 2e-2)}[compute_dtype]  # bf16 gradients: 8-bit mantissas
    for (want, want_grads), (got, got_grads) in zip(plain, new):
        assert float(want["loss"]) > 1
        for name in ("loss", "loss_s", "acc_s"):
            np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=tol, atol=tol, err_msg=name)
        assert float(got["sim_accept_len"]) == pytest.approx(float(np.cumprod(got["acc_s"]).sum()))
        for a, b in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads)):
            np.testing.assert_allclose(b, a, atol=grad_tol * np.abs(a).max())
    assert np.abs(np.asarray(plain[-1][0]["acc_s"])).max() > 0  # the trained drafter hits


def _trainer_losses(tmp_path, **fit):
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    cfg = FitConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, ttt_length=3, **fit)
    tr = Trainer(target, eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target), _records(), cfg,
                 work_dir=tmp_path)
    return [float(tr.train_step(next(tr.data_iter))["loss"]) for _ in range(3)]


@pytest.mark.parametrize("fit, rtol", [({}, 1e-6), ({"compute_dtype": "bfloat16", "micro_batches": 2, "loss_chunk": 8}, 2e-5)],
                         ids=["defaults", "bf16-micro-chunked"])
def test_trainer_losses_unchanged(tmp_path, fit, rtol):
    """The trainer's first losses are those of the code before the memory work."""
    np.testing.assert_allclose(_trainer_losses(tmp_path, **fit), BEFORE[fit.get("compute_dtype", "float32")], rtol=rtol)


def test_fit_step_compiles_from_abstract_inputs():
    """The step lowers on ``ShapeDtypeStruct`` s alone (as ``plan`` compiles it for a
    topology), offline too; micro-batches cut the compiled temporaries."""
    tgraph, tstate, dgraph, params, frozen = _models()
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    B, T, H = 8, 64, 128
    temp = {}
    for micro_batches, offline in ((1, False), (4, False), (1, True)):
        cfg = FitConfig(batch_size=B, ttt_length=3, micro_batches=micro_batches, loss_chunk=16, offline=offline)
        opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
        batch = [jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, T), jnp.bool_)]
        if offline:
            batch += [jax.ShapeDtypeStruct((B, T, 3 * H), jnp.float32), jax.ShapeDtypeStruct((B, T, H), jnp.float32)]
        step = fit_step_fn(tgraph, dgraph, cfg, optax.adamw(1e-3))
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
            abstract(params), opt_state, abstract(frozen), abstract(tstate), *batch).compile()
        temp[micro_batches, offline] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[4, False] < temp[1, False] / 2, temp


def test_fit_config_memory_fields():
    """The memory fields are checked and come from the YAML config like every fit key."""
    from pathlib import Path

    from eagle3_jax.train import pipeline

    tiny = Path(__file__).parent.parent / "configs" / "tiny.yaml"  # fit.batch_size 16
    fit = pipeline.load_config(tiny, ["fit.micro_batches=2", "fit.remat=false", "fit.loss_chunk=32"])["fit"]
    assert (fit["micro_batches"], fit["remat"], fit["loss_chunk"]) == (2, False, 32)
    assert dataclasses.asdict(FitConfig()) | {"micro_batches": 1, "remat": True} == dataclasses.asdict(FitConfig())
    with pytest.raises(ValueError, match=r"fit.micro_batches=3 .*must divide fit.batch_size=16"):
        pipeline.load_config(tiny, ["fit.micro_batches=3"])
    with pytest.raises(ValueError, match="fit.micro_batches=3: must divide fit.batch_size=8"):
        FitConfig(batch_size=8, micro_batches=3)
    with pytest.raises(ValueError, match="fit.loss_chunk"):
        FitConfig(loss_chunk=0)
    with pytest.raises(TypeError, match="fit.remat"):
        FitConfig(remat="yes")
