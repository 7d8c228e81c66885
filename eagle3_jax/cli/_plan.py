"""The ``plan`` command: a dry run of a training config on a mesh (per-device bytes of weights,
KV caches, drafter, optimizer state and activations), or with ``--topology`` its programs
compiled for a TPU topology and the report written as JSON."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from eagle3_jax import plan
from eagle3_jax.atomic import write_atomic
from eagle3_jax.sharding import parse_mesh


def cmd_plan(args) -> int:
    """``eagle3-jax plan``: the training config's per-device memory on a mesh, estimated
    (:func:`eagle3_jax.plan.plan`) or, with ``--topology``, compiled for a TPU topology."""
    mesh = None if args.mesh is None else parse_mesh(args.mesh)
    if args.topology == "config":
        from eagle3_jax.train import pipeline  # the train extra (orbax, grain)

        args.topology = pipeline.load_config(args.config, args.overrides).topology
        if not args.topology:
            raise ValueError(f"{args.config}: names no topology; give --topology NAME (e.g. v6e:2x4)")
    if args.topology is not None:
        return _plan_topology(args, mesh)
    memory = None if args.device_memory is None else plan.parse_bytes(args.device_memory)
    p = plan.plan(args.config, mesh=mesh, batch=args.batch, seq_len=args.seq_len, device_memory=memory,
                  target_config=args.target_config, overrides=args.overrides)
    print(plan.format_plan(p, args.config))
    return 0


def _plan_topology(args, mesh) -> int:
    """``plan --topology``: the config's programs compiled for a TPU topology (its report
    printed, and written as JSON to ``--json``, default ``plan-<topology>.json``)."""
    out = Path(args.json or f"plan-{args.topology.replace(':', '-')}.json")
    if out.is_dir():
        raise ValueError(f"--json {out}: is a directory; give a file path")
    programs = tuple(args.programs.split(",")) if args.programs else ("decode", "slots", "fit")
    unknown = sorted(set(programs) - {"decode", "slots", "fit"})
    if unknown:
        raise ValueError(f"--programs {args.programs}: unknown {', '.join(unknown)}; choose from decode, slots, fit")
    start = time.perf_counter()

    def progress(name):  # one line a program: a compile takes seconds to minutes
        print(f"[{time.perf_counter() - start:6.0f} s] compiling {name} for {args.topology}", file=sys.stderr,
              flush=True)

    report = plan.plan_topology(args.config, args.topology, mesh=mesh, tau=args.tau, prompt_len=args.prompt_len,
                                attention_impl=args.attention, target_config=args.target_config,
                                overrides=args.overrides, programs=programs, progress=progress)
    report["compile_total_s"] = round(time.perf_counter() - start, 1)
    print(plan.format_topology_report(report))
    print(f"compiled in {report['compile_total_s']:.0f} s; report: {out}")
    write_atomic(out, json.dumps(report, indent=1) + "\n")
    return 0
