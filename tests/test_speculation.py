"""The speculative budget as tiers with an on-device policy: whatever tier each round runs,
the output is vanilla's (greedy tokens, sampled distribution); the policy follows its
estimates (deterministic with given round costs), honours warm-up and cooldown, and falls
back to no drafting when drafting does not pay."""

from __future__ import annotations

import re

import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import builtin
from eagle3_jax.decode import encode_chat
from eagle3_jax import speculation
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig
from helpers import FIXTURES, chi2_pvalue

TIERS = (None, TreeConfig.chain(4), TreeConfig(16, 4, 4))


@pytest.fixture(autouse=True)
def _no_learned_estimates():
    speculation.forget()  # each test sees its warm-up


@pytest.fixture(scope="module")
def pair():
    target, drafter, tok = builtin.load()
    prompts = [encode_chat(tok, [{"role": "user", "content": t["prompt"]}]) for t in builtin.eval_tasks()[:4]]
    return target, drafter, tok, prompts


def _after_warmup(res, spec):
    return res.stats["tier_per_round"][spec.warmup:]


def test_adaptive_is_lossless_with_budgets_and_ragged_batch(pair):
    """Measured round costs (the default), a ragged batch with mixed thinking budgets: every
    round's tier is compiled into the one loop and the tokens are vanilla's."""
    target, drafter, tok, prompts = pair
    kw = dict(max_new_tokens=96, tokenizer=tok, thinking_budget=[0, 5, None, 11])
    want = eagle3_jax.generate(target, None, prompts, **kw)
    spec = Speculation(TIERS, warmup=2, cooldown=3)
    got = eagle3_jax.generate(target, drafter, prompts, speculation=spec, **kw)
    assert got.tokens == want.tokens and got.thinking_status == want.thinking_status
    assert got.stats["tier_per_round"][:2] == ["chain4", "chain4"]  # warm-up on the longest chain
    assert sum(got.stats["tier_rounds"].values()) == len(got.stats["tier_per_round"])
    phases = got.stats["phases"]
    assert phases["thinking"]["proposed"] + phases["answer"]["proposed"] == got.stats["proposed"]


@pytest.mark.parametrize("round_ms,want", [((1.0, 1.0, 100.0), "chain4"), ((1.0, 100.0, 100.0), "none"),
                                           ((100.0, 100.0, 1.0), "16,4,4")])
def test_policy_follows_expected_tokens_per_ms(pair, round_ms, want):
    """With given costs the choice is deterministic: after the warm-up it settles on the tier
    with the most expected tokens per millisecond (chain4 commits ~4 tokens a round for 1 ms;
    nothing beats a plain step that costs 100× less)."""
    target, drafter, tok, prompts = pair
    spec = Speculation(TIERS, warmup=1, cooldown=1, probe=0)  # no tries of the longest chain (their own tests are below)
    # the math prompt: 96 new tokens of thinking, so that every tier runs a dozen rounds or more
    res = eagle3_jax.generate(target, drafter, prompts[1:2], max_new_tokens=96, speculation=spec, round_ms=round_ms)
    rest = _after_warmup(res, spec)
    assert len(rest) >= 12 and set(rest) == {want}, rest
    vanilla = eagle3_jax.generate(target, None, prompts[1:2], max_new_tokens=96)
    assert res.tokens == vanilla.tokens
    # acceptance per draft position counts only the rounds whose tier drafted that position:
    # position 5 is offered by (16,4,4) rounds, never by chain4's
    depth = {"none": 0, "chain4": 4, "16,4,4": 5}
    rounds = list(zip(res.stats["accept_lengths"][0], res.stats["tier_per_round"]))
    for i in range(1, 6):
        offered = sum(a >= i - 1 and depth[t] >= i for a, t in rounds)
        took = sum(a >= i for a, t in rounds)
        assert res.stats["offered_per_position"][i - 1] == offered
        assert res.stats["acceptance_rate"][i - 1] == pytest.approx(took / max(offered, 1))


