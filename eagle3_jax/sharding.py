"""Logical → physical sharding: one rules table for every array.

Parameters carry logical axis names (``embed``, ``heads``, ``mlp``, …) in their declarations
(:mod:`eagle3_jax.params`); ``RULES`` maps each logical axis onto mesh axes of the
``(data, fsdp, tensor)`` mesh.  A dimension that its mesh axes do not divide raises a
``ValueError`` naming the array, the axis and the mesh, unless its rule says
``fewer="replicate"`` and the dimension has fewer units (heads) than those axes have devices:
then it is replicated, explicitly (e.g. 8 KV heads on ``tensor=16``).  A mesh axis already
used by an earlier dimension of the same array is not used again; mesh axes a mesh does not
have are ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class Rule:
    """Where a logical axis goes: the mesh axes it is split over (none: replicated), and
    ``fewer``: what happens when the dimension has fewer units than those axes have devices
    (``"raise"``, or ``"replicate"`` it)."""

    mesh_axes: tuple[str, ...] = ()
    fewer: str = "raise"

    def __post_init__(self):
        if self.fewer not in ("raise", "replicate"):
            raise ValueError(f"Rule.fewer={self.fewer!r}: expected 'raise' or 'replicate'")


class SplitError(ValueError):
    """A dimension that its rule splits over mesh axes whose device count does not divide it;
    ``axis`` is its logical axis (a rule of ``None`` for it replicates it)."""

    def __init__(self, message: str, axis: str):
        super().__init__(message)
        self.axis = axis


RULES: dict[str, Rule] = {
    "batch": Rule(("data", "fsdp")),
    "vocab": Rule(("tensor",)),
    "draft_vocab": Rule(("tensor",)),
    "embed": Rule(("fsdp",)),
    "fused": Rule(("fsdp",)),  # the drafter's 3·H feature input and 2·H attention input
    "heads": Rule(("tensor",), fewer="replicate"),  # e.g. 2 query heads on tensor=4
    "kv_heads": Rule(("tensor",), fewer="replicate"),  # grouped-query attention: fewer KV heads than tensor
    "mlp": Rule(("tensor",)),
    "layers": Rule(),
    "captured": Rule(),  # a drafter's per-captured-layer feature norms
    "norm": Rule(),
    "seq": Rule(),
    "head_dim": Rule(),
}


def _rule(value, axis: str) -> Rule:
    if isinstance(value, Rule):
        return value
    if value is None:
        return Rule()
    if isinstance(value, str):
        return Rule((value,))
    if isinstance(value, tuple) and all(isinstance(a, str) for a in value):
        return Rule(value)
    raise TypeError(f"rules[{axis!r}]={value!r}: expected a Rule, a mesh axis name, a tuple of them or None")


def resolve_rules(rules: Mapping | None = None) -> dict[str, Rule]:
    """``RULES`` with the entries of ``rules`` over it (each a ``Rule``, a mesh axis name, a
    tuple of names, or ``None`` for replicated)."""
    return {**RULES, **{k: _rule(v, k) for k, v in (rules or {}).items()}}


def batch_shards(mesh, rules: Mapping | None = None) -> int:
    """How many devices of ``mesh`` (a ``Mesh`` or an ``AbstractMesh``) the ``batch`` rule
    splits a batch over (1 without a mesh)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in resolve_rules(rules)["batch"].mesh_axes if a in mesh.shape)


def hidden_sharding(mesh, batch: int, width: int, rules: Mapping | None = None, *,
                    name: str = "hidden states") -> NamedSharding | None:
    """The layout of a decode forward's hidden states ``[B, T, X]`` (``X`` a multiple of
    ``width``) on ``mesh``: the hidden dimension split as the weights split theirs (the
    ``embed`` rule: over fsdp), the rows over the batch's other mesh axes (data).  Each device
    then multiplies its own slice of every weight and only a few rows of activations move.
    With the rows split over fsdp as well (the caches' layout), XLA's partitioner gathers a
    drafter's whole weights on every device at every draft step instead: on a v6e:2x4
    (data=2 x fsdp=4) a chain-4 round of Llama-3.1-8B with 3 layers read 11.5 GB a device,
    4.5 GB so constrained.  ``None`` where the weights' hidden dimension is not split (no
    fsdp): nothing to keep local."""
    s = spec((width, 1, batch), ("embed", "seq", "batch"), mesh, rules, name=name)  # the hidden dimension first
    if s[0] is None:
        return None
    return NamedSharding(mesh, P(s[2], None, s[0]))


