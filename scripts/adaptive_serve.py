"""The adaptive policy in the server under load, run after run: does it settle on the tier that
pays?  The built-in pair behind a server of ``--max-batch`` slots (in this process, loopback);
each run resets the policy (a fresh warm-up, often on its first request alone) and sends
``--requests`` greedy streamed chat requests from the eval prompts (``serve.replay.run_load``),
Poisson arrivals at ``--rate`` per second (run ``i``: arrival seed ``i``, the prompts from
``i * requests`` on).  Prints each run's tokens/s and rounds per tier (each request's rounds,
summed: a round of 8 requests counts 8 times), then their means.

    python scripts/adaptive_serve.py --runs 8 --rate 64 --tiers chain2 chain4 chain6 16,4,4 chain14
    python scripts/adaptive_serve.py --runs 8 --rate 64 --thin 0    # the rule before 985b537

``--thin`` sets ``eagle3_jax.speculation.THIN`` before the engine compiles (the decayed offers
below which a draft position, drafted in fewer than ``THIN_ROUNDS`` chain rounds, is taken at
no less than the rate of all positions; 0: never).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from eagle3_jax import builtin, speculation
from eagle3_jax.tree import parse_tree
from eagle3_jax.serve.server import ServerThread, build
from eagle3_jax.serve.replay import run_load
from eagle3_jax.speculation import Speculation, tier_name


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rate", type=float, default=64.0, help="requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=24, help="requests per run")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=8, help="the server's slots")
    ap.add_argument("--max-len", type=int, default=512, help="tokens per slot")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="per run; unfinished requests count as timeouts")
    ap.add_argument("--tiers", nargs="+", default=["chain2", "chain4", "chain6", "16,4,4", "chain14"],
                    help="the adaptive policy's tiers, besides no drafting")
    ap.add_argument("--thin", type=float, default=None, help="override speculation.THIN (0: the rule before 985b537)")
    args = ap.parse_args(argv)

    if args.thin is not None:
        speculation.THIN = args.thin  # read when the engine's programs are traced, below
    target, drafter, tok = builtin.load()
    prompts = [t["prompt"] for t in builtin.eval_tasks()]
    tiers = (None, *(parse_tree(t) for t in args.tiers))
    app = build(target, drafter, tok, speculation=Speculation(tiers), model_name="adaptive-serve",
                max_batch=args.max_batch, max_len=args.max_len)
    engine = app.state.engine
    names = [tier_name(t) for t in tiers]
    print(f"THIN={speculation.THIN}; round ms per tier: "
          + ", ".join(f"{n} {ms:.2f}" for n, ms in zip(names, engine.slots.round_ms)))
    speeds, shares = [], {n: [] for n in names}
    with ServerThread(app) as srv:
        for run in range(args.runs):
            while engine.running or engine.waiting:  # the policy is reset between dispatches only
                time.sleep(0.01)
            engine.slots.reset_policy()  # a fresh warm-up
            start = run * args.requests % len(prompts)
            records, wall = asyncio.run(run_load(srv.url, prompts[start:] + prompts[:start], rate=args.rate,
                                                 requests=args.requests, max_tokens=args.max_tokens, temperature=0.0,
                                                 seed=run, max_seconds=args.max_seconds))
            done = [r for r in records if r["status"] == 200]
            tokens = sum(r["tokens"] for r in done)
            rounds = dict.fromkeys(names, 0)
            for r in done:
                for name, n in (r.get("tier_rounds") or {}).items():
                    rounds[name] += n
            total = max(sum(rounds.values()), 1)
            for n in names:
                shares[n].append(rounds[n] / total)
            speeds.append(tokens / wall)
            failed = "" if len(done) == len(records) else f"; {len(records) - len(done)} not answered 200"
            print(f"run {run}: {tokens / wall:7.1f} tok/s ({tokens} tokens in {wall:.2f} s); rounds per tier "
                  f"{rounds}{failed}", flush=True)
    print(f"mean of {args.runs} runs: {np.mean(speeds):.1f} tok/s; share of the requests' rounds per tier "
          "(a round counts once per request in it; mean over the runs): "
          + ", ".join(f"{n} {np.mean(s):.2f}" for n, s in shares.items()))


if __name__ == "__main__":
    main()
