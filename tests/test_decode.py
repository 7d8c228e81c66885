"""Decoding (``eagle3_jax.decode``): ``generate`` against the official EAGLE-3 (golden greedy
outputs and acceptance), lossless (greedy token identity with vanilla decoding, the sampled
distribution by χ²), its loop (phases, early stops, the compiled loop's HLO: no cache copies,
the prefill's last logits only), its request validation (malformed arguments refused before
anything compiles, naming the argument; the accepted prompt containers and scalars mean the
same), its cache of compiled programs (bounded, and letting go of their kernels' memory maps),
on a simulated mesh, and through the CLI."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import cost, decode, layers, verify as verify_mod
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig
from helpers import FIXTURES, chi2_pvalue, cpu_devices_env, full_optimization, golden_drafters, oracle_drafter

ROOT = Path(__file__).parent.parent
MAPS = Path("/proc/self/maps")


@pytest.fixture(scope="module")
def target():
    return eagle3_jax.load_target(FIXTURES / "target_tiny")


@pytest.fixture(scope="module")
def drafters(target):
    return golden_drafters(target)


@pytest.fixture(scope="module")
def pair(target, drafters):
    """The tiny target and its trained drafter."""
    return target, drafters["drafter_tiny_trained"]


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


def test_phases_leave_every_row_as_one_loop_over_the_batch(target, drafters):
    """A batch of 8 whose answers end at different times decodes in phases of 8, 4 and 2 rows
    (the rows still decoding gathered into fewer): every row's tokens and round records are
    those of one loop over the whole batch (vanilla greedy; speculative sampled, each row's key
    travelling with it)."""
    prompts = _prompts(8, seed=4)
    vanilla = eagle3_jax.generate(target, None, prompts, max_new_tokens=64).tokens
    long_rows = set(vanilla[6]) | set(vanilla[7])  # rows 0-5 stop early (each at a token of its own), 6 and 7 do not
    stops = sorted({next(t for t in vanilla[r][3 + 6 * r:] if t not in long_rows) for r in range(6)})
    assert decode.phase_rows(8, 64) == (8, 4, 2)
    runs = [(None, 0.0), (drafters["drafter_tiny_trained"], 0.8)]

    def results(phases=True):
        decode.clear_compiled()
        return [eagle3_jax.generate(target, d, prompts, max_new_tokens=64, stop_token_ids=stops, temperature=t, seed=3,
                                    tree=TreeConfig(8, 3, 2), phases=phases) for d, t in runs]

    phased = results()
    lengths = sorted(map(len, phased[0].tokens))
    assert lengths[-2:] == [64, 64] and lengths[5] < 40  # two rows decode alone for 24+ steps
    one_loop = decode.prepare(target, None, prompts, max_new_tokens=64, temperature=0.0, top_p=1.0, top_k=0,
                              tree=TreeConfig(8, 3, 2), seed=3, stop_token_ids=stops, tokenizer=None, phases=False)
    assert one_loop.statics.phases == (8,)
    for got, want in zip(phased, results(phases=False)):
        assert got.tokens == want.tokens
        assert got.stats["accept_lengths"] == want.stats["accept_lengths"]
    assert phased[0].tokens == [v[:len(t)] for v, t in zip(vanilla, phased[0].tokens)]


# ------------------------------------------------------------------ sampling is lossless
def _sampling_run(target, drafter, prompt, n, seed):
    res = eagle3_jax.generate(target, drafter, [prompt] * n, max_new_tokens=3, temperature=0.8, top_p=0.95,
                              seed=seed, tree=TreeConfig(16, 4, 4))
    return np.array(res.tokens), res


@pytest.fixture(scope="module")
def vanilla_samples(target):
    """2000 vanilla samples of the golden prompt: the target's own distribution."""
    prompt = np.load(FIXTURES / "eagenerate_greedy_trained.npz")["p0_prompt"].tolist()
    with full_optimization():
        return prompt, _sampling_run(target, None, prompt, 2000, seed=2)[0]


