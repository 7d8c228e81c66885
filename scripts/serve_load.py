"""Measurements of the OpenAI-compatible server (``eagle3_jax.serve``) on loopback, with the
built-in pair; too slow for the test suite, so their output is quoted instead.

``solo``: concurrency 1 — the eval prompts one after another through the server (streamed,
timed on the client) vs ``eagle3_jax.generate`` on each prompt alone (batch 1, compilation
excluded), same tree, greedy, same budget: served tokens/s over generate's.  The server runs
in this process (a thread) by default; ``--process`` starts it as ``eagle3-jax serve`` in a
process of its own, as a deployment runs it, so the client's work does not hold the server's
GIL.

``flood``: ``--requests`` requests (default 200) arriving faster than the server can serve
them (Poisson at ``--rate``) with a small queue: every request must be answered (200) or
refused (429) — none lost, none hung — ``/health`` must answer throughout, and the process's
resident memory must be flat after the run (a second flood must not grow it).

    python scripts/serve_load.py solo --requests 32
    python scripts/serve_load.py flood --requests 200 --rate 400
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
import types

import httpx

import eagle3_jax
from eagle3_jax import builtin
from eagle3_jax.tree import parse_tree
from eagle3_jax.decode import encode_chat
from eagle3_jax.serve.server import ServerThread, build


def rss_mb() -> float:
    """Resident set size now (MB), from /proc when there is one, else the peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _e2e_sum(c, url) -> float:
    for line in c.get(url + "/metrics").text.splitlines():
        if line.startswith("eagle3:e2e_request_latency_seconds_sum"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def server_process(args):
    """``eagle3-jax serve`` with the built-in pair in a process of its own on a free loopback port
    (yields an object with its ``url``, as ``ServerThread`` does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "eagle3_jax.cli", "serve", "--port", str(port), "--max-batch", str(args.max_batch),
           "--max-len", str(args.max_len), "--rounds-per-dispatch", str(args.rounds_per_dispatch),
           *(["--dispatch-ms", str(args.dispatch_ms)] if args.dispatch_ms else []),
           "--speculation", args.tree, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up in 300 s")
            time.sleep(0.5)
        yield types.SimpleNamespace(url=url)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def solo(args, target, drafter, tok):
    """Each prompt ``--repeats`` times through generate and through the server, interleaved (the
    machine's load drifts), the fastest of each kept: best-case wall time per token of both."""
    tree = parse_tree(args.tree)
    texts = [t["prompt"] for t in builtin.eval_tasks()[: args.requests]]
    prompts = [encode_chat(tok, [{"role": "user", "content": t}]) for t in texts]
    kw = dict(max_new_tokens=args.max_tokens, tree=tree, tokenizer=tok)
    eagle3_jax.generate(target, drafter, [prompts[0]], **kw)  # compile
    if args.process:
        app, server = None, server_process(args)
    else:
        app = build(target, drafter, tok, max_batch=args.max_batch, max_len=args.max_len, speculation=tree,
                    rounds_per_dispatch=args.rounds_per_dispatch, dispatch_ms=args.dispatch_ms, model_name="builtin",
                    temperature=0.0)
        server = ServerThread(app)
    gen_s = gen_wall = srv_s = engine_s = 0.0
    n_tokens, same = 0, 0
    with server as srv, httpx.Client(timeout=120) as c:
        def once(text):
            body = {"model": "builtin", "messages": [{"role": "user", "content": text}], "max_tokens": args.max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True}
            e2e = _e2e_sum(c, srv.url)
            start = time.perf_counter()
            ids = []
            with c.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:])["choices"]:
                            ids += ch.get("token_ids", [])
            seconds = time.perf_counter() - start
            return seconds, _e2e_sum(c, srv.url) - e2e, ids

        once(texts[0])  # warm the HTTP path
        for text, prompt in zip(texts, prompts):
            gens, walls, srvs = [], [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                gens.append(eagle3_jax.generate(target, drafter, [prompt], **kw))
                walls.append(time.perf_counter() - start)
                srvs.append(once(text))
            gen = min(gens, key=lambda r: r.stats["seconds"])
            gen_s += gen.stats["seconds"]
            gen_wall += min(walls)
            srv_s += min(s for s, _, _ in srvs)
            engine_s += min(e for _, e, _ in srvs)
            n_tokens += len(gen.tokens[0])
            same += all(ids == gen.tokens[0] for _, _, ids in srvs)
    where = "its own process" if args.process else "this process"
    bound = f" and {args.dispatch_ms:g} ms" if args.dispatch_ms else ""
    print(f"concurrency 1, {len(prompts)} eval prompts, {args.tree}, greedy, max_tokens {args.max_tokens}, "
          f"{args.max_batch} slots, at most {args.rounds_per_dispatch} rounds{bound} per dispatch, server in {where}, "
          f"fastest of {args.repeats} each:")
    print(f"  generate (batch 1):           {n_tokens} tokens in {gen_s:.3f} s = {n_tokens / gen_s:7.1f} tok/s "
          f"(its stats: the compiled call)")
    print(f"  generate, wall (whole call):  {n_tokens} tokens in {gen_wall:.3f} s = {n_tokens / gen_wall:7.1f} tok/s")
    print(f"  served, client-timed (HTTP):  {n_tokens} tokens in {srv_s:.3f} s = {n_tokens / srv_s:7.1f} tok/s "
          f"({gen_s / srv_s:.1%} of generate)")
    print(f"  served, engine-timed (e2e):   {n_tokens} tokens in {engine_s:.3f} s = {n_tokens / engine_s:7.1f} tok/s "
          f"({gen_s / engine_s:.1%} of generate)")
    print(f"  identical tokens {same}/{len(prompts)}" + ("" if app is None else f"; {app.state.engine.dispatches} dispatches"))
    return 0


async def _flood(url: str, n: int, rate: float, seed: int, texts, max_tokens: int):
    import numpy as np

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    health_fail = 0
    stop = asyncio.Event()

    async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=httpx.Limits(max_connections=n + 16)) as c:
        async def health():
            nonlocal health_fail
            while not stop.is_set():
                try:
                    r = await c.get(url + "/health", timeout=5)
                    health_fail += r.status_code != 200
                except httpx.HTTPError:
                    health_fail += 1
                await asyncio.sleep(0.1)

        async def one(i, at):
            await asyncio.sleep(at)
            body = {"model": "builtin", "messages": [{"role": "user", "content": texts[i % len(texts)]}],
                    "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": i % 2 == 0}
            try:
                r = await c.post(url + "/v1/chat/completions", json=body)
                if r.status_code == 200 and body["stream"]:
                    return 200 if r.text.rstrip().endswith("data: [DONE]") and '"finish_reason":"' in r.text else "broken"
                if r.status_code == 200:
                    return 200 if r.json()["choices"][0]["finish_reason"] in ("stop", "length") else "broken"
                if r.status_code == 429 and r.json()["error"]["code"] == "queue_full":
                    return 429
                return r.status_code
            except Exception as e:  # noqa: BLE001
                return f"{type(e).__name__}"

        watcher = asyncio.create_task(health())
        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(one(i, at) for i, at in enumerate(np.cumsum(gaps)))), 600)
        seconds = time.perf_counter() - start
        stop.set()
        await watcher
        metrics = (await c.get(url + "/metrics")).text
    return results, seconds, health_fail, metrics


