"""The two-budget experiment: what the thinking budget B does to quality and work, and what the
speculative budget K does to execution, reported apart.

* Step 1 — speculation off, B swept: accuracy, thinking and answer tokens, time to first
  token, time per output token, end-to-end latency, budget-exhausted and incomplete rates.
* Step 2 — at each chosen B: vanilla vs each static tier vs the adaptive policy: proposed
  nodes per round, τ per phase, accepted / committed tokens, the rounds of each tier, time per
  output token, tokens/s, peak memory; greedy token identity with vanilla and, sampled,
  accuracy agreement (two-proportion z).
* Step 3 — under load: the arrival-rate replay (``eagle3_jax.serve.replay``) against a
  loopback server per mode: goodput, TTFT/TPOT percentiles and the rate where speculation
  stops paying (``goodput_vs_rate.png``).

Figures a reader can trust (DESIGN.md):

* **Timing with its spread.**  Every timed row of steps 1 and 2 runs ``repeats`` times, the
  rows of a step taking turns batch by batch in an order that rotates each repeat, so that a
  slow spell of a shared machine falls on every row alike.  Each timed figure is the median
  over the repeats with its min–max (``row["timing"]``); a speedup pairs a mode with vanilla at
  the same B in the same repeat.  The summary states a speedup (a cut in execution time) only
  with its interval, and says "no measurable difference" where that interval holds 1 or where
  another mode's overlaps the best one's.
* **Counts that reconcile.**  A row's counts are those of its timed calls (no warm-up,
  measuring or first-token calls) in the repeat at the median time (``per_repeat`` lists each
  repeat's).  A speculative row's committed tokens are its prompts' first tokens (made by the
  prefill) + Σ over tiers of that tier's drafted rounds × its tokens per round (``tier_rounds``,
  ``tier_tokens_per_round``) + ``forced_less_dropped``: what the forced rounds committed (the
  end of thinking, under B) less the tokens a round accepted past a stop or the length limit.
  Forced rounds are counted apart, in ``forced_rounds`` and ``forced_tier_rounds``.
* **Time that matches the rounds.**  Each repeat measures what a round of each mode's tiers
  costs (``cost.forced_rounds`` on the first batch, greedy), and a row's time is compared with
  its calls' first-token time + its loop rounds × those costs (``predicted_seconds``).  The
  two reconcile when, in at least one repeat, their ratio is within ``RECONCILE_FACTOR`` (the
  time and the costs of one repeat, the closest repeat: a busy spell of a shared machine that
  slows one but not the other moves a single repeat's ratio by half or more); a row that does
  not is marked in the report and named in the summary (``row["time_check"]``).
* **The policy's state said.**  The adaptive policy is handed the repeat's round costs, and
  what it learned is reset before each row and repeat (within one, it carries from batch to
  batch); with ``keep_policy_state`` it carries from call to call in the order run instead.

With ``categories`` (e.g. the built-in pair's task families) every figure of steps 1 and 2 is
also reported per category, each category's prompts run in batches of their own (so τ per
category is measured, not apportioned).

``run_experiment`` writes ``report.json``, ``report.md`` and two figures into ``out_dir``
(``eagle3_jax.experiment_report`` words the report and draws the figures):
``quality_tokens_latency.png`` (the curves over B) and ``budget_heatmap.png`` (speedup and τ
over B × K), each as soon as its step is done: every output path is checked before the first
step, the report is rewritten whole (never in part) after each step, and a report that cannot
be written is printed instead (the run then ends in an ``OSError`` naming it).  Latencies are
per request at the given batch size, compilation and each program's first run excluded
(``generate``'s ``warm_up``); TTFT is the request's own compiled program stopped after the
prefill (its first token), timed just before the full call.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eagle3_jax import speculation as policy
from eagle3_jax.atomic import check_output_path, write_atomic
from eagle3_jax.bench import category_groups, peak_memory, two_proportion_z
from eagle3_jax.cost import forced_rounds
from eagle3_jax.decode import compile_generate, generate, keep_compiled
from eagle3_jax.experiment_report import (HEATMAP, QUALITY_FIGURE, RECONCILE_FACTOR, STEP, TIMED, UNLIMITED, heatmap,
                                          markdown, quality_figure, summary)
from eagle3_jax.speculation import Speculation, tier_name
from eagle3_jax.tree import TreeConfig


def _label(b) -> str:
    return UNLIMITED if b is None else str(b)


def mode_name(mode) -> str:
    """A mode's name in the report: ``vanilla`` (``None``), ``adaptive`` (a ``Speculation``) or
    its tier's name (``chain4``, ``16,4,4``)."""
    return "vanilla" if mode is None else "adaptive" if isinstance(mode, Speculation) else tier_name(mode)


