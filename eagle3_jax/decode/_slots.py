"""The slot engine, the device half of continuous batching: a fixed number of rows ("slots") of
batched caches, a request prefilled into a free slot between dispatches while the others keep
decoding.  Dispatches run the same rounds (``_loop.run_rounds``) as ``generate``; sampling
parameters, seeds, stop ids, limits and thinking budgets are per-row arrays, so one compiled
program serves them all."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import budget, limits, sharding
from eagle3_jax import speculation as policy
from eagle3_jax.decode._generate import placed, result_stats
from eagle3_jax.decode._loop import kernel_mesh, prefill_state, run_rounds
from eagle3_jax.decode._measure import fastest_rounds
from eagle3_jax.decode._programs import PROGRAMS, ProgramCache
from eagle3_jax.decode._request import (bucket, budget_rows, cache_layouts, prompt_rows, sampling_args,
                                        speculation_arg, stop_args, thinking_config)
from eagle3_jax.decode._state import NO_SPEC, Loop, State, first_rows, put_rows
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig
from eagle3_jax.verify import RowSampling, SamplingConfig


def _slots_empty(tgraph, tstate, dgraph, dstate, round_ms_T, learned, *, slots: int, max_len: int, stops: int,
                 loop: Loop) -> State:
    """Every slot free (done), caches of ``max_len`` slots per row."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    ones = jnp.ones((slots,), jnp.int32)
    rows = RowSampling.of(SamplingConfig(), slots)
    st = prefill_state(target, drafter, jnp.zeros((slots, 1), jnp.int32), ones, jax.random.split(jax.random.key(0), slots),
                       -ones, ones * budget.BEFORE, jnp.full((slots, stops), -1, jnp.int32), ones, rows, cache_len=1,
                       loop=loop)
    st = dataclasses.replace(st, tcache=target.init_cache(slots, max_len), done=jnp.ones((slots,), bool),
                             n_out=0 * ones, out=0 * st.out)
    if drafter is not None:
        dcache = dataclasses.replace(drafter.init_cache(slots, max_len), hidden=loop.hidden_sharding)
        st = dataclasses.replace(st, dcache=dcache, ctl=policy.init(loop.spec, round_ms_T, learned))
    return st


def _slot_insert(tgraph, tstate, dgraph, dstate, st: State, slot, prompt_1xT, length_1, seed, budget_1, phase_1,
                 stops_1xS, limit_1, temperature_1, top_p_1, top_k_1, *, loop: Loop) -> State:
    """Prefills one request into row ``slot`` (its first token emitted); its key is row 0's of
    ``generate`` with the same seed."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    key_1 = jax.random.fold_in(jax.random.key(seed), 0)[None]
    row = prefill_state(target, drafter, prompt_1xT, length_1, key_1, budget_1, phase_1, stops_1xS, limit_1,
                        RowSampling(temperature_1, top_p_1, top_k_1), cache_len=prompt_1xT.shape[1], loop=loop)
    return put_rows(st, row, slot)


def _slot_rounds(tgraph, tstate, dgraph, dstate, st: State, cap, force_tier, *, loop: Loop, rows: int) -> State:
    """Up to ``cap`` rounds of every active slot, all of them in the first ``rows`` rows: the
    rounds run on those rows only (their cost follows the requests, not the slots), which are
    then written back."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    with kernel_mesh(target, loop):
        if rows == st.done.shape[0]:
            return run_rounds(target, drafter, st, loop, force_tier, cap)
        sub = run_rounds(target, drafter, first_rows(st, rows), loop, force_tier, cap)
    return dataclasses.replace(put_rows(st, sub, 0), step=sub.step, ctl=sub.ctl)


def _slot_snapshot(st: State) -> dict:
    """What :meth:`Slots.poll` reads of a state, as arrays of their own (the state itself is
    donated to the next dispatch, so a poll that lags a dispatch behind reads these)."""
    out = {"out": st.out, "n_out": st.n_out, "done": st.done, "accept": st.accept}
    if st.round_tier is not None:
        out["round_tier"] = st.round_tier
    if st.think is not None:
        out.update(phase=st.think.phase, thinking=st.think.thinking, forced=st.think.forced,
                   round_thinking=st.think.round_thinking)
    return out


