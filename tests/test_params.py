"""Parameter declarations (``declare(cfg)``) and the logical→mesh rules: the declarations name
exactly the checkpoint tensors, the models are built from them, and sharding follows one rules
table that raises on a dimension it cannot split (naming the parameter, axis and mesh) unless a
rule says to replicate it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P
from safetensors import safe_open

from eagle3_jax import sharding
from eagle3_jax.checkpoint import TorchPickleSource
from eagle3_jax.config import DrafterConfig, RopeConfig, TargetConfig, read_config_json
from eagle3_jax.models import drafter as drafter_mod, target as target_mod
from helpers import FIXTURES, build_hf_model


def mesh(data=1, fsdp=1, tensor=1):
    return AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES)


def tcfg(**kw):
    base = dict(family="llama", vocab_size=1024, hidden_size=128, intermediate_size=352, num_layers=8, num_heads=8,
                num_kv_heads=4, head_dim=16, rms_norm_eps=1e-5, rope=RopeConfig())
    return TargetConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2", "qwen3"])
def test_target_declaration_names_exactly_the_hf_tensors(kind, tmp_path):
    """Biases (qwen2), q/k norms (qwen3) and tied embeddings: the declared checkpoint names are the
    tensors transformers writes, no more, no fewer."""
    build_hf_model(kind, tmp_path, num_hidden_layers=3)
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        stored = set(f.keys())
    cfg = TargetConfig.from_dict(read_config_json(tmp_path), capture_layers=(0, 1, 2))
    declared = {n for _, p in target_mod.declare(cfg).present() for n in p.checkpoint_names()}
    assert declared == stored


def test_drafter_declaration_names_exactly_the_official_tensors():
    source = TorchPickleSource(FIXTURES / "drafter_tiny" / "pytorch_model.bin")
    cfg = DrafterConfig.from_dict(read_config_json(FIXTURES / "drafter_tiny"))
    declared = {p.checkpoint for _, p in drafter_mod.declare(cfg).present()}
    # the official release ships neither the shared embedding nor t2d; d2t is the vocabulary map
    assert declared - {"embed_tokens.weight"} == set(source.names()) - {"d2t", "t2d"}


def test_models_are_built_from_their_declarations():
    cfg = tcfg(family="qwen2", qkv_bias=True, qk_norm=True, tie_word_embeddings=True)
    decl = target_mod.declare(cfg)
    model = nnx.eval_shape(lambda: target_mod.Target(cfg, dtype=jnp.bfloat16))
    abstract = decl.abstract(jnp.bfloat16)
    params = nnx.state(model, nnx.Param)
    assert set(params.keys()) == set(abstract) and "lm_head" not in abstract and "bq" in abstract
    for name, s in abstract.items():
        assert (getattr(model, name).shape, getattr(model, name).dtype) == (s.shape, s.dtype), name
    assert model.lm_head is None and model.bo is None  # declared absent for this configuration
    assert decl.count() == sum(int(np.prod(s.shape)) for s in abstract.values())

    dcfg = DrafterConfig(vocab_size=64, draft_vocab_size=32, hidden_size=16, intermediate_size=24, num_heads=2,
                         num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope=RopeConfig(), target_hidden_size=16)
    drafter = nnx.eval_shape(lambda: drafter_mod.Drafter(dcfg, jnp.zeros((64, 16))))
    ddecl = drafter_mod.declare(dcfg)
    assert set(nnx.state(drafter, nnx.Param).keys()) == {n for n, p in ddecl.present() if not p.frozen}
    assert set(drafter_mod.param_shapes(dcfg)) == set(nnx.state(drafter, nnx.Param).keys())
    assert ddecl.count(frozen=False) + 64 * 16 == ddecl.count()


def test_shardings_follow_the_rules():
    decl = target_mod.declare(tcfg())  # 8 heads, 4 KV heads of 16, mlp 352, vocab 1024
    s = decl.shardings(mesh(data=2, tensor=4))
    assert s["wq"].spec == P(None, None, "tensor") and s["wk"].spec == P(None, None, "tensor")
    assert s["w_down"].spec == P(None, "tensor", None) and s["embed"].spec == P("tensor", None)
    assert s["attn_norm"].spec == P(None, None)
    assert s["wq"].shard_shape((8, 128, 128)) == (8, 128, 32)
    # fewer KV heads (4) than tensor devices (8): the rule replicates them, explicitly; query heads split
    s = decl.shardings(mesh(tensor=8))
    assert s["wk"].spec == P(None, None, None) and s["wq"].spec == P(None, None, "tensor")
    # heads stay whole: 2 KV heads of 64 are 128 columns, divisible by 4, yet never cut in half
    s = target_mod.declare(tcfg(num_heads=4, num_kv_heads=2, head_dim=64)).shardings(mesh(tensor=4))
    assert s["wk"].spec == P(None, None, None) and s["wq"].spec == P(None, None, "tensor")
    # fsdp splits the embedding width; a mesh axis is used once per array
    s = drafter_mod.declare(DrafterConfig(vocab_size=1024, draft_vocab_size=256, hidden_size=128,
                                          intermediate_size=352, num_heads=8, num_kv_heads=4, head_dim=16,
                                          rms_norm_eps=1e-5, rope=RopeConfig(), target_hidden_size=128)
                            ).shardings(mesh(fsdp=2, tensor=4))
    assert s["fc"].spec == P("fsdp", None) and s["lm_head"].spec == P("fsdp", "tensor")


@pytest.mark.parametrize("cfg_kw, axes, param, axis", [
    (dict(intermediate_size=344), dict(tensor=16), "w_gate", "'mlp'"),  # 344 / 16 is not whole
    (dict(num_heads=12, num_kv_heads=4), dict(tensor=8), "wq", "'heads'"),  # 12 heads, not fewer than 8
    (dict(vocab_size=1000), dict(tensor=16), "embed", "'vocab'"),
    (dict(hidden_size=120, head_dim=15), dict(fsdp=16), "embed", "'embed'"),
])
def test_unsplittable_dimension_raises_naming_parameter_axis_and_mesh(cfg_kw, axes, param, axis):
    m = mesh(**axes)
    with pytest.raises(ValueError) as e:
        target_mod.declare(tcfg(**cfg_kw)).shardings(m)
    msg = str(e.value)
    assert msg.startswith(f"{param}:") and axis in msg
    assert ", ".join(f"{a}={s}" for a, s in m.shape.items()) in msg


def test_rules_override_the_table():
    decl = target_mod.declare(tcfg(intermediate_size=344))
    assert decl.shardings(mesh(tensor=16), {"mlp": None})["w_gate"].spec == P(None, None, None)
    # a rule without "replicate" raises where the default would replicate fewer KV heads
    with pytest.raises(ValueError, match=r"^wk: .*'kv_heads'.*tensor=8"):
        target_mod.declare(tcfg()).shardings(mesh(tensor=8), {"kv_heads": sharding.Rule(("tensor",))})
    assert decl.shardings(mesh(data=2), {"layers": "data"})["wq"].spec == P("data", None, None)
    with pytest.raises(ValueError, match="no sharding rule for logical axis 'nope'"):
        sharding.spec((4,), ("nope",), mesh(tensor=2))
    with pytest.raises(TypeError, match=r"rules\['mlp'\]"):
        decl.shardings(mesh(tensor=2), {"mlp": 3})


def test_hidden_states_split_as_the_weights_hidden_dimension():
    """A decode forward's hidden states [B, T, X]: the hidden dimension where the weights' embed
    rule puts it, the rows over the batch's other axes; nothing to constrain without it split."""
    assert sharding.hidden_sharding(mesh(data=2, fsdp=4), 8, 128).spec == P("data", None, "fsdp")
    assert sharding.hidden_sharding(mesh(fsdp=8), 8, 128).spec == P(None, None, "fsdp")
    assert sharding.hidden_sharding(mesh(data=2, tensor=4), 8, 128) is None
    by_tensor = sharding.hidden_sharding(mesh(data=2, tensor=4), 8, 128, {"embed": "tensor"})
    assert by_tensor.spec == P(("data", "fsdp"), None, "tensor")
    with pytest.raises(ValueError, match=r"^drafter hidden states: .*'embed'.*fsdp=16"):
        sharding.hidden_sharding(mesh(fsdp=16), 8, 120, name="drafter hidden states")