def test_deeper_positions_keep_their_estimate_while_a_shorter_chain_runs():
    """Rounds of chain4 say nothing about draft positions 5 and 6: after a warm-up on chain6
    and many chain4 rounds, all accepted, chain6 is still expected to commit about two
    tokens more per round (its deeper positions neither fade to a prior of 1/2 nor fall
    below what the other positions show), so the policy moves to it when it is cheap enough."""
    import dataclasses

    import jax.numpy as jnp

    spec = Speculation((None, TreeConfig.chain(4), TreeConfig.chain(6)), warmup=2, cooldown=4)
    ctl = speculation.init(spec, (1.0, 1.35, 1.65))
    everyone = jnp.ones((1,), bool)
    for depth in (6, 6):  # the warm-up: the longest chain, every draft accepted
        assert int(ctl.tier) == 2
        ctl = speculation.update(ctl, spec, jnp.full((1,), depth), everyone)
    for _ in range(40):  # chain4 held (as a cooldown or a bound would), every draft accepted
        ctl = speculation.update(dataclasses.replace(ctl, tier=jnp.int32(1), since=jnp.int32(0)), spec,
                                 jnp.full((1,), 4), everyone)
    est = np.asarray(speculation.expected_tokens(ctl, spec))
    assert est[1] == pytest.approx(5.0, abs=0.1) and est[2] > est[1] + 1.5, est
    for _ in range(spec.cooldown):  # left to itself, it switches once the cooldown has passed
        ctl = speculation.update(ctl, spec, jnp.full((1,), 4), everyone)
    assert int(ctl.tier) == 2  # about 6.9 tokens in 1.65 ms beat 5 in 1.35 ms


def _policy_run(ctl, spec, rounds: int, accepted: tuple[int, ...]):
    """``rounds`` rounds of whatever tier the policy picks, row ``i`` accepting
    ``accepted[i]`` drafts (at most its tier's depth); returns the controller and the tiers run."""
    import jax.numpy as jnp

    ran = []
    for _ in range(rounds):
        t = spec.tiers[int(ctl.tier)]
        depth = 0 if t is None else t.path_len - 1
        ran.append(int(ctl.tier))
        ctl = speculation.update(ctl, spec, jnp.minimum(jnp.asarray(accepted), depth), jnp.ones((len(accepted),), bool))
    return ctl, ran


# a good drafter's rows: most accept every draft, a few stop early (about 0.95 at each position)
GOOD = (14,) * 14 + (12, 10, 8, 5, 3, 1)


def test_a_long_chain_judged_by_a_few_warm_up_rows_is_tried_again():
    """A server's warm-up often runs on its first request alone: one row, two rounds of the
    longest chain, here rejected once at draft position 8 and once at 12 (a good drafter's
    rare misses). Positions offered fewer than ``THIN`` times are taken at no less than the
    rate of all positions, so once chain6's rounds (8 rows, after the warm-up) have
    shown that rate, the policy tries chain14 instead of keeping chain6 for good (without the
    rule the two misses hold chain14 at 11.0 expected tokens, 0.58 tokens/ms against chain6's
    0.61, and nothing after the warm-up revisits positions 7-14). Then chain14 is judged on its
    own rounds: kept where it pays, dropped where its deep positions really fail, and then
    tried only after waits that double (the probe away from the longest chain; it guards
    against the optimism lasting)."""
    import jax.numpy as jnp

    spec = Speculation((None, TreeConfig.chain(6), TreeConfig.chain(14)), warmup=2, cooldown=4)
    warm = speculation.init(spec, (2.7, 10.7, 19.0))  # about a server's measured costs at 8 slots (ms)
    for accepted in (7, 11):  # the warm-up on chain14, one row
        assert int(warm.tier) == 2
        warm = speculation.update(warm, spec, jnp.full((1,), accepted), jnp.ones((1,), bool))
    ctl, ran = _policy_run(warm, spec, 60, GOOD)
    assert ran[-40:] == [2] * 40, ran  # tried, and kept: it pays
    ctl, ran = _policy_run(warm, spec, 300, (7,) * 20)
    runs = _runs(ran[spec.warmup:])
    assert runs[:2] == [(1, 2), (2, spec.cooldown)], runs  # the thin positions' try, dropped
    tries = runs[2:-1:2]
    assert [n for _, n in tries] == [16, 32, 64, 128] and {t for t, _ in tries} == {1}, runs
    assert all(r == (2, spec.cooldown) for r in runs[3:-1:2]), runs  # each try: one cooldown
    assert ran.count(2) <= 0.1 * len(ran), ran


