"""Compiles the Pallas TPU tree-attention kernel through Mosaic for TPU v5e, v5p and v6e, on
a host without a TPU.

    python scripts/tpu_kernel_sweep.py [--quick] [--chips v5e v5p v6e]

libtpu (``pip install -e ".[tpu]"``) compiles for a topology that is not there: each shape
is ``jax.jit(tree_attention).lower(...).compile()`` on one chip of ``v5e:2x2``, ``v5p:2x2x1``
or ``v6e:2x2``, with the cache as the decode loop passes it (the stacked
``[L, B, S, K, D]`` cache of all layers and a traced layer index).  The shapes are those of
the shipped configs' attention (bfloat16, head_dim 128, 32 or 64 query heads over 8 KV heads:
Llama-3.1-8B, Qwen3-8B and R1-Distill-Llama-8B, Llama-3.3-70B) over caches of 2k-32k slots,
some not a multiple of the kernel's 128-slot block, 1, 16 or 64 new (tree) tokens and
batches of 1, 4 and 64: not the cross product, a covering set in which every pair of values
of two of these dimensions appears (and two ``[B, S, K, D]`` single-layer caches), 19
shapes per chip, a few minutes on two cores (``--quick``: three, half a minute).  Each
stacked cache has the model's layers, or as many as fit 8 GiB (a one-chip compile refuses
arguments past its HBM; v5e has 16 GiB).

Each compiled program must hold the Mosaic kernel (a ``tpu_custom_call``), per its
``memory_analysis`` temporaries smaller than one layer of the cache (the cache is read in
place, never copied), and per its ``cost_analysis`` the bytes of one layer's keys and values
(the kernel's ``pl.CostEstimate``; without one XLA counts a Mosaic call as nothing).  One line per shape, a line per chip, and a closing summary; the exit
status is nonzero if any shape fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time

import jax
import jax.numpy as jnp

from eagle3_jax.pallas_kernels.tree_attention import tree_attention
from eagle3_jax.topology import devices as topology_devices

TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}  # the smallest each libtpu describes
HEAD_DIM, KV_HEADS = 128, 8
LAYERS = {32: 32, 64: 80}  # query heads -> the config's layers (8B models: 32; Llama-3.3-70B: 80)
CACHE_BUDGET = 8 << 30  # bytes of keys and values one compile may pass


@dataclasses.dataclass(frozen=True)
class Shape:
    """One kernel call: ``batch`` sequences of ``new`` tree tokens over a ``slots``-slot cache."""

    batch: int
    new: int
    heads: int
    slots: int
    stacked: bool = True  # the [L, B, S, K, D] cache with a traced layer index, else [B, S, K, D]

    @property
    def layers(self) -> int:
        per_layer = 2 * self.batch * self.slots * KV_HEADS * HEAD_DIM * 2  # keys and values, bfloat16
        return max(1, min(LAYERS[self.heads], CACHE_BUDGET // per_layer)) if self.stacked else 1

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's keys (what a copy of the cache would at least take)."""
        return self.batch * self.slots * KV_HEADS * HEAD_DIM * 2

    def __str__(self):
        cache = f"[{self.layers},B,S,K,D] traced layer" if self.stacked else "[B,S,K,D]"
        return (f"B={self.batch:<2} T={self.new:<2} heads={self.heads}/{KV_HEADS} S={self.slots:<5} "
                f"cache {cache}")


def shapes(quick: bool = False) -> list[Shape]:
    """A covering set, not the cross product: for each (cache slots, new tokens) pair one
    (batch, query heads) pair, chosen so that every pair of values of any two of the four
    dimensions appears; then the shape the TPU kernel first failed at, Llama-3.3-70B's decode
    at the largest batch and cache, and two single-layer caches."""
    if quick:
        return [Shape(1, 1, 32, 3000), Shape(4, 16, 64, 8192), Shape(2, 64, 32, 2048, stacked=False)]
    batches, new, heads, slots = (1, 4, 64), (1, 16, 64), (32, 64), (2048, 3000, 8192, 8200, 32768)
    covering = [Shape(batches[(s + t) % 3], new[t], heads[(s + t) % 2], slots[s])
                for s, t in itertools.product(range(len(slots)), range(len(new)))]
    return covering + [Shape(4, 16, 32, 8192), Shape(64, 1, 64, 32768), Shape(1, 1, 32, 3000, stacked=False),
                       Shape(2, 16, 64, 8200, stacked=False)]