def _slot_release(st: State, slot) -> State:
    return dataclasses.replace(st, done=st.done.at[slot].set(True))


def _slot_reset(st: State, *, loop: Loop) -> State:
    """A fresh policy with the same round costs (inside a jit, so its arrays are of the kind
    the compiled dispatches take: an eagerly built one made them compile again)."""
    return dataclasses.replace(st, ctl=policy.init(loop.spec, st.ctl.round_ms, policy.fresh(loop.spec)))


_slots_empty_jit = jax.jit(_slots_empty, static_argnums=(0, 2), static_argnames=("slots", "max_len", "stops", "loop"))


def _slot_programs(programs: ProgramCache, tgraph, dgraph, tdef, ddef, loop: Loop):
    """The jitted insert and dispatch for one pair and loop, with the graphs bound rather than
    static arguments and the weights passed as flat lists (``tdef`` / ``ddef``: their tree
    structures): a dispatch then neither hashes a graph nor walks an ``nnx.State`` on the host.
    Kept in ``programs`` (an engine of the same pair and loop reuses them)."""
    def build():
        def states(tl, dl):
            return jax.tree.unflatten(tdef, tl), None if ddef is None else jax.tree.unflatten(ddef, dl)

        def insert(tl, dl, *a):
            ts, ds = states(tl, dl)
            st = _slot_insert(tgraph, ts, dgraph, ds, *a, loop=loop)
            return st, _slot_snapshot(st)

        def rounds(tl, dl, st, cap, tier, rows):
            ts, ds = states(tl, dl)
            st = _slot_rounds(tgraph, ts, dgraph, ds, st, cap, tier, loop=loop, rows=rows)
            return st, _slot_snapshot(st)

        return jax.jit(insert, donate_argnums=(2,)), jax.jit(rounds, donate_argnums=(2,), static_argnums=(5,))

    return programs.get(("slots", tgraph, dgraph, tdef, ddef, loop), build)


def lower_slots(target, drafter, *, num_slots: int, max_len: int, mesh, speculation=None, rules=None,
                max_stop_ids: int = 8, programs: ProgramCache | None = None) -> jax.stages.Lowered:
    """The server's dispatch (:meth:`Slots.run`: rounds of every slot) lowered for ``num_slots``
    slots of ``max_len`` positions, for ahead-of-time compilation, as :func:`lower_generate`
    (abstract models, any mesh: the weights placed by their declarations)."""
    spec = speculation_arg(target, drafter, TreeConfig() if speculation is None else speculation)
    spec = spec if drafter is not None else None
    mesh = sharding.auto_mesh(mesh)
    num_slots = limits.check("num_slots", num_slots, limits.POSITIVE)
    hidden = None if drafter is None else sharding.hidden_sharding(mesh, num_slots, drafter.config.hidden_size, rules,
                                                                     name="drafter hidden states")
    loop = Loop(limits.check("max_len", max_len, limits.MAX_LEN), None, spec, None,
                cache_layouts(target, drafter, num_slots, max_len, mesh, rules), hidden)
    (tgraph, tstate), (dgraph, dstate) = placed(target, drafter, mesh, rules)
    n_tiers = 1 if spec is None else len(spec.tiers)
    learned = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), policy.fresh(spec or NO_SPEC))
    stops = limits.check("max_stop_ids", max_stop_ids, limits.NON_NEGATIVE) + len(target.config.eos_token_ids)
    state = jax.eval_shape(functools.partial(_slots_empty, tgraph, dgraph=dgraph, slots=num_slots,
                                             max_len=max_len, stops=stops, loop=loop),
                           tstate, dstate=dstate, round_ms_T=jax.ShapeDtypeStruct((n_tiers,), jnp.float32),
                           learned=learned)
    _, rounds = _slot_programs(PROGRAMS if programs is None else programs, tgraph, dgraph, jax.tree.structure(tstate),
                               None if dstate is None else jax.tree.structure(dstate), loop)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return rounds.lower(jax.tree.leaves(tstate), [] if dstate is None else jax.tree.leaves(dstate), state, scalar,
                        scalar, num_slots)


