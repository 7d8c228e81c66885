"""Vanilla vs EAGLE-3 in one process, on the same prompts and settings.

Speedup is a ratio measured in one run (compilation and each program's first run excluded
from both timings); greedy token identity is checked on every prompt.
"""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import jax
import numpy as np

from eagle3_jax.atomic import save_figure
from eagle3_jax.cost import forced_rounds
from eagle3_jax.decode import compile_generate, generate, keep_compiled, prompt_rows
from eagle3_jax.speculation import Speculation, tier_name
from eagle3_jax.tree import TreeConfig


def load_prompts(path: str | Path, vocab_size: int, tokenizer=None) -> list[list[int]]:
    """Prompts from a JSON file: a list of token-id lists (each id in ``[0, vocab_size)``),
    or of strings (needs a tokenizer); errors name the file and the prompt."""

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read prompts ({e})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of prompts")
    if any(isinstance(p, str) for p in data) and tokenizer is None:
        raise ValueError(f"{path}: text prompts need a tokenizer (tokenizer.json in the target directory)")
    try:
        return [row.tolist() for row in prompt_rows([p for p in data], vocab_size, tokenizer)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def round_parts(target, drafter, prompt: list[int], tree: TreeConfig, *, max_new_tokens: int = 256,
                batch_size: int = 1, repeats: int = 3, mesh=None, rules=None) -> dict:
    """Milliseconds per round of the speculative round and its parts, inside the compiled
    decode loop on ``prompt`` (repeated ``batch_size`` times), the tree forced for as many
    rounds as fit ``max_new_tokens`` and for a quarter of them (stop tokens ignored:
    ``eagle3_jax.cost.forced_rounds``).

    ``round_ms`` is wall clock: the difference of the two calls over the difference in
    rounds, each the fastest of ``repeats``, so that what a call costs besides its rounds (the
    cache's allocation, the prefill, the launch) cancels out.  The parts split it by their
    shares of the same difference in op time under the profiler: ``draft`` (tree expansion),
    ``verify`` (the target's tree forward + the acceptance walk), ``catch_up`` (the drafter on
    the accepted tokens), ``commit`` (the target cache), ``emit`` (outputs, stops) and ``loop``
    (the loop's own bookkeeping).  ``mesh``, ``rules``: decoded on it (as ``generate(...,
    mesh=, rules=)``; the parts' op time summed over its devices).  ``drafter`` None: a vanilla step (``round_ms``
    only, not profiled)."""

    compiled, args = compile_generate(target, drafter, [prompt] * batch_size, max_new_tokens=max_new_tokens, tree=tree,
                                      mesh=mesh, rules=rules)
    per_round = tree.path_len if drafter is not None else 1
    [forced] = forced_rounds([(compiled, args)], max_new_tokens, per_round, repeats=repeats, parts=drafter is not None)
    if drafter is None:
        return {"round_ms": forced["round_ms"]}
    us = dict(forced["parts_us"])
    us["loop"] = us.pop("other", 0.0)
    names = ("draft", "verify", "catch_up", "commit", "emit", "loop")
    total = sum(us.get(n, 0.0) for n in names) or 1.0
    out = {"round_ms": forced["round_ms"]}
    out.update({f"{n}_ms": out["round_ms"] * us.get(n, 0.0) / total for n in names})
    return out


def peak_memory() -> dict:
    """Peak device memory where the backend reports it, else the process's peak RSS."""
    stats = jax.local_devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return {"bytes": int(stats["peak_bytes_in_use"]), "source": f"{jax.default_backend()} peak_bytes_in_use"}
    return {"bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "source": "host peak RSS"}


def two_proportion_z(p1: float, p2: float, n: int) -> float:
    """z of two accuracies over ``n`` prompts each (pooled): |z| < 2 is agreement within noise."""
    p = (p1 + p2) / 2
    se = math.sqrt(2 * p * (1 - p) / n) if 0 < p < 1 else 0.0
    return 0.0 if se == 0 else (p1 - p2) / se


def category_groups(n: int, categories=None) -> dict:
    """Prompt indices per category (``categories[i]``: prompt ``i``'s, as a string), in order of
    first appearance; one group, ``None``, of all ``n`` prompts without categories."""
    if categories is None:
        return {None: list(range(n))}
    categories = list(categories)
    if len(categories) != n:
        raise ValueError(f"categories: {len(categories)} values for {n} prompts")
    groups: dict = {}
    for i, c in enumerate(categories):
        groups.setdefault(str(c), []).append(i)
    return groups


def run_bench(target, drafter, prompts, *, trees, max_new_tokens: int, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0, batch_size: int = 1, seed: int = 0, repeats: int = 3,
              grade=None, categories=None, parts: dict | None = None, generate_kw: dict | None = None,
              log=print) -> dict:
    """Runs vanilla and EAGLE-3 per tree budget (a ``TreeConfig``, or a ``Speculation`` of
    tiers with its policy, reported as ``adaptive``) on the same prompts (each timed as the
    fastest of ``repeats`` passes, compilation and each program's first run excluded:
    ``generate``'s ``warm_up``; the passes interleave the modes batch by batch); returns a
    JSON-able report.  Each call is also timed stopped after its prefill (``generate``'s
    ``time_first_token``, the fastest of the same passes): ``first_token_seconds`` per mode,
    and ``decode_tokens_per_second`` over the tokens after each prompt's first and the time
    after the first-token call, so that a tree's ``decode_speedup`` leaves out the prefill
    and launch its ``speedup`` pays (and which short answers weigh).

    ``grade(i, tokens) -> bool`` scores prompt ``i``'s output (task accuracy per mode);
    ``categories[i]``: prompt ``i``'s category (e.g. a task family): every figure (τ,
    accuracy, identity; tokens/s and speedup when each category's prompts run in batches of
    their own, that is when every category fills a batch) is also reported per category under
    ``by_category``; a batch larger than a category takes the prompts in order (so that
    ``batch_size`` is the batch that runs);
    ``generate_kw``: further ``generate`` arguments for both modes (e.g. the thinking budget);
    ``parts`` caches :func:`round_parts` per tree and for vanilla's step (and length and batch)
    across calls (e.g. one per temperature).
    """
    parts = {} if parts is None else parts
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    groups = category_groups(len(prompts), categories)
    cats = [] if categories is None else list(groups)
    # each category in batches of its own when it fills one; else the prompts in order
    timed = min(map(len, groups.values())) >= batch_size
    batched = groups if timed else {None: list(range(len(prompts)))}

    modes = [(None, None), *((drafter, tree) for tree in trees)]  # vanilla first
    chunks = [(cat, idx[j:j + batch_size]) for cat, idx in batched.items() for j in range(0, len(idx), batch_size)]
    # per mode: per prompt tokens, per category seconds and chunk statistics (of the first pass)
    results = [([None] * len(prompts), {}, {}) for _ in modes]
    fastest: dict = {}
    first: dict = {}  # (mode, chunk) → the fastest call stopped after the prefill
    # the passes interleave the modes chunk by chunk (in an order that rotates each pass), so
    # that a slow spell of a shared machine falls on every mode alike, not on one of them
    with keep_compiled(len(modes) * len(chunks)):  # each (mode, chunk shape) comes round every pass
        for r in range(repeats):
            for c, (cat, ids) in enumerate(chunks):
                for m in ((k + r) % len(modes) for k in range(len(modes))):
                    drafter_, tree = modes[m]
                    out = generate(target, drafter_, [prompts[i] for i in ids], max_new_tokens=max_new_tokens,
                                   speculation=tree, warm_up=True, time_first_token=True, **sampling,
                                   **(generate_kw or {}))
                    fastest[m, c] = min(fastest.get((m, c), math.inf), out.stats["seconds"])
                    first[m, c] = min(first.get((m, c), math.inf), out.stats["first_token_seconds"])
                    if r == 0:
                        tokens, _, stats = results[m]
                        for i, t in zip(ids, out.tokens):
                            tokens[i] = t
                        stats.setdefault(cat, []).append(out.stats)
    for (m, c), sec in fastest.items():
        seconds = results[m][1]
        seconds[chunks[c][0]] = seconds.get(chunks[c][0], 0.0) + sec
    first_s = [sum(first[m, c] for c in range(len(chunks))) for m in range(len(modes))]

    def past_first(m: int, tokens: int, seconds: float) -> dict:
        """Mode ``m``'s first-token time and its tokens/s after each prompt's first token
        (None when the difference of the two fastest calls is not positive: timer noise)."""
        after = seconds - first_s[m]
        return {"first_token_seconds": first_s[m], "first_token_share": first_s[m] / seconds if seconds > 0 else None,
                "decode_tokens_per_second": (tokens - len(prompts)) / after if after > 0 else None}

    def graded(tokens):
        return None if grade is None else [bool(grade(i, t)) for i, t in enumerate(tokens)]

    def mean(values, idx):
        return None if values is None else sum(values[i] for i in idx) / len(idx)

    base_tokens, base_s, _ = results[0]
    base_correct = graded(base_tokens)

    def vanilla_row(idx, seconds):  # seconds None: the prompts shared batches with others (not timed alone)
        n = sum(len(base_tokens[i]) for i in idx)
        return {"prompts": len(idx), "tokens": n, "seconds": seconds,
                "tokens_per_second": None if seconds is None else n / seconds, "accuracy": mean(base_correct, idx)}

    thinking = {k: v for k, v in (generate_kw or {}).items() if k.startswith("thinking")}
    everyone = range(len(prompts))
    vanilla = vanilla_row(everyone, sum(base_s.values()))
    vanilla.update(past_first(0, vanilla["tokens"], vanilla["seconds"]))
    if cats:
        vanilla["by_category"] = {c: vanilla_row(groups[c], base_s.get(c) if timed else None) for c in cats}
    report = {"settings": {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "prompts": len(prompts), **thinking,
                           "repeats": repeats, **sampling, **({"categories": {c: len(groups[c]) for c in cats}} if cats else {})},
              "vanilla": vanilla, "eagle3": []}
    # a vanilla step inside the compiled loop, timed as the rounds are (greedy, the first prompt)
    step_key = (None, max_new_tokens, batch_size)
    if step_key not in parts:
        parts[step_key] = round_parts(target, None, prompts[0], TreeConfig(), max_new_tokens=max_new_tokens,
                                      batch_size=batch_size, mesh=(generate_kw or {}).get("mesh"),
                                      rules=(generate_kw or {}).get("rules"))
    vanilla["step_ms"] = parts[step_key]["round_ms"]
    log(f"[T={temperature}] vanilla: {vanilla['tokens']} tokens in {vanilla['seconds']:.2f}s = "
        f"{vanilla['tokens_per_second']:.1f} tok/s, step {vanilla['step_ms']:.2f} ms in the loop"
        + (f", first token (prefill and launch) {100 * vanilla['first_token_share']:.0f}% of the time"
           if vanilla["first_token_share"] is not None else "")
        + (f", accuracy {vanilla['accuracy']:.3f}" if grade else ""))
    for m, (tree, (tokens, secs, stats)) in enumerate(zip(trees, results[1:]), 1):
        correct = graded(tokens)
        adaptive = isinstance(tree, Speculation)
        every_batch = [s for key in batched for s in stats[key]]  # in the order of the chunks
        accepts = [a for st in every_batch for a in st["accept_lengths"]]  # per prompt, in batch order
        accepts = dict(zip((i for _, ids in chunks for i in ids), accepts))

        def row(idx, seconds, stats_, base):
            """``seconds`` and ``stats_`` (the batches' statistics) None: prompts that shared
            their batches with others (τ, accuracy and identity are their own, tokens/s and the
            acceptance per position are not)."""
            n = sum(len(tokens[i]) for i in idx)
            acc = [a for i in idx for a in accepts[i]]
            tau = float(np.mean(acc) + 1) if acc else 0.0
            rate = None
            if stats_ is not None:
                took, offered = (np.sum([st[k] for st in stats_], axis=0)
                                 for k in ("accepted_per_position", "offered_per_position"))
                rate = [float(a / max(o, 1)) for a, o in zip(took, offered)]
            tps = None if seconds is None else n / seconds
            out = {"prompts": len(idx), "tokens": n, "seconds": seconds, "tokens_per_second": tps,
                   "speedup": None if tps is None else tps / base["tokens_per_second"], "tau": tau, "rounds": len(acc),
                   "acceptance_rate": rate, "accuracy": mean(correct, idx),
                   "identical_to_vanilla": all(tokens[i] == base_tokens[i] for i in idx) if temperature == 0 else None}
            if grade is not None and temperature > 0:
                out["accuracy_z"] = two_proportion_z(out["accuracy"], base["accuracy"], len(idx))
            return out

        entry = row(everyone, sum(secs.values()), every_batch, vanilla)
        entry.update(past_first(m, entry["tokens"], entry["seconds"]))
        rates = entry["decode_tokens_per_second"], vanilla["decode_tokens_per_second"]
        entry["decode_speedup"] = rates[0] / rates[1] if None not in rates else None
        key = (tree, max_new_tokens, batch_size)
        if not adaptive and key not in parts:  # independent of the sampling settings
            parts[key] = round_parts(target, drafter, prompts[0], tree, max_new_tokens=max_new_tokens,
                                     batch_size=batch_size, mesh=(generate_kw or {}).get("mesh"),
                                     rules=(generate_kw or {}).get("rules"))
        entry = {"tree": {"name": "adaptive", "tiers": [tier_name(t) for t in tree.tiers]} if adaptive else
                 {"total_tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k, "name": tree_name(tree)},
                 **entry, "wall_ms_per_round": 1e3 * entry["seconds"] / max(entry["rounds"], 1), **parts.get(key, {})}
        if entry.get("round_ms", 0.0) > 0 and vanilla["step_ms"] > 0:  # each below the timer's noise: no ratio
            # the speedup the loop alone would give: tokens per round at a round's cost in steps
            entry["loop_speedup"] = entry["tau"] * vanilla["step_ms"] / entry["round_ms"]
        if cats:
            entry["by_category"] = {c: row(groups[c], secs[c] if timed else None, stats[c] if timed else None,
                                           vanilla["by_category"][c]) for c in cats}
        report["eagle3"].append(entry)
        if adaptive:
            counts: dict = {}
            for st in every_batch:
                for name, c in st["tier_rounds"].items():
                    counts[name] = counts.get(name, 0) + c
            entry["tier_rounds"] = counts
            detail = f"rounds per tier {counts}"
        else:
            core_ms = entry["draft_ms"] + entry["verify_ms"]
            # a round cheaper than the timer's noise (a few tiny rounds) can time at 0 ms: no split then
            share = f"{entry['round_ms'] / core_ms:.2f}x draft + verify" if core_ms > 0 else "below the timer's noise"
            detail = (f"round {entry['round_ms']:.2f} ms (draft {entry['draft_ms']:.2f}, verify {entry['verify_ms']:.2f}, "
                      f"catch-up {entry['catch_up_ms']:.2f}, commit {entry['commit_ms']:.2f}, rest "
                      f"{entry['emit_ms'] + entry['loop_ms']:.2f}; {share})")
            if "loop_speedup" in entry:
                detail += f", in the loop tau x step / round = {entry['loop_speedup']:.2f}x"
        if entry["decode_speedup"] is not None:
            detail += (f"; past the first token {entry['decode_speedup']:.2f}x (first token "
                       f"{100 * entry['first_token_share']:.0f}% of the time)")
        log(f"[T={temperature}] eagle3 {entry['tree']['name']}: {entry['tokens_per_second']:.1f} tok/s, "
            f"speedup {entry['speedup']:.2f}x, tau {entry['tau']:.2f}, acceptance per position "
            f"{[round(r, 2) for r in entry['acceptance_rate']]}, {detail}"
            + (f", accuracy {entry['accuracy']:.3f}" if grade else "")
            + (f", identical to vanilla: {entry['identical_to_vanilla']}" if temperature == 0 else ""))
        for c, r in entry.get("by_category", {}).items():
            log(f"    {c} ({r['prompts']} prompts): "
                + (f"{r['tokens_per_second']:.1f} tok/s, speedup {r['speedup']:.2f}x, " if timed else "")
                + f"tau {r['tau']:.2f}" + (f", accuracy {r['accuracy']:.3f} (vanilla "
                                          f"{vanilla['by_category'][c]['accuracy']:.3f})" if grade else ""))
    report["peak_memory"] = peak_memory()
    return report


tree_name = tier_name


def write_figure(reports: list[dict], path: str | Path):
    """PNG: speedup and τ per tree budget (one bar group per temperature), and the
    acceptance rate per draft position (one line per budget, greedy report first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [e["tree"]["name"] for e in reports[0]["eagle3"]]
    width = 0.8 / len(reports)
    sweep = len({rep["settings"].get("max_new_tokens") for rep in reports}) > 1
    for j, rep in enumerate(reports):
        x = [i + j * width for i in range(len(names))]
        label = f"T={rep['settings']['temperature']}" + (f", max {rep['settings']['max_new_tokens']}" if sweep else "")
        ax1.bar(x, [e["speedup"] for e in rep["eagle3"]], width, label=label)
        ax2.bar(x, [e["tau"] for e in rep["eagle3"]], width, label=label)
    for ax, title in ((ax1, "speedup over vanilla (×)"), (ax2, "τ (tokens per round)")):
        ax.set_xticks([i + width * (len(reports) - 1) / 2 for i in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    ax1.axhline(1.0, color="gray", lw=0.8)
    for e in reports[0]["eagle3"]:
        ax3.plot(range(1, len(e["acceptance_rate"]) + 1), e["acceptance_rate"], marker="o", label=e["tree"]["name"])
    ax3.set_title(f"acceptance per draft position (T={reports[0]['settings']['temperature']})")
    ax3.set_xlabel("draft position")
    ax3.xaxis.get_major_locator().set_params(integer=True)
    ax3.set_ylim(0, 1.02)
    ax3.legend()
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
