"""The decode loop's state and its inputs: the carry of the rounds (``State``, ``Think``), what
a compiled loop is specialised on (``Loop``, ``LoopStatics``), the jitted entry's array inputs
(``LoopInputs``), and helpers over the rows of a state (gather, scatter, per-row keys)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax import budget, kv_cache
from eagle3_jax import speculation as policy
from eagle3_jax.speculation import Speculation
from eagle3_jax.verify import RowSampling, SamplingConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    """The loop's carry: caches, per-row outputs and round records, the policy's state."""

    tcache: kv_cache.KVCache
    dcache: kv_cache.KVCache | None
    root: jax.Array  # [B] next token to feed (emitted, not yet in the target cache)
    last_hidden: jax.Array | None  # [B, H] drafter output at the last committed position
    out: jax.Array  # [B, W] emitted tokens
    n_out: jax.Array  # [B]
    done: jax.Array  # [B]
    accept: jax.Array  # [B, W] accepted draft tokens per round of the row (-1 = no round, -2 = a forced round)
    rounds: jax.Array  # [B] rounds each row has run (its index into ``accept``)
    step: jax.Array  # scalar: rounds this loop has run
    key: jax.Array  # [B] one PRNG key per row
    stops: jax.Array  # [B, S] stop ids per row (-1 padded)
    limit: jax.Array  # [B] the most new tokens of each row (<= W)
    sampling: RowSampling | None = None  # per-row sampling (None: the loop's static one)
    think: "Think | None" = None
    ctl: "policy.Controller | None" = None  # the speculative-budget policy
    round_tier: jax.Array | None = None  # [B, W] the tier each round of a row ran


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Think:
    """The thinking budget's per-sequence state (see ``eagle3_jax.budget``)."""

    budget: jax.Array  # [B] thinking-content tokens allowed (-1 = unlimited)
    phase: jax.Array  # [B] BEFORE / THINKING / AFTER
    content: jax.Array  # [B] committed thinking-content tokens (what the budget counts)
    thinking: jax.Array  # [B] committed thinking tokens (reported)
    force: jax.Array  # [B] index in E of the next forced token to emit, -1 when not forcing
    forced: jax.Array  # [B] the budget forced the end of thinking
    round_thinking: jax.Array  # [B, W] the round's first committed token is thinking


@dataclasses.dataclass(frozen=True)
class Loop:
    """What a compiled loop is specialised on besides shapes.

    ``width``: output slots per row (the most new tokens, and rounds, of a row); ``sampling``:
    one static ``SamplingConfig`` for every row, or ``None`` for per-row arrays in the state
    (the slot engine); ``spec``: the speculation tiers (``None``: vanilla decoding)."""

    width: int
    sampling: SamplingConfig | None
    spec: Speculation | None
    thinking: budget.ThinkingConfig | None
    cache_shardings: tuple = (None, None)  # the target's and the drafter's cache layout on a mesh
    hidden_sharding: jax.sharding.NamedSharding | None = None  # the drafter's activations' (sharding.hidden_sharding)

    @property
    def row_shards(self) -> int:
        """The devices the batch is split over (each holding a block of consecutive rows)."""
        return kv_cache.row_shards(self.cache_shardings[0])

    @property
    def burst(self) -> int:
        """Target steps per ``None``-tier burst: the policy's cooldown, within the scratch slots
        the drafter's catch-up writes past the prefix."""
        return min(self.spec.cooldown, self.spec.scratch)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopInputs:
    """The jitted loop's array inputs (``compile_generate``'s ``args[-1]``)."""

    prompt_BxT: jax.Array  # the prompts, padded to their bucket
    lengths_B: jax.Array
    key: jax.Array  # the seed's key; row b's is ``fold_in(key, b)``
    budget_B: jax.Array  # thinking-content tokens allowed per row (-1 = unlimited)
    phase_B: jax.Array  # the thinking phase after each prompt
    round_ms_T: jax.Array  # milliseconds per round of each speculation tier (the adaptive policy's)
    force_tier: jax.Array  # scalar: a tier forced for a measurement (-1: the policy's)
    round_cap: jax.Array  # scalar: the most rounds the loop runs
    keep_stops: jax.Array  # scalar bool: stop tokens end rows in a forced tier too
    learned: dict  # what the policy learned on earlier calls (``speculation.fresh``)


