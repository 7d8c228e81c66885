"""The Pallas kernels (``eagle3_jax.pallas_kernels``): tree attention (TPU and GPU kernels in
their CPU interpreters) against the jnp reference twin, inside the decode loop too; both
kernels are also lowered for real chips (TPU v5e, Hopper sm_90a) without one, and where
libtpu is installed the TPU kernel is compiled through Mosaic for a v5e topology, alone and
as the dispatcher picks it inside a model compiled for the TPU."""

import functools
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from helpers import FIXTURES
from eagle3_jax.pallas_kernels.tree_attention import pick_kernel, tree_attention, tree_attention_ref
from eagle3_jax.pallas_kernels.tree_attention_mgpu import tree_attention_mgpu


def _masks(kind, rng, B, T):
    if kind == "chain":
        m = np.tril(np.ones((T, T), bool))
        return np.broadcast_to(m, (B, T, T))
    if kind == "full":
        return np.ones((B, T, T), bool)
    parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, T)] for _ in range(B)]  # random trees
    m = np.zeros((B, T, T), bool)
    for b in range(B):
        for i in range(T):
            a = i
            while a >= 0:
                m[b, i, a] = True
                a = parents[b][a]
    return m


# every value of the grid (batch 1/3, GQA 1/4/8, head_dim 64/128, tree 1/7/60, chain/random/full) appears
CASES = [(1, 1, 64, 1, "chain"), (3, 4, 128, 7, "random"), (1, 8, 64, 60, "full"), (3, 1, 128, 60, "random"),
         (3, 8, 128, 7, "chain"), (1, 4, 64, 60, "chain"), (3, 4, 64, 1, "full")]


def _inputs(B, gqa, D, T, mask, dtype, S=152):
    rng = np.random.default_rng(B * 1000 + gqa * 100 + D + T)
    K = 2
    N = K * gqa
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    q, kc, vc, kn, vn = arr(B, T, N, D), arr(B, S, K, D), arr(B, S, K, D), arr(B, T, K, D), arr(B, T, K, D)
    # prefixes around the 64-slot block boundary, an empty cache and (B > 1) a full one, whose
    # last block runs past the cache's end (152 is not a multiple of 64)
    prefix = jnp.asarray(rng.choice([0, 1, 63, 64, 97, S], size=B), jnp.int32).at[0].set(0)
    if B > 1:
        prefix = prefix.at[-1].set(S)
    return q, kc, vc, prefix, kn, vn, jnp.asarray(_masks(mask, rng, B, T))


