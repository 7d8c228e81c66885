"""The slot engine (continuous batching): requests joining and leaving a running batch get
exactly the tokens ``generate`` gives them alone — greedy under mixed budgets, sampled by seed."""

from __future__ import annotations

import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import builtin
from eagle3_jax.decode import Slots, encode_chat
from eagle3_jax.tree import TreeConfig

MAX_NEW = 40


@pytest.fixture(scope="module")
def pair():
    target, drafter, tok = builtin.load()
    tasks = builtin.eval_tasks()[:6]
    prompts = [encode_chat(tok, [{"role": "user", "content": t["prompt"]}]) for t in tasks]
    return target, drafter, tok, prompts


def _drain(slots: Slots, queue: list, results: dict, rounds: int = 3, lag: int = 0):
    """Inserts ``queue`` entries (index, kwargs) into free slots between dispatches until
    every request finished; ``results[index]`` = its final view.  ``lag=1`` reads each
    dispatch's views while the next one runs (as the server does)."""
    where = {}
    while queue or where:
        free = [s for s in range(slots.num_slots) if s not in where]
        while queue and free:
            i, kw = queue.pop(0)
            s = free.pop(0)
            where[s] = i, slots.insert(s, **kw)
        slots.run(rounds)
        views = slots.poll(lag=lag)
        for s, (i, ticket) in list(where.items()):
            if views[s].ticket != ticket:  # a lagging view from before the request's admission
                assert lag
                continue
            if views[s].done:
                results[i] = views[s]
                del where[s]
    return results


@pytest.mark.parametrize("tree,lag", [(TreeConfig.chain(4), 0), (TreeConfig.chain(4), 1), (None, 0)],
                         ids=["chain4", "chain4-lag", "vanilla"])
def test_greedy_requests_joining_a_running_batch_equal_generate_alone(pair, tree, lag):
    """Six requests with different prompts, budgets and limits through three slots: each
    joins when a slot frees, and each gets generate's tokens, thinking counts and statuses —
    read in step with the dispatches, or a dispatch behind (``poll(lag=1)``)."""
    target, drafter, tok, prompts = pair
    drafter = drafter if tree is not None else None
    budgets = [0, 5, None, 11, None, 3]
    limits = [MAX_NEW, MAX_NEW, 17, MAX_NEW, MAX_NEW, MAX_NEW]
    slots = Slots(target, drafter, num_slots=3, max_len=192, speculation=tree, tokenizer=tok)
    queue = [(i, dict(prompt_ids=p, max_new_tokens=n, thinking_budget=b))
             for i, (p, n, b) in enumerate(zip(prompts, limits, budgets))]
    got = _drain(slots, queue, {}, lag=lag)
    for i, (p, n, b) in enumerate(zip(prompts, limits, budgets)):
        want = eagle3_jax.generate(target, drafter, [p], max_new_tokens=MAX_NEW, tokenizer=tok, thinking_budget=b,
                                   tree=tree or TreeConfig())  # one program for every limit: a shorter one is a prefix
        v = got[i]
        if n < len(want.tokens[0]):
            assert v.tokens == want.tokens[0][:n] and v.finish_reason == "length", i
            continue
        assert v.tokens == want.tokens[0], i
        assert (v.thinking_tokens, v.answer_tokens, v.thinking_status, v.finish_reason) == (
            want.thinking_tokens[0], want.answer_tokens[0], want.thinking_status[0], want.finish_reason[0]), i
        assert v.stats["committed"] == len(v.tokens)
        if tree is not None:
            assert v.stats["rounds"] == want.stats["rounds"] and v.stats["accepted"] == want.stats["accepted"]
            assert v.stats["accepted_per_position"][0] == sum(a >= 1 for a in v.stats["accept_lengths"][0])


def test_sampled_request_depends_on_its_seed_only(pair):
    """A sampled request gives generate's tokens for its seed, alone or beside other requests."""
    target, drafter, tok, prompts = pair
    tree = TreeConfig.chain(4)
    kw = dict(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, top_k=50, seed=7)
    want = eagle3_jax.generate(target, drafter, [prompts[1]], tree=tree, **kw).tokens[0]
    slots = Slots(target, drafter, num_slots=3, max_len=192, speculation=tree, tokenizer=tok)
    got = _drain(slots, [(0, dict(prompt_ids=prompts[1], **kw))], {})
    assert got[0].tokens == want
    others = [(1, dict(prompt_ids=prompts[0], max_new_tokens=MAX_NEW)),  # greedy
              (2, dict(prompt_ids=prompts[2], max_new_tokens=MAX_NEW, temperature=1.0, seed=3))]
    got = _drain(slots, others[:1] + [(0, dict(prompt_ids=prompts[1], **kw))] + others[1:], {})
    assert got[0].tokens == want
    assert got[1].tokens == eagle3_jax.generate(target, drafter, [prompts[0]], tree=tree,
                                                max_new_tokens=MAX_NEW).tokens[0]


