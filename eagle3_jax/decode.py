"""The jitted decode loop: prefill, then draft → verify → commit rounds inside one
``lax.while_loop`` (no host round-trip per round), for any batch size.

``drafter=None`` runs vanilla autoregressive decoding through the same loop and the
same stop logic; it is the baseline of every speedup figure.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import itertools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import budget, kv_cache, layers, sharding
from eagle3_jax import speculation as policy
from eagle3_jax.config import host_scalar, integer
from eagle3_jax.models.drafter import declare as declare_drafter
from eagle3_jax.models.target import check_token_ids
from eagle3_jax.models.target import declare as declare_target
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig, expand, forced_chain
from eagle3_jax.verify import RowSampling, SamplingConfig, sample, verify


@dataclasses.dataclass
class GenerateResult:
    """Generated tokens per sequence (stop token included, prompt excluded) and stats.

    ``stats``: ``rounds`` (per sequence), ``accept_lengths`` (accepted draft tokens per
    round, per sequence), ``tau`` (mean over rounds of accepted + 1), ``acceptance_rate``
    (per draft position i: P(position i accepted | positions < i accepted), over the rounds
    whose tier drafted position i), ``accepted_per_position`` / ``offered_per_position``
    (those rounds' counts),
    ``proposed`` / ``accepted`` / ``committed`` token counts, ``new_tokens``,
    ``forced_rounds``, ``seconds`` and ``tokens_per_second`` (wall clock, compilation
    excluded), ``first_token_seconds`` / ``warm_up_seconds`` when asked for; with a drafter,
    ``tier_per_round`` / ``tier_rounds`` (the speculation tier each round ran); with a
    thinking phase, ``phases`` holds the round statistics and committed tokens of the
    ``thinking`` and ``answer`` phases (they sum to the totals).

    Per sequence: ``thinking_tokens`` / ``answer_tokens`` (summing to its length),
    ``finish_reason`` (``stop`` | ``length``) and ``thinking_status`` (``none`` | ``closed``
    | ``budget_exhausted`` | ``incomplete``).
    """

    tokens: list[list[int]]
    stats: dict
    texts: list[str] | None = None
    thinking_tokens: list[int] = dataclasses.field(default_factory=list)
    answer_tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: list[str] = dataclasses.field(default_factory=list)
    thinking_status: list[str] = dataclasses.field(default_factory=list)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _State:
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
    think: "_Think | None" = None
    ctl: "policy.Controller | None" = None  # the speculative-budget policy
    round_tier: jax.Array | None = None  # [B, W] the tier each round of a row ran


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Think:
    """The thinking budget's per-sequence state (see ``eagle3_jax.budget``)."""

    budget: jax.Array  # [B] thinking-content tokens allowed (-1 = unlimited)
    phase: jax.Array  # [B] BEFORE / THINKING / AFTER
    content: jax.Array  # [B] committed thinking-content tokens (what the budget counts)
    thinking: jax.Array  # [B] committed thinking tokens (reported)
    force: jax.Array  # [B] index in E of the next forced token to emit, -1 when not forcing
    forced: jax.Array  # [B] the budget forced the end of thinking
    round_thinking: jax.Array  # [B, W] the round's first committed token is thinking


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What a compiled loop is specialised on besides shapes.

    ``width``: output slots per row (the most new tokens, and rounds, of a row); ``sampling``:
    one static ``SamplingConfig`` for every row, or ``None`` for per-row arrays in the state
    (the slot engine); ``spec``: the speculation tiers (``None``: vanilla decoding)."""

    width: int
    sampling: SamplingConfig | None
    spec: Speculation | None
    thinking: budget.ThinkingConfig | None
    cache_shardings: tuple = (None, None)  # the target's and the drafter's cache layout on a mesh

    @property
    def row_shards(self) -> int:
        """The devices the batch is split over (each holding a block of consecutive rows)."""
        return kv_cache.row_shards(self.cache_shardings[0])

    @property
    def burst(self) -> int:
        """Target steps per ``None``-tier burst: the policy's cooldown, within the scratch slots
        the drafter's catch-up writes past the prefix."""
        return min(self.spec.cooldown, self.spec.scratch)


def _sampling(st: _State, loop: _Loop):
    return loop.sampling if loop.sampling is not None else st.sampling


def _split(key_B):
    """Per-row key splits: ``(next keys, keys to use now)``."""
    ks = jax.vmap(jax.random.split)(key_B)
    return ks[:, 0], ks[:, 1]


def _emit(st: _State, new_BxP, count_B, loop: _Loop, round_B=None) -> _State:
    """Appends ``new[:, :count]`` to the output, truncating at a stop token or the row's limit,
    and counts the appended tokens' thinking phase (``round_B``: the round they belong to)."""
    P = new_BxP.shape[1]
    j = jnp.arange(P)[None]
    is_stop = (new_BxP[:, :, None] == st.stops[:, None, :]).any(-1) & (j < count_B[:, None])
    has_stop = is_stop.any(1)
    first_stop = jnp.where(has_stop, jnp.argmax(is_stop, 1) + 1, P)
    n = jnp.minimum(jnp.minimum(count_B, first_stop), st.limit - st.n_out)
    n = jnp.where(st.done, 0, n)
    W = st.out.shape[1]
    slots = jnp.where(j < n[:, None], st.n_out[:, None] + j, W)  # W = dropped
    out = layers.row_set(st.out, slots, new_BxP)
    n_out = st.n_out + n
    done = st.done | (has_stop & (first_stop <= n)) | (n_out >= st.limit)
    think = st.think
    if loop.thinking is not None:
        phase, content, count, first = budget.account(new_BxP, n, think.phase, think.content, think.thinking,
                                                      loop.thinking)
        think = dataclasses.replace(think, phase=phase, content=content, thinking=count)
        if round_B is not None:
            think = dataclasses.replace(think, round_thinking=layers.row_set(think.round_thinking, round_B,
                                                                             first & (n > 0)))
    return dataclasses.replace(st, out=out, n_out=n_out, done=done, think=think)


def _end_ids(thinking: budget.ThinkingConfig):
    return jnp.asarray(thinking.end_ids, jnp.int32)


def _budget_cut(think: _Think, cand_BxP, count_B, active_B, prev_B, thinking: budget.ThinkingConfig):
    """Applies the budget to a round's candidate tokens (``prev``: the token emitted before
    them): ``(keep_B, hit_B, token_B, force_B)`` — the candidates kept, whether the next one
    is replaced, the end-of-thinking token replacing it (``E[1]`` when the thought already
    ends with ``E[0]``, e.g. a newline) and the forcing index afterwards."""
    keep, hit = budget.cut(cand_BxP, count_B, think.phase, think.content, think.budget, think.force >= 0, thinking)
    hit = hit & active_B
    end = _end_ids(thinking)
    m = len(thinking.end_ids)
    last = jnp.where(keep > 0, jnp.take_along_axis(cand_BxP, jnp.maximum(keep - 1, 0)[:, None], 1)[:, 0], prev_B)
    skip = (last == end[0]) & (m > 1)
    first = jnp.where(skip, 1, 0)
    token = end[first]
    force = jnp.where(first + 1 < m, first + 1, -1)
    return keep, hit, token, jnp.where(hit, force, think.force)


def _prefill(target, drafter, prompt_BxT, lengths_B, key_B, budget_B, phase_B, stops_BxS, limit_B, rows, *,
             cache_len: int, loop: _Loop) -> _State:
    """Runs the prompts through the target (and the drafter) into fresh caches of
    ``cache_len`` slots and emits the first token of each row."""
    B, T = prompt_BxT.shape
    W, thinking = loop.width, loop.thinking
    think = None
    if thinking is not None:
        zeros = jnp.zeros((B,), jnp.int32)
        think = _Think(budget_B, phase_B, zeros, zeros, jnp.full((B,), -1, jnp.int32), jnp.zeros((B,), bool),
                       jnp.zeros((B, W), bool))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    tcache = kv_cache.constrain(target.init_cache(B, cache_len), loop.cache_shardings[0])
    # the head on each prompt's last token only: [B, T, V] logits would be the prefill's
    # largest buffer by far for a real vocabulary (32 prompts of 2k tokens, 128k ids: 34 GB)
    logits_BxV, feats, tcache = target(prompt_BxT, pos, cache=tcache, logits_at_B=lengths_B - 1)
    tcache = kv_cache.advance(tcache, lengths_B)
    key_B, sub = _split(key_B)
    first = sample(sub, logits_BxV, loop.sampling if loop.sampling is not None else rows)
    if thinking is not None:  # B = 0 on a prompt that opens thinking: the first token is already E[0]
        _, hit, token, force = _budget_cut(think, first[:, None], jnp.ones((B,), jnp.int32), jnp.ones((B,), bool),
                                           layers.row_get(prompt_BxT, lengths_B - 1), thinking)
        first = jnp.where(hit, token, first)
        think = dataclasses.replace(think, force=force, forced=hit)
    dcache = last_hidden = round_tier = None
    if drafter is not None:
        # drafter position j pairs the feature at j with token j+1 (the first token is the root)
        ids = jnp.where(jnp.arange(T)[None] == lengths_B[:, None] - 1, first[:, None], jnp.roll(prompt_BxT, -1, 1))
        dcache = kv_cache.constrain(drafter.init_cache(B, cache_len), loop.cache_shardings[1])
        dout, dcache = drafter(feats, ids, pos, cache=dcache)
        dcache = kv_cache.advance(dcache, lengths_B)
        last_hidden = layers.row_get(dout, lengths_B - 1)
        round_tier = jnp.zeros((B, W), jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    st = _State(tcache, dcache, first, last_hidden, jnp.zeros((B, W), jnp.int32), zeros, jnp.zeros((B,), bool),
                jnp.full((B, W), -1, jnp.int32), zeros, jnp.int32(0), key_B, stops_BxS, limit_B, rows, think,
                round_tier=round_tier)
    return _emit(st, first[:, None], jnp.ones((B,), jnp.int32), loop)


def _target_step(target, st: _State, loop: _Loop):
    """One target step per active row (no drafter): ``(state, features_Bx3H of the fed token,
    the token emitted after it, the round's record_B)`` (record: 0, -2 when forced, -1 for a
    row that is done); records a round of tier 0."""
    thinking = loop.thinking
    B = st.root.shape[0]
    with jax.named_scope("step"):
        logits, feats, tcache = target(st.root[:, None], st.tcache.lengths[:, None], cache=st.tcache)
        key, sub = _split(st.key)
        nxt = sample(sub, logits[:, 0], _sampling(st, loop))
    with jax.named_scope("emit"):
        active = ~st.done
        think, forcing = st.think, jnp.zeros((B,), bool)
        if thinking is not None:
            end_ids, m = _end_ids(thinking), len(thinking.end_ids)
            forcing = active & (think.force >= 0)
            nxt = jnp.where(forcing, end_ids[jnp.maximum(think.force, 0)], nxt)
            force = jnp.where(forcing, jnp.where(think.force + 1 < m, think.force + 1, -1), think.force)
            _, hit, token, force = _budget_cut(dataclasses.replace(think, force=force), nxt[:, None],
                                               active.astype(jnp.int32), active & ~forcing, st.root, thinking)
            nxt = jnp.where(hit, token, nxt)
            think = dataclasses.replace(think, force=force, forced=think.forced | hit)
        record = jnp.where(active, jnp.where(forcing, -2, 0), -1)
        st = dataclasses.replace(st, tcache=kv_cache.advance(tcache, active.astype(jnp.int32)),
                                 root=jnp.where(active, nxt, st.root), key=key, think=think,
                                 accept=layers.row_set(st.accept, st.rounds, record))
        st = _emit(st, nxt[:, None], active.astype(jnp.int32), loop, st.rounds)
        return dataclasses.replace(st, rounds=st.rounds + active, step=st.step + 1), feats[:, 0], nxt, record


def _vanilla_round(target, st: _State, loop: _Loop) -> _State:
    """One target step per active row: vanilla decoding."""
    return _target_step(target, st, loop)[0]


def _burst(target, drafter, st: _State, loop: _Loop, cap, force_tier, min_active: int = 0) -> _State:
    """Rounds of the ``None`` tier (no drafting) while the policy keeps it: up to ``loop.burst``
    plain target steps, then one drafter catch-up over the tokens they committed, so that
    falling back costs about a vanilla step per token.  Each step is a round (of tier ``None``)
    for the records and the policy."""
    B, n = st.root.shape[0], loop.burst
    none = loop.spec.tiers.index(None)

    def step(carry):
        i, s, feats_BxNxF, tokens_BxN, count_B = carry
        rounds = s.rounds
        s, feats, nxt, record = _target_step(target, s, loop)
        active = record != -1
        s = dataclasses.replace(
            s, ctl=policy.update(s.ctl, loop.spec, jnp.maximum(record, 0), record >= 0),
            round_tier=layers.row_set(s.round_tier, rounds, jnp.where(active, none, 0)))
        return (i + 1, s, feats_BxNxF.at[:, i].set(feats.astype(feats_BxNxF.dtype)), tokens_BxN.at[:, i].set(nxt),
                count_B + active)

    F = 3 * target.config.hidden_size
    carry = (jnp.int32(0), st, jnp.zeros((B, n, F), target.dtype), jnp.zeros((B, n), jnp.int32),
             jnp.zeros((B,), jnp.int32))
    _, st2, feats_BxNxF, tokens_BxN, count_B = jax.lax.while_loop(
        lambda c: (c[0] < n) & _going(c[1], cap, min_active, loop.row_shards) & (_tier(c[1], force_tier) == none),
        step, carry)
    with jax.named_scope("catch_up"):  # drafter position j pairs the feature at j with the token after it
        dpos = st.dcache.lengths[:, None] + jnp.arange(n)[None]
        dout, dcache = drafter(feats_BxNxF, tokens_BxN, dpos, cache=st.dcache)
    last = jnp.where((count_B > 0)[:, None], layers.row_get(dout, jnp.maximum(count_B - 1, 0)), st.last_hidden)
    return dataclasses.replace(st2, dcache=kv_cache.advance(dcache, count_B), last_hidden=last)


def _propose(target, drafter, st: _State, active_B, sub_B, tree: TreeConfig, loop: _Loop):
    """Tier ``tree``'s draft and verification; the caches are only read.  Returns the accepted
    path's data (``tree.path_len`` nodes): node ids, accepted count, bonus, the token after
    each node, its target features; the keys/values of every node of the tree (the commit
    takes the path's, on each device its own rows'), and the forced tokens committed."""
    root, tcache = st.root, st.tcache
    B = root.shape[0]
    thinking = loop.thinking
    forcing, n_forced = jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32)
    with jax.named_scope("draft"):
        t = expand(drafter, st.dcache, st.last_hidden, root, tree)
        F = min(tree.total_tokens, tree.path_len) - 1
        if thinking is not None and F:  # sequences forcing E commit it as a chain instead of a draft
            end_ids, m = _end_ids(thinking), len(thinking.end_ids)
            force = st.think.force
            forcing = active_B & (force >= 0)
            start = jnp.maximum(force, 0)
            n_forced = jnp.clip(m - start, 0, F)
            ids = end_ids[jnp.minimum(start[:, None] + jnp.arange(F)[None], m - 1)]
            chain = forced_chain(root, ids, n_forced, tree)
            t = jax.tree.map(lambda c, d: jnp.where(forcing.reshape((B,) + (1,) * (c.ndim - 1)), c, d), chain, t)
    with jax.named_scope("verify"):
        logits, feats, new_kv = target.forward(t.tokens, tcache.lengths[:, None] + t.depth, cache=tcache,
                                               region_mask_BxTxR=t.mask)
        path, accepted, bonus = verify(t, logits, sub_B, _sampling(st, loop), tree.top_k, force_B=forcing)
        node = jnp.maximum(path, 0)
        drafted = jnp.take_along_axis(t.tokens, jnp.concatenate([node[:, 1:], node[:, :1]], 1), 1)
        return path, accepted, bonus, drafted, jnp.take_along_axis(feats, node[..., None], 1), new_kv, n_forced


def _spec_round(target, drafter, st: _State, loop: _Loop, tier: int) -> _State:
    """One round of drafting tier ``tier`` (an index into the tiers): its proposal, then the
    commit, the drafter's catch-up and the output bookkeeping that every tier shares."""
    spec, thinking = loop.spec, loop.thinking
    B = st.root.shape[0]
    active = ~st.done
    think, forcing = st.think, jnp.zeros((B,), bool)
    key, sub = _split(st.key)
    path, accepted, bonus, drafted, path_feats, tree_kv, n_forced = _propose(target, drafter, st, active, sub,
                                                                             spec.tiers[tier], loop)
    # the round's own path length: a short tier's commit and catch-up cost no more than its own
    j = jnp.arange(path.shape[1])[None]
    if thinking is not None:
        end_ids, m = _end_ids(thinking), len(thinking.end_ids)
        forcing = active & (think.force >= 0)
        start = jnp.maximum(think.force, 0)
        done_forcing = start + n_forced >= m
        bonus = jnp.where(forcing & ~done_forcing, end_ids[jnp.minimum(start + n_forced, m - 1)], bonus)
        force = jnp.where(forcing, jnp.where(~done_forcing & (start + n_forced + 1 < m), start + n_forced + 1, -1),
                          think.force)
        cand = jnp.where(j < accepted[:, None], drafted, bonus[:, None])
        keep, hit, token, force = _budget_cut(dataclasses.replace(think, force=force), cand, accepted + 1,
                                              active & ~forcing, st.root, thinking)
        accepted = jnp.where(hit, keep, accepted)
        bonus = jnp.where(hit, token, bonus)
        think = dataclasses.replace(think, force=force, forced=think.forced | hit)
    count = jnp.where(active, accepted + 1, 0)
    with jax.named_scope("commit"):
        tcache = kv_cache.commit(st.tcache, jnp.maximum(path, 0), count, new_kv=tree_kv)  # the path's nodes
    with jax.named_scope("catch_up"):
        # token following each committed node: the next accepted draft token, then the bonus
        new = jnp.where(j < accepted[:, None], drafted, bonus[:, None])
        # the drafter consumes the committed nodes' target features (from the tree pass)
        dpos = st.dcache.lengths[:, None] + j
        dout, dcache = drafter(path_feats, new, dpos, cache=st.dcache)
    with jax.named_scope("emit"):
        round_accept = jnp.where(active, jnp.where(forcing, -2, accepted), -1)
        st2 = dataclasses.replace(
            st, tcache=tcache, dcache=kv_cache.advance(dcache, count), key=key, think=think,
            root=jnp.where(active, bonus, st.root),
            last_hidden=jnp.where(active[:, None], layers.row_get(dout, accepted), st.last_hidden),
            accept=layers.row_set(st.accept, st.rounds, round_accept),
            ctl=policy.update(st.ctl, spec, jnp.maximum(round_accept, 0), round_accept >= 0),
            round_tier=layers.row_set(st.round_tier, st.rounds, jnp.where(active, tier, 0)))
        st2 = _emit(st2, new, count, loop, st.rounds)
        return dataclasses.replace(st2, rounds=st.rounds + active, step=st.step + 1)


def _rounds(target, drafter, st: _State, loop: _Loop, force_tier, cap, min_active: int = 0,
            keep_stops=False) -> _State:
    """Rounds until at most ``min_active`` rows are still decoding (every row done, by
    default) or ``cap`` rounds ran: the loop of ``generate`` (of each of its phases) and of
    the slot engine's dispatches.  ``keep_stops``: stop tokens end rows even in a forced
    tier (see below)."""
    tiers = () if loop.spec is None else loop.spec.tiers
    burst = functools.partial(_burst, target, drafter, loop=loop, cap=cap, force_tier=force_tier, min_active=min_active)
    going = functools.partial(_going, cap=cap, min_active=min_active, shards=loop.row_shards)

    def tier_rounds(i: int):
        return functools.partial(_spec_round, target, drafter, loop=loop, tier=i)

    if loop.spec is None:
        body = functools.partial(_vanilla_round, target, loop=loop)
    elif len(tiers) == 1:
        body = burst if tiers[0] is None else tier_rounds(0)
    else:
        # One loop per tier, in turn: each runs its tier's rounds while the policy keeps it (the
        # None tier as bursts, so that a pass that does not stop there runs no catch-up).
        # Straight-line rounds, no conditional around the caches: XLA would copy buffers into
        # and out of the branches of a switch.
        def body(s):
            for i, t in enumerate(tiers):
                s = jax.lax.while_loop(lambda s, i=i: going(s) & (_tier(s, force_tier) == i),
                                       burst if t is None else tier_rounds(i), s)
            return s

    # A forced tier is a measurement of its round cost: with ``keep_stops`` over the call's own
    # answers, as they end (``generate``'s round costs); without, rows end at their limit or
    # the cap, not at a stop token, so that every measured call runs its rounds whatever the
    # text says (``cost.forced_rounds``, and answers too short to time).
    stops = st.stops
    st = dataclasses.replace(st, step=jnp.int32(0), stops=jnp.where((force_tier >= 0) & jnp.logical_not(keep_stops), -1, stops))
    return dataclasses.replace(jax.lax.while_loop(going, body, st), stops=stops)


# A batch of this many rows or more, with room for this many new tokens, decodes in phases
# (see ``_phase_rows``).
COMPACT_FROM = 8
COMPACT_MIN_NEW_TOKENS = 64


def _phase_rows(batch: int, max_new_tokens: int, shards: int = 1) -> tuple[int, ...]:
    """The rows each phase of ``generate``'s loop runs on: the whole batch, then, once at most
    half of its rows are still decoding, those gathered into half as many rows, then into a
    quarter.  A static batch pays for its finished rows until its longest answer ends (the
    built-in pair's first 64 eval prompts at batch 32, 256 new tokens: 45% of its row-steps
    make a token; in phases, 1.6x the tokens/s, ``scripts/phases_bench.py``).  From
    ``COMPACT_FROM`` rows and ``COMPACT_MIN_NEW_TOKENS`` new tokens on (each phase compiles a
    loop of its own, and moves the rows it keeps).  On a mesh whose data axes split the batch
    over ``shards`` devices, the phases whose rows they split evenly: each device gathers its
    own rows (see ``_phased_rounds``)."""
    if batch < COMPACT_FROM or max_new_tokens < COMPACT_MIN_NEW_TOKENS:
        return (batch,)
    return tuple(rows for rows in (batch, batch // 2, batch // 4) if rows % shards == 0)


def _phased_rounds(target, drafter, st: _State, loop: _Loop, force_tier, cap, phases: tuple[int, ...],
                   keep_stops=False) -> _State:
    """``_rounds`` over the phases of ``_phase_rows``: each phase runs until the rows still
    decoding fit the next one, which takes them (in their order) and leaves the finished rows'
    outputs where they are.  Rows are independent (their keys, caches and limits are their
    own; the policy's state is shared and counts active rows only), so every row's tokens are
    those of one loop over the whole batch.  On a mesh each device's block of rows shrinks on
    that device (a phase starts once every device's active rows fit its share), so that no
    cache moves between devices.  Returns the whole batch's state without its caches."""
    whole = idx = None
    left = cap
    shards = loop.row_shards
    for i, rows in enumerate(phases):
        if i:  # each device's active rows first (all of them fit), then finished ones to fill its share
            n = st.done.shape[0] // shards
            order = jnp.argsort(st.done.reshape(shards, n), axis=1, stable=True)[:, : rows // shards]
            pick = (order + n * jnp.arange(shards)[:, None]).reshape(-1)
            st, idx = _take_rows(st, pick, shards), pick if idx is None else idx[pick]
        st = _rounds(target, drafter, st, loop, force_tier, left, min_active=phases[i + 1] if i + 1 < len(phases) else 0,
                     keep_stops=keep_stops)
        left = left - st.step
        rows_st = dataclasses.replace(st, tcache=None, dcache=None)
        whole = rows_st if whole is None else _set_rows(whole, rows_st, idx)
    return whole


def _going(st: _State, cap, min_active: int = 0, shards: int = 1):
    """Whether the loop goes on: below ``cap`` steps, with more than ``min_active`` rows still
    decoding (on a batch split over ``shards`` devices, more than their share on some device)."""
    active = (~st.done).reshape(shards, -1).sum(1).max()
    return (active > min_active // shards) & (st.step < cap)


def _tier(st: _State, force_tier):
    """The tier of the next round: the policy's, or ``force_tier`` when measuring one (>= 0)."""
    return jnp.where(force_tier >= 0, force_tier, st.ctl.tier)


def _stop_rows(stop_ids: tuple[int, ...], batch: int):
    return jnp.broadcast_to(jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32), (batch, max(len(stop_ids), 1)))


def _run(tgraph, tstate, dgraph, dstate, prompt_BxT, lengths_B, key, budget_B, phase_B, round_ms_T, force_tier,
         round_cap, keep_stops, learned, *, max_len: int, max_new: int, stop_ids: tuple[int, ...], sampling: SamplingConfig,
         spec: Speculation | None, thinking: budget.ThinkingConfig | None, cache_shardings: tuple = (None, None),
         phases: tuple[int, ...] = ()):
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    loop = _Loop(max_new, sampling, spec if drafter is not None else None, thinking, cache_shardings)
    with _kernel_mesh(target, loop):
        return _run_on(target, drafter, prompt_BxT, lengths_B, key, budget_B, phase_B, round_ms_T, force_tier,
                       round_cap, keep_stops, learned, max_len=max_len, max_new=max_new, stop_ids=stop_ids, loop=loop,
                       phases=phases)


def _kernel_mesh(target, loop: _Loop):
    """For a target with a kernel attention, the mesh of the loop's caches as the tracing
    context's (``jax.sharding.use_abstract_mesh``), where there is one: the kernels run per
    device under ``shard_map`` over it (``pallas_kernels.tree_attention.per_device``)."""
    layout = loop.cache_shardings[0]
    if layout is None or target.attention_impl == "xla":
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh)


def _run_on(target, drafter, prompt_BxT, lengths_B, key, budget_B, phase_B, round_ms_T, force_tier, round_cap,
            keep_stops, learned, *, max_len: int, max_new: int, stop_ids: tuple[int, ...], loop: _Loop,
            phases: tuple[int, ...]):
    B = prompt_BxT.shape[0]
    spec, thinking = loop.spec, loop.thinking
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(B))  # row b's key: fold_in(seed key, b)
    with jax.named_scope("prefill"):
        st = _prefill(target, drafter, prompt_BxT, lengths_B, keys, budget_B, phase_B, _stop_rows(stop_ids, B),
                      jnp.full((B,), max_new, jnp.int32), None, cache_len=max_len, loop=loop)
    if drafter is not None:
        st = dataclasses.replace(st, ctl=policy.init(spec, round_ms_T, learned))
    st = _phased_rounds(target, drafter, st, loop, force_tier, jnp.minimum(max_new, round_cap), phases or (B,),
                        keep_stops=keep_stops)
    out = {"out": st.out, "n_out": st.n_out, "accept": st.accept}
    if st.round_tier is not None:
        out["round_tier"] = st.round_tier
        out["learned"] = policy.learned(st.ctl)
    if thinking is not None:
        out.update(phase=st.think.phase, thinking=st.think.thinking, forced=st.think.forced,
                   round_thinking=st.think.round_thinking)
    return out


def _run_jit():
    """A jit of :func:`_run` of its own, so that JAX's tracing, lowering and compilation caches
    (keyed weakly on the function) let its program go with the last reference to it: a jit
    kept for the process would keep every program it ever compiled (on XLA:CPU, hundreds to
    thousands of memory mappings each, against a default limit of 65530 per process)."""
    @functools.wraps(_run)  # the same name (``jit(_run)`` in profiles) and signature
    def run(*args, **kw):
        return _run(*args, **kw)

    return jax.jit(run, static_argnums=(0, 2),
                   static_argnames=("max_len", "max_new", "stop_ids", "sampling", "spec", "thinking", "cache_shardings",
                                    "phases"))


# Compiled loops, least recently used first.  Each holds its executable (and its
# constants) in memory, so the number kept is bounded; one evicted is freed (``_run_jit``).
COMPILE_CACHE_SIZE = 16
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_ROUND_MS: dict = {}  # id(compiled) → its measurements of the milliseconds per round of each speculation tier
ROUND_MS_MEASUREMENTS = 3  # a program's round costs are measured on its first calls, this many (``_round_ms``)
_RAN: set = set()  # id(compiled) of the loops that have run in this process (generate's warm_up)


def _compiled(tgraph, dgraph, prompt_shape, kw: tuple, tstate, dstate):
    """Compiles the loop once per (models, weight shardings, batch, prompt bucket, limits, tree,
    sampling); keeps the ``COMPILE_CACHE_SIZE`` most recently used programs."""
    placement = tuple(getattr(x, "sharding", None) for x in jax.tree.leaves((tstate, dstate)))
    cache_key = (tgraph, dgraph, prompt_shape, kw, placement)
    if cache_key in _COMPILED:
        _COMPILED.move_to_end(cache_key)
    else:
        _COMPILED[cache_key] = _lower(tgraph, tstate, dgraph, dstate, prompt_shape, kw).compile()
        _trim(COMPILE_CACHE_SIZE)
    return _COMPILED[cache_key]


def _lower(tgraph, tstate, dgraph, dstate, prompt_shape, kw: tuple) -> jax.stages.Lowered:
    """The loop lowered for ``prompt_shape`` prompts (``kw``: ``_prepare``'s static arguments);
    the states may be concrete or ``ShapeDtypeStruct`` s with shardings."""
    spec = jax.ShapeDtypeStruct
    batch = spec(prompt_shape[:1], jnp.int32)
    tiers = dict(kw)["spec"].tiers if dict(kw)["spec"] is not None else (None,)
    return _run_jit().lower(
        tgraph, tstate, dgraph, dstate, spec(prompt_shape, jnp.int32), batch, jax.random.key(0), batch, batch,
        spec((len(tiers),), jnp.float32), spec((), jnp.int32), spec((), jnp.int32), spec((), jnp.bool_),
        jax.tree.map(lambda x: spec(x.shape, x.dtype), policy.fresh(dict(kw)["spec"] or _NO_SPEC)),
        **dict(kw))


def _trim(size: int):
    """Evicts the least recently used loops beyond ``size`` (freed: see :func:`_run_jit`)."""
    while len(_COMPILED) > size:
        evicted = id(_COMPILED.popitem(last=False)[1])
        _ROUND_MS.pop(evicted, None)
        _RAN.discard(evicted)


@contextlib.contextmanager
def keep_compiled(loops: int):
    """Keeps at least ``loops`` compiled loops while inside (then the usual
    ``COMPILE_CACHE_SIZE`` again): for a benchmark that cycles through more loops than the
    cache holds, each of which would otherwise be compiled again whenever it comes round (an
    evicted loop is freed, so it is compiled anew)."""
    global COMPILE_CACHE_SIZE
    before = COMPILE_CACHE_SIZE
    COMPILE_CACHE_SIZE = max(before, int(loops))
    try:
        yield
    finally:
        COMPILE_CACHE_SIZE = before
        _trim(before)


def clear_compiled():
    """Drops the compiled loops kept for reuse (and their measured round costs), freeing their
    executables' memory once nothing else holds them: JAX's caches do not (each was compiled by
    a jit of its own, :func:`_run_jit`), and ``jax.clear_caches`` does not reach these."""
    _COMPILED.clear()
    _ROUND_MS.clear()
    _RAN.clear()


def encode_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True)
    return list(out["input_ids"])


def _bucket(n: int, base: int = 32) -> int:
    """Rounds prompt lengths up so that varied prompts share one compilation."""
    return max(base, -(-n // base) * base)


# Below this, temperature sampling is numerically a greedy argmax with extra steps (and
# logits / temperature overflow float32 near 1e-38): pass 0 for greedy decoding.
MIN_TEMPERATURE = 1e-3


def _is_int(x) -> bool:
    return integer(x) is not None


def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    n = integer(value)
    if n is None:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if n < lo or (hi is not None and n >= hi):
        raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}), got {n}")
    return n


def _float_arg(name: str, value) -> float:
    value = host_scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def prompt_rows(prompts, vocab_size: int, tokenizer=None, *, row_name: str | None = None) -> list[np.ndarray]:
    """One int64 array per prompt, from the containers ``generate`` accepts (see there);
    ``TypeError`` / ``ValueError`` naming ``prompts[i]`` (or ``row_name``) otherwise."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim not in (1, 2):
            raise ValueError(f"prompts: an array must be 1-D (one prompt) or 2-D (one row per prompt), got shape {arr.shape}")
        prompts = [arr] if arr.ndim == 1 else list(arr)
    elif isinstance(prompts, (list, tuple)):
        if prompts and all(_is_int(p) for p in prompts):
            prompts = [prompts]  # one prompt given as a flat list of ids
    else:
        raise TypeError(f"prompts must be a list of token-id sequences, a 2-D array or strings, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts: need at least one prompt")
    rows = []
    for i, p in enumerate(prompts):
        label = row_name or f"prompts[{i}]"
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"{label} is a string: pass tokenizer= to encode it")
            p = tokenizer.encode(p)
        if isinstance(p, (np.ndarray, jax.Array)):
            arr = np.asarray(p)
            if arr.ndim != 1:
                raise ValueError(f"{label}: expected a 1-D sequence of token ids, got shape {arr.shape}")
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"{label}: token ids must be integers, got dtype {arr.dtype}")
        elif isinstance(p, (list, tuple)):
            bad = next((x for x in p if not _is_int(x)), None)
            if bad is not None:
                raise TypeError(f"{label}: token ids must be integers, got {type(bad).__name__} {bad!r}")
            arr = np.asarray(p, np.int64)
        else:
            raise TypeError(f"{label}: expected a sequence of token ids, got {type(p).__name__}")
        if arr.size == 0:
            raise ValueError(f"{label} is empty")
        check_token_ids(arr, vocab_size, label)
        rows.append(arr.astype(np.int64))
    return rows


@dataclasses.dataclass(frozen=True)
class _Request:
    """A validated ``generate`` call: padded prompts and everything the compiled loop is keyed on."""

    prompt_BxT: np.ndarray
    lengths_B: np.ndarray
    kw: tuple
    seed: int
    budget_B: np.ndarray  # thinking-content tokens allowed per sequence, -1 = unlimited
    phase_B: np.ndarray  # the thinking phase after each prompt
    round_ms: np.ndarray | None  # per speculation tier (None: measured when the policy adapts)
    rows: int  # the caller's prompts (the first rows; the rest pad the batch to the mesh)
    mesh: jax.sharding.Mesh | None = None
    rules: tuple | None = None

    @property
    def spec(self) -> Speculation | None:
        return dict(self.kw)["spec"]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return dict(self.kw)["stop_ids"]

    @property
    def thinking(self) -> budget.ThinkingConfig | None:
        return dict(self.kw)["thinking"]


def _thinking_config(tokenizer, think_token_ids, end_thinking_ids, mode, grace, vocab: int):
    """The static thinking setup from explicit ids or the tokenizer's ``<think>``/``</think>``,
    or ``None`` when neither names them."""
    mode = budget.check_mode(mode)  # with or without a thinking phase
    grace = _int_arg("thinking_grace", grace, 0)
    if think_token_ids is None and tokenizer is not None:
        ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
        unk = getattr(tokenizer, "unk_token_id", None)
        if all(_is_int(i) and i != unk for i in ids):
            think_token_ids = tuple(ids)
    if think_token_ids is None:
        if end_thinking_ids is not None:
            raise ValueError("end_thinking_ids needs the think-open/close tokens: pass think_token_ids=(open, close) "
                             "or a tokenizer with <think> and </think>")
        return None
    if not _is_sequence(think_token_ids) or len(think_token_ids) != 2:
        raise TypeError(f"think_token_ids must be (open_id, close_id), got {think_token_ids!r}")
    open_id, close_id = (_int_arg(f"think_token_ids[{i}]", x, 0, vocab) for i, x in enumerate(think_token_ids))
    if end_thinking_ids is None:
        newline = tokenizer.encode("\n", add_special_tokens=False) if tokenizer is not None else []
        end_thinking_ids = (*newline, close_id) if len(newline) == 1 else (close_id,)
    elif not _is_sequence(end_thinking_ids) or not len(end_thinking_ids):
        raise TypeError(f"end_thinking_ids must be a non-empty sequence of token ids, got {end_thinking_ids!r}")
    end = tuple(_int_arg(f"end_thinking_ids[{i}]", x, 0, vocab) for i, x in enumerate(end_thinking_ids))
    return budget.ThinkingConfig(open_id, close_id, end, mode, grace if mode == "soft" else 0)


def _is_sequence(x) -> bool:
    """An ordered run of values (list, tuple, 1-D array): not a string, nor a dict or a set,
    whose order is not the caller's (a dict would be read as its keys), nor a 0-d array."""
    return (hasattr(x, "__len__") and getattr(x, "ndim", 1) > 0
            and not isinstance(x, (str, bytes, collections.abc.Mapping, collections.abc.Set)))


def _budgets(thinking_budget, n: int) -> np.ndarray:
    if thinking_budget is None or _is_int(thinking_budget):
        values = [thinking_budget] * n
    elif not _is_sequence(thinking_budget):
        raise TypeError(f"thinking_budget must be None, an int or one value per prompt (a list, tuple or array), "
                        f"got {type(thinking_budget).__name__} {thinking_budget!r}")
    else:
        values = list(thinking_budget)
        if len(values) != n:
            raise ValueError(f"thinking_budget: {len(values)} values for {n} prompts")
    return np.array([-1 if v is None else _int_arg(f"thinking_budget[{i}]", v, 0, 2 ** 31) for i, v in enumerate(values)],
                    np.int32)


def _sampling_args(temperature, top_p, top_k, vocab: int) -> SamplingConfig:
    temperature = _float_arg("temperature", temperature)
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}")
    top_p = _float_arg("top_p", top_p)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return SamplingConfig(temperature, top_p, _int_arg("top_k", top_k, 0, vocab + 1))


