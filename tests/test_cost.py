"""The cost report (``eagle3_jax.cost``, ``bench --cost``): forced rounds and the loop report
timing the same rounds, the HLO readers (large ops, the round's parts), the op profiles of a
call and of the decode step, and the step timings on a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import eagle3_jax
from eagle3_jax import cost, decode
from eagle3_jax.tree import TreeConfig
from helpers import FIXTURES


def test_forced_rounds_run_past_the_stop_and_difference_the_calls():
    """`cost.forced_rounds` (bench's round time) runs the forced tier past a stop token that
    ends the request early (so that a short answer times as many rounds as a long one), for as
    many rounds as fit `max_new_tokens` and a quarter as many; it reports the rounds between."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)
    prompt = [[1, 2, 3, 4, 5]]
    out = eagle3_jax.generate(target, drafter, prompt, max_new_tokens=40, tree=TreeConfig.chain(3)).tokens[0]
    stop = out[1] if out[1] != out[0] else next(t for t in out if t != out[0])  # not the prefill's token
    compiled, args = decode.compile_generate(target, drafter, prompt, max_new_tokens=40, tree=TreeConfig.chain(3),
                                             stop_token_ids=[stop])
    assert int((np.asarray(compiled(*args)["accept"]) != -1).sum()) < 6  # the stop ends it early
    # 4 tokens a round (3 drafted and the bonus): 9 rounds fit the 39 after the prefill's, and a quarter of them
    [forced] = cost.forced_rounds([(compiled, args)], 40, TreeConfig.chain(3).path_len, repeats=3)
    assert forced["rounds"] == 9 - 2 and forced["round_ms"] > 0
    # each part is its least over the repeats (a preempted op inflates one call, not all three)
    assert forced["parts_us"]["verify"] > 0 and forced["parts_us"]["draft"] > 0
    # the round's time alone (bench's vanilla step): the same rounds, no profiler
    [plain] = cost.forced_rounds([(compiled, args)], 40, TreeConfig.chain(3).path_len, repeats=1, parts=False)
    assert plain["rounds"] == 9 - 2 and plain["round_ms"] > 0 and plain["parts_us"] == {}


def test_loop_report_times_the_same_rounds_at_each_cache_size():
    """`bench --cost`'s sweep over `max_new_tokens` (`cost.loop_report`) times the rounds of the
    smallest's new tokens in each program, so that the live prefix is the same and only the
    cache's capacity differs."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)
    small, large = cost.loop_report(target, drafter, [1, 2, 3, 4, 5], TreeConfig.chain(3), [24, 96],
                                    repeats=1, log=lambda line: None)
    assert small["forced_tokens"] == large["forced_tokens"] == 24
    for mode, rounds in (("vanilla", 23 - 5), ("eagle3", 5 - 1)):  # 23 steps fit after the prefill's token; 5 rounds
        assert small[mode]["rounds"] == large[mode]["rounds"] == rounds
        assert large[mode]["cache_slots"] - small[mode]["cache_slots"] == 96 - 24
        assert small[mode]["loop_cache_copies"] == large[mode]["loop_cache_copies"] == 0


_HLO_PARTS = """\
HloModule jit__run

%layer_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %copy.1 = f32[4]{0} copy(%gte.1)
  ROOT %fusion.2 = (s32[], f32[4]) fusion(%copy.1), kind=kLoop, calls=%fused_add
}

%fused_add (q: f32[4]) -> (s32[], f32[4]) {
  ROOT %add.3 = f32[4]{0} add(%q, %q), metadata={op_name="jit(_run)/while/body/verify/add"}
}

