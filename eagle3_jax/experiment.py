"""The two-budget experiment: what the thinking budget B does to quality and work, and what the
speculative budget K does to execution, reported apart.

* Step 1 — speculation off, B swept: accuracy, thinking and answer tokens, time to first
  token, time per output token, end-to-end latency, budget-exhausted and incomplete rates.
* Step 2 — at each chosen B: vanilla vs each static tier vs the adaptive policy: proposed
  nodes per round, τ per phase, accepted / committed tokens, time per output token, tokens/s,
  peak memory; greedy token identity with vanilla and, sampled, accuracy agreement
  (two-proportion z).
* Step 3 — under load: the arrival-rate replay (``eagle3_jax.serve.replay``) against a
  loopback server per mode: goodput, TTFT/TPOT percentiles and the rate where speculation
  stops paying (``goodput_vs_rate.png``).

With ``categories`` (e.g. the built-in pair's task families) every figure of steps 1 and 2 is
also reported per category, each category's prompts run in batches of their own (so τ per
category is measured, not apportioned).

``run_experiment`` writes ``report.json``, ``report.md`` and two figures into ``out_dir``:
``quality_tokens_latency.png`` (the curves over B) and ``budget_heatmap.png`` (speedup and τ
over B × K).  Latencies are per request at the given batch size, compilation and each
program's first run excluded (``generate``'s ``warm_up``); TTFT is the request's own compiled
program stopped after the prefill (its first token), timed just before the full call.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from eagle3_jax.bench import category_groups, peak_memory, two_proportion_z
from eagle3_jax.decode import generate, keep_compiled
from eagle3_jax.speculation import Speculation, tier_name
from eagle3_jax.tree import TreeConfig

UNLIMITED = "unlimited"


def _label(b) -> str:
    return UNLIMITED if b is None else str(b)


def _mode_name(mode) -> str:
    return "vanilla" if mode is None else "adaptive" if isinstance(mode, Speculation) else tier_name(mode)


def _run(target, drafter, prompts, groups, *, budget, mode, batch_size, max_new_tokens, temperature, seed, tokenizer):
    """All prompts under one (B, K), each category's in batches of its own: per-request
    tokens and latencies (in prompt order) and the statistics of each batch (``chunks``:
    category, prompt indices, stats)."""
    kw = dict(tokenizer=tokenizer, thinking_budget=budget, temperature=temperature, seed=seed)
    if mode is not None:
        kw["speculation"] = mode
    d = None if mode is None else drafter
    n = len(prompts)
    out = {k: [None] * n for k in ("tokens", "thinking", "answer", "status", "ttft", "e2e")}
    out["chunks"] = []
    for cat, idx in groups.items():
        for j in range(0, len(idx), batch_size):
            ids = idx[j:j + batch_size]
            chunk = [prompts[i] for i in ids]
            res = generate(target, d, chunk, max_new_tokens=max_new_tokens, time_first_token=True, warm_up=True, **kw)
            for k, i in enumerate(ids):
                out["tokens"][i], out["thinking"][i] = res.tokens[k], res.thinking_tokens[k]
                out["answer"][i], out["status"][i] = res.answer_tokens[k], res.thinking_status[k]
                out["ttft"][i], out["e2e"][i] = res.stats["first_token_seconds"], res.stats["seconds"]
            out["chunks"].append((cat, ids, res.stats))
    return out


def _grade(r: dict, grade, details):
    """Scores each request of a run once: ``correct`` (``grade``) and ``details`` (dicts)."""
    r["correct"] = None if grade is None else [bool(grade(i, t)) for i, t in enumerate(r["tokens"])]
    r["details"] = None
    if details is not None:
        r["details"] = []
        for i, t in enumerate(r["tokens"]):
            d = details(i, t)
            if not isinstance(d, dict):
                raise TypeError(f"details({i}, tokens) returned {type(d).__name__}, expected a dict")
            r["details"].append(d)


def _view(r: dict, cat=None) -> tuple[list[int], list[dict]]:
    """(prompt indices, batch statistics) of one category of a run (``None``: all prompts)."""
    chunks = [(ids, st) for c, ids, st in r["chunks"] if cat is None or c == cat]
    return sorted(i for ids, _ in chunks for i in ids), [st for _, st in chunks]


def _pool(stats: list[dict], key: str, phase: str | None = None) -> list:
    src = [s["phases"][phase] if phase else s for s in stats]
    return [a for s in src for row in s[key] for a in row] if key == "accept_lengths" else [s[key] for s in src]


def _numeric(v) -> bool:
    return isinstance(v, (bool, int, float)) and not (isinstance(v, float) and math.isnan(v))


def _mean_details(rows: list[dict]) -> dict:
    """Each numeric or bool value's mean over the requests whose details hold it."""
    keys = dict.fromkeys(k for d in rows for k, v in d.items() if _numeric(v))
    return {k: float(np.mean([float(d[k]) for d in rows if _numeric(d.get(k))])) for k in keys}