def _stop_args(stop_token_ids, vocab: int) -> list[int]:
    if stop_token_ids is None:
        return []
    if _is_int(stop_token_ids) or isinstance(stop_token_ids, (str, bytes)):
        raise TypeError(f"stop_token_ids must be a sequence of token ids, got {type(stop_token_ids).__name__} {stop_token_ids!r}")
    return [_int_arg(f"stop_token_ids[{i}]", s, 0, vocab) for i, s in enumerate(stop_token_ids)]


def _speculation_arg(target, drafter, speculation) -> Speculation:
    """``speculation`` as a ``Speculation`` (a ``TreeConfig`` is one fixed tier), checked against the pair."""
    if isinstance(speculation, TreeConfig):
        speculation = Speculation.fixed(speculation)
    elif not isinstance(speculation, Speculation):
        raise TypeError(f"speculation must be a TreeConfig or a Speculation, got {type(speculation).__name__}")
    if drafter is not None:
        if (drafter.config.vocab_size != target.config.vocab_size
                or drafter.config.target_hidden_size != target.config.hidden_size):
            raise ValueError("drafter and target do not match (vocab size or hidden size); load the drafter with target=")
        if speculation.max_top_k > drafter.config.draft_vocab_size:
            raise ValueError(f"tree.top_k={speculation.max_top_k} exceeds the draft vocabulary "
                             f"({drafter.config.draft_vocab_size})")
    return speculation


