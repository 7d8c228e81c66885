"""One logical-axis table per parameter and one rules table per mesh.

Parameters carry logical axis names (``embed``, ``heads``, ``mlp``, …); ``RULES`` maps
them onto the mesh axes ``(data, fsdp, tensor)``.  A dimension that the mesh axis does
not divide is replicated rather than rejected, so tiny test models shard on any mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "draft_vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "fused": "fsdp",
    "layers": None,
    "norm": None,
}

TARGET_AXES = {
    "embed": ("vocab", "embed"),
    "wq": ("layers", "embed", "heads"), "wk": ("layers", "embed", "kv_heads"), "wv": ("layers", "embed", "kv_heads"),
    "wo": ("layers", "heads", "embed"),
    "bq": ("layers", "heads"), "bk": ("layers", "kv_heads"), "bv": ("layers", "kv_heads"), "bo": ("layers", "norm"),
    "q_norm": ("layers", "norm"), "k_norm": ("layers", "norm"),
    "attn_norm": ("layers", "norm"), "mlp_norm": ("layers", "norm"),
    "w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"), "w_down": ("layers", "mlp", "embed"),
    "b_gate": ("layers", "mlp"), "b_up": ("layers", "mlp"), "b_down": ("layers", "norm"),
    "norm": ("norm",), "lm_head": ("embed", "vocab"),
}

DRAFTER_AXES = {
    "fc": ("fused", "embed"),
    "hidden_norm": ("norm",), "input_norm": ("norm",), "post_norm": ("norm",),
    "wq": ("fused", "heads"), "wk": ("fused", "kv_heads"), "wv": ("fused", "kv_heads"), "wo": ("heads", "embed"),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
    "norm": ("norm",), "lm_head": ("embed", "draft_vocab"),
    "embed": ("vocab", "embed"),
}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh; ``-1`` for ``data`` takes the remaining devices."""
    devices = np.asarray(devices if devices is not None else jax.devices())
    if data == -1:
        data = devices.size // (fsdp * tensor)
    if data * fsdp * tensor != devices.size:
        raise ValueError(f"mesh {data}x{fsdp}x{tensor} does not match the {devices.size} devices")
    return Mesh(devices.reshape(data, fsdp, tensor), MESH_AXES)


def spec(shape, logical, mesh: Mesh) -> P:
    """PartitionSpec for ``shape`` with logical axes, replicating non-divisible dims and
    mesh axes already used by an earlier dimension."""
    parts, used = [], set()
    for dim, name in zip(shape, logical):
        axes = RULES.get(name)
        axes = (axes,) if isinstance(axes, str) else axes
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        ok = axes and size > 1 and dim % size == 0 and not used & set(axes)
        parts.append(axes if ok else None)
        used |= set(axes) if ok else set()
    return P(*parts)


def param_shardings(shapes: dict, axes: dict, mesh: Mesh) -> dict:
    """``{name: NamedSharding}`` for a ``{name: shape}`` table (``None`` shapes skipped)."""
    return {n: NamedSharding(mesh, spec(s, axes[n], mesh)) for n, s in shapes.items() if s is not None}


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch split over (data, fsdp); other dimensions replicated."""
    return NamedSharding(mesh, P(RULES["batch"], *([None] * (ndim - 1))))
