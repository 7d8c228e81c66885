"""``eagle3-jax plan``: per-device bytes of a training config on a mesh, without devices (an
``AbstractMesh``): the figures follow the known parameter counts of the targets the shipped
configs name (Llama-3.1-8B: 8.03 B, Llama-3.3-70B: 70.6 B) and the sharding rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_jax import cli, plan

CONFIGS = Path(__file__).parent.parent / "configs"
GiB = 2 ** 30


@pytest.mark.parametrize("config, params, per_layer_norms, layers", [
    ("llama31_8b.yaml", 8_030_261_248, 2 * 4096, 32),
    ("llama33_70b.yaml", 70_553_706_496, 2 * 8192, 80),
])
@pytest.mark.parametrize("mesh", [{"tensor": 8}, {"data": 2, "tensor": 8}])  # v5e-8, v5p-16
def test_plan_counts_the_known_models(config, params, per_layer_norms, layers, mesh):
    p = plan.plan(CONFIGS / config, mesh=mesh)
    assert p.target_params == params
    # every weight matrix splits 8 ways over tensor (heads, KV heads, MLP, vocabulary); the
    # RMSNorm weights are replicated; bfloat16
    norms = layers * per_layer_norms + per_layer_norms // 2
    assert p.bytes["target weights"] == 2 * ((params - norms) // 8 + norms)
    text = plan.format_plan(p, config)
    assert f"{params / 1e9:.2f} B parameters ({params:,})" in text
    assert round(params / 1e9, 1) == {"llama31_8b.yaml": 8.0, "llama33_70b.yaml": 70.6}[config]


def test_kv_cache_follows_the_rules():
    # Llama-3.1-8B: 32 layers, 8 KV heads of 128, bfloat16; k and v of [32, 64, 2048, 8, 128]
    full = 2 * 32 * 64 * 2048 * 8 * 128 * 2
    label = "target KV cache (64 x 2048)"
    p = plan.plan(CONFIGS / "llama31_8b.yaml", mesh={"data": 2, "tensor": 8}, batch=64, seq_len=2048)
    assert p.bytes[label] == full // 16  # batch over data, KV heads over tensor
    # 8 KV heads on tensor=16: replicated (the explicit rule), only the batch splits
    p = plan.plan(CONFIGS / "llama31_8b.yaml", mesh={"data": 2, "tensor": 16}, batch=64, seq_len=2048)
    assert p.bytes[label] == full // 2
    with pytest.raises(ValueError, match=r"target KV cache: dimension 1 \(logical axis 'batch', size 3\)"):
        plan.plan(CONFIGS / "llama31_8b.yaml", mesh={"data": 2, "tensor": 8}, batch=3)


def test_fit_verdicts():
    p = plan.plan(CONFIGS / "llama33_70b.yaml", mesh={"tensor": 8}, device_memory=16 * GiB)
    assert p.fits()["decode"] is False  # 70.6 B in bfloat16 over 8 chips is 16.4 GiB each
    p = plan.plan(CONFIGS / "llama31_8b.yaml", mesh={"tensor": 8}, device_memory=16 * GiB)
    assert p.fits()["decode"] is True
    assert p.decode_total == sum(v for k, v in p.bytes.items() if "weights" in k or "KV" in k)
    # the shipped config's fit batch (256 x 2048) on 8 chips is far beyond 16 GiB; on a pod it shrinks
    assert p.fits()["fit"] is False
    big = plan.plan(CONFIGS / "llama31_8b.yaml", mesh={"data": 64, "tensor": 8})
    assert big.fit_total < p.fit_total


def test_cli_plan(capsys, tmp_path):
    assert cli.main(["plan", "--config", str(CONFIGS / "llama31_8b.yaml"), "--mesh", "data=2,tensor=8",
                     "--device-memory", "16GiB", "--batch", "32", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "mesh data=2, fsdp=1, tensor=8 (16 devices)" in out and "8.03 B parameters" in out
    assert "target KV cache (32 x 4096)" in out and "decode: fits in 16.00 GiB per device" in out
    # the config's own mesh has data=-1 (all devices): a plan needs sizes
    assert cli.main(["plan", "--config", str(CONFIGS / "llama31_8b.yaml")]) == 2
    assert "give --mesh" in capsys.readouterr().err
    assert cli.main(["plan", "--config", str(CONFIGS / "llama31_8b.yaml"), "--mesh", "tensor=3"]) == 2
    assert "wq: dimension 2 (logical axis 'heads'" in capsys.readouterr().err
    assert cli.main(["plan", "--config", str(CONFIGS / "llama31_8b.yaml"), "--mesh", "tensor=8",
                     "--device-memory", "lots"]) == 2
    assert "device memory 'lots'" in capsys.readouterr().err
    # a target that is neither here nor among the shipped configs
    cfg = tmp_path / "c.yaml"
    cfg.write_text("target: /nowhere/Some-Model\n")
    assert cli.main(["plan", "--config", str(cfg), "--mesh", "tensor=8"]) == 2
    assert "--target-config" in capsys.readouterr().err
    assert cli.main(["plan", "--config", str(cfg), "--mesh", "tensor=8", "--target-config",
                     str(CONFIGS / "targets" / "Qwen3-8B.json")]) == 0
    assert "8.19 B parameters (8,190,735,360)" in capsys.readouterr().out


def test_plan_inputs_named(tmp_path, capsys):
    """A size under one byte, a --target-config that is no file and an unsized config mesh are
    each refused by name (not a ZeroDivisionError, not a made-up config.json path)."""
    with pytest.raises(ValueError, match="at least one byte"):
        plan.parse_bytes("0.5B")
    assert cli.main(["plan", "--config", str(CONFIGS / "llama31_8b.yaml"), "--mesh", "tensor=8",
                     "--target-config", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "--target-config" in err and "nope.json: no such file" in err and "nope.json/config.json" not in err
    assert cli.main(["plan", "--config", str(CONFIGS / "llama31_8b.yaml")]) == 2
    assert "data=-1 means 'all devices'" in capsys.readouterr().err