def _prepare(target, drafter, prompts, *, max_new_tokens, temperature, top_p, top_k, tree, seed, stop_token_ids,
             tokenizer, thinking_budget=None, thinking_mode="hard", thinking_grace=0, think_token_ids=None,
             end_thinking_ids=None, speculation=None, round_ms=None, mesh=None, rules=None) -> _Request:
    vocab = target.config.vocab_size
    max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 1)
    sampling = _sampling_args(temperature, top_p, top_k, vocab)
    seed = _int_arg("seed", seed, 0, 2 ** 32)
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig (e.g. TreeConfig(60, 7, 10) or TreeConfig.chain(4)), got {type(tree).__name__}")
    stops = _stop_args(stop_token_ids, vocab)
    seqs = prompt_rows(prompts, vocab, tokenizer)
    speculation = _speculation_arg(target, drafter, Speculation.fixed(tree) if speculation is None else speculation)
    if round_ms is not None:
        given = round_ms
        try:
            round_ms = np.asarray(round_ms, np.float64)
        except (TypeError, ValueError):
            round_ms = None
        if round_ms is None or round_ms.shape != (len(speculation.tiers),) or not np.isfinite(round_ms).all() \
                or (round_ms <= 0).any():
            raise ValueError(f"round_ms: need one positive time per tier ({len(speculation.tiers)}), got {given!r}")
    rows = len(seqs)
    if mesh is not None:  # pad the batch to a multiple of the devices it is split over
        mesh = sharding.auto_mesh(mesh)
        seqs = seqs + [seqs[0]] * (-len(seqs) % sharding.batch_shards(mesh, rules))
    longest = max(s.size for s in seqs)
    T = _bucket(longest)
    scratch = 1 if drafter is None else speculation.scratch
    max_len = T + max_new_tokens + scratch
    if max_len > target.config.max_position_embeddings:
        raise ValueError(f"prompts + max_new_tokens: the longest prompt ({longest} tokens, padded to a bucket of {T}) + "
                         f"max_new_tokens ({max_new_tokens}) + {scratch} scratch slot(s) for a round = {max_len} exceeds "
                         f"the target's max_position_embeddings ({target.config.max_position_embeddings})")
    prompt = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        prompt[i, : s.size] = s
    lengths = np.array([s.size for s in seqs], np.int32)
    stop_ids = tuple(sorted(set(target.config.eos_token_ids) | set(stops)))
    thinking = _thinking_config(tokenizer, think_token_ids, end_thinking_ids, thinking_mode, thinking_grace, vocab)
    budgets = _budgets(thinking_budget, rows)
    budgets = np.concatenate([budgets, np.full((len(seqs) - rows,), budgets[0], np.int32)])
    if thinking is None and (budgets >= 0).any():
        raise ValueError("thinking_budget needs the think-open/close tokens: pass think_token_ids=(open, close) or a "
                         "tokenizer with <think> and </think>")
    phase = np.array([budget.initial_phase(s, thinking) if thinking else budget.BEFORE for s in seqs], np.int32)
    cache_shardings = _cache_shardings(target, drafter, len(seqs), max_len, mesh, rules)
    kw = dict(max_len=max_len, max_new=max_new_tokens, stop_ids=stop_ids,
              sampling=sampling, spec=speculation if drafter is not None else None,
              thinking=thinking, cache_shardings=cache_shardings,
              phases=_phase_rows(len(seqs), max_new_tokens, kv_cache.row_shards(cache_shardings[0])))
    return _Request(prompt, lengths, tuple(kw.items()), seed, budgets, phase, round_ms, rows, mesh,
                    None if rules is None else tuple(rules.items()))


