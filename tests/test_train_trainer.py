"""``eagle3_jax.train.trainer``: ``FitConfig``'s checks, the fit step, the ``Trainer`` (the
sharded step equals the single-device one, the offline cache, kill-and-resume, no start over an
old run).

The fit step's memory work changes no loss: sequence-chunked vocabulary logits, rematerialised
TTT steps and micro-batches with gradient accumulation give the losses and gradients of the
plain step (``helpers.plain_fit_step_fn``: the whole ``[B, T, V]`` float32 target logits, every
step's activations kept, one batch), which itself gives the losses the trainer gave before them."""

import dataclasses
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import eagle3_jax
from eagle3_jax.train import pipeline
from eagle3_jax.train.trainer import FitConfig, Trainer, fit_step_fn
from helpers import FIXTURES, cpu_devices_env, plain_fit_step_fn, random_records

ROOT = Path(__file__).parent.parent

# Trainer losses of the first three steps of ``_trainer_losses`` as the code before the memory
# work (commit ce1e964, ``helpers.plain_fit_step_fn``) gave them
BEFORE = {"float32": [18.37738800048828, 17.926633834838867, 18.14557647705078],
          "bfloat16": [18.37797737121582, 17.924907684326172, 18.14604377746582]}


# ------------------------------------------------------------------ FitConfig
def test_fit_config_checks_types_and_ranges():
    with pytest.raises(TypeError, match="fit.lr"):
        FitConfig(lr="1e-4")
    with pytest.raises(TypeError, match="fit.steps"):
        FitConfig(steps=True)
    with pytest.raises(ValueError, match="fit.warmup_steps"):
        FitConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="fit.buckets"):
        FitConfig(buckets=(32, 0))
    assert FitConfig(lr=1, buckets=[32]).lr == 1.0 and FitConfig(buckets=[32]).buckets == (32,)


def test_fit_config_memory_fields():
    """The memory fields are checked and come from the YAML config like every fit key."""
    tiny = ROOT / "configs" / "tiny.yaml"  # fit.batch_size 16
    fit = pipeline.load_config(tiny, ["fit.micro_batches=2", "fit.remat=false", "fit.loss_chunk=32"]).fit
    assert (fit.micro_batches, fit.remat, fit.loss_chunk) == (2, False, 32)
    assert dataclasses.asdict(FitConfig()) | {"micro_batches": 1, "remat": True} == dataclasses.asdict(FitConfig())
    with pytest.raises(ValueError, match=r"fit.micro_batches=3 .*must divide fit.batch_size=16"):
        pipeline.load_config(tiny, ["fit.micro_batches=3"])
    with pytest.raises(ValueError, match="fit.micro_batches=3: must divide fit.batch_size=8"):
        FitConfig(batch_size=8, micro_batches=3)
    with pytest.raises(ValueError, match="fit.loss_chunk"):
        FitConfig(loss_chunk=0)
    with pytest.raises(TypeError, match="fit.remat"):
        FitConfig(remat="yes")


# ------------------------------------------------------------------ the fit step against the plain step
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
    records = random_records(n=4, T=20, seed=1)
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
    return _run(lambda tg, dg, o: plain_fit_step_fn(tg, dg, cfg, o), _sgd_keeping_grads(0.1))


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
    tr = Trainer(target, eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target), random_records(), cfg,
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