def test_parse_mesh():
    assert sharding.parse_mesh("data=2,tensor=4") == {"data": 2, "fsdp": 1, "tensor": 4}
    assert sharding.parse_mesh(" data=-1 , fsdp=8 ") == {"data": -1, "fsdp": 8, "tensor": 1}
    for bad, why in (("data=2,data=2", "twice"), ("pipe=2", "unknown axis"), ("tensor=0", ">= 1"),
                     ("tensor", "axis=size"), ("", "axis=size"), ("fsdp=-1", ">= 1")):
        with pytest.raises(ValueError, match=why):
            sharding.parse_mesh(bad)


def test_parse_rules():
    assert sharding.parse_rules("vocab=none,mlp=fsdp+tensor") == {"vocab": None, "mlp": sharding.Rule(("fsdp", "tensor"))}
    # an axis keeps its default rule's fewer: 2 query heads on tensor=4 stay replicated, as by default
    assert sharding.parse_rules(" heads = tensor ") == {"heads": sharding.Rule(("tensor",), "replicate")}
    assert sharding.spec((2 * 64,), ("heads",), mesh(tensor=4), sharding.parse_rules("heads=tensor"),
                         units={"heads": 64}) == P(None)
    for bad, why in (("vocab=none,vocab=tensor", "twice"), ("nope=none", "unknown logical axis 'nope'"),
                     ("vocab=pipe", "mesh axes"), ("vocab=tensor+tensor", "each once"), ("vocab", "axis=mesh_axes"),
                     ("", "axis=mesh_axes"), ("vocab=", "axis=mesh_axes")):
        with pytest.raises(ValueError, match=why):
            sharding.parse_rules(bad)
    # what it gives is what rules= takes: a vocabulary that tensor=4 does not divide, replicated
    with pytest.raises(sharding.SplitError, match="'vocab'") as e:
        sharding.spec((910, 128), ("vocab", "embed"), mesh(tensor=4))
    assert e.value.axis == "vocab"
    assert sharding.spec((910, 128), ("vocab", "embed"), mesh(tensor=4), sharding.parse_rules("vocab=none")) == P(None, None)


def test_logical_axes_derive_from_the_declarations():
    assert target_mod.logical_axes()["bq"] == ("layers", "heads")
    assert drafter_mod.logical_axes()["embed"] == ("vocab", "embed")
    assert target_mod.param_shapes(tcfg())["bq"] is None
