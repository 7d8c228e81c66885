"""Measurement: forced rounds of ``generate``'s program (a tier forced for a number of rounds,
the stop tokens kept or not) and the one round-cost timer (:func:`fastest_rounds`), which
times ``generate``'s round costs for the adaptive policy and those of a ``Slots`` engine."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def forced_args(args: tuple, tier: int, rounds: int, keep_stops: bool = False) -> tuple:
    """``compile_generate``'s arguments for a measurement call: speculation tier ``tier``
    (an index into the request's tiers; a single tree is tier 0, vanilla decoding too) forced
    for ``rounds`` rounds, which stop tokens do not end (see ``run_rounds``) unless
    ``keep_stops``; ``tier`` -1: the call as ``generate`` makes it, but for at most
    ``rounds`` rounds."""
    *states, inputs = args
    return (*states, dataclasses.replace(inputs, force_tier=jnp.int32(tier), round_cap=jnp.int32(rounds),
                                         keep_stops=jnp.bool_(keep_stops)))


def timed_call(compiled, args) -> tuple[float, dict]:
    """``compiled(*args)``'s wall seconds (to its outputs' readiness) and outputs."""
    start = time.perf_counter()
    res = jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start, res


def forced_call(compiled, args, tier: int, rounds: int, keep_stops: bool = False, *,
                call: Callable = timed_call) -> tuple[float, int]:
    """One measurement call (:func:`forced_args`) of ``compile_generate``'s program: its wall
    seconds and the rounds it ran (``max_new_tokens``, and with ``keep_stops`` the stop
    tokens, may end it before ``rounds``); ``call``: the timer (:func:`timed_call`)."""
    seconds, res = call(compiled, forced_args(args, tier, rounds, keep_stops))
    return seconds, loop_rounds(res)


def loop_rounds(res: dict) -> int:
    """The rounds a call of the loop ran (those in which some row took part)."""
    return int((np.asarray(res["accept"]) != -1).any(0).sum())


def fastest_rounds(time_tier: Callable[[int], tuple[float, int]], n_tiers: int, repeats: int,
                   baseline: bool = False) -> tuple[float, ...]:
    """The round-cost timer: milliseconds per round of each of ``n_tiers`` tiers, from
    ``time_tier(tier) -> (seconds, rounds run)``, each tier's fastest of ``repeats`` passes
    that time every tier in turn (in an order that rotates), so that a slow spell of a shared
    machine falls on every tier alike.  ``baseline``: each pass first times ``time_tier(-1)``,
    a call without the rounds, whose fastest time every tier's is taken less (what a call
    costs besides its rounds cancels out)."""
    best, ran = {}, {}
    for r in range(repeats):
        order = ([-1] if baseline else []) + [(i + r) % n_tiers for i in range(n_tiers)]
        for tier in order:
            t, ran[tier] = time_tier(tier)
            best[tier] = min(best.get(tier, float("inf")), t)
    base = best.get(-1, 0.0)
    return tuple(1e3 * max(best[i] - base, 1e-6) / max(ran[i], 1) for i in range(n_tiers))


def stretch_caps(first, rounds: int, seconds_long: float, max_new: int) -> list[int]:
    """The rounds of each tier that make the same new tokens per row (``round_costs``'s
    stretch), from a first call of each: ``(rounds run, new tokens per row, seconds less the
    prefill)``.  The stretch is as many tokens as the tier slowest per token makes in
    ``seconds_long``, at least ``4 * rounds`` and at most ``max_new - 1``; each tier runs at
    least ``rounds`` rounds."""
    slowest = max(seconds / made for _, made, seconds in first)  # seconds per new token per row
    span = min(max(seconds_long / slowest, 4 * rounds), max(max_new - 1, 1))
    return [max(rounds, math.ceil(span * max(ran, 1) / made)) for ran, made, _ in first]


def round_costs(programs, compiled, args, n_tiers: int, rounds: int = 8, seconds_long: float = 0.4,
                repeats: int = 3, *, call: Callable = timed_call) -> tuple[float, ...]:
    """Milliseconds per round of each speculation tier, measured once per compiled program on
    the program itself and the call's own prompts, each tier forced over the same stretch of
    the answers: the rounds that make about the same new tokens per row, so that every tier
    is timed at the same live lengths (the rounds of a long chain read a longer prefix than
    those of a short one after the same number of rounds) and, where the answers end inside
    the stretch, with the rows finishing and a batch's phases shrinking (``phase_rows``) as
    in the call itself.  The stretch is as many tokens as the tier slowest per token makes
    in about ``seconds_long``, at least ``4 * rounds`` and at most ``max_new_tokens - 1``; a
    tier's cost is its call less a call stopped after the prefill, over the rounds it ran
    (what a call costs besides its rounds cancels out: the prefill, the launch, the output's
    transfer).  Stop tokens end the rows as in the call (so a tier's stretch ends where the
    answers end, if sooner), unless some tier's first ``rounds`` rounds would already end
    every row, some at a stop token (answers too short to time): then every tier is forced
    past them.  Each call is the fastest of ``repeats`` passes that time every tier in turn
    (:func:`fastest_rounds`).  Measured anew on each of the program's first
    ``programs.measurements`` calls (later calls reuse them: ``ProgramCache.round_ms``), each
    tier's cost the lower median of the measurements so far (of two, the faster): a first
    measurement that a busy spell slowed (or a baseline call it slowed made too fast) does not
    steer every later call of the program."""
    return programs.round_ms(compiled, lambda: measure_round_ms(compiled, args, n_tiers, rounds, seconds_long, repeats,
                                                                call=call))


def measure_round_ms(compiled, args, n_tiers: int, rounds: int = 8, seconds_long: float = 0.4, repeats: int = 3, *,
                     call: Callable = timed_call) -> tuple[float, ...]:
    """One measurement of :func:`round_costs`."""
    forced_call(compiled, args, 0, 0, call=call)  # the program's first run
    max_new = int(args[-1].round_cap)

    def first_pass(keep_stops: bool):
        base = forced_call(compiled, args, 0, 0, call=call)[0]
        out, short = [], False
        for tier in range(n_tiers):
            t, res = call(compiled, forced_args(args, tier, rounds, keep_stops))
            n_out = np.asarray(res["n_out"])
            ran = loop_rounds(res)
            # every row ended within the first rounds, some at a stop token (not max_new_tokens)
            short |= ran < rounds and bool((n_out < max_new).any())
            out.append((ran, max(float(n_out.mean()) - 1.0, 1.0), max(t - base, 1e-6)))  # new tokens per row
        return out, short

    keep_stops = True
    first, short = first_pass(keep_stops)
    if short:  # answers too short to time: every tier forced past its stops
        keep_stops = False
        first, _ = first_pass(keep_stops)
    cap = stretch_caps(first, rounds, seconds_long, max_new)
    return fastest_rounds(lambda tier: forced_call(compiled, args, max(tier, 0), 0 if tier < 0 else cap[tier],
                                                   keep_stops, call=call), n_tiers, repeats, baseline=True)