def flood(args, target, drafter, tok):
    texts = [t["prompt"] for t in builtin.eval_tasks()]
    app = build(target, drafter, tok, max_batch=args.max_batch, max_len=args.max_len, speculation=parse_tree(args.tree),
                max_queue=args.max_queue, rounds_per_dispatch=args.rounds_per_dispatch, dispatch_ms=args.dispatch_ms,
                model_name="builtin")
    ok = True
    with ServerThread(app) as srv:
        engine = app.state.engine
        rss = []
        for round_ in range(args.floods):
            results, seconds, health_fail, metrics = asyncio.run(
                _flood(srv.url, args.requests, args.rate, round_, texts, args.max_tokens))
            rss.append(rss_mb())
            counts = {k: results.count(k) for k in sorted(set(results), key=str)}
            lost = len(results) - results.count(200) - results.count(429)
            settled = engine.running == 0 and engine.waiting == 0
            print(f"flood {round_ + 1}: {args.requests} requests at {args.rate}/s over {seconds:.1f} s -> {counts}; "
                  f"lost/broken {lost}; /health failures {health_fail}; idle after: {settled}; RSS {rss[-1]:.0f} MB")
            ok &= lost == 0 and health_fail == 0 and settled and results.count(429) > 0
        if len(rss) > 1:
            growth = rss[-1] - rss[1 if len(rss) > 2 else 0]
            print(f"RSS after each flood (MB): {[round(x) for x in rss]}; growth after the first: {growth:+.0f} MB")
            ok &= growth < 50
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("solo", "flood"))
    p.add_argument("--requests", type=int, default=None, help="solo: prompts (default 32); flood: requests (200)")
    p.add_argument("--rate", type=float, default=400.0, help="flood: arrivals per second")
    p.add_argument("--floods", type=int, default=3, help="flood: runs (memory must be flat after the first)")
    p.add_argument("--tree", default="chain4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--rounds-per-dispatch", type=int, default=16)
    p.add_argument("--dispatch-ms", type=float, default=None)
    p.add_argument("--repeats", type=int, default=5, help="solo: runs per prompt and side (the fastest kept)")
    p.add_argument("--process", action="store_true", help="solo: run the server in a process of its own")
    args = p.parse_args(argv)
    args.requests = args.requests or (32 if args.mode == "solo" else 200)
    target, drafter, tok = builtin.load()
    return (solo if args.mode == "solo" else flood)(args, target, drafter, tok)


if __name__ == "__main__":
    sys.exit(main())
