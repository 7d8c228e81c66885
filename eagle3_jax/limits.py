"""One table of the ranges the API, the CLI, the server and the configs check numbers against,
and one checker: :func:`check` returns a value as its kind or raises ``TypeError`` (wrong kind)
or ``ValueError`` (out of range, or a float not finite) worded ``name=value: problem``
(``max_new_tokens=0: must be >= 1``, ``fit.lr=-1.0: must be > 0``); :func:`problem` is the
reason alone, for callers that word the name themselves (an argparse type, a config key with
its origin).

A ``Range`` is a kind — ``int``, ``float`` (finite), ``bool``, ``str`` or ``tuple`` (of ints, the
bounds applying to each item) — with optional bounds (``lo`` included unless ``lo_inclusive`` is
false, ``hi`` excluded unless ``hi_inclusive``) or a tuple of ``choices``.  Integers are Python or
numpy integers or 0-d arrays of one, never a bool; an int is a float too (:func:`integer` and
:func:`host_scalar` read such arguments as Python's).

The table: generate's and the server's arguments, the CLI's flags, a draft tree's fields
(``TREE``), the speculative policy's (``SPECULATION``) and the sizes a ``config.json`` may give
(``VOCAB_SIZE`` … ``POSITIONS``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def host_scalar(value):
    """A 0-d numpy or JAX array as its numpy scalar (``np.array(5)``, ``jnp.int32(5)`` and
    ``np.int32(5)`` read alike); anything else as it is."""
    if isinstance(value, np.generic) or not hasattr(value, "__array__"):
        return value  # numpy scalars (a prompt's ids, often) and plain Python values: no conversion
    return np.asarray(value)[()] if np.ndim(value) == 0 else value


def integer(value) -> int | None:
    """``value`` as an ``int`` when it is an integer argument (a Python or numpy integer, or a
    0-d array of one; not a bool), else ``None``."""
    value = host_scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


KIND_NAMES = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string",
              tuple: "a list of integers"}


@dataclasses.dataclass(frozen=True)
class Range:
    kind: type = int
    lo: int | float | None = None
    hi: int | float | None = None
    lo_inclusive: bool = True
    hi_inclusive: bool = False
    choices: tuple = ()

    def below(self, hi) -> Range:
        """This range with its upper bound ``hi`` (excluded): a bound known only at the call (a vocabulary)."""
        return dataclasses.replace(self, hi=hi, hi_inclusive=False)

    def at_most(self, hi) -> Range:
        """This range with its upper bound ``hi`` (included): a bound known only at the call."""
        return dataclasses.replace(self, hi=hi, hi_inclusive=True)

    def at_least(self, lo) -> Range:
        """This range with its lower bound ``lo`` (included): a bound known only at the call."""
        return dataclasses.replace(self, lo=lo, lo_inclusive=True)

    def pydantic(self) -> dict:
        """The bounds as pydantic ``Field`` keywords (``ge``/``gt``, ``le``/``lt``)."""
        out = {} if self.lo is None else {"ge" if self.lo_inclusive else "gt": self.lo}
        return out if self.hi is None else {**out, "le" if self.hi_inclusive else "lt": self.hi}


# the shared quantities: generate / the slot engine, the CLI's flags, the server and the configs
POSITIVE = Range(int, lo=1)  # counts: steps, batch sizes, repeats, slots
NON_NEGATIVE = Range(int, lo=0)  # counts that may be 0: grace tokens, warm-up steps, queue lengths
POSITIVE_FLOAT = Range(float, lo=0, lo_inclusive=False)  # rates, times, learning rates
NON_NEGATIVE_FLOAT = Range(float, lo=0)
MAX_NEW_TOKENS = POSITIVE
MAX_LEN = Range(int, lo=2)  # a KV cache's length: a prompt token and a new one at least
TOKEN_ID = NON_NEGATIVE  # below the vocabulary size
TEMPERATURE = NON_NEGATIVE_FLOAT  # 0 is greedy (generate refuses (0, MIN_TEMPERATURE) too)
# Below this, temperature sampling is numerically a greedy argmax with extra steps (and
# logits / temperature overflow float32 near 1e-38): pass 0 for greedy decoding.
MIN_TEMPERATURE = 1e-3
TOP_P = Range(float, lo=0, lo_inclusive=False, hi=1, hi_inclusive=True)
TOP_K = NON_NEGATIVE  # 0: no top-k (below the vocabulary size + 1 where it is known)
SEED = Range(int, lo=0, hi=2 ** 32)  # a sampling seed (uint32)
THINKING_BUDGET = Range(int, lo=0, hi=2 ** 31)  # tokens (int32 in the loop state)
THINKING_GRACE = NON_NEGATIVE
PORT = Range(int, lo=0, hi=2 ** 16)
DTYPE = Range(str, choices=("float32", "bfloat16", "float16"))

# a draft tree (``TreeConfig``): nodes with the root, expansions, beams (children per beam); a
# chain's drafted tokens
TREE = {"total_tokens": Range(int, lo=2), "depth": NON_NEGATIVE, "top_k": POSITIVE}
CHAIN_LENGTH = POSITIVE
# the speculative tiers' policy (``Speculation``): rounds and tier indices (``probe_max`` no
# less than ``probe``, ``max_tier`` below the number of tiers: bounds known at the call)
SPECULATION = {"probe": NON_NEGATIVE, "probe_max": NON_NEGATIVE, "warmup": NON_NEGATIVE, "cooldown": POSITIVE,
               "min_tier": NON_NEGATIVE, "max_tier": NON_NEGATIVE}

# config.json sizes (``eagle3_jax.config_json``), far above any released model, so that a corrupt
# or hostile config.json cannot make us allocate before the weights are checked; each bound included
VOCAB_SIZE = Range(int, lo=1, hi=1 << 24, hi_inclusive=True)
WIDTH = Range(int, lo=1, hi=1 << 20, hi_inclusive=True)  # hidden_size, intermediate_size, target_hidden_size
HEAD_DIM = Range(int, lo=2, hi=4096, hi_inclusive=True)
HEADS = Range(int, lo=1, hi=4096, hi_inclusive=True)
LAYERS = Range(int, lo=1, hi=4096, hi_inclusive=True)
POSITIONS = Range(int, lo=1, hi=(1 << 31) - 1, hi_inclusive=True)
DRAFTER_FAMILY = Range(str, choices=("llama", "qwen3"))  # a fresh drafter's decoder layers
MESH_DATA = Range(int, lo=-1)  # the data axis of a training mesh; -1: all the devices left (0 is refused)
FRACTION = Range(float, lo=0, hi=1)  # a share in [0, 1)


def _as_kind(value, kind):
    """``(value as kind, None)``, or ``(value, why not)``: ``expected an integer`` and the like."""
    if kind is tuple:
        items = tuple(value) if isinstance(value, (list, tuple)) else None
        if items is None or any(integer(v) is None for v in items):
            return value, f"expected {KIND_NAMES[tuple]}"
        return tuple(map(integer, items)), None
    if kind is int:
        n = integer(value)
        return (value, f"expected {KIND_NAMES[int]}") if n is None else (n, None)
    x = host_scalar(value)
    if kind is float:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
            return value, f"expected {KIND_NAMES[float]}"  # not finite: a ValueError (see _outside)
        return float(x), None
    if kind is bool:
        return (bool(x), None) if isinstance(x, (bool, np.bool_)) else (value, f"expected {KIND_NAMES[bool]}")
    return (value, None) if isinstance(value, kind) else (value, f"expected {KIND_NAMES[kind]}")


def _outside(value, rng: Range) -> str | None:
    """Why ``value`` (already of ``rng.kind``) is outside ``rng``, or None."""
    if rng.kind is float and not math.isfinite(value):
        return f"expected {KIND_NAMES[float]}"
    if rng.choices:
        return None if value in rng.choices else f"expected one of {', '.join(map(str, rng.choices))}"
    items = value if isinstance(value, tuple) else (value,)
    low = rng.lo is not None and any(v < rng.lo if rng.lo_inclusive else v <= rng.lo for v in items)
    high = rng.hi is not None and any(v > rng.hi if rng.hi_inclusive else v >= rng.hi for v in items)
    if not (low or high):
        return None
    bounds = ([] if rng.lo is None else [f"{'>=' if rng.lo_inclusive else '>'} {rng.lo}"]) + \
             ([] if rng.hi is None else [f"{'<=' if rng.hi_inclusive else '<'} {rng.hi}"])
    return f"must be {' and '.join(bounds)}" + (" (each item)" if isinstance(value, tuple) else "")


def problem(value, rng: Range) -> tuple[object, Exception | None]:
    """``(value as rng.kind, None)`` when it is in range, else ``(value, error)``: a ``TypeError``
    (``expected an integer``) or a ``ValueError`` (``must be >= 1``) saying why, naming nothing."""
    value, why = _as_kind(value, rng.kind)
    if why:
        return value, TypeError(why)
    why = _outside(value, rng)
    return value, (ValueError(why) if why else None)


def check(name: str, value, rng: Range):
    """``value`` as ``rng.kind`` (numpy and 0-d array scalars as Python's), or ``TypeError`` /
    ``ValueError`` ``f"{name}={value!r}: {why}"``."""
    value, error = problem(value, rng)
    if error:
        raise type(error)(f"{name}={value!r}: {error}")
    return value
