"""Draft tree, verification and generate: golden parity with the official EAGLE-3,
losslessness (greedy token identity, sampling distribution), tree invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eagle3_jax
from eagle3_jax import decode as gen_mod, verify as verify_mod
from eagle3_jax.decode import _loop as loop_mod  # where phase_rows reads COMPACT_FROM
from eagle3_jax.kv_cache import advance
from eagle3_jax.tree import TreeConfig, _select, expand
from helpers import FIXTURES, oracle_drafter


@pytest.fixture(scope="module")
def target():
    return eagle3_jax.load_target(FIXTURES / "target_tiny")


@pytest.fixture(scope="module")
def drafters(target):
    return {name: eagle3_jax.load_drafter(FIXTURES / name, target=target) for name in ("drafter_tiny", "drafter_tiny_trained")}


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


@pytest.mark.parametrize("fname,dname", [("eagenerate_greedy.npz", "drafter_tiny"),
                                         ("eagenerate_greedy_trained.npz", "drafter_tiny_trained")])
def test_greedy_generation_matches_official(target, drafters, fname, dname):
    gold = np.load(FIXTURES / fname)
    prompts = [gold[f"p{i}_prompt"].tolist() for i in range(5)]
    res = eagle3_jax.generate(target, drafters[dname], prompts, max_new_tokens=64)
    for i, p in enumerate(prompts):
        official = gold[f"p{i}_ea_output_ids"][len(p):]
        assert res.tokens[i] == official[:64].tolist()
        ours, theirs = np.array(res.stats["accept_lengths"][i]), gold[f"p{i}_round_accept_length"]
        n = min(len(ours), len(theirs))
        assert n >= len(theirs) - 3
        np.testing.assert_array_equal(ours[:n], theirs[:n])
    if dname == "drafter_tiny_trained":
        assert res.stats["tau"] > 2.0


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1024, size=int(L)).tolist() for L in rng.integers(4, 30, size=n)]


@pytest.mark.parametrize("tree", [TreeConfig(60, 7, 10), TreeConfig(16, 4, 4), TreeConfig(8, 3, 2), TreeConfig.chain(4)])
def test_oracle_drafter_is_lossless_batch4(target, tree):
    prompts = _prompts(4, seed=1)
    oracle, vanilla = oracle_drafter(target, prompts, 40)
    res = eagle3_jax.generate(target, oracle, prompts, max_new_tokens=40, tree=tree)
    assert res.tokens == vanilla
    assert max(max(a) for a in res.stats["accept_lengths"]) == min(tree.path_len - 1, tree.depth + 1)
    assert res.stats["tau"] > 2.5


@pytest.mark.parametrize("tree,batch", [(TreeConfig(60, 7, 10), 1), (TreeConfig(8, 3, 2), 4)])
def test_random_drafter_is_lossless(target, drafters, tree, batch):
    prompts = _prompts(batch, seed=2)
    vanilla = eagle3_jax.generate(target, None, prompts, max_new_tokens=48).tokens
    res = eagle3_jax.generate(target, drafters["drafter_tiny"], prompts, max_new_tokens=48, tree=tree)
    assert res.tokens == vanilla


def test_early_stops_are_identical(target):
    prompts = _prompts(4, seed=3)
    oracle, vanilla = oracle_drafter(target, prompts, 40)
    stop = vanilla[1][17]  # a token in the middle of a sequence: stops it mid-round
    want = eagle3_jax.generate(target, None, prompts, max_new_tokens=37, stop_token_ids=[stop]).tokens
    got = eagle3_jax.generate(target, oracle, prompts, max_new_tokens=37, stop_token_ids=[stop], tree=TreeConfig(16, 4, 4))
    assert got.tokens == want
    assert want[1][-1] == stop and len(want[1]) <= 18
    assert all(len(t) == 37 or t[-1] == stop for t in got.tokens)
    assert got.stats["new_tokens"] == sum(map(len, want))


def test_phases_leave_every_row_as_one_loop_over_the_batch(target, drafters, monkeypatch):
    """A batch of 8 whose answers end at different times decodes in phases of 8, 4 and 2 rows
    (the rows still decoding gathered into fewer): every row's tokens and round records are
    those of one loop over the whole batch (vanilla greedy; speculative sampled, each row's key
    travelling with it)."""
    prompts = _prompts(8, seed=4)
    vanilla = eagle3_jax.generate(target, None, prompts, max_new_tokens=64).tokens
    long_rows = set(vanilla[6]) | set(vanilla[7])  # rows 0-5 stop early (each at a token of its own), 6 and 7 do not
    stops = sorted({next(t for t in vanilla[r][3 + 6 * r:] if t not in long_rows) for r in range(6)})
    assert gen_mod.phase_rows(8, 64) == (8, 4, 2)
    runs = [(None, 0.0), (drafters["drafter_tiny_trained"], 0.8)]

    def results():
        gen_mod.clear_compiled()
        return [eagle3_jax.generate(target, d, prompts, max_new_tokens=64, stop_token_ids=stops, temperature=t, seed=3,
                                    tree=TreeConfig(8, 3, 2)) for d, t in runs]

    phased = results()
    lengths = sorted(map(len, phased[0].tokens))
    assert lengths[-2:] == [64, 64] and lengths[5] < 40  # two rows decode alone for 24+ steps
    monkeypatch.setattr(loop_mod, "COMPACT_FROM", 10 ** 6)
    assert gen_mod.phase_rows(8, 64) == (8,)
    for got, want in zip(phased, results()):
        assert got.tokens == want.tokens
        assert got.stats["accept_lengths"] == want.stats["accept_lengths"]
    assert phased[0].tokens == [v[:len(t)] for v, t in zip(vanilla, phased[0].tokens)]


# ------------------------------------------------------------------ sampling is lossless
def _chi2_pvalue(a, b, bins):
    from scipy.stats import chi2_contingency

    table = np.array([[np.sum(x == v) for v in bins] + [np.sum(~np.isin(x, bins))] for x in (a, b)])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table)[1]


def _sampling_run(target, drafter, prompt, n, seed):
    res = eagle3_jax.generate(target, drafter, [prompt] * n, max_new_tokens=3, temperature=0.8, top_p=0.95,
                              seed=seed, tree=TreeConfig(16, 4, 4))
    return np.array(res.tokens), res


@pytest.fixture(scope="module")
def vanilla_samples(target):
    """2000 vanilla samples of the golden prompt: the target's own distribution."""
    prompt = np.load(FIXTURES / "eagenerate_greedy_trained.npz")["p0_prompt"].tolist()
    return prompt, _sampling_run(target, None, prompt, 2000, seed=2)[0]


