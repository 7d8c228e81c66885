"""The thinking budget B inside the decode loop: speculative output equals vanilla output
under the same budget (greedy tokens, sampled distribution), committed tokens only count,
and the per-phase statistics sum to the totals."""

from __future__ import annotations

import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import budget, builtin
from eagle3_jax.decode import encode_chat
from eagle3_jax.tree import TreeConfig
from helpers import FIXTURES, chi2_pvalue, oracle_drafter


@pytest.fixture(scope="module")
def pair():
    target, drafter, tok = builtin.load()
    tasks = builtin.eval_tasks()[:4]
    prompts = [encode_chat(tok, [{"role": "user", "content": t["prompt"]}]) for t in tasks]
    return target, drafter, tok, prompts


def _check_sums(res):
    assert [t + a for t, a in zip(res.thinking_tokens, res.answer_tokens)] == [len(t) for t in res.tokens]
    phases = res.stats["phases"]
    assert [a + b for a, b in zip(phases["thinking"]["rounds"], phases["answer"]["rounds"])] == res.stats["rounds"]
    assert [sorted(a + b) for a, b in zip(phases["thinking"]["accept_lengths"], phases["answer"]["accept_lengths"])] == \
        [sorted(a) for a in res.stats["accept_lengths"]]
    for key in ("proposed", "accepted", "committed", "forced_rounds"):
        assert phases["thinking"][key] + phases["answer"][key] == res.stats[key], key
    assert res.stats["committed"] == sum(map(len, res.tokens))


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_greedy_speculative_equals_vanilla_under_mixed_budgets(pair, mode):
    """A ragged batch with B = 0, a B that ends mid-round, another B, and unlimited: every tier
    gives vanilla's tokens, thinking counts and statuses."""
    target, drafter, tok, prompts = pair
    budgets = [0, 5, 11, None]  # the last prompt (tool) closes its thinking within 96 tokens
    kw = dict(max_new_tokens=96, tokenizer=tok, thinking_budget=budgets, thinking_mode=mode, thinking_grace=3)
    want = eagle3_jax.generate(target, None, prompts, **kw)
    slack = 3 if mode == "soft" else 0
    assert want.thinking_status[0] == "budget_exhausted" and want.thinking_status[3] == "closed"
    for b, n in zip(budgets, want.thinking_tokens):  # <think>, B (+ grace) content tokens, then \n</think> forced
        if b is not None:
            assert n in (b + slack + 2, b + slack + 3)
    _check_sums(want)
    for tree in (TreeConfig.chain(4), TreeConfig(16, 4, 4)):
        got = eagle3_jax.generate(target, drafter, prompts, tree=tree, **kw)
        assert got.tokens == want.tokens, tree
        assert got.thinking_tokens == want.thinking_tokens and got.thinking_status == want.thinking_status
        assert got.finish_reason == want.finish_reason
        assert got.stats["forced_rounds"] >= 2  # the end of thinking went through forced rounds
        _check_sums(got)


def test_budget_on_one_sequence_and_the_text(pair):
    target, drafter, tok, prompts = pair
    kw = dict(max_new_tokens=128, tokenizer=tok, thinking_budget=7)
    want = eagle3_jax.generate(target, None, prompts[:1], **kw)
    got = eagle3_jax.generate(target, drafter, prompts[:1], tree=TreeConfig.chain(6), **kw)
    assert got.tokens == want.tokens
    text = tok.decode(got.tokens[0])
    thought, _, answer = text.partition(builtin.THINK_CLOSE)  # the forced close
    assert thought.startswith(builtin.THINK_OPEN) and got.thinking_status == ["budget_exhausted"]
    assert got.finish_reason == ["stop"] and answer.strip() and got.answer_tokens[0] > 0


def test_unlimited_budget_changes_nothing(pair):
    target, drafter, tok, prompts = pair
    plain = eagle3_jax.generate(target, drafter, prompts, max_new_tokens=64, tree=TreeConfig.chain(4))
    tracked = eagle3_jax.generate(target, drafter, prompts, max_new_tokens=64, tree=TreeConfig.chain(4), tokenizer=tok)
    assert tracked.tokens == plain.tokens and tracked.stats["forced_rounds"] == 0
    assert set(tracked.thinking_status) <= {"closed", "incomplete"}
    _check_sums(tracked)
    short = eagle3_jax.generate(target, None, prompts[:1], max_new_tokens=4, tokenizer=tok)
    assert short.thinking_status == ["incomplete"] and short.finish_reason == ["length"]


