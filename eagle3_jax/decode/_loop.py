"""The decode loop: the prefill, then draft → verify → commit rounds inside one
``lax.while_loop`` (no host round-trip per round), for any batch size, and its jitted entry
(``run_loop``: the models' graphs and states, the call's ``LoopInputs`` and ``LoopStatics``).

A drafter of ``None`` runs vanilla autoregressive decoding through the same loop and the
same stop logic; it is the baseline of every speedup figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax import budget, kv_cache, layers
from eagle3_jax import speculation as policy
from eagle3_jax.decode._state import (NO_SPEC, Loop, LoopInputs, LoopStatics, State, Think, sampling_of, set_rows,
                                      split_keys, stop_rows, take_rows)
from eagle3_jax.tree import TreeConfig, expand, forced_chain
from eagle3_jax.verify import sample, verify


def emit(st: State, new_BxP, count_B, loop: Loop, round_B=None) -> State:
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


def end_id_array(thinking: budget.ThinkingConfig):
    return jnp.asarray(thinking.end_ids, jnp.int32)


def budget_cut(think: Think, cand_BxP, count_B, active_B, prev_B, thinking: budget.ThinkingConfig):
    """Applies the budget to a round's candidate tokens (``prev``: the token emitted before
    them): ``(keep_B, hit_B, token_B, force_B)`` — the candidates kept, whether the next one
    is replaced, the end-of-thinking token replacing it (``E[1]`` when the thought already
    ends with ``E[0]``, e.g. a newline) and the forcing index afterwards."""
    keep, hit = budget.cut(cand_BxP, count_B, think.phase, think.content, think.budget, think.force >= 0, thinking)
    hit = hit & active_B
    end = end_id_array(thinking)
    m = len(thinking.end_ids)
    last = jnp.where(keep > 0, jnp.take_along_axis(cand_BxP, jnp.maximum(keep - 1, 0)[:, None], 1)[:, 0], prev_B)
    skip = (last == end[0]) & (m > 1)
    first = jnp.where(skip, 1, 0)
    token = end[first]
    force = jnp.where(first + 1 < m, first + 1, -1)
    return keep, hit, token, jnp.where(hit, force, think.force)


def prefill_state(target, drafter, prompt_BxT, lengths_B, key_B, budget_B, phase_B, stops_BxS, limit_B, rows, *,
                  cache_len: int, loop: Loop) -> State:
    """Runs the prompts through the target (and the drafter) into fresh caches of
    ``cache_len`` slots and emits the first token of each row."""
    B, T = prompt_BxT.shape
    W, thinking = loop.width, loop.thinking
    think = None
    if thinking is not None:
        zeros = jnp.zeros((B,), jnp.int32)
        think = Think(budget_B, phase_B, zeros, zeros, jnp.full((B,), -1, jnp.int32), jnp.zeros((B,), bool),
                      jnp.zeros((B, W), bool))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    tcache = kv_cache.constrain(target.init_cache(B, cache_len), loop.cache_shardings[0])
    # the head on each prompt's last token only: [B, T, V] logits would be the prefill's
    # largest buffer by far for a real vocabulary (32 prompts of 2k tokens, 128k ids: 34 GB)
    logits_BxV, feats, tcache = target(prompt_BxT, pos, cache=tcache, logits_at_B=lengths_B - 1)
    tcache = kv_cache.advance(tcache, lengths_B)
    key_B, sub = split_keys(key_B)
    first = sample(sub, logits_BxV, loop.sampling if loop.sampling is not None else rows)
    if thinking is not None:  # B = 0 on a prompt that opens thinking: the first token is already E[0]
        _, hit, token, force = budget_cut(think, first[:, None], jnp.ones((B,), jnp.int32), jnp.ones((B,), bool),
                                          layers.row_get(prompt_BxT, lengths_B - 1), thinking)
        first = jnp.where(hit, token, first)
        think = dataclasses.replace(think, force=force, forced=hit)
    dcache = last_hidden = round_tier = None
    if drafter is not None:
        # drafter position j pairs the feature at j with token j+1 (the first token is the root)
        ids = jnp.where(jnp.arange(T)[None] == lengths_B[:, None] - 1, first[:, None], jnp.roll(prompt_BxT, -1, 1))
        dcache = kv_cache.constrain(drafter.init_cache(B, cache_len), loop.cache_shardings[1], loop.hidden_sharding)
        dout, dcache = drafter(feats, ids, pos, cache=dcache)
        dcache = kv_cache.advance(dcache, lengths_B)
        last_hidden = layers.row_get(dout, lengths_B - 1)
        round_tier = jnp.zeros((B, W), jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    st = State(tcache, dcache, first, last_hidden, jnp.zeros((B, W), jnp.int32), zeros, jnp.zeros((B,), bool),
               jnp.full((B, W), -1, jnp.int32), zeros, jnp.int32(0), key_B, stops_BxS, limit_B, rows, think,
               round_tier=round_tier)
    return emit(st, first[:, None], jnp.ones((B,), jnp.int32), loop)


def target_step(target, st: State, loop: Loop):
    """One target step per active row (no drafter): ``(state, features_Bx3H of the fed token,
    the token emitted after it, the round's record_B)`` (record: 0, -2 when forced, -1 for a
    row that is done); records a round of tier 0."""
    thinking = loop.thinking
    B = st.root.shape[0]
    with jax.named_scope("step"):
        logits, feats, tcache = target(st.root[:, None], st.tcache.lengths[:, None], cache=st.tcache)
        key, sub = split_keys(st.key)
        nxt = sample(sub, logits[:, 0], sampling_of(st, loop))
    with jax.named_scope("emit"):
        active = ~st.done
        think, forcing = st.think, jnp.zeros((B,), bool)
        if thinking is not None:
            end_ids, m = end_id_array(thinking), len(thinking.end_ids)
            forcing = active & (think.force >= 0)
            nxt = jnp.where(forcing, end_ids[jnp.maximum(think.force, 0)], nxt)
            force = jnp.where(forcing, jnp.where(think.force + 1 < m, think.force + 1, -1), think.force)
            _, hit, token, force = budget_cut(dataclasses.replace(think, force=force), nxt[:, None],
                                              active.astype(jnp.int32), active & ~forcing, st.root, thinking)
            nxt = jnp.where(hit, token, nxt)
            think = dataclasses.replace(think, force=force, forced=think.forced | hit)
        record = jnp.where(active, jnp.where(forcing, -2, 0), -1)
        st = dataclasses.replace(st, tcache=kv_cache.advance(tcache, active.astype(jnp.int32)),
                                 root=jnp.where(active, nxt, st.root), key=key, think=think,
                                 accept=layers.row_set(st.accept, st.rounds, record))
        st = emit(st, nxt[:, None], active.astype(jnp.int32), loop, st.rounds)
        return dataclasses.replace(st, rounds=st.rounds + active, step=st.step + 1), feats[:, 0], nxt, record


def vanilla_round(target, st: State, loop: Loop) -> State:
    """One target step per active row: vanilla decoding."""
    return target_step(target, st, loop)[0]


def burst_rounds(target, drafter, st: State, loop: Loop, cap, force_tier, min_active: int = 0) -> State:
    """Rounds of the ``None`` tier (no drafting) while the policy keeps it: up to ``loop.burst``
    plain target steps, then one drafter catch-up over the tokens they committed, so that
    falling back costs about a vanilla step per token.  Each step is a round (of tier ``None``)
    for the records and the policy."""
    B, n = st.root.shape[0], loop.burst
    none = loop.spec.tiers.index(None)

    def step(carry):
        i, s, feats_BxNxF, tokens_BxN, count_B = carry
        rounds = s.rounds
        s, feats, nxt, record = target_step(target, s, loop)
        active = record != -1
        s = dataclasses.replace(
            s, ctl=policy.update(s.ctl, loop.spec, jnp.maximum(record, 0), record >= 0),
            round_tier=layers.row_set(s.round_tier, rounds, jnp.where(active, none, 0)))
        return (i + 1, s, feats_BxNxF.at[:, i].set(feats.astype(feats_BxNxF.dtype)), tokens_BxN.at[:, i].set(nxt),
                count_B + active)

    F = target.config.feature_width
    carry = (jnp.int32(0), st, jnp.zeros((B, n, F), target.dtype), jnp.zeros((B, n), jnp.int32),
             jnp.zeros((B,), jnp.int32))
    _, st2, feats_BxNxF, tokens_BxN, count_B = jax.lax.while_loop(
        lambda c: (c[0] < n) & still_going(c[1], cap, min_active, loop.row_shards) & (next_tier(c[1], force_tier) == none),
        step, carry)
    with jax.named_scope("catch_up"):  # drafter position j pairs the feature at j with the token after it
        dpos = st.dcache.lengths[:, None] + jnp.arange(n)[None]
        dout, dcache = drafter(feats_BxNxF, tokens_BxN, dpos, cache=st.dcache)
    last = jnp.where((count_B > 0)[:, None], layers.row_get(dout, jnp.maximum(count_B - 1, 0)), st.last_hidden)
    return dataclasses.replace(st2, dcache=kv_cache.advance(dcache, count_B), last_hidden=last)


def propose(target, drafter, st: State, active_B, sub_B, tree: TreeConfig, loop: Loop):
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
            end_ids, m = end_id_array(thinking), len(thinking.end_ids)
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
        path, accepted, bonus = verify(t, logits, sub_B, sampling_of(st, loop), tree.top_k, force_B=forcing)
        node = jnp.maximum(path, 0)
        drafted = jnp.take_along_axis(t.tokens, jnp.concatenate([node[:, 1:], node[:, :1]], 1), 1)
        return path, accepted, bonus, drafted, jnp.take_along_axis(feats, node[..., None], 1), new_kv, n_forced


def spec_round(target, drafter, st: State, loop: Loop, tier: int) -> State:
    """One round of drafting tier ``tier`` (an index into the tiers): its proposal, then the
    commit, the drafter's catch-up and the output bookkeeping that every tier shares."""
    spec, thinking = loop.spec, loop.thinking
    B = st.root.shape[0]
    active = ~st.done
    think, forcing = st.think, jnp.zeros((B,), bool)
    key, sub = split_keys(st.key)
    path, accepted, bonus, drafted, path_feats, tree_kv, n_forced = propose(target, drafter, st, active, sub,
                                                                            spec.tiers[tier], loop)
    # the round's own path length: a short tier's commit and catch-up cost no more than its own
    j = jnp.arange(path.shape[1])[None]
    if thinking is not None:
        end_ids, m = end_id_array(thinking), len(thinking.end_ids)
        forcing = active & (think.force >= 0)
        start = jnp.maximum(think.force, 0)
        done_forcing = start + n_forced >= m
        bonus = jnp.where(forcing & ~done_forcing, end_ids[jnp.minimum(start + n_forced, m - 1)], bonus)
        force = jnp.where(forcing, jnp.where(~done_forcing & (start + n_forced + 1 < m), start + n_forced + 1, -1),
                          think.force)
        cand = jnp.where(j < accepted[:, None], drafted, bonus[:, None])
        keep, hit, token, force = budget_cut(dataclasses.replace(think, force=force), cand, accepted + 1,
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
        st2 = emit(st2, new, count, loop, st.rounds)
        return dataclasses.replace(st2, rounds=st.rounds + active, step=st.step + 1)


def run_rounds(target, drafter, st: State, loop: Loop, force_tier, cap, min_active: int = 0,
               keep_stops=False) -> State:
    """Rounds until at most ``min_active`` rows are still decoding (every row done, by
    default) or ``cap`` rounds ran: the loop of ``generate`` (of each of its phases) and of
    the slot engine's dispatches.  ``keep_stops``: stop tokens end rows even in a forced
    tier (see below)."""
    tiers = () if loop.spec is None else loop.spec.tiers
    burst = functools.partial(burst_rounds, target, drafter, loop=loop, cap=cap, force_tier=force_tier, min_active=min_active)
    going = functools.partial(still_going, cap=cap, min_active=min_active, shards=loop.row_shards)

    def tier_rounds(i: int):
        return functools.partial(spec_round, target, drafter, loop=loop, tier=i)

    if loop.spec is None:
        body = functools.partial(vanilla_round, target, loop=loop)
    elif len(tiers) == 1:
        body = burst if tiers[0] is None else tier_rounds(0)
    else:
        # One loop per tier, in turn: each runs its tier's rounds while the policy keeps it (the
        # None tier as bursts, so that a pass that does not stop there runs no catch-up).
        # Straight-line rounds, no conditional around the caches: XLA would copy buffers into
        # and out of the branches of a switch.
        def body(s):
            for i, t in enumerate(tiers):
                s = jax.lax.while_loop(lambda s, i=i: going(s) & (next_tier(s, force_tier) == i),
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
# (see ``phase_rows``).
COMPACT_FROM = 8


COMPACT_MIN_NEW_TOKENS = 64


def phase_rows(batch: int, max_new_tokens: int, shards: int = 1) -> tuple[int, ...]:
    """The rows each phase of ``generate``'s loop runs on: the whole batch, then, once at most
    half of its rows are still decoding, those gathered into half as many rows, then into a
    quarter.  A static batch pays for its finished rows until its longest answer ends (the
    built-in pair's first 64 eval prompts at batch 32, 256 new tokens: 45% of its row-steps
    make a token; in phases, 1.6x the tokens/s, ``scripts/phases_bench.py``).  From
    ``COMPACT_FROM`` rows and ``COMPACT_MIN_NEW_TOKENS`` new tokens on (each phase compiles a
    loop of its own, and moves the rows it keeps).  On a mesh whose data axes split the batch
    over ``shards`` devices, the phases whose rows they split evenly: each device gathers its
    own rows (see ``phased_rounds``)."""
    if batch < COMPACT_FROM or max_new_tokens < COMPACT_MIN_NEW_TOKENS:
        return (batch,)
    return tuple(rows for rows in (batch, batch // 2, batch // 4) if rows % shards == 0)


def phased_rounds(target, drafter, st: State, loop: Loop, force_tier, cap, phases: tuple[int, ...],
                  keep_stops=False) -> State:
    """``run_rounds`` over the phases of ``phase_rows``: each phase runs until the rows still
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
            st, idx = take_rows(st, pick, shards), pick if idx is None else idx[pick]
        st = run_rounds(target, drafter, st, loop, force_tier, left, min_active=phases[i + 1] if i + 1 < len(phases) else 0,
                        keep_stops=keep_stops)
        left = left - st.step
        rows_st = dataclasses.replace(st, tcache=None, dcache=None)
        whole = rows_st if whole is None else set_rows(whole, rows_st, idx)
    return whole


def still_going(st: State, cap, min_active: int = 0, shards: int = 1):
    """Whether the loop goes on: below ``cap`` steps, with more than ``min_active`` rows still
    decoding (on a batch split over ``shards`` devices, more than their share on some device)."""
    active = (~st.done).reshape(shards, -1).sum(1).max()
    return (active > min_active // shards) & (st.step < cap)


def next_tier(st: State, force_tier):
    """The tier of the next round: the policy's, or ``force_tier`` when measuring one (>= 0)."""
    return jnp.where(force_tier >= 0, force_tier, st.ctl.tier)


def prefill_call(target, drafter, inputs: LoopInputs, statics: LoopStatics, loop: Loop) -> State:
    """The state after the prefill of a ``generate`` call (its first token emitted; row b's
    key ``fold_in(inputs.key, b)``), with the policy started from ``inputs.learned``."""
    B = inputs.prompt_BxT.shape[0]
    keys = jax.vmap(lambda i: jax.random.fold_in(inputs.key, i))(jnp.arange(B))  # row b's key: fold_in(seed key, b)
    with jax.named_scope("prefill"):
        st = prefill_state(target, drafter, inputs.prompt_BxT, inputs.lengths_B, keys, inputs.budget_B,
                           inputs.phase_B, stop_rows(statics.stop_ids, B), jnp.full((B,), statics.max_new, jnp.int32),
                           None, cache_len=statics.max_len, loop=loop)
    if drafter is not None:
        st = dataclasses.replace(st, ctl=policy.init(loop.spec, inputs.round_ms_T, inputs.learned))
    return st


def run_loop(tgraph, tstate, dgraph, dstate, inputs: LoopInputs, statics: LoopStatics) -> dict:
    """``generate``'s program: the prefill, then the rounds (in phases) until every row is done
    or ``inputs.round_cap`` rounds ran.  Returns the rows' outputs, round records, the tier of
    each round and what the policy learned, and the thinking state when tracked."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    loop = statics.loop(statics.spec if drafter is not None else None)
    with kernel_mesh(target, loop):
        return _run_loop_on(target, drafter, inputs, statics, loop)


def kernel_mesh(target, loop: Loop):
    """For a target with a kernel attention, the mesh of the loop's caches as the tracing
    context's (``jax.sharding.use_abstract_mesh``), where there is one: the kernels run per
    device under ``shard_map`` over it (``pallas_kernels.tree_attention.per_device``)."""
    layout = loop.cache_shardings[0]
    if layout is None or target.attention_impl == "xla":
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh)


def _run_loop_on(target, drafter, inputs: LoopInputs, statics: LoopStatics, loop: Loop) -> dict:
    B = inputs.prompt_BxT.shape[0]
    st = prefill_call(target, drafter, inputs, statics, loop)
    st = phased_rounds(target, drafter, st, loop, inputs.force_tier, jnp.minimum(statics.max_new, inputs.round_cap),
                       statics.phases or (B,), keep_stops=inputs.keep_stops)
    out = {"out": st.out, "n_out": st.n_out, "accept": st.accept}
    if st.round_tier is not None:
        out["round_tier"] = st.round_tier
        out["learned"] = policy.learned(st.ctl)
    if loop.thinking is not None:
        out.update(phase=st.think.phase, thinking=st.think.thinking, forced=st.think.forced,
                   round_thinking=st.think.round_thinking)
    return out


def loop_jit():
    """A jit of :func:`run_loop` of its own, so that JAX's tracing, lowering and compilation caches
    (keyed weakly on the function) let its program go with the last reference to it: a jit
    kept for the process would keep every program it ever compiled (on XLA:CPU, hundreds to
    thousands of memory mappings each, against a default limit of 65530 per process)."""
    @functools.wraps(run_loop)  # the same name (``jit(run_loop)`` in profiles) and signature
    def run(*args, **kw):
        return run_loop(*args, **kw)

    return jax.jit(run, static_argnums=(0, 2, 5))


def lower_loop(tgraph, tstate, dgraph, dstate, prompt_shape, statics: LoopStatics) -> jax.stages.Lowered:
    """The loop lowered for ``prompt_shape`` prompts; the states may be concrete or
    ``ShapeDtypeStruct`` s with shardings."""
    sds = jax.ShapeDtypeStruct
    batch = sds(prompt_shape[:1], jnp.int32)
    tiers = statics.spec.tiers if statics.spec is not None else (None,)
    inputs = LoopInputs(sds(prompt_shape, jnp.int32), batch, jax.random.key(0), batch, batch,
                        sds((len(tiers),), jnp.float32), sds((), jnp.int32), sds((), jnp.int32), sds((), jnp.bool_),
                        jax.tree.map(lambda x: sds(x.shape, x.dtype), policy.fresh(statics.spec or NO_SPEC)))
    return loop_jit().lower(tgraph, tstate, dgraph, dstate, inputs, statics)
