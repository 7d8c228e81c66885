"""Tree-attention benchmark: kernel vs jnp reference vs the XLA path, achieved HBM bandwidth vs peak.

    python -m eagle3_jax.pallas_kernels.bench                        # full grid on the default accelerator
    python -m eagle3_jax.pallas_kernels.bench --quick --interpret gpu  # smoke run of a kernel on the CPU

The kernel is the one ``tree_attention.attention`` dispatches to (Mosaic TPU on a TPU,
Mosaic GPU on a Hopper GPU for bfloat16); elsewhere only the reference is timed.

Each row also reports the kernel's largest absolute difference from the reference.
Bytes counted: the visible cache prefix (keys + values) plus queries, new keys/values
and outputs — the minimum an exact kernel must move.  Both timings are taken in one
process on the same inputs; ratios are reference time / kernel time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import layers
from eagle3_jax.pallas_kernels.tree_attention import pick_kernel, tree_attention_ref

PEAK_GBPS = {"TPU v4": 1200, "TPU v5 lite": 819, "TPU v5e": 819, "TPU v5p": 2765, "TPU v5": 2765, "TPU v6 lite": 1640,
             "TPU v6e": 1640, "H100": 3350, "H200": 4800, "A100": 2039}


def peak_bandwidth() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_GBPS.items() if k.lower() in kind.lower()), None)


def _time(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def run(cache_lens, tree_sizes, batches, *, heads=32, kv_heads=8, head_dim=128, dtype=jnp.bfloat16, interpret=None,
        reps=10):
    """One row per (cache length, tree, batch): the time of the reference, of the XLA path the
    decode loop runs (``eagle3_jax.layers.attention``, blockwise over the live prefix:
    ``xla_ms``) and of the kernel (``speedup`` over the reference, ``speedup_vs_xla``)."""
    rows = []
    kernel = pick_kernel(dtype, head_dim, interpret)
    peak = peak_bandwidth()
    print(f"kernel: {_kernel_name(kernel)} on {jax.devices()[0].device_kind}", flush=True)
    for S, T, B in itertools.product(cache_lens, tree_sizes, batches):
        rng = np.random.default_rng(0)
        arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
        q, kn, vn = arr(B, T, heads, head_dim), arr(B, T, kv_heads, head_dim), arr(B, T, kv_heads, head_dim)
        kc, vc = arr(B, S, kv_heads, head_dim), arr(B, S, kv_heads, head_dim)
        prefix = jnp.full((B,), S, jnp.int32)
        mask = jnp.asarray(np.tril(np.ones((B, T, T), bool)))
        scale = head_dim ** -0.5
        ref = jax.jit(lambda *a: tree_attention_ref(*a, scale=scale))
        t_ref = _time(ref, q, kc, vc, prefix, kn, vn, mask, reps=reps)
        item = jnp.dtype(dtype).itemsize
        nbytes = item * (2 * B * S * kv_heads * head_dim + 2 * B * T * heads * head_dim + 2 * B * T * kv_heads * head_dim)
        row = {"cache_len": S, "tree": T, "batch": B, "ref_ms": t_ref * 1e3, "ref_GBps": nbytes / t_ref / 1e9}
        xla = jax.jit(lambda q, kc, vc, prefix, kn, vn, mask: layers.attention(q, (kc[None], vc[None]), 0, prefix, kn,
                                                                               vn, mask, scale=scale))
        row["xla_ms"] = _time(xla, q, kc, vc, prefix, kn, vn, mask, reps=reps) * 1e3
        if kernel is not None:
            ker = jax.jit(lambda *a: kernel(*a, scale=scale))
            t_k = _time(ker, q, kc, vc, prefix, kn, vn, mask, reps=reps)
            err = jnp.abs(ker(q, kc, vc, prefix, kn, vn, mask).astype(jnp.float32)
                          - ref(q, kc, vc, prefix, kn, vn, mask).astype(jnp.float32)).max()
            row.update(kernel_ms=t_k * 1e3, kernel_GBps=nbytes / t_k / 1e9, speedup=t_ref / t_k, max_abs_err=float(err))
            row["speedup_vs_xla"] = row["xla_ms"] / row["kernel_ms"]
            if peak:
                row["kernel_frac_of_peak"] = nbytes / t_k / 1e9 / peak
        rows.append(row)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "peak_GBps": peak,
            "kernel": _kernel_name(kernel), "rows": rows}


def _kernel_name(kernel) -> str:
    if kernel is None:
        return ("none for this backend and dtype (reference and XLA path only; --interpret runs one in its CPU "
                "interpreter)")
    fn = getattr(kernel, "func", kernel)
    interpreted = " in its CPU interpreter" if getattr(kernel, "keywords", {}).get("interpret") else ""
    return f"{fn.__module__}.{fn.__name__}{interpreted}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny grid (CPU smoke run)")
    p.add_argument("--interpret", choices=("tpu", "gpu"), help="run that kernel in its CPU interpreter")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args(argv)
    if args.quick:
        report = run([256], [16], [1], heads=8, kv_heads=2, head_dim=64, interpret=args.interpret, reps=2)
    else:
        report = run([1024, 4096, 16384, 32768], [16, 32, 64], [1, 8, 32], interpret=args.interpret)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
