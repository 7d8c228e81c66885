"""The sampling filters (top-k, top-p) by bisection vs by sorting the vocabulary, at the
shapes a verify step samples from.

    python scripts/sampling_filters_bench.py [--vocab 910] [--rows 1 32 500] [--nodes 16] [--repeats 20]

``eagle3_jax.verify.target_probs`` finds each row's top-k threshold and nucleus by a 32-step
bisection over the values' bit patterns (a few fused reductions over the row per step).  The
reference here is the textbook form: sort every row, cumulative sums.  Both are jitted on
``[rows, nodes, vocab]`` logits (temperature 0.8, top-p 0.95, then also top-k 50), checked to
keep the same tokens, and timed in turns; the script prints each one's median milliseconds
and their ratio.  On XLA:CPU a sort of every row dominates a large batch's verify step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.verify import SamplingConfig, target_probs


def sorted_probs(logits, s: SamplingConfig):
    """The filters through sorts (the reference)."""
    logits = logits.astype(jnp.float32) / s.temperature
    if s.top_k:
        kth = -jnp.sort(-logits, axis=-1)[..., s.top_k - 1: s.top_k]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    if s.top_p < 1:
        desc = -jnp.sort(-probs, axis=-1)
        before = jnp.cumsum(desc, axis=-1) - desc  # the mass sorted before each token
        cutoff = jnp.min(jnp.where(before < s.top_p, desc, jnp.inf), axis=-1, keepdims=True)
        probs = jnp.where(probs >= cutoff, probs, 0.0)
        probs = probs / probs.sum(-1, keepdims=True)
    return probs


def _check_same(logits, s: SamplingConfig, a, b) -> int:
    """Both keep the same tokens, but where float32 sums in different orders round a token's
    strictly more likely mass across ``top_p`` (within 1e-5 of it in float64): the number of
    rows where that happened; any other difference stops the script."""
    rows = np.argwhere((a != b).any(-1))
    for row in map(tuple, rows):
        lg = np.asarray(logits[row], np.float64) / s.temperature
        if s.top_k:
            lg = np.where(lg < np.sort(lg)[::-1][s.top_k - 1], -np.inf, lg)
        p = np.exp(lg - lg.max())
        p /= p.sum()
        for v in np.flatnonzero(a[row] != b[row]):
            if abs(p[p > p[v]].sum() - s.top_p) > 1e-5:
                raise SystemExit(f"{s}: row {row} token {v}: the two keep different tokens")
    return len(rows)


def _times_ms(fn, x, repeats: int) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn(x)``, after a first one."""
    jax.block_until_ready(fn(x))
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        out.append(1e3 * (time.perf_counter() - start))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=910, help="default: the built-in target's")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 500])
    ap.add_argument("--nodes", type=int, default=16, help="tree nodes sampled per row")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"{jax.default_backend()} backend, vocabulary {args.vocab}, {args.nodes} nodes per row; median of "
          f"{args.repeats} calls, the two taking turns")
    rng = np.random.default_rng(0)
    for s in (SamplingConfig(0.8, top_p=0.95), SamplingConfig(0.8, top_p=0.95, top_k=50)):
        for rows in args.rows:
            x = jnp.asarray(rng.normal(size=(rows, args.nodes, args.vocab)) * 3, jnp.float32)
            fns = {"bisection": jax.jit(lambda lg: target_probs(lg, s)), "sort": jax.jit(lambda lg: sorted_probs(lg, s))}
            kept = {k: np.asarray(f(x)) > 0 for k, f in fns.items()}
            edge = _check_same(x, s, kept["bisection"], kept["sort"])
            times = {k: [] for k in fns}
            for _ in range(4):
                for k, f in fns.items():
                    times[k] += _times_ms(f, x, max(args.repeats // 4, 1))
            ms = {k: float(np.median(v)) for k, v in times.items()}
            print(f"  top_p={s.top_p} top_k={s.top_k:<3d} rows {rows:4d}: bisection {ms['bisection']:8.2f} ms, "
                  f"sort {ms['sort']:8.2f} ms: sort / bisection {ms['sort'] / ms['bisection']:5.1f}x"
                  + (f" ({edge} of {x.size // x.shape[-1]} rows differ at the nucleus' edge)" if edge else ""))


if __name__ == "__main__":
    main()