def _assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert np.abs(got - want).max() <= 2e-2 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("B,gqa,D,T,mask", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_kernel_matches_reference(B, gqa, D, T, mask, dtype):
    args = _inputs(B, gqa, D, T, mask, dtype)
    got = tree_attention(*args, scale=D ** -0.5, block_k=64, interpret=True)
    _assert_close(got, tree_attention_ref(*args, scale=D ** -0.5), dtype)


@pytest.mark.parametrize("S", [200, 40])
def test_tpu_kernel_prefixes_at_block_boundaries(S):
    """Every prefix at and beside a 64-slot block boundary, in a cache of 200 slots (its last
    block runs past the end: the interpreter pads it with NaN, as a TPU's VMEM may hold
    anything) and in one shorter than a block (40: one block of 40 slots); one (traced)
    layer of a stacked cache, as the decode loop calls it."""
    B = 8
    q, _, _, _, kn, vn, m = _inputs(B, 4, 64, 7, "random", jnp.float32, S=S)
    rng = np.random.default_rng(S)
    kc, vc = (jnp.asarray(rng.normal(size=(3, B, S, 2, 64)), jnp.float32) for _ in range(2))
    prefix = jnp.asarray(np.minimum([0, 1, 63, 64, 65, 128, S - 1, S], S), jnp.int32)
    kernel = jax.jit(lambda kc, vc, layer: tree_attention(q, kc, vc, prefix, kn, vn, m, scale=0.125, layer=layer,
                                                          block_k=64, interpret=True))
    got = kernel(kc, vc, jnp.int32(2))
    assert np.isfinite(np.asarray(got)).all()
    _assert_close(got, tree_attention_ref(q, kc[2], vc[2], prefix, kn, vn, m, scale=0.125), jnp.float32)


@pytest.mark.parametrize("B,gqa,D,T,mask,dtype", [c + (jnp.bfloat16,) for c in CASES] + [CASES[1] + (jnp.float16,)])
def test_gpu_kernel_matches_reference(B, gqa, D, T, mask, dtype):
    args = _inputs(B, gqa, D, T, mask, dtype)
    # 2 splits: the prefix shared between two blocks (the second one empty for short prefixes)
    got = tree_attention_mgpu(*args, scale=D ** -0.5, splits=2, interpret=True)
    _assert_close(got, tree_attention_ref(*args, scale=D ** -0.5), dtype)


def test_gpu_kernel_long_walk():
    """Up to 5 blocks of 64 slots through the 4 SMEM slots: the pipeline wraps around.
    (A cache shorter than one block runs in the generate test below.)"""
    args = _inputs(3, 1, 64, 7, "chain", jnp.bfloat16, S=296)
    _assert_close(tree_attention_mgpu(*args, scale=0.125, splits=1, interpret=True),
                  tree_attention_ref(*args, scale=0.125), jnp.bfloat16)


@pytest.mark.parametrize("kernel,dtype", [(tree_attention, jnp.float32), (tree_attention_mgpu, jnp.bfloat16)])
def test_kernels_read_one_layer_of_a_stacked_cache(kernel, dtype):
    q, kc, vc, prefix, kn, vn, m = _inputs(3, 4, 64, 7, "random", dtype)
    rng = np.random.default_rng(1)
    stack = lambda c: jnp.stack([jnp.asarray(rng.normal(size=c.shape), dtype), c, -c])  # layer 1 = c
    got = kernel(q, stack(kc), stack(vc), prefix, kn, vn, m, scale=0.125, layer=jnp.int32(1), interpret=True)
    _assert_close(got, tree_attention_ref(q, kc, vc, prefix, kn, vn, m, scale=0.125), dtype)


def test_gpu_kernel_refuses_float32_and_odd_head_dims():
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        tree_attention_mgpu(*_inputs(1, 1, 64, 7, "chain", jnp.float32), scale=0.125, interpret=True)
    with pytest.raises(ValueError, match="head_dim 48 must be one of"):
        tree_attention_mgpu(*_inputs(1, 1, 48, 7, "chain", jnp.bfloat16), scale=0.125, interpret=True)


@pytest.mark.parametrize("B,gqa,D,T,dtype,S", [(1, 8, 128, 60, jnp.bfloat16, 1000), (3, 4, 64, 7, jnp.float16, 1000),
                                               (2, 1, 128, 1, jnp.bfloat16, 1000), (1, 4, 128, 1, jnp.bfloat16, 1192)])
def test_gpu_kernel_lowers_for_hopper(B, gqa, D, T, dtype, S):
    """The compiled program (not the interpreted one) passes Mosaic GPU's layout inference
    and WGMMA checks for sm_90a; only PTX assembly is left to a real GPU.  (1192 slots: the
    multiple of 8 next to the 1193 that failed on an H200.)"""
    fn = functools.partial(tree_attention_mgpu, scale=D ** -0.5, splits=3)
    assert "mosaic_gpu" in _lower(fn, "cuda", B, gqa, D, T, dtype, S=S)


def test_gpu_kernel_refuses_a_cache_it_cannot_tile():
    """A cache whose slots are not a multiple of 8 does not lower (Mosaic GPU layout inference
    fails: seen on an H200 with 150 and 1193 slots): a clear error, and the dispatcher picks the
    reference; the decode loop's caches are sized so (kv_cache.capacity)."""
    from eagle3_jax.pallas_kernels import tree_attention_mgpu as mgpu

    fn = functools.partial(tree_attention_mgpu, scale=128 ** -0.5, splits=3)
    with pytest.raises(ValueError, match="a cache of 1193 slots; Mosaic GPU needs a multiple of 8"):
        _lower(fn, "cuda", 1, 4, 128, 1, jnp.bfloat16, S=1193)
    assert not mgpu.supports(jnp.bfloat16, 128, 1, 1193) and mgpu.supports(jnp.bfloat16, 128, 1, 1192)
    assert mgpu.supports(jnp.bfloat16, 128, 1, 37)  # shorter than a block: padded to one
    assert pick_kernel(jnp.bfloat16, 64, "gpu", cache_len=150) is None


@pytest.mark.parametrize("B,gqa,D,T,dtype", [(1, 8, 128, 60, jnp.bfloat16), (3, 4, 64, 7, jnp.float32),
                                             (2, 1, 64, 1, jnp.bfloat16)])
def test_tpu_kernel_lowers_for_tpu(B, gqa, D, T, dtype):
    """Pallas → Mosaic TPU lowering (block shapes, index maps), which needs no libtpu; Mosaic's
    own compilation, which does: ``test_tpu_kernel_compiles_for_v5e``."""
    fn = functools.partial(tree_attention, scale=D ** -0.5)
    assert "tpu_custom_call" in _lower(fn, "tpu", B, gqa, D, T, dtype)


def _trace(fn, B, gqa, D, T, dtype, K=2, S=1000, L=4):
    """Traces ``fn`` as the target calls it: one (traced) layer of the stacked cache."""
    sds = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)
    args = (sds(B, T, K * gqa, D), sds(L, B, S, K, D), sds(L, B, S, K, D), sds(B, dt=jnp.int32), sds(B, T, K, D),
            sds(B, T, K, D), sds(B, T, T, dt=jnp.bool_), sds(dt=jnp.int32))
    return jax.jit(lambda *a: fn(*a[:-1], layer=a[-1])).trace(*args)


