"""The training pipeline on two processes of JAX's multi-controller runtime on this machine
(a loopback coordinator, 2 processes × 2 CPU devices, gloo collectives) against one process
with 4 devices.

The two processes run ``train all`` (prepare → regenerate → vocab → fit → export) on the
tiny config; then one process with 4 devices runs ``fit`` on the same records and vocab
map.  Checked: each process regenerated its own block of the conversations and the joined
records hold every conversation once, in order; no shard or temporary file is left; the
fit losses of both runs agree (rtol 1e-5); one process wrote the export, once.

    python scripts/multihost_pipeline.py [--conversations 24] [--steps 4] [--work-dir DIR] [KEY=VALUE ...]

(``KEY=VALUE``: config overrides for both runs, e.g. ``fit.offline=true``.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def overrides(work: Path, run: str, steps: int, mesh: str, extra=()) -> list[str]:
    data, tensor = mesh.split("x")
    return [f"target={ROOT / 'tests' / 'fixtures' / 'target_tiny'}", f"tokenizer={work / 'tok'}",
            f"data={work / 'conv.jsonl'}", f"work_dir={work / run}", "seq_len=48", "regenerate.max_new_tokens=12",
            "regenerate.batch_size=8", f"fit.steps={steps}", "fit.batch_size=8", "fit.ttt_length=2", "fit.log_every=1",
            "fit.save_every=2", "fit.warmup_steps=1", "fit.buckets=[]", f"mesh.data={data}", "mesh.fsdp=1",
            f"mesh.tensor={tensor}", *extra]


def worker(args):
    """One process: joins the runtime (when several), then runs the pipeline steps."""
    import jax

    if args.processes > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes,
                                   process_id=args.process)
    from eagle3_jax.train import pipeline

    assert jax.process_count() == args.processes and len(jax.devices()) == 4, (jax.process_count(), jax.devices())
    cfg = pipeline.load_config(ROOT / "configs" / "tiny.yaml", overrides(Path(args.work_dir), args.run, args.steps,
                                                                        args.mesh, args.overrides))
    pipeline.run(args.step, cfg)


def launch(work: Path, run: str, step: str, processes: int, steps: int, mesh: str, timeout: float,
           extra=()) -> list[str]:
    """Runs ``step`` in ``processes`` processes with 4 devices in all; returns their outputs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the caller's XLA flags kept, the device count added
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={4 // processes}".strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--process", str(i), "--processes", str(processes),
                               "--port", str(port), "--work-dir", str(work), "--run", run, "--step", step,
                               "--steps", str(steps), "--mesh", mesh, *extra],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(processes)]
    outs = []
    try:
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
            (work / f"{run}.process{i}.log").write_text(out)
            if p.returncode:
                raise RuntimeError(f"{run}: process {i} of {processes} failed (exit {p.returncode}):\n{out[-4000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def cpu_s() -> float:
    """CPU seconds used by finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mesh", default="2x2", help="data x tensor, 4 devices in all")
    p.add_argument("--work-dir", help="default: a temporary directory, removed after")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--process", "--processes", "--port"):
        p.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides for both runs, e.g. fit.offline=true")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    import numpy as np

    from eagle3_jax.train import data
    from eagle3_jax.train.tiny import arithmetic_conversations, arithmetic_corpus, build_tokenizer

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="multihost-"))
    try:
        build_tokenizer(work / "tok", arithmetic_corpus())
        convs = arithmetic_conversations(args.conversations, seed=0)
        (work / "conv.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
        start, cpu = time.perf_counter(), cpu_s()
        outs = launch(work, "multi", "all", 2, args.steps, args.mesh, args.timeout, args.overrides)
        multi_s, multi_cpu = time.perf_counter() - start, cpu_s() - cpu
        multi = work / "multi"

        # regenerate: process i did the i-th contiguous block; the joined records hold each conversation once, in order
        n = args.conversations
        for i, out in enumerate(outs):
            block = data.shard_range(n, i, 2)
            assert f"process {i} of 2: conversations [{block.start}, {block.stop}): {len(block)} records" in out, out
        regenerated = json.loads((multi / "regenerated.json").read_text())
        assert [c[0]["content"] for c in regenerated] == [c["conversations"][0]["value"] for c in convs]
        records = data.load_records(multi / "regenerated.npz")
        assert len(records["input_ids"]) == n
        leftovers = sorted(f.name for f in multi.iterdir() if ".shard-" in f.name or ".tmp" in f.name)
        assert not leftovers, leftovers

        # one export, by process 0
        exported = [i for i, out in enumerate(outs) for line in out.splitlines() if line.startswith("exported ")]
        assert exported == [0], exported
        assert (multi / "export" / "model.safetensors").is_file() and (multi / "best" / "model.safetensors").is_file()

        # fit: one process with the same 4 devices, the same records and vocab map
        single = work / "single"
        single.mkdir()
        for name in ("regenerated.npz", "vocab.npz"):
            shutil.copy(multi / name, single / name)
        start, cpu = time.perf_counter(), cpu_s()
        launch(work, "single", "fit", 1, args.steps, args.mesh, args.timeout, args.overrides)
        single_s, single_cpu = time.perf_counter() - start, cpu_s() - cpu
        got, want = losses(multi / "metrics.jsonl"), losses(single / "metrics.jsonl")
        assert len(got) == len(want) == args.steps, (got, want)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        print(f"2 processes x 2 devices, mesh {args.mesh}: train all in {multi_s:.1f} s ({multi_cpu:.1f} CPU s); "
              f"{n} conversations split "
              f"{[len(data.shard_range(n, i, 2)) for i in range(2)]}, {n} records joined in order, no shard left")
        print(f"fit losses, 2 processes: {[round(x, 6) for x in got]}")
        print(f"fit losses, 1 process:   {[round(x, 6) for x in want]} (fit in {single_s:.1f} s, "
              f"{single_cpu:.1f} CPU s)")
        print(f"max relative difference {max(abs(a - b) / abs(b) for a, b in zip(got, want)):.2e}; "
              f"export written once, by process {exported[0]}")
        print("ok")
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
