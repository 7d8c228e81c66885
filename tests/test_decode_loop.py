"""The decode loop (``eagle3_jax.decode._loop``) as compiled: its HLO copies no KV cache, in
any tier, dtype or phase, and the prefill computes the last token's logits only."""

from __future__ import annotations

import pytest

import eagle3_jax
from eagle3_jax import cost, decode, layers
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig
from helpers import FIXTURES


@pytest.mark.parametrize("tree,dtype,batch,max_new", [
    (None, None, 1, 40), (TreeConfig.chain(3), None, 1, 40), (TreeConfig(8, 2, 2), None, 1, 40),
    (Speculation((None, TreeConfig.chain(3), TreeConfig(8, 2, 2))), None, 1, 40), (TreeConfig.chain(3), "bfloat16", 1, 40),
    (TreeConfig.chain(3), None, 8, 64)],
    ids=["vanilla", "chain3", "tree", "adaptive", "chain3-bfloat16", "chain3-phases"])
def test_decode_loop_copies_no_cache(tree, dtype, batch, max_new, monkeypatch):
    """In the optimized HLO of the whole decode loop, no cache-sized buffer is copied or
    converted inside the loop (KV writes, commit and the drafter's catch-up update the caches
    in place), also when an adaptive policy switches between tiers and bursts of plain steps,
    with bfloat16 weights (which XLA:CPU would update by converting the whole cache), and in
    each phase of a batch decoded in phases (whose rows are gathered between the loops); and
    the empty caches are not copied into the loop either."""
    monkeypatch.setattr(layers, "PREFIX_BLOCK", 16)  # blocks smaller than the tiny cache
    target = eagle3_jax.load_target(FIXTURES / "target_tiny", dtype=dtype)
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target) if tree else None
    spec = tree if isinstance(tree, Speculation) else Speculation.fixed(tree or TreeConfig())
    assert len(decode.phase_rows(batch, max_new)) == (3 if batch == 8 else 1)
    compiled, args = decode.compile_generate(target, drafter, [[1, 2, 3, 4, 5]] * batch, max_new_tokens=max_new,
                                             speculation=spec, round_ms=[1.0] * len(spec.tiers),
                                             programs=decode.ProgramCache())
    assert int(compiled(*args)["n_out"][0]) > 0
    cfg = target.config
    max_len = 32 + max_new + (spec.scratch if tree else 1)
    # one row's float32 layer (what a bfloat16 one converts to): the smallest phase's cache is larger
    layer_bytes = max_len * cfg.num_kv_heads * cfg.head_dim * 4
    ops = cost.cache_ops(compiled.as_text(), layer_bytes, slots=max_len)
    assert [op for op in ops["copy"] if op[3] != "ENTRY"] == []
    assert ops["in_place"], "the cache updates should appear as in-place dynamic-update-slice/scatter"
    # nor before it: the empty caches' keys and values are filled in place (kv_cache.init_cache);
    # the copies left are a smaller phase's rows, gathered between the loops
    assert [op for op in ops["copy"] if op[3] == "ENTRY" and op[4][1] == batch] == []


def test_prefill_computes_the_last_tokens_logits_only():
    """The decode loop's prefill runs the target's head on each prompt's last token only: no
    ``[B, T, V]`` logits in the program (for a real vocabulary, the prefill's largest buffer:
    32 prompts of 2k tokens over 128k ids would be 34 GB)."""
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    B, V = 2, target.config.vocab_size
    compiled, args = decode.compile_generate(target, None, [[1, 2, 3, 4, 5]] * B, max_new_tokens=8)
    T = args[-1].prompt_BxT.shape[1]  # the prompt's bucket
    assert T > 1
    text = compiled.as_text()
    assert f"f32[{B},{T},{V}]" not in text
    assert f"f32[{B},{V}]" in text