def _lower(fn, platform, *shape, **kwargs):
    """``fn`` (see ``_trace``) lowered for ``platform``, as text."""
    return _trace(fn, *shape, **kwargs).lower(lowering_platforms=(platform,)).as_text()


def test_dispatcher_on_cpu():
    assert pick_kernel(jnp.bfloat16, 128) is None  # no accelerator here: the XLA reference
    assert pick_kernel(jnp.float32, 128, "tpu").func is tree_attention
    assert pick_kernel(jnp.bfloat16, 64, "gpu").func is tree_attention_mgpu
    with pytest.raises(ValueError, match="interpret='cuda'"):
        pick_kernel(jnp.bfloat16, 128, "cuda")
    # compiling for another platform than this host's: that platform's kernel
    assert pick_kernel(jnp.float32, 128, platform="tpu") is tree_attention
    assert pick_kernel(jnp.bfloat16, 128, platform="cuda", cache_len=1024) is tree_attention_mgpu
    assert pick_kernel(jnp.float32, 128, platform="cuda") is None  # WGMMA has no exact float32
    assert pick_kernel(jnp.bfloat16, 128, platform="cpu") is None


def test_dispatcher_lowers_only_the_target_platforms_branch():
    """``attention`` compiled: the kernel of the platform the program is lowered for (the
    CPU's reference here; the Mosaic kernels where lowered for a TPU or a GPU, with no chip)."""
    from eagle3_jax.pallas_kernels.tree_attention import attention

    traced = _trace(functools.partial(attention, scale=128 ** -0.5), 2, 4, 128, 7, jnp.bfloat16, S=1024)
    cpu, tpu, cuda = (traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "tpu", "cuda"))
    assert "tpu_custom_call" not in cpu and "mosaic_gpu" not in cpu
    assert "tpu_custom_call" in tpu and "mosaic_gpu" not in tpu
    assert "mosaic_gpu" in cuda and "tpu_custom_call" not in cuda
    q, kc, vc, prefix, kn, vn, m = _inputs(3, 4, 64, 7, "random", jnp.float32)
    _assert_close(jax.jit(functools.partial(attention, scale=0.125))(q, kc, vc, prefix, kn, vn, m),
                  tree_attention_ref(q, kc, vc, prefix, kn, vn, m, scale=0.125), jnp.float32)


