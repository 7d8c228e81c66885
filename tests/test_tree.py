"""The draft tree (``eagle3_jax.tree``): golden parity with the official EAGLE-3's draft
trees, the tree invariants of ``select`` on random candidates, and the tree budget's checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from eagle3_jax.kv_cache import advance
from eagle3_jax.tree import TreeConfig, expand, select
from helpers import FIXTURES, golden_drafters, random_candidates


@pytest.fixture(scope="module")
def drafters():
    return golden_drafters()


@pytest.mark.parametrize("fname,dname", [("draft_tree.npz", "drafter_tiny"), ("draft_tree_trained.npz", "drafter_tiny_trained")])
def test_tree_matches_official(drafters, fname, dname):
    drafter, gold = drafters[dname], np.load(FIXTURES / fname)
    cases = [c for c in range(3) if f"c{c}_draft_tokens" in gold]
    for c in cases:
        N, depth, k = (int(x) for x in gold[f"c{c}_params_total_token_depth_top_k"])
        cfg = TreeConfig(N, depth, k)
        h = jnp.asarray(gold[f"c{c}_hidden_states"])[None]
        ids = jnp.asarray(gold[f"c{c}_input_ids"])[None, 1:]
        T = h.shape[1]
        out, cache = drafter(h, ids, jnp.arange(T)[None], cache=drafter.init_cache(1, T + depth * k + 2))
        build = jax.jit(lambda cache, last, root: expand(drafter, cache, last, root, cfg))
        tree = build(advance(cache, jnp.array([T])), out[:, -1], jnp.asarray(gold[f"c{c}_sample_token"], jnp.int32))
        np.testing.assert_array_equal(tree.tokens[0], gold[f"c{c}_draft_tokens"])
        np.testing.assert_array_equal(tree.mask[0], gold[f"c{c}_tree_mask"].astype(bool))
        np.testing.assert_array_equal(tree.depth[0], gold[f"c{c}_tree_position_ids"])
        ri = gold[f"c{c}_retrieve_indices"]
        paths = np.asarray(tree.paths[0])
        np.testing.assert_array_equal(paths[: ri.shape[0], : ri.shape[1]], ri)
        assert (paths[ri.shape[0]:] == -1).all() and (paths[:, ri.shape[1]:] == -1).all()


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 4), depth=st.integers(0, 4), frac=st.floats(0, 1), seed=st.integers(0, 10_000))
def test_tree_invariants(k, depth, frac, seed):
    cands = k + depth * k * k
    N = 2 + int(frac * (cands - 1))
    cfg = TreeConfig(N, depth, k)
    s, t, p = random_candidates(np.random.default_rng(seed), cfg)
    tree = jax.tree.map(lambda x: np.asarray(x[0]), select(s, t, p, jnp.array([7], jnp.int32), cfg))
    parents, depth_, mask, paths = tree.parents, tree.depth, tree.mask, tree.paths
    assert parents[0] == -1 and tree.tokens[0] == 7
    for n in range(1, N):
        assert 0 <= parents[n] < n
    for n in range(N):  # mask = self + ancestors; position = depth
        anc, a = {n}, parents[n]
        while a >= 0:
            anc.add(a)
            a = parents[a]
        assert set(np.flatnonzero(mask[n])) == anc
        assert depth_[n] == len(anc) - 1
    leaves = [n for n in range(N) if n not in set(parents[1:])]
    rows = [r for r in paths if (r >= 0).any()]
    assert [r[r >= 0][-1] for r in rows] == leaves  # one row per leaf, in increasing leaf order
    for r in rows:  # every path is a root-to-leaf chain
        r = r[r >= 0]
        assert r[0] == 0 and all(parents[r[i + 1]] == r[i] for i in range(len(r) - 1))


@pytest.mark.parametrize("make, exc, words", [
    (lambda: TreeConfig(16, 4.0, 4), TypeError, "TreeConfig.depth"),
    (lambda: TreeConfig("16", 4, 4), TypeError, "TreeConfig.total_tokens"),
    (lambda: TreeConfig(16, 4, True), TypeError, "TreeConfig.top_k"),
    (lambda: TreeConfig.chain(3.0), ValueError, "TreeConfig.chain"),
    (lambda: TreeConfig.chain(0), ValueError, "TreeConfig.chain"),
], ids=["float-depth", "string-total", "bool-top-k", "float-chain", "empty-chain"])
def test_tree_budget_fields_must_be_integers(make, exc, words):
    with pytest.raises(exc, match=words):  # not a shape error from deep inside the first compile
        make()