def _tiers(mode) -> tuple:
    """A mode's tiers: ``TreeConfig`` s and ``None`` (vanilla: one, ``None``)."""
    return mode.tiers if isinstance(mode, Speculation) else (mode,)


def tier_names(mode) -> list[str]:
    """The names of a mode's tiers (vanilla's one: ``step``), as ``round_costs`` keys them."""
    return [STEP] if mode is None else [tier_name(t) for t in _tiers(mode)]


def _new_run(n: int) -> dict:
    """One pass of a row over the ``n`` prompts: per-request outputs (in prompt order) and each
    batch's statistics (``chunks``: category, prompt indices, stats)."""
    return {**{k: [None] * n for k in ("tokens", "thinking", "answer", "status", "ttft", "e2e")}, "chunks": []}


def _call(run: dict, target, drafter, prompts, cat, ids, *, budget, mode, max_new_tokens, temperature, seed, tokenizer,
          round_ms=None, timed: bool = True):
    """One batch (``ids``) of one row into ``run``; ``round_ms``: the adaptive policy's round
    costs; ``timed``: the first token timed too and the program's first run left out
    (``generate``'s ``time_first_token`` and ``warm_up``)."""
    kw = dict(tokenizer=tokenizer, thinking_budget=budget, temperature=temperature, seed=seed)
    if mode is not None:
        kw["speculation"] = mode
    if isinstance(mode, Speculation):
        kw["round_ms"] = round_ms
    res = generate(target, None if mode is None else drafter, [prompts[i] for i in ids], max_new_tokens=max_new_tokens,
                   time_first_token=timed, warm_up=timed, **kw)
    for k, i in enumerate(ids):
        run["tokens"][i], run["thinking"][i] = res.tokens[k], res.thinking_tokens[k]
        run["answer"][i], run["status"][i] = res.answer_tokens[k], res.thinking_status[k]
        run["ttft"][i], run["e2e"][i] = res.stats.get("first_token_seconds"), res.stats["seconds"]
    run["chunks"].append((cat, ids, res.stats))


def round_costs(target, drafter, batch: list, modes, *, max_new_tokens: int, tokenizer, seed: int) -> dict:
    """Milliseconds per round of each mode's tiers, ``{mode name: {tier name: ms}}`` (vanilla's
    one tier is ``step``): each tier forced on ``batch`` for the rounds that make
    ``max_new_tokens`` and for a quarter of them, on the program the mode's greedy rows run (B
    is an argument of that program, not part of it); a round costs the difference of the two
    calls over the difference in rounds, each the fastest of 3 (``cost.forced_rounds``), so
    that what a call costs besides its rounds cancels out."""
    out = {}
    for mode in modes:
        kw = dict(tokenizer=tokenizer, seed=seed)
        if mode is not None:
            kw["speculation"] = mode
        if isinstance(mode, Speculation):  # stand-in costs: the program's own measurement is not wanted here
            kw["round_ms"] = [1.0] * len(mode.tiers)
        program = compile_generate(target, None if mode is None else drafter, batch, max_new_tokens=max_new_tokens, **kw)
        out[mode_name(mode)] = {
            name: forced_rounds([program], max_new_tokens, 1 if t is None else t.path_len, tier=i, parts=False)[0]["round_ms"]
            for i, (name, t) in enumerate(zip(tier_names(mode), _tiers(mode)))}
    return out


def _policy_round_ms(costs: dict, mode: Speculation) -> list[float]:
    """The adaptive policy's round costs, per tier, from ``round_costs`` (a cost below the
    timer's resolution, 0, taken as a microsecond: ``generate`` wants positive ones)."""
    return [max(costs["adaptive"][name], 1e-3) for name in tier_names(mode)]


def _loop_rounds(run: dict, mode) -> dict:
    """The rounds the loop of a run's calls ran, per tier (forced ones too; vanilla: its steps)."""
    counts: collections.Counter = collections.Counter()
    for _, ids, st in run["chunks"]:
        if mode is None:  # a step per token after the prefill's, for the batch's longest answer
            counts[STEP] += max(len(run["tokens"][i]) for i in ids) - 1
        else:
            counts.update(st["tier_per_round"])
    return dict(counts)


