"""The two-budget experiment's report (``eagle3_jax.experiment`` runs the steps): ``report.md``
from the report dict, the summary's lines and the two figures.

* ``report.md``: step 1 (B swept, speculation off) and step 2 (each mode at each chosen B)
  as tables, each timed figure the median [min–max] over the repeats; the reconciliation of
  step 2's rows in counts (committed tokens = first tokens + Σ tier rounds × tokens per round
  + forced less dropped) and in time (each repeat's time against its first-token time + loop
  rounds × round costs, marked **no** where no repeat is within ``RECONCILE_FACTOR``); the
  adaptive policy's tier rounds and the round costs of each repeat; per category and
  per-request details where the run has them; step 3's replay table.
* :func:`summary`: the two effects stated apart — what B did to the target's tokens and
  accuracy, what EAGLE-3 did to execution time at the same B, a speedup claimed only with
  its interval ("no measurable difference" where it holds 1, ties named) — and the rows whose
  time does not reconcile with their rounds.
* :func:`quality_figure` (``quality_tokens_latency.png``: accuracy, thinking tokens and
  latency over B) and :func:`heatmap` (``budget_heatmap.png``: speedup and τ over B × K);
  matplotlib (the ``train`` extra) is imported only to draw them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

UNLIMITED = "unlimited"  # an unlimited thinking budget B, as the report names it
TIMED = ("seconds", "tokens_per_second", "ttft_ms", "tpot_ms", "e2e_ms")  # each with its spread over the repeats
STEP = "step"  # vanilla's one "tier": a target step
RECONCILE_FACTOR = 1.5  # a row's time against its rounds × round costs: within this factor in some repeat
QUALITY_FIGURE, HEATMAP = "quality_tokens_latency.png", "budget_heatmap.png"


def _interval(s: dict, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """``median [min–max]`` of a spread (each value × ``scale``)."""
    return (f"{scale * s['median']:{spec}}{suffix} [{scale * s['min']:{spec}}–{scale * s['max']:{spec}}{suffix}]")


def _overlap(a: dict, b: dict) -> bool:
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def _speed_claim(rows: dict, repeats: int) -> str:
    """What EAGLE-3 did to execution time at one B, with its interval over the repeats: the best
    mode's cut (or rise) in time against vanilla, or "no measurable difference" where its
    speedup's interval holds 1; the modes whose speedup intervals overlap the best one's."""
    modes = [m for m in rows if m != "vanilla"]
    best = max(modes, key=lambda m: rows[m]["speedup"])
    sp = rows[best]["timing"]["speedup"]
    cut = {k: 1 - 1 / sp[k] for k in ("median", "min", "max")}  # cut in time = 1 - 1/speedup
    ident = f"identical tokens: {rows[best]['identical_to_vanilla']}"
    if sp["min"] <= 1 <= sp["max"]:
        text = (f"no measurable difference in execution time between EAGLE-3 (its best median: {best}, speedup "
                f"{_interval(sp, '.2f', suffix='×')}) and vanilla ({repeats} repeats; {ident})")
    else:
        verb, sign = ("cut", 1) if sp["min"] > 1 else ("raised", -1)
        lo, hi = sorted((sign * cut["min"], sign * cut["max"]))
        text = (f"EAGLE-3 ({best}) {verb} execution time by {100 * sign * cut['median']:.1f}% "
                f"[{100 * lo:.1f}–{100 * hi:.1f}%] (speedup {_interval(sp, '.2f', suffix='×')}, median [min–max] "
                f"of {repeats} repeats; {ident})")
    ties = [m for m in modes if m != best and _overlap(rows[m]["timing"]["speedup"], sp)]
    if ties:
        text += f"; no measurable difference between {best} and {', '.join(ties)}"
    return text


def _attribution(report: dict) -> list[str]:
    """The two effects, stated apart: what B did to the target's work and quality, and what
    EAGLE-3 did to execution time at the same B (each budget named by its value)."""
    s1, lines = report["step1"], []
    ref = s1.get(UNLIMITED)
    repeats = report["settings"]["repeats"]
    for b, rows in report["step2"].items():
        speed = _speed_claim(rows, repeats)
        if ref is not None and b != UNLIMITED and b in s1:
            tokens = 1 - s1[b]["tokens"] / ref["tokens"]
            acc = "" if ref["accuracy"] is None else \
                f" and changed accuracy by {100 * (s1[b]['accuracy'] - ref['accuracy']):+.1f} points"
            lines.append(f"Budget B={b} reduced target tokens by {100 * tokens:.1f}% (vs unlimited){acc}; "
                         f"at the same B, {speed}.")
        else:
            lines.append(f"Budget B={b}: {speed}.")
    return lines


def _fmt(v, spec=".3f"):
    return "—" if v is None else format(v, spec) if isinstance(v, float) else str(v)


_STEP1_HEAD = "| accuracy | thinking tok | answer tok | TTFT ms | TPOT ms | e2e ms | exhausted | incomplete |"
_STEP2_HEAD = ("| tok/s | speedup | TPOT ms | τ | τ thinking / answer | proposed / round | rounds (forced) | accuracy | "
               "identical | sampled accuracy (z) |")


def _head(first: str, cells: str) -> list[str]:
    line = first + cells
    return [line, "|" + " --- |" * (line.count("|") - 1)]


def _step1_cells(r: dict) -> str:
    t = r["timing"]
    return (f"| {_fmt(r['accuracy'])} | {r['thinking_tokens']:.1f} | {r['answer_tokens']:.1f} | "
            f"{_interval(t['ttft_ms'], '.2f')} | {_interval(t['tpot_ms'], '.3f')} | {_interval(t['e2e_ms'], '.1f')} | "
            f"{r['budget_exhausted_rate']:.2f} | {r['incomplete_rate']:.2f} |")


def _step2_cells(r: dict) -> str:
    t = r["timing"]
    phases = f"{_fmt(r.get('tau_thinking'), '.2f')} / {_fmt(r.get('tau_answer'), '.2f')}"
    sampled = "—" if "sampled_accuracy" not in r else f"{r['sampled_accuracy']:.3f} ({r['sampled_accuracy_z']:+.2f})"
    rounds = f"{r['rounds']} ({r['forced_rounds']})" if "rounds" in r else "—"
    return (f"| {_interval(t['tokens_per_second'], '.1f')} | {_interval(t['speedup'], '.2f', suffix='×')} | "
            f"{_interval(t['tpot_ms'], '.3f')} | {_fmt(r.get('tau'), '.2f')} | {phases} | "
            f"{_fmt(r.get('proposed_per_round'), '.1f')} | {rounds} | {_fmt(r['accuracy'])} | "
            f"{r['identical_to_vanilla']} | {sampled} |")


_TIME_HEAD = (f" time s | first token + rounds × cost s | ratio per repeat | reconciled (closest ratio within "
              f"{RECONCILE_FACTOR:g}×) |")
_TIME_NOTE = (f"A row's time reconciles with its rounds when, in at least one repeat, its time is within a factor "
              f"{RECONCILE_FACTOR:g} of its calls' first-token time + their loop rounds × that repeat's round costs "
              f"(ratio near 1: the time is what the rounds cost; a shared machine's load moves a single repeat's "
              f"ratio, not every repeat's); a row that does not is marked **no**.")


def _time_cells(r: dict) -> str:
    """A row's time (the median repeat's) beside its first-token time + rounds × round costs,
    the ratio of the two in each repeat, and whether the closest is within ``RECONCILE_FACTOR``."""
    ratios = " / ".join(_fmt(p["seconds"] / p["predicted_seconds"] if p["predicted_seconds"] > 0 else None, ".2f")
                        for p in r["per_repeat"])
    check = r["time_check"]
    verdict = f"{'yes' if check['within'] else '**no**'} ({check['ratio']:.2f}, repeat {check['repeat'] + 1})"
    return f"| {r['seconds']:.3f} | {r['predicted_seconds']:.3f} | {ratios} | {verdict} |"


def _unreconciled(report: dict) -> list[str]:
    """A summary line naming the rows whose time does not reconcile with their rounds (none: no line)."""
    rows = [f"step 1 B={b}" for b, r in report["step1"].items() if not r["time_check"]["within"]]
    rows += [f"step 2 B={b} {m}" for b, per in report.get("step2", {}).items() for m, r in per.items()
             if not r["time_check"]["within"]]
    if not rows:
        return []
    return [f"The time of {', '.join(rows)} is not within {RECONCILE_FACTOR:g}× of its rounds × the measured round "
            f"costs in any repeat: its timing (or its counts) does not describe the rounds that ran."]


def _tiers_text(counts: dict | None, per_round: dict | None = None) -> str:
    if counts is None:
        return "— (forced rounds of a batch of several rows: not placed per tier)"
    shown = [(t, n) for t, n in counts.items() if n] or list(counts.items())[:1]
    return ", ".join(f"{t} {n}" + (f"×{per_round[t]:.2f}" if per_round and per_round[t] is not None else "")
                     for t, n in shown)


def _reconciliation(report: dict) -> list[str]:
    """Step 2's rows in counts and in time: committed tokens as first tokens + Σ tier rounds ×
    tokens per round + forced less dropped, the forced rounds by tier, and the time of the
    median repeat beside its first-token time + loop rounds × round costs."""
    md = ["### Step 2: rounds by tier, and time against round costs", "",
          "Committed tokens = first tokens (the prefill's) + Σ tier drafted rounds × tokens per round + forced "
          "rounds' tokens less those accepted past a stop or the length limit. The time of the repeat at the "
          "median beside its calls' first-token time + their loop rounds × that repeat's round costs, and the ratio "
          "of the two in each repeat.", "", _TIME_NOTE,
          "",
          *_head("| B | mode ", "| tokens | first + tier rounds × tokens / round + forced − dropped | forced rounds by "
                               "tier |" + _TIME_HEAD)]
    for b, rows in report["step2"].items():
        for name, r in rows.items():
            if name == "vanilla":
                sums = f"{r['prompts']} + {STEP} {r['tokens'] - r['prompts']}×1"
                forced = "—"
            elif r["tier_rounds"] is None:
                sums, forced = _tiers_text(None), "—"
            else:
                sums = (f"{r['first_tokens']} + {_tiers_text(r['tier_rounds'], r['tier_tokens_per_round'])} "
                        f"{r['forced_less_dropped']:+d}")
                forced = f"{r['forced_rounds']}" + (f" ({_tiers_text(r['forced_tier_rounds'])})" if r["forced_rounds"]
                                                    else "")
            md.append(f"| {b} | {name} | {r['tokens']} | {sums} | {forced} " + _time_cells(r))
    return md


def _per_repeat(report: dict) -> list[str]:
    """The adaptive rows' tier rounds in each repeat (how its choices vary), and the round costs
    each repeat measured."""
    md = [f"Adaptive policy, tier rounds per repeat (drafted; its state {report['settings']['policy_state']}):", ""]
    for b, rows in report["step2"].items():
        reps = rows["adaptive"]["per_repeat"]
        md.append(f"- B={b}: " + "; ".join(
            f"repeat {i + 1}: {_tiers_text(rep['tier_rounds'])} (forced {rep['forced_rounds']}, τ "
            f"{_fmt(rep['tau'], '.2f')}, {rep['seconds']:.3f} s)" for i, rep in enumerate(reps)))
    costs = report["round_costs"]
    n = report["settings"]["repeats"]
    md += ["", "Round costs measured in each repeat (ms per round, each tier forced on the first batch):", "",
           "| step | mode | tier | " + " | ".join(f"repeat {i + 1}" for i in range(n)) + " |", "|" + " --- |" * (n + 3)]
    for step, per in costs.items():
        for mode, tiers in per[0].items():
            md += [f"| {step} | {mode} | {t} | " + " | ".join(f"{c[mode][t]:.3f}" for c in per) + " |" for t in tiers]
    return md


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


def markdown(report: dict) -> str:
    """``report.md``: whatever steps are done so far."""
    settings = report["settings"]
    categorized = "categories" in settings
    md = ["# Two-budget experiment", "",
          f"Timed figures: median [min–max] of {settings['repeats']} repeats, the rows of a step taking turns batch by "
          f"batch in an order that rotates each repeat; a speedup pairs a mode with vanilla in the same repeat. "
          f"The adaptive policy's learned state: {settings['policy_state']}.", ""]
    if report["summary"]:
        md += ["## Summary", "", *[f"- {line}" for line in report["summary"]], ""]
    md += ["## Step 1: thinking budget B, speculation off", "", _TIME_NOTE, "", *_head("| B ", _STEP1_HEAD + _TIME_HEAD)]
    md += [f"| {b} " + _step1_cells(r) + _time_cells(r)[1:] for b, r in report["step1"].items()]
    if categorized:
        md += ["", *_category_step1(report)]
    if details := _details_table(report):
        md += ["", *details]
    if "step2" in report:
        md += ["", "## Step 2: speculative budget K at each chosen B (greedy)", "", *_head("| B | mode ", _STEP2_HEAD)]
        md += [f"| {b} | {name} " + _step2_cells(r) for b, rows in report["step2"].items() for name, r in rows.items()]
        md += ["", *_reconciliation(report), "", *_per_repeat(report)]
        if categorized:
            md += ["", "### Step 2 per category", "", *_head("| category | B | mode ", _STEP2_HEAD)]
            md += [f"| {c} | {b} | {name} " + _step2_cells(r["by_category"][c])
                   for c in settings["categories"] for b, rows in report["step2"].items() for name, r in rows.items()]
        mem = report["peak_memory"]
        md += ["", f"Peak memory: {mem['bytes'] / 2 ** 30:.2f} GiB ({mem['source']}).", ""]
    if "step3" in report:
        from eagle3_jax.serve import replay

        md += ["## Step 3: arrival-rate replay against the server (goodput per mode per rate)", "",
               replay.table(report["step3"]), "", "![goodput](goodput_vs_rate.png)", ""]
    return "\n".join(md)



def summary(report: dict) -> list[str]:
    """The summary's lines: the two effects at each chosen B (what B did, what EAGLE-3 did at
    that B), then the rows whose time does not reconcile with their rounds (if any)."""
    return _attribution(report) + _unreconciled(report)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def quality_figure(report: dict, path: Path):
    """Accuracy, thinking tokens and latency over B (speculation off): overall and per category;
    the latency's median with its min–max over the repeats."""
    plt = _pyplot()
    s1 = report["step1"]
    labels = list(s1)
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    series = [("accuracy", "accuracy"), ("thinking_tokens", "thinking tokens / request"),
              ("e2e_ms", "latency ms / request (median, min–max)")]
    cats = list(report["settings"].get("categories", {}))
    for ax, (key, title) in zip(axes, series):
        for c in [None, *cats]:  # overall, then one thinner line per category
            rows = [s1[b] if c is None else s1[b]["by_category"][c] for b in labels]
            y = np.array([np.nan if r[key] is None else r[key] for r in rows], float)
            err = None
            if key in TIMED:
                err = np.array([[r[key] - r["timing"][key]["min"] for r in rows],
                                [r["timing"][key]["max"] - r[key] for r in rows]])
            ax.errorbar(x, y, yerr=err, marker="o", lw=2.5 if c is None else 1, capsize=3,
                        label="all" if c is None else c)
        if cats:
            ax.legend(fontsize=8)
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("thinking budget B")
        ax.set_title(title)
    fig.suptitle("Quality, tokens and latency over the thinking budget (speculation off)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heatmap(report: dict, path: Path):
    """Speedup (median over the repeats) and τ over B × K."""
    plt = _pyplot()
    s2 = report["step2"]
    bs = list(s2)
    modes = [m for m in s2[bs[0]] if m != "vanilla"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.8 * len(bs) + 2.5))
    for ax, key, title in ((axes[0], "speedup", "speedup over vanilla (median)"), (axes[1], "tau", "τ (tokens per round)")):
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
