"""Vanilla vs EAGLE-3 in one process, on the same prompts and settings.

Speedup is a ratio measured in one run (compilation excluded from both timings);
greedy token identity is checked on every prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_jax.decode import generate
from eagle3_jax.tree import TreeConfig


def parse_tree(spec: str) -> TreeConfig:
    """``"60,7,10"`` → TreeConfig(60, 7, 10); ``"chain4"`` → a 4-token chain."""
    if spec.startswith("chain"):
        return TreeConfig.chain(int(spec[5:]))
    try:
        n, d, k = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--tree {spec!r}: expected TOTAL,DEPTH,TOPK (e.g. 60,7,10) or chainN") from None
    return TreeConfig(n, d, k)


def load_prompts(path: str | Path, tokenizer=None) -> list[list[int]]:
    """Prompts from a JSON file: a list of token-id lists, or of strings (needs a tokenizer)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read prompts ({e})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of prompts")
    if isinstance(data[0], str):
        if tokenizer is None:
            raise ValueError(f"{path}: text prompts need a tokenizer (tokenizer.json in the target directory)")
        return [tokenizer.encode(p) for p in data]
    return [list(map(int, p)) for p in data]


def run_bench(target, drafter, prompts, *, trees, max_new_tokens: int, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0, batch_size: int = 1, seed: int = 0, repeats: int = 3,
              log=print) -> dict:
    """Runs vanilla and EAGLE-3 per tree budget (each timed as the fastest of ``repeats``
    runs, compilation excluded); returns a JSON-able report."""
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)

    def run(drafter_, tree):
        tokens, seconds, stats = [], 0.0, []
        for i in range(0, len(prompts), batch_size):
            runs = [generate(target, drafter_, prompts[i:i + batch_size], max_new_tokens=max_new_tokens, tree=tree,
                             **sampling) for _ in range(repeats)]
            tokens += runs[0].tokens
            seconds += min(r.stats["seconds"] for r in runs)
            stats.append(runs[0].stats)
        return tokens, seconds, stats

    base_tokens, base_s, _ = run(None, TreeConfig())
    n_base = sum(map(len, base_tokens))
    report = {"settings": {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "prompts": len(prompts),
                           "repeats": repeats, **sampling},
              "vanilla": {"tokens": n_base, "seconds": base_s, "tokens_per_second": n_base / base_s}, "eagle3": []}
    log(f"vanilla: {n_base} tokens in {base_s:.2f}s = {n_base / base_s:.1f} tok/s")
    for tree in trees:
        tokens, s, stats = run(drafter, tree)
        n = sum(map(len, tokens))
        acc = [a for st in stats for row in st["accept_lengths"] for a in row]
        rounds = len(acc)
        positions = tree.path_len - 1
        rate = [sum(a >= i for a in acc) / max(sum(a >= i - 1 for a in acc), 1) for i in range(1, positions + 1)]
        entry = {
            "tree": {"total_tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k},
            "tokens": n, "seconds": s, "tokens_per_second": n / s, "speedup": (n / s) / (n_base / base_s),
            "tau": sum(a + 1 for a in acc) / max(rounds, 1), "rounds": rounds, "acceptance_rate": rate,
            "identical_to_vanilla": tokens == base_tokens if temperature == 0 else None,
        }
        report["eagle3"].append(entry)
        log(f"eagle3 {tree.total_tokens},{tree.depth},{tree.top_k}: {n / s:.1f} tok/s, speedup {entry['speedup']:.2f}x, "
            f"tau {entry['tau']:.2f}, acceptance per position {[round(r, 2) for r in rate]}"
            + (f", identical to vanilla: {entry['identical_to_vanilla']}" if temperature == 0 else ""))
    return report