def _cache_shardings(target, drafter, batch: int, max_len: int, mesh, rules) -> tuple:
    """The target's and the drafter's cache layouts on ``mesh`` (by ``kv_cache.CACHE_AXES``)."""
    if mesh is None:
        return (None, None)
    out = []
    for name, model, layers_ in (("target", target, target.config.num_layers), ("drafter", drafter, 1)):
        if model is None:
            out.append(None)
            continue
        shape = (layers_, batch, max_len, model.config.num_kv_heads, model.config.head_dim)
        out.append(kv_cache.layout(shape, mesh, rules, name=f"{name} KV cache"))
    return tuple(out)


_THINKING_DOC = """
      thinking_budget: the thinking budget B, counted in committed thinking tokens: ``None``
        (unlimited), an int, or one value per prompt (``None`` entries unlimited).  At B the
        end-of-thinking sequence is committed as if generated and the answer follows.
      thinking_mode: ``"hard"`` (force at B) or ``"soft"`` (the model may close by itself
        within ``thinking_grace`` more tokens; force at B + grace).
      think_token_ids: ``(open_id, close_id)``; default: the tokenizer's ``<think>`` /
        ``</think>``.  Without either, no thinking phase is tracked.
      end_thinking_ids: the forced end-of-thinking sequence (must contain the close id, with
        no open id after its last close: it ends the thinking); default: a newline then the
        close token.  Needs the think ids.  ``thinking_mode`` and ``thinking_grace`` are
        checked even when no thinking phase is tracked; the grace applies in soft mode only.
"""


