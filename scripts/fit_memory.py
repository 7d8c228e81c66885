"""Compiled memory of the fit step (``eagle3_jax.train.trainer.fit_step_fn``) from abstract
inputs only (nothing is allocated): for each setting of ``fit.micro_batches`` /
``fit.loss_chunk`` / ``fit.remat``, the XLA ``memory_analysis()`` temporaries and arguments
of one device running the whole batch, and the compile time.  The default shapes are the
tiny config's (``configs/tiny.yaml``: the tiny target, draft vocabulary 256, batch 16 x 96
positions, four TTT steps).

``--topology v5e:2x2`` compiles for one chip of that TPU topology instead of this host's
CPU (``jax[tpu]``'s libtpu; no TPU needed); XLA:CPU schedules the rematerialised steps'
recomputation early, so ``fit.remat`` saves nothing there, while the TPU compiler's
schedule keeps it.  ``--reference`` also measures the plain step the tests compare against
(``plain_fit_step_fn`` of ``tests/helpers.py``: the code before the memory work, the whole float32 logits).

    python scripts/fit_memory.py [--target-config CONFIG_JSON] [--draft-vocab 256] [--batch 16]
        [--seq-len 96] [--ttt-length 4] [--dtype float32] [--compute-dtype float32]
        [--setting MICRO_BATCHES,LOSS_CHUNK,REMAT ...] [--reference] [--topology NAME] [--json OUT]

e.g. ``--setting 1,256,1 --setting 4,64,1``; the default settings span each knob.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SETTINGS = ("1,100000,0", "1,256,1", "1,32,1", "2,256,1", "4,32,1")


def abstract_models(target_config: Path, draft_vocab: int, dtype: str):
    """``(tgraph, tstate, dgraph, params, frozen)`` of the target and the pipeline's fresh
    drafter for it, every leaf a ``ShapeDtypeStruct``."""
    from eagle3_jax.config import TargetConfig, read_config_json
    from eagle3_jax.models.target import Target
    from eagle3_jax.train.pipeline import new_drafter

    tcfg = TargetConfig.from_dict(read_config_json(target_config), source=str(target_config))
    target = nnx.eval_shape(lambda: Target(tcfg, dtype=jnp.dtype(dtype)))
    drafter = nnx.eval_shape(lambda: new_drafter(Target(tcfg, dtype=jnp.dtype(dtype)), None, draft_vocab_size=draft_vocab))
    return (*nnx.split(target), *nnx.split(drafter, nnx.Param, ...))


def one_chip(topology: str | None):
    """A sharding on one chip of the TPU ``topology``, or None (this host's default device)."""
    if topology is None:
        return None
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    return NamedSharding(Mesh(devices[:1], ("data",)), P())


def measure(models, *, batch: int, seq_len: int, ttt_length: int, compute_dtype: str, micro_batches: int,
            loss_chunk: int, remat: bool, sharding=None, reference: bool = False) -> dict:
    """Compiles one fit step (``reference``: the tests' plain step) and returns its
    ``memory_analysis()`` sizes and compile seconds."""
    from eagle3_jax.train.trainer import FitConfig, fit_step_fn, optimizer

    tgraph, tstate, dgraph, params, frozen = models
    cfg = FitConfig(batch_size=batch, ttt_length=ttt_length, compute_dtype=compute_dtype, micro_batches=micro_batches,
                    loss_chunk=loss_chunk, remat=remat)
    opt = optimizer(cfg)
    if reference:
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import plain_fit_step_fn

        step = plain_fit_step_fn(tgraph, dgraph, cfg, opt)
    else:
        step = fit_step_fn(tgraph, dgraph, cfg, opt)
    place = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)  # noqa: E731
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        *place((params, jax.eval_shape(opt.init, params), frozen, tstate, jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
                jax.ShapeDtypeStruct((batch, seq_len), jnp.bool_)))).compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    return {"step": "reference" if reference else "fit_step_fn", "micro_batches": micro_batches,
            "loss_chunk": loss_chunk, "remat": remat, "temp_bytes": mem.temp_size_in_bytes,
            "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "compile_seconds": round(seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-config", type=Path, default=ROOT / "tests" / "fixtures" / "target_tiny" / "config.json")
    ap.add_argument("--draft-vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--ttt-length", type=int, default=4)
    ap.add_argument("--dtype", default="float32", help="the models' dtype")
    ap.add_argument("--compute-dtype", default="float32", help="fit.compute_dtype")
    ap.add_argument("--setting", action="append", help="MICRO_BATCHES,LOSS_CHUNK,REMAT (0 or 1); repeatable")
    ap.add_argument("--reference", action="store_true", help="also measure the tests' plain step (the code before)")
    ap.add_argument("--topology", help="compile for one chip of this TPU topology (e.g. v5e:2x2; needs jax[tpu])")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)

    models = abstract_models(args.target_config, args.draft_vocab, args.dtype)
    sharding = one_chip(args.topology)
    device = args.topology or jax.devices()[0].platform
    print(f"fit step on {device}: {args.target_config}, draft vocab {args.draft_vocab}, batch {args.batch} x "
          f"{args.seq_len}, ttt_length {args.ttt_length}, {args.dtype} (compute {args.compute_dtype})")
    print(f"{'step':>11} {'micro_batches':>13} {'loss_chunk':>10} {'remat':>5} {'temp MiB':>10} {'args MiB':>9} "
          f"{'compile s':>9}")
    runs = [(True, "1,1,0")] if args.reference else []
    rows = []
    for reference, setting in runs + [(False, s) for s in args.setting or DEFAULT_SETTINGS]:
        micro, chunk, remat = (int(v) for v in setting.split(","))
        row = measure(models, batch=args.batch, seq_len=args.seq_len, ttt_length=args.ttt_length,
                      compute_dtype=args.compute_dtype, micro_batches=micro, loss_chunk=chunk, remat=bool(remat),
                      sharding=sharding, reference=reference)
        rows.append(row)
        shown = ("-", "-", "-") if reference else (micro, chunk, remat)
        print(f"{row['step']:>11} {shown[0]:>13} {shown[1]:>10} {shown[2]:>5} {row['temp_bytes'] / 2**20:>10.2f} "
              f"{row['argument_bytes'] / 2**20:>9.2f} {row['compile_seconds']:>9}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
