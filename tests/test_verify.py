"""Verification (``eagle3_jax.verify``): the sampling filters (top-k, top-p) against their
sorted definition, and the per-row sampling parameters against the static ones."""

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import verify as verify_mod
from eagle3_jax.tree import TreeConfig, select
from helpers import random_candidates


def test_target_probs_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    p = verify_mod.target_probs(logits, verify_mod.SamplingConfig(1.0, top_p=0.7))
    np.testing.assert_allclose(p, [[0.625, 0.375, 0, 0]], atol=1e-6)
    p = verify_mod.target_probs(logits, verify_mod.SamplingConfig(1.0, top_k=3))
    np.testing.assert_allclose(p, [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]], atol=1e-6)


def _sorted_filters(logits, temperature, top_p, top_k):
    """The filters as their definition reads, on one row with NumPy sorts: keep the ``top_k``
    largest logits (ties with the k-th kept), then the fewest most likely tokens whose mass
    reaches ``top_p`` (each token kept when the tokens sorted before it hold less)."""
    lg = logits.astype(np.float64) / temperature
    if top_k:
        lg = np.where(lg < np.sort(lg)[::-1][top_k - 1], -np.inf, lg)
    p = np.exp(lg - lg.max())
    p /= p.sum()
    if top_p < 1:
        desc = np.sort(p)[::-1]
        cutoff = desc[np.cumsum(desc) - desc < top_p].min()
        p = np.where(p >= cutoff, p, 0.0)
        p /= p.sum()
    return p


def test_filters_keep_what_sorting_keeps():
    """top-k and top-p (found by bisection, not by sorting the vocabulary) keep exactly the
    tokens a sort keeps, with ties, -inf logits and the parameters per row or static."""
    rng = np.random.default_rng(0)
    B, V = 48, 300
    logits = rng.normal(size=(B, V)) * rng.uniform(0.2, 4, size=(B, 1))
    logits[B // 3: 2 * B // 3] = rng.integers(-3, 3, size=(B // 3, V))  # many ties
    logits[2 * B // 3:, rng.random(V) < 0.3] = -np.inf
    logits[:, 0] = np.maximum(logits[:, 0], 0.0)
    temperature = rng.uniform(0.3, 2, size=B)
    top_p = np.where(rng.random(B) < 0.2, 1.0, rng.uniform(0.05, 0.999, size=B))
    top_k = np.where(rng.random(B) < 0.3, 0, rng.integers(1, V + 1, size=B))
    logits[0], top_k[0], top_p[0] = -np.arange(V), 1, 1.0  # -0.0 ties with 0.0
    logits[0, 1] = -0.0
    want = np.stack([_sorted_filters(*row) for row in zip(logits, temperature, top_p, top_k)])
    rows = verify_mod.RowSampling(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
                                  jnp.asarray(top_k, jnp.int32))
    got = np.asarray(verify_mod.target_probs(jnp.asarray(logits, jnp.float32), rows))
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for b in (1, B // 2, B - 1):  # the static path: one configuration for every row
        s = verify_mod.SamplingConfig(float(temperature[b]), top_p=float(top_p[b]), top_k=int(top_k[b]))
        got = np.asarray(verify_mod.target_probs(jnp.asarray(logits[b:b + 1], jnp.float32), s))[0]
        np.testing.assert_array_equal(got > 0, want[b] > 0)
        np.testing.assert_allclose(got, want[b], atol=1e-5)


def test_per_row_sampling_gives_greedy_rows_the_greedy_result():
    """The slot engine's per-row parameters: all rows greedy (the run-time greedy walk) and a
    mix of greedy and sampled rows (the sampling walk) both give every greedy row exactly the
    static greedy walk's path, acceptance and bonus, and ``sample`` its argmax."""
    rng = np.random.default_rng(0)
    cfg, B, V = TreeConfig(9, 3, 2), 4, 160
    trees = [select(*random_candidates(rng, cfg), jnp.array([7], jnp.int32), cfg) for _ in range(B)]
    tree = jax.tree.map(lambda *x: jnp.concatenate(x), *trees)
    logits = rng.normal(size=(B, cfg.total_tokens, V)).astype(np.float32)
    for b in range(B):  # make the target agree with a random child (or with none) at each node
        for n in range(cfg.total_tokens):
            kids = np.flatnonzero(np.asarray(tree.parents[b]) == n)
            if len(kids) and rng.random() < 0.7:
                logits[b, n, int(tree.tokens[b, rng.choice(kids)])] = 9.0
    logits, key = jnp.asarray(logits), jax.random.split(jax.random.key(3), B)
    force = jnp.array([True, False, False, False])  # row 0: a forced chain
    ref = verify_mod.verify(tree, logits, key, verify_mod.SamplingConfig(), cfg.top_k, force)
    assert int(ref[1][1:].sum()) > 0  # drafts are accepted
    greedy_rows = verify_mod.RowSampling.of(verify_mod.SamplingConfig(), B)
    mixed = verify_mod.RowSampling(jnp.array([0.0, 1.0, 0.0, 0.7]), jnp.ones(B), jnp.zeros(B, jnp.int32))
    for rows, keep in ((greedy_rows, [0, 1, 2, 3]), (mixed, [0, 2])):
        got = jax.jit(verify_mod.verify, static_argnums=4)(tree, logits, key, rows, cfg.top_k, force)
        for r, g in zip(ref, got):
            np.testing.assert_array_equal(np.asarray(r)[keep], np.asarray(g)[keep])
        drawn = jax.jit(verify_mod.sample)(key, logits[:, 0], rows)
        np.testing.assert_array_equal(np.asarray(drawn)[keep], np.asarray(jnp.argmax(logits[:, 0], -1))[keep])
