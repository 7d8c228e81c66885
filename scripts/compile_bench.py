"""XLA:CPU's compile time for ``generate``'s decode loops, with its MLIR fusion emitters (XLA's
default) and with the older LLVM IR emitters (``--xla_cpu_use_fusion_emitters=false``, the
test suite's setting, ``tests/conftest.py``), and the compiled loops' run time.

    python scripts/compile_bench.py [--repeats 2] [--full-optimization]

XLA reads ``XLA_FLAGS`` once per process, so each setting compiles in a process of its own
(the settings alternate, ``--repeats`` times each); the persistent compilation cache is off.
Per loop of the built-in pair (batch 4, a 20-token prompt, 64 new tokens): XLA's compile time
(JAX's ``backend_compile_duration`` event; tracing and lowering are the same either way), the
process's CPU time over ``compile_generate`` (tracing, lowering and XLA's threads compiling), and
one warm greedy call's time; then each setting's totals
(the median over repeats) and the ratios.  The suite compiles with
``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` (its default here too); ``--full-optimization`` measures
XLA's default pipeline instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SETTINGS = {"MLIR emitters (default)": "", "LLVM IR emitters": "--xla_cpu_use_fusion_emitters=false"}
LOOPS = ("vanilla", "chain4", "tree 60,7,10", "adaptive chain4,chain2,none")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child() -> None:
    """Compiles and runs each loop in this process; prints one JSON line per loop."""
    import jax

    from eagle3_jax import builtin
    from eagle3_jax.decode import compile_generate, timed_call
    from eagle3_jax.speculation import Speculation
    from eagle3_jax.tree import TreeConfig

    backend = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: backend.append(secs) if event.endswith("/backend_compile_duration") else None)
    target, drafter, _ = builtin.load()
    prompts = [[5 + i] * 20 for i in range(4)]
    calls = {
        "vanilla": (None, {}),
        "chain4": (drafter, {"tree": TreeConfig.chain(4)}),
        "tree 60,7,10": (drafter, {"tree": TreeConfig()}),
        "adaptive chain4,chain2,none": (drafter, {"speculation": Speculation((TreeConfig.chain(4), TreeConfig.chain(2),
                                                                             None)), "round_ms": [1.0, 1.0, 1.0]}),
    }
    for name in LOOPS:
        d, kw = calls[name]
        backend.clear()
        cpu0 = _cpu()
        compiled, args = compile_generate(target, d, prompts, max_new_tokens=64, **kw)
        cpu = _cpu() - cpu0
        timed_call(compiled, args)  # the first run's one-time costs
        seconds = timed_call(compiled, args)[0]
        print(json.dumps({"loop": name, "compile_s": sum(backend), "cpu_s": cpu, "run_s": seconds}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="processes per setting, alternating (default 2)")
    ap.add_argument("--full-optimization", action="store_true", help="XLA's default pipeline, not the suite's cheap one")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child()
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false",
               JAX_DISABLE_MOST_OPTIMIZATIONS="0" if a.full_optimization else "1")
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    t0 = time.time()
    for r in range(a.repeats):
        for setting, flags in SETTINGS.items():
            out = subprocess.run([sys.executable, __file__, "--child"], env={**env, "XLA_FLAGS": flags},
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{setting}: the child process failed:\n{out.stderr[-3000:]}")
            rows = {row["loop"]: row for row in map(json.loads, out.stdout.splitlines())}
            runs[setting].append(rows)
            print(f"[{time.time() - t0:6.1f} s] {setting}, repeat {r + 1}: compile "
                  f"{sum(x['compile_s'] for x in rows.values()):.2f} s", file=sys.stderr, flush=True)
    med = {s: {loop: {k: statistics.median(run[loop][k] for run in rs) for k in ("compile_s", "cpu_s", "run_s")}
               for loop in LOOPS} for s, rs in runs.items()}
    pipeline = "full optimization" if a.full_optimization else "JAX_DISABLE_MOST_OPTIMIZATIONS=1"
    print(f"built-in pair, batch 4, 64 new tokens, {pipeline}; median of {a.repeats} process(es) per setting")
    print(f"{'loop':30s}" + "".join(f"{s:>24s}" for s in SETTINGS) + "   (compile s / CPU s / run ms)")
    for loop in LOOPS:
        cells = "".join(f"{m[loop]['compile_s']:7.2f} {m[loop]['cpu_s']:7.2f} {1e3 * m[loop]['run_s']:7.1f}"
                        .rjust(24) for m in med.values())
        print(f"{loop:30s}{cells}")
    s0, s1 = SETTINGS
    tot = {s: {k: sum(m[loop][k] for loop in LOOPS) for k in ("compile_s", "cpu_s", "run_s")} for s, m in med.items()}
    print(f"total: compile {tot[s0]['compile_s']:.2f} -> {tot[s1]['compile_s']:.2f} s "
          f"({tot[s0]['compile_s'] / tot[s1]['compile_s']:.2f}x faster), CPU {tot[s0]['cpu_s']:.2f} -> "
          f"{tot[s1]['cpu_s']:.2f} s ({tot[s0]['cpu_s'] / tot[s1]['cpu_s']:.2f}x), run "
          f"{1e3 * tot[s0]['run_s']:.1f} -> {1e3 * tot[s1]['run_s']:.1f} ms ({tot[s1]['run_s'] / tot[s0]['run_s']:.2f}x the time)")


if __name__ == "__main__":
    main()
