"""The adaptive policy in the server under load, run after run: does it settle on the tier that
pays?  The built-in pair behind a server of ``--max-batch`` slots (in this process, loopback);
each run resets the policy (a fresh warm-up, often on its first request alone) and sends
``--requests`` greedy chat requests from the eval prompts, Poisson arrivals at ``--rate`` per
second (run ``i``: arrival seed ``i``, the prompts from ``i * requests`` on).  Prints each run's
tokens/s and rounds per tier (summed over the requests), then their means.

    python scripts/adaptive_serve.py --runs 8 --rate 64 --tiers chain2 chain4 chain6 16,4,4 chain14
    python scripts/adaptive_serve.py --runs 8 --rate 64 --thin 0    # the rule before 985b537

``--thin`` sets ``eagle3_jax.speculation.THIN`` before the engine compiles (the decayed offers
below which a chain position is taken at no less than the rate of all positions; 0: never).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import numpy as np

from eagle3_jax import builtin, speculation
from eagle3_jax.bench import parse_tree
from eagle3_jax.serve.app import ServerThread, build
from eagle3_jax.serve.replay import arrivals
from eagle3_jax.speculation import Speculation, tier_name


async def _load(url: str, prompts: list[str], *, rate: float, requests: int, seed: int, max_tokens: int):
    """``requests`` chat requests at Poisson times; their responses and the wall time."""
    times = arrivals(rate, requests, seed)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()

        async def one(i: int, at: float):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            r = await client.post(url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompts[(i + requests * seed) % len(prompts)]}],
                "max_tokens": max_tokens, "temperature": 0.0})
            r.raise_for_status()
            return r.json()

        res = await asyncio.gather(*[one(i, at) for i, at in enumerate(times)])
        return res, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rate", type=float, default=64.0, help="requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=24, help="requests per run")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=8, help="the server's slots")
    ap.add_argument("--max-len", type=int, default=512, help="tokens per slot")
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
            engine.slots.reset_policy()  # the engine is idle between runs: a fresh warm-up
            res, wall = asyncio.run(_load(srv.url, prompts, rate=args.rate, requests=args.requests, seed=run,
                                          max_tokens=args.max_tokens))
            tokens = sum(r["usage"]["completion_tokens"] for r in res)
            rounds = dict.fromkeys(names, 0)
            for r in res:
                for name, n in r["usage"]["speculative"].get("tier_rounds", {}).items():
                    rounds[name] += n
            total = max(sum(rounds.values()), 1)
            for n in names:
                shares[n].append(rounds[n] / total)
            speeds.append(tokens / wall)
            print(f"run {run}: {tokens / wall:7.1f} tok/s ({tokens} tokens in {wall:.2f} s); rounds per tier {rounds}",
                  flush=True)
    print(f"mean of {args.runs} runs: {np.mean(speeds):.1f} tok/s; share of the rounds per tier: "
          + ", ".join(f"{n} {np.mean(s):.2f}" for n, s in shares.items()))


if __name__ == "__main__":
    main()