@dataclasses.dataclass(frozen=True)
class LoopStatics:
    """What ``generate``'s compiled loop is keyed on besides the models and shapes: the cache
    length, the most new tokens, the stop ids, the sampling, the speculation tiers, the
    thinking setup, the caches' layout on a mesh and the rows of each phase."""

    max_len: int
    max_new: int
    stop_ids: tuple[int, ...]
    sampling: SamplingConfig
    spec: Speculation | None
    thinking: budget.ThinkingConfig | None
    cache_shardings: tuple = (None, None)
    phases: tuple[int, ...] = ()
    hidden_sharding: jax.sharding.NamedSharding | None = None

    def loop(self, spec: Speculation | None) -> Loop:
        """The rounds' ``Loop`` (``spec``: ``None`` for vanilla decoding)."""
        return Loop(self.max_new, self.sampling, spec, self.thinking, self.cache_shardings, self.hidden_sharding)


NO_SPEC = Speculation((None,), policy="fixed")


def sampling_of(st: State, loop: Loop):
    return loop.sampling if loop.sampling is not None else st.sampling


def split_keys(key_B):
    """Per-row key splits: ``(next keys, keys to use now)``."""
    ks = jax.vmap(jax.random.split)(key_B)
    return ks[:, 0], ks[:, 1]


def stop_rows(stop_ids: tuple[int, ...], batch: int):
    return jnp.broadcast_to(jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32), (batch, max(len(stop_ids), 1)))


def row_axes(st: State) -> State:
    """The batch axis of every array of ``st``, in its shape (-1: shared by the rows, the loop
    counter and the policy's state)."""
    cache = lambda c: None if c is None else dataclasses.replace(c, k=1, v=1, lengths=0)  # noqa: E731  ([L, B, S, K, D])
    return dataclasses.replace(jax.tree.map(lambda _: 0, st), tcache=cache(st.tcache), dcache=cache(st.dcache),
                               step=-1, ctl=jax.tree.map(lambda _: -1, st.ctl))


def put_rows(st: State, rows: State, at) -> State:
    """``st`` with rows ``[at, at + n)`` replaced by the ``n``-row state ``rows`` (its caches may
    be shorter: the slots past the prompt are scratch); the loop counter and the policy's state
    are ``st``'s."""
    def put(big, small, axis):
        if axis < 0:
            return big
        start = [0] * big.ndim
        start[axis] = at
        return jax.lax.dynamic_update_slice(big, small if small.dtype == big.dtype else small.astype(big.dtype), start)

    rows = dataclasses.replace(rows, step=st.step, ctl=st.ctl)  # a prefilled row has no policy of its own
    return jax.tree.map(put, st, rows, row_axes(st))


def take_rows(st: State, idx, shards: int = 1) -> State:
    """Rows ``idx`` of ``st``, in that order (the loop counter and the policy's state whole).

    ``shards`` > 1: the rows are split over that many devices in equal blocks, and ``idx``
    takes as many rows from each block, in block order: each device gathers its own (a gather
    whose batch is the devices), not the whole batch's."""
    def take(x, axis):
        if axis < 0:
            return x
        if shards == 1:
            return jnp.take(x, idx, axis=axis)
        n = x.shape[axis] // shards
        own = idx.reshape(shards, -1) - n * jnp.arange(shards)[:, None]  # each block's own row numbers
        blocks = x.reshape(x.shape[:axis] + (shards, n) + x.shape[axis + 1:])
        own = own.reshape((1,) * axis + own.shape + (1,) * (x.ndim - axis - 1))
        return jnp.take_along_axis(blocks, own, axis=axis + 1).reshape(x.shape[:axis] + (-1,) + x.shape[axis + 1:])

    return jax.tree.map(take, st, row_axes(st))


def set_rows(st: State, rows: State, idx) -> State:
    """``st`` with rows ``idx`` replaced by those of ``rows`` (both without caches); the loop
    counter and the policy's state are ``rows``'."""
    def put(big, small, axis):
        return small if axis < 0 else big.at[(slice(None),) * axis + (idx,)].set(small)

    return jax.tree.map(put, st, rows, row_axes(st))


def first_rows(st: State, n: int) -> State:
    """Rows ``[0, n)`` of ``st`` (the loop counter and the policy's state whole)."""
    return jax.tree.map(lambda x, axis: x if axis < 0 else jax.lax.slice_in_dim(x, 0, n, axis=axis), st, row_axes(st))