def compile_generate(target, drafter, prompts, **kwargs):
    """The compiled decode loop ``generate(target, drafter, prompts, **kwargs)`` would run,
    and its inputs: ``(compiled, args)`` with ``compiled(*args)`` a dict of arrays (``out``,
    ``n_out``, ``accept``, the tier per round, and the thinking state when tracked).  For
    inspecting the program (``compiled.as_text()``, ``eagle3_jax.cost``)."""
    compiled, args, _ = _compile(target, drafter, prompts, **kwargs)
    return compiled, args


def lower_generate(target, drafter, *, batch: int, prompt_len: int, max_new_tokens: int, mesh, rules=None,
                   **kwargs) -> jax.stages.Lowered:
    """The decode loop ``generate`` runs for ``batch`` prompts of ``prompt_len`` tokens on
    ``mesh``, lowered and not compiled, for ahead-of-time compilation (``eagle3_jax.topology``):
    ``target`` / ``drafter`` (``None``: vanilla decoding) may be abstract
    (``nnx.eval_shape``: no weights anywhere), and ``mesh`` any ``jax.sharding.Mesh``, such as
    one over a TPU topology's devices on a host without TPUs; the weights are placed by their
    declarations, the caches and the batch as ``generate`` places them.  ``kwargs``: the other
    arguments of :func:`generate` (``speculation``, ``tree``, ``temperature``, ...)."""
    req, (tgraph, tstate), (dgraph, dstate) = _placed_request(target, drafter, batch, prompt_len, max_new_tokens,
                                                              mesh, rules, kwargs)
    return _lower(tgraph, tstate, dgraph, dstate, req.prompt_BxT.shape, req.kw)


def _placed_request(target, drafter, batch: int, prompt_len: int, max_new_tokens: int, mesh, rules, kwargs: dict):
    """``generate``'s request for ``batch`` prompts of ``prompt_len`` tokens (the ids only shape
    the programs) and the models' split states placed on its mesh."""
    _int_arg("batch", batch, 1)
    _int_arg("prompt_len", prompt_len, 1)
    req = _prepare(target, drafter, [[0] * prompt_len] * batch, max_new_tokens=max_new_tokens, mesh=mesh, rules=rules,
                   **{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "tree": TreeConfig(), "seed": 0,
                      "stop_token_ids": None, "tokenizer": None, **kwargs})
    return req, *_placed(target, drafter, req.mesh, None if req.rules is None else dict(req.rules))


def _placed(target, drafter, mesh, rules) -> tuple[tuple, tuple]:
    """``((tgraph, tstate), (dgraph, dstate))``, the states placed on ``mesh`` by the models'
    declarations (``(None, None)`` for no drafter)."""
    tgraph, tstate = nnx.split(target)
    tstate = sharding.place(tstate, declare_target(target.config), mesh, rules)
    if drafter is None:
        return (tgraph, tstate), (None, None)
    dgraph, dstate = nnx.split(drafter)
    return (tgraph, tstate), (dgraph, sharding.place(dstate, declare_drafter(drafter.config), mesh, rules))


def lower_parts(target, drafter, *, batch: int, prompt_len: int, max_new_tokens: int, mesh, rules=None,
                **kwargs) -> tuple[jax.stages.Lowered, dict]:
    """The loop's parts as programs of their own, for ahead-of-time compilation (see
    :func:`lower_generate`, which takes the same arguments): ``(prefill, lower_round)``, the
    prefill of ``generate``'s loop lowered (prompts → the loop's state after the first token),
    and ``lower_round(tier, state)``, one round of speculation tier ``tier`` (an index into the
    tiers; ``None``: no drafting, a plain target step) lowered on ``state``, the compiled
    prefill's ``out_info``.  A loop's cost analysis counts its body once, whatever its trip
    count; these parts hold no loop over rounds, so their costs are a round's."""
    req, (tgraph, tstate), (dgraph, dstate) = _placed_request(target, drafter, batch, prompt_len, max_new_tokens,
                                                              mesh, rules, kwargs)
    kw = dict(req.kw)
    spec = kw["spec"]
    loop = _Loop(kw["max_new"], kw["sampling"], spec, kw["thinking"], kw["cache_shardings"])

    def prefill(tstate, dstate, prompt_BxT, lengths_B, budget_B, phase_B, round_ms_T, learned):
        target_, drafter_ = nnx.merge(tgraph, tstate), None if dgraph is None else nnx.merge(dgraph, dstate)
        B = prompt_BxT.shape[0]
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(B))
        with _kernel_mesh(target_, loop):
            st = _prefill(target_, drafter_, prompt_BxT, lengths_B, keys, budget_B, phase_B,
                          _stop_rows(kw["stop_ids"], B), jnp.full((B,), kw["max_new"], jnp.int32), None,
                          cache_len=kw["max_len"], loop=loop)
        return st if drafter_ is None else dataclasses.replace(st, ctl=policy.init(spec, round_ms_T, learned))

    def one_round(tier, tstate, dstate, st):
        target_, drafter_ = nnx.merge(tgraph, tstate), None if dgraph is None else nnx.merge(dgraph, dstate)
        with _kernel_mesh(target_, loop):
            if tier is None:
                return _vanilla_round(target_, st, loop)
            return _spec_round(target_, drafter_, st, loop, tier)

    sds = jax.ShapeDtypeStruct
    B = req.prompt_BxT.shape[0]
    tiers = spec.tiers if spec is not None else (None,)
    learned = jax.tree.map(lambda x: sds(x.shape, x.dtype), policy.fresh(spec or _NO_SPEC))
    prefill_lowered = jax.jit(prefill).lower(
        tstate, dstate, sds(req.prompt_BxT.shape, jnp.int32), sds((B,), jnp.int32), sds((B,), jnp.int32),
        sds((B,), jnp.int32), sds((len(tiers),), jnp.float32), learned)

    def lower_round(tier: int | None, state) -> jax.stages.Lowered:
        state = jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding=x.sharding), state)
        return jax.jit(functools.partial(one_round, tier), donate_argnums=(2,)).lower(tstate, dstate, state)

    return prefill_lowered, lower_round