def test_a_depth_one_row_never_reaches_is_tried_ever_more_rarely():
    """One row that always fails at draft position 9 (chain6 pays more): the tries of chain14
    thin out to waits that double, although each try ages what the position showed before
    (the count of rounds that drafted it is not aged, so it is not taken as thin again)."""
    spec = Speculation((None, TreeConfig.chain(6), TreeConfig.chain(14)), warmup=2, cooldown=4)
    ctl, ran = _policy_run(speculation.init(spec, (2.7, 10.7, 19.0)), spec, 400, (8,))
    runs = _runs(ran[spec.warmup:])
    assert [n for t, n in runs[-7:-1:2]] == [32, 64, 128] and {t for t, _ in runs[-7:-1:2]} == {1}, runs
    assert ran.count(2) <= 0.12 * len(ran), runs


def _runs(tiers):
    """``[(tier, rounds in a row), ...]``."""
    out = []
    for t in tiers:
        if out and out[-1][0] == t:
            out[-1] = (t, out[-1][1] + 1)
        else:
            out.append((t, 1))
    return out


def test_a_long_chain_left_in_a_poor_stretch_is_tried_again():
    """A good drafter on chain14, then a stretch where every row fails at draft position 9
    (chain6 pays more there), then good again. Chain6's rounds say nothing about positions
    7-14, whose low estimates are real evidence, not thin: without a try of chain14 after
    ``probe`` rounds away from it, chain6 would run for good. The try's rounds decide, since
    what a position showed before is aged by every round since it was last drafted."""
    spec = Speculation((None, TreeConfig.chain(6), TreeConfig.chain(14)), warmup=2, cooldown=4)
    ctl = speculation.init(spec, (2.7, 10.7, 19.0))
    ctl, ran = _policy_run(ctl, spec, 30, GOOD)
    assert ran[-20:] == [2] * 20, ran
    ctl, ran = _policy_run(ctl, spec, 30, (8,) * 20)
    assert ran[-10:].count(1) >= 6, ran  # left for chain6 (a try of chain14 may fall here)
    ctl, ran = _policy_run(ctl, spec, 100, GOOD)
    assert ran[-40:] == [2] * 40, ran  # back on chain14, and kept
    assert ran.index(2, ran.index(1)) <= 2 * spec.probe + spec.cooldown, ran  # within two tries


def test_a_rarely_reached_position_is_judged_after_a_few_rounds_of_its_chain():
    """One row, chain14's rounds accepting 6, 6, 6, 6, 7, 7, 8 and 9 drafts over and over
    (7.875 tokens a round): position 10 is offered in one round of eight, so its decayed
    offers stay under 2 for good. Thinness ends after ``THIN_ROUNDS`` rounds of the chain too,
    so positions 9-14 are then judged on what they showed (shrunk toward the rate of all
    positions as any estimate is), not held at that rate: chain14 is expected to commit about
    what it does, not 0.7 tokens more."""
    import dataclasses

    import jax.numpy as jnp

    spec = Speculation((None, TreeConfig.chain(6), TreeConfig.chain(14)), warmup=2, cooldown=4)
    ctl = speculation.init(spec, (1.0, 1.9, 2.3))
    pattern = (6, 6, 6, 6, 7, 7, 8, 9)
    for accepted in pattern * 6:  # chain14 held
        ctl = speculation.update(dataclasses.replace(ctl, tier=jnp.int32(2), since=jnp.int32(0)), spec,
                                 jnp.full((1,), accepted), jnp.ones((1,), bool))
    assert float(ctl.trials[9]) < 2.0 and float(ctl.drafts[9]) > speculation.THIN_ROUNDS, (ctl.trials, ctl.drafts)
    est = np.asarray(speculation.expected_tokens(ctl, spec))
    assert est[2] < 1 + np.mean(pattern) + 0.5, est  # 8.13 (thinness by offers alone: 8.82)


def test_min_tier_holds_in_the_loop(pair):
    """No tier below ``min_tier`` runs, however cheap: plain rounds at 0.001 ms would win."""
    target, drafter, tok, prompts = pair
    spec = Speculation(TIERS, warmup=1, cooldown=5, min_tier=1)
    res = eagle3_jax.generate(target, drafter, prompts[:2], max_new_tokens=96, speculation=spec,
                              round_ms=(0.001, 1.0, 1.2))
    rest = _after_warmup(res, spec)
    assert rest and "none" not in rest


