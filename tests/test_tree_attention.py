"""Pallas tree attention (interpret mode on the CPU) against its jnp reference twin."""

import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from helpers import FIXTURES
from pallas_kernels.tree_attention import tree_attention, tree_attention_ref


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


@pytest.mark.parametrize("B,gqa,D,T,mask", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference(B, gqa, D, T, mask, dtype):
    rng = np.random.default_rng(B * 1000 + gqa * 100 + D + T)
    K = 2
    N, S, block = K * gqa, 150, 64  # cache length not a multiple of the block
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    q, kc, vc, kn, vn = arr(B, T, N, D), arr(B, S, K, D), arr(B, S, K, D), arr(B, T, K, D), arr(B, T, K, D)
    prefix = jnp.asarray(rng.choice([0, 1, 63, 64, 97, 150], size=B), jnp.int32).at[0].set(0)  # incl. empty cache
    m = jnp.asarray(_masks(mask, rng, B, T))
    got = tree_attention(q, kc, vc, prefix, kn, vn, m, scale=D ** -0.5, block_k=block, interpret=True)
    want = tree_attention_ref(q, kc, vc, prefix, kn, vn, m, scale=D ** -0.5)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert np.abs(got - want).max() <= 2e-2 * max(1.0, np.abs(want).max())


def test_generate_with_pallas_is_token_identical():
    target_xla = eagle3_jax.load_target(FIXTURES / "target_tiny")
    target_pallas = eagle3_jax.load_target(FIXTURES / "target_tiny", attention_impl="pallas_interpret")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target_xla)
    gold = np.load(FIXTURES / "eagenerate_greedy_trained.npz")
    prompts = [gold["p0_prompt"].tolist(), gold["p3_prompt"].tolist()]
    tree = eagle3_jax.TreeConfig(16, 4, 4)
    want = eagle3_jax.generate(target_xla, drafter, prompts, max_new_tokens=24, tree=tree)
    got = eagle3_jax.generate(target_pallas, drafter, prompts, max_new_tokens=24, tree=tree)
    assert got.tokens == want.tokens
    assert got.stats["accept_lengths"] == want.stats["accept_lengths"]


def test_bench_entry_point_runs(capsys):
    from pallas_kernels import bench

    bench.main(["--quick", "--interpret"])
    out = capsys.readouterr().out
    assert "kernel_ms=" in out and "ref_ms=" in out
