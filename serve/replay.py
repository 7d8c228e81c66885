"""Arrival-rate replay (the experiment's step 3): where does speculation stop paying?

For each mode (vanilla, each static tier, the adaptive policy over them) a server is started
on loopback (uvicorn in a thread, :class:`~eagle3_jax.serve.server.ServerThread`), and for each
arrival rate ``N`` chat requests (the built-in eval prompts, cycled) arrive as a Poisson
process, open loop: each is sent at its arrival time whatever the server's state, streamed,
and timed on the client from its arrival.  Per mode and rate it reports throughput (generated
tokens/s and requests/s over the run), goodput (requests per second that met both the TTFT and
the TPOT objective), TTFT and TPOT percentiles, and refused (429) / failed requests.  The
crossover is the lowest rate at which no speculative mode's goodput beats vanilla's.
:func:`run_replay` runs it, prints the table and writes the report and its figure
(``eagle3-jax replay``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import jax
import numpy as np

from eagle3_jax.atomic import save_figure, write_report, write_report_figure
from eagle3_jax.serve.server import ServerThread, build
from eagle3_jax.speculation import Speculation, tier_name

PERCENTILES = (50, 90, 99)


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests of a Poisson process of ``rate``/s."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


async def _one(client, url: str, body: dict, at: float, t0: float) -> dict:
    """Sends one streamed chat request at ``t0 + at``; its timing, token count, status and
    (from its usage) τ and rounds per speculation tier."""
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    start = t0 + at
    rec = {"arrival": at, "status": None, "ttft": None, "latency": None, "tokens": 0}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["status"] = chunk["error"].get("code") or 500
                    return rec
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
                    rec["reasoning_tokens"] = chunk["usage"]["completion_tokens_details"]["reasoning_tokens"]
                    spec = chunk["usage"].get("speculative", {})
                    rec["tau"], rec["tier_rounds"] = spec.get("tau"), spec.get("tier_rounds", {})
                for c in chunk.get("choices", []):
                    d = c.get("delta", {})
                    if rec["ttft"] is None and (d.get("content") or d.get("reasoning_content") or c.get("token_ids")):
                        rec["ttft"] = time.perf_counter() - start
        rec["latency"] = time.perf_counter() - start
    except Exception as e:  # a broken connection counts as a failure, never as lost
        rec["status"] = f"{type(e).__name__}: {e}"
    return rec


async def run_load(url: str, prompts: list[str], *, rate: float, requests: int, max_tokens: int,
                   temperature: float, seed: int, max_seconds: float) -> tuple[list[dict], float]:
    """Open-loop Poisson load: every request's record (unfinished by ``max_seconds``: status
    ``timeout``) and the run's wall time."""
    import httpx

    times = arrivals(rate, requests, seed)
    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=requests + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(max_seconds + 30), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, url, {
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed + i, "stream": True,
            "stream_options": {"include_usage": True}}, at, t0)) for i, at in enumerate(times)]
        done, pending = await asyncio.wait(tasks, timeout=max_seconds)
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - t0
        records = []
        for i, t in enumerate(tasks):
            if t in done:
                records.append(t.result())
            else:
                records.append({"arrival": times[i], "status": "timeout", "ttft": None, "latency": None, "tokens": 0})
        await asyncio.gather(*pending, return_exceptions=True)
    return records, wall


def summarize(records: list[dict], wall: float, ttft_slo: float, tpot_slo: float) -> dict:
    """Throughput, goodput and latency percentiles of one run."""
    ok = [r for r in records if r["status"] == 200 and r["latency"] is not None]
    for r in ok:
        r["tpot"] = (r["latency"] - r["ttft"]) / (r["tokens"] - 1) if r["tokens"] > 1 and r["ttft"] is not None else 0.0
    good = [r for r in ok if r["ttft"] is not None and r["ttft"] <= ttft_slo and r["tpot"] <= tpot_slo]
    tokens = sum(r["tokens"] for r in ok)

    def pct(key):
        vals = [r[key] for r in ok if r.get(key) is not None]
        return {f"p{p}": float(np.percentile(vals, p)) for p in PERCENTILES} if vals else {}

    taus = [r["tau"] for r in ok if r.get("tau")]
    return {
        "requests": len(records), "completed": len(ok), "rejected_429": sum(r["status"] == 429 for r in records),
        "failed": sum(r["status"] not in (200, 429) for r in records), "seconds": wall,
        "tokens_per_second": tokens / wall, "requests_per_second": len(ok) / wall, "goodput": len(good) / wall,
        "goodput_fraction": len(good) / len(records), "ttft_s": pct("ttft"), "tpot_s": pct("tpot"),
        "mean_tau": float(np.mean(taus)) if taus else None,
    }


def crossover(modes: dict, rates: list[float]) -> float | None:
    """The lowest rate at which no speculative mode's goodput beats vanilla's (None: speculation
    pays at every rate measured)."""
    spec = [m for m in modes if m != "vanilla"]
    for i, rate in enumerate(rates):
        base = modes["vanilla"][i]["goodput"]
        if not any(modes[m][i]["goodput"] > base for m in spec):
            return rate
    return None


