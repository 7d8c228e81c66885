"""Where a decode step's and a round's time goes, and whether XLA copies the KV cache.

Three instruments, all on compiled programs:

* :func:`profile_parts` runs a compiled function under the JAX profiler and charges
  each executed XLA op's own time (its duration minus the ops nested in it) to the
  innermost named scope of the round it came from (``draft``, ``verify``,
  ``catch_up``, ``commit``, ``emit``, …, see ``decode/_loop.py``), via the op's metadata in
  the optimized HLO; an op XLA made itself (a copy of a loop carry, a fusion without
  metadata) is charged to the part whose loop or call runs it.
* :func:`cache_ops` lists the ops of an optimized HLO module whose result is at least
  as large as one layer of the KV cache: copies of cache-sized buffers, dtype conversions
  included (what must not happen per step), and in-place updates (dynamic-update-slice,
  scatter).

* :func:`profile_ops` ranks the ops themselves by their own time: which XLA op (a copy XLA
  inserted, a dot, a loop's bookkeeping), how often it runs per call and where it came from.

``eagle3-jax bench --cost`` prints all three (:func:`report`): the parts of the vanilla step
and of the speculative round, the cache-sized copies, and the heaviest ops of ``decode_step``
by batch.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from eagle3_jax import kv_cache, sharding
from eagle3_jax.decode import compile_generate, forced_args, forced_call
from eagle3_jax.speculation import tier_name

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "s64": 8, "f64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"\b(?:condition|body|calls|to_apply|branch_computations)=(\{[^}]*\}|%\S+?)(?=[,\s]|$)")
_NOT_COMPUTED = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}  # aliases, no data moved
_COPIES = {"copy", "convert", "bitcast-convert"}  # rewrite a whole buffer
PARTS = ("prefill", "draft", "verify", "commit", "catch_up", "emit", "step")


def _bytes(dtype: str, dims: str) -> int:
    return _DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def op_parts(hlo_text: str) -> dict[str, str]:
    """HLO instruction name → the innermost round part named in its ``op_name``.  An op that
    names none (XLA's own copies, and ops it rewrote: a dot it turns into a matrix-vector
    product loses its metadata; nor do ops named outside the parts) is charged to the one part
    that all its users in the same computation are charged to (a draft's dot that only the
    draft's softmax reads is the draft's); without users, or with users in several parts, to
    the part of the op that runs its computation (a copy inside the verify's layer loop is the
    verify's), else ``other``."""
    own, comp_of, callers, users = {}, {}, {}, {}
    comp = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if head:
            comp = head.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%(\S+) = ", line)
        if not m:
            continue
        name = m.group(1)
        op = _OP_NAME.search(line)
        scopes = op.group(1).split("/") if op else []
        own[name] = next((s for s in reversed(scopes) if s in PARTS), None)
        comp_of[name] = comp
        # its operands: the ops it names before calls=/body=/... (a result's type names none)
        for operand in re.findall(r"%([\w.-]+)", _CALLED.split(line[m.end():])[0]):
            users.setdefault(operand, []).append(name)
        for called in _CALLED.findall(line):
            for c in re.findall(r"%(\S+?)(?:[,}]|$)", called):
                callers.setdefault(c, name)

    memo = {name: p for name, p in own.items() if p is not None}

    def part(name: str) -> str:  # depth-first without recursion: a loop body's data flow is long
        stack, seen = [name], set()
        while stack:
            n = stack[-1]
            if n in memo:
                stack.pop()
                continue
            mine = [u for u in users.get(n, ()) if comp_of.get(u) == comp_of[n]]
            caller = callers.get(comp_of[n])
            todo = [d for d in (*mine, caller) if d is not None and d not in memo]
            if todo and n not in seen:  # resolve the users and the caller first
                seen.add(n)
                stack.extend(todo)
                continue
            named = {memo.get(u, "other") for u in mine}
            memo[n] = named.pop() if len(named) == 1 else memo.get(caller, "other")
            stack.pop()
        return memo[name]

    return {name: part(name) for name in own}


def large_ops(hlo_text: str, min_bytes: int) -> list[tuple[str, str, int, str, tuple[int, ...]]]:
    """Every op of an optimized HLO module (outside fused computations) with a result of
    ``min_bytes`` or more: ``(name, op, bytes, computation, dims)``.  A fusion is named by
    the op at its root (and the computation it calls is not listed again, whatever XLA named
    it: ``fused_...``, ``wrapped_copy_computation``, ...); ``computation`` is ``ENTRY`` for ops
    that run once per call, else the loop body or called computation that holds them (run per
    iteration)."""
    roots, comp_of, fused, found = {}, {}, set(), []
    comp = None
    lines = hlo_text.splitlines()
    for line in lines:
        head = re.match(r"^(ENTRY )?%(\S+) ", line)
        if head:
            comp = "ENTRY" if head.group(1) else head.group(2)
        m = re.match(r"^\s*ROOT %\S+ = \w+\[[\d,]*\]\S* ([\w-]+)\(", line)
        if m and comp:
            roots[comp] = m.group(1)
        m = _INSTR.match(line)
        if m and comp:
            comp_of[m.group(1)] = comp
            called = re.search(r"calls=%([\w.-]+)", line) if m.group(4) == "fusion" else None
            if called:
                fused.add(called.group(1))
    for line in lines:
        m = _INSTR.match(line)
        if not m or m.group(1) not in comp_of or comp_of[m.group(1)] in fused:  # a fusion's body: listed at its caller
            continue
        name, dtype, dims, op = m.groups()
        size = _bytes(dtype, dims)
        if size < min_bytes or op in _NOT_COMPUTED:
            continue
        if op == "fusion":
            called = re.search(r"calls=%([\w.-]+)", line)
            op = roots.get(called.group(1), "fusion") if called else "fusion"
        found.append((name, op, size, comp_of[name], tuple(int(d) for d in dims.split(",") if d)))
    return found


def cache_ops(hlo_text: str, min_bytes: int, slots: int | None = None) -> dict:
    """The ops of :func:`large_ops` that copy or update a buffer of ``min_bytes`` or more
    (one cache layer, say) and, when ``slots`` is given, with a dimension of that many
    (the cache's): ``{"copy": [...], "in_place": [...]}``.  A ``copy`` of that size inside a
    loop is a cache copy per iteration, and so is a conversion of it to another dtype
    (``convert``, ``bitcast-convert``: XLA:CPU's way of updating a 16-bit float buffer);
    dynamic-update-slice and scatter are updates in place (XLA aliases their buffer)."""
    ops = [o for o in large_ops(hlo_text, min_bytes) if slots is None or slots in o[4]]
    return {"copy": [o for o in ops if o[1] in _COPIES],
            "in_place": [o for o in ops if o[1] in ("dynamic-update-slice", "scatter")]}


def profile_parts(compiled, *args, repeats: int = 5) -> dict[str, float]:
    """Microseconds of ``compiled(*args)`` charged to each round part (exclusive op time from
    the profiler trace; ``other`` = ops outside any named part): each part's least over
    ``repeats`` calls, each traced on its own, so that a spell in which a shared machine's other
    work preempts an op adds to none of them."""
    return _least_over_calls(compiled, lambda: args, op_parts(compiled.as_text()), repeats)[0]


def profile_ops(compiled, *args, repeats: int = 5, top: int = 10, fresh_args=None) -> list[dict]:
    """The ``top`` ops of ``compiled(*args)`` by their own time (the profiler's exclusive time
    of every execution in a call, summed; each op's least over ``repeats`` traced calls):
    ``{"op", "us", "runs", "shape", "scope"}`` per op, heaviest first: its HLO name (XLA
    names a fusion after the ops in it: ``dynamic-slice_bitcast_fusion`` copies a slice out of
    a larger buffer), how many times one call runs it (16 for an op in a 16-layer loop), its
    result's shape and the end of its ``op_name`` (empty for an op XLA made itself).

    A program that donates its inputs (a decode step updating its cache in place) takes
    ``fresh_args``: a function returning new ``args`` for each call, made before it is traced."""
    info = _op_info(compiled.as_text())
    best, runs = _least_over_calls(compiled, fresh_args or (lambda: args), {name: name for name in info}, repeats)
    return [{"op": k, "us": us, "runs": runs.get(k, 0), **info[k]} for k, us in list(best.items())[:top]]


def _least_over_calls(compiled, call_args, key_of: dict[str, str], repeats: int):
    """``compiled(*call_args())`` once untimed, then ``repeats`` times under the profiler:
    each key's least exclusive microseconds over the calls (heaviest first), and how many op
    executions the first traced call had per key."""
    jax.block_until_ready(compiled(*call_args()))
    calls = [_traced_parts(compiled, call_args(), key_of) for _ in range(repeats)]
    best = {k: min(c[0].get(k, 0.0) for c in calls) for k in set().union(*(c[0] for c in calls))}
    return dict(sorted(best.items(), key=lambda kv: -kv[1])), calls[0][1]


def _op_info(hlo_text: str) -> dict[str, dict]:
    """HLO instruction name → ``{"shape", "scope"}`` (see :func:`profile_ops`)."""
    found = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT )?%(\S+) = (.*?) [\w-]+\(", line)
        if m:
            shape = re.sub(r"\{[^}]*\}", "", m.group(2))  # without the layout
            op = _OP_NAME.search(line)
            found[m.group(1)] = {"shape": "(tuple)" if shape.startswith("(") else shape,
                                 "scope": "/".join(op.group(1).split("/")[-2:]) if op else ""}
    return found


def _traced_parts(compiled, args, parts: dict[str, str]) -> tuple[dict[str, float], dict[str, int]]:
    """One call of ``compiled(*args)`` under the profiler: exclusive microseconds per part,
    and how many op executions each part had."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        try:
            jax.block_until_ready(compiled(*args))
        finally:
            jax.profiler.stop_trace()
        trace = next(Path(d).rglob("*.trace.json.gz"), None)
        if trace is None:
            raise RuntimeError("the JAX profiler wrote no perfetto trace")
        events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = [e for e in events if e.get("ph") == "X" and e.get("name") in parts]
    totals: dict[str, float] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():  # exclusive time: minus the ops nested inside (while bodies, calls)
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, event, child time]
        def close(entry):
            totals[parts[entry[1]["name"]]] += entry[1]["dur"] - entry[2]
            counts[parts[entry[1]["name"]]] += 1
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                close(stack.pop())
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e, 0.0])
        while stack:
            close(stack.pop())
    return dict(totals), dict(counts)


def step_ms(target, shapes, live: int = 33, calls: int = 30, turns: int = 3, *, mesh=None,
            rules=None) -> dict[tuple[int, int], float]:
    """Median milliseconds of ``target.decode_step`` for each ``(batch, slots)`` of ``shapes``:
    ``batch`` sequences of ``live`` committed tokens in a cache of ``slots`` slots (the live
    length is held fixed).  The shapes take ``turns`` turns of ``calls / turns`` timed calls
    each (after two untimed ones, so that each runs back to back as in a decode loop): a slow
    spell of a shared machine falls on all of them, and their ratios hold.

    ``mesh``: a batch that the mesh's batch axes split runs on it (the weights placed by their
    declared axes, the cache by ``kv_cache.CACHE_AXES``, as ``generate(..., mesh=)`` decodes;
    see :func:`on_mesh`), ``rules`` overriding ``sharding.RULES``; any other batch on one device."""
    mesh = None if mesh is None else sharding.auto_mesh(mesh)
    models = {shape: _step_model(target, shape[0], mesh, rules) for shape in shapes}
    caches = {}
    for (batch, slots), (model, cache_sharding) in models.items():
        cache = model.prefill(np.ones((batch, live), np.int32), np.full(batch, live), slots)[2]
        caches[batch, slots] = kv_cache.constrain(cache, cache_sharding)
    times = {shape: [] for shape in caches}
    for _ in range(turns):
        for shape in caches:
            tokens = np.ones((shape[0],), np.int32)
            for i in range(2 + -(-calls // turns)):
                start = time.perf_counter()
                logits, _, cache = models[shape][0].decode_step(caches[shape], tokens)
                jax.block_until_ready(logits)
                if i >= 2:
                    times[shape].append(time.perf_counter() - start)
                caches[shape] = dataclasses.replace(cache, lengths=cache.lengths - 1)
    return {shape: 1e3 * float(np.median(t)) for shape, t in times.items()}


def on_mesh(mesh, batch: int, rules=None) -> bool:
    """Whether ``mesh``'s batch axes (``sharding.RULES``, or ``rules`` over them) split
    ``batch`` rows over more than one device (and evenly)."""
    shards = sharding.batch_shards(mesh, rules)
    return shards > 1 and batch % shards == 0


def _step_model(target, batch: int, mesh, rules=None):
    """``(target, cache sharding)`` for a decode step of ``batch`` rows: placed on ``mesh`` by
    ``rules`` when it splits them (:func:`on_mesh`), else ``target`` as it is and ``None``."""
    if not on_mesh(mesh, batch, rules):
        return target, None
    placed = sharding.place_model(target, mesh, rules)
    cfg = target.config
    shape = (cfg.num_layers, batch, 1, cfg.num_kv_heads, cfg.head_dim)  # the layout does not depend on the slots
    return placed, kv_cache.layout(shape, mesh, rules, name="target KV cache")


def step_ops(target, batch: int, live: int = 33, slots: int = 256, *, top: int = 8, repeats: int = 5) -> list[dict]:
    """:func:`profile_ops` of ``target.decode_step`` for ``batch`` sequences of ``live``
    committed tokens in a cache of ``slots`` slots: the ops a step spends its time in."""
    cache = target.prefill(np.ones((batch, live), np.int32), np.full(batch, live), slots)[2]
    graphdef, state = nnx.split(target)
    # the cache donated, as decode_step's own jit does: written in place, not copied
    step = jax.jit(lambda state, cache, tokens: nnx.merge(graphdef, state).decode_step(cache, tokens),
                   donate_argnums=1)
    tokens = np.ones((batch,), np.int32)
    return profile_ops(step.lower(state, cache, tokens).compile(), repeats=repeats, top=top,
                       fresh_args=lambda: (state, jax.tree.map(jax.numpy.copy, cache), tokens))


def forced_rounds(programs, new_tokens: int, per_round: int, *, tier: int = 0, repeats: int = 3,
                  parts: bool = True) -> list[dict]:
    """What one round of a compiled decode loop costs, apart from what a call costs besides
    its rounds (the cache's allocation, the prefill, the launch, the output's transfer), for
    each of ``programs``: ``(compiled, args)`` pairs of ``decode.compile_generate`` (one
    request compiled for several ``max_new_tokens``, say).

    Each program is called for as many rounds as make ``new_tokens`` (at most its
    ``max_new_tokens``) when every draft is accepted, the prefill making the first token and a
    round at most ``per_round`` (the tier's ``TreeConfig.path_len``; 1 for plain steps), and
    for a quarter as many, speculation tier ``tier`` forced (``decode.forced_args``: stop
    tokens ignored, so that a short answer runs as many rounds as a long one); each call is
    the fastest of ``repeats``, the programs and their two calls taking turns so that a slow
    spell of a shared machine falls on all of them, and a round costs the difference of the
    two calls over the difference in rounds run.  Returns, per program, ``{"rounds",
    "round_ms", "parts_us"}``: rounds in the difference, wall milliseconds per round, and
    each part's op time per round under the profiler (:func:`profile_parts`, each part's
    least of ``repeats`` calls; ``other``: the loop's own ops; empty with ``parts=False``, which
    skips the profiler's calls)."""
    most = max((new_tokens - 1) // per_round, 2)
    rounds = (max(most // 4, 1), most)
    for compiled, args in programs:
        forced_call(compiled, args, tier, rounds[0])  # the program's first run
    best = [[float("inf")] * 2 for _ in programs]
    ran = [[0, 0] for _ in programs]
    for _ in range(repeats):
        for p, (compiled, args) in enumerate(programs):
            for i, r in enumerate(rounds):
                seconds, ran[p][i] = forced_call(compiled, args, tier, r)
                best[p][i] = min(best[p][i], seconds)
    out = []
    for (compiled, args), (short_s, long_s), (short_n, long_n) in zip(programs, best, ran):
        n = max(long_n - short_n, 1)
        us = {}
        if parts:
            short, long = (profile_parts(compiled, *forced_args(args, tier, r), repeats=repeats) for r in rounds)
            us = {k: max(long.get(k, 0.0) - short.get(k, 0.0), 0.0) / n for k in long.keys() | short.keys()}
        out.append({"rounds": n, "round_ms": 1e3 * max(long_s - short_s, 0.0) / n,
                    "parts_us": dict(sorted(us.items(), key=lambda kv: -kv[1]))})
    return out


def loop_report(target, drafter, prompt: list[int], tree, max_news, *, batch: int = 1, repeats: int = 5,
                log=print) -> list[dict]:
    """One request (``prompt`` repeated ``batch`` times) through the compiled decode loop at
    each ``max_new_tokens`` of ``max_news``, vanilla and speculative: ms per step / round, the
    round's parts (profiler), and the cache-sized copies XLA left inside the loop.

    Every program times the same rounds, those of the smallest ``max_new_tokens`` (see
    :func:`forced_rounds`, ``repeats`` turns of the programs of a mode), over the same live prefix, so
    that only the cache's capacity differs between them.  Returns one dict per
    ``max_new_tokens``."""
    max_news = list(max_news)
    if not max_news:
        raise ValueError("loop_report: max_news names no max_new_tokens to time")
    forced_tokens = min(max_news)
    out = [{"max_new_tokens": m, "forced_tokens": forced_tokens, "batch": batch} for m in max_news]
    cfg = target.config
    for mode, d in (("vanilla", None), ("eagle3", drafter)):
        programs = [compile_generate(target, d, [prompt] * batch, max_new_tokens=m, tree=tree) for m in max_news]
        timed = forced_rounds(programs, forced_tokens, tree.path_len if d is not None else 1, repeats=repeats)
        for rep, (compiled, args), forced in zip(out, programs, timed):
            m = rep["max_new_tokens"]
            max_len = args[-1].prompt_BxT.shape[1] + m + (tree.scratch if d is not None else 1)
            layer_bytes = batch * max_len * cfg.num_kv_heads * cfg.head_dim * target.cache_dtype.itemsize
            ops = cache_ops(compiled.as_text(), layer_bytes, slots=max_len)
            loop_copies = [o for o in ops["copy"] if o[3] != "ENTRY"]
            round_us = {k: v for k, v in forced["parts_us"].items() if v >= 5.0}  # the prefill's ops cancel out
            rep[mode] = {"rounds": forced["rounds"], "ms_per_round": forced["round_ms"], "cache_slots": max_len,
                         "us_per_round": round_us, "loop_cache_copies": len(loop_copies),
                         "in_place_updates": len([o for o in ops["in_place"] if o[3] != "ENTRY"])}
            shown = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in round_us.items())
            log(f"  {mode:7s} max_new={m} batch={batch} cache={max_len} slots: {forced['round_ms']:.2f} ms/round over "
                f"{forced['rounds']} forced rounds; op ms/round: {shown}; cache-sized copies in the loop: {len(loop_copies)}")
    return out


def report(target, drafter, prompt, tree, max_news, batches, mesh=None, rules=None) -> dict:
    """Where a step's and a round's time goes (``eagle3-jax bench --cost``), printed and
    returned: :func:`step_ms` by cache slots (batch 1) and by batch (256 slots) from one timing
    run, the step's heaviest ops (:func:`step_ops`) at batches 1 and 32, and
    :func:`loop_report` of one request ``prompt`` at each batch of ``batches`` and each
    ``max_new_tokens`` of ``max_news`` (``mesh``: the batches it splits step on it, placed by
    ``rules``)."""
    print("decode_step ms at 33 live tokens, by cache slots (batch 1) and by batch (256 slots"
          + (f"; * on the mesh {dict(mesh.shape)}" if mesh is not None else "") + "):")
    # one timing run, all shapes taking turns: the batch-1, 256-slot step divides both ratios
    step_slots, step_batches = (256, 1024, 4096, 16384), (1, 8, 32)
    step = step_ms(target, [(1, s) for s in step_slots] + [(b, 256) for b in step_batches[1:]], mesh=mesh,
                   rules=rules)
    by_slots = {s: step[1, s] for s in step_slots}
    by_batch = {b: step[b, 256] for b in step_batches}
    print("  slots  " + "  ".join(f"{s}: {ms:.2f}" for s, ms in by_slots.items())
          + f"   ({by_slots[16384] / by_slots[256]:.2f}x from 256 to 16384)")
    print("  batch  " + "  ".join(f"{b}{'*' if on_mesh(mesh, b, rules) else ''}: {ms:.2f}"
                                   for b, ms in by_batch.items())
          + f"   ({by_batch[32] / by_batch[1]:.2f}x from 1 to 32)")
    heaviest = {b: step_ops(target, b) for b in (1, 32)}
    for b, ops in heaviest.items():
        print(f"  its heaviest XLA ops at batch {b} (own ms per step, runs per step, result, op_name):")
        for o in ops:
            print(f"    {o['us'] / 1e3:6.3f} ms {o['runs']:4d}x  {o['op']:36s} {o['shape']:22s} {o['scope']}")
    print(f"decode loop, one request, {tier_name(tree)}, the rounds of {min(max_news)} new tokens timed at each "
          "max_new_tokens (the same live prefix, caches of different capacity"
          + ("; on one device" if mesh is not None else "") + "):")
    loops = [rep for b in batches for rep in loop_report(target, drafter, prompt, tree, max_news, batch=b)]
    return {"step_ms_by_slots": by_slots, "step_ms_by_batch": by_batch, "step_heaviest_ops": heaviest, "loops": loops,
            "step_mesh": None if mesh is None else {"axes": dict(mesh.shape),
                                                    "batches": [b for b in by_batch if on_mesh(mesh, b, rules)]}}