# ------------------------------------------------------------------ the Trainer: mesh, offline cache, resume
def test_mesh_step_equals_single_device(tmp_path):
    script = textwrap.dedent(f"""
        import dataclasses, sys, numpy as np, jax
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        import eagle3_jax
        from eagle3_jax.sharding import make_mesh
        from eagle3_jax.train.trainer import FitConfig, Trainer
        from helpers import FIXTURES, random_records
        assert len(jax.devices()) == 8
        target = eagle3_jax.load_target(FIXTURES / "target_tiny")
        cfg = FitConfig(steps=2, batch_size=8, lr=1e-3, warmup_steps=1, ttt_length=3)
        out = {{}}
        # the 8-device mesh as jax.make_mesh makes it (Explicit axes by default), which the trainer takes as Auto
        explicit = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
        # "micro": two micro-batches of 4 rows, each split over the mesh's 4 batch shards
        for name, mesh, micro in (("single", make_mesh(1, 1, 1, devices=jax.devices()[:1]), 1), ("mesh", explicit, 1),
                                  ("micro", explicit, 2)):
            drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
            tr = Trainer(target, drafter, random_records(), dataclasses.replace(cfg, micro_batches=micro),
                         work_dir={str(tmp_path)!r} + "/" + name, mesh=mesh)
            losses = [float(tr.train_step(next(tr.data_iter))["loss"]) for _ in range(2)]
            if name != "single":
                assert len(tr.params["wq"][...].sharding.device_set) > 1  # really sharded
            out[name] = (losses, jax.device_get(tr.params))
        for name in ("mesh", "micro"):
            np.testing.assert_allclose(out["single"][0], out[name][0], rtol=1e-5)
            for a, b in zip(jax.tree.leaves(out["single"][1]), jax.tree.leaves(out[name][1])):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # Adam amplifies reduction-order noise on ~0 grads
        try:  # a micro-batch of 2 rows cannot split over 4 batch shards
            Trainer(target, eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target), random_records(),
                    dataclasses.replace(cfg, micro_batches=4),
                    work_dir={str(tmp_path)!r} + "/refused", mesh=explicit)
            raise AssertionError("not refused")
        except ValueError as e:
            assert "fit.micro_batches=4" in str(e), e
        print("ok", out["mesh"][0])
    """)
    env = cpu_devices_env(8)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok" in res.stdout


def test_offline_cache_trains_like_online(tmp_path):
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    losses = {}
    for offline in (False, True):
        cfg = FitConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, ttt_length=2, offline=offline)
        drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
        tr = Trainer(target, drafter, random_records(), cfg, work_dir=tmp_path / str(offline))
        placed = jax.tree.map(lambda x: x.sharding, tr.opt_state)
        losses[offline] = [float(tr.train_step(next(tr.data_iter))["loss"]) for _ in range(3)]
        # the AdamW state starts where the step leaves it (else the second step compiles again)
        assert jax.tree.map(lambda x: x.sharding, tr.opt_state) == placed
    assert (tmp_path / "True" / "offline" / "features.npy").exists()
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    # and what offline steps train on is the cache: zeroed, the same first step gives another loss
    cfg = FitConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, ttt_length=2, offline=True)
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    tr = Trainer(target, drafter, random_records(), cfg, work_dir=tmp_path / "zeroed")
    tr.cached = {name: np.zeros_like(table) for name, table in tr.cached.items()}
    assert abs(float(tr.train_step(next(tr.data_iter))["loss"]) - losses[True][0]) > 1e-3


def test_kill_and_resume_is_exact(tmp_path):
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    cfg = FitConfig(steps=6, batch_size=4, lr=1e-3, warmup_steps=2, ttt_length=2, save_every=2)

    def trainer(name):
        drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
        return Trainer(target, drafter, random_records(), cfg, work_dir=tmp_path / name)

    straight = trainer("straight")
    straight.fit()
    first = trainer("resumed")
    first.fit(steps=4)  # "killed" after step 4: a new trainer picks up from the checkpoint
    second = trainer("resumed")
    second.fit(resume=True)
    assert second.step == straight.step == 6
    for a, b in zip(jax.tree.leaves(jax.device_get(straight.params)), jax.tree.leaves(jax.device_get(second.params))):
        np.testing.assert_array_equal(a, b)
    assert next(straight.data_iter)["input_ids"].tolist() == next(second.data_iter)["input_ids"].tolist()
    assert (tmp_path / "straight" / "best" / "model.safetensors").exists()
    eagle3_jax.load_drafter(tmp_path / "straight" / "best", target=target)


def test_trainer_refuses_to_start_over_an_old_run(tmp_path):
    """The API guard behind it: a Trainer that restores nothing will not write into a
    work_dir holding another run's checkpoints or best/ (no step is compiled)."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    rng = np.random.default_rng(0)
    records = {"input_ids": rng.integers(0, 1024, (8, 16)).astype(np.int32), "loss_mask": rng.random((8, 16)) < 0.9}

    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)  # the Trainer copies its params

    def trainer():
        return Trainer(target, drafter, records, FitConfig(steps=2, batch_size=4), work_dir=tmp_path)

    old = trainer()
    old.step = 5
    old.save()
    old.ckpt.wait_until_finished()
    with pytest.raises(FileExistsError, match="step 5"):
        trainer().fit()
    (tmp_path / "ckpt").rename(tmp_path / "old_ckpt")
    (tmp_path / "best").mkdir()
    with pytest.raises(FileExistsError, match="best"):
        trainer().fit(resume=True)