def _sweep():
    """``scripts/tpu_kernel_sweep.py`` (its shapes, one chip of a topology, the compile and its
    checks), or a skip where libtpu is not installed."""
    pytest.importorskip("libtpu", reason='compiling for a TPU needs libtpu: pip install -e ".[tpu]"')
    path = Path(__file__).parent.parent / "scripts" / "tpu_kernel_sweep.py"
    spec = importlib.util.spec_from_file_location("tpu_kernel_sweep", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
    spec.loader.exec_module(module)
    return module


def test_tpu_kernel_compiles_for_v5e():
    """Through Mosaic, for a v5e chip (no TPU here: libtpu compiles for the topology): one layer
    of a stacked cache of 1000 slots (not a multiple of the 128-slot block) picked by a traced
    index, and a single-layer cache shorter than one block; the compiled program holds the
    kernel and no copy of the cache."""
    sweep = _sweep()
    device = sweep.tpu_device("v5e:2x2")
    for shape in (sweep.Shape(2, 16, 32, 1000), sweep.Shape(3, 1, 64, 100, stacked=False)):
        compiled = sweep.compile_shape(device, shape)
        assert sweep.check(compiled, shape)[0] is None, shape
        assert "tpu_custom_call" in compiled.as_text()


def test_model_compiled_for_a_tpu_runs_the_mosaic_kernel():
    """A Pallas-attention target's tree step compiled for a v5e on this CPU host runs the
    Mosaic kernel: the dispatcher picks by the platform compiled for, not by this host's
    device (run here, the same step runs the reference: the dispatcher test above)."""
    from flax import nnx
    from eagle3_jax.config import TargetConfig, read_config_json

    sweep = _sweep()
    mesh = jax.sharding.Mesh([sweep.tpu_device("v5e:2x2")], ("chip",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cfg = TargetConfig.from_dict(read_config_json(FIXTURES / "target_tiny" / "config.json"))
    target = nnx.eval_shape(lambda: eagle3_jax.Target(cfg, dtype=jnp.bfloat16, attention_impl="pallas"))
    graph, state = nnx.split(target)
    B, N = 2, 8
    cache = jax.eval_shape(lambda: target.init_cache(B, 200))  # 256 slots: a cache a kernel reads
    tokens, depth, tree_mask = jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.int32), jnp.ones((B, N, N), bool)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                        (state, cache, tokens, depth, tree_mask))

    def tree_step(state, cache, tokens, depth, tree_mask):  # ``Target.tree_forward``'s program
        return nnx.merge(graph, state)(tokens, cache.lengths[:, None] + depth, cache=cache, region_mask_BxTxR=tree_mask)

    assert "tpu_custom_call" in jax.jit(tree_step, donate_argnums=1).lower(*args).compile().as_text()


def test_generate_with_pallas_is_token_identical():
    target_xla = eagle3_jax.load_target(FIXTURES / "target_tiny")
    target_pallas = eagle3_jax.load_target(FIXTURES / "target_tiny", attention_impl="pallas_interpret")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target_xla)
    gold = np.load(FIXTURES / "eagenerate_greedy_trained.npz")
    prompts = [gold["p0_prompt"].tolist(), gold["p3_prompt"].tolist()]
    tree = eagle3_jax.TreeConfig(16, 4, 4)
    want = eagle3_jax.generate(target_xla, drafter, prompts, max_new_tokens=16, tree=tree)
    got = eagle3_jax.generate(target_pallas, drafter, prompts, max_new_tokens=16, tree=tree)
    assert got.tokens == want.tokens
    assert got.stats["accept_lengths"] == want.stats["accept_lengths"]


def test_generate_with_gpu_kernel_is_token_identical():
    """The built-in pair in bfloat16 (head_dim 64, as WGMMA needs): the GPU kernel in its
    interpreter inside the jitted decode loop gives the XLA path's tokens."""
    from eagle3_jax import builtin
    from eagle3_jax.decode import encode_chat

    target_xla, drafter, tok = builtin.load("bfloat16")
    target_mgpu = eagle3_jax.load_target(builtin.TARGET_DIR, dtype="bfloat16", attention_impl="pallas_interpret_gpu")
    prompts = [encode_chat(tok, [{"role": "user", "content": builtin.eval_tasks()[1]["prompt"]}])]
    tree = eagle3_jax.TreeConfig.chain(6)
    want = eagle3_jax.generate(target_xla, drafter, prompts, max_new_tokens=10, tree=tree)
    got = eagle3_jax.generate(target_mgpu, drafter, prompts, max_new_tokens=10, tree=tree)
    assert got.tokens == want.tokens
    assert got.stats["accept_lengths"] == want.stats["accept_lengths"]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_bench_entry_point_runs(capsys, backend):
    from eagle3_jax.pallas_kernels import bench

    bench.main(["--quick", "--interpret", backend])
    out = capsys.readouterr().out
    assert "kernel_ms=" in out and "ref_ms=" in out
    assert f"tree_attention{'_mgpu' if backend == 'gpu' else ''} in its CPU interpreter" in out


