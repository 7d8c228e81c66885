"""The cache of compiled programs (``eagle3_jax.decode._programs``): bounded, held longer
inside ``keep_compiled``, timed on the call's own program, and letting go of its kernels'
memory maps."""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import pytest

import eagle3_jax
from eagle3_jax import decode
from helpers import FIXTURES, golden_drafters

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



OK = [[1, 2, 3]]


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
