"""Stress fuzzing of the checkpoint readers: the fuzz cases of ``tests/test_checkpoint_torch_reader.py``
with many more examples, and a summary of the outcomes.

    python scripts/fuzz_checkpoints.py --examples 2000

Each case must load exactly what an independent oracle computes or be refused with a
``ValueError`` naming the file (and the tensor or key); a violation stops the run with
hypothesis's shrunk example and exit status 1.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import checkpoint_forge as forge  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples per fuzz case (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be positive, got {args.examples}")
    fields, pickles, flips, configs = forge.strategies()
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "pytorch_model.bin"
        cases = {
            "tensor fields": (fields, lambda c: forge.check_fields(file, c)),
            "pickle bytes": (pickles, lambda c: forge.check_pickle_bytes(file, c)),
            "zip bytes": (flips, lambda c: forge.check_zip_bytes(file, c)),
            "configs": (configs, lambda c: forge.check_config(*c)),
        }
        total = 0
        for name, (strategy, check) in cases.items():
            outcomes = collections.Counter()

            @seed(args.seed)
            @settings(max_examples=args.examples, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
            @given(strategy)
            def run(case):
                outcomes[check(case)] += 1

            start = time.perf_counter()
            try:
                run()
            except AssertionError as e:
                print(f"{name}: FAILED\n{e}", file=sys.stderr)
                return 1
            runs = sum(outcomes.values())
            total += runs
            print(f"{name}: {runs} runs in {time.perf_counter() - start:.1f}s")
            for outcome, n in outcomes.most_common():
                print(f"  {n:6d}  {outcome}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"all {total} runs passed; peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