def _predicted_seconds(run: dict, mode, costs: dict) -> float:
    """A run's time as its calls' first-token time + its loop rounds × the round costs."""
    first = sum(st["first_token_seconds"] for _, _, st in run["chunks"])
    per_round = costs[mode_name(mode)]
    return first + sum(n * per_round[t] for t, n in _loop_rounds(run, mode).items()) / 1e3


def _time_check(per_repeat: list[dict]) -> dict:
    """A row's time against its first-token time + rounds × round costs (``per_repeat``: each
    repeat's ``seconds`` and ``predicted_seconds``): the ratio of the repeat closest to 1, which
    repeat, and whether it is within ``RECONCILE_FACTOR``."""
    ratios = [p["seconds"] / p["predicted_seconds"] if p["predicted_seconds"] > 0 else math.inf for p in per_repeat]
    r = min(range(len(ratios)), key=lambda i: abs(math.log(ratios[i])) if 0 < ratios[i] < math.inf else math.inf)
    return {"ratio": ratios[r], "repeat": r, "factor": RECONCILE_FACTOR,
            "within": 1 / RECONCILE_FACTOR <= ratios[r] <= RECONCILE_FACTOR}


def tier_split(st: dict) -> tuple | None:
    """One call's drafted rounds, their tokens (accepted + 1 each) and its forced rounds, per
    tier (three ``Counter`` s).  A row decodes from the loop's first round until it ends, so its
    j-th round is the loop's (``tier_per_round``); its rounds are its drafted thinking rounds,
    then its forced ones (the end of thinking committed), then its drafted answer rounds.
    ``None`` where forced rounds cannot be placed: a batch of several rows (the statistics
    count them per batch, not per row)."""
    tiers, accepts, forced = st["tier_per_round"], st["accept_lengths"], st["forced_rounds"]
    if forced and len(accepts) > 1:
        return None
    rounds, tokens, forced_tiers = collections.Counter(), collections.Counter(), collections.Counter()
    for b, acc in enumerate(accepts):
        thought = len(st["phases"]["thinking"]["accept_lengths"][b]) if forced else len(acc)
        drafted = tiers[:thought] + tiers[thought + forced: len(acc) + forced]
        for t, a in zip(drafted, acc):
            rounds[t] += 1
            tokens[t] += a + 1
        forced_tiers.update(tiers[thought: thought + forced])
    return rounds, tokens, forced_tiers


def _tier_counts(stats: list[dict], names: list[str], tokens: int, prompts: int) -> dict:
    """The tier accounting of a row's calls (see the module doc; ``None`` values where
    :func:`tier_split` cannot place the forced rounds)."""
    rounds, made, forced = collections.Counter(), collections.Counter(), collections.Counter()
    for st in stats:
        split = tier_split(st)
        if split is None:
            return dict.fromkeys(("tier_rounds", "forced_tier_rounds", "tier_tokens_per_round", "forced_less_dropped"))
        for total, part in zip((rounds, made, forced), split):
            total.update(part)
    return {"tier_rounds": {n: rounds[n] for n in names}, "forced_tier_rounds": {n: forced[n] for n in names},
            "tier_tokens_per_round": {n: made[n] / rounds[n] if rounds[n] else None for n in names},
            "first_tokens": prompts, "forced_less_dropped": tokens - prompts - sum(made.values())}


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


def _speculation_row(stats: list[dict], mode, tokens: int, prompts: int) -> dict:
    """A speculative row's round statistics over its calls' ``stats`` (``tokens`` committed for
    ``prompts`` requests): rounds, τ overall and per phase, proposed per round, and the tier
    accounting of :func:`_tier_counts`."""
    rounds = sum(sum(s["rounds"]) for s in stats)
    row = {"rounds": rounds, "proposed_per_round": sum(s["proposed"] for s in stats) / max(rounds, 1),
           "accepted": sum(s["accepted"] for s in stats), "committed": sum(s["committed"] for s in stats),
           "forced_rounds": sum(s["forced_rounds"] for s in stats)}
    for phase in ("thinking", "answer"):
        acc = _pool(stats, "accept_lengths", phase) if all("phases" in s for s in stats) else []
        row[f"tau_{phase}"] = float(np.mean(acc) + 1) if acc else None
    acc = _pool(stats, "accept_lengths")
    row["tau"] = float(np.mean(acc) + 1) if acc else None
    row.update(_tier_counts(stats, tier_names(mode), tokens, prompts))
    return row


