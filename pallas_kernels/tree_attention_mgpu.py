"""Tree attention on NVIDIA Hopper: a Mosaic GPU (Pallas) kernel, same semantics and
signature as ``tree_attention.tree_attention_ref``.

Kernel layout and blocking
--------------------------
* rows: the ``G·T`` query rows that share KV head ``h`` (``row = g·T + t``), padded to a
  multiple of ``block_q = 64`` (one warpgroup's WGMMA tile); q is relaid out to
  ``[B, K, rows, D]`` (small: the tree, not the cache).
* grid ``(row tiles, K, B·(splits + 1))``, one warpgroup per block.  Blocks
  ``split < splits`` each walk an equal share of the cache prefix ``[0, prefix_len[b])`` in
  ``block_kv`` slots (default 64, ``max_concurrent_steps`` TMA copies in flight, default
  4), reading the cache in place from its ``[B, S, K, D]`` layout (strided TMA, no copy);
  block ``split = splits`` attends the ``T`` new keys under the tree mask, given as an
  additive f32 bias ``[B, rows, T_pad]`` (``T_pad`` = ``T`` rounded up to 64).  The row
  tiles of one (head, sequence, split) are adjacent in launch order, so they read the same
  cache blocks while these are in L2.
* a cache whose length is not a multiple of ``block_kv`` is not padded: the last block
  starts at ``S - block_kv`` and masks the slots an earlier block already covered.
* per block: Q tile ``[64, D]`` in SMEM; ``S = Q·Kᵀ`` and ``acc += P·V`` on WGMMA with f32
  accumulators; online softmax (``m``, ``l``, ``acc [64, D]``) in f32 registers; each block
  writes its normalised partial output and log-sum-exp (f32), and the partials are merged
  in XLA (``(splits + 1)·B·N·T·D`` floats).
* ``splits`` defaults to enough blocks for about two per SM, with at least 4 cache blocks
  per split.  SMEM per block: the K/V pipeline and the Q tile,
  ``(2·max_concurrent_steps·block_kv + 64)·D`` 16-bit elements, plus the f32 output tile
  ``64·D``: 176 KiB at D = 128 with the defaults, so head_dim is 64 or 128.

Inputs must be bfloat16 or float16: WGMMA has no float32 mode (float32 operands would run
as TF32, ~1e-3 relative), so the dispatcher sends float32 to the XLA reference instead.
``interpret=True`` runs the kernel in the Mosaic GPU interpreter on the CPU (TMA copies,
barriers and WGMMA simulated).  The interpreter (jax 0.10) has no transposed or register
WGMMA operand and no ``run_state``, so those few lines take other, equivalent forms in
interpret mode (``_wgmma``, ``_softmax_step``); the compiled form is checked by lowering it
for sm_90a without a GPU (``lower(lowering_platforms=("cuda",))``).  The tests do both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from eagle3_jax.pallas_kernels.layout import rows_by_kv_head, rows_to_tokens, stacked_cache

BLOCK_Q = 64  # one warpgroup's WGMMA M tile
BLOCK_KV = 64  # cache slots per pipeline step (the default block_kv); a shorter cache is padded to one
MASK = -1e30  # finite: a fully masked block gives weight exp(MASK - m) = 0, never NaN
DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)  # SMEM holds a 4-deep K/V pipeline of 64-slot blocks up to D = 128
# the new keys/values and their bias are one SMEM block: 2·T_pad·D 16-bit + 64·T_pad f32, double
# buffered, beside the Q/O tiles (48 KiB at D = 128): by this count T_pad = 64 fits the 227 KiB a
# block may have and 128 does not (device_check's `kernels` part probes it); longer runs (a
# prefill) go to the XLA reference (``supports``)
MAX_NEW = 64
# the cache's slots a multiple of 8 (the TMA descriptor's row tiling; the last block's start,
# S - block_kv, must be 8-aligned for layout inference): 150 or 1193 slots fail to lower
CACHE_ALIGN = 8


def _is_16bit(dtype) -> bool:
    return jnp.dtype(dtype) in map(jnp.dtype, DTYPES)


def supports(dtype, head_dim: int, new_tokens: int = 1, cache_len: int = 0) -> bool:
    """Whether the kernel takes ``dtype`` inputs with this head_dim, ``new_tokens`` new (tree)
    tokens per sequence (at most ``MAX_NEW``: a tree or a decode step, not a prefill) and a
    cache of ``cache_len`` slots (a multiple of ``CACHE_ALIGN``, or shorter than a block, which
    is padded; ``kv_cache.capacity`` sizes the decode loop's caches so)."""
    return (_is_16bit(dtype) and head_dim in HEAD_DIMS and new_tokens <= MAX_NEW
            and (cache_len % CACHE_ALIGN == 0 or cache_len < BLOCK_KV))


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or 132  # 132: H100/H200 SXM


def _default_splits(row_tiles: int, kv_heads: int, batch: int, cache_len: int, block_kv: int) -> int:
    """Cache splits per (row tile, head, sequence): ~2 blocks per SM, ≥ 4 cache blocks each."""
    blocks = row_tiles * kv_heads * batch
    return max(1, min(-(-2 * _num_sms() // blocks), cache_len // (4 * block_kv)))


def _wgmma(acc_ref, a, b_ref, *, transpose_b: bool, interpret: bool):
    """``acc += a @ b`` (``bᵀ`` if ``transpose_b``) on WGMMA, ``a`` an SMEM ref or registers.

    On the GPU the transpose is a descriptor flag and a register ``a`` feeds the tensor
    core directly.  The Mosaic GPU interpreter (jax 0.10) takes neither, so in interpret
    mode both are staged through scratch SMEM first: the same product, in the forms it has.
    """
    if not interpret:
        plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref)
        return
    b_shape = b_ref.shape[::-1] if transpose_b else b_ref.shape

    def staged(a_smem, b_smem):
        a_smem[...] = a[...]  # a ref or an array: [...] reads either
        b_smem[...] = b_ref[...].T if transpose_b else b_ref[...]
        plgpu.wgmma(acc_ref, a_smem, b_smem)

    pl.run_scoped(staged, plgpu.SMEM(acc_ref.shape[:1] + b_shape[:1], b_ref.dtype), plgpu.SMEM(b_shape, b_ref.dtype))


def _softmax_step(carry, q_smem, k_smem, v_smem, mask_fn, *, scale, interpret):
    """One online-softmax step over a ``[n, D]`` key/value block held in SMEM."""
    acc_QxD, m_Q, l_Q = carry

    def qk(acc_ref):
        _wgmma(acc_ref, q_smem, k_smem, transpose_b=True, interpret=interpret)
        return acc_ref[...]

    s_QxN = mask_fn(pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, k_smem.shape[0]), jnp.float32)) * scale)
    m_new = jnp.maximum(m_Q, s_QxN.max(axis=1))
    alpha = jnp.exp(m_Q - m_new)
    p_QxN = jnp.exp(s_QxN - lax.broadcast_in_dim(m_new, s_QxN.shape, [0]))
    l_Q = l_Q * alpha + p_QxN.sum(axis=1)

    acc_QxD = acc_QxD * lax.broadcast_in_dim(alpha, acc_QxD.shape, [0])

    def pv(acc_ref):
        _wgmma(acc_ref, p_QxN.astype(v_smem.dtype), v_smem, transpose_b=False, interpret=interpret)

    if interpret:  # no run_state there: P·V into a fresh accumulator, then added
        def fresh(acc_ref):
            pv(acc_ref)
            return acc_ref[...]

        return acc_QxD + pl.run_scoped(fresh, plgpu.ACC(acc_QxD.shape, jnp.float32)), m_new, l_Q
    return pl.run_state(pv)(plgpu.ACC.init(acc_QxD)), m_new, l_Q  # accumulates in place: one [64, D] live