def _tiers_chosen(cooldown: int, min_tier: int, rounds: int = 60) -> list[int]:
    """The policy's tier after each of ``rounds`` rounds over no drafting (0.001 ms), chain2
    (1 ms) and chain6 (1.6 ms), warm-up 1, whose drafts are all accepted in blocks of 8
    rounds and all rejected in the blocks between: a policy free to switch at every round
    leaves chain6 for one round late in each rejected block."""
    import jax.numpy as jnp

    tiers = (None, TreeConfig.chain(2), TreeConfig.chain(6))
    spec = Speculation(tiers, warmup=1, cooldown=cooldown, min_tier=min_tier)
    ctl = speculation.init(spec, (0.001, 1.0, 1.6))
    chosen = []
    for r in range(rounds):
        drafts = 0 if tiers[int(ctl.tier)] is None else tiers[int(ctl.tier)].path_len - 1
        accepted = drafts if (r // 8) % 2 == 0 else 0
        ctl = speculation.update(ctl, spec, jnp.full((1,), accepted), jnp.ones((1,), bool))
        chosen.append(int(ctl.tier))
    return chosen


def test_cooldown_spaces_the_switches():
    """After a switch the policy keeps its tier for ``cooldown`` rounds: the same rounds that
    make it switch back after one round with a cooldown of 1 keep each tier 5 rounds with 5;
    and ``min_tier`` keeps it off the plain rounds it would otherwise take at 0.001 ms."""
    def switches(chosen):
        return [i for i in range(1, len(chosen)) if chosen[i] != chosen[i - 1]]

    free = switches(_tiers_chosen(cooldown=1, min_tier=1))
    assert any(b - a < 5 for a, b in zip(free, free[1:])), free  # these rounds do pull it back at once
    held = _tiers_chosen(cooldown=5, min_tier=1)
    gaps = switches(held)
    assert len(gaps) >= 4 and all(b - a >= 5 for a, b in zip(gaps, gaps[1:])), held
    assert min(held) == 1  # never below min_tier
    assert 0 in _tiers_chosen(cooldown=5, min_tier=0)  # where no drafting is allowed, it wins


def test_poor_drafter_falls_back_to_no_drafting():
    """An untrained drafter (random weights, same shape): the measured costs make drafting a
    loss, so after the warm-up the loop runs plain rounds."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 1024, size=10).tolist() for _ in range(2)]
    spec = Speculation((None, TreeConfig.chain(4), TreeConfig(16, 4, 4)), warmup=2, cooldown=2)
    res = eagle3_jax.generate(target, drafter, prompts, max_new_tokens=64, speculation=spec,
                              round_ms=(1.0, 1.5, 2.5))  # a chain-4 round costs 1.5 plain rounds here
    rest = _after_warmup(res, spec)
    assert rest.count("none") >= 0.8 * len(rest), rest
    want = eagle3_jax.generate(target, None, prompts, max_new_tokens=64).tokens
    assert res.tokens == want
    # drafting is tried again after `probe` plain rounds, and each try that falls straight back
    # doubles the wait, up to `probe_max`: runs of 4, 8, 16, 16, ... plain rounds between tries,
    # also over short calls in a row (each shorter than the longest wait): a call goes on where
    # the last one stopped, it does not try drafting again at its start
    spec = Speculation((None, TreeConfig.chain(4), TreeConfig(16, 4, 4)), warmup=2, cooldown=2, probe=4, probe_max=16)
    want8 = eagle3_jax.generate(target, None, prompts, max_new_tokens=8).tokens
    rest = []
    for _ in range(10):
        res = eagle3_jax.generate(target, drafter, prompts, max_new_tokens=8, speculation=spec, round_ms=(1.0, 1.5, 2.5))
        rest += res.stats["tier_per_round"]
        assert res.tokens == want8
    rest = rest[spec.warmup:]
    runs = [len(r) for r in "".join("n" if t == "none" else "d" for t in rest).split("d") if r]
    tries = runs[:-1] if rest[-1] == "none" else runs  # the last run may end with the output, before its try
    assert len(tries) >= 4 and tries == [min(4 * 2 ** k, 16) for k in range(len(tries))], rest
    assert rest.count("none") >= 0.6 * len(rest), rest


def test_adaptive_sampling_matches_the_target_distribution(optimized):
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)
    prompt = np.load(FIXTURES / "eagenerate_greedy_trained.npz")["p0_prompt"].tolist()
    kw = dict(max_new_tokens=6, temperature=0.8, top_p=0.95)
    spec = Speculation((None, TreeConfig.chain(3), TreeConfig(16, 4, 4)), warmup=1, cooldown=1)
    base = np.array(eagle3_jax.generate(target, None, [prompt] * 2000, seed=2, **kw).tokens)
    res = eagle3_jax.generate(target, drafter, [prompt] * 2000, seed=1, speculation=spec,
                              round_ms=(1.0, 1.2, 1.5), **kw)
    got = np.array(res.tokens)
    assert len(set(res.stats["tier_per_round"])) >= 2
    for pos in (1, 3, 5):
        bins = np.unique(np.concatenate([got[:, pos], base[:, pos]]), return_counts=True)
        top = bins[0][np.argsort(-bins[1])[:12]]
        assert chi2_pvalue(got[:, pos], base[:, pos], top) > 1e-3, pos


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(tiers=()), ValueError, "at least one tier"),
    (dict(tiers=None), TypeError, "speculation.tiers must be a sequence of TreeConfig or None, got NoneType"),
    (dict(tiers=TreeConfig.chain(2)), TypeError, "got TreeConfig (one tier: Speculation.fixed(tier))"),
    (dict(tiers=((5, 3, 1),)), TypeError, "tiers[0]"),
    # a second no-drafting tier was never run by the loop (it ran the first's), which then hung
    (dict(tiers=(None, TreeConfig.chain(2), None), min_tier=2), ValueError, "tiers[2] repeats tiers[0] (no drafting)"),
    (dict(tiers=(TreeConfig.chain(4), TreeConfig(16, 4, 4), TreeConfig.chain(4))), ValueError,
     "tiers[2] repeats tiers[0] (chain4)"),
    (dict(tiers=(None,), policy="greedy"), ValueError, "policy"),
    (dict(tiers=(None,), cooldown=0), ValueError, "cooldown"),
    (dict(tiers=(None, TreeConfig.chain(2)), min_tier=2), ValueError, "min_tier"),
    (dict(tiers=(None, TreeConfig.chain(2)), min_tier=0.5), ValueError, "min_tier must be an integer"),
    (dict(tiers=(None, TreeConfig.chain(2)), max_tier=1.0), ValueError, "max_tier must be an integer"),
])
def test_bad_speculation(kwargs, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        Speculation(**kwargs)


def test_speculation_takes_numpy_integers_as_ints():
    spec = Speculation((None, TreeConfig.chain(2)), warmup=np.int64(1), cooldown=np.int32(3), min_tier=np.int64(0),
                       max_tier=np.int64(1), probe=np.int64(4), probe_max=np.int64(8))
    assert spec == Speculation((None, TreeConfig.chain(2)), warmup=1, cooldown=3, min_tier=0, max_tier=1, probe=4,
                               probe_max=8)
    assert all(type(getattr(spec, f)) is int for f in ("warmup", "cooldown", "min_tier", "max_tier", "probe", "probe_max"))


def test_bad_round_ms_and_speculation_type(pair):
    target, drafter, _, prompts = pair
    for round_ms in ((1.0, -1.0, 2.0), "fast", (1.0, None, 2.0), {"chain4": 1.0}):
        with pytest.raises(ValueError, match="round_ms: need one positive time per tier"):
            eagle3_jax.generate(target, drafter, prompts[:1], max_new_tokens=4, speculation=Speculation(TIERS),
                                round_ms=round_ms)
    with pytest.raises(TypeError, match="speculation"):
        eagle3_jax.generate(target, drafter, prompts[:1], max_new_tokens=4, speculation="adaptive")


def test_learned_estimates_carry_over_to_the_next_call(pair):
    """A second call with the same models and tiers starts from what the first learned: no
    second warm-up (and the same tokens)."""
    target, drafter, _, prompts = pair
    spec = Speculation(TIERS, warmup=3, cooldown=2)
    first = eagle3_jax.generate(target, drafter, prompts[:1], max_new_tokens=64, speculation=spec,
                                round_ms=(1.0, 1.0, 100.0))
    assert first.stats["tier_per_round"][:3] == ["chain4"] * 3
    second = eagle3_jax.generate(target, drafter, prompts[1:2], max_new_tokens=64, speculation=spec,
                                 round_ms=(1.0, 100.0, 1.0))  # now trees are cheap: switched at once
    assert second.stats["tier_per_round"][0] == "16,4,4"
    speculation.forget()
    third = eagle3_jax.generate(target, drafter, prompts[1:2], max_new_tokens=64, speculation=spec,
                                round_ms=(1.0, 100.0, 1.0))
    assert third.stats["tier_per_round"][:3] == ["chain4"] * 3 and third.tokens == second.tokens


def test_round_costs_are_measured_past_the_answers_end(pair):
    """A tier can be forced past the answer's end (``cost.forced_rounds``, and ``generate``'s
    round costs when the answers are too short to time): the answer's stop token does not
    cut the forced rounds short, while the call itself still stops there."""
    target, drafter, _, prompts = pair
    spec = Speculation(TIERS, warmup=1, cooldown=1)
    compiled, args = eagle3_jax.decode.compile_generate(target, drafter, prompts[:1], max_new_tokens=96,
                                                        speculation=spec, round_ms=(1.0, 1.0, 100.0))
    res = compiled(*args)
    n, rounds = int(res["n_out"][0]), int((np.asarray(res["accept"])[0] != -1).sum())
    assert n < 50  # the answer ends by itself, well before the limit
    for tier, t in enumerate(TIERS):
        cap = n + 8 if t is None else rounds + 8  # a plain round commits one token, a drafting one >= 1
        forced = compiled(*eagle3_jax.decode.forced_args(args, tier, cap))
        ran = np.asarray(forced["accept"])[0] != -1
        assert ran.sum() == cap and (np.asarray(forced["round_tier"])[0][ran] == tier).all()
        assert n < int(forced["n_out"][0]) < 96


def test_a_forced_tier_can_keep_the_stops_and_then_ends_where_the_call_ends(pair):
    """The round-cost measurement times each tier over the call's own answers: forced with
    ``keep_stops`` a tier ends each row at its stop token, with the call's tokens."""
    target, drafter, _, prompts = pair
    spec = Speculation(TIERS, warmup=1, cooldown=1)
    compiled, args = eagle3_jax.decode.compile_generate(target, drafter, prompts[:2], max_new_tokens=256,
                                                        speculation=spec, round_ms=(1.0, 1.0, 100.0))
    res = compiled(*args)
    n = np.asarray(res["n_out"])
    assert (n < 256).all()  # both answers end by themselves
    for tier in range(len(TIERS)):
        forced = compiled(*eagle3_jax.decode.forced_args(args, tier, 256, keep_stops=True))
        ran = np.asarray(forced["accept"]) != -1
        assert (np.asarray(forced["round_tier"])[ran] == tier).all()
        np.testing.assert_array_equal(np.asarray(forced["n_out"]), n)
        for b in range(2):
            assert np.asarray(forced["out"])[b, : n[b]].tolist() == np.asarray(res["out"])[b, : n[b]].tolist()