def test_sampling_matches_target_distribution(target, drafters, vanilla_samples, optimized):
    prompt, base = vanilla_samples
    spec, res = _sampling_run(target, drafters["drafter_tiny_trained"], prompt, 2000, seed=1)
    assert res.stats["accepted"] > 400  # the drafter's proposals are actually being accepted
    for pos in (1, 2):  # tokens produced by tree verification
        bins = np.unique(np.concatenate([spec[:, pos], base[:, pos]]), return_counts=True)
        top = bins[0][np.argsort(-bins[1])[:12]]
        assert chi2_pvalue(spec[:, pos], base[:, pos], top) > 1e-3


def test_biased_acceptance_is_detected(target, drafters, vanilla_samples, monkeypatch, optimized):
    """The same test fails when acceptance is deliberately biased (accept with 3·p)."""
    prompt, base = vanilla_samples
    monkeypatch.setattr(verify_mod, "_accepts", lambda u, remaining, p: u * remaining < 3 * p)
    jax.clear_caches()
    decode.PROGRAMS.clear()
    spec, _ = _sampling_run(target, drafters["drafter_tiny_trained"], prompt, 2000, seed=1)
    pvals = []
    for pos in (1, 2):
        bins = np.unique(np.concatenate([spec[:, pos], base[:, pos]]), return_counts=True)
        pvals.append(chi2_pvalue(spec[:, pos], base[:, pos], bins[0][np.argsort(-bins[1])[:12]]))
    monkeypatch.undo()
    jax.clear_caches()
    decode.PROGRAMS.clear()
    assert min(pvals) < 1e-3


# ------------------------------------------------------------------ the compiled loop
@pytest.mark.parametrize("tree,dtype,batch,max_new", [
    (None, None, 1, 40), (TreeConfig.chain(3), None, 1, 40), (TreeConfig(8, 2, 2), None, 1, 40),
    (Speculation((None, TreeConfig.chain(3), TreeConfig(8, 2, 2))), None, 1, 40), (TreeConfig.chain(3), "bfloat16", 1, 40),
    (TreeConfig.chain(3), None, 8, 64)],
    ids=["vanilla", "chain3", "tree", "adaptive", "chain3-bfloat16", "chain3-phases"])
def test_decode_loop_copies_no_cache(tree, dtype, batch, max_new, monkeypatch):
    """In the optimized HLO of the whole decode loop, no cache-sized buffer is copied or
    converted inside the loop (KV writes, commit and the drafter's catch-up update the caches
    in place), also when an adaptive policy switches between tiers and bursts of plain steps,
    with bfloat16 weights (which XLA:CPU would update by converting the whole cache), and in
    each phase of a batch decoded in phases (whose rows are gathered between the loops); and
    the empty caches are not copied into the loop either."""
    monkeypatch.setattr(layers, "PREFIX_BLOCK", 16)  # blocks smaller than the tiny cache
    target = eagle3_jax.load_target(FIXTURES / "target_tiny", dtype=dtype)
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target) if tree else None
    spec = tree if isinstance(tree, Speculation) else Speculation.fixed(tree or TreeConfig())
    assert len(decode.phase_rows(batch, max_new)) == (3 if batch == 8 else 1)
    compiled, args = decode.compile_generate(target, drafter, [[1, 2, 3, 4, 5]] * batch, max_new_tokens=max_new,
                                             speculation=spec, round_ms=[1.0] * len(spec.tiers),
                                             programs=decode.ProgramCache())
    assert int(compiled(*args)["n_out"][0]) > 0
    cfg = target.config
    max_len = 32 + max_new + (spec.scratch if tree else 1)
    # one row's float32 layer (what a bfloat16 one converts to): the smallest phase's cache is larger
    layer_bytes = max_len * cfg.num_kv_heads * cfg.head_dim * 4
    ops = cost.cache_ops(compiled.as_text(), layer_bytes, slots=max_len)
    assert [op for op in ops["copy"] if op[3] != "ENTRY"] == []
    assert ops["in_place"], "the cache updates should appear as in-place dynamic-update-slice/scatter"
    # nor before it: the empty caches' keys and values are filled in place (kv_cache.init_cache);
    # the copies left are a smaller phase's rows, gathered between the loops
    assert [op for op in ops["copy"] if op[3] == "ENTRY" and op[4][1] == batch] == []


