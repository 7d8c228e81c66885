"""Compiled programs kept for reuse: one ``ProgramCache`` class (compiling on a miss, least
recently used eviction, the round costs measured on each program, whether it has run), an
object its user owns — ``generate``'s default one (``PROGRAMS``), a ``Slots`` engine's, a
test's."""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, Hashable

# The programs a cache keeps by default.  Each holds its executable (and its constants) in
# memory, so the number kept is bounded; one evicted is freed (``_loop.loop_jit``).
COMPILE_CACHE_SIZE = 16
ROUND_MS_MEASUREMENTS = 3  # a program's round costs are measured on its first calls, this many


class ProgramCache:
    """Programs by key, least recently used first, at most ``size`` of them (an evicted one
    is dropped with its measured round costs, and freed once nothing else holds it: JAX's
    caches do not, each loop being compiled by a jit of its own); ``measurements``: the calls
    of a program on which its round costs are measured (:meth:`round_ms`)."""

    def __init__(self, size: int = COMPILE_CACHE_SIZE, measurements: int = ROUND_MS_MEASUREMENTS):
        self.size = size
        self.measurements = measurements
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._round_ms: dict = {}  # id(program) → its measurements of the milliseconds per round of each tier
        self._ran: set = set()  # id(program) of the programs that have run

    def get(self, key: Hashable, build: Callable[[], object]):
        """The program of ``key``, built by ``build()`` on a miss (the most recently used now)."""
        if key in self._programs:
            self._programs.move_to_end(key)
        else:
            self._programs[key] = build()
            self._trim(self.size)
        return self._programs[key]

    def __len__(self) -> int:
        return len(self._programs)

    def keys(self) -> list:
        """The keys held, least recently used first."""
        return list(self._programs)

    def _trim(self, size: int):
        """Evicts the least recently used programs beyond ``size``."""
        while len(self._programs) > size:
            evicted = id(self._programs.popitem(last=False)[1])
            self._round_ms.pop(evicted, None)
            self._ran.discard(evicted)

    @contextlib.contextmanager
    def keep(self, programs: int):
        """Keeps at least ``programs`` programs while inside (then ``size`` again): for a benchmark
        that cycles through more programs than the cache holds, each of which would otherwise
        be compiled again whenever it comes round (an evicted program is freed)."""
        before = self.size
        self.size = max(before, int(programs))
        try:
            yield
        finally:
            self.size = before
            self._trim(before)

    def clear(self):
        """Drops every program (and its measured round costs), freeing their executables'
        memory once nothing else holds them (``jax.clear_caches`` does not reach these)."""
        self._programs.clear()
        self._round_ms.clear()
        self._ran.clear()

    def round_ms(self, program, measure: Callable[[], tuple]) -> tuple[float, ...]:
        """Milliseconds per round of each speculation tier of ``program``: ``measure()`` runs on
        its first ``measurements`` calls (later calls reuse them), each tier's cost the lower
        median of the measurements so far (of two, the faster)."""
        done = self._round_ms.setdefault(id(program), [])
        if len(done) < self.measurements:
            done.append(tuple(measure()))
        return tuple(sorted(m[i] for m in done)[(len(done) - 1) // 2] for i in range(len(done[0])))

    def measured(self, program) -> list[tuple]:
        """The round-cost measurements of ``program`` so far."""
        return list(self._round_ms.get(id(program), ()))

    def first_run(self, program) -> bool:
        """Whether ``program`` has not run yet (:meth:`ran` not called on it since it was built)."""
        return id(program) not in self._ran

    def ran(self, program):
        self._ran.add(id(program))


# ``generate``'s (and by default every ``Slots``') programs.
PROGRAMS = ProgramCache()


def keep_compiled(loops: int):
    """Keeps at least ``loops`` compiled loops of the default cache while inside (then
    ``COMPILE_CACHE_SIZE`` again): :meth:`ProgramCache.keep` of ``PROGRAMS``."""
    return PROGRAMS.keep(loops)


def clear_compiled():
    """Drops the compiled loops of the default cache (and their measured round costs):
    :meth:`ProgramCache.clear` of ``PROGRAMS``."""
    PROGRAMS.clear()
