"""The sharded TTT training loop: the frozen target computes features and logits
inside the jitted step, optax AdamW updates the drafter, orbax checkpoints everything
needed to resume exactly (params, optimizer state, step, data-iterator state).

On several processes (``jax.distributed``) the mesh spans every process's devices; every
process draws the same global batches and puts only its devices' rows of them, so the
losses are those of one process with as many devices.  Orbax saves and restores
collectively; ``best/`` and the metrics log are written by process 0 alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from eagle3_jax import limits, sharding
from eagle3_jax.checkpoint import save_drafter
from eagle3_jax.models import drafter as drafter_mod, target as target_mod
from eagle3_jax.train import data
from eagle3_jax.train import ttt


@dataclasses.dataclass(frozen=True)
class FitConfig:
    steps: int = 1000
    batch_size: int = 8
    lr: float = 5e-5
    warmup_steps: int = 50
    end_lr_ratio: float = 0.1
    ttt_length: int = 7
    step_weight: float = 0.8
    clip_norm: float = 0.5
    compute_dtype: str = "float32"  # "bfloat16": bf16 compute over float32 master weights
    seed: int = 0
    save_every: int = 100
    keep: int = 3
    log_every: int = 10
    offline: bool = False  # run the target once over the data, cache its outputs on disk, train from the cache
    buckets: tuple[int, ...] = ()  # length buckets (batches cut to their bucket's length); () = one of seq_len
    # memory of the fit step (none changes the losses beyond float rounding):
    micro_batches: int = 1  # the batch run in this many slices inside the step, gradients summed (batch_size divides)
    loss_chunk: int = 256  # sequence positions per chunk of the vocabulary-sized logits and losses
    remat: bool = True  # recompute each TTT step's layer in the backward pass (less memory, more compute)

    def __post_init__(self):
        """Type- and range-checks every field against ``FIT_LIMITS`` (errors name it
        ``fit.<field>``); ints given for floats become floats, a list of buckets a tuple."""
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, limits.check(f"fit.{f.name}", getattr(self, f.name), FIT_LIMITS[f.name]))
        if self.batch_size % self.micro_batches:
            raise ValueError(f"fit.micro_batches={self.micro_batches}: must divide fit.batch_size={self.batch_size}")


# each field's kind and allowed range (a tuple's bounds apply to each item)
FIT_LIMITS = {"steps": limits.POSITIVE, "batch_size": limits.POSITIVE, "lr": limits.POSITIVE_FLOAT,
              "warmup_steps": limits.NON_NEGATIVE, "end_lr_ratio": limits.NON_NEGATIVE_FLOAT,
              "ttt_length": limits.POSITIVE, "step_weight": limits.POSITIVE_FLOAT, "clip_norm": limits.POSITIVE_FLOAT,
              "compute_dtype": limits.DTYPE, "seed": limits.NON_NEGATIVE, "save_every": limits.POSITIVE,
              "keep": limits.POSITIVE, "log_every": limits.POSITIVE, "offline": limits.Range(bool),
              "buckets": limits.Range(tuple, lo=1), "micro_batches": limits.POSITIVE, "loss_chunk": limits.POSITIVE,
              "remat": limits.Range(bool)}


def optimizer(cfg: FitConfig) -> optax.GradientTransformation:
    """AdamW β=(0.9, 0.95), no weight decay, global-norm clipping, warmup then cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1), max(cfg.steps, cfg.warmup_steps + 1),
                                                  end_value=cfg.lr * cfg.end_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0))


def opt_state_shardings(opt: optax.GradientTransformation, params, mesh: Mesh):
    """The shardings of ``opt.init(params)``: each moment on its parameter's sharding,
    everything else (step counts) replicated over ``mesh``.  ``params``: arrays or
    ``jax.ShapeDtypeStruct`` s with shardings."""
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(opt, lambda _, p: p.sharding, jax.eval_shape(opt.init, params), params,
                                 transform_non_params=lambda _: replicated)