def _compile(target, drafter, prompts, *, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, tree=TreeConfig(),
             seed=0, stop_token_ids=None, tokenizer=None, **kw):
    req = _prepare(target, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                   top_k=top_k, tree=tree, seed=seed, stop_token_ids=stop_token_ids, tokenizer=tokenizer, **kw)
    spec = req.spec
    tgraph, tstate = nnx.split(target)
    dgraph, dstate = nnx.split(drafter) if drafter is not None else (None, None)
    if req.mesh is not None:
        rules = None if req.rules is None else dict(req.rules)
        tstate = sharding.place(tstate, declare_target(target.config), req.mesh, rules)
        if drafter is not None:
            dstate = sharding.place(dstate, declare_drafter(drafter.config), req.mesh, rules)
    compiled = _compiled(tgraph, dgraph, req.prompt_BxT.shape, req.kw, tstate, dstate)
    n_tiers = 1 if spec is None else len(spec.tiers)
    learned = policy.recall((tgraph, dgraph, spec, req.mesh)) or policy.fresh(spec or _NO_SPEC)
    learned = jax.tree.map(np.asarray, learned)  # wherever the last call left it
    args = (tstate, dstate, jnp.asarray(req.prompt_BxT), jnp.asarray(req.lengths_B), jax.random.key(req.seed),
            jnp.asarray(req.budget_B), jnp.asarray(req.phase_B), jnp.ones((n_tiers,), jnp.float32), jnp.int32(-1),
            jnp.int32(dict(req.kw)["max_new"]), jnp.bool_(False), learned)
    round_ms = req.round_ms
    if round_ms is None and spec is not None and spec.policy == "adaptive":
        round_ms = _round_ms(compiled, args, n_tiers)
    if round_ms is not None:
        args = args[:7] + (jnp.asarray(round_ms, jnp.float32),) + args[8:]
    return compiled, args, req


_NO_SPEC = Speculation((None,), policy="fixed")


def forced_args(args: tuple, tier: int, rounds: int, keep_stops: bool = False) -> tuple:
    """``compile_generate``'s arguments for a measurement call: speculation tier ``tier``
    (an index into the request's tiers; a single tree is tier 0, vanilla decoding too) forced
    for ``rounds`` rounds, which stop tokens do not end (see ``_rounds``) unless
    ``keep_stops``; ``tier`` -1: the call as ``generate`` makes it, but for at most
    ``rounds`` rounds."""
    return (*args[:8], jnp.int32(tier), jnp.int32(rounds), jnp.bool_(keep_stops), *args[11:])


def forced_call(compiled, args, tier: int, rounds: int, keep_stops: bool = False) -> tuple[float, int]:
    """One measurement call (:func:`forced_args`) of ``compile_generate``'s program: its wall
    seconds and the rounds it ran (``max_new_tokens``, and with ``keep_stops`` the stop
    tokens, may end it before ``rounds``)."""
    seconds, res = _timed_call(compiled, forced_args(args, tier, rounds, keep_stops))
    return seconds, _loop_rounds(res)


def _timed_call(compiled, args) -> tuple[float, dict]:
    start = time.perf_counter()
    res = jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start, res


def _loop_rounds(res: dict) -> int:
    """The rounds a call of the loop ran (those in which some row took part)."""
    return int((np.asarray(res["accept"]) != -1).any(0).sum())


def _stretch_caps(first, rounds: int, seconds_long: float, max_new: int) -> list[int]:
    """The rounds of each tier that make the same new tokens per row (``_round_ms``'s
    stretch), from a first call of each: ``(rounds run, new tokens per row, seconds less the
    prefill)``.  The stretch is as many tokens as the tier slowest per token makes in
    ``seconds_long``, at least ``4 * rounds`` and at most ``max_new - 1``; each tier runs at
    least ``rounds`` rounds."""
    slowest = max(seconds / made for _, made, seconds in first)  # seconds per new token per row
    span = min(max(seconds_long / slowest, 4 * rounds), max(max_new - 1, 1))
    return [max(rounds, math.ceil(span * max(ran, 1) / made)) for ran, made, _ in first]