def test_prefill_computes_the_last_tokens_logits_only():
    """The decode loop's prefill runs the target's head on each prompt's last token only: no
    ``[B, T, V]`` logits in the program (for a real vocabulary, the prefill's largest buffer:
    32 prompts of 2k tokens over 128k ids would be 34 GB)."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    B, V = 2, target.config.vocab_size
    compiled, args = decode.compile_generate(target, None, [[1, 2, 3, 4, 5]] * B, max_new_tokens=8)
    T = args[-1].prompt_BxT.shape[1]  # the prompt's bucket
    assert T > 1
    text = compiled.as_text()
    assert f"f32[{B},{T},{V}]" not in text
    assert f"f32[{B},{V}]" in text


# ------------------------------------------------------------------ request validation
OK = [[1, 2, 3]]


BAD = [
    # (id, kwargs, exception, words the message must contain)
    ("prompt-floats", dict(prompts=[[1.0, 2.0]]), TypeError, "prompts[0]"),
    ("prompt-float-array", dict(prompts=np.array([[1.5, 2.0]])), TypeError, "prompts[0]"),
    ("prompt-bools", dict(prompts=[[True, False]]), TypeError, "prompts[0]"),
    ("prompt-bool-array", dict(prompts=[np.array([True, False])]), TypeError, "prompts[0]"),
    ("prompt-string-no-tokenizer", dict(prompts=["hello"]), ValueError, "tokenizer"),
    ("prompt-empty-list", dict(prompts=[]), ValueError, "prompts"),
    ("prompt-empty-row", dict(prompts=[[1, 2], []]), ValueError, "prompts[1]"),
    ("prompt-3d-array", dict(prompts=np.zeros((1, 2, 3), np.int32)), ValueError, "prompts"),
    ("prompt-nested-row", dict(prompts=[[[1, 2]]]), TypeError, "prompts[0]"),
    ("prompt-none", dict(prompts=None), TypeError, "prompts"),
    ("prompt-int", dict(prompts=5), TypeError, "prompts"),
    ("prompt-dict", dict(prompts={"a": 1}), TypeError, "prompts"),
    ("prompt-id-negative", dict(prompts=[[1, -1]]), ValueError, "prompts[0]"),
    ("prompt-id-too-large", dict(prompts=[[1, 10 ** 6]]), ValueError, "prompts[0]"),
    ("prompt-row-of-strings", dict(prompts=[["a", "b"]]), TypeError, "prompts[0]"),
    ("max-new-zero", dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    ("max-new-float", dict(max_new_tokens=8.0), TypeError, "max_new_tokens"),
    ("max-new-bool", dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    ("max-new-string", dict(max_new_tokens="8"), TypeError, "max_new_tokens"),
    ("too-long", dict(max_new_tokens=10 ** 6), ValueError, "max_position_embeddings"),
    ("temperature-nan", dict(temperature=float("nan")), ValueError, "temperature"),
    ("temperature-inf", dict(temperature=float("inf")), ValueError, "temperature"),
    ("temperature-negative", dict(temperature=-0.5), ValueError, "temperature"),
    ("temperature-tiny", dict(temperature=1e-12), ValueError, "temperature"),
    ("temperature-string", dict(temperature="0.7"), TypeError, "temperature"),
    ("top-p-zero", dict(top_p=0.0), ValueError, "top_p"),
    ("top-p-above-one", dict(top_p=1.5), ValueError, "top_p"),
    ("top-p-nan", dict(top_p=float("nan")), ValueError, "top_p"),
    ("top-k-negative", dict(top_k=-1), ValueError, "top_k"),
    ("top-k-float", dict(top_k=2.5), TypeError, "top_k"),
    ("top-k-above-vocab", dict(top_k=10 ** 6), ValueError, "top_k"),
    ("seed-negative", dict(seed=-1), ValueError, "seed"),
    ("seed-float", dict(seed=1.5), TypeError, "seed"),
    ("seed-huge", dict(seed=2 ** 40), ValueError, "seed"),
    ("tree-tuple", dict(tree=(60, 7, 10)), TypeError, "tree"),
    ("tree-top-k-over-draft-vocab", dict(tree=TreeConfig(4, 1, 10 ** 4 // 2)), ValueError, "top_k"),
    ("stop-int", dict(stop_token_ids=5), TypeError, "stop_token_ids"),
    ("stop-string", dict(stop_token_ids="5"), TypeError, "stop_token_ids"),
    ("stop-float", dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids[0]"),
    ("stop-out-of-vocab", dict(stop_token_ids=[10 ** 6]), ValueError, "stop_token_ids[0]"),
    ("stop-0d-array", dict(stop_token_ids=np.array(5)), TypeError, "stop_token_ids"),
    # a dict's or a set's order is not the prompts' (a dict was read as its keys: budgets 0, 1, ...)
    ("thinking-budget-dict", dict(think_token_ids=(3, 4), thinking_budget={0: 8}), TypeError, "thinking_budget"),
    ("thinking-budget-set", dict(think_token_ids=(3, 4), thinking_budget={8}), TypeError, "thinking_budget"),
    ("end-thinking-0d-array", dict(think_token_ids=(3, 4), thinking_budget=2, end_thinking_ids=np.array(4)), TypeError,
     "end_thinking_ids"),
    ("thinking-budget-0d-float-array", dict(think_token_ids=(3, 4), thinking_budget=np.array(2.0)), TypeError,
     "thinking_budget"),
    # a dict was read as its keys ({3: 4, 1: 2}: open 3, close 1), a set in its own order
    ("think-ids-dict", dict(think_token_ids={3: 4, 1: 2}, thinking_budget=2), TypeError, "think_token_ids"),
    ("think-ids-set", dict(think_token_ids={3, 4}, thinking_budget=2), TypeError, "think_token_ids"),
    ("end-thinking-set", dict(think_token_ids=(3, 4), thinking_budget=2, end_thinking_ids={5, 4}), TypeError,
     "end_thinking_ids"),
    ("end-thinking-dict", dict(think_token_ids=(3, 4), thinking_budget=2, end_thinking_ids={4: 5}), TypeError,
     "end_thinking_ids"),
    ("thinking-grace-negative", dict(think_token_ids=(3, 4), thinking_mode="soft", thinking_grace=-1), ValueError,
     "thinking_grace"),
    ("thinking-grace-without-thinking", dict(thinking_grace=1.5), TypeError, "thinking_grace"),
]


@pytest.mark.parametrize("kwargs,exc,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_generate_argument_is_named(pair, kwargs, exc, words):
    target, drafter = pair
    compiled = []

    class Recording(decode.ProgramCache):
        def get(self, key, build):
            compiled.append(key)
            return super().get(key, build)

    args = dict(prompts=OK, max_new_tokens=8, programs=Recording())  # nothing may compile
    args.update(kwargs)
    prompts = args.pop("prompts")
    with pytest.raises(exc) as info:
        eagle3_jax.generate(target, drafter, prompts, **args)
    assert words in str(info.value)
    assert not compiled


def test_prompt_containers_mean_the_same_prompts(pair):
    """Lists, tuples, numpy int64 scalars, 1-D numpy/jax arrays and a 2-D array (one row per
    prompt) all give the same padded batch; a flat list of ids is one prompt."""
    target, _ = pair
    want = decode.prepare(target, None, [[5, 6, 7], [8, 9, 10]], max_new_tokens=4, temperature=0.0, top_p=1.0,
                           top_k=0, tree=TreeConfig(), seed=0, stop_token_ids=None, tokenizer=None)
    forms = [
        ((5, 6, 7), (8, 9, 10)),
        [np.array([5, 6, 7]), jnp.array([8, 9, 10])],
        np.array([[5, 6, 7], [8, 9, 10]]),
        jnp.array([[5, 6, 7], [8, 9, 10]], jnp.int32),
        [[np.int64(5), np.int64(6), np.int64(7)], [np.int32(8), 9, 10]],
        [[jnp.int32(5), 6, 7], [np.array(8), 9, 10]],
    ]
    for form in forms:
        got = decode.prepare(target, None, form, max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0,
                             tree=TreeConfig(), seed=0, stop_token_ids=None, tokenizer=None)
        np.testing.assert_array_equal(got.prompt_BxT, want.prompt_BxT)
        np.testing.assert_array_equal(got.lengths_B, want.lengths_B)
    one = decode.prepare(target, None, [np.int64(5), 6, 7], max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0,
                          tree=TreeConfig(), seed=0, stop_token_ids=None, tokenizer=None)
    assert one.prompt_BxT.shape[0] == 1 and one.lengths_B.tolist() == [3]


def test_scalar_arguments_read_alike_as_python_numpy_or_jax_scalars(pair):
    """0-d numpy and JAX arrays and numpy scalars are the numbers they hold, for every scalar
    argument (a thinking budget too); a TreeConfig of numpy integers is the same tree."""
    target, drafter = pair
    think = dict(think_token_ids=(3, 4), end_thinking_ids=(4,))

    def request(conv):
        return decode.prepare(target, drafter, [[5, 6, 7], [8, 9]], max_new_tokens=conv(4), temperature=conv(0.5),
                               top_p=conv(0.75), top_k=conv(5), tree=TreeConfig(conv(4), conv(1), conv(3)),
                               seed=conv(3), stop_token_ids=[conv(7)], tokenizer=None, thinking_budget=conv(2), **think)

    want = request(lambda x: x)
    for conv in (np.asarray, lambda x: np.array(x)[()], jnp.asarray):
        got = request(conv)
        assert got.statics == want.statics and got.seed == want.seed
        np.testing.assert_array_equal(got.budget_B, want.budget_B)
    assert hash(TreeConfig(np.int64(4), 1, 3)) == hash(TreeConfig(4, 1, 3))
    assert isinstance(TreeConfig(np.int64(4), 1, 3).total_tokens, int)


# ------------------------------------------------------------------ compiled programs
# Compiled loops are kept for reuse, and can be let go: XLA:CPU maps pages for every kernel
# and unmaps them only with their executable, so a long-lived process (a notebook, this suite's
# workers) that never lets go reaches the kernel's limit on memory maps and crashes inside a
# compilation.
def test_compile_cache_is_bounded(pair):
    """Each new max_new_tokens compiles a program; only the most recently used are kept."""
    target, _ = pair
    programs = decode.ProgramCache(2)
    for n in (3, 4, 5, 4):
        eagle3_jax.generate(target, None, OK, max_new_tokens=n, programs=programs)
    assert len(programs) == 2
    assert [key[3].max_new for key in programs.keys()] == [5, 4]  # 3 evicted, 4 most recent


def test_keep_compiled_holds_more_loops_while_inside(pair):
    """``keep_compiled(n)`` keeps n loops while inside (a benchmark cycling through them
    compiles each once), then trims to the cache's size, the most recently used kept (on the
    default cache, ``decode.keep_compiled``)."""
    target, _ = pair
    programs = decode.ProgramCache(2)
    with programs.keep(3):
        for n in (3, 4, 5, 3):
            eagle3_jax.generate(target, None, OK, max_new_tokens=n, programs=programs)
        assert [key[3].max_new for key in programs.keys()] == [4, 5, 3]  # none evicted, none compiled again
    assert programs.size == 2
    assert [key[3].max_new for key in programs.keys()] == [5, 3]
    before = decode.PROGRAMS.size
    with decode.keep_compiled(before + 3):
        assert decode.PROGRAMS.size == before + 3
    assert decode.PROGRAMS.size == before == decode.COMPILE_CACHE_SIZE


def test_first_token_is_timed_on_the_call_s_own_program(pair):
    """``time_first_token`` times the same compiled program stopped after the prefill: no
    second program, the same tokens."""
    target, drafter = pair
    programs = decode.ProgramCache()
    plain = eagle3_jax.generate(target, drafter, OK, max_new_tokens=6, programs=programs)
    timed = eagle3_jax.generate(target, drafter, OK, max_new_tokens=6, time_first_token=True, programs=programs)
    assert timed.tokens == plain.tokens and len(programs) == 1
    assert 0 < timed.stats["first_token_seconds"] and "first_token_seconds" not in plain.stats


def test_warm_up_runs_a_program_once_before_its_first_timed_call(pair):
    """``warm_up`` runs the call's own program untimed only if it has not run in this process
    (by an earlier warm-up or any ``generate``); the tokens are the same either way, and a
    program dropped from the cache of compiled loops is warmed again."""
    target, drafter = pair
    programs = decode.ProgramCache()
    kw = dict(max_new_tokens=6, programs=programs)
    first = eagle3_jax.generate(target, drafter, OK, warm_up=True, **kw)
    again = eagle3_jax.generate(target, drafter, OK, warm_up=True, **kw)
    plain = eagle3_jax.generate(target, None, OK, **kw)  # vanilla's program: run, not warmed
    after = eagle3_jax.generate(target, None, OK, warm_up=True, **kw)
    assert first.stats["warm_up_seconds"] > 0 and again.stats["warm_up_seconds"] is None
    assert after.stats["warm_up_seconds"] is None and "warm_up_seconds" not in plain.stats
    assert first.tokens == again.tokens and plain.tokens == after.tokens and len(programs) == 2
    programs.clear()
    assert eagle3_jax.generate(target, drafter, OK, warm_up=True, **kw).stats["warm_up_seconds"] > 0


def _maps() -> int:
    return len(MAPS.read_text().splitlines())


@pytest.mark.skipif(not MAPS.exists(), reason="counts the memory maps of /proc/self/maps (Linux)")
def test_clear_compiled_unmaps_the_loops_kernels():
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    decode.clear_compiled()
    jax.clear_caches()
    gc.collect()
    before = _maps()
    first = eagle3_jax.generate(target, drafter, [[1, 2, 3]], max_new_tokens=8, tree=eagle3_jax.TreeConfig(8, 3, 3))
    grown = _maps() - before
    assert grown > 100  # the loop's kernels
    jax.clear_caches()
    gc.collect()
    assert _maps() - before > grown // 2  # the kept loop still holds them
    decode.clear_compiled()
    gc.collect()
    assert _maps() - before < grown // 4
    again = eagle3_jax.generate(target, drafter, [[1, 2, 3]], max_new_tokens=8, tree=eagle3_jax.TreeConfig(8, 3, 3))
    assert again.tokens == first.tokens


@pytest.mark.skipif(not MAPS.exists(), reason="counts the memory maps of /proc/self/maps (Linux)")
def test_a_dropped_loop_unmaps_its_kernels_without_clearing_jax():
    """The cache of compiled loops bounds their memory by itself: a loop it evicts, or that
    ``clear_compiled`` drops, is unmapped without ``jax.clear_caches`` (JAX's own caches do
    not keep it), so that a process compiling many loops stays within the limit on maps."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    programs = decode.ProgramCache(1)
    jax.clear_caches()
    gc.collect()
    before = _maps()
    tree = eagle3_jax.TreeConfig(8, 3, 3)
    eagle3_jax.generate(target, drafter, [[1, 2, 3]], max_new_tokens=8, tree=tree, programs=programs)
    one = _maps() - before
    assert one > 100  # the loop's kernels
    for n in (9, 10, 11):  # each a loop of its own, evicting the one before
        eagle3_jax.generate(target, drafter, [[1, 2, 3]], max_new_tokens=n, tree=tree, programs=programs)
    gc.collect()
    assert len(programs) == 1 and _maps() - before < 2 * one  # one loop's maps, not four
    programs.clear()
    gc.collect()
    assert _maps() - before < one // 4


# ------------------------------------------------------------------ on a mesh, through the CLI
def test_generate_on_meshes_equals_one_device():
    env = cpu_devices_env(8)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "mesh_decode.py"), "--quick"], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if "tokens identical" in line and not line.startswith("phases")]
    assert len(lines) == 5, res.stdout
    assert lines[3].startswith("tiny-2l  tree8,2,3 {'data': 2, 'tensor': 4}"), res.stdout  # a two-layer drafter
    # fsdp: the weights split over their hidden dimension, no draft step gathering a drafter weight whole
    assert lines[4].startswith("tiny-2l  tree8,2,3 {'data': 2, 'fsdp': 4}") and "(8, 32, 128) per device" in lines[4], \
        res.stdout
    assert "-> (8, 2, 60, 1, 16) per device" in lines[0]  # data=2, tensor=4: batch and KV heads split
    assert "-> (8, 1, 60, 4, 16) per device" in lines[2]  # data=8: one row per device
    assert any(line.startswith("phases (8, 4, 2)") and "tokens identical" in line for line in res.stdout.splitlines()), \
        res.stdout


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