def _kernel(prefix_ref, layer_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, bias_ref, o_ref, lse_ref, q_smem, o_smem, lse_smem,
            q_barrier, *, scale, block_kv, splits, max_concurrent_steps, interpret):
    r_tile, h, bs = lax.axis_index("rows"), lax.axis_index("heads"), lax.axis_index("bs")
    b, split = lax.div(bs, splits + 1), lax.rem(bs, splits + 1)
    rows = pl.ds(r_tile * BLOCK_Q, BLOCK_Q)
    D = q_smem.shape[1]
    S = k_ref.shape[2]
    layer = layer_ref[0]

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_barrier)
    plgpu.barrier_wait(q_barrier)
    step = functools.partial(_softmax_step, scale=scale, interpret=interpret)
    init = (jnp.zeros((BLOCK_Q, D), jnp.float32), jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
            jnp.zeros((BLOCK_Q,), jnp.float32))

    def finish(carry):
        acc, m, l = carry
        o_smem[...] = acc / lax.broadcast_in_dim(l, acc.shape, [0])
        lse_smem[...] = m + jnp.log(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, b, h, rows])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(split < splits)
    def _cache_share():
        prefix = prefix_ref[b]
        n_blocks = lax.div(prefix + block_kv - 1, block_kv)
        per = lax.div(n_blocks + splits - 1, splits)
        first = jnp.minimum(split * per, n_blocks)
        count = jnp.minimum(per, n_blocks - first)

        def start(i):  # element offset of block first + i, clamped so it never runs past S
            return jnp.minimum((first + i) * block_kv, S - block_kv)

        def body(idx, k_smem, v_smem, carry):
            (i,) = idx
            lo = (first + i) * block_kv  # slots below lo belong to the previous block
            slot = start(i) + lax.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 1)
            visible = (slot >= lo) & (slot < prefix)
            return step(carry, q_smem, k_smem, v_smem, lambda s: jnp.where(visible, s, MASK))

        spec = plgpu.BlockSpec((pl.Element(block_kv), D), lambda i: (start(i), 0))
        carry = plgpu.emit_pipeline(body, grid=(count,), in_specs=[spec, spec],
                                    max_concurrent_steps=max_concurrent_steps, init_carry=init)(
            k_ref.at[layer, b, :, h], v_ref.at[layer, b, :, h])
        finish(carry)

    @pl.when(split == splits)
    def _tree():
        T_pad = kn_ref.shape[2]

        def body(_, kn_smem, vn_smem, bias_smem, carry):
            return step(carry, q_smem, kn_smem, vn_smem, lambda s: s + bias_smem[...])

        kv_spec = plgpu.BlockSpec((T_pad, D), lambda i: (0, 0))
        carry = plgpu.emit_pipeline(body, grid=(1,), in_specs=[kv_spec, kv_spec, plgpu.BlockSpec((BLOCK_Q, T_pad),
                                                                                                 lambda i: (0, 0))],
                                    init_carry=init)(kn_ref.at[b, h], vn_ref.at[b, h], bias_ref.at[b, rows])
        finish(carry)