def spec(shape, axes, mesh, rules: Mapping | None = None, *, units: Mapping[str, int] | None = None,
         name: str = "array") -> P:
    """The ``PartitionSpec`` of array ``name`` of ``shape`` with logical ``axes`` on ``mesh``
    (a ``Mesh`` or ``AbstractMesh``) by ``rules`` (entries over ``RULES``).  ``units[axis]``
    is how many elements make one unsplittable unit along ``axis`` (a head's ``head_dim``;
    default 1).  Raises ``ValueError`` naming ``name``, the axis and the mesh where a
    dimension cannot be split and its rule does not say to replicate it."""
    table = resolve_rules(rules)
    units = units or {}
    if len(shape) != len(axes):
        raise ValueError(f"{name}: {len(axes)} logical axes {tuple(axes)} for shape {tuple(shape)}")
    parts, used = [], set()
    for dim, (dim_size, axis) in enumerate(zip(shape, axes)):
        if axis is None:
            parts.append(None)
            continue
        if axis not in table:
            raise ValueError(f"{name}: no sharding rule for logical axis {axis!r} (dimension {dim}); known: {sorted(table)}")
        rule = table[axis]
        mesh_axes = tuple(a for a in rule.mesh_axes if a in mesh.shape and a not in used)
        devices = math.prod(mesh.shape[a] for a in mesh_axes)
        if devices == 1:
            parts.append(None)
            continue
        unit = units.get(axis, 1)
        n = dim_size // unit
        if n % devices == 0:
            parts.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
            used |= set(mesh_axes)
        elif rule.fewer == "replicate" and n < devices:
            parts.append(None)
        else:
            what = f"{dim_size}" + (f" = {n} units of {unit}" if unit != 1 else "")
            raise SplitError(
                f"{name}: dimension {dim} (logical axis {axis!r}, size {what}) cannot be split over mesh axes "
                f"{'×'.join(mesh_axes)} ({devices} devices) of mesh {_show_mesh(mesh)}; choose another mesh or give "
                f"rules={{{axis!r}: ...}} (e.g. None to replicate it)", axis)
    return P(*parts)


