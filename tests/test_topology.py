"""Compiling for TPU topologies on this CPU host (``eagle3_jax.topology``, ``plan --topology``):
a tiny model's decode loop (XLA and Pallas attention), its parts and its fit step compile for a
v5e slice; the compiler's out-of-memory refusal is reported, not raised; without libtpu the
command names the install.  libtpu is the ``tpu`` extra; these tests skip without it."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax import cli, decode, plan, sharding, topology
from eagle3_jax.config import TargetConfig
from eagle3_jax.models.drafter import Drafter
from eagle3_jax.models.target import Target
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig

needs_libtpu = pytest.mark.skipif(not topology.have_libtpu(), reason=f"needs libtpu: {topology.INSTALL}")

# head_dim 128: the Mosaic kernel's lanes
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
        "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "eos_token_id": 2, "tie_word_embeddings": False}


def _pair(attention_impl="xla", unroll=False, layers=4):
    tcfg = TargetConfig.from_dict({**TINY, "num_hidden_layers": layers}, capture_layers=(0, 1, 2))
    from eagle3_jax.plan import drafter_config_for
    from eagle3_jax.train.config import PipelineConfig

    dcfg = drafter_config_for(PipelineConfig(draft_vocab_size=128), tcfg)
    target = nnx.eval_shape(lambda: Target(tcfg, dtype=jnp.bfloat16, attention_impl=attention_impl,
                                           unroll_layers=unroll))
    drafter = nnx.eval_shape(lambda: Drafter(dcfg, jnp.zeros((tcfg.vocab_size, tcfg.hidden_size), jnp.bfloat16),
                                             dtype=jnp.bfloat16))
    return target, drafter


@pytest.fixture(scope="module")
def v5e():
    return sharding.make_mesh(data=2, devices=topology.devices("v5e:2x2")[:2])


@needs_libtpu
@pytest.mark.parametrize("attention_impl", ["xla", "pallas"])
def test_decode_loop_compiles_for_v5e(v5e, attention_impl):
    """``generate``'s whole loop (a chain and no drafting, adaptively) compiles for TPU v5e on a
    2-device mesh, with the Mosaic tree-attention kernel where asked."""
    target, drafter = _pair(attention_impl)
    spec = Speculation((None, TreeConfig.chain(3)))
    lowered = decode.lower_generate(target, drafter, batch=4, prompt_len=40, max_new_tokens=24, mesh=v5e,
                                    speculation=spec)
    program, compiled = topology.compile_with_report("loop", lowered)
    assert compiled is not None and program.refused is None
    assert 0 < program.total < topology.CHIPS["v5e"].hbm_bytes
    assert ("tpu_custom_call" in compiled.as_text()) == (attention_impl == "pallas")


@needs_libtpu
def test_round_costs_follow_the_layers(v5e):
    """The parts' costs: a round of 4 unrolled layers costs more than one of 3, by one layer's
    weights at least (every weight is read once a round), and the extrapolation is linear."""
    costs = {}
    for layers in (3, 4):
        target, drafter = _pair(unroll=True, layers=layers)
        prefill, lower_round = decode.lower_parts(target, drafter, batch=2, prompt_len=32, max_new_tokens=16, mesh=v5e,
                                                  speculation=Speculation((None, TreeConfig.chain(3))))
        _, pre = topology.compile_with_report("prefill", prefill)
        costs[layers] = {tier: topology.compile_program("round", lower_round(tier, pre.out_info)) for tier in (None, 1)}
    layer_weight_bytes = 2 * (4 * 256 * 128 + 3 * 256 * 512)  # bf16 q, k, v, o (2 heads, 1 KV head) and the MLP
    for tier in (None, 1):
        three, four = costs[3][tier], costs[4][tier]
        assert four.bytes_accessed - three.bytes_accessed >= layer_weight_bytes
        assert four.flops > three.flops
        eight = topology.per_layer({3: three, 4: four}, 8, "x")
        assert eight.flops == pytest.approx(three.flops + 5 * (four.flops - three.flops))
    assert costs[4][1].flops > costs[4][None].flops  # a chain round verifies 4 tokens, a step one


@needs_libtpu
def test_out_of_memory_is_reported_not_raised(v5e):
    """The TPU compiler refuses a program whose temporaries exceed HBM; the report keeps the
    figure it gives."""
    x = jax.ShapeDtypeStruct((1 << 16, 256), jnp.float32, sharding=NamedSharding(v5e, P()))
    lowered = jax.jit(lambda x: jnp.sort(x @ x.T, axis=0)[:8]).lower(x)  # 16 GiB and more of temporaries
    program, compiled = topology.compile_with_report("too big", lowered)
    assert compiled is None and "exceeds available HBM" in program.refused
    assert program.temporaries > topology.CHIPS["v5e"].hbm_bytes


def _cost(flops, gb):
    return topology.Program("p", 1.0, 0, 0, 0, 0, 0, flops, gb * 1e9, None)


def test_per_layer_reads_the_least_squares_line():
    """Exactly linear costs extrapolate exactly; one compile off the line (the 70B vanilla
    step on v5p:2x4x4: 0.82, 0.72, 0.96 GB at 3, 4, 5 layers) moves the least-squares slope
    less than it moves a difference of two, and a slope below one read of a layer's weights
    is replaced by that floor, said in the note."""
    linear = topology.per_layer({3: _cost(30, 3.5), 4: _cost(40, 4.5), 5: _cost(50, 5.5)}, 80, "step")
    assert linear.flops == pytest.approx(800) and linear.bytes_accessed == pytest.approx(80.5e9)
    assert linear.note is None and linear.compile_s == 3.0
    seen = {3: _cost(7.0, 0.82), 4: _cost(8.64, 0.72), 5: _cost(10.27, 0.96)}
    step = topology.per_layer(seen, 80, "step")
    assert step.bytes_accessed == pytest.approx(0.8333e9 + 76 * 0.07e9, rel=1e-3)  # slope (0.96 - 0.82) / 2
    two = topology.per_layer({3: seen[3], 4: seen[4]}, 80, "step")  # their slope is negative: clamped at zero
    assert two.bytes_accessed == pytest.approx(0.77e9) and "(-100.0 MB" in two.note
    floored = topology.per_layer(seen, 80, "step", layer_bytes=0.1e9)
    assert floored.bytes_accessed == pytest.approx(0.8333e9 + 76 * 0.1e9, rel=1e-3)
    assert "below one read of a layer's weights (100.0 MB" in floored.note
    with pytest.raises(ValueError, match="two layer counts or more"):
        topology.per_layer({3: seen[3]}, 80, "step")


def test_chip_table_and_names():
    assert topology.chip("v5p:2x2x2").hbm_bytes == 95 * 2 ** 30
    with pytest.raises(ValueError, match="unknown chip 'h100'"):
        topology.chip("h100:1")


def test_plan_topology_without_libtpu_names_the_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(topology, "have_libtpu", lambda: False)
    assert cli.main(["plan", "--config", str(plan.Path(__file__).parent.parent / "configs" / "llama31_8b.yaml"),
                     "--topology", "v5e:2x4", "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[tpu]"' in err and not (tmp_path / "r.json").exists()


@needs_libtpu
def test_cli_plan_topology_tiny(tmp_path, capsys):
    """``plan --topology`` end to end on a tiny config: the fit step compiled, its table
    printed and the JSON report written."""
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "tiny.json").write_text(json.dumps(TINY))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("target: /nowhere/tiny\ndata: x.jsonl\nwork_dir: run\nseq_len: 64\ndraft_vocab_size: 128\n"
                   "dtype: bfloat16\nregenerate: {batch_size: 4, max_new_tokens: 16}\n"
                   "fit: {batch_size: 8, ttt_length: 2, micro_batches: 2, loss_chunk: 32}\nmesh: {data: -1}\n")
    out = tmp_path / "report.json"
    assert cli.main(["plan", "--config", str(cfg), "--topology", "v5e:2x2", "--programs", "fit",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fit step (8 x 64, TTT 2, 2 micro-batches)" in text and "fits" in text
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    (fit,) = report["programs"]
    assert fit["fits"] and fit["total"] > 0
    (cost,) = report["costs"]
    assert cost["flops"] > 0 and cost["roofline_ms"] > 0


def test_keep_cpu_default_respects_the_user(monkeypatch):
    """Only where libtpu is installed, no TPU or GPU plugin is present and JAX_PLATFORMS is unset."""
    calls = []
    monkeypatch.setattr(topology.jax.config, "update", lambda *a: calls.append(a))
    monkeypatch.setattr(topology, "have_libtpu", lambda: True)
    monkeypatch.setattr(topology, "_has_tpu_hardware", lambda: False)
    monkeypatch.setattr(topology, "_has_gpu_plugin", lambda: False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    topology.keep_cpu_default()
    assert calls == []
    monkeypatch.delenv("JAX_PLATFORMS")
    topology.keep_cpu_default()
    assert calls == [("jax_platforms", "cpu")]
    monkeypatch.setattr(topology, "_has_tpu_hardware", lambda: True)
    topology.keep_cpu_default()
    assert len(calls) == 1


@needs_libtpu
def test_fit_step_keeps_rows_split_over_fsdp():
    """On a data x fsdp mesh every device trains on its own rows: the TTT attention's scores are
    made for batch / devices rows per device, not for the rows of all the fsdp devices (which
    the compiler chose, following the weights' fsdp split of the hidden dimension, before the
    step constrained its activations: 206 GiB estimated, 47.6 GiB compiled for Llama-3.1-8B)."""
    from eagle3_jax.train.trainer import FitConfig

    mesh = sharding.make_mesh(data=2, fsdp=2, devices=topology.devices("v5e:2x2"))
    target, drafter = _pair()
    rows, T = 16, 64
    fit = FitConfig(batch_size=rows, ttt_length=2, loss_chunk=32, compute_dtype="bfloat16")
    text = plan.lower_fit_step(target, drafter, fit, mesh, rows=rows, seq_len=T).compile().as_text()
    # scores [rows, kv heads, group, T, T + step] of the TTT attention, per device
    K, G = TINY["num_key_value_heads"], TINY["num_attention_heads"] // TINY["num_key_value_heads"]
    import re
    scores = {int(b) for b in re.findall(rf"f32\[(\d+),{K},{G},{T},{T}\]", text)}
    assert scores == {rows // 4}, scores