def replay(target, drafter, tokenizer, *, prompts: list[str], rates: list[float], requests: int, tiers,
           max_tokens: int = 256, temperature: float = 0.0, ttft_slo: float = 1.0, tpot_slo: float = 0.02,
           max_seconds: float = 120.0, seed: int = 0, log=print, **server_kw) -> dict:
    """Runs every mode at every rate; returns the report (see the module docstring).
    ``server_kw`` goes to :func:`eagle3_jax.serve.server.build` (``max_batch``, ``max_len``, ...)."""
    modes = [("vanilla", None, None)] + [(tier_name(t), drafter, t) for t in tiers]
    modes.append(("adaptive", drafter, Speculation((None, *tiers), policy="adaptive")))
    report = {"rates": list(rates), "requests": requests, "max_tokens": max_tokens, "temperature": temperature,
              "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "server": {k: v for k, v in server_kw.items()
                                                                         if k != "effort_budgets"}, "modes": {}}
    for name, dr, spec in modes:
        app = build(target, dr, tokenizer, speculation=spec, model_name="replay", **server_kw)
        rows = []
        with ServerThread(app) as srv:
            for rate in rates:
                records, wall = asyncio.run(run_load(srv.url, prompts, rate=rate, requests=requests,
                                                     max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                     max_seconds=max_seconds))
                row = {"rate": rate, **summarize(records, wall, ttft_slo, tpot_slo)}
                rows.append(row)
                log(f"{name:>9} rate {rate:>6.2f}/s: {row['tokens_per_second']:8.1f} tok/s, goodput "
                    f"{row['goodput']:6.2f} req/s ({row['completed']}/{requests} done, {row['rejected_429']} x 429, "
                    f"{row['failed']} failed), TTFT p50 {row['ttft_s'].get('p50', math.nan) * 1e3:7.1f} ms, "
                    f"TPOT p50 {row['tpot_s'].get('p50', math.nan) * 1e3:6.2f} ms")
        report["modes"][name] = rows
    report["crossover_rate"] = crossover(report["modes"], list(rates))
    return report


def table(report: dict) -> str:
    """The report as a markdown table (goodput per mode per rate, then the crossover)."""
    rates = report["rates"]
    head = "| mode | " + " | ".join(f"{r:g}/s" for r in rates) + " |"
    lines = [head, "|" + " --- |" * (len(rates) + 1)]
    for name, rows in report["modes"].items():
        cells = [f"{r['goodput']:.2f} ({r['tokens_per_second']:.0f} tok/s, TPOT {r['tpot_s'].get('p50', math.nan) * 1e3:.1f} ms)"
                 for r in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    x = report["crossover_rate"]
    lines.append("")
    lines.append(f"goodput in requests/s meeting TTFT <= {report['ttft_slo_s']:g} s and TPOT <= "
                 f"{report['tpot_slo_s'] * 1e3:g} ms; speculation stops paying at "
                 + (f"{x:g} requests/s" if x is not None else "no measured rate"))
    return "\n".join(lines)


def write_figure(report: dict, path):
    """Goodput (and tokens/s) vs arrival rate, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in report["modes"].items():
        rates = [r["rate"] for r in rows]
        style = "k--" if name == "vanilla" else "-o"
        axes[0].plot(rates, [r["goodput"] for r in rows], style, label=name)
        axes[1].plot(rates, [r["tokens_per_second"] for r in rows], style, label=name)
    if report.get("crossover_rate") is not None:
        for ax in axes:
            ax.axvline(report["crossover_rate"], color="grey", lw=0.8)
    axes[0].set(xlabel="arrival rate (requests/s)", ylabel="goodput (requests/s within SLO)",
                title=f"goodput (TTFT <= {report['ttft_slo_s']:g} s, TPOT <= {report['tpot_slo_s'] * 1e3:g} ms)")
    axes[1].set(xlabel="arrival rate (requests/s)", ylabel="generated tokens/s", title="throughput")
    axes[0].legend()
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)


def run_replay(target, drafter, tokenizer, *, prompts: list[str], rates: list[float], requests: int, tiers,
               json_path, figure_path, **kw) -> dict:
    """``eagle3-jax replay``: :func:`replay` of ``prompts`` at each of ``rates`` (sorted) over
    vanilla decoding, each of ``tiers`` and the adaptive policy over them; prints the
    :func:`table` and writes the report (with the device) to ``json_path`` and its figure to
    ``figure_path``.  ``kw``: :func:`replay`'s other keyword arguments (``max_tokens``,
    ``temperature``, the objectives, the server's settings)."""
    report = replay(target, drafter, tokenizer, prompts=prompts, rates=sorted(rates), requests=requests, tiers=tiers,
                    **kw)
    report["device"] = jax.devices()[0].device_kind
    print(table(report), flush=True)
    write_report(json_path, json.dumps(report, indent=2) + "\n", "--json")
    write_report_figure(figure_path, lambda: write_figure(report, figure_path), json_path)
    print(f"wrote {json_path} and {figure_path}")
    return report
