"""The decode step's attention at batch 1 and 32 against this machine's memory bandwidth.

    python scripts/cpu_kernel_rates.py [--batch 1 32] [--live 33 200] [--repeats 100]

With the built-in target's shapes (16 layers, its heads and head size) and a stacked
``[layers, batch, 256, kv_heads, head_dim]`` float32 cache, times every layer's attention of
one new query per sequence over ``--live`` committed slots: ``eagle3_jax.layers.attention``
(64-slot blocks and the new token, online softmax) jitted in a loop over the layers, as a
decode step runs it.  One query per sequence makes attention a read of the keys and values
(a couple of flops per byte), so its floor is the time to read them: the script prints the
blocks' bytes, the rate the compiled attention reads them at, the rate NumPy copies a buffer
of that size on the same machine (``np.copyto``, the fastest of ``--repeats``), and the ratio
of the two.  A ratio well under 1 says that the compiled kernels, not the bytes the work needs,
set the attention's time (at batch 1, the ops' own cost; at batch 32 on XLA:CPU, the copy of
each block out of the stacked cache before its dots).  The attention's output is checked
against ``layers.attention_ref`` so that the timed call computes what it should.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import builtin, layers


def _timed_ms(fn, repeats: int, best: bool = False) -> float:
    """Median (or fastest) milliseconds of ``fn()`` over ``repeats`` calls, after a first one."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.min(times) if best else np.median(times))


def attention_case(cfg, batch: int, live: int, slots: int = 256, seed: int = 0):
    """``(call, check, bytes)``: every layer's attention of one new query per sequence over
    ``live`` committed slots; ``check()`` is the largest difference from ``attention_ref`` on
    the first layer; ``bytes``: the keys and values of the blocks read, all layers."""
    L, K, D, N = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    scale = D ** -0.5
    rng = np.random.default_rng(seed)
    k_c, v_c = (jnp.asarray(rng.standard_normal((L, batch, slots, K, D), np.float32)) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 1, N, D), np.float32))
    k_new, v_new = (jnp.asarray(rng.standard_normal((batch, 1, K, D), np.float32)) for _ in range(2))
    prefix = jnp.full((batch,), live, jnp.int32)
    mask = layers.causal_mask(batch, 1)

    @jax.jit
    def every_layer(q, k_c, v_c):
        def layer(i, q):  # each layer's output feeds the next query, as in the model
            return q + 1e-3 * layers.attention(q, (k_c, v_c), i, prefix, k_new, v_new, mask, scale=scale)
        return jax.lax.fori_loop(0, L, layer, q)

    def check() -> float:
        out = layers.attention(q, (k_c, v_c), 0, prefix, k_new, v_new, mask, scale=scale)
        k_all = k_c[0].at[:, live].set(k_new[:, 0])  # the new token right after the prefix
        v_all = v_c[0].at[:, live].set(v_new[:, 0])
        ref = layers.attention_ref(q, k_all, v_all, layers.visibility(prefix, mask, slots), scale)
        return float(jnp.abs(out - ref).max())

    blocks = -(-live // layers.PREFIX_BLOCK) * layers.PREFIX_BLOCK
    return (lambda: every_layer(q, k_c, v_c)), check, 2 * L * batch * blocks * K * D * 4


def copy_gbps(nbytes: int, repeats: int) -> float:
    """GB/s of ``np.copyto`` between two float32 buffers of ``nbytes``."""
    src = np.random.default_rng(0).standard_normal(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return nbytes / _timed_ms(lambda: np.copyto(dst, src), repeats, best=True) / 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--live", type=int, nargs="+", default=[33, 200],
                    help="committed slots per sequence, at most 256 (33: one 64-slot block)")
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args(argv)
    if any(not 1 <= n <= 256 for n in args.live):
        ap.error("--live: expected 1 to 256 (the cache has 256 slots)")
    if any(b < 1 for b in args.batch):
        ap.error("--batch: expected 1 or more")

    cfg = builtin.load()[0].config
    print(f"{jax.default_backend()} backend, {cfg.num_layers} layers, float32; attention: median of "
          f"{args.repeats} calls; copy: fastest of {args.repeats}")
    for live in args.live:
        ms = {}
        for b in args.batch:
            call, check, nbytes = attention_case(cfg, b, live)
            gap = check()
            if not gap < 1e-4:
                raise SystemExit(f"batch {b}, live {live}: attention differs from attention_ref by {gap}")
            ms[b] = _timed_ms(call, args.repeats)
            xla, copy = nbytes / ms[b] / 1e6, copy_gbps(nbytes, args.repeats)
            print(f"  live {live:3d} batch {b:3d}: {ms[b]:7.3f} ms for {nbytes / 1e6:6.2f} MB of blocks: "
                  f"{xla:5.2f} GB/s; NumPy copies {copy:5.2f} GB/s ({xla / copy:.2f} of it)", flush=True)
        lo, hi = min(args.batch), max(args.batch)
        if lo != hi:
            print(f"  live {live:3d} batch {hi} / batch {lo}: {ms[hi] / ms[lo]:.2f}x the time for {hi // lo}x the bytes")


if __name__ == "__main__":
    main()
