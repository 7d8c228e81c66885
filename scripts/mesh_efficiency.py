"""What a data-parallel mesh costs beyond its devices' shares of the work: a round of the
compiled decode loop at batch ``2n`` on a ``data=2`` mesh against batch ``n`` on one device.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/mesh_efficiency.py [--batch-size 32] [--tree chain14]

On the built-in pair, vanilla and the ``--tree``: each loop is run with the tree forced for a
short and a long stretch of rounds (``eagle3_jax.cost.forced_rounds``: the fastest of
``--repeats`` calls, the programs taking turns), and a round costs the difference over the
rounds in between.  With both halves of the batch decoding at once and nothing else to do, the
mesh's round would cost what one device's half-batch round does; the printed ratio is what the
mesh adds (its collectives, and the two devices sharing the memory and the machine).  Also
counts the collective instructions in the mesh program's loops (every phase's loop and the
loops inside a round: ``scripts/mesh_decode.py``'s ``loop_collectives``).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import jax

from eagle3_jax import builtin, cost, sharding
from eagle3_jax.tree import parse_tree
from eagle3_jax.decode import compile_generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh_decode import loop_collectives  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32, help="the mesh's batch (one device runs half of it)")
    ap.add_argument("--tree", default="chain14")
    ap.add_argument("--new-tokens", type=int, default=200, help="tokens the long stretch of forced rounds makes")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if len(jax.devices()) < 2:
        raise SystemExit("needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    if args.batch_size < 2 or args.batch_size % 2:
        raise SystemExit(f"--batch-size {args.batch_size}: an even number of rows, at least 2")
    target, drafter, _ = builtin.load()
    mesh = sharding.make_mesh(data=2, devices=jax.devices()[:2])
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    tree = parse_tree(args.tree)
    for name, d in (("vanilla", None), (args.tree, drafter)):
        progs = {"one device": compile_generate(target, d, [prompt] * (args.batch_size // 2), max_new_tokens=256,
                                                tree=tree),
                 "mesh": compile_generate(target, d, [prompt] * args.batch_size, max_new_tokens=256, mesh=mesh,
                                          tree=tree)}
        per_round = 1 if d is None else tree.path_len
        one, two = cost.forced_rounds(list(progs.values()), args.new_tokens, per_round, repeats=args.repeats,
                                      parts=False)
        ops = collections.Counter(op for op, _ in loop_collectives(progs["mesh"][0].as_text()))
        print(f"{name:8s} round: batch {args.batch_size // 2} on one device {one['round_ms']:.2f} ms, batch "
              f"{args.batch_size} on data=2 {two['round_ms']:.2f} ms ({two['round_ms'] / one['round_ms']:.2f}x); "
              f"collective instructions in the mesh program's loops: {dict(ops) or 'none'}", flush=True)


if __name__ == "__main__":
    main()