def _spread(values) -> dict:
    """The median of ``values`` (one per repeat), their min and max, and the values."""
    values = [float(v) for v in values]
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "values": values}


def _timed_row(runs: list[dict], mode, costs: list[dict], cat=None) -> dict:
    """One row (one category of it; ``None``: all prompts) over its repeats: each timed figure
    the median with its spread (``timing``), the counts those of the repeat at the whole row's
    median time (``median_repeat``, the lower middle one for an even number of repeats; greedy
    output is the same in every repeat); for the whole row, each repeat's time beside its
    rounds × that repeat's round costs (``per_repeat``)."""
    per = [_summary_row(r, cat) for r in runs]
    m = int(np.argsort([sum(st["seconds"] for st in _view(r)[1]) for r in runs], kind="stable")[(len(runs) - 1) // 2])
    row = {**per[m], "median_repeat": m, "timing": {k: _spread([p[k] for p in per]) for k in TIMED}}
    row.update({k: v["median"] for k, v in row["timing"].items()})
    if mode is not None:
        row.update(_speculation_row(_view(runs[m], cat)[1], mode, row["tokens"], row["prompts"]))
    if cat is None:
        row["per_repeat"] = []
        for r, (run, p) in enumerate(zip(runs, per)):
            rep = {"seconds": p["seconds"], "predicted_seconds": _predicted_seconds(run, mode, costs[r]),
                   "loop_rounds": _loop_rounds(run, mode)}
            if mode is not None:
                spec = _speculation_row(_view(run)[1], mode, p["tokens"], p["prompts"])
                rep.update({k: spec[k] for k in ("tau", "rounds", "forced_rounds", "tier_rounds", "forced_tier_rounds")})
            row["per_repeat"].append(rep)
        row["predicted_seconds"] = row["per_repeat"][m]["predicted_seconds"]
        row["time_check"] = _time_check(row["per_repeat"])
    return row


def _check_outputs(out_dir: Path, step3: bool) -> list[Path]:
    """The files the run writes into ``out_dir``, each checked before any work (a directory in
    a file's place, or no permission to write, fails now rather than after the steps)."""
    check_output_path(out_dir, "out_dir", directory=True)
    names = ["report.json", "report.md", QUALITY_FIGURE, HEATMAP] + (["goodput_vs_rate.png"] if step3 else [])
    return [check_output_path(out_dir / name, "output") for name in names]


def _save(report: dict, out_dir: Path, failed: dict, figures=()):
    """Writes ``report.json`` and ``report.md``, each whole or not at all (``write_atomic``),
    then ``figures`` (``(draw, file name)`` pairs); a report file that cannot be written is
    printed on stdout instead, and every failure is kept in ``failed`` (file name → error)
    for the end of the run."""
    for name, text in (("report.json", json.dumps(report, indent=2) + "\n"), ("report.md", markdown(report))):
        try:
            write_atomic(out_dir / name, text)
            failed.pop(name, None)
        except OSError as e:
            print(text, flush=True)
            failed[name] = e
    for draw, name in figures:
        try:
            draw(report, out_dir / name)
            failed.pop(name, None)
        except OSError as e:
            failed[name] = e


def _step2_rows(runs: dict, costs: list, b, modes: list, cats: list, accuracy: dict) -> dict:
    """Step 2's rows at budget ``b`` from each (B, mode)'s timed runs (and, in ``accuracy``,
    its sampled run): identity with vanilla's tokens, the speedup paired repeat by repeat with
    vanilla's (its median and spread), the sampled accuracy against vanilla's (z)."""
    base = runs[b, None]
    rows = {}
    for mode in modes:
        per = {}
        for c in [None, *cats]:
            row = _timed_row(runs[b, mode], mode, costs, c)
            idx = _view(base[0], c)[0]
            mine = runs[b, mode][row["median_repeat"]]["tokens"]
            row["identical_to_vanilla"] = all(mine[i] == base[0]["tokens"][i] for i in idx)
            row["timing"]["speedup"] = _spread([_summary_row(run, c)["tokens_per_second"] /
                                                _summary_row(v, c)["tokens_per_second"] for run, v in zip(runs[b, mode], base)])
            row["speedup"] = row["timing"]["speedup"]["median"]
            if accuracy:
                sv, sm = (float(np.mean([accuracy[b, x]["correct"][i] for i in idx])) for x in (None, mode))
                row["sampled_accuracy"], row["sampled_accuracy_z"] = sm, two_proportion_z(sm, sv, len(idx))
            per[c] = row
        rows[mode_name(mode)] = {**per[None], **({"by_category": {c: per[c] for c in cats}} if cats else {})}
    return rows


def run_experiment(target, drafter, tokenizer, prompts, *, grade=None, categories=None, details=None,
                   budgets=(0, 8, 16, 32, 64, 128, None), chosen=(16, 64, None),
                   tiers=(TreeConfig.chain(4), TreeConfig.chain(6), TreeConfig(16, 4, 4)),
                   batch_size: int = 1, max_new_tokens: int = 256, sampled_temperature: float | None = 0.7,
                   seed: int = 0, repeats: int = 3, keep_policy_state: bool = False, out_dir="experiment",
                   progress: bool = True, replay_prompts=None, replay_rates=(), replay_requests: int = 24,
                   server_kw: dict | None = None) -> dict:
    """Runs the steps and writes the report after each (see the module doc); returns the report dict.

    ``grade(i, tokens) -> bool`` scores prompt ``i`` (accuracy; ``None``: not reported);
    ``categories[i]``: prompt ``i``'s category (e.g. a task family): each category's prompts
    run in batches of their own, and every figure of steps 1 and 2 is also reported per
    category (``report["step1"][B]["by_category"][c]``, ``report["step2"][B][mode]["by_category"][c]``);
    ``details(i, tokens) -> dict``: further per-request figures (e.g. a tool call's JSON
    validity), each numeric or bool value averaged over the requests that report it
    (``row["details"]``, overall and per category);
    ``chosen``: the budgets of step 2; ``tiers``: the static tiers (the adaptive policy runs
    over them plus no drafting); ``sampled_temperature``: also compare sampled accuracy of
    each mode with vanilla at that temperature, one pass untimed (``None``: greedy only; needs
    ``grade``); ``repeats``: timed passes of steps 1 and 2 (at least 3 for an interval that
    means something); ``keep_policy_state``: the adaptive policy's learned state carried from
    call to call in the order run (default: reset before each row and repeat).  Step 3 runs
    when ``replay_rates`` are given: ``eagle3_jax.serve.replay`` of ``replay_prompts`` (texts)
    at those arrival rates against a loopback server (``server_kw`` for its engine), per mode.
    Raises ``OSError`` at the end when a report file could not be written (it was printed).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    groups = category_groups(len(prompts), categories)
    cats = [] if categories is None else list(groups)
    out_dir = Path(out_dir)
    _check_outputs(out_dir, bool(replay_rates))
    n = len(prompts)
    chunks = [(cat, idx[j:j + batch_size]) for cat, idx in groups.items() for j in range(0, len(idx), batch_size)]
    adaptive = Speculation((None, *tiers))
    modes = [None, *tiers, adaptive]
    sampled = bool(sampled_temperature) and grade is not None
    call = dict(max_new_tokens=max_new_tokens, seed=seed, tokenizer=tokenizer)
    calls = len(chunks) * (repeats * (len(budgets) + len(chosen) * len(modes)) + sampled * len(chosen) * len(modes))
    bar = tqdm(total=calls, desc="experiment", disable=not progress)
    state_before = policy.snapshot()

    def timed_step(rows: list, step_modes: list) -> tuple[dict, list]:
        """``repeats`` passes over ``rows`` ((B, mode) pairs), the rows taking turns batch by
        batch in an order that rotates each pass; each pass first measures its round costs.
        Returns each row's runs (one per repeat, graded) and each repeat's round costs."""
        runs = {row: [_new_run(n) for _ in range(repeats)] for row in rows}
        costs = []
        for r in range(repeats):
            bar.set_postfix_str(f"repeat {r + 1}: round costs")
            costs.append(round_costs(target, drafter, [prompts[i] for i in chunks[0][1]], step_modes, **call))
            states: dict = {}  # each row's own policy state in this pass (unless kept across rows)
            for cat, ids in chunks:
                for k in range(len(rows)):
                    b, mode = row = rows[(k + r) % len(rows)]
                    bar.set_postfix_str(f"repeat {r + 1}: B={_label(b)} {mode_name(mode)}")
                    learns = isinstance(mode, Speculation) and not keep_policy_state
                    if learns:
                        policy.restore(states.get(row, {}))
                    _call(runs[row][r], target, drafter, prompts, cat, ids, budget=b, mode=mode, temperature=0.0,
                          round_ms=_policy_round_ms(costs[r], adaptive) if mode is adaptive else None, **call)
                    if learns:
                        states[row] = policy.snapshot()
                    bar.update()
        for row_runs in runs.values():  # greedy: graded once, unless a repeat's tokens differ
            _grade(row_runs[0], grade, details)
            for run in row_runs[1:]:
                if run["tokens"] == row_runs[0]["tokens"]:
                    run["correct"], run["details"] = row_runs[0]["correct"], row_runs[0]["details"]
                else:
                    _grade(run, grade, details)
        return runs, costs

    def with_categories(row: dict, rows: dict) -> dict:  # the overall row, and the categories' under by_category
        return {**row, **({"by_category": rows} if cats else {})}

    report = {"settings": {"prompts": n, "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                           "budgets": [_label(b) for b in budgets], "chosen": [_label(b) for b in chosen],
                           "tiers": [tier_name(t) for t in tiers], "sampled_temperature": sampled_temperature,
                           "repeats": repeats,
                           "policy_state": "kept from call to call in the order run" if keep_policy_state else
                           "reset before each row and repeat",
                           **({"categories": {c: len(groups[c]) for c in cats}} if cats else {})},
              "steps": [], "summary": [], "round_costs": {}}
    failed: dict = {}
    try:
        with keep_compiled(len(modes) * 2 * len(chunks)):  # a loop per (mode, temperature, batch shape)
            runs, report["round_costs"]["step1"] = timed_step([(b, None) for b in budgets], [None])
            report["step1"] = {_label(b): with_categories(
                _timed_row(runs[b, None], None, report["round_costs"]["step1"]),
                {c: _timed_row(runs[b, None], None, report["round_costs"]["step1"], c) for c in cats})
                for b in budgets}
            report["steps"].append("step1")
            _save(report, out_dir, failed, [(quality_figure, QUALITY_FIGURE)])

            runs, costs = timed_step([(b, m) for b in chosen for m in modes], modes)
            report["round_costs"]["step2"] = costs
            accuracy = {}
            if sampled:  # one untimed pass per row, for accuracy only
                for b in chosen:
                    for mode in modes:
                        run = _new_run(n)
                        if mode is adaptive and not keep_policy_state:
                            policy.restore({})
                        for cat, ids in chunks:
                            bar.set_postfix_str(f"T={sampled_temperature}: B={_label(b)} {mode_name(mode)}")
                            _call(run, target, drafter, prompts, cat, ids, budget=b, mode=mode, timed=False,
                                  temperature=sampled_temperature,
                                  round_ms=_policy_round_ms(costs[-1], adaptive) if mode is adaptive else None, **call)
                            bar.update()
                        _grade(run, grade, None)
                        accuracy[b, mode] = run
            report["step2"] = {_label(b): _step2_rows(runs, costs, b, modes, cats, accuracy) for b in chosen}
            report["peak_memory"] = peak_memory()
            report["summary"] = summary(report)
            report["steps"].append("step2")
            _save(report, out_dir, failed, [(heatmap, HEATMAP)])
    finally:
        bar.close()
        if not keep_policy_state:
            policy.restore(state_before)
    if replay_rates:
        from eagle3_jax.serve import replay

        report["step3"] = replay.replay(target, drafter, tokenizer, prompts=list(replay_prompts), rates=sorted(replay_rates),
                                        requests=replay_requests, tiers=tiers, max_tokens=max_new_tokens, seed=seed,
                                        log=lambda line: print(line) if progress else None, **(server_kw or {}))
        x = report["step3"]["crossover_rate"]
        report["summary"].append("under load (step 3), speculation " + (
            f"stops paying at {x:g} requests/s" if x is not None else "paid at every arrival rate measured"))
        report["steps"].append("step3")
        _save(report, out_dir, failed, [(lambda rep, path: replay.write_figure(rep["step3"], path), "goodput_vs_rate.png")])
    if failed:
        raise OSError(f"{out_dir}: could not write " + "; ".join(f"{name} ({e})" for name, e in failed.items())
                      + (" — the report was printed on stdout instead" if {"report.json", "report.md"} & set(failed)
                         else ""))
    return report