def test_round_costs_are_timed_over_the_same_tokens_for_every_tier():
    """Each tier is forced for the rounds that make the same new tokens per row (so a long
    chain is not timed deeper into the answer than a short one), as many as the slowest tier
    per token makes in about ``seconds_long``, within ``[4 * rounds, max_new - 1]`` tokens."""
    caps = eagle3_jax.decode.stretch_caps
    # (rounds run, new tokens per row, seconds): plain steps, a chain of 4, a chain of 14
    first = [(8, 8.0, 0.030), (8, 36.0, 0.075), (8, 78.0, 0.170)]
    got = caps(first, rounds=8, seconds_long=0.4, max_new=256)
    span = 0.4 / (0.030 / 8.0)  # the plain tier is the slowest per token
    for (ran, made, _), cap in zip(first, got):
        assert span <= cap * made / ran < span + made / ran  # the fewest rounds that cover the span
    assert got[0] > got[1] > got[2] == 11
    assert caps(first, rounds=8, seconds_long=0.4, max_new=40) == [39, 9, 8]  # at most max_new - 1 tokens, 8 rounds
    assert caps(first, rounds=8, seconds_long=0.001, max_new=256)[0] == 32  # at least 4 * rounds tokens


def _stand_in_args(max_new):
    """``compile_generate``'s arguments for a stand-in program: no states, inputs that only
    say ``max_new_tokens`` (the round cap of an unforced call)."""
    import jax.numpy as jnp

    return (None, None, eagle3_jax.decode.LoopInputs(*(None,) * 6, jnp.int32(-1), max_new, jnp.bool_(False), None))