%round_body (r: (s32[], f32[4])) -> (s32[], f32[4]) {
  %while.4 = (s32[], f32[4]) while(%t), condition=%layer_cond, body=%layer_body, metadata={op_name="jit(_run)/while/body/verify/while"}
  %copy.5 = s32[] copy(%gte.5)
  %fusion.6 = f32[4]{0} fusion(%x, %dot.13), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(_run)/while/body/catch_up/mul"}
  %copy.12 = f32[4,4]{1,0} copy(%gte.12)
  %dot.13 = f32[4]{0} dot(%x, %copy.12), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %fusion.14 = f32[4]{0} fusion(%dot.13), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(_run)/while/body/draft/exp"}
  %dot.15 = f32[4]{0} dot(%x, %copy.12), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %fusion.16 = f32[4]{0} fusion(%dot.15, %fusion.14), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(_run)/while/body/draft/exp"}
  %copy.17 = f32[4]{0} copy(%gte.17)
  %while.18 = (s32[], f32[4], f32[4], f32[4], f32[4], /*index=5*/f32[4]) while(%copy.17), condition=%layer_cond, body=%layer_body, metadata={op_name="jit(_run)/while/body/verify/while"}
  ROOT %tuple.7 = (s32[], f32[4], f32[4], f32[4]) tuple(%copy.5, %fusion.6, %fusion.16, %while.18)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %copy.8 = f32[4]{0} copy(%a)
  %while.9 = (s32[], f32[4]) while(%t0), condition=%round_cond, body=%round_body, metadata={op_name="jit(_run)/while"}
  ROOT %conditional.10 = f32[4]{0} conditional(%i, %x), branch_computations={%branch_a, %branch_b}, metadata={op_name="jit(_run)/draft/cond"}
}

%branch_b (b: f32[4]) -> f32[4] {
  ROOT %copy.11 = f32[4]{0} copy(%b)
}
"""


_HLO_WRAPPED = """\
HloModule m

%wrapped_copy_computation (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %copy.9 = f32[64]{0} copy(%p)
}

