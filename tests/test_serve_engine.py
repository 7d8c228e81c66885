"""``eagle3_jax.serve.engine``, the slot engine's scheduler, over stand-ins for ``decode.Slots``:
an admission's rounds are dispatched before its first poll, ``--max-queue`` counts the requests
waiting beyond the free slots, and a deferred warm-up compiles on the engine thread while no
request runs."""

from __future__ import annotations

import asyncio
import time

import pytest

from eagle3_jax.decode import SlotView
from eagle3_jax.serve.engine import Engine, Params, QueueFull
from helpers import FakeSlots, builtin_tokenizer


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


class RecordingSlots:
    """A stand-in for ``decode.Slots`` (one slot, a request of ``n`` tokens, one per program):
    records the engine's calls; ``poll(lag=1)`` shows the program before the last, as Slots does."""

    num_slots, thinking = 1, None

    def __init__(self, eos: int, n: int = 3):
        self.stop_ids, self.n, self.calls, self.states, self.ticket = (eos,), n, [], [], -1

    def _program(self, tokens):
        done = len(tokens) >= self.n
        self.states.append(SlotView(not done, list(tokens), done, "length" if done else None, 0, len(tokens), "none", {},
                                    self.ticket))

    def insert(self, slot, prompt_ids, **kw):
        self.calls.append("insert")
        self.ticket += 1
        self._program([5])
        return self.ticket

    def run(self, rounds):
        self.calls.append(f"run({rounds})")
        last = self.states[-1]
        self._program((last.tokens + [5] * rounds)[: self.n])

    def poll(self, lag=0):
        self.calls.append(f"poll(lag={lag})")
        return [self.states[-2 if lag and len(self.states) > 1 else -1]]

    def release(self, slot):
        self.calls.append("release")


def test_engine_runs_an_admission_at_once_and_reads_its_first_token_from_the_prefill(tok):
    """After an admission the engine dispatches rounds before it polls, and that lagged poll
    shows the prefill's first token (the device never waits for the host between a prefill and
    its rounds); the rounds per dispatch then double up to ``rounds_per_dispatch``."""
    slots = RecordingSlots(tok.eos_token_id, n=40)
    engine = Engine(slots, tok, rounds_per_dispatch=8)

    async def go():
        engine.start()
        req = engine.submit([1, 2, 3], Params(max_new_tokens=40), split=False)
        kind, (_, first) = await asyncio.wait_for(req.events.get(), 30)
        while kind != "done":
            kind, _ = await asyncio.wait_for(req.events.get(), 30)
        engine.shutdown()
        return first, req.result

    first, result = asyncio.run(go())
    assert slots.calls[:5] == ["insert", "run(2)", "poll(lag=1)", "run(4)", "poll(lag=1)"]
    assert first == [5] and len(result.tokens) == 40  # the first delta: the prefill's token, read by the first poll
    assert "poll(lag=0)" not in slots.calls and slots.calls.count("run(8)") >= 2


@pytest.mark.parametrize("max_queue", [0, 2])
def test_max_queue_counts_requests_beyond_the_free_slots(tok, max_queue):
    """2 slots and ``max_queue`` waiting: exactly that many requests are taken, one more is
    refused; ``--max-queue 0`` takes a request into a free slot (never "refuse all")."""
    slots = FakeSlots.of(tok)
    slots.hold.set()
    engine = Engine(slots, tok, max_queue=max_queue).start()

    async def main():
        taken = [engine.submit([1, 2], Params(max_new_tokens=4), split=False) for _ in range(2 + max_queue)]
        with pytest.raises(QueueFull, match=f"--max-queue {max_queue}"):
            engine.submit([1, 2], Params(max_new_tokens=4), split=False)
        slots.hold.clear()
        for req in taken:  # every request taken is answered
            kind = None
            while kind != "done":
                kind, _ = await asyncio.wait_for(req.events.get(), 10)
        engine.submit([1, 2], Params(max_new_tokens=4), split=False)  # the slots are free again
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(main())


class BucketSlots(FakeSlots):
    """FakeSlots with prompt buckets of 8, 16 and 32 tokens."""

    def warm_buckets(self):
        return [8, 16, 32]

    def prompt_bucket(self, prompt_len: int) -> int:
        return next(b for b in self.warm_buckets() if prompt_len <= b)


def test_deferred_warm_up_leaves_the_larger_prompt_buckets_to_the_engine_thread(tok):
    """``warmup(defer=True)`` compiles the one-row dispatch and the smallest prefill before
    the engine serves; the other prefills and dispatches follow on the engine thread while it
    is idle, a prefill and a dispatch in turn, smallest first (every one counted of the total)."""
    slots = BucketSlots.of(tok, num_slots=8, max_len=64)
    seen = []
    engine = Engine(slots, tok, max_queue=4)
    engine.warmup([1, 2], progress=lambda done, total, what: seen.append((done, total, what)), defer=True)
    assert seen == [(1, 7, "dispatch of 1 rows"), (2, 7, "prefill of 8-token prompts")]
    assert engine.deferred == 5 and [len(p) for p, _ in slots.inserts][-1] == 8
    engine.start()
    try:
        for _ in range(400):
            if engine.deferred == 0 and len(seen) == 7:
                break
            time.sleep(0.01)
        assert seen[2:] == [(3, 7, "prefill of 16-token prompts"), (4, 7, "dispatch of 2 rows"),
                            (5, 7, "prefill of 32-token prompts"), (6, 7, "dispatch of 4 rows"),
                            (7, 7, "dispatch of 8 rows")]
    finally:
        engine.shutdown()


def test_deferred_warm_up_compiles_while_no_request_runs(tok):
    """``warmup(defer=True)`` compiles the one-row dispatch and the prefills at once, the
    dispatches of more rows on the engine thread while it is idle; the progress counts every
    program of the total."""
    slots = FakeSlots.of(tok, num_slots=8)
    seen = []
    engine = Engine(slots, tok, max_queue=4)
    engine.warmup([1, 2], progress=lambda done, total, what: seen.append((done, total, what)), defer=True)
    steps = engine.warmup_steps()
    assert [what for *_, what in seen] == ["dispatch of 1 rows", "prefill of 96-token prompts"]
    assert engine.deferred == 3 and [d for d, *_ in seen] == [1, 2] and {t for _, t, _ in seen} == {len(steps)}
    engine.start()
    try:
        for _ in range(200):
            if engine.deferred == 0 and len(seen) == len(steps):
                break
            time.sleep(0.01)
        assert seen[2:] == [(3, 5, "dispatch of 2 rows"), (4, 5, "dispatch of 4 rows"), (5, 5, "dispatch of 8 rows")]
    finally:
        engine.shutdown()