@pytest.mark.parametrize("answer, max_new, keeps", [(120, 256, True), (30, 256, False), (120, 40, True)])
def test_round_ms_times_every_tier_over_the_same_tokens(answer, max_new, keeps):
    """``generate``'s round costs (a stand-in program: a prefill of 5 ms, rounds of 2, 5 and
    9 ms making 1, 4 and 10 tokens per row, answers of ``answer`` tokens): every tier is timed
    over the same new tokens, with the stop tokens kept; past them when some tier's first 8
    rounds end every row at a stop (answers too short to time), not when ``max_new_tokens``
    does; a round costs the call less the prefill-only call, over its rounds."""
    import math

    import jax.numpy as jnp

    decode = eagle3_jax.decode
    costs, per_round, calls = (2.0, 5.0, 9.0), (1, 4, 10), []

    def program(compiled, args):
        inputs = args[-1]
        tier, cap, keep = int(inputs.force_tier), int(inputs.round_cap), bool(inputs.keep_stops)
        limit = min(answer, max_new - 1) if keep else max_new - 1  # new tokens a row can make
        ran = min(cap, math.ceil(limit / per_round[tier]))
        made = min(ran * per_round[tier], limit)
        calls.append((tier, cap, keep, made))
        accept = np.full((2, 512), -1)
        accept[:, :ran] = per_round[tier] - 1
        return 0.005 + 1e-3 * costs[tier] * ran, {"n_out": np.full((2,), 1 + made), "accept": accept}

    args = _stand_in_args(jnp.int32(max_new))
    assert decode.round_costs(decode.ProgramCache(), object(), args, 3, call=program) == pytest.approx(costs)
    timed = [c for c in calls[-4:] if c[1] > 0]  # the last pass: the prefill alone, then each tier
    assert len(timed) == 3 and {keep for _, _, keep, _ in timed} == {keeps}, timed
    made = [m for *_, m in timed]
    assert max(made) - min(made) < max(per_round), timed  # the same tokens, to within a round