def _summary_row(r: dict, cat=None) -> dict:
    idx, stats = _view(r, cat)
    n = len(idx)
    new = sum(len(r["tokens"][i]) for i in idx)
    seconds = sum(s["seconds"] for s in stats)
    tpot = [(r["e2e"][i] - r["ttft"][i]) / max(len(r["tokens"][i]) - 1, 1) for i in idx]
    status = [r["status"][i] for i in idx]
    row = {
        "prompts": n, "accuracy": None if r["correct"] is None else float(np.mean([r["correct"][i] for i in idx])),
        "thinking_tokens": float(np.mean([r["thinking"][i] for i in idx])),
        "answer_tokens": float(np.mean([r["answer"][i] for i in idx])),
        "tokens": new, "seconds": seconds, "tokens_per_second": new / seconds if seconds else math.inf,
        "ttft_ms": 1e3 * float(np.mean([r["ttft"][i] for i in idx])), "tpot_ms": 1e3 * float(np.mean(tpot)),
        "e2e_ms": 1e3 * float(np.mean([r["e2e"][i] for i in idx])),
        "budget_exhausted_rate": status.count("budget_exhausted") / n,
        "incomplete_rate": status.count("incomplete") / n,
    }
    if r["details"] is not None:
        row["details"] = _mean_details([r["details"][i] for i in idx])
    return row


def _speculation_row(stats: list[dict]) -> dict:
    rounds = sum(sum(s["rounds"]) for s in stats)
    row = {"rounds": rounds, "proposed_per_round": sum(s["proposed"] for s in stats) / max(rounds, 1),
           "accepted": sum(s["accepted"] for s in stats), "committed": sum(s["committed"] for s in stats),
           "forced_rounds": sum(s["forced_rounds"] for s in stats)}
    for phase in ("thinking", "answer"):
        acc = _pool(stats, "accept_lengths", phase) if all("phases" in s for s in stats) else []
        row[f"tau_{phase}"] = float(np.mean(acc) + 1) if acc else None
    acc = _pool(stats, "accept_lengths")
    row["tau"] = float(np.mean(acc) + 1) if acc else None
    tiers: dict = {}
    for s in stats:
        for k, v in s.get("tier_rounds", {}).items():
            tiers[k] = tiers.get(k, 0) + v
    if tiers:
        row["tier_rounds"] = tiers
    return row