ENTRY %main (a: f32[64]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  ROOT %wrapped_copy = f32[64]{0} fusion(%a), kind=kLoop, calls=%wrapped_copy_computation
}
"""


def test_large_ops_names_a_fusion_once_where_it_runs():
    """A computation that a fusion calls is not listed as if it ran apart from its caller (a
    copy fused by XLA into ``wrapped_copy_computation`` runs once, in ENTRY, not per iteration)."""
    assert cost.large_ops(_HLO_WRAPPED, 256) == [("wrapped_copy", "copy", 256, "ENTRY", (64,))]


def test_op_parts_charges_xla_created_ops_to_the_part_that_runs_them():
    """An op without a part in its ``op_name`` (XLA's copies, fusions it made, a dot it
    rewrote) belongs to the one part its users name, else to the part of the op that runs its
    computation, through every level of nesting; ops outside any part (the loop's own carry
    copies, the entry) are ``other``."""
    parts = cost.op_parts(_HLO_PARTS)
    assert parts["copy.1"] == "verify"  # a copy XLA put in the verify's layer loop
    assert parts["fusion.2"] == "verify"
    assert parts["add.3"] == "verify"
    assert parts["while.4"] == "verify"
    assert parts["copy.5"] == "other"  # the round loop's bookkeeping
    assert parts["fusion.6"] == "catch_up"
    assert parts["copy.8"] == "other" and parts["while.9"] == "other"
    assert parts["dot.15"] == "draft"  # a dot XLA rewrote without metadata, read by the draft only
    assert parts["dot.13"] == "other"  # read by the draft and by the catch-up: the round loop's
    assert parts["copy.12"] == "other"  # its users' parts, through unnamed ones, disagree
    assert parts["copy.17"] == "verify"  # read by the verify's loop only (a type with /*index=5*/)
    assert parts["copy.11"] == "draft"  # a branch of a conditional named in the draft


def test_profile_ops_ranks_a_calls_ops_with_their_runs_per_call():
    """`cost.profile_ops` (`bench --cost`'s heaviest ops of a step): every op it names is an op
    of the compiled module, heaviest first, with its result's shape, its op_name and how many
    times a call runs it: the dot in a 16-step layer loop 16 times, the sum after it once."""
    def f(x_BxH, w_LxHxH):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x_BxH, w_LxHxH)
        return h.sum()

    x, w = jnp.ones((8, 64)), jnp.ones((16, 64, 64)) / 64
    compiled = jax.jit(f).lower(x, w).compile()
    ops = cost.profile_ops(compiled, x, w, repeats=2, top=1000)
    hlo = compiled.as_text()
    assert ops and all(f"%{o['op']} = " in hlo for o in ops)
    assert [o["us"] for o in ops] == sorted((o["us"] for o in ops), reverse=True)
    by_scope = {o["scope"].split("/")[-1]: o for o in ops}
    assert by_scope["dot_general"]["runs"] == 16 and by_scope["dot_general"]["shape"] == "f32[8,64]"
    assert by_scope["reduce_sum"]["runs"] == 1 and by_scope["reduce_sum"]["shape"] == "f32[]"
    assert len(cost.profile_ops(compiled, x, w, repeats=1, top=2)) == 2


def test_step_ops_profiles_the_decode_step_as_it_runs():
    """`cost.step_ops` profiles `decode_step`'s own program: the cache donated and written in
    place (no copy of a whole cache, which a wrapper that does not donate it would make), the
    layer loop's ops run once per layer."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    cfg = target.config
    ops = cost.step_ops(target, 2, live=5, slots=64, top=1000, repeats=1)
    cache_shape = f"f32[{cfg.num_layers},2,64,{cfg.num_kv_heads},{cfg.head_dim}]"
    assert [o for o in ops if o["shape"] == cache_shape]  # the writes of the new keys and values
    assert not [o for o in ops if o["shape"] == cache_shape and o["op"].startswith("copy")]
    assert {o["runs"] for o in ops} >= {1, cfg.num_layers}


def test_cost_report_divides_both_step_ratios_by_one_timing(monkeypatch, capsys):
    """`bench --cost` times every decode-step shape in one `cost.step_ms` run (the shapes
    taking turns, on the mesh and rules it was given), so the slots ratio and the batch ratio
    share the batch-1, 256-slot figure instead of dividing by two timings of the same step
    taken at different times (each run here times every shape differently)."""
    from eagle3_jax import sharding

    calls, mesh = [], sharding.abstract_mesh(data=2)
    rules = {**sharding.RULES, "batch": sharding.Rule(("data",))}

    def step_ms(target, shapes, **kw):
        calls.append((list(shapes), kw))
        return {(b, s): len(calls) * 10.0 + b + s / 1024 for b, s in shapes}

    monkeypatch.setattr(cost, "step_ms", step_ms)
    monkeypatch.setattr(cost, "step_ops", lambda target, batch: [])
    loops = []
    monkeypatch.setattr(cost, "loop_report", lambda *a, batch, **kw: loops.append(batch) or [])
    report = cost.report(None, None, [1], None, (64,), (1, 4), mesh=mesh, rules=rules)
    assert loops == [1, 4]  # the decode loop at the batches asked for, not the step's
    [(shapes, kw)] = calls
    assert len(set(shapes)) == len(shapes) and kw == {"mesh": mesh, "rules": rules}
    assert {(1, s) for s in (256, 1024, 4096, 16384)} | {(8, 256), (32, 256)} == set(shapes)
    assert report["step_ms_by_slots"][256] == report["step_ms_by_batch"][1] == 11.25
    assert report["step_ms_by_batch"][32] == 42.25 and report["step_ms_by_slots"][16384] == 27.0
    assert report["step_mesh"] == {"axes": {"data": 2, "fsdp": 1, "tensor": 1}, "batches": [8, 32]}
    out = capsys.readouterr().out
    assert f"({42.25 / 11.25:.2f}x from 1 to 32)" in out and f"({27.0 / 11.25:.2f}x from 256 to 16384)" in out


def test_step_ms_puts_on_a_mesh_only_the_batches_it_splits():
    """`bench --cost --mesh`: `cost.step_ms` steps a batch on the mesh when its batch axes
    split it evenly over more than one device, and any other batch on one device (on a real
    mesh: the README's `bench --cost --mesh data=2` runs)."""
    from eagle3_jax.sharding import abstract_mesh

    assert cost.on_mesh(abstract_mesh(data=2), 32) and cost.on_mesh(abstract_mesh(data=2, tensor=4), 8)
    assert not cost.on_mesh(abstract_mesh(data=2), 1) and not cost.on_mesh(abstract_mesh(data=4), 6)
    assert not cost.on_mesh(abstract_mesh(tensor=8), 32) and not cost.on_mesh(None, 32)