def test_a_slow_first_round_cost_measurement_does_not_pin_later_calls():
    """``generate``'s round costs for the adaptive policy are measured again on a program's
    first ``ROUND_MS_MEASUREMENTS`` calls, each tier the lower median so far: a first
    measurement that a busy spell slowed (here the chain's rounds 4.5× their cost, as once
    measured while another row ran) steers the first call only, not every later call of the
    program, and a measurement too fast (a cost of nothing) steers none."""
    import math

    import jax.numpy as jnp

    decode = eagle3_jax.decode
    costs, per_round, slow = (2.0, 5.0, 9.0), (1, 4, 10), [4.5]

    def program(compiled, args):  # a prefill of 5 ms, then rounds of each tier's cost (× slow[0] for tier 1)
        tier, cap = int(args[-1].force_tier), int(args[-1].round_cap)
        ran = min(cap, math.ceil(200 / per_round[tier]))
        accept = np.full((2, 512), -1)
        accept[:, :ran] = per_round[tier] - 1
        ms = costs[tier] * (slow[0] if tier == 1 else 1.0)
        return 0.005 + 1e-3 * ms * ran, {"n_out": np.full((2,), 1 + ran * per_round[tier]), "accept": accept}

    args = _stand_in_args(jnp.int32(256))
    compiled, programs = object(), decode.ProgramCache()  # one program, called again and again

    def round_costs():
        return decode.round_costs(programs, compiled, args, 3, call=program)

    assert round_costs() == pytest.approx((2.0, 22.5, 9.0))  # the busy first call
    slow[0] = 1.0
    assert round_costs() == pytest.approx(costs)  # measured again: the spell is gone
    slow[0] = 0.0
    assert round_costs() == pytest.approx(costs)  # the median of 22.5, 5 and 0 ms
    slow[0] = 4.5
    for _ in range(2):  # measured on the first 3 calls only
        assert round_costs() == pytest.approx(costs)
    assert len(programs.measured(compiled)) == programs.measurements == decode.ROUND_MS_MEASUREMENTS == 3