def test_sampling_matches_target_distribution(target, drafters, vanilla_samples):
    prompt, base = vanilla_samples
    spec, res = _sampling_run(target, drafters["drafter_tiny_trained"], prompt, 2000, seed=1)
    assert res.stats["accepted"] > 400  # the drafter's proposals are actually being accepted
    for pos in (1, 2):  # tokens produced by tree verification
        bins = np.unique(np.concatenate([spec[:, pos], base[:, pos]]), return_counts=True)
        top = bins[0][np.argsort(-bins[1])[:12]]
        assert _chi2_pvalue(spec[:, pos], base[:, pos], top) > 1e-3


def test_biased_acceptance_is_detected(target, drafters, vanilla_samples, monkeypatch):
    """The same test fails when acceptance is deliberately biased (accept with 3·p)."""
    prompt, base = vanilla_samples
    monkeypatch.setattr(verify_mod, "_accepts", lambda u, remaining, p: u * remaining < 3 * p)
    jax.clear_caches()
    gen_mod.PROGRAMS.clear()
    spec, _ = _sampling_run(target, drafters["drafter_tiny_trained"], prompt, 2000, seed=1)
    pvals = []
    for pos in (1, 2):
        bins = np.unique(np.concatenate([spec[:, pos], base[:, pos]]), return_counts=True)
        pvals.append(_chi2_pvalue(spec[:, pos], base[:, pos], bins[0][np.argsort(-bins[1])[:12]]))
    monkeypatch.undo()
    jax.clear_caches()
    gen_mod.PROGRAMS.clear()
    assert min(pvals) < 1e-3


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
    trees = [_select(*_random_candidates(rng, cfg), jnp.array([7], jnp.int32), cfg) for _ in range(B)]
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


# ------------------------------------------------------------------ tree invariants
def _random_candidates(rng, cfg: TreeConfig):
    """Candidate lists with the structure expand() produces (beam-major, cumulative scores)."""
    k = cfg.top_k
    scores = np.sort(-rng.exponential(size=k))[::-1]
    all_s, all_p = [scores], [np.full(k, -1)]
    beam_cand, beam_s = np.arange(k), scores
    for i in range(cfg.depth):
        child = np.sort(-rng.exponential(size=(k, k)), axis=1)[:, ::-1]
        cu = (beam_s[:, None] + child).reshape(-1)
        all_s.append(cu)
        all_p.append(np.repeat(beam_cand, k))
        best = np.argsort(-cu, kind="stable")[:k]
        beam_cand, beam_s = k + i * k * k + best, cu[best]
    C = cfg.num_candidates
    return (jnp.asarray(np.concatenate(all_s))[None], jnp.arange(C, dtype=jnp.int32)[None] + 100,
            jnp.asarray(np.concatenate(all_p), jnp.int32)[None])


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 4), depth=st.integers(0, 4), frac=st.floats(0, 1), seed=st.integers(0, 10_000))
def test_tree_invariants(k, depth, frac, seed):
    cands = k + depth * k * k
    N = 2 + int(frac * (cands - 1))
    cfg = TreeConfig(N, depth, k)
    s, t, p = _random_candidates(np.random.default_rng(seed), cfg)
    tree = jax.tree.map(lambda x: np.asarray(x[0]), _select(s, t, p, jnp.array([7], jnp.int32), cfg))
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


def test_cli_generate_prints_tokens_and_tau(capsys):
    from eagle3_jax.cli import main

    gold = np.load(FIXTURES / "eagenerate_greedy_trained.npz")
    ids = ",".join(map(str, gold["p0_prompt"]))
    assert main(["generate", "--target", str(FIXTURES / "target_tiny"), "--drafter", str(FIXTURES / "drafter_tiny_trained"),
                 "--prompt-ids", ids, "--max-new-tokens", "16", "--tree", "16,4,4", "--attention", "pallas"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0].split()
    assert [int(x) for x in first] == gold["p0_ea_output_ids"][len(gold["p0_prompt"]):][:16].tolist()
    assert "tau" in out and "tok/s" in out