def run_experiment(target, drafter, tokenizer, prompts, *, grade=None, categories=None, details=None,
                   budgets=(0, 8, 16, 32, 64, 128, None), chosen=(16, 64, None),
                   tiers=(TreeConfig.chain(4), TreeConfig.chain(6), TreeConfig(16, 4, 4)),
                   batch_size: int = 1, max_new_tokens: int = 256, sampled_temperature: float | None = 0.7,
                   seed: int = 0, out_dir="experiment", progress: bool = True, replay_prompts=None,
                   replay_rates=(), replay_requests: int = 24, server_kw: dict | None = None) -> dict:
    """Runs the steps and writes the report (see the module doc); returns the report dict.

    ``grade(i, tokens) -> bool`` scores prompt ``i`` (accuracy; ``None``: not reported);
    ``categories[i]``: prompt ``i``'s category (e.g. a task family): each category's prompts
    run in batches of their own, and every figure of steps 1 and 2 is also reported per
    category (``report["step1"][B]["by_category"][c]``, ``report["step2"][B][mode]["by_category"][c]``);
    ``details(i, tokens) -> dict``: further per-request figures (e.g. a tool call's JSON
    validity), each numeric or bool value averaged over the requests that report it
    (``row["details"]``, overall and per category);
    ``chosen``: the budgets of step 2; ``tiers``: the static tiers (the adaptive policy runs
    over them plus no drafting); ``sampled_temperature``: also compare sampled accuracy of
    each mode with vanilla at that temperature (``None``: greedy only).  Step 3 runs when
    ``replay_rates`` are given: ``eagle3_jax.serve.replay`` of ``replay_prompts`` (texts) at those
    arrival rates against a loopback server (``server_kw`` for its engine), per mode.
    """
    from tqdm import tqdm

    groups = category_groups(len(prompts), categories)
    cats = [] if categories is None else list(groups)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = [None, *tiers, Speculation((None, *tiers))]
    temps = [0.0] + ([sampled_temperature] if sampled_temperature else [])
    jobs = [("step1", b, None, 0.0) for b in budgets] + [("step2", b, m, t) for t in temps for b in chosen for m in modes]
    results: dict = {}
    bar = tqdm(jobs, desc="experiment", disable=not progress)
    with keep_compiled(len(jobs) * len(prompts)):  # a loop per (mode, temperature, batch shape): kept for the run
        for step, b, mode, temp in bar:
            key = (b, _mode_name(mode), temp)
            bar.set_postfix_str(f"B={_label(b)} {_mode_name(mode)} T={temp}")
            if key not in results:
                results[key] = _run(target, drafter, prompts, groups, budget=b, mode=mode, batch_size=batch_size,
                                    max_new_tokens=max_new_tokens, temperature=temp, seed=seed, tokenizer=tokenizer)
                _grade(results[key], grade, details)  # each run graded once
    summaries = {key: {c: _summary_row(r, c) for c in [None, *cats]} for key, r in results.items()}

    def with_categories(rows: dict) -> dict:  # the overall row, and the categories' under by_category
        return {**rows[None], **({"by_category": {c: rows[c] for c in cats}} if cats else {})}

    report = {"settings": {"prompts": len(prompts), "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                           "budgets": [_label(b) for b in budgets], "chosen": [_label(b) for b in chosen],
                           "tiers": [tier_name(t) for t in tiers], "sampled_temperature": sampled_temperature,
                           **({"categories": {c: len(groups[c]) for c in cats}} if cats else {})},
              "step1": {_label(b): with_categories(summaries[(b, "vanilla", 0.0)]) for b in budgets}, "step2": {}}
    for b in chosen:
        base = results[(b, "vanilla", 0.0)]
        rows = {}
        for mode in modes:
            name = _mode_name(mode)
            r = results[(b, name, 0.0)]
            per = {}
            for c in [None, *cats]:
                idx, stats = _view(r, c)
                row = {**summaries[(b, name, 0.0)][c],
                       "identical_to_vanilla": all(r["tokens"][i] == base["tokens"][i] for i in idx)}
                if mode is not None:
                    row.update(_speculation_row(stats))
                row["speedup"] = row["tokens_per_second"] / summaries[(b, "vanilla", 0.0)][c]["tokens_per_second"]
                if sampled_temperature and grade is not None:
                    sv, sm = (summaries[(b, n, sampled_temperature)][c]["accuracy"] for n in ("vanilla", name))
                    row["sampled_accuracy"], row["sampled_accuracy_z"] = sm, two_proportion_z(sm, sv, len(idx))
                per[c] = row
            rows[name] = with_categories(per)
        report["step2"][_label(b)] = rows
    report["peak_memory"] = peak_memory()
    report["summary"] = _attribution(report)
    if replay_rates:
        from eagle3_jax.serve import replay

        report["step3"] = replay.replay(target, drafter, tokenizer, prompts=list(replay_prompts), rates=sorted(replay_rates),
                                        requests=replay_requests, tiers=tiers, max_tokens=max_new_tokens, seed=seed,
                                        log=lambda line: bar.write(line) if progress else None, **(server_kw or {}))
        replay.write_figure(report["step3"], out_dir / "goodput_vs_rate.png")
        x = report["step3"]["crossover_rate"]
        report["summary"].append("under load (step 3), speculation " + (
            f"stops paying at {x:g} requests/s" if x is not None else "paid at every arrival rate measured"))
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(_markdown(report))
    _figures(report, out_dir)
    return report