def _tiny_case():
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 1024, size=12).tolist()
    cont = eagle3_jax.generate(target, None, [prompt], max_new_tokens=40).tokens[0]
    open_id = prompt[-1]  # the prompt ends in the think-open token: thinking from the first token
    k = next(i for i in range(14, 30) if cont[i] not in cont[:i] and cont[i] != open_id)
    return target, prompt, cont, open_id, cont[k], k


def test_a_rejected_drafted_close_does_not_end_thinking():
    """The drafter proposes the close token where the target does not produce it: that draft
    is rejected, thinking goes on, and it ends where the target itself closes it."""
    target, prompt, cont, open_id, close_id, k = _tiny_case()
    kw = dict(max_new_tokens=40, think_token_ids=(open_id, close_id))
    want = eagle3_jax.generate(target, None, [prompt], **kw)
    assert want.tokens[0] == cont and want.thinking_tokens == [k + 1] and want.thinking_status == ["closed"]
    oracle, _ = oracle_drafter(target, [prompt], 40)
    at = len(prompt) + 6  # the oracle's table holds prompt + continuation
    assert cont[6] != close_id
    oracle.table[...] = oracle.table[...].at[0, at].set(close_id)  # a wrong draft: close instead of cont[6]
    got = eagle3_jax.generate(target, oracle, [prompt], tree=TreeConfig.chain(4), **kw)
    assert got.tokens == want.tokens and got.thinking_tokens == [k + 1] and got.thinking_status == ["closed"]
    assert min(min(a) for a in got.stats["accept_lengths"]) < 4  # the injected close was rejected in some round


def test_budget_cut_mid_round_with_a_long_end_sequence():
    """B ends inside an accepted run, and the forced sequence is longer than a round's chain."""
    target, prompt, cont, open_id, close_id, k = _tiny_case()
    end = (3, 4, 5, 6, 7, 8, close_id)
    kw = dict(max_new_tokens=40, think_token_ids=(open_id, close_id), thinking_budget=6, end_thinking_ids=end)
    want = eagle3_jax.generate(target, None, [prompt], **kw)
    assert want.tokens[0][:6] == cont[:6] and tuple(want.tokens[0][6:13]) == end
    oracle, _ = oracle_drafter(target, [prompt], 40)
    got = eagle3_jax.generate(target, oracle, [prompt], tree=TreeConfig.chain(4), **kw)
    assert got.tokens == want.tokens and got.thinking_status == ["budget_exhausted"]
    assert got.stats["forced_rounds"] == 2  # 7 forced tokens: E[0] replaces a drafted one, 6 in two chain rounds


def test_sampling_distribution_with_a_budget(optimized):
    """Sampled, with B = 1 and a forced end: the tokens after the forced sequence are
    distributed as the target's own (χ², as for generate without a budget)."""
    target, prompt, _, open_id, close_id, _ = _tiny_case()
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)
    kw = dict(max_new_tokens=6, temperature=0.8, think_token_ids=(open_id, close_id), thinking_budget=1,
              end_thinking_ids=(9, close_id))
    base = eagle3_jax.generate(target, None, [prompt] * 2000, seed=2, **kw)
    spec = eagle3_jax.generate(target, drafter, [prompt] * 2000, seed=1, tree=TreeConfig(16, 4, 4), **kw)
    assert spec.stats["forced_rounds"] > 0
    a, b = np.array(spec.tokens, dtype=object), np.array(base.tokens, dtype=object)
    for pos in (0, 3, 4):  # the free thinking token, then the first answer tokens after the forced E
        xa = np.array([t[pos] if len(t) > pos else -1 for t in a])
        xb = np.array([t[pos] if len(t) > pos else -1 for t in b])
        bins = np.unique(np.concatenate([xa, xb]), return_counts=True)
        top = bins[0][np.argsort(-bins[1])[:12]]
        assert chi2_pvalue(xa, xb, top) > 1e-3, pos
    for t in spec.tokens:  # a content token, then the forced end — unless the model closed by itself
        assert t[1:3] == [9, close_id] or close_id in t[:2]