def _round_ms(compiled, args, n_tiers: int, rounds: int = 8, seconds_long: float = 0.4,
              repeats: int = 3) -> tuple[float, ...]:
    """Milliseconds per round of each speculation tier, measured once per compiled program on
    the program itself and the call's own prompts, each tier forced over the same stretch of
    the answers: the rounds that make about the same new tokens per row, so that every tier
    is timed at the same live lengths (the rounds of a long chain read a longer prefix than
    those of a short one after the same number of rounds) and, where the answers end inside
    the stretch, with the rows finishing and a batch's phases shrinking (``_phase_rows``) as
    in the call itself.  The stretch is as many tokens as the tier slowest per token makes
    in about ``seconds_long``, at least ``4 * rounds`` and at most ``max_new_tokens - 1``; a
    tier's cost is its call less a call stopped after the prefill, over the rounds it ran
    (what a call costs besides its rounds cancels out: the prefill, the launch, the output's
    transfer).  Stop tokens end the rows as in the call (so a tier's stretch ends where the
    answers end, if sooner), unless some tier's first ``rounds`` rounds would already end
    every row, some at a stop token (answers too short to time): then every tier is forced
    past them.  Each call is the fastest of ``repeats`` passes that time every tier in turn
    (in an order that rotates), so that a slow spell of a shared machine falls on every tier
    alike.  Measured anew on each of the program's first ``ROUND_MS_MEASUREMENTS`` calls (later
    calls reuse them), each tier's cost the lower median of the measurements so far (of two,
    the faster): a first measurement that a busy spell slowed (or a baseline call it slowed
    made too fast) does not steer every later call of the program."""
    done = _ROUND_MS.setdefault(id(compiled), [])
    if len(done) < ROUND_MS_MEASUREMENTS:
        done.append(_measure_round_ms(compiled, args, n_tiers, rounds, seconds_long, repeats))
    return tuple(sorted(m[i] for m in done)[(len(done) - 1) // 2] for i in range(n_tiers))


def _measure_round_ms(compiled, args, n_tiers: int, rounds: int, seconds_long: float,
                      repeats: int) -> tuple[float, ...]:
    """One measurement of ``_round_ms``."""
    forced_call(compiled, args, 0, 0)  # the program's first run
    max_new = int(args[9])

    def first_pass(keep_stops: bool):
        base = forced_call(compiled, args, 0, 0)[0]
        out, short = [], False
        for tier in range(n_tiers):
            t, res = _timed_call(compiled, forced_args(args, tier, rounds, keep_stops))
            n_out = np.asarray(res["n_out"])
            ran = _loop_rounds(res)
            # every row ended within the first rounds, some at a stop token (not max_new_tokens)
            short |= ran < rounds and bool((n_out < max_new).any())
            out.append((ran, max(float(n_out.mean()) - 1.0, 1.0), max(t - base, 1e-6)))  # new tokens per row
        return out, short

    keep_stops = True
    first, short = first_pass(keep_stops)
    if short:  # answers too short to time: every tier forced past its stops
        keep_stops = False
        first, _ = first_pass(keep_stops)
    cap = _stretch_caps(first, rounds, seconds_long, max_new)

    best, ran = {}, {}
    for r in range(repeats):
        calls = [(-1, 0)] + [(tier, cap[tier]) for tier in ((i + r) % n_tiers for i in range(n_tiers))]
        for tier, n in calls:
            t, ran[tier] = forced_call(compiled, args, max(tier, 0), n, keep_stops)
            best[tier] = min(best.get(tier, float("inf")), t)
    return tuple(1e3 * max(best[i] - best[-1], 1e-6) / max(ran[i], 1) for i in range(n_tiers))


def generate(target, drafter, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, tree: TreeConfig = TreeConfig(), seed: int = 0,
             stop_token_ids: Sequence[int] | None = None, tokenizer=None, thinking_budget=None,
             thinking_mode: str = "hard", thinking_grace: int = 0, think_token_ids=None,
             end_thinking_ids=None, speculation: Speculation | TreeConfig | None = None,
             round_ms=None, mesh: jax.sharding.Mesh | None = None, rules=None,
             time_first_token: bool = False, warm_up: bool = False) -> GenerateResult:
    """Generates with EAGLE-3 speculative decoding (or vanilla decoding if ``drafter`` is None).

    Greedy output is token-identical to the target's own greedy decoding under the same
    thinking budget; with ``temperature > 0`` every token is distributed exactly as sampling
    the target (after top-k / top-p).  Stops at ``max_new_tokens``, the target's EOS ids and
    ``stop_token_ids``; budgets and stops count committed tokens only.

    Args:
      prompts: one prompt (a list/tuple of token ids, a 1-D numpy or jax array, or a string
        with ``tokenizer``), a list of such prompts, or a 2-D integer array (one row per prompt).
      max_new_tokens: the most tokens generated per prompt (>= 1), thinking included.
      temperature: 0 for greedy, else >= ``MIN_TEMPERATURE``; ``top_p`` in (0, 1], ``top_k``
        >= 0 (0 = off).
      tree: the draft tree budget (``TreeConfig``); ignored without a drafter.
      speculation: the speculative budget K as tiers and a policy (``Speculation``, see
        ``eagle3_jax.speculation``; a ``TreeConfig`` is one fixed tier); overrides ``tree``.
      round_ms: milliseconds per round of each tier, for the adaptive policy (default:
        measured per models, tiers, batch and prompt bucket on the first
        ``ROUND_MS_MEASUREMENTS`` calls, each tier the median of those measurements).
      seed: the sampling seed, in [0, 2**32).
      mesh: a ``jax.sharding.Mesh`` (``eagle3_jax.sharding.make_mesh``, or ``jax.make_mesh``'s, its
        Explicit axes taken as Auto: ``sharding.auto_mesh``) to decode on: weights by
        their declared logical axes (heads, MLP and vocabulary over ``tensor``), KV caches over
        KV heads, the batch over ``data`` (padded to a multiple of it); ``rules`` override
        ``eagle3_jax.sharding.RULES``.  Models loaded with ``mesh=`` are used in place, others
        are placed for the call.  The tokens are those of one device.
      stop_token_ids: token ids that end a sequence, besides the target's EOS ids.
      time_first_token: also time the call stopped after the prefill (its first token), on
        the same compiled program just before the full call: ``stats["first_token_seconds"]``
        (the full call's time is ``stats["seconds"]``).
      warm_up: for benchmarks: when the compiled program has not run in this process yet, run
        it once untimed before the timed call (``stats["warm_up_seconds"]``; ``None`` when it
        had run).  A program's first run pays one-time costs besides its compilation (on
        XLA:CPU the first touches of its fresh buffers and the first execution of each fused
        dot; for the built-in pair on 2 CPU cores, 0.3–0.9 s more for a batch-32 EAGLE-3
        loop, 25–40 ms at batch 1), which a steady-state timing leaves out.  The timed call's output is the
        same.{thinking}
    Returns a ``GenerateResult``; per sequence ``thinking_tokens``, ``answer_tokens``,
    ``finish_reason`` (``stop`` | ``length``) and ``thinking_status`` (``none`` | ``closed``
    | ``budget_exhausted`` | ``incomplete``); ``stats["phases"]`` splits the round statistics
    by the phase of each round's first committed token.

    Raises ``TypeError`` / ``ValueError`` naming the argument for malformed input.
    """
    compiled, args, req = _compile(target, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_p=top_p, top_k=top_k, tree=tree, seed=seed, stop_token_ids=stop_token_ids,
                                   tokenizer=tokenizer, thinking_budget=thinking_budget, thinking_mode=thinking_mode,
                                   thinking_grace=thinking_grace, think_token_ids=think_token_ids,
                                   end_thinking_ids=end_thinking_ids, speculation=speculation, round_ms=round_ms,
                                   mesh=mesh, rules=rules)
    warm = _timed_call(compiled, args)[0] if warm_up and id(compiled) not in _RAN else None
    first_token = _timed_call(compiled, forced_args(args, -1, 0))[0] if time_first_token else None
    seconds, res = _timed_call(compiled, args)
    _RAN.add(id(compiled))
    if "learned" in res and req.spec.policy == "adaptive":
        policy.remember((nnx.graphdef(target), nnx.graphdef(drafter), req.spec, req.mesh), res["learned"])
    res = {k: np.asarray(v)[: req.rows] for k, v in res.items() if k != "learned"}  # every entry is per row
    n_out = res["n_out"]
    tokens = [res["out"][b, : n_out[b]].tolist() for b in range(n_out.shape[0])]
    stats = _stats(res, seconds, req.spec)
    if first_token is not None:
        stats["first_token_seconds"] = first_token
    if warm_up:
        stats["warm_up_seconds"] = warm
    texts = [tokenizer.decode(t) for t in tokens] if tokenizer is not None else None
    stops = set(req.stop_ids)
    finish = ["stop" if t and t[-1] in stops else "length" for t in tokens]
    if req.thinking is not None:
        thinking = res["thinking"].tolist()
        status = [budget.status(int(ph), bool(fo), th > 0 or p0 == budget.THINKING)
                  for ph, fo, th, p0 in zip(res["phase"], res["forced"], thinking, req.phase_B[: req.rows])]
    else:
        thinking, status = [0] * len(tokens), ["none"] * len(tokens)
    answer = [len(t) - th for t, th in zip(tokens, thinking)]
    return GenerateResult(tokens, stats, texts, thinking, answer, finish, status)


generate.__doc__ = generate.__doc__.replace("{thinking}", _THINKING_DOC.rstrip() + "\n")


def _round_stats(accept_BxR, rounds_mask_BxR, proposed_BxR, depth_BxR, positions: int) -> dict:
    """Statistics of the drafted rounds in ``rounds_mask``; ``depth``: the draft positions of
    each round's tier (a position deeper than its round's tier was not offered in it)."""
    drafted = rounds_mask_BxR & (accept_BxR >= 0)
    acc = [row[m].tolist() for row, m in zip(accept_BxR, drafted)]
    flat, depth = accept_BxR[drafted].astype(np.int64), depth_BxR[drafted]
    i = np.arange(1, positions + 1)[:, None]
    accepted = (flat[None] >= i).sum(1)
    offered = ((flat[None] >= i - 1) & (depth[None] >= i)).sum(1)
    return {
        "rounds": [len(a) for a in acc],
        "accept_lengths": acc,
        "tau": float((flat + 1).mean()) if flat.size else 0.0,
        "acceptance_rate": [float(a / max(o, 1)) for a, o in zip(accepted, offered)],
        "accepted_per_position": accepted.tolist(),
        "offered_per_position": offered.tolist(),
        "proposed": int((drafted * proposed_BxR).sum()),
        "accepted": int(flat.sum()),
    }


def _stats(res: dict, seconds: float, spec: Speculation | None) -> dict:
    """Round statistics (drafted rounds only: a round that committed forced end-of-thinking
    tokens is counted in ``forced_rounds``), the tier of each round, and per thinking phase
    when tracked."""
    accept, n_out = res["accept"], res["n_out"]
    tiers = (None,) if spec is None else spec.tiers
    tier_BxR = res.get("round_tier", np.zeros(accept.shape, np.int64))
    proposed_BxR = np.array([0 if t is None else t.total_tokens - 1 for t in tiers])[tier_BxR]
    depth_BxR = np.array([0 if t is None else t.path_len - 1 for t in tiers])[tier_BxR]
    positions = 0 if spec is None else spec.positions
    new_tokens = int(n_out.sum())
    stats = _round_stats(accept, np.ones_like(accept, bool), proposed_BxR, depth_BxR, positions)
    names = [policy.tier_name(t) for t in tiers]
    stats.update({
        "forced_rounds": int((accept == -2).sum()),
        "committed": new_tokens,
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else float("inf"),
    })
    if spec is not None:  # every row runs every round of the loop until it is done: the longest saw them all
        ran = accept != -1
        longest = int(ran.sum(1).argmax())
        tier_R = tier_BxR[longest][ran[longest]]
        stats["tier_per_round"] = [names[i] for i in tier_R]
        stats["tier_rounds"] = {n: int((tier_R == i).sum()) for i, n in enumerate(names)}
    if "round_thinking" in res:
        rt, thinking = res["round_thinking"], res["thinking"]
        stats["phases"] = {
            "thinking": {**_round_stats(accept, rt, proposed_BxR, depth_BxR, positions), "committed": int(thinking.sum()),
                         "forced_rounds": int(((accept == -2) & rt).sum())},
            "answer": {**_round_stats(accept, ~rt, proposed_BxR, depth_BxR, positions), "committed": int(new_tokens - thinking.sum()),
                       "forced_rounds": int(((accept == -2) & ~rt).sum())},
        }
    return stats


# ---------------------------------------------------------------- the slot engine
#
# Continuous batching: a fixed number of rows ("slots") of batched caches, a request prefilled
# into a free slot between dispatches while the others keep decoding.  Dispatches run the
# same ``_rounds`` (and so the same round) as ``generate``; sampling parameters, seeds, stop
# ids, limits and thinking budgets are per-row arrays, so one compiled program serves them all.


def _row_axes(st: _State) -> _State:
    """The batch axis of every array of ``st``, in its shape (-1: shared by the rows, the loop
    counter and the policy's state)."""
    cache = lambda c: None if c is None else dataclasses.replace(c, k=1, v=1, lengths=0)  # noqa: E731  ([L, B, S, K, D])
    return dataclasses.replace(jax.tree.map(lambda _: 0, st), tcache=cache(st.tcache), dcache=cache(st.dcache),
                               step=-1, ctl=jax.tree.map(lambda _: -1, st.ctl))


def _put_rows(st: _State, rows: _State, at) -> _State:
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
    return jax.tree.map(put, st, rows, _row_axes(st))


def _take_rows(st: _State, idx, shards: int = 1) -> _State:
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

    return jax.tree.map(take, st, _row_axes(st))


def _set_rows(st: _State, rows: _State, idx) -> _State:
    """``st`` with rows ``idx`` replaced by those of ``rows`` (both without caches); the loop
    counter and the policy's state are ``rows``'."""
    def put(big, small, axis):
        return small if axis < 0 else big.at[(slice(None),) * axis + (idx,)].set(small)

    return jax.tree.map(put, st, rows, _row_axes(st))


def _first_rows(st: _State, n: int) -> _State:
    """Rows ``[0, n)`` of ``st`` (the loop counter and the policy's state whole)."""
    return jax.tree.map(lambda x, axis: x if axis < 0 else jax.lax.slice_in_dim(x, 0, n, axis=axis), st, _row_axes(st))


def _slots_empty(tgraph, tstate, dgraph, dstate, round_ms_T, learned, *, slots: int, max_len: int, stops: int,
                 loop: _Loop) -> _State:
    """Every slot free (done), caches of ``max_len`` slots per row."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    ones = jnp.ones((slots,), jnp.int32)
    rows = RowSampling.of(SamplingConfig(), slots)
    st = _prefill(target, drafter, jnp.zeros((slots, 1), jnp.int32), ones, jax.random.split(jax.random.key(0), slots),
                  -ones, ones * budget.BEFORE, jnp.full((slots, stops), -1, jnp.int32), ones, rows, cache_len=1,
                  loop=loop)
    st = dataclasses.replace(st, tcache=target.init_cache(slots, max_len), done=jnp.ones((slots,), bool),
                             n_out=0 * ones, out=0 * st.out)
    if drafter is not None:
        st = dataclasses.replace(st, dcache=drafter.init_cache(slots, max_len), ctl=policy.init(loop.spec, round_ms_T, learned))
    return st


def _slot_insert(tgraph, tstate, dgraph, dstate, st: _State, slot, prompt_1xT, length_1, seed, budget_1, phase_1,
                 stops_1xS, limit_1, temperature_1, top_p_1, top_k_1, *, loop: _Loop) -> _State:
    """Prefills one request into row ``slot`` (its first token emitted); its key is row 0's of
    ``generate`` with the same seed."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    key_1 = jax.random.fold_in(jax.random.key(seed), 0)[None]
    row = _prefill(target, drafter, prompt_1xT, length_1, key_1, budget_1, phase_1, stops_1xS, limit_1,
                   RowSampling(temperature_1, top_p_1, top_k_1), cache_len=prompt_1xT.shape[1], loop=loop)
    return _put_rows(st, row, slot)


def _slot_rounds(tgraph, tstate, dgraph, dstate, st: _State, cap, force_tier, *, loop: _Loop, rows: int) -> _State:
    """Up to ``cap`` rounds of every active slot, all of them in the first ``rows`` rows: the
    rounds run on those rows only (their cost follows the requests, not the slots), which are
    then written back."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    with _kernel_mesh(target, loop):
        if rows == st.done.shape[0]:
            return _rounds(target, drafter, st, loop, force_tier, cap)
        sub = _rounds(target, drafter, _first_rows(st, rows), loop, force_tier, cap)
    return dataclasses.replace(_put_rows(st, sub, 0), step=sub.step, ctl=sub.ctl)


def _slot_snapshot(st: _State) -> dict:
    """What :meth:`Slots.poll` reads of a state, as arrays of their own (the state itself is
    donated to the next dispatch, so a poll that lags a dispatch behind reads these)."""
    out = {"out": st.out, "n_out": st.n_out, "done": st.done, "accept": st.accept}
    if st.round_tier is not None:
        out["round_tier"] = st.round_tier
    if st.think is not None:
        out.update(phase=st.think.phase, thinking=st.think.thinking, forced=st.think.forced,
                   round_thinking=st.think.round_thinking)
    return out


def _slot_release(st: _State, slot) -> _State:
    return dataclasses.replace(st, done=st.done.at[slot].set(True))


def _slot_reset(st: _State, *, loop: _Loop) -> _State:
    """A fresh policy with the same round costs (inside a jit, so its arrays are of the kind
    the compiled dispatches take: an eagerly built one made them compile again)."""
    return dataclasses.replace(st, ctl=policy.init(loop.spec, st.ctl.round_ms, policy.fresh(loop.spec)))


_slots_empty_jit = jax.jit(_slots_empty, static_argnums=(0, 2), static_argnames=("slots", "max_len", "stops", "loop"))
_SLOT_PROGRAMS: collections.OrderedDict = collections.OrderedDict()  # (graphs, loop) → (insert, rounds), LRU


def _slot_programs(tgraph, dgraph, tdef, ddef, loop: _Loop):
    """The jitted insert and dispatch for one pair and loop, with the graphs bound rather than
    static arguments and the weights passed as flat lists (``tdef`` / ``ddef``: their tree
    structures): a dispatch then neither hashes a graph nor walks an ``nnx.State`` on the host."""
    key = (tgraph, dgraph, tdef, ddef, loop)
    if key in _SLOT_PROGRAMS:
        _SLOT_PROGRAMS.move_to_end(key)
    else:
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

        _SLOT_PROGRAMS[key] = (jax.jit(insert, donate_argnums=(2,)),
                               jax.jit(rounds, donate_argnums=(2,), static_argnums=(5,)))
        while len(_SLOT_PROGRAMS) > COMPILE_CACHE_SIZE:
            _SLOT_PROGRAMS.popitem(last=False)
    return _SLOT_PROGRAMS[key]


def lower_slots(target, drafter, *, num_slots: int, max_len: int, mesh, speculation=None, rules=None,
                max_stop_ids: int = 8) -> jax.stages.Lowered:
    """The server's dispatch (:meth:`Slots.run`: rounds of every slot) lowered for ``num_slots``
    slots of ``max_len`` positions, for ahead-of-time compilation, as :func:`lower_generate`
    (abstract models, any mesh: the weights placed by their declarations)."""
    spec = _speculation_arg(target, drafter, TreeConfig() if speculation is None else speculation)
    spec = spec if drafter is not None else None
    mesh = sharding.auto_mesh(mesh)
    num_slots = _int_arg("num_slots", num_slots, 1)
    loop = _Loop(_int_arg("max_len", max_len, 2), None, spec, None,
                 _cache_shardings(target, drafter, num_slots, max_len, mesh, rules))
    (tgraph, tstate), (dgraph, dstate) = _placed(target, drafter, mesh, rules)
    n_tiers = 1 if spec is None else len(spec.tiers)
    learned = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), policy.fresh(spec or _NO_SPEC))
    stops = _int_arg("max_stop_ids", max_stop_ids, 0) + len(target.config.eos_token_ids)
    state = jax.eval_shape(functools.partial(_slots_empty, tgraph, dgraph=dgraph, slots=num_slots,
                                             max_len=max_len, stops=stops, loop=loop),
                           tstate, dstate=dstate, round_ms_T=jax.ShapeDtypeStruct((n_tiers,), jnp.float32),
                           learned=learned)
    _, rounds = _slot_programs(tgraph, dgraph, jax.tree.structure(tstate),
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
    """

    def __init__(self, target, drafter, *, num_slots: int, max_len: int,
                 speculation: Speculation | TreeConfig | None = None, tokenizer=None, think_token_ids=None,
                 end_thinking_ids=None, thinking_mode: str = "hard", thinking_grace: int = 0, round_ms=None,
                 max_stop_ids: int = 8):
        self.num_slots = _int_arg("num_slots", num_slots, 1)
        self.max_len = _int_arg("max_len", max_len, 2, target.config.max_position_embeddings + 1)
        vocab = target.config.vocab_size
        spec = _speculation_arg(target, drafter, TreeConfig() if speculation is None else speculation)
        self.spec = spec if drafter is not None else None
        self.thinking = _thinking_config(tokenizer, think_token_ids, end_thinking_ids, thinking_mode, thinking_grace,
                                         vocab)
        self.stop_ids = tuple(sorted(set(target.config.eos_token_ids)))
        self._max_stops = _int_arg("max_stop_ids", max_stop_ids, 0) + len(self.stop_ids)
        self._scratch = 1 if self.spec is None else spec.scratch
        if self.max_len < _bucket(1) + self._scratch + 1:
            raise ValueError(f"max_len={self.max_len} leaves no room for a request: a prompt bucket of {_bucket(1)}, the "
                             f"round's {self._scratch} scratch slot(s) and one new token need {_bucket(1) + self._scratch + 1}")
        self._target, self._vocab, self._tokenizer = target, vocab, tokenizer
        self._graphs = nnx.split(target), nnx.split(drafter) if drafter is not None else (None, None)
        self._loop = _Loop(self.max_len, None, self.spec, self.thinking)
        (tg, ts), (dg, ds) = self._graphs
        self._leaves = (jax.tree.leaves(ts), jax.tree.leaves(ds) if ds is not None else [])
        self._insert_fn, self._rounds_fn = _slot_programs(tg, dg, jax.tree.structure(ts),
                                                          None if ds is None else jax.tree.structure(ds), self._loop)
        self._busy = [False] * self.num_slots
        self._stops = [set(self.stop_ids)] * self.num_slots
        self._prompt_phase = [budget.BEFORE] * self.num_slots
        self._tickets = [-1] * self.num_slots  # the request in each slot (insert's serial number)
        self._serial = itertools.count()
        self._snaps: collections.deque = collections.deque(maxlen=2)  # (snapshot, host meta) of the last programs
        learned = policy.fresh(self.spec or _NO_SPEC)
        n_tiers = 1 if self.spec is None else len(self.spec.tiers)
        if round_ms is None and self.spec is not None and self.spec.policy == "adaptive":
            self._state = self._empty(jnp.ones((n_tiers,), jnp.float32), learned)
            round_ms = self.measure_round_ms()
        self.round_ms = None if round_ms is None else tuple(float(x) for x in round_ms)
        self._state = self._empty(jnp.asarray(self.round_ms or (1.0,) * n_tiers, jnp.float32), learned)

    def _empty(self, round_ms_T, learned) -> _State:
        (tg, ts), (dg, ds) = self._graphs
        return _slots_empty_jit(tg, ts, dg, ds, round_ms_T, learned, slots=self.num_slots, max_len=self.max_len,
                                stops=self._max_stops, loop=self._loop)

    def measure_round_ms(self, rounds: int = 24, repeats: int = 3) -> list[float]:
        """Milliseconds per round of each speculation tier on this engine (one entry without
        one), every slot busy (a synthetic prompt; a forced tier ignores stop tokens): one
        dispatch of ``rounds`` rounds after the inserts, the fastest of ``repeats`` passes that
        time every tier in turn.  Call with no request running: it fills and frees every slot."""
        if any(self._busy):
            raise RuntimeError("measure_round_ms() fills every slot: call it with none busy (release them first)")
        n_tiers = 1 if self.spec is None else len(self.spec.tiers)
        prompt = list(range(1, min(16, self.max_len // 4) + 1))
        best = [float("inf")] * n_tiers
        for r in range(repeats):
            for tier in ((i + r) % n_tiers for i in range(n_tiers)):
                for s in range(self.num_slots):
                    self.insert(s, prompt, max_new_tokens=self.max_new_tokens_for(len(prompt)))
                jax.block_until_ready(self._state)
                start = time.perf_counter()
                self._dispatch(rounds, tier)
                jax.block_until_ready(self._state)
                ran = int(np.asarray(self._state.step))
                self._snaps.clear()
                best[tier] = min(best[tier], 1e3 * (time.perf_counter() - start) / max(ran, 1))
                for s in range(self.num_slots):
                    self.release(s)
        return best

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
        if _bucket(prompt_len) > self.max_len:
            return 0
        return self.request_len - prompt_len

    def prompt_bucket(self, prompt_len: int) -> int:
        """The padded length a prompt of ``prompt_len`` tokens is prefilled at: a power of two
        (at least 32) when that fits in a slot, else ``max_len`` rounded down to a multiple of
        32 (a prompt that fits in no bucket gets no room: :meth:`max_new_tokens_for`).  There is
        one compiled prefill per bucket, so few exist and a server warms them all up
        (:meth:`warm_buckets`)."""
        b = _bucket(1)
        while b < prompt_len:
            b *= 2
        return b if b <= self.max_len else self._top_bucket

    @property
    def _top_bucket(self) -> int:
        """The longest prefill: ``max_len`` rounded down to a multiple of 32."""
        return self.max_len // _bucket(1) * _bucket(1)

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
        slot = _int_arg("slot", slot, 0, self.num_slots)
        if self._busy[slot]:
            raise ValueError(f"slot {slot} holds a running request: release it first")
        (prompt,) = prompt_rows([prompt_ids] if not isinstance(prompt_ids, str) else prompt_ids, self._vocab,
                                self._tokenizer, row_name="prompt_ids")
        max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 1)
        room = self.max_new_tokens_for(prompt.size)
        if max_new_tokens > room:
            raise ValueError(f"max_new_tokens: a prompt of {prompt.size} tokens leaves room for {max(room, 0)} new "
                             f"tokens in a slot of max_len={self.max_len}, got {max_new_tokens}")
        sampling = _sampling_args(temperature, top_p, top_k, self._vocab)
        seed = _int_arg("seed", seed, 0, 2 ** 32)
        stops = sorted(set(self.stop_ids) | set(_stop_args(stop_token_ids, self._vocab)))
        if len(stops) > self._max_stops:
            raise ValueError(f"stop_token_ids: at most {self._max_stops - len(self.stop_ids)} stop ids per request, "
                             f"got {len(stops) - len(self.stop_ids)}")
        (budget_,) = _budgets(thinking_budget, 1)
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
        self._dispatch(_int_arg("rounds", rounds, 1), -1)

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
        slot = _int_arg("slot", slot, 0, self.num_slots)
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
        lag = _int_arg("lag", lag, 0, 2)
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
            stats = _stats(row, 0.0, self.spec)
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