def tpu_device(topology: str):
    """One chip of TPU topology ``topology``, compile-only (``eagle3_jax.topology.devices``)."""
    return topology_devices(topology)[0]


def compile_shape(device, shape: Shape) -> jax.stages.Compiled:
    """``tree_attention`` (not interpreted) compiled for ``device`` at ``shape``."""
    mesh = jax.sharding.Mesh([device], ("chip",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sds = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype, sharding=one)
    B, T, N, S, K, D = shape.batch, shape.new, shape.heads, shape.slots, KV_HEADS, HEAD_DIM
    cache = (shape.layers, B, S, K, D) if shape.stacked else (B, S, K, D)
    args = [sds(B, T, N, D), sds(*cache), sds(*cache), sds(B, dtype=jnp.int32), sds(B, T, K, D), sds(B, T, K, D),
            sds(B, T, T, dtype=jnp.bool_)]
    if shape.stacked:
        fn = lambda q, kc, vc, prefix, kn, vn, mask, layer: tree_attention(q, kc, vc, prefix, kn, vn, mask,
                                                                           scale=D ** -0.5, layer=layer)
        args.append(sds(dtype=jnp.int32))
    else:
        fn = lambda *a: tree_attention(*a, scale=D ** -0.5)
    return jax.jit(fn).lower(*args).compile()


def check(compiled: jax.stages.Compiled, shape: Shape) -> tuple[str | None, int | None]:
    """What is wrong with the compiled program (or ``None``), and its temporaries' bytes
    (``None`` where ``memory_analysis`` gives none)."""
    memory = compiled.memory_analysis()
    temporaries = None if memory is None else memory.temp_size_in_bytes
    if "tpu_custom_call" not in compiled.as_text():
        return "no Mosaic kernel (tpu_custom_call) in the compiled program", temporaries
    if temporaries is not None and temporaries >= shape.layer_bytes:
        return f"temporaries of {temporaries} bytes: a copy of the cache", temporaries
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    read = cost.get("bytes accessed", 0)
    if not 2 * shape.layer_bytes <= read < 4 * shape.layer_bytes:  # the kernel's pl.CostEstimate: one layer
        return (f"cost analysis counts {read:.0f} bytes, not one layer's keys and values "
                f"({2 * shape.layer_bytes})"), temporaries
    return None, temporaries


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="three shapes per chip")
    p.add_argument("--chips", nargs="+", choices=tuple(TOPOLOGIES), default=list(TOPOLOGIES))
    args = p.parse_args(argv)
    start = time.perf_counter()
    todo = shapes(args.quick)
    passed = 0
    for chip in args.chips:
        device = tpu_device(TOPOLOGIES[chip])
        chip_start, chip_passed, compiled, memory_known = time.perf_counter(), 0, 0, 0
        for shape in todo:
            shape_start, temporaries = time.perf_counter(), None
            try:
                problem, temporaries = check(compile_shape(device, shape), shape)
                compiled, memory_known = compiled + 1, memory_known + (temporaries is not None)
            except Exception as e:  # Mosaic's and XLA's refusals
                problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
            memory = "" if temporaries is None else f"  temporaries {temporaries / 2 ** 20:.1f} MiB"
            print(f"{chip}  {shape}  {'FAILED: ' + problem if problem else 'ok'}  "
                  f"{time.perf_counter() - shape_start:.1f} s{memory}", flush=True)
            chip_passed += problem is None
        passed += chip_passed
        memory = "available" if memory_known == compiled else f"NOT available ({compiled - memory_known} programs)"
        print(f"{chip} ({device.device_kind}): {chip_passed}/{len(todo)} compiled in "
              f"{time.perf_counter() - chip_start:.1f} s; memory_analysis {memory}", flush=True)
    total = len(todo) * len(args.chips)
    print(f"tpu kernel sweep: {passed}/{total} shapes compiled on {', '.join(args.chips)} "
          f"({time.perf_counter() - start:.1f} s)")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