def test_bad_thinking_arguments(pair):
    target, _, tok, prompts = pair
    with pytest.raises(ValueError, match="thinking_budget"):
        eagle3_jax.generate(eagle3_jax.load_target(FIXTURES / "target_tiny"), None, [[1, 2]], max_new_tokens=4,
                            thinking_budget=4)
    with pytest.raises(ValueError, match="thinking_budget"):
        eagle3_jax.generate(target, None, prompts, max_new_tokens=4, tokenizer=tok, thinking_budget=[1, 2])
    with pytest.raises(ValueError, match="thinking_budget"):
        eagle3_jax.generate(target, None, prompts[:1], max_new_tokens=4, tokenizer=tok, thinking_budget=-3)
    with pytest.raises(ValueError, match="thinking_mode"):
        eagle3_jax.generate(target, None, prompts[:1], max_new_tokens=4, tokenizer=tok, thinking_mode="medium")
    with pytest.raises(ValueError, match="end_thinking_ids"):
        eagle3_jax.generate(target, None, prompts[:1], max_new_tokens=4, tokenizer=tok, end_thinking_ids=[5])
    with pytest.raises(TypeError, match="think_token_ids"):
        eagle3_jax.generate(target, None, prompts[:1], max_new_tokens=4, think_token_ids=5)
    # an end sequence that opens thinking again after its close: refused (a round committed the
    # token after it unchecked where a plain step cut it: speculative != vanilla, a fuzzer's find)
    with pytest.raises(ValueError, match=r"end_thinking_ids=\[19, 226, 300\] opens thinking again"):
        eagle3_jax.generate(target, None, prompts[:1], max_new_tokens=4, think_token_ids=(226, 19),
                            end_thinking_ids=(19, 226, 300), thinking_budget=2)
    # checked even where no thinking phase is tracked (no think ids, no tokenizer)
    with pytest.raises(ValueError, match="thinking_mode"):
        eagle3_jax.generate(target, None, prompts[:1], max_new_tokens=4, thinking_mode="medium")
    with pytest.raises(ValueError, match="end_thinking_ids needs the think-open/close tokens"):
        eagle3_jax.generate(target, None, prompts[:1], max_new_tokens=4, end_thinking_ids=[5, 6])


def test_an_end_sequence_may_pass_through_an_open_before_its_close():
    """Only an open *after* the last close is refused: E = (close, open, close) ends thinking."""
    assert budget.ThinkingConfig(open_id=1, close_id=2, end_ids=(2, 1, 2)).end_ids == (2, 1, 2)
    assert budget.ThinkingConfig(open_id=1, close_id=2, end_ids=(1, 9, 2)).end_ids == (1, 9, 2)
    with pytest.raises(ValueError, match="opens thinking again"):
        budget.ThinkingConfig(open_id=1, close_id=2, end_ids=(2, 9, 1))


def test_phase_rules():
    cfg = budget.ThinkingConfig(open_id=1, close_id=2, end_ids=(9, 2))
    assert budget.initial_phase([5, 1, 7], cfg) == budget.THINKING
    assert budget.initial_phase([1, 2, 7], cfg) == budget.AFTER
    assert budget.initial_phase([5, 7], cfg) == budget.BEFORE
    import jax.numpy as jnp

    toks = jnp.array([[1, 5, 5, 2, 6], [5, 5, 5, 5, 5]])
    before, _ = budget.phases(toks, jnp.array([budget.BEFORE, budget.THINKING]), cfg)
    assert before.tolist() == [[0, 1, 1, 1, 2], [1, 1, 1, 1, 1]]
    keep, hit = budget.cut(toks, jnp.array([5, 5]), jnp.array([0, 1]), jnp.array([0, 2]), jnp.array([1, 3]),
                           jnp.array([False, False]), cfg)
    assert keep.tolist() == [2, 1] and hit.tolist() == [True, True]  # 2nd content token / the 4th overall
    # a run that ends exactly at the budget is not cut: candidates past `count` never count
    keep, hit = budget.cut(jnp.full((1, 5), 5), jnp.array([2]), jnp.array([budget.THINKING]), jnp.array([0]),
                           jnp.array([2]), jnp.array([False]), cfg)
    assert keep.tolist() == [2] and hit.tolist() == [False]
