"""A batch decoded in phases vs one static loop, on the built-in pair (the fastest of --repeats interleaved passes).

    python scripts/phases_bench.py [--num-prompts 64] [--batch-size 32] [--max-new-tokens 256] [--repeats 3]

``generate`` gathers a batch's rows still decoding into half as many rows once at most half of
them are left, then into a quarter (from ``eagle3_jax.decode.COMPACT_FROM`` rows on).  This
runs the built-in eval prompts (the families interleaved, as ``eagle3-jax bench`` batches them)
in batches of ``--batch-size``, vanilla and
each ``--tree``, with the phases and without them (``generate(..., phases=False)``);
prints tokens/s, the ratio of the two, the share of a static batch's row-steps that make a
token, and checks that both give every row the same tokens.
"""

from __future__ import annotations

import argparse
import math

from eagle3_jax import builtin
from eagle3_jax.tree import parse_tree
from eagle3_jax.decode import encode_chat, generate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tree", nargs="+", default=["chain4"])
    ap.add_argument("--repeats", type=int, default=3,
                    help="passes, each running every setting batch by batch; the fastest kept (this machine is noisy)")
    args = ap.parse_args(argv)

    target, drafter, tok = builtin.load()
    tasks = builtin.eval_tasks()[: args.num_prompts]
    prompts = [encode_chat(tok, [{"role": "user", "content": t["prompt"]}]) for t in tasks]
    chunks = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    modes = [("vanilla", None, None)] + [(t, drafter, parse_tree(t)) for t in args.tree]
    settings = [(m, phased) for m in modes for phased in (False, True)]
    best, tokens = {}, {}
    for r in range(args.repeats):
        for k in range(len(settings)):  # an order that rotates per pass
            (name, d, tree), phased = settings[(k + r) % len(settings)]
            seconds, out = 0.0, []
            for chunk in chunks:
                res = generate(target, d, chunk, max_new_tokens=args.max_new_tokens, phases=phased,
                               **({} if tree is None else {"tree": tree}))
                seconds += res.stats["seconds"]
                out += res.tokens
            best[name, phased] = min(best.get((name, phased), math.inf), seconds)
            tokens[name, phased] = out
    n = sum(map(len, tokens["vanilla", False]))
    steps = sum(len(c) * max(len(t) for t in tokens["vanilla", False][i:i + len(c)])
                for i, c in zip(range(0, len(prompts), args.batch_size), chunks))
    print(f"{len(prompts)} prompts in batches of {args.batch_size}, {args.max_new_tokens} new tokens: "
          f"{n} tokens; a static batch's row-steps that make a token: {n / steps:.0%} (vanilla)")
    for name, _, _ in modes:
        static, phased = best[name, False], best[name, True]
        same = tokens[name, False] == tokens[name, True]
        print(f"{name:8s} static {n / static:7.1f} tok/s, phased {n / phased:7.1f} tok/s: {static / phased:.2f}x; "
              f"identical tokens: {same}")
    for name, _, _ in modes[1:]:
        print(f"{name} speedup over vanilla: static {best['vanilla', False] / best[name, False]:.2f}x, "
              f"phased {best['vanilla', True] / best[name, True]:.2f}x; greedy identical to vanilla: "
              f"{tokens[name, True] == tokens['vanilla', True]}")


if __name__ == "__main__":
    main()
