"""Loading onto a mesh: ``load_target(path, mesh=...)`` / ``load_drafter(..., mesh=...)`` build
each parameter from per-device blocks of the checkpoint; on 8 simulated CPU devices every
shard has the shape its declared logical axes give and the values of the unsharded load.
(The memory bound on a 2 GB checkpoint is measured by scripts/mesh_load_memory.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import builtin
from eagle3_jax.sharding import make_mesh
from helpers import FIXTURES, cpu_devices_env

ROOT = Path(__file__).parent.parent


def test_sharded_load_on_eight_devices():
    script = textwrap.dedent(f"""
        import contextlib, io
        import numpy as np, jax
        import eagle3_jax
        from eagle3_jax import cli
        from eagle3_jax.sharding import Rule, SplitError, make_mesh
        F = {str(FIXTURES)!r}
        B = {str(builtin.TARGET_DIR)!r}
        assert len(jax.devices()) == 8

        def check(model, ref, expect):
            for name in ref_names(ref):
                got, want = getattr(model, name)[...], np.asarray(getattr(ref, name)[...])
                assert got.dtype == want.dtype, name
                assert len(got.addressable_shards) == 8, name
                for shard in got.addressable_shards:  # each device holds exactly its block
                    assert shard.data.shape == got.sharding.shard_shape(got.shape), name
                    np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=name)
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
            for name, shape in expect.items():
                assert getattr(model, name)[...].addressable_shards[0].data.shape == shape, (name, shape)

        def ref_names(model):
            return [n for n in ("embed", "wq", "wk", "wv", "wo", "attn_norm", "mlp_norm", "w_gate", "w_up", "w_down",
                                "norm", "lm_head", "fc", "hidden_norm", "input_norm", "post_norm", "d2t", "inv_freq")
                    if getattr(model, n, None) is not None]

        # golden tiny target: 8 layers, hidden 128, 8 query / 4 KV heads of 16, mlp 352, vocab 1024
        cases = [((2, 1, 4), None, dict(wq=(8, 128, 32), wk=(8, 128, 16), w_down=(8, 88, 128), embed=(256, 128))),
                 # fewer KV heads (4) than tensor (8): replicated by the rule, the rest split
                 ((1, 1, 8), None, dict(wq=(8, 128, 16), wk=(8, 128, 64), w_gate=(8, 128, 44), lm_head=(128, 128))),
                 ((1, 2, 4), None, dict(wq=(8, 64, 32), embed=(256, 64), norm=(128,))),
                 # the stacked layer axis itself split
                 ((2, 1, 4), {{"layers": "data"}}, dict(wq=(4, 128, 32), attn_norm=(4, 128)))]
        for dtype in (None, "bfloat16"):  # bfloat16: cast block by block
            ref = eagle3_jax.load_target(F + "/target_tiny", dtype=dtype)
            dref = eagle3_jax.load_drafter(F + "/drafter_tiny", target=ref)  # official pytorch_model.bin
            for axes, rules, expect in (cases if dtype is None else cases[1:2]):
                mesh = make_mesh(*axes)
                target = eagle3_jax.load_target(F + "/target_tiny", dtype=dtype, mesh=mesh, rules=rules)
                check(target, ref, expect)
                drafter = eagle3_jax.load_drafter(F + "/drafter_tiny", target=target, mesh=mesh)
                check(drafter, dref, {{}})
                assert drafter.embed[...].sharding == target.embed[...].sharding  # shared, not copied

        # a dimension the mesh cannot split raises before any tensor is read, naming it all
        try:
            eagle3_jax.load_target(F + "/target_tiny", mesh=make_mesh(1, 1, 8), rules={{"kv_heads": Rule(("tensor",))}})
        except SplitError as e:
            assert "target_tiny: wk: dimension 2 (logical axis 'kv_heads'" in str(e) and "tensor=8" in str(e), e
            assert e.axis == "kv_heads"
        else:
            raise AssertionError("no error")

        # the command line: the built-in target's 910 ids do not split over tensor=8, and the error
        # says which --rules replicates them (with the rules already given); with them, it loads
        # and decodes (vanilla), the --rules given twice merged
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cli.main(["generate", "--prompt-ids", "1,2,3", "--target", B, "--mesh", "tensor=8", "--rules", "mlp=tensor"])
        assert rc == 2 and "target: embed: dimension 0 (logical axis 'vocab'" in err.getvalue() and \
            "(on the command line: --rules mlp=tensor,vocab=none)" in err.getvalue(), err.getvalue()
        assert cli.main(["generate", "--prompt-ids", "1,2,3", "--target", B, "--mesh", "tensor=8", "--rules", "mlp=tensor",
                         "--rules", "vocab=none", "--max-new-tokens", "2", "--no-compare"]) == 0
        print("ok")
    """)
    env = cpu_devices_env(8)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


def test_one_device_mesh_and_argument_errors(tmp_path):
    ref = eagle3_jax.load_target(FIXTURES / "target_tiny")
    mesh = make_mesh(1, 1, 1)
    target = eagle3_jax.load_target(FIXTURES / "target_tiny", mesh=mesh)
    for name in ("embed", "wq", "w_down", "lm_head"):
        np.testing.assert_array_equal(np.asarray(getattr(target, name)[...]), np.asarray(getattr(ref, name)[...]))
    with pytest.raises(ValueError, match="not both"):
        eagle3_jax.load_target(FIXTURES / "target_tiny", mesh=mesh, shardings={})
    with pytest.raises(ValueError, match="rules= needs mesh="):
        eagle3_jax.load_target(FIXTURES / "target_tiny", rules={"mlp": None})
    with pytest.raises(TypeError, match="mesh: expected a jax.sharding.Mesh"):
        eagle3_jax.load_drafter(FIXTURES / "drafter_tiny", target=ref, mesh={"tensor": 8})
    with pytest.raises(ValueError, match="shardings: no parameter named 'w_q'"):
        eagle3_jax.load_target(FIXTURES / "target_tiny", shardings={"w_q": None})


@pytest.mark.parametrize("bad, why", [("nan", "holds NaN or infinite values"), ("shape", "expected shape"),
                                      ("int", "weights must be floating point")])
def test_bad_tensors_are_refused_on_a_mesh_too(tmp_path, bad, why):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(FIXTURES / "target_tiny" / "model.safetensors")
    name = "model.layers.3.mlp.up_proj.weight"
    if bad == "nan":
        tensors[name][5, 7] = np.nan
    elif bad == "shape":
        tensors[name] = tensors[name][:-1]
    else:
        tensors[name] = tensors[name].astype(np.int32)
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(FIXTURES / "target_tiny" / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'model.safetensors'}: tensor '{name}'") + f".*{why}"):
        eagle3_jax.load_target(tmp_path, mesh=make_mesh(1, 1, 1))


def test_a_mesh_with_explicit_axes_loads_and_decodes_as_an_auto_one():
    """``jax.make_mesh`` makes Explicit axes by default; loading and decoding take such a mesh
    as its Auto twin (same devices and names) and give the tokens of no mesh at all."""
    import jax
    from jax.sharding import AxisType

    from eagle3_jax.sharding import MESH_AXES, auto_mesh

    explicit = jax.make_mesh((1, 1, 1), MESH_AXES, axis_types=(AxisType.Explicit,) * 3)
    auto = auto_mesh(explicit)
    assert auto.axis_types == (AxisType.Auto,) * 3 and auto.axis_names == MESH_AXES
    assert (auto.devices == explicit.devices).all() and auto_mesh(auto) is auto
    ref = eagle3_jax.load_target(FIXTURES / "target_tiny")
    target = eagle3_jax.load_target(FIXTURES / "target_tiny", mesh=explicit)
    assert target.wq[...].sharding.mesh == auto
    assert target.inv_freq[...].sharding.mesh == auto  # every array the load places, not only the parameters
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    want = eagle3_jax.generate(ref, None, prompts, max_new_tokens=6).tokens
    assert eagle3_jax.generate(target, None, prompts, max_new_tokens=6, mesh=explicit).tokens == want
    assert eagle3_jax.generate(target, None, prompts, max_new_tokens=6).tokens == want  # no mesh= at the call