def _combine_partials(o_PxBxKxRxD, lse_PxBxKxR):
    """Merges per-split normalised partials by their log-sum-exp weights (f32)."""
    lse_max = lse_PxBxKxR.max(axis=0)
    w = jnp.exp(lse_PxBxKxR - lse_max)
    o = jnp.where(w[..., None] > 0, o_PxBxKxRxD, 0.0)  # an empty split's 0/0 must not leak
    return (w[..., None] * o).sum(0) / w.sum(0)[..., None]


def _tree_bias(tree_mask_BxTxT, rows_pad: int, t_pad: int):
    """Additive ``[B, rows_pad, T_pad]`` bias: 0 where row ``g·T + t`` sees new key ``t'``."""
    B, T, _ = tree_mask_BxTxT.shape
    t_of_row = jnp.arange(rows_pad) % T  # padded rows copy a real row: finite, then dropped
    visible = jnp.pad(tree_mask_BxTxT.astype(bool)[:, t_of_row], ((0, 0), (0, 0), (0, t_pad - T)))
    return jnp.where(visible, 0.0, MASK).astype(jnp.float32)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "splits", "max_concurrent_steps", "interpret"))
def tree_attention_mgpu(q_BxTxNxD, k_cache, v_cache, prefix_len_B, k_new_BxTxKxD, v_new_BxTxKxD, tree_mask_BxTxT, *,
                        scale: float, layer=None, block_kv: int = BLOCK_KV, splits: int | None = None,
                        max_concurrent_steps: int = 4, interpret: bool = False):
    """Mosaic GPU tree attention (see the module docstring for blocking and layout)."""
    B, T, N, D = q_BxTxNxD.shape
    K, dtype = k_cache.shape[-2], q_BxTxNxD.dtype
    G = N // K
    if not _is_16bit(dtype) or k_cache.dtype != dtype:
        raise TypeError(f"tree_attention_mgpu: q and the cache must both be bfloat16 or float16, got q {dtype}, "
                        f"cache {k_cache.dtype} (float32 goes to tree_attention_ref)")
    if D not in HEAD_DIMS or N % K:
        raise ValueError(f"tree_attention_mgpu: head_dim {D} must be one of {HEAD_DIMS} and heads {N} a multiple "
                         f"of kv heads {K}")
    if T > MAX_NEW:
        raise ValueError(f"tree_attention_mgpu: {T} new tokens per sequence; at most {MAX_NEW} fit its shared "
                         f"memory (a prefill goes to tree_attention_ref: see supports)")
    kc, vc, layer = stacked_cache(k_cache, v_cache, layer, block_kv)
    S = kc.shape[2]
    if S % CACHE_ALIGN:
        raise ValueError(f"tree_attention_mgpu: a cache of {S} slots; Mosaic GPU needs a multiple of {CACHE_ALIGN} "
                         f"(kv_cache.capacity rounds the decode loop's; supports() sends others to the reference)")
    R = G * T
    R_pad, T_pad = _round_up(R, BLOCK_Q), _round_up(T, 64)
    row_tiles = R_pad // BLOCK_Q
    if splits is None:
        splits = _default_splits(row_tiles, K, B, S, block_kv)

    q = jnp.pad(rows_by_kv_head(q_BxTxNxD, K), ((0, 0), (0, 0), (0, R_pad - R), (0, 0)))
    new = lambda x: jnp.pad(x.astype(dtype).transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, T_pad - T), (0, 0)))
    bias = _tree_bias(tree_mask_BxTxT, R_pad, T_pad)

    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, block_kv=block_kv, splits=splits,
                          max_concurrent_steps=max_concurrent_steps, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((splits + 1, B, K, R_pad, D), jnp.float32),
                  jax.ShapeDtypeStruct((splits + 1, B, K, R_pad), jnp.float32)),
        scratch_types=(plgpu.SMEM((BLOCK_Q, D), dtype), plgpu.SMEM((BLOCK_Q, D), jnp.float32),
                       plgpu.SMEM((BLOCK_Q,), jnp.float32), plgpu.Barrier()),
        grid=(row_tiles, K, B * (splits + 1)),
        grid_names=("rows", "heads", "bs"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params() if interpret else None,
    )
    o, lse = kernel(prefix_len_B.astype(jnp.int32), layer, q, kc, vc, new(k_new_BxTxKxD), new(v_new_BxTxKxD), bias)
    out = _combine_partials(o, lse)[:, :, :R]  # [B, K, R, D]
    return rows_to_tokens(out, T).astype(dtype)


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not yet public in jax 0.10

    return InterpretGPUParams()