def test_release_frees_a_slot_and_bad_inserts_are_refused(pair):
    target, drafter, tok, prompts = pair
    slots = Slots(target, None, num_slots=2, max_len=96, tokenizer=tok)
    slots.insert(0, prompts[0], max_new_tokens=50)
    with pytest.raises(ValueError, match="slot 0 holds a running request"):
        slots.insert(0, prompts[1], max_new_tokens=8)
    slots.run(2)
    assert slots.poll()[0].active
    slots.release(0)
    views = slots.poll()
    assert not views[0].active and not views[1].active
    slots.insert(0, prompts[1], max_new_tokens=8)  # free again
    with pytest.raises(ValueError, match="max_new_tokens: a prompt of"):
        slots.insert(1, prompts[1], max_new_tokens=96)
    with pytest.raises(ValueError, match=r"^slot=2: must be >= 0 and < 2$"):  # the argument and its range
        slots.insert(2, prompts[1], max_new_tokens=8)
    with pytest.raises(ValueError, match="temperature"):
        slots.insert(1, prompts[1], max_new_tokens=8, temperature=-1.0)
    with pytest.raises(TypeError, match="^prompt_ids: token ids must be integers"):  # the parameter's name
        slots.insert(1, [[7, 8, 9]], max_new_tokens=8)
    with pytest.raises(ValueError, match="max_len"):
        Slots(target, None, num_slots=1, max_len=10 ** 6)
    with pytest.raises(ValueError, match="max_len=40 leaves no room"):
        Slots(target, drafter, num_slots=1, max_len=40, speculation=TreeConfig(16, 4, 4))
    # what a slot holds: request_len tokens, a prompt of at most max_prompt_len (its bucket must fit)
    for max_len, tree in ((100, TreeConfig.chain(4)), (131, TreeConfig(16, 4, 4)), (100, None)):
        s = Slots(target, drafter if tree else None, num_slots=1, max_len=max_len, speculation=tree)
        assert s.request_len == max_len - (tree.scratch if tree else 1)
        assert s.max_prompt_len == min(s.request_len - 1, max_len // 32 * 32)
        assert s.max_new_tokens_for(s.max_prompt_len) >= 1 and s.max_new_tokens_for(s.max_prompt_len + 1) <= 0
        assert s.max_prompt_len + s.max_new_tokens_for(s.max_prompt_len) <= s.request_len
    slots.run(20)
    v = slots.poll()[0]
    assert v.done and v.finish_reason in ("stop", "length") and len(v.tokens) <= 8
    assert np.all(np.asarray(v.tokens) < target.config.vocab_size)


def test_prompt_buckets_and_warmup_compile_every_prefill(pair, caplog, monkeypatch):
    """A slot prefills at a power-of-two length (above the largest that fits: at max_len
    rounded down to 32), so the server's warm-up compiles every prefill a request can need:
    none compiles later, inserted beside a running request; a prompt padded to another length
    than generate's (80 tokens: 128 here, 96 there) still gets generate's tokens."""
    import jax

    from eagle3_jax.serve.engine import Engine

    target, drafter, tok, prompts = pair
    tree = TreeConfig.chain(4)
    slots = Slots(target, drafter, num_slots=2, max_len=192, speculation=tree, tokenizer=tok)
    assert [slots.prompt_bucket(n) for n in (1, 32, 33, 64, 65, 128, 129, 160, 170)] == [
        32, 32, 64, 64, 128, 128, 192, 192, 192]
    assert slots.warm_buckets() == [1, 33, 65, 129]
    Engine(slots, tok).warmup(prompts[0][:5])
    long_prompt = (prompts[2] * 4)[:80]
    assert len(long_prompt) == 80
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        slots.insert(0, prompts[4], max_new_tokens=MAX_NEW)  # keeps running while the others come and go
        for n in (1, 31, 40, 64, 100, 128, 150, 170):
            slots.run(2)
            slots.insert(1, (prompts[1] * 10)[:n], max_new_tokens=4)
            slots.run(2)
            assert slots.poll()[1].tokens
            slots.release(1)
        slots.insert(1, long_prompt, max_new_tokens=MAX_NEW)
        got = slots.poll()[1]
        while not got.done:
            slots.run(8)
            got = slots.poll()[1]
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiles, compiles
    want = eagle3_jax.generate(target, drafter, [long_prompt], max_new_tokens=MAX_NEW, tree=tree)
    assert got.tokens == want.tokens[0]
    with jax.log_compiles(True), caplog.at_level("WARNING"):  # the check above does see compilations
        jax.jit(lambda x: x + 1)(np.float32(len(got.tokens)))
    assert any("Compiling" in r.getMessage() for r in caplog.records)

    # The engine's rounds per dispatch: those that fit in dispatch_ms at the measured round cost.
    for s in (0, 1):
        slots.release(s)
    ms = slots.measure_round_ms(repeats=1)
    assert len(ms) == 1 and 0 < ms[0] < 1e3
    slots.insert(0, prompts[0], max_new_tokens=4)
    with pytest.raises(RuntimeError, match="none busy"):
        slots.measure_round_ms()
    slots.release(0)
    monkeypatch.setattr(slots, "measure_round_ms", lambda repeats=3: [4.0])
    for dispatch_ms, cap in ((100.0, 25), (1.0, 1), (1e6, 64), (None, 64)):
        engine = Engine(slots, tok, rounds_per_dispatch=64, dispatch_ms=dispatch_ms)
        assert engine.max_rounds == 64
        engine.warmup(prompts[0][:5], cycles=1)
        assert engine.max_rounds == cap, dispatch_ms


def test_lagging_poll_after_release_and_reinsert(pair):
    """``poll(lag=1)`` shows a slot as it was at the program before the last: a dispatch, or
    an insert (the new request's prefill and first token, read while its rounds run); a
    released request shows with its old ticket until a program after the release is read."""
    target, _, tok, prompts = pair
    slots = Slots(target, None, num_slots=1, max_len=128, tokenizer=tok)
    first = slots.insert(0, prompts[0], max_new_tokens=40)
    slots.run(2)
    slots.run(2)
    v = slots.poll(lag=1)[0]
    assert v.ticket == first and v.active and len(v.tokens) == 3  # the prefill's token and 2 rounds
    slots.run(2)
    slots.release(0)
    slots.run(1)  # nothing is active: a dispatch that does nothing
    v = slots.poll(lag=1)[0]
    assert v.ticket == first and v.active and len(v.tokens) == 7  # the dispatch before the release
    second = slots.insert(0, prompts[1], max_new_tokens=5)
    assert second != first
    slots.run(2)
    v = slots.poll(lag=1)[0]
    assert v.ticket == second and v.active and len(v.tokens) == 1  # the insert: its prefill's token
    slots.run(2)
    v = slots.poll(lag=1)[0]
    assert v.ticket == second and len(v.tokens) == 3
    slots.run(8)
    slots.run(1)
    v = slots.poll(lag=1)[0]
    assert v.ticket == second and v.done and len(v.tokens) <= 5
    slots.insert(0, prompts[2], max_new_tokens=4)  # seen done with its own ticket: the slot is free


def test_dispatch_runs_the_fewest_rows_that_hold_the_busy_slots(pair):
    """A dispatch runs on the leading rows that hold every busy slot (a power of two, at most
    the slots): a lone request in slot 0 costs one row's rounds, not the batch's.  Requests
    get generate's tokens whichever row count their rounds ran at."""
    target, drafter, tok, prompts = pair
    tree = TreeConfig.chain(4)
    slots = Slots(target, drafter, num_slots=5, max_len=192, speculation=tree, tokenizer=tok)
    assert slots.row_buckets() == [1, 2, 4, 5] and slots.dispatch_rows() == 1
    want = [eagle3_jax.generate(target, drafter, [p], max_new_tokens=MAX_NEW, tree=tree).tokens[0] for p in prompts[:3]]
    slots.insert(4, prompts[2], max_new_tokens=MAX_NEW)
    assert slots.dispatch_rows() == 5
    slots.run(2)  # all five rows
    v = slots.poll()[4]
    assert len(v.tokens) >= 3 and v.tokens == want[2][:len(v.tokens)]
    slots.insert(2, prompts[1], max_new_tokens=MAX_NEW)
    slots.insert(0, prompts[0], max_new_tokens=MAX_NEW)
    assert slots.dispatch_rows() == 5
    slots.release(4)
    assert slots.dispatch_rows() == 4
    slots.run(3)  # rows 0-3
    v = slots.poll()[2]
    assert len(v.tokens) >= 4 and v.tokens == want[1][:len(v.tokens)]
    slots.release(2)
    assert slots.dispatch_rows() == 1
    while not (v := slots.poll()[0]).done:
        slots.run(8)  # row 0 alone
    assert v.tokens == want[0]