def target_head(target):
    """The target's output projection ``[H, V]`` as :meth:`Target.head` applies it (the
    embedding transposed when tied)."""
    return target.embed[...].T if target.lm_head is None else target.lm_head[...]


def fit_step_fn(tgraph, dgraph, cfg: FitConfig, opt: optax.GradientTransformation | None = None,
                param_shardings=None):
    """The fit step, pure: ``step(params, opt_state, frozen, tstate, input_ids, loss_mask,
    feats=None, hidden=None) -> (params, opt_state, metrics)``, one TTT + AdamW update on a
    global batch, to be jitted (the trainer donates ``params`` and ``opt_state``).  It needs
    no trainer and no data: lowering it on ``jax.ShapeDtypeStruct`` s compiles it.

    Its arguments, from the modules: ``tgraph, tstate = nnx.split(target)``;
    ``dgraph, params, frozen = nnx.split(drafter, nnx.Param, ...)``; ``opt_state =
    opt.init(params)`` (``opt``: default :func:`optimizer` of ``cfg``); ``input_ids``
    int32 ``[B, T]``; ``loss_mask`` bool ``[B, T]``; offline (``cfg.offline``) also the
    target's fused features ``feats [B, T, 3H]`` and final-normed ``hidden [B, T, H]``,
    which otherwise the frozen target computes inside the step.  ``param_shardings``: the
    params' shardings (a tree like ``params``), kept by the updated params and the
    gradient accumulators, and their mesh's batch axes keep every activation split by rows
    (the target's features, the TTT steps); None leaves them to the compiler.  ``metrics``: see
    :func:`eagle3_jax.train.ttt.ttt_metrics`.

    Memory (none of it changes the loss beyond float rounding): the batch runs in
    ``cfg.micro_batches`` slices, micro-batch ``m`` taking rows ``m, m + M, ...`` so that
    every batch shard holds rows of each.  A first pass (``lax.map``) runs the target on
    each slice and finds where its argmax is in the draft vocabulary, which fixes each TTT
    step's loss normaliser for the whole batch; a ``lax.scan`` then sums each slice's
    gradients of the normalised loss, so ``micro_batches=k`` gives the full batch's loss and
    gradients.  Logits and losses over the vocabulary are made ``cfg.loss_chunk`` positions
    at a time; ``cfg.remat`` recomputes each TTT step's layer in the backward pass (see
    :func:`eagle3_jax.train.ttt.ttt_sums`).  ``cfg.compute_dtype`` casts the float params
    for the forward pass; logits and losses accumulate in float32 whatever it is."""
    opt = optimizer(cfg) if opt is None else opt
    M = cfg.micro_batches
    mesh = next((x.mesh for x in jax.tree.leaves(param_shardings) if isinstance(x, NamedSharding)), None)

    def rows(x_BxX):
        """``x`` kept split by rows over the batch's mesh axes (as the step's inputs are): without
        it the compiler may follow the weights' ``fsdp`` split of the hidden dimension instead and
        give each device the rows of all ``fsdp`` devices, attention and logits included."""
        if mesh is None:
            return x_BxX
        return jax.lax.with_sharding_constraint(x_BxX, sharding.batch_sharding(mesh, x_BxX.ndim))

    def split(x_BxX):
        """``[B, ...]`` → ``[M, B/M, ...]``: micro-batch ``m`` holds rows ``m, m + M, ...``."""
        return jnp.swapaxes(x_BxX.reshape(x_BxX.shape[0] // M, M, *x_BxX.shape[1:]), 0, 1)

    def step(params, opt_state, frozen, tstate, input_ids, loss_mask, feats=None, hidden=None):
        target = nnx.merge(tgraph, tstate)
        vocab_map = nnx.merge(dgraph, params, frozen)  # its draft-vocabulary map only (not differentiated)
        head_HxV = jax.lax.stop_gradient(target_head(target))
        label_head_HxVd = ttt.draft_head(vocab_map, head_HxV)
        T = input_ids.shape[1]

        def in_vocab(hidden_BxTxH):
            return ttt.in_draft_vocab(vocab_map, hidden_BxTxH, head_HxV, chunk=cfg.loss_chunk)

        def target_pass(ids_BxT):
            ids_BxT = rows(ids_BxT)
            hidden_BxTxH, feats_BxTx3H, _ = target.trunk(ids_BxT, jnp.broadcast_to(jnp.arange(T), ids_BxT.shape))
            hidden_BxTxH, feats_BxTx3H = rows(hidden_BxTxH), rows(feats_BxTx3H)
            return jax.lax.stop_gradient((feats_BxTx3H, hidden_BxTxH)), in_vocab(hidden_BxTxH)

        ids_MxBxT, mask_MxBxT = split(input_ids), split(loss_mask)
        if feats is None:  # online: the frozen target runs inside the step
            (feats_M, hidden_M), in_vocab_MxBxT = jax.lax.map(target_pass, ids_MxBxT)
        else:
            feats_M, hidden_M = split(feats), split(hidden)
            in_vocab_MxBxT = jax.lax.map(in_vocab, hidden_M)
        count_L, predicted_L = ttt.step_counts(mask_MxBxT.reshape(-1, T), in_vocab_MxBxT.reshape(-1, T), cfg.ttt_length)

        def loss_fn(p, xs):
            feats_BxTx3H, hidden_BxTxH, ids_BxT, mask_BxT, in_vocab_BxT = map(rows, xs)
            if cfg.compute_dtype != "float32":
                p = jax.tree.map(lambda x: x.astype(cfg.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
            drafter = nnx.merge(dgraph, p, frozen)
            sums = ttt.ttt_sums(drafter, feats_BxTx3H, ids_BxT, hidden_BxTxH, label_head_HxVd, mask_BxT, in_vocab_BxT,
                                length=cfg.ttt_length, chunk=cfg.loss_chunk, remat=cfg.remat)
            return ttt.weighted_loss(sums[0], count_L, cfg.step_weight), sums

        def micro_batch(carry, xs):
            grads, sums = carry
            (_, micro_sums), micro_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, xs)
            return (jax.tree.map(jnp.add, grads, micro_grads), jax.tree.map(jnp.add, sums, micro_sums)), None

        grads = jax.tree.map(jnp.zeros_like, params)
        if param_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        zeros_L = jnp.zeros((cfg.ttt_length,), jnp.float32)
        (grads, (ce_sum_L, hit_L)), _ = jax.lax.scan(
            micro_batch, (grads, (zeros_L, zeros_L)), (feats_M, hidden_M, ids_MxBxT, mask_MxBxT, in_vocab_MxBxT))
        _, metrics = ttt.ttt_metrics(ce_sum_L, hit_L, count_L, predicted_L, cfg.step_weight)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if param_shardings is not None:
            params = jax.lax.with_sharding_constraint(params, param_shardings)
        return params, opt_state, metrics

    return step


def cache_target_outputs(target, records: dict, directory: Path, batch_size: int = 8) -> dict:
    """Runs the frozen target once over every record and memory-maps its fused features and
    final-normed hidden states (``features.npy``, ``hidden.npy``); the logits are recomputed
    from the hidden by the target's head inside the step.  Reused when already complete.
    On several processes process 0 alone writes the cache, then every process maps it: a
    target on process 0's own devices runs there while the others wait; a target spread
    over the devices of every process (``load_target(mesh=...)``) runs on all of them and
    its outputs are gathered to process 0."""
    directory = Path(directory)
    ids = records["input_ids"]
    n, T = ids.shape
    H = target.config.hidden_size
    meta = {"n": n, "seq_len": T, "hidden": H, "captured": list(target.config.capture_layers),
            "fingerprint": int(np.asarray(ids, np.int64).sum() % (2 ** 31))}
    done = directory / "done.json"
    graph, state = nnx.split(target)
    spread = not all(x.is_fully_addressable for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    writer = jax.process_index() == 0
    if (writer or spread) and not (done.exists() and json.loads(done.read_text()) == meta):
        if writer:
            directory.mkdir(parents=True, exist_ok=True)
            dtype = np.dtype(jnp.dtype(target.dtype))
            feats = np.lib.format.open_memmap(directory / "features.npy", "w+", dtype, (n, T, target.config.feature_width))
            hidden = np.lib.format.open_memmap(directory / "hidden.npy", "w+", dtype, (n, T, H))
        run = jax.jit(lambda st, x: nnx.merge(graph, st).trunk(x, jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape))[:2])
        # positions past a row's last loss token never reach the loss: run each chunk only up to
        # its longest row, rounded up to a multiple of 32 (a few compilations, much less padding)
        used = np.where(records["loss_mask"].any(1), T - np.argmax(records["loss_mask"][:, ::-1], 1), 1)
        for i in tqdm(range(0, n, batch_size), desc="cache target outputs"):
            chunk = ids[i: i + batch_size]
            Tb = min(T, -(-int(used[i: i + batch_size].max()) // 32) * 32)
            padded = np.concatenate([chunk, np.zeros((batch_size - len(chunk), T), ids.dtype)])[:, :Tb]
            out = run(state, padded)
            if spread:  # a collective: every process runs each chunk
                from jax.experimental import multihost_utils

                out = multihost_utils.process_allgather(out, tiled=True)
            if writer:
                h, f = jax.device_get(out)
                hidden[i: i + len(chunk), :Tb], feats[i: i + len(chunk), :Tb] = h[: len(chunk)], f[: len(chunk)]
        if writer:
            feats.flush(), hidden.flush()
            data.write_json(meta, done)
    _barrier("offline cache")
    if not (done.exists() and json.loads(done.read_text()) == meta):
        raise FileNotFoundError(f"{done}: missing or of other records after process 0 wrote the cache "
                                "(is work_dir on storage every process sees?)")
    return {"features": np.load(directory / "features.npy", mmap_mode="r"),
            "hidden": np.load(directory / "hidden.npy", mmap_mode="r")}


def _barrier(name: str):
    """Waits until every process gets here (nothing to wait for on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"eagle3_jax {name}")


def _put(x, sharding_: NamedSharding, *, copy: bool = False):
    """``x`` (host data, an array on this process's devices, or a global array) on
    ``sharding_``; a sharding over other processes' devices too is filled from each
    process's own copy of ``x`` (every process holds the same value), slice by slice."""
    if sharding_.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding_, may_alias=False if copy else None)
    return jax.make_array_from_callback(np.shape(x), sharding_, lambda index: np.asarray(x[index]))


class Trainer:
    """Trains ``drafter`` against ``target`` on ``records`` over ``mesh`` (default: all devices as data)."""

    def __init__(self, target, drafter, records: dict, cfg: FitConfig, *, work_dir: str | Path, mesh: Mesh | None = None):
        self.cfg = cfg
        self.work_dir = Path(work_dir)
        self.mesh = sharding.make_mesh(data=-1) if mesh is None else sharding.auto_mesh(mesh)
        axes = sharding.batch_sharding(self.mesh, 1).spec[0] or ()
        shards = math.prod(self.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
        if cfg.batch_size % shards:
            raise ValueError(f"fit.batch_size={cfg.batch_size} is not divisible by the {shards} batch shards "
                             f"of the mesh {dict(self.mesh.shape)}")
        if cfg.batch_size // cfg.micro_batches % shards:
            raise ValueError(f"fit.micro_batches={cfg.micro_batches}: a micro-batch of {cfg.batch_size // cfg.micro_batches} "
                             f"rows (fit.batch_size / fit.micro_batches) is not divisible by the {shards} batch shards "
                             f"of the mesh {dict(self.mesh.shape)}")
        self.records = records
        self.seq_len = records["input_ids"].shape[1]
        self.opt = optimizer(cfg)

        self.tgraph, tstate = nnx.split(target)
        self.tstate = self._place(tstate, target_mod.declare(target.config).shardings(self.mesh))
        self.dgraph, params, frozen = nnx.split(drafter, nnx.Param, ...)
        dsh = drafter_mod.declare(drafter.config).shardings(self.mesh)  # the shared embedding's too
        self.params = self._place(params, dsh, copy=True)
        self.frozen = self._place(frozen, dsh)
        self.param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
        replicated = NamedSharding(self.mesh, P())
        opt_shardings = opt_state_shardings(self.opt, self.params, self.mesh)
        # placed (committed) from the start: the step's outputs are, and a step whose inputs
        # differ in placement from its last call's compiles again
        self.opt_state = jax.jit(self.opt.init, out_shardings=opt_shardings)(self.params)
        self.step = 0
        self.cached = cache_target_outputs(target, records, self.work_dir / "offline") if cfg.offline else {}
        self.data_iter = data.dataset(records, batch_size=cfg.batch_size, seed=cfg.seed, buckets=tuple(cfg.buckets))
        self.ckpt = ocp.CheckpointManager(
            (self.work_dir / "ckpt").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=True))
        step = fit_step_fn(self.tgraph, self.dgraph, cfg, self.opt, self.param_shardings)
        self._train_step = jax.jit(step, donate_argnums=(0, 1),  # the metrics: whole on every process
                                   out_shardings=(self.param_shardings, opt_shardings, replicated))
        self.best = {"sim_accept_len": -1.0, "step": None}

    def _place(self, state, shardings: dict, *, copy: bool = False):
        """Puts each leaf on its sharding (by parameter name); everything else replicated.
        ``copy``: never alias the caller's arrays (the trainable params are donated)."""
        replicated = NamedSharding(self.mesh, P())

        def put(path, x):
            name = str(getattr(path[0], "key", getattr(path[0], "name", ""))) if path else ""
            return _put(x, shardings.get(name, replicated), copy=copy)

        return jax.tree_util.tree_map_with_path(put, state)

    # ------------------------------------------------------------------ step
    def train_step(self, batch):
        """One optimizer step on a global batch ``{input_ids, loss_mask}`` (with ``rows``
        in offline mode), the same on every process, as ``data_iter`` yields it; each
        process puts only the rows its devices hold.  Returns the metrics."""
        def put(name, dtype=None):
            x = np.asarray(batch[name], dtype)
            return jax.make_array_from_callback(x.shape, sharding.batch_sharding(self.mesh, x.ndim), lambda i: x[i])

        def cached(name):  # only this process's rows are read from the memory-mapped cache
            rows, length, table = np.asarray(batch["rows"]), np.shape(batch["input_ids"])[1], self.cached[name]
            shape = (len(rows), length, *table.shape[2:])
            return jax.make_array_from_callback(shape, sharding.batch_sharding(self.mesh, len(shape)),
                                                lambda i: np.asarray(table[rows[i[0]], :length])[(slice(None), *i[1:])])

        extra = (cached("features"), cached("hidden")) if self.cfg.offline else ()
        self.params, self.opt_state, metrics = self._train_step(self.params, self.opt_state, self.frozen, self.tstate,
                                                                put("input_ids", np.int32), put("loss_mask", bool), *extra)
        self.step += 1
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self):
        state = {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state, "step": self.step}
        self.ckpt.save(self.step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave({"iterator": self.data_iter.get_state(), "best": self.best})))

    def restore(self) -> bool:
        """Restores the latest checkpoint if there is one; returns whether it did."""
        latest = self.ckpt.latest_step()
        if latest is None:
            return False
        abstract = {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state, "step": self.step}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, abstract)
        got = self.ckpt.restore(latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        nnx.replace_by_pure_dict(self.params, got.state["params"])
        self.opt_state = got.state["opt_state"]
        self.step = int(got.state["step"])
        self.data_iter.set_state(got.data["iterator"])
        self.best = got.data["best"]
        return True

    def _check_fresh(self):
        """A new run may not write over an earlier one: its checkpoints would be skipped (orbax
        keeps the later steps) and its ``best/`` overwritten."""
        latest = self.ckpt.latest_step()
        if latest is not None:
            raise FileExistsError(f"{self.work_dir / 'ckpt'}: holds checkpoints of an earlier run (up to step {latest}); "
                                  "pass resume=True to continue it, or move it aside first "
                                  "(`eagle3-jax train fit --no-resume` does)")
        if (self.work_dir / "best").exists():
            raise FileExistsError(f"{self.work_dir / 'best'}: holds the best drafter of an earlier run; move it aside "
                                  "before starting a new run (`eagle3-jax train fit --no-resume` does)")

    def drafter(self):
        """The current drafter as a module (for export or generation).  On several
        processes its arrays are gathered to every host: each process must call it."""
        params, frozen = self.params, self.frozen
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            gather = lambda x: (multihost_utils.process_allgather(x, tiled=True)  # noqa: E731
                                if isinstance(x, jax.Array) and not x.is_fully_addressable else x)
            params, frozen = jax.tree.map(gather, params), jax.tree.map(gather, frozen)
        return nnx.merge(self.dgraph, params, frozen)

    # ------------------------------------------------------------------ loop
    def fit(self, steps: int | None = None, *, resume: bool = False, log_path: str | Path | None = None):
        """Trains up to ``steps`` total steps (default ``cfg.steps``), checkpointing every
        ``save_every`` and at the end; exports the best drafter (by simulated acceptance
        length over the last interval) to ``work_dir/best``.  ``resume``: continue from the
        latest checkpoint in ``work_dir``; a new run (nothing restored, no step taken) refuses
        a ``work_dir`` holding an earlier run's checkpoints or ``best/`` (``FileExistsError``)."""
        steps = self.cfg.steps if steps is None else steps
        if not (resume and self.restore()) and self.step == 0:  # a new run (not this trainer's own continuing)
            self._check_fresh()
        writer = jax.process_index() == 0  # writes the log and best/ (the checkpoints: every process, with orbax)
        log = open(log_path or self.work_dir / "metrics.jsonl", "a") if writer else None
        window, t0, tokens = [], time.perf_counter(), 0
        bar = tqdm(total=steps, initial=self.step, desc="fit")
        try:
            while self.step < steps:
                batch = next(self.data_iter)
                metrics = jax.device_get(self.train_step(batch))
                tokens += int(np.asarray(batch["loss_mask"]).sum())
                window.append(float(metrics["sim_accept_len"]))
                if self.step % self.cfg.log_every == 0 or self.step == steps:
                    row = {"step": self.step, "loss": float(metrics["loss"]),
                           **{f"acc_{i}": float(a) for i, a in enumerate(metrics["acc_s"])},
                           "sim_accept_len": float(metrics["sim_accept_len"]),
                           "tokens_per_second": tokens / (time.perf_counter() - t0)}
                    if log:
                        log.write(json.dumps(row) + "\n")
                        log.flush()
                    bar.set_postfix(loss=f"{row['loss']:.3f}", sim_len=f"{row['sim_accept_len']:.2f}",
                                    acc=" ".join(f"{float(a):.2f}" for a in metrics["acc_s"]), tok_s=f"{row['tokens_per_second']:.0f}")
                bar.update(1)
                if self.step % self.cfg.save_every == 0 or self.step == steps:
                    score = float(np.mean(window))
                    window = []
                    better = score > self.best["sim_accept_len"]
                    if jax.process_count() > 1:  # every process takes process 0's branch (drafter() is collective)
                        from jax.experimental import multihost_utils

                        better = bool(multihost_utils.broadcast_one_to_all(np.int32(better)))
                    if better:
                        self.best = {"sim_accept_len": score, "step": self.step}
                        drafter = self.drafter()
                        if writer:
                            save_drafter(drafter, self.work_dir / "best")
                    self.save()
        finally:
            bar.close()
            if log:
                log.close()
            self.ckpt.wait_until_finished()
        return self.best
