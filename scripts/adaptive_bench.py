"""Adaptive speculative budget vs static tiers on the built-in pair (greedy, the fastest of --repeats interleaved passes).

    python scripts/adaptive_bench.py [--num-prompts 64] [--batch-sizes 1 8] [--repeats 3] [--drafters trained untrained]
                                     [--tiers chain4 chain6 16,4,4 32,6,8]

For each batch size: vanilla, each static tier, and the adaptive policy over those tiers
(plus no drafting), with the trained drafter and with an untrained drafter of the same shape
(random weights: drafting never pays).  Prints tokens/s, the ratio of adaptive to the best
static tier and to vanilla, and the rounds per tier the policy chose.
"""

from __future__ import annotations

import argparse
import json

from flax import nnx

from eagle3_jax import builtin
from eagle3_jax.bench import run_bench
from eagle3_jax.tree import parse_tree
from eagle3_jax.decode import encode_chat
from eagle3_jax.models.drafter import Drafter
from eagle3_jax.speculation import Speculation

TIERS = ("chain4", "chain6", "16,4,4", "32,6,8")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts, each running every mode batch by batch; the fastest kept (this machine is noisy)")
    ap.add_argument("--drafters", nargs="+", choices=("trained", "untrained"), default=["trained", "untrained"],
                    help="the built-in drafter and/or an untrained one of the same shape")
    ap.add_argument("--tiers", nargs="+", default=list(TIERS), help="the static tiers (TOTAL,DEPTH,TOPK or chainN), "
                    "and the adaptive policy's over them and no drafting")
    ap.add_argument("--json", help="write the reports here")
    args = ap.parse_args(argv)

    target, drafter, tok = builtin.load()
    tasks = builtin.eval_tasks()[: args.num_prompts]
    prompts = [encode_chat(tok, [{"role": "user", "content": t["prompt"]}]) for t in tasks]
    untrained = Drafter(drafter.config, target.embed[...], d2t=drafter.d2t[...], rngs=nnx.Rngs(1))
    trees = [parse_tree(t) for t in args.tiers]
    reports = []
    for name, d in (("trained", drafter), ("untrained", untrained)):
        if name not in args.drafters:
            continue
        for batch in args.batch_sizes:
            print(f"--- {name} drafter, batch {batch}")
            rep = run_bench(target, d, prompts, trees=[*trees, Speculation((None, *trees))],
                            max_new_tokens=args.max_new_tokens, batch_size=batch, repeats=args.repeats)
            vanilla = rep["vanilla"]["tokens_per_second"]
            static = {e["tree"]["name"]: e["tokens_per_second"] for e in rep["eagle3"][:-1]}
            ada = rep["eagle3"][-1]
            best = max(static, key=static.get)
            others = [k for k in static if k != best]
            print(f"adaptive {ada['tokens_per_second']:.1f} tok/s = {ada['tokens_per_second'] / static[best]:.3f}x the "
                  f"best static tier ({best}), {ada['tokens_per_second'] / vanilla:.3f}x vanilla; above every other "
                  f"tier: {all(ada['tokens_per_second'] > static[k] for k in others)}; rounds per tier "
                  f"{ada['tier_rounds']}; identical to vanilla: {ada['identical_to_vanilla']}")
            reports.append({"drafter": name, "batch": batch, **rep})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)


if __name__ == "__main__":
    main()
