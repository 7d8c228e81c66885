"""``generate`` and its statistics, and the compiled program it runs for inspection and
ahead-of-time compilation (``compile_generate``, ``lower_generate``, ``lower_parts``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import budget, limits, sharding
from eagle3_jax import speculation as policy
from eagle3_jax.decode._loop import kernel_mesh, lower_loop, prefill_call, spec_round, vanilla_round
from eagle3_jax.decode._measure import forced_args, round_costs, timed_call
from eagle3_jax.decode._programs import PROGRAMS, ProgramCache
from eagle3_jax.decode._request import prepare
from eagle3_jax.decode._state import NO_SPEC, LoopInputs
from eagle3_jax.models.drafter import declare as declare_drafter
from eagle3_jax.models.target import declare as declare_target
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig


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
    return lower_loop(tgraph, tstate, dgraph, dstate, req.prompt_BxT.shape, req.statics)


def _placed_request(target, drafter, batch: int, prompt_len: int, max_new_tokens: int, mesh, rules, kwargs: dict):
    """``generate``'s request for ``batch`` prompts of ``prompt_len`` tokens (the ids only shape
    the programs) and the models' split states placed on its mesh."""
    limits.check("batch", batch, limits.POSITIVE)
    limits.check("prompt_len", prompt_len, limits.POSITIVE)
    req = prepare(target, drafter, [[0] * prompt_len] * batch, max_new_tokens=max_new_tokens, mesh=mesh, rules=rules,
                  **{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "tree": TreeConfig(), "seed": 0,
                      "stop_token_ids": None, "tokenizer": None, **kwargs})
    return req, *placed(target, drafter, req.mesh, None if req.rules is None else dict(req.rules))


def placed(target, drafter, mesh, rules) -> tuple[tuple, tuple]:
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
    statics = req.statics
    spec = statics.spec
    loop = statics.loop(spec)

    def prefill(tstate, dstate, prompt_BxT, lengths_B, budget_B, phase_B, round_ms_T, learned):
        target_, drafter_ = nnx.merge(tgraph, tstate), None if dgraph is None else nnx.merge(dgraph, dstate)
        inputs = LoopInputs(prompt_BxT, lengths_B, jax.random.key(0), budget_B, phase_B, round_ms_T, None, None, None,
                            learned)
        with kernel_mesh(target_, loop):
            return prefill_call(target_, drafter_, inputs, statics, loop)

    def one_round(tier, tstate, dstate, st):
        target_, drafter_ = nnx.merge(tgraph, tstate), None if dgraph is None else nnx.merge(dgraph, dstate)
        with kernel_mesh(target_, loop):
            if tier is None:
                return vanilla_round(target_, st, loop)
            return spec_round(target_, drafter_, st, loop, tier)

    sds = jax.ShapeDtypeStruct
    B = req.prompt_BxT.shape[0]
    tiers = spec.tiers if spec is not None else (None,)
    learned = jax.tree.map(lambda x: sds(x.shape, x.dtype), policy.fresh(spec or NO_SPEC))
    prefill_lowered = jax.jit(prefill).lower(
        tstate, dstate, sds(req.prompt_BxT.shape, jnp.int32), sds((B,), jnp.int32), sds((B,), jnp.int32),
        sds((B,), jnp.int32), sds((len(tiers),), jnp.float32), learned)

    def lower_round(tier: int | None, state) -> jax.stages.Lowered:
        state = jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding=x.sharding), state)
        return jax.jit(functools.partial(one_round, tier), donate_argnums=(2,)).lower(tstate, dstate, state)

    return prefill_lowered, lower_round


