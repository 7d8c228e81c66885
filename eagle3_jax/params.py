"""Parameter declarations: each model parameter is declared once, as a :class:`ParamInfo`
(shape, logical axes, checkpoint name, initialiser, dtype), in its model's ``declare(cfg)``
(:func:`eagle3_jax.models.target.declare`, :func:`eagle3_jax.models.drafter.declare`).

Everything else derives from that one table: the models' ``__init__`` (initialisers, in
declaration order), ``eval_shape`` (:meth:`Declaration.abstract`), sharding
(:meth:`Declaration.shardings` through the logical→mesh rules of :mod:`eagle3_jax.sharding`),
loading and saving (:mod:`eagle3_jax.checkpoint`: checkpoint names, PyTorch ``[out, in]``
transposes, per-layer tensors stacked on the ``layers`` axis) and the memory plan
(:mod:`eagle3_jax.plan`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from eagle3_jax import sharding

# Initialisers: ``init(next_key, shape, dtype)``; ``next_key()`` draws a fresh PRNG key and
# is only called by those that need one (so keyless parameters do not shift the stream).


def normal(stddev: float) -> Callable:
    """Normal(0, stddev), drawn in float32 then cast."""
    return lambda next_key, shape, dtype: (stddev * jax.random.normal(next_key(), shape)).astype(dtype)


def fan_in_normal(next_key, shape, dtype):
    """Normal(0, 1/fan_in) with ``fan_in = shape[-2]`` (Flax layout ``[in, out]``, stacked
    layers first)."""
    return (jax.random.normal(next_key(), shape) / jnp.sqrt(shape[-2])).astype(dtype)


def ones(next_key, shape, dtype):
    return jnp.ones(shape, dtype)


def zeros(next_key, shape, dtype):
    return jnp.zeros(shape, dtype)


# Logical axes along which a parameter is stored as one tensor per entry: decoder layers, and
# the captured target layers of a drafter's per-feature norms.
STACKED_AXES = ("layers", "captured")


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter, declared once.

    Attributes:
      shape: Flax-layout shape (stacked decoder layers first).
      axes: one logical axis name per dimension (``"layers"``, ``"embed"``, ``"heads"``, …;
        see ``eagle3_jax.sharding.RULES``).
      checkpoint: its Hugging Face / official state-dict name; for a parameter stacked over
        decoder layers (first axis ``"layers"``) a template with ``{layer}``.
      init: initialiser ``(next_key, shape, dtype) -> array``; ``None`` for an array the
        caller supplies (the drafter's shared embedding).
      transpose: stored as PyTorch ``Linear`` ``[out, in]`` (Flax holds ``[in, out]``).
      dtype: its dtype; ``None`` for the model's.
      frozen: never trained (a ``Frozen`` variable rather than an ``nnx.Param``).
      first: the checkpoint's index of the first stacked entry (a drafter's layers after
        its first are ``layers.1``, ``layers.2``, …).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    checkpoint: str
    init: Callable | None
    transpose: bool = False
    dtype: Any = None
    frozen: bool = False
    first: int = 0

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"{self.checkpoint}: {len(self.axes)} logical axes for shape {self.shape}")
        if self.stacked != ("{layer}" in self.checkpoint):
            raise ValueError(f"{self.checkpoint}: a name template with {{layer}} iff the first axis is one of "
                             f"{STACKED_AXES}")

    @property
    def stacked(self) -> bool:
        """Stored per decoder layer (or per captured layer) in the checkpoint, stacked on the
        first axis here."""
        return bool(self.axes) and self.axes[0] in STACKED_AXES

    def checkpoint_names(self) -> list[str]:
        """The checkpoint tensors this parameter is read from / written to (one per layer if stacked)."""
        if self.stacked:
            return [self.checkpoint.format(layer=self.first + i) for i in range(self.shape[0])]
        return [self.checkpoint]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A model's parameters: ``params`` maps each name to its :class:`ParamInfo`, or to
    ``None`` where this configuration does not have it (e.g. biases of a Llama); ``units``
    maps a logical axis to the number of elements of one unsplittable unit along it (a head:
    ``{"heads": head_dim, "kv_heads": head_dim}``), so sharding never cuts a head in two."""

    params: Mapping[str, ParamInfo | None]
    units: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def present(self) -> Iterator[tuple[str, ParamInfo]]:
        """``(name, info)`` of the parameters this configuration has, in declaration order."""
        return ((n, p) for n, p in self.params.items() if p is not None)

    def shapes(self) -> dict[str, tuple[int, ...] | None]:
        """``{name: shape}`` (``None`` for parameters this configuration does not have)."""
        return {n: None if p is None else p.shape for n, p in self.params.items()}

    def dtype_of(self, name: str, dtype):
        """The dtype of parameter ``name`` in a model of ``dtype``."""
        p = self.params[name]
        return dtype if p.dtype is None else p.dtype

    def count(self, *, frozen: bool = True) -> int:
        """Number of parameter elements (``frozen=False``: trainable ones only)."""
        return sum(p.size for _, p in self.present() if frozen or not p.frozen)

    def shardings(self, mesh, rules=None) -> dict[str, jax.sharding.NamedSharding]:
        """``{name: NamedSharding}`` on ``mesh`` (a ``Mesh`` or ``AbstractMesh``) by ``rules``
        (entries override ``eagle3_jax.sharding.RULES``); a dimension that cannot be split
        raises ``ValueError`` naming the parameter, the axis and the mesh."""
        return {n: jax.sharding.NamedSharding(mesh, sharding.spec(p.shape, p.axes, mesh, rules, units=self.units, name=n))
                for n, p in self.present()}

    def abstract(self, dtype, mesh=None, rules=None) -> dict[str, jax.ShapeDtypeStruct]:
        """``{name: ShapeDtypeStruct}`` (sharded when ``mesh`` is given): the parameters
        without allocating them."""
        shardings = self.shardings(mesh, rules) if mesh is not None else {}
        return {n: jax.ShapeDtypeStruct(p.shape, self.dtype_of(n, dtype), sharding=shardings.get(n))
                for n, p in self.present()}

    def initial_values(self, dtype, next_key, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every declared parameter's initial value in declaration order (``None`` where absent);
        ``given`` supplies those declared without an initialiser."""
        given = given or {}
        out = {}
        for n, p in self.params.items():
            if p is None:
                out[n] = None
            elif p.init is None:
                if n not in given:
                    raise ValueError(f"parameter {n!r} has no initialiser; it must be given")
                out[n] = jnp.asarray(given[n], self.dtype_of(n, dtype))
            else:
                out[n] = p.init(next_key, p.shape, self.dtype_of(n, dtype))
        return out