_slot_release_jit = jax.jit(_slot_release, donate_argnums=(0,))


_slot_reset_jit = jax.jit(_slot_reset, static_argnames=("loop",), donate_argnums=(0,))


@dataclasses.dataclass
class SlotView:
    """One slot as of the last :meth:`Slots.poll`.

    ``active``: it holds a request that has not finished; ``tokens``: every token generated
    for that request so far (prompt excluded); ``finish_reason``: ``stop`` | ``length`` once
    ``done``, else ``None``; the thinking fields as in ``GenerateResult``; ``stats``: the
    request's round statistics as in ``GenerateResult.stats`` (no timing), with
    ``accepted_per_position``; ``ticket``: the request it shows (what :meth:`Slots.insert`
    returned; -1 for a free slot) — a lagging poll may show a slot's previous request.
    """

    active: bool
    tokens: list[int]
    done: bool
    finish_reason: str | None
    thinking_tokens: int
    answer_tokens: int
    thinking_status: str
    stats: dict
    ticket: int = -1


class Slots:
    """The device half of continuous batching: ``num_slots`` rows of batched caches of
    ``max_len`` positions, requests prefilled into free rows while the others keep decoding.

    Every dispatch (:meth:`run`) runs the rounds ``generate`` runs, on every active row at once
    (on the fewest leading rows that hold them, :meth:`dispatch_rows`);
    sampling parameters, seeds, stop ids, token limits and thinking budgets are per-row arrays,
    so one compiled program serves any mix of requests.  A greedy request gets exactly the
    tokens ``generate`` gives it alone; a sampled request's tokens depend only on its seed when
    the speculation is a fixed tier (the adaptive policy's tier per round depends on the batch).

    :meth:`insert`, :meth:`run` and :meth:`release` only dispatch device work; :meth:`poll` is
    the one host synchronisation.  ``poll(lag=1)`` reads the program (insert or dispatch) before
    the last one, so a driver can keep the device busy: dispatch round N+1, then read round N
    while it runs (or a new request's prefill while its first rounds run).  Not thread-safe:
    drive it from one thread.

    Args:
      target, drafter: the pair (``drafter=None``: vanilla decoding).
      num_slots: requests decoded at once; max_len: positions per slot (prompt, new tokens and
        the round's scratch), at most the target's ``max_position_embeddings``.
      speculation: ``None`` (``TreeConfig()``), a ``TreeConfig`` or a ``Speculation``; with the
        adaptive policy its round costs are measured on this engine at construction unless
        ``round_ms`` gives them.
      tokenizer, think_token_ids, end_thinking_ids, thinking_mode, thinking_grace: the thinking
        phase, as for ``generate``; max_stop_ids: the most extra stop ids a request may give.
      programs: the ``ProgramCache`` keeping the compiled insert and dispatch (default: the
        module's ``PROGRAMS``, shared with ``generate``).
    """

    def __init__(self, target, drafter, *, num_slots: int, max_len: int,
                 speculation: Speculation | TreeConfig | None = None, tokenizer=None, think_token_ids=None,
                 end_thinking_ids=None, thinking_mode: str = "hard", thinking_grace: int = 0, round_ms=None,
                 max_stop_ids: int = 8, programs: ProgramCache | None = None):
        self.num_slots = limits.check("num_slots", num_slots, limits.POSITIVE)
        self.max_len = limits.check("max_len", max_len,
                                    limits.MAX_LEN.below(target.config.max_position_embeddings + 1))
        vocab = target.config.vocab_size
        spec = speculation_arg(target, drafter, TreeConfig() if speculation is None else speculation)
        self.spec = spec if drafter is not None else None
        self.thinking = thinking_config(tokenizer, think_token_ids, end_thinking_ids, thinking_mode, thinking_grace,
                                        vocab)
        self.stop_ids = tuple(sorted(set(target.config.eos_token_ids)))
        self._max_stops = limits.check("max_stop_ids", max_stop_ids, limits.NON_NEGATIVE) + len(self.stop_ids)
        self._scratch = 1 if self.spec is None else spec.scratch
        if self.max_len < bucket(1) + self._scratch + 1:
            raise ValueError(f"max_len={self.max_len} leaves no room for a request: a prompt bucket of {bucket(1)}, the "
                             f"round's {self._scratch} scratch slot(s) and one new token need {bucket(1) + self._scratch + 1}")
        self._target, self._vocab, self._tokenizer = target, vocab, tokenizer
        self._graphs = nnx.split(target), nnx.split(drafter) if drafter is not None else (None, None)
        self._loop = Loop(self.max_len, None, self.spec, self.thinking)
        (tg, ts), (dg, ds) = self._graphs
        self._leaves = (jax.tree.leaves(ts), jax.tree.leaves(ds) if ds is not None else [])
        self.programs = PROGRAMS if programs is None else programs
        self._insert_fn, self._rounds_fn = _slot_programs(self.programs, tg, dg, jax.tree.structure(ts),
                                                          None if ds is None else jax.tree.structure(ds), self._loop)
        self._busy = [False] * self.num_slots
        self._stops = [set(self.stop_ids)] * self.num_slots
        self._prompt_phase = [budget.BEFORE] * self.num_slots
        self._tickets = [-1] * self.num_slots  # the request in each slot (insert's serial number)
        self._serial = itertools.count()
        self._snaps: collections.deque = collections.deque(maxlen=2)  # (snapshot, host meta) of the last programs
        learned = policy.fresh(self.spec or NO_SPEC)
        n_tiers = 1 if self.spec is None else len(self.spec.tiers)
        if round_ms is None and self.spec is not None and self.spec.policy == "adaptive":
            self._state = self._empty(jnp.ones((n_tiers,), jnp.float32), learned)
            round_ms = self.measure_round_ms()
        self.round_ms = None if round_ms is None else tuple(float(x) for x in round_ms)
        self._state = self._empty(jnp.asarray(self.round_ms or (1.0,) * n_tiers, jnp.float32), learned)

    def _empty(self, round_ms_T, learned) -> State:
        (tg, ts), (dg, ds) = self._graphs
        return _slots_empty_jit(tg, ts, dg, ds, round_ms_T, learned, slots=self.num_slots, max_len=self.max_len,
                                stops=self._max_stops, loop=self._loop)

    def measure_round_ms(self, rounds: int = 24, repeats: int = 3) -> list[float]:
        """Milliseconds per round of each speculation tier on this engine (one entry without
        one), every slot busy (a synthetic prompt; a forced tier ignores stop tokens): one
        dispatch of ``rounds`` rounds after the inserts, the fastest of ``repeats`` passes that
        time every tier in turn (``fastest_rounds``, the timer of ``generate``'s round costs).
        Call with no request running: it fills and frees every slot."""
        if any(self._busy):
            raise RuntimeError("measure_round_ms() fills every slot: call it with none busy (release them first)")
        n_tiers = 1 if self.spec is None else len(self.spec.tiers)
        prompt = list(range(1, min(16, self.max_len // 4) + 1))

        def time_tier(tier: int) -> tuple[float, int]:
            for s in range(self.num_slots):
                self.insert(s, prompt, max_new_tokens=self.max_new_tokens_for(len(prompt)))
            jax.block_until_ready(self._state)
            start = time.perf_counter()
            self._dispatch(rounds, tier)
            jax.block_until_ready(self._state)
            seconds = time.perf_counter() - start
            ran = int(np.asarray(self._state.step))
            self._snaps.clear()
            for s in range(self.num_slots):
                self.release(s)
            return seconds, ran

        return list(fastest_rounds(time_tier, n_tiers, repeats))

    def reset_policy(self):
        """Forgets what the adaptive policy learned (e.g. from warm-up requests); the round
        costs are kept.  Call between dispatches."""
        if self.spec is not None:
            self._state = _slot_reset_jit(self._state, loop=self._loop)

    @property
    def request_len(self) -> int:
        """The most tokens one request can hold, prompt and new tokens: ``max_len`` less the
        round's scratch slots."""
        return self.max_len - self._scratch

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt a slot takes, with room for one new token: at most
        ``request_len - 1``, and ``max_len`` rounded down to 32 (its prefill's bucket)."""
        return min(self.request_len - 1, self._top_bucket)

    def max_new_tokens_for(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens can get in a slot (<= 0: it does not fit)."""
        if bucket(prompt_len) > self.max_len:
            return 0
        return self.request_len - prompt_len

    def prompt_bucket(self, prompt_len: int) -> int:
        """The padded length a prompt of ``prompt_len`` tokens is prefilled at: a power of two
        (at least 32) when that fits in a slot, else ``max_len`` rounded down to a multiple of
        32 (a prompt that fits in no bucket gets no room: :meth:`max_new_tokens_for`).  There is
        one compiled prefill per bucket, so few exist and a server warms them all up
        (:meth:`warm_buckets`)."""
        b = bucket(1)
        while b < prompt_len:
            b *= 2
        return b if b <= self.max_len else self._top_bucket

    @property
    def _top_bucket(self) -> int:
        """The longest prefill: ``max_len`` rounded down to a multiple of 32."""
        return self.max_len // bucket(1) * bucket(1)

    def warm_buckets(self) -> list[int]:
        """The shortest prompt length of every bucket a request can use (those with room for
        a new token): prefilling one prompt of each length compiles every prefill."""
        out, n = [], 1
        while self.max_new_tokens_for(n) >= 1:
            out.append(n)
            b = self.prompt_bucket(n)
            if b >= self._top_bucket:
                break
            n = b + 1
        return out

    def insert(self, slot: int, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, stop_token_ids: Sequence[int] | None = None, thinking_budget=None) -> int:
        """Prefills a request into the free slot ``slot``; its first token is emitted.  Arguments
        as for ``generate`` (one prompt); ``TypeError`` / ``ValueError`` naming the argument.
        Returns the request's ticket (``SlotView.ticket`` of its views)."""
        slot = limits.check("slot", slot, limits.NON_NEGATIVE.below(self.num_slots))
        if self._busy[slot]:
            raise ValueError(f"slot {slot} holds a running request: release it first")
        (prompt,) = prompt_rows([prompt_ids] if not isinstance(prompt_ids, str) else prompt_ids, self._vocab,
                                self._tokenizer, row_name="prompt_ids")
        max_new_tokens = limits.check("max_new_tokens", max_new_tokens, limits.MAX_NEW_TOKENS)
        room = self.max_new_tokens_for(prompt.size)
        if max_new_tokens > room:
            raise ValueError(f"max_new_tokens: a prompt of {prompt.size} tokens leaves room for {max(room, 0)} new "
                             f"tokens in a slot of max_len={self.max_len}, got {max_new_tokens}")
        sampling = sampling_args(temperature, top_p, top_k, self._vocab)
        seed = limits.check("seed", seed, limits.SEED)
        stops = sorted(set(self.stop_ids) | set(stop_args(stop_token_ids, self._vocab)))
        if len(stops) > self._max_stops:
            raise ValueError(f"stop_token_ids: at most {self._max_stops - len(self.stop_ids)} stop ids per request, "
                             f"got {len(stops) - len(self.stop_ids)}")
        (budget_,) = budget_rows(thinking_budget, 1)
        if self.thinking is None and budget_ >= 0:
            raise ValueError("thinking_budget needs the think-open/close tokens: this engine has no thinking phase")
        phase = budget.initial_phase(prompt, self.thinking) if self.thinking else budget.BEFORE
        T = self.prompt_bucket(prompt.size)
        prompt_1xT = np.zeros((1, T), np.int32)
        prompt_1xT[0, : prompt.size] = prompt
        row = lambda v, dtype=np.int32: np.asarray([v], dtype)  # noqa: E731  (numpy: no eager device work)
        self._state, snap = self._insert_fn(
            *self._leaves, self._state, np.int32(slot), prompt_1xT, row(prompt.size), np.uint32(seed), row(budget_),
            row(phase), np.asarray([stops + [-1] * (self._max_stops - len(stops))], np.int32), row(max_new_tokens),
            row(sampling.temperature, np.float32), row(sampling.top_p, np.float32), row(sampling.top_k))
        self._busy[slot] = True
        self._stops[slot] = set(stops)
        self._prompt_phase[slot] = phase
        self._tickets[slot] = next(self._serial)
        self._snaps.append((snap, self._meta()))
        return self._tickets[slot]

    def run(self, rounds: int):
        """Dispatches up to ``rounds`` rounds of every active slot (returns at once)."""
        self._dispatch(limits.check("rounds", rounds, limits.POSITIVE), -1)

    def row_buckets(self) -> list[int]:
        """The row counts a dispatch runs on: powers of two below ``num_slots``, then ``num_slots``
        (one compiled dispatch each; a server warms them all up)."""
        out = [1]
        while out[-1] < self.num_slots:
            out.append(min(2 * out[-1], self.num_slots))
        return out

    def dispatch_rows(self) -> int:
        """The rows the next dispatch runs on: the smallest of :meth:`row_buckets` that holds
        every busy slot (a server fills the lowest free slot first, so a lone request's rounds
        cost one row's, not ``num_slots``')."""
        last = max((s for s, b in enumerate(self._busy) if b), default=0)
        return next(n for n in self.row_buckets() if n > last)

    def _dispatch(self, rounds: int, force_tier: int):
        self._state, snap = self._rounds_fn(*self._leaves, self._state, np.int32(rounds), np.int32(force_tier),
                                            self.dispatch_rows())
        self._snaps.append((snap, self._meta()))

    def _meta(self):
        """The host's view of the slots as of now (stored with a dispatch's snapshot)."""
        return tuple(self._busy), tuple(self._tickets), tuple(self._stops), tuple(self._prompt_phase)

    def release(self, slot: int):
        """Ends the request in ``slot`` now (e.g. its client went away); the slot is free."""
        slot = limits.check("slot", slot, limits.NON_NEGATIVE.below(self.num_slots))
        self._state = _slot_release_jit(self._state, np.int32(slot))
        self._busy[slot] = False

    def poll(self, lag: int = 0) -> list[SlotView]:
        """Waits for the dispatched work and returns one ``SlotView`` per slot; a slot whose
        request is seen finished here becomes free.

        ``lag=1`` reads the state as of the program before the last (a :meth:`run` or an
        :meth:`insert`; waiting only for that one; the state now when there is no such program),
        so the last dispatch keeps the device busy meanwhile: after ``insert`` then ``run``, it
        reads the new request's first token as soon as its prefill is done, while its rounds
        run.  Its views show the slots as they were then: a slot released or filled since shows
        its previous request (compare ``SlotView.ticket``)."""
        lag = limits.check("lag", lag, limits.NON_NEGATIVE.below(2))
        if lag and len(self._snaps) == 2:
            fetch, (busy, tickets, stops, prompt_phase) = self._snaps[0]
        else:
            fetch, (busy, tickets, stops, prompt_phase) = _slot_snapshot(self._state), self._meta()
        res = jax.device_get(fetch)
        views = []
        for s in range(self.num_slots):
            if not busy[s]:
                views.append(SlotView(False, [], True, None, 0, 0, "none", {}))
                continue
            tokens = res["out"][s, : res["n_out"][s]].tolist()
            done = bool(res["done"][s])
            row = {k: v[s: s + 1] for k, v in res.items() if k not in ("out", "done")}
            stats = result_stats(row, 0.0, self.spec)
            for k in ("seconds", "tokens_per_second", "new_tokens"):
                stats.pop(k)
            thinking, status = 0, "none"
            if self.thinking is not None:
                thinking = int(res["thinking"][s])
                status = budget.status(int(res["phase"][s]), bool(res["forced"][s]),
                                       thinking > 0 or prompt_phase[s] == budget.THINKING)
            finish = None
            if done:
                finish = "stop" if tokens and tokens[-1] in stops[s] else "length"
                if self._tickets[s] == tickets[s]:
                    self._busy[s] = False
            views.append(SlotView(not done, tokens, done, finish, thinking, len(tokens) - thinking, status, stats,
                                  tickets[s]))
        return views