def _show_mesh(mesh) -> str:
    return "(" + ", ".join(f"{a}={s}" for a, s in mesh.shape.items()) + ")"


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh; ``-1`` for ``data`` takes the remaining devices."""
    devices = np.asarray(devices if devices is not None else jax.devices())
    if data == -1:
        data = devices.size // (fsdp * tensor)
    if data * fsdp * tensor != devices.size:
        raise ValueError(f"mesh {data}x{fsdp}x{tensor} does not match the {devices.size} devices")
    return Mesh(devices.reshape(data, fsdp, tensor), MESH_AXES)


def auto_mesh(mesh, what: str = "mesh") -> Mesh:
    """``mesh`` with every axis ``Auto`` (the same devices and axis names).

    This package places arrays by their declared logical axes and constrains the ones it
    makes inside a program (``with_sharding_constraint``), which JAX allows on ``Auto`` axes
    only, while ``jax.make_mesh`` makes ``Explicit`` axes by default: every function that
    takes a ``mesh=`` passes it through here.  Raises ``TypeError`` naming ``what`` for
    anything but a ``jax.sharding.Mesh``."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{what}: expected a jax.sharding.Mesh (e.g. eagle3_jax.sharding.make_mesh or "
                        f"jax.make_mesh), got {type(mesh).__name__}")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def abstract_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1) -> jax.sharding.AbstractMesh:
    """A ``(data, fsdp, tensor)`` mesh of that many devices without any devices (for plans)."""
    for axis, size in (("data", data), ("fsdp", fsdp), ("tensor", tensor)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {axis}={size!r}: expected a positive integer")
    return jax.sharding.AbstractMesh((data, fsdp, tensor), MESH_AXES)


def parse_rules(text: str) -> dict[str, Rule | None]:
    """``"vocab=none,mlp=fsdp+tensor"`` → ``{"vocab": None, "mlp": Rule(("fsdp", "tensor"))}``:
    ``rules`` overrides of :data:`RULES` as a command line gives them (``none``: replicated;
    an axis keeps its default rule's ``fewer``, e.g. query heads fewer than the tensor
    devices replicated)."""
    out = {}
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*([\w+]+)", item)
        if not m:
            raise ValueError(f"rules {text!r}: expected axis=mesh_axes items separated by commas, e.g. vocab=none "
                             "or mlp=fsdp+tensor")
        axis, value = m.group(1), m.group(2)
        if axis not in RULES:
            raise ValueError(f"rules {text!r}: unknown logical axis {axis!r}; expected some of {', '.join(RULES)}")
        if axis in out:
            raise ValueError(f"rules {text!r}: axis {axis!r} given twice")
        mesh_axes = () if value.lower() == "none" else tuple(value.split("+"))
        bad = [a for a in mesh_axes if a not in MESH_AXES]
        if bad or len(set(mesh_axes)) != len(mesh_axes):
            raise ValueError(f"rules {text!r}: {axis}={value}: expected none or mesh axes joined by + "
                             f"(some of {', '.join(MESH_AXES)}, each once)")
        # the axis keeps what its default rule does with fewer units than devices
        out[axis] = Rule(mesh_axes, RULES[axis].fewer) if mesh_axes else None
    if not out:
        raise ValueError(f"rules {text!r}: expected axis=mesh_axes items, e.g. vocab=none")
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,tensor=4"`` → ``{"data": 2, "fsdp": 1, "tensor": 4}`` (axes not named are 1;
    ``data=-1`` takes the remaining devices when the mesh is built)."""
    out = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", item)
        if not m:
            raise ValueError(f"mesh {text!r}: expected axis=size items separated by commas, e.g. data=2,tensor=4")
        axis, size = m.group(1), int(m.group(2))
        if axis not in MESH_AXES:
            raise ValueError(f"mesh {text!r}: unknown axis {axis!r}; expected some of {', '.join(MESH_AXES)}")
        if axis in seen:
            raise ValueError(f"mesh {text!r}: axis {axis!r} given twice")
        if size < 1 and not (axis == "data" and size == -1):
            raise ValueError(f"mesh {text!r}: {axis}={size} must be >= 1" + (" (or -1)" if axis == "data" else ""))
        out[axis] = size
        seen.add(axis)
    if not seen:
        raise ValueError(f"mesh {text!r}: expected axis=size items, e.g. data=2,tensor=4")
    return out


def place(state, decl, mesh: Mesh, rules: Mapping | None = None):
    """A model's ``nnx`` state with every parameter of ``decl`` (its declaration) placed on
    ``mesh`` by the rules, every other array (buffers such as RoPE frequencies) replicated;
    arrays already placed so are kept as they are.  An abstract state (``ShapeDtypeStruct``
    leaves, from ``nnx.eval_shape``) gets ``ShapeDtypeStruct`` s carrying the shardings."""
    by_name = decl.shardings(mesh, rules)
    replicated = NamedSharding(mesh, P())

    def put(path, x):
        want = by_name.get(path[0].key, replicated)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=want)
        return x if getattr(x, "sharding", None) == want else jax.device_put(x, want)

    return jax.tree_util.tree_map_with_path(put, state)


def place_model(model, mesh: Mesh, rules: Mapping | None = None):
    """A target or drafter (an ``nnx`` module with a ``declaration()``) with its state
    :func:`place`-d on ``mesh`` by its declaration: a new module of the same graph (the given
    one is left where it is)."""
    from flax import nnx

    if not callable(getattr(model, "declaration", None)):
        raise TypeError(f"place_model: expected a Target or a Drafter, got {type(model).__name__}")
    decl = model.declaration()
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, place(state, decl, mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch split over (data, fsdp); other dimensions replicated."""
    return NamedSharding(mesh, P(RULES["batch"].mesh_axes, *([None] * (ndim - 1))))
