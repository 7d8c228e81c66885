"""Compiled loops are kept for reuse, and can be let go: XLA:CPU maps pages for every kernel
and unmaps them only with their executable, so a long-lived process (a notebook, this suite's
workers) that never lets go reaches the kernel's limit on memory maps and crashes inside a
compilation."""

import gc
from pathlib import Path

import jax
import pytest

import eagle3_jax
import eagle3_jax.decode
from helpers import FIXTURES

MAPS = Path("/proc/self/maps")


def _maps() -> int:
    return len(MAPS.read_text().splitlines())


@pytest.mark.skipif(not MAPS.exists(), reason="counts the memory maps of /proc/self/maps (Linux)")
def test_clear_compiled_unmaps_the_loops_kernels():
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=target)
    eagle3_jax.decode.clear_compiled()
    jax.clear_caches()
    gc.collect()
    before = _maps()
    first = eagle3_jax.generate(target, drafter, [[1, 2, 3]], max_new_tokens=8, tree=eagle3_jax.TreeConfig(8, 3, 3))
    grown = _maps() - before
    assert grown > 100  # the loop's kernels
    jax.clear_caches()
    gc.collect()
    assert _maps() - before > grown // 2  # the kept loop still holds them
    eagle3_jax.decode.clear_compiled()
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
    programs = eagle3_jax.decode.ProgramCache(1)
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