def _compile(target, drafter, prompts, *, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, tree=TreeConfig(),
             seed=0, stop_token_ids=None, tokenizer=None, programs: ProgramCache | None = None, **kw):
    """``(compiled, args, request)`` of a ``generate`` call: ``args`` the models' states (placed
    on the request's mesh, if any) and the call's ``LoopInputs``, the round costs measured on
    the program when the policy adapts and none are given."""
    programs = PROGRAMS if programs is None else programs
    req = prepare(target, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                  top_k=top_k, tree=tree, seed=seed, stop_token_ids=stop_token_ids, tokenizer=tokenizer, **kw)
    spec = req.spec
    if req.mesh is not None:
        (tgraph, tstate), (dgraph, dstate) = placed(target, drafter, req.mesh, None if req.rules is None else dict(req.rules))
    else:
        (tgraph, tstate), (dgraph, dstate) = nnx.split(target), nnx.split(drafter) if drafter is not None else (None, None)
    # once per (models, weight shardings, batch, prompt bucket, limits, tree, sampling)
    placement = tuple(getattr(x, "sharding", None) for x in jax.tree.leaves((tstate, dstate)))
    shape = req.prompt_BxT.shape
    compiled = programs.get((tgraph, dgraph, shape, req.statics, placement),
                            lambda: lower_loop(tgraph, tstate, dgraph, dstate, shape, req.statics).compile())
    n_tiers = 1 if spec is None else len(spec.tiers)
    learned = policy.recall((tgraph, dgraph, spec, req.mesh)) or policy.fresh(spec or NO_SPEC)
    learned = jax.tree.map(np.asarray, learned)  # wherever the last call left it
    inputs = LoopInputs(jnp.asarray(req.prompt_BxT), jnp.asarray(req.lengths_B), jax.random.key(req.seed),
                        jnp.asarray(req.budget_B), jnp.asarray(req.phase_B), jnp.ones((n_tiers,), jnp.float32),
                        jnp.int32(-1), jnp.int32(req.statics.max_new), jnp.bool_(False), learned)
    round_ms = req.round_ms
    if round_ms is None and spec is not None and spec.policy == "adaptive":
        round_ms = round_costs(programs, compiled, (tstate, dstate, inputs), n_tiers)
    if round_ms is not None:
        inputs = dataclasses.replace(inputs, round_ms_T=jnp.asarray(round_ms, jnp.float32))
    return compiled, (tstate, dstate, inputs), req


def generate(target, drafter, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, tree: TreeConfig = TreeConfig(), seed: int = 0,
             stop_token_ids: Sequence[int] | None = None, tokenizer=None, thinking_budget=None,
             thinking_mode: str = "hard", thinking_grace: int = 0, think_token_ids=None,
             end_thinking_ids=None, speculation: Speculation | TreeConfig | None = None,
             round_ms=None, mesh: jax.sharding.Mesh | None = None, rules=None,
             time_first_token: bool = False, warm_up: bool = False,
             programs: ProgramCache | None = None, phases: bool = True) -> GenerateResult:
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
        same.
      programs: the ``ProgramCache`` that keeps the compiled loop for later calls (with its
        measured round costs); default: the module's ``PROGRAMS``.
      phases: let a large batch decode in phases (``phase_rows``); ``False`` runs one loop
        over the whole batch (the same tokens: for measurements and tests).{thinking}
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
                                   mesh=mesh, rules=rules, programs=programs, phases=phases)
    programs = PROGRAMS if programs is None else programs
    warm = timed_call(compiled, args)[0] if warm_up and programs.first_run(compiled) else None
    first_token = timed_call(compiled, forced_args(args, -1, 0))[0] if time_first_token else None
    seconds, res = timed_call(compiled, args)
    programs.ran(compiled)
    if "learned" in res and req.spec.policy == "adaptive":
        policy.remember((nnx.graphdef(target), nnx.graphdef(drafter), req.spec, req.mesh), res["learned"])
    res = {k: np.asarray(v)[: req.rows] for k, v in res.items() if k != "learned"}  # every entry is per row
    n_out = res["n_out"]
    tokens = [res["out"][b, : n_out[b]].tolist() for b in range(n_out.shape[0])]
    stats = result_stats(res, seconds, req.spec)
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


def round_stats(accept_BxR, rounds_mask_BxR, proposed_BxR, depth_BxR, positions: int) -> dict:
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


def result_stats(res: dict, seconds: float, spec: Speculation | None) -> dict:
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
    stats = round_stats(accept, np.ones_like(accept, bool), proposed_BxR, depth_BxR, positions)
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
            "thinking": {**round_stats(accept, rt, proposed_BxR, depth_BxR, positions), "committed": int(thinking.sum()),
                         "forced_rounds": int(((accept == -2) & rt).sum())},
            "answer": {**round_stats(accept, ~rt, proposed_BxR, depth_BxR, positions), "committed": int(new_tokens - thinking.sum()),
                       "forced_rounds": int(((accept == -2) & ~rt).sum())},
        }
    return stats
