"""Decode-loop costs on one CPU core against all of them, each setting in a fresh process.

    python scripts/cpu_cores_bench.py [--runs 3] [--repeats 5]

On a small host a batch-1 step is a few hundred tiny ops, and XLA:CPU hands ready ops to the
threads of its pool: on 2 cores a step can cost more than on one (likely the handoffs, and
each op's inputs moving between the cores' caches). This times, in the built-in pair's
compiled decode loop, a vanilla step and a chain-6 round at batch 1, and a vanilla step and a
chain-4 round at batch 32 (``eagle3_jax.cost``'s method: forced rounds, a long call minus a
short one over the rounds between them; the median of ``--repeats``), in child processes
pinned to the first core (``os.sched_setaffinity`` before JAX starts, so that every thread it
makes runs there) and given every core, the two taking turns ``--runs`` times. It prints each
child's figures and the two ratios behind ``eagle3-jax bench``'s batch-1 speedup and batch
scaling: a chain-6 round over a vanilla step at batch 1, and a batch-32 step over a batch-1 one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def measure(repeats: int) -> dict:
    """Milliseconds per step or round of each loop, in this process."""
    import numpy as np

    from eagle3_jax import builtin, decode
    from eagle3_jax.decode import encode_chat
    from eagle3_jax.tree import TreeConfig

    target, drafter, tok = builtin.load()
    prompt = encode_chat(tok, [{"role": "user", "content": builtin.eval_tasks()[1]["prompt"]}])
    out = {}
    # (name, drafter, batch, tree, rounds of the long call)
    for name, d, batch, tree, long in (("vanilla_b1", None, 1, None, 200), ("chain6_b1", drafter, 1, 6, 40),
                                       ("vanilla_b32", None, 32, None, 60), ("chain4_b32", drafter, 32, 4, 30)):
        compiled, args = decode.compile_generate(target, d, [prompt] * batch, max_new_tokens=256,
                                                 tree=TreeConfig.chain(tree or 1))
        decode.forced_call(compiled, args, 0, 4)  # the program's first run
        ms = []
        for _ in range(repeats):
            short_s, short_n = decode.forced_call(compiled, args, 0, 4)
            long_s, long_n = decode.forced_call(compiled, args, 0, long)
            ms.append(1e3 * (long_s - short_s) / max(long_n - short_n, 1))
        out[name] = float(np.median(ms))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="turns of the two settings, each child a fresh process")
    ap.add_argument("--repeats", type=int, default=5, help="timings per loop in a child (their median is kept)")
    ap.add_argument("--child", choices=["one", "all"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.repeats < 1:
        ap.error(f"--runs and --repeats must be at least 1, got {args.runs} and {args.repeats}")

    if not hasattr(os, "sched_setaffinity"):
        sys.exit("cpu_cores_bench: needs os.sched_setaffinity (Linux) to pin a process to one core")
    if args.child:
        if args.child == "one":
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(json.dumps({"cores": len(os.sched_getaffinity(0)), **measure(args.repeats)}), flush=True)
        return

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        sys.exit(f"cpu_cores_bench: this process may run on {cores} core; nothing to compare")
    print(f"{cores} cores; ms per vanilla step / speculative round in the compiled loop (median of {args.repeats})")
    print("run  cores  vanilla b1  chain6 b1  vanilla b32  chain4 b32  chain6/vanilla b1  vanilla b32/b1")
    for run in range(args.runs):
        for setting in ("one", "all"):
            child = subprocess.run([sys.executable, __file__, "--child", setting, "--repeats", str(args.repeats)],
                                   capture_output=True, text=True)
            if child.returncode:
                sys.exit(f"cpu_cores_bench: the {setting}-core child failed:\n{child.stderr[-3000:]}")
            r = json.loads(child.stdout.strip().splitlines()[-1])
            print(f"{run + 1:3d}  {r['cores']:5d}  {r['vanilla_b1']:10.2f}  {r['chain6_b1']:9.2f}  "
                  f"{r['vanilla_b32']:11.2f}  {r['chain4_b32']:10.2f}  {r['chain6_b1'] / r['vanilla_b1']:17.2f}  "
                  f"{r['vanilla_b32'] / r['vanilla_b1']:14.2f}", flush=True)


if __name__ == "__main__":
    main()
