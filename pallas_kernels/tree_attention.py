"""Tree attention: ``T`` new (tree) tokens attend the committed KV-cache prefix
``[0, prefix_len[b])`` in full plus the ``T`` new keys under a boolean tree mask.

``tree_attention`` (Pallas, TPU Mosaic grid/BlockSpec kernel; runs on the CPU with
``interpret=True``), ``tree_attention_mgpu.tree_attention_mgpu`` (Pallas, Mosaic GPU for
Hopper) and ``tree_attention_ref`` (pure jnp) share one signature; ``attention`` dispatches
by the platform the program is compiled for (``pick_kernel``).

Kernel layout and blocking (TPU)
--------------------------------
* the cache is read in place, in its own layout: ``[B, S, K, D]``, or one ``layer`` of the
  stacked ``[L, B, S, K, D]`` (a traced index, picked by the index map); a TPU keeps its
  minor ``[K, D]`` in (8, 128) tiles, so a block is ``[block_k, hk, D]``: ``block_k``
  slots (default 128) of ``hk`` KV heads, the fewest that fill whole tiles (a multiple
  of 8 that divides ``K``: 8 for the shipped configs' ``K = 8``), else all ``K``.  (A
  ``[S, K·D]`` view would be a free reshape on a CPU or GPU but is a relayout copy of the
  whole cache on a TPU.)  In VMEM the block is turned head-major, ``[hk, block_k, D]``,
  before its matmuls.
* grid ``(B, K // hk, cdiv(S, block_k))``: one program per (sequence, head group),
  walking the cache block by block (``pl.Blocked`` indices: every block starts at a
  multiple of ``block_k``, which Mosaic can prove tile-aligned); the last axis carries the
  online-softmax state.  Every cache byte is read once (GQA-aware: the query block holds
  all ``G·T`` rows of the heads sharing each KV head, ``[hk, G·T, D]``, resident in VMEM).
* a cache whose length is not a multiple of ``block_k`` is not padded: its last block
  runs past the end (Pallas clips the copy), and the slots there are masked, their values
  zeroed (VMEM past the copy holds anything, NaN too).  A cache shorter than ``block_k``
  is one block of all its slots.
* blocks at or past ``prefix_len[b]`` are skipped: the index map clamps the block index to
  the block holding the prefix's last slot, so the pipeline issues no new DMA (index
  arithmetic on non-negative ints, ``lax.div`` rather than ``//``: Mosaic lowers a floor
  division through ``sign``, which it refuses in an index map); the last grid step also
  folds in the ``T`` new keys (``[B, K, T, D]``) under the tree mask, tiled to the query
  rows (``[B, G·T, T]``).
* accumulators ``m, l [hk, G·T, 1]`` and ``acc [hk, G·T, D]`` are float32 VMEM scratch;
  inputs may be bfloat16 or float32, matmuls accumulate in float32.

``scripts/tpu_kernel_sweep.py`` compiles it through Mosaic for v5e, v5p and v6e at the
shipped configs' shapes, without a TPU (libtpu compiles for a topology that is not there);
its speed on a chip is not measured here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from eagle3_jax import kv_cache
from eagle3_jax.pallas_kernels.layout import rows_by_kv_head, rows_to_tokens, stacked_cache


def tree_attention_ref(q_BxTxNxD, k_cache, v_cache, prefix_len_B, k_new_BxTxKxD, v_new_BxTxKxD, tree_mask_BxTxT, *,
                       scale: float, layer=None):
    """jnp reference: softmax over [cache prefix ; new tokens under the tree mask], float32.

    The cache is ``[B, S, K, D]``, or the stacked ``[L, B, S, K, D]`` with ``layer`` (an
    int32 scalar, may be traced) naming one; the kernels read that layer in place.
    """
    k_cache_BxSxKxD, v_cache_BxSxKxD = (k_cache, v_cache) if layer is None else (k_cache[layer], v_cache[layer])
    B, T, N, D = q_BxTxNxD.shape
    S, K = k_cache_BxSxKxD.shape[1], k_cache_BxSxKxD.shape[2]
    k = jnp.concatenate([k_cache_BxSxKxD, k_new_BxTxKxD.astype(k_cache_BxSxKxD.dtype)], 1)
    v = jnp.concatenate([v_cache_BxSxKxD, v_new_BxTxKxD.astype(v_cache_BxSxKxD.dtype)], 1)
    prefix_vis = jnp.arange(S)[None, None, :] < prefix_len_B[:, None, None]
    visible = jnp.concatenate([jnp.broadcast_to(prefix_vis, (B, T, S)), tree_mask_BxTxT.astype(bool)], -1)
    q = q_BxTxNxD.reshape(B, T, K, N // K, D)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return out.reshape(B, T, N, D).astype(q_BxTxNxD.dtype)


def _online_update(s, v, m_ref, l_ref, acc_ref):
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=-1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_ref[...] = m_new


def _kernel(prefix_ref, layer_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref, *,
            scale: float, block_k: int, cache_len: int):
    b, j = pl.program_id(0), pl.program_id(2)
    prefix = jnp.minimum(prefix_ref[b], cache_len)
    heads = q_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def update(h, k, v, mask_fn):
        q = q_ref[h]
        if k.shape[0] == 1:  # one key (one new token): Pallas lowers a 16-bit matrix-vector dot with a bad
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)  # broadcast (jax 0.10.2); exact in float32
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        _online_update(mask_fn(s), v, m_ref.at[h], l_ref.at[h], acc_ref.at[h])

    @pl.when(j * block_k < prefix)
    def _prefix_block():
        visible = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1) < prefix
        kb, vb = (jnp.swapaxes(ref[...], 0, 1) for ref in (k_ref, v_ref))  # [heads, block_k, D]
        if cache_len % block_k:  # the last block runs past the cache's end, into VMEM rows that hold
            rows = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k, 1), 1)  # anything, NaN too,
            vb = jnp.where(rows < cache_len, vb, 0)  # and 0 · NaN is NaN: zero their values
        for h in range(heads):
            update(h, kb[h], vb[h], lambda s: jnp.where(visible, s, -jnp.inf))

    @pl.when(j == pl.num_programs(2) - 1)
    def _tree_block_and_finish():
        mask = mask_ref[...] > 0
        for h in range(heads):
            update(h, kn_ref[h], vn_ref[h], lambda s: jnp.where(mask, s, -jnp.inf))
            o_ref[h] = (acc_ref[h] / l_ref[h]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "interpret"))
def tree_attention(q_BxTxNxD, k_cache, v_cache, prefix_len_B, k_new_BxTxKxD, v_new_BxTxKxD, tree_mask_BxTxT, *,
                   scale: float, layer=None, block_k: int = 128, interpret: bool = False):
    """Pallas TPU tree attention (see the module docstring for blocking and layout)."""
    B, T, N, D = q_BxTxNxD.shape
    kc, vc, layer = stacked_cache(k_cache, v_cache, layer)
    L, _, S, K, _ = kc.shape
    G = N // K
    block_k = min(block_k, S)  # a shorter cache is one block of all its slots
    # KV heads per program: the fewest that fill whole (8, 128) tiles of the cache's [K, D], else all of them
    hk = next((h for h in range(8, K, 8) if K % h == 0), K)
    # head-major layouts of the small operands: [B, K, rows, D]
    q = rows_by_kv_head(q_BxTxNxD, K)
    kn = k_new_BxTxKxD.astype(kc.dtype).transpose(0, 2, 1, 3)
    vn = v_new_BxTxKxD.astype(vc.dtype).transpose(0, 2, 1, 3)
    mask = jnp.tile(tree_mask_BxTxT.astype(jnp.int32), (1, G, 1))  # [B, G·T, T]: rows are g-major, row = g·T + t
    prefix = prefix_len_B.astype(jnp.int32)

    def kv_index(b, g, j, prefix_ref, layer_ref):
        # block indices; past the prefix, the block holding its last slot again (no new DMA).  lax.div of
        # a non-negative int, not //: Mosaic lowers a floor division through sign, which it refuses here
        last = jax.lax.div(jnp.clip(prefix_ref[b] - 1, 0, S - 1), block_k)
        return layer_ref[0], b, jnp.minimum(j, last), g, 0

    heads = lambda b, g, j, *_: (b, g, 0, 0)
    kv_spec = pl.BlockSpec((None, None, block_k, hk, D), kv_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, K // hk, pl.cdiv(S, block_k)),
        in_specs=[pl.BlockSpec((None, hk, G * T, D), heads), kv_spec, kv_spec,
                  pl.BlockSpec((None, hk, T, D), heads), pl.BlockSpec((None, hk, T, D), heads),
                  pl.BlockSpec((None, G * T, T), lambda b, g, j, *_: (b, 0, 0))],
        out_specs=pl.BlockSpec((None, hk, G * T, D), heads),
        scratch_shapes=[pltpu.VMEM((hk, G * T, 1), jnp.float32), pltpu.VMEM((hk, G * T, 1), jnp.float32),
                        pltpu.VMEM((hk, G * T, D), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_k=block_k, cache_len=S),
        out_shape=jax.ShapeDtypeStruct((B, K, G * T, D), q_BxTxNxD.dtype),
        grid_spec=grid_spec,
        interpret=interpret,
        cost_estimate=cost_estimate(q, kc, kn, mask),
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(prefix, layer, q, kc, vc, kn, vn, mask)
    return rows_to_tokens(out, T)


def cost_estimate(q_BxKxRxD, k_cache_LxBxSxKxD, k_new_BxKxTxD, mask_BxRxT) -> pl.CostEstimate:
    """What one call costs at most, for XLA's cost analysis (which counts a Mosaic call as
    nothing without it): its small operands and output, one layer's keys and values read
    whole, and the score and value matmuls and exponentials over every cache slot and new
    key.  A call whose prefix is shorter reads and computes less (blocks past the prefix
    are skipped), so this is the cost at a full cache."""
    B, K, R, D = q_BxKxRxD.shape  # R = G·T query rows a KV head
    S, T = k_cache_LxBxSxKxD.shape[2], k_new_BxKxTxD.shape[2]
    keys = S + T
    small = 2 * q_BxKxRxD.nbytes + 2 * k_new_BxKxTxD.nbytes + mask_BxRxT.nbytes + 4 * B
    layer = 2 * B * S * K * D * k_cache_LxBxSxKxD.dtype.itemsize
    return pl.CostEstimate(flops=4 * B * K * R * keys * D, transcendentals=B * K * R * keys,
                           bytes_accessed=small + layer)


# The most new tokens per sequence the TPU kernel takes: its query rows (G·T of a KV head) and
# the tree mask live in VMEM, which a tree or a decode step fits and a prefill does not (a
# 1024-token prefill of Llama-3.1-8B asked 137 MiB of v5e's 128 MiB): those use the reference.
MAX_NEW = 64


def _is_hopper(device) -> bool:  # WGMMA exists on sm_90 only (not Ampere, not Blackwell)
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def pick_kernel(dtype, head_dim: int, interpret: str | None = None, new_tokens: int = 1, cache_len: int = 0,
                platform: str | None = None):
    """The kernel ``attention`` runs for ``dtype`` inputs, or ``None`` for the XLA reference.

    ``interpret=None`` picks the compiled kernel for ``platform``, a lowering platform
    (``"tpu"``, ``"cuda"``, ...; default: the default device's): the Mosaic TPU kernel for a
    TPU, for at most ``MAX_NEW`` new tokens per sequence; the Mosaic GPU kernel for CUDA, where the attached GPU, if any, is a Hopper (the
    kernel is sm_90a code), for bfloat16/float16 (WGMMA has no exact float32), head_dim
    64/128, at most ``MAX_NEW`` new tokens per sequence (``new_tokens``: a tree or a decode
    step; a prefill does not fit its shared memory) and a cache of ``cache_len`` slots it can
    tile (``tree_attention_mgpu.supports``).  ``interpret="tpu"`` / ``"gpu"`` returns that
    kernel in its CPU interpreter, the GPU one under the same rule as on a GPU (else ``None``).
    """
    from eagle3_jax.pallas_kernels import tree_attention_mgpu as mgpu  # here: Mosaic GPU only where it runs

    if interpret not in (None, "tpu", "gpu"):
        raise ValueError(f"interpret={interpret!r}: expected None, 'tpu' or 'gpu'")
    if interpret == "tpu":
        return functools.partial(tree_attention, interpret=True)
    if interpret == "gpu":
        fits = mgpu.supports(dtype, head_dim, new_tokens, cache_len)
        return functools.partial(mgpu.tree_attention_mgpu, interpret=True) if fits else None
    device = jax.devices()[0]
    platform = platform or {"gpu": "cuda"}.get(device.platform, device.platform)
    if platform == "tpu":
        return tree_attention if new_tokens <= MAX_NEW else None
    attached_hopper = device.platform != "gpu" or _is_hopper(device)  # no GPU attached: compiling for one
    if platform == "cuda" and attached_hopper and mgpu.supports(dtype, head_dim, new_tokens, cache_len):
        return mgpu.tree_attention_mgpu
    return None


def attention(q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask, *, scale: float, layer=None,
              interpret: str | None = None):
    """Dispatcher: the kernel ``pick_kernel`` chooses for ``q``, else the XLA reference.

    Compiled (``interpret=None``), the platform the program is lowered for chooses, through
    ``lax.platform_dependent``: only that platform's branch is lowered, so a program compiled
    for a TPU topology on a CPU host runs the Mosaic kernel, and the CPU runs the reference.
    """
    args = (q, k_cache, v_cache, prefix_len, k_new, v_new, tree_mask)
    pick = functools.partial(pick_kernel, q.dtype, q.shape[-1], interpret, new_tokens=q.shape[1],
                             cache_len=k_cache.shape[-3])
    reference = functools.partial(tree_attention_ref, scale=scale, layer=layer)
    if interpret is not None:
        kernel = pick()
        return reference(*args) if kernel is None else kernel(*args, scale=scale, layer=layer)
    branches = {p: per_device(functools.partial(kernel, scale=scale), q, k_cache, layer)
                for p in ("tpu", "cuda") if (kernel := pick(platform=p)) is not None}
    return jax.lax.platform_dependent(*args, default=reference, **branches)


def per_device(kernel, q_BxTxNxD, k_cache, layer):
    """``kernel`` as a function of ``attention``'s seven arrays, run on each device's block
    under ``jax.shard_map`` where a mesh of several devices is set
    (``jax.sharding.get_abstract_mesh()``: the decode loop sets its cache's): XLA cannot
    partition a Mosaic kernel.  The blocks are the cache's layout (``kv_cache.layout``: the
    batch over the batch axes, KV heads over ``tensor`` where they divide); the query rows and
    new keys follow it, so each device's queries meet their own KV heads."""
    mesh = jax.sharding.get_abstract_mesh()
    stacked = layer is not None
    if mesh.empty or mesh.size == 1:
        return lambda *args: kernel(*args, layer=layer)
    spec = tuple(kv_cache.layout(k_cache.shape if stacked else (1, *k_cache.shape), mesh).spec)
    batch, heads = (spec + (None,) * (5 - len(spec)))[1:4:2]  # query heads split as their KV heads (N = G·K)
    rows, tokens = P(batch), P(batch, None, heads, None)
    cache = P(None, batch, None, heads, None) if stacked else P(batch, None, heads, None)
    in_specs = (tokens, cache, cache, rows, tokens, tokens, rows)

    if stacked:
        def local(q, kc, vc, prefix, kn, vn, mask, layer_):
            return kernel(q, kc, vc, prefix, kn, vn, mask, layer=layer_)

        mapped = jax.shard_map(local, in_specs=in_specs + (P(),), out_specs=tokens, check_vma=False)
        return lambda *args: mapped(*args, jnp.asarray(layer, jnp.int32))
    return jax.shard_map(lambda *args: kernel(*args, layer=None), in_specs=in_specs, out_specs=tokens,
                         check_vma=False)
