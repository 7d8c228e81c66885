"""The checks a lent accelerator should run, in two device calls (a Hopper GPU: the Mosaic GPU kernel).

    scripts/device_check.sh OUT_DIR kernels bench llama8b    # one call (~6 minutes on an H200)
    scripts/device_check.sh OUT_DIR builtin step             # a second call (~4 minutes)
    python -m eagle3_jax.device_check PART --out OUT_DIR [--smoke]

A tool (it runs the built-in pair, ``bench`` and ``cost``), so it sits in the tools layer,
above the kernels it checks.

Parts, each writing ``OUT_DIR/PART.json`` (what ran, what broke, the figures):

* ``kernels``: the compiled kernel (not its interpreter) against ``tree_attention_ref`` over
  the test grid (bfloat16/float16; batch 1/3; GQA 1/4/8; head_dim 64/128; tree 1/7/60;
  prefixes 0, around a block, not a multiple of one, the full cache; 2 splits and the
  default; caches of 256 and 1024 slots, and of 152: a multiple of 8, not of a block), a
  stacked cache read at one layer, and how many new tokens fit its shared memory.
* ``bench``: kernel vs ``tree_attention_ref`` vs the XLA path's blocked attention
  (``layers.attention``) time, and the kernel's achieved HBM bandwidth, for cache 1k/8k/32k,
  tree 16/64, batch 1/32.
* ``builtin``: the built-in pair in bfloat16, greedy, ``attention_impl`` xla and pallas:
  ``bench.run_bench`` at batch 1 (8 prompts) and 32 (tokens/s, τ, speedup, each tree's
  token identity with vanilla), and vanilla's identity between the two.
* ``step``: ``Target.decode_step`` of the built-in target by cache capacity and batch
  (``cost.step_ms``: what issue 14's bars measure on a CPU).
* ``llama8b``: a random-weight Llama with an 8B model's shapes (32 layers, hidden 4096,
  32/8 heads, vocab 128256; made on the device) and a random drafter of matching shape: the
  wall time of one speculative round (60-token tree) and of one vanilla step in the compiled
  decode loop (rounds forced, so τ does not matter), at context 1k and 8k, xla and pallas.

``--smoke`` shrinks every part to a few seconds on the CPU (the kernels in their
interpreter): what the test suite runs so that the script itself cannot rot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import eagle3_jax
from eagle3_jax import Drafter, DrafterConfig, RopeConfig, Target, TargetConfig, TreeConfig, builtin, cost
from eagle3_jax.bench import run_bench
from eagle3_jax.decode import compile_generate, encode_chat, forced_call
from eagle3_jax.pallas_kernels import bench as kernel_bench
from eagle3_jax.pallas_kernels import tree_attention_mgpu as mgpu
from eagle3_jax.pallas_kernels.tree_attention import tree_attention_ref
from eagle3_jax.tree import parse_tree

PARTS = ("kernels", "bench", "builtin", "step", "llama8b")


def _env() -> dict:
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "flax": flax.__version__, "backend": jax.default_backend(),
            "device": dev.device_kind, "compute_capability": str(getattr(dev, "compute_capability", "")),
            "devices": jax.device_count()}


def _tree_mask(rng, B: int, T: int, kind: str) -> np.ndarray:
    """``[B, T, T]``: a chain, a full block, or a random tree (each node sees its ancestors)."""
    if kind == "chain":
        return np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)).copy()
    if kind == "full":
        return np.ones((B, T, T), bool)
    m = np.zeros((B, T, T), bool)
    for b in range(B):
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, T)]
        for i in range(T):
            a = i
            while a >= 0:
                m[b, i, a], a = True, parent[a]
    return m


def _case(B, gqa, D, T, kind, dtype, S, *, K=2, seed=0, layers=None):
    """Kernel inputs; prefixes drawn from 0, around the 64-slot block, and the full cache."""
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    cache = (layers,) if layers else ()
    q, kn, vn = arr(B, T, K * gqa, D), arr(B, T, K, D), arr(B, T, K, D)
    kc, vc = arr(*cache, B, S, K, D), arr(*cache, B, S, K, D)
    prefix = rng.choice([0, 1, 63, 64, 97, S - 1, S], size=B)
    prefix[0], prefix[-1] = (0, S) if B > 1 else (S // 2 + 1,) * 2
    return q, kc, vc, jnp.asarray(prefix, jnp.int32), kn, vn, jnp.asarray(_tree_mask(rng, B, T, kind))


def _err(got, want) -> tuple[float, float]:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max()), float(np.abs(want).max())


def part_kernels(smoke: bool) -> dict:
    interpret = smoke
    grid = [(1, 1, 64, 1, "chain"), (3, 4, 128, 7, "random"), (1, 8, 64, 60, "full"), (3, 1, 128, 60, "random"),
            (3, 8, 128, 7, "chain"), (1, 4, 64, 60, "chain"), (3, 4, 64, 1, "full"), (3, 8, 128, 60, "random")]
    # (dtype, cache length, splits): bfloat16 with 2 splits on a short cache (the second split
    # empty for short prefixes), each dtype with the default splits on a longer one, and a
    # cache of 152 slots (a multiple of 8, as the kernel needs, but not of its 64-slot block)
    variants = [("bfloat16", 256, 2)] if smoke else [("bfloat16", 256, 2), ("bfloat16", 1024, None),
                                                      ("float16", 1024, None), ("bfloat16", 152, 2)]
    cases = [dict(B=B, gqa=gqa, D=D, T=T, mask=kind, dtype=dtype, S=S, splits=splits, seed=i)
             for i, ((B, gqa, D, T, kind), (dtype, S, splits)) in enumerate(
                 (c, v) for c in grid[: 2 if smoke else None] for v in variants)]
    cases.append(dict(B=3, gqa=4, D=64, T=7, mask="random", dtype="bfloat16", S=384, splits=None, seed=99, layers=3))
    rows = []
    for c in cases:
        args = _case(c["B"], c["gqa"], c["D"], c["T"], c["mask"], jnp.dtype(c["dtype"]), c["S"], seed=c["seed"],
                     layers=c.get("layers"))
        layer = jnp.int32(1) if c.get("layers") else None
        row = dict(c)
        try:  # the reference first: on the H200 a failed kernel compile once broke the next XLA one
            want = jax.block_until_ready(tree_attention_ref(*args, scale=c["D"] ** -0.5, layer=layer))
            t0 = time.perf_counter()
            got = jax.block_until_ready(mgpu.tree_attention_mgpu(*args, scale=c["D"] ** -0.5, layer=layer,
                                                                 splits=c["splits"], interpret=interpret))
            row["first_call_s"] = time.perf_counter() - t0
            row["max_abs_err"], row["max_abs_ref"] = _err(got, want)
            row["ok"] = row["max_abs_err"] <= 2e-2 * max(1.0, row["max_abs_ref"])
        except Exception as e:  # noqa: BLE001 - a case that breaks is a finding, not the end of the run
            row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e)[:2000]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    # how many new tokens fit: the tree block (new keys/values and their bias) lives in SMEM
    fits = []
    for D, T in ([] if smoke else [(128, 64), (128, 100), (128, 128), (64, 128), (64, 192)]):
        args = _case(1, 4, D, T, "chain", jnp.bfloat16, 256, seed=7)
        row = {"D": D, "T": T}
        try:
            saved, mgpu.MAX_NEW = mgpu.MAX_NEW, 10 ** 6  # past the dispatcher's limit on purpose
            try:
                got = jax.block_until_ready(mgpu.tree_attention_mgpu(*args, scale=D ** -0.5))
            finally:
                mgpu.MAX_NEW = saved
            row["max_abs_err"], _ = _err(got, tree_attention_ref(*args, scale=D ** -0.5))
            row["compiled"] = True
        except Exception as e:  # noqa: BLE001
            row["compiled"], row["error"] = False, f"{type(e).__name__}: {str(e)[:600]}"
        fits.append(row)
        print(json.dumps(row), flush=True)
    return {"interpret": interpret, "cases": rows, "passed": sum(r["ok"] for r in rows), "total": len(rows),
            "new_tokens_fit": fits}


def part_bench(smoke: bool) -> dict:
    if smoke:
        return kernel_bench.run([256], [16], [1], heads=8, kv_heads=2, head_dim=64, interpret="gpu", reps=1)
    return kernel_bench.run([1024, 8192, 32768], [16, 64], [1, 32], reps=10)


def part_builtin(smoke: bool) -> dict:
    dtype = "bfloat16"
    impls = ["xla", "pallas_interpret_gpu"] if smoke else ["xla", "pallas"]
    n, max_new = (2, 8) if smoke else (8, 256)
    batches = [1] if smoke else [1, 32]
    trees = [parse_tree(t) for t in (["chain4"] if smoke else ["chain6", "60,7,10"])]
    out = {"dtype": dtype, "max_new_tokens": max_new, "trees": [t.__dict__ for t in trees], "impls": {}}
    tokens = {}
    for impl in impls:
        target, drafter, tok = builtin.load(dtype, impl)
        # prompts of at most 32 tokens (108 of the 200): one prompt shape, so one compile per
        # mode and batch (a GPU compiles a decode loop in 5-16 s)
        encoded = (encode_chat(tok, [{"role": "user", "content": t["prompt"]}]) for t in builtin.eval_tasks())
        prompts = [p for p in encoded if len(p) <= 32][:max(batches[-1], n)]
        rec = out["impls"][impl] = {"prompts": len(prompts)}
        try:
            tokens[impl] = eagle3_jax.generate(target, None, prompts[:n], max_new_tokens=max_new).tokens
            for batch in batches:  # run_bench reports each tree's identity with vanilla
                rec[f"batch{batch}"] = run_bench(target, drafter, prompts[:max(batch, n)], trees=trees,
                                                 max_new_tokens=max_new, batch_size=batch, repeats=1)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            traceback.print_exc()
    if len(tokens) == 2:
        a, b = tokens.values()
        out["vanilla_identical_across_impls"] = [sum(x == y for x, y in zip(a, b)), len(a)]
    return out


def part_step(smoke: bool) -> dict:
    shapes = [(1, 256), (1, 16384), (32, 256)] if not smoke else [(1, 64), (2, 64)]
    out = {}
    for dtype in (["float32"] if smoke else ["float32", "bfloat16"]):
        target, _, _ = builtin.load(dtype, "xla")
        ms = cost.step_ms(target, shapes, calls=6 if smoke else 60)
        out[dtype] = {f"batch{b}_slots{s}": v for (b, s), v in ms.items()}
        print(dtype, out[dtype], flush=True)
    return out


def _llama8b(smoke: bool):
    if smoke:
        dims = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=8, num_heads=4, num_kv_heads=2,
                    head_dim=16)
        draft_vocab = 128
    else:
        dims = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128)
        draft_vocab = 32000
    rope = RopeConfig(theta=500000.0)
    tcfg = TargetConfig(family="llama", rms_norm_eps=1e-5, rope=rope, max_position_embeddings=16384, **dims)
    dtype = jnp.float32 if smoke else jnp.bfloat16
    target = Target(tcfg, dtype=dtype, rngs=nnx.Rngs(0))
    dcfg = DrafterConfig(vocab_size=dims["vocab_size"], draft_vocab_size=draft_vocab, hidden_size=dims["hidden_size"],
                         intermediate_size=dims["intermediate_size"], num_heads=dims["num_heads"],
                         num_kv_heads=dims["num_kv_heads"], head_dim=dims["head_dim"], rms_norm_eps=1e-5, rope=rope,
                         target_hidden_size=dims["hidden_size"], max_position_embeddings=16384)
    d2t = np.arange(draft_vocab)  # draft token i is target token 2i (any map: τ is not measured)
    drafter = Drafter(dcfg, target.embed[...], d2t=d2t, dtype=dtype, rngs=nnx.Rngs(1))
    return target, drafter


def part_llama8b(smoke: bool) -> dict:
    tree = TreeConfig(16, 4, 4) if smoke else TreeConfig(60, 7, 10)
    contexts = [40] if smoke else [1024, 8192]
    impls = ["xla"] if smoke else ["xla", "pallas"]
    rounds = (2, 6) if smoke else (4, 20)
    out = {"tree": tree.__dict__, "rows": []}
    target, drafter = _llama8b(smoke)
    rng = np.random.default_rng(0)
    for ctx in contexts:
        prompt = rng.integers(0, target.config.vocab_size, size=ctx).tolist()
        for impl in impls:
            target.attention_impl = impl  # the same weights; a separate program
            row = {"impl": impl, "context": ctx}
            try:
                for mode, d in (("vanilla", None), ("eagle3", drafter)):
                    t0 = time.perf_counter()
                    compiled, args = compile_generate(target, d, [prompt], max_new_tokens=rounds[1] * 8 + 8, tree=tree)
                    row[f"{mode}_compile_s"] = time.perf_counter() - t0
                    forced_call(compiled, args, 0, rounds[0])  # the program's first run
                    best = {}
                    for _ in range(3):
                        for r in rounds:
                            s, n = forced_call(compiled, args, 0, r)
                            best[r] = min(best.get(r, (float("inf"), n)), (s, n))
                    (s0, n0), (s1, n1) = best[rounds[0]], best[rounds[1]]
                    row[f"{mode}_ms_per_round"] = 1e3 * (s1 - s0) / max(n1 - n0, 1)
                    row[f"{mode}_rounds"] = [n0, n1]
                row["round_over_step"] = row["eagle3_ms_per_round"] / row["vanilla_ms_per_round"]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
                traceback.print_exc()
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=PARTS)
    p.add_argument("--out", required=True, help="directory for PART.json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (kernels interpreted)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"part": args.part, "env": _env(), "smoke": args.smoke}
    t0 = time.perf_counter()
    try:
        doc["result"] = globals()[f"part_{args.part}"](args.smoke)
        rc = 0
    except Exception as e:  # noqa: BLE001 - the JSON records it; the next part still runs
        doc["error"] = f"{type(e).__name__}: {str(e)[:4000]}"
        traceback.print_exc()
        rc = 1
    doc["seconds"] = time.perf_counter() - t0
    (out / f"{args.part}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"{args.part}: {doc['seconds']:.1f} s, wrote {out / (args.part + '.json')}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