def test_gpu_kernel_takes_a_tree_not_a_prefill():
    """The new tokens' keys, values and bias are one shared-memory block: at most MAX_NEW of
    them; the dispatcher sends longer runs (a prefill) to the reference, interpreted or not."""
    from eagle3_jax.pallas_kernels import tree_attention_mgpu as mgpu

    assert mgpu.supports(jnp.bfloat16, 128, mgpu.MAX_NEW) and not mgpu.supports(jnp.bfloat16, 128, mgpu.MAX_NEW + 1)
    assert pick_kernel(jnp.bfloat16, 64, "gpu", new_tokens=mgpu.MAX_NEW).func is tree_attention_mgpu
    assert pick_kernel(jnp.bfloat16, 64, "gpu", new_tokens=mgpu.MAX_NEW + 1) is None
    assert pick_kernel(jnp.float32, 64, "gpu") is None  # as on a GPU: WGMMA has no exact float32
    with pytest.raises(ValueError, match="at most 64 fit"):
        tree_attention_mgpu(*_inputs(1, 1, 64, 65, "chain", jnp.bfloat16), scale=0.125, interpret=True)


def test_a_kernel_read_cache_has_whole_blocks():
    """A cache a Pallas kernel reads has a multiple of kv_cache.KERNEL_SLOTS slots (Mosaic GPU in
    jax 0.11.2 did not compile other lengths); the XLA path's has exactly max_len."""
    from eagle3_jax import kv_cache

    cfg = eagle3_jax.load_target(FIXTURES / "target_tiny").config
    for impl, want in [("xla", 150), ("pallas", 256), ("pallas_interpret_gpu", 256)]:
        assert eagle3_jax.Target(cfg, attention_impl=impl).init_cache(2, 150).max_len == want
    assert kv_cache.capacity(256, "pallas") == 256 and kv_cache.capacity(1, "pallas_interpret") == 128


def test_device_check_script_runs(tmp_path):
    """eagle3_jax/device_check.py, shrunk to the CPU (--smoke): the parts that matter most
    on a GPU run end to end here, so that the one-call device script cannot rot."""
    import json

    from eagle3_jax import device_check

    for part in ("kernels", "bench", "llama8b"):
        assert device_check.main([part, "--out", str(tmp_path), "--smoke"]) == 0
    doc = {p: json.loads((tmp_path / f"{p}.json").read_text()) for p in ("kernels", "bench", "llama8b")}
    kernels = doc["kernels"]["result"]
    assert kernels["total"] >= 3 and kernels["passed"] == kernels["total"], kernels
    row = doc["bench"]["result"]["rows"][0]
    assert row["max_abs_err"] < 2e-2 and row["xla_ms"] > 0
    (llama,) = doc["llama8b"]["result"]["rows"]
    assert "error" not in llama and llama["eagle3_rounds"][1] > llama["eagle3_rounds"][0]


def test_slots_with_a_kernel_read_cache_equal_generate():
    """The slot engine with a Pallas target, whose caches have whole 128-slot blocks
    (kv_cache.capacity: a prefill's row cache and the slots' cache both rounded up), gives
    generate's tokens."""
    from eagle3_jax.decode import Slots

    target = eagle3_jax.load_target(FIXTURES / "target_tiny", attention_impl="pallas_interpret")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)
    prompts = [np.load(FIXTURES / "eagenerate_greedy_trained.npz")[k].tolist() for k in ("p0_prompt", "p3_prompt")]
    tree = eagle3_jax.TreeConfig(16, 4, 4)
    slots = Slots(target, drafter, num_slots=2, max_len=150, speculation=tree)
    assert slots.max_len == 150 and target.init_cache(2, 150).max_len == 256
    tickets = [slots.insert(s, p, max_new_tokens=12) for s, p in enumerate(prompts)]
    got = {}
    for _ in range(12):  # 12 tokens each: at most 11 rounds after the prefill's token
        slots.run(4)
        got.update({s: v.tokens for s, v in enumerate(slots.poll()) if v.done and v.ticket == tickets[s]})
    want = eagle3_jax.generate(target, drafter, prompts, max_new_tokens=12, tree=tree)
    assert [got.get(s) for s in range(2)] == want.tokens