def _attribution(report: dict) -> list[str]:
    """The two effects, stated apart: what B did to the target's work and quality, and what
    EAGLE-3 did to execution time at the same B."""
    s1, lines = report["step1"], []
    ref = s1.get(UNLIMITED)
    for b, rows in report["step2"].items():
        best = max((n for n in rows if n != "vanilla"), key=lambda n: rows[n]["tokens_per_second"])
        cut = 1 - rows[best]["seconds"] / rows["vanilla"]["seconds"]
        if ref is not None and b != UNLIMITED:
            tokens = 1 - s1[b]["tokens"] / ref["tokens"]
            acc = "" if ref["accuracy"] is None else \
                f" and changed accuracy by {100 * (s1[b]['accuracy'] - ref['accuracy']):+.1f} points"
            lines.append(f"Budget B={b} reduced target tokens by {100 * tokens:.1f}% (vs unlimited){acc}; "
                         f"at the same B, EAGLE-3 ({best}) cut execution time by {100 * cut:.1f}% "
                         f"(identical tokens: {rows[best]['identical_to_vanilla']}).")
        else:
            lines.append(f"Unlimited B: EAGLE-3 ({best}) cut execution time by {100 * cut:.1f}% "
                         f"(identical tokens: {rows[best]['identical_to_vanilla']}).")
    return lines


def _fmt(v, spec=".3f"):
    return "—" if v is None else format(v, spec) if isinstance(v, float) else str(v)


_STEP1_HEAD = "| accuracy | thinking tok | answer tok | TTFT ms | TPOT ms | e2e ms | exhausted | incomplete |"
_STEP2_HEAD = ("| tok/s | speedup | TPOT ms | τ | τ thinking / answer | proposed / round | accuracy | identical | "
               "sampled accuracy (z) |")


def _head(first: str, cells: str) -> list[str]:
    line = first + cells
    return [line, "|" + " --- |" * (line.count("|") - 1)]


def _step1_cells(r: dict) -> str:
    return (f"| {_fmt(r['accuracy'])} | {r['thinking_tokens']:.1f} | {r['answer_tokens']:.1f} | {r['ttft_ms']:.2f} | "
            f"{r['tpot_ms']:.3f} | {r['e2e_ms']:.1f} | {r['budget_exhausted_rate']:.2f} | {r['incomplete_rate']:.2f} |")


def _step2_cells(r: dict) -> str:
    phases = f"{_fmt(r.get('tau_thinking'), '.2f')} / {_fmt(r.get('tau_answer'), '.2f')}"
    sampled = "—" if "sampled_accuracy" not in r else f"{r['sampled_accuracy']:.3f} ({r['sampled_accuracy_z']:+.2f})"
    return (f"| {r['tokens_per_second']:.1f} | {r['speedup']:.2f}× | {r['tpot_ms']:.3f} | {_fmt(r.get('tau'), '.2f')} | "
            f"{phases} | {_fmt(r.get('proposed_per_round'), '.1f')} | {_fmt(r['accuracy'])} | "
            f"{r['identical_to_vanilla']} | {sampled} |")


def _category_step1(report: dict) -> list[str]:
    s1, cats = report["step1"], report["settings"]["categories"]
    md = ["### Step 1 per category", "", "Accuracy by category and B:", "",
          "| category (prompts) | " + " | ".join(f"B={b}" for b in s1) + " |", "|" + " --- |" * (len(s1) + 1)]
    for c, n in cats.items():
        md.append(f"| {c} ({n}) | " + " | ".join(_fmt(r["by_category"][c]["accuracy"]) for r in s1.values()) + " |")
    md.append("| all | " + " | ".join(_fmt(r["accuracy"]) for r in s1.values()) + " |")
    md += ["", *_head("| category | B ", _STEP1_HEAD)]
    for c in cats:
        md += [f"| {c} | {b} " + _step1_cells(r["by_category"][c]) for b, r in s1.items()]
    return md


def _details_table(report: dict) -> list[str]:
    s1, cats = report["step1"], list(report["settings"].get("categories", {}))
    rows = [(c, b, (r if c is None else r["by_category"][c]).get("details", {})) for c in [*cats, None] for b, r in s1.items()]
    keys = list(dict.fromkeys(k for _, _, d in rows for k in d))
    if not keys:
        return []
    md = ["Per-request details, speculation off (each the mean over the requests that report it):", "",
          "| category | B | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 2)]
    return md + [f"| {'all' if c is None else c} | {b} | " + " | ".join(_fmt(d.get(k)) for k in keys) + " |"
                 for c, b, d in rows if d]


def _markdown(report: dict) -> str:
    categorized = "categories" in report["settings"]
    md = ["# Two-budget experiment", "", "## Summary", "", *[f"- {line}" for line in report["summary"]], "",
          "## Step 1: thinking budget B, speculation off", "", *_head("| B ", _STEP1_HEAD)]
    md += [f"| {b} " + _step1_cells(r) for b, r in report["step1"].items()]
    if categorized:
        md += ["", *_category_step1(report)]
    if details := _details_table(report):
        md += ["", *details]
    md += ["", "## Step 2: speculative budget K at each chosen B (greedy)", "", *_head("| B | mode ", _STEP2_HEAD)]
    md += [f"| {b} | {name} " + _step2_cells(r) for b, rows in report["step2"].items() for name, r in rows.items()]
    if categorized:
        md += ["", "### Step 2 per category", "", *_head("| category | B | mode ", _STEP2_HEAD)]
        md += [f"| {c} | {b} | {name} " + _step2_cells(r["by_category"][c])
               for c in report["settings"]["categories"] for b, rows in report["step2"].items() for name, r in rows.items()]
    mem = report["peak_memory"]
    md += ["", f"Peak memory: {mem['bytes'] / 2 ** 30:.2f} GiB ({mem['source']}).", ""]
    if "step3" in report:
        from eagle3_jax.serve import replay

        md += ["## Step 3: arrival-rate replay against the server (goodput per mode per rate)", "",
               replay.table(report["step3"]), "", "![goodput](goodput_vs_rate.png)", ""]
    return "\n".join(md)


def _figures(report: dict, out_dir: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s1 = report["step1"]
    labels = list(s1)
    x = range(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    series = [("accuracy", "accuracy"), ("thinking_tokens", "thinking tokens / request"), ("e2e_ms", "latency ms / request")]
    cats = list(report["settings"].get("categories", {}))
    for ax, (key, title) in zip(axes, series):
        for c in [None, *cats]:  # overall, then one thinner line per category
            rows = [s1[b] if c is None else s1[b]["by_category"][c] for b in labels]
            ax.plot(x, [np.nan if r[key] is None else r[key] for r in rows], marker="o", lw=2.5 if c is None else 1,
                    label="all" if c is None else c)
        if cats:
            ax.legend(fontsize=8)
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("thinking budget B")
        ax.set_title(title)
    fig.suptitle("Quality, tokens and latency over the thinking budget (speculation off)")
    fig.tight_layout()
    fig.savefig(out_dir / "quality_tokens_latency.png", dpi=110)
    plt.close(fig)

    s2 = report["step2"]
    bs = list(s2)
    modes = [m for m in s2[bs[0]] if m != "vanilla"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.8 * len(bs) + 2.5))
    for ax, key, title in ((axes[0], "speedup", "speedup over vanilla"), (axes[1], "tau", "τ (tokens per round)")):
        grid = np.array([[s2[b][m].get(key) or np.nan for m in modes] for b in bs], float)
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(modes)), modes)
        ax.set_yticks(range(len(bs)), bs)
        ax.set_xlabel("speculative budget K")
        ax.set_ylabel("thinking budget B")
        ax.set_title(title)
        for i in range(len(bs)):
            for j in range(len(modes)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out_dir / "budget_heatmap.png", dpi=110)
    plt.close(fig)
