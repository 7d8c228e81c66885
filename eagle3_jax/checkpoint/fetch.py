"""Weights fetched from a checkpoint source (:mod:`eagle3_jax.checkpoint.sources`): each
tensor's stored shape checked against its declaration from the file header before its data
is read, floating point and finite, PyTorch ``Linear`` weights ``[out, in]`` turned into
Flax ``[in, out]``; on a mesh, each global array assembled from per-device blocks read
straight from the files (stacked parameters one layer at a time)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.sharding import SplitError, auto_mesh


def _check_shape(source, name: str, shape, transpose: bool) -> Path:
    """The stored shape of ``name`` checked against ``shape`` (given after the ``[out, in]`` →
    ``[in, out]`` transpose), from the file header, before any data is read."""
    file = source.path_of(name)
    stored = tuple(source.shape(name))
    got = stored[::-1] if transpose else stored
    if shape is not None and got != tuple(shape):
        note = " (after [out,in]→[in,out])" if transpose else ""
        raise ValueError(f"{file}: tensor {name!r}: expected shape {tuple(shape)}{note}, got {got}")
    return file


def _check_float(arr, file: Path, name: str):
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise ValueError(f"{file}: tensor {name!r} has dtype {arr.dtype}; weights must be floating point")


def fetch_weight(source, name: str, shape, transpose: bool, dtype, sharding=None):
    """Weight ``name``: its stored shape checked against ``shape`` (given after the
    ``[out, in]`` → ``[in, out]`` transpose) before its data is read; then floating point and
    finite, cast to ``dtype``."""
    file = _check_shape(source, name, shape, transpose)
    arr = source.get(name)
    _check_float(arr, file, name)
    if transpose:
        arr = arr.T
    arr = arr.astype(dtype)
    return jax.device_put(arr, sharding) if sharding is not None else arr


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(shape, dtype, sharding):
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(buf, layer, i):
    return jax.lax.dynamic_update_index_in_dim(buf, layer, i, 0)


def _assemble(read, shape, sharding) -> jax.Array:
    """A global array from per-device blocks ``read(index) -> np.ndarray``: each distinct
    block is read once, put on the devices holding it and dropped before the next is read."""
    groups: dict[tuple, list] = {}  # distinct block → the devices holding it
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        groups.setdefault(tuple(s.indices(n)[:2] for s, n in zip(index, shape)), []).append(device)
    arrays = []
    for bounds, devices in groups.items():
        host = read(tuple(slice(a, b) for a, b in bounds))
        arrays += [jax.device_put(host, d) for d in devices]
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def fetch_sharded(source, info, dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """Parameter ``info`` (a :class:`~eagle3_jax.params.ParamInfo`) as a global array on
    ``sharding``, built from per-device blocks read straight from the checkpoint (see
    ``_assemble``).  A stacked parameter is written one layer at a time into a sharded
    buffer (donated, so updated in place).  No host or device holds more than its share
    plus one layer's block in flight.  Shapes are checked from the headers before any data
    is read."""
    names, shape = info.checkpoint_names(), info.shape
    files = [_check_shape(source, n, shape[1:] if info.stacked else shape, info.transpose) for n in names]
    np_dtype = np.dtype(dtype)

    def reader(k: int):
        def read(index) -> np.ndarray:
            arr = source.read(names[k], index[::-1] if info.transpose else index)
            _check_float(arr, files[k], names[k])
            return np.ascontiguousarray((arr.T if info.transpose else arr).astype(np_dtype, copy=False))
        return read

    if not info.stacked:
        return _assemble(reader(0), shape, sharding)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        layer_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        layer_sharding = sharding
    else:
        raise TypeError(f"sharding of {info.checkpoint!r}: a stacked parameter takes a NamedSharding or a "
                        f"SingleDeviceSharding, got {type(sharding).__name__}")
    buf = _zeros(shape, dtype, sharding)
    for i in range(shape[0]):
        buf = _put_layer(buf, _assemble(reader(i), shape[1:], layer_sharding), i)
    return buf


def fetch_param(source, info, dtype, sharding=None):
    """Parameter ``info`` (a :class:`~eagle3_jax.params.ParamInfo`): on ``sharding`` from
    per-device blocks (:func:`fetch_sharded`), else whole on the default device (a stacked
    parameter read one tensor at a time and stacked)."""
    if sharding is not None:
        return fetch_sharded(source, info, dtype, sharding)
    if info.stacked:
        return jnp.stack([fetch_weight(source, n, info.shape[1:], info.transpose, dtype) for n in info.checkpoint_names()])
    return fetch_weight(source, info.checkpoint, info.shape, info.transpose, dtype)


def replicated(value, mesh):
    """``value`` on every device of ``mesh`` (as is without a mesh)."""
    return value if mesh is None else jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def param_shardings(decl, path: Path, mesh, rules, shardings) -> tuple:
    """``(mesh, shardings)`` of a load: the mesh as its Auto twin (``sharding.auto_mesh``, for
    every array the load places on it) and the per-parameter shardings from it and ``rules``,
    or given."""
    if mesh is not None and shardings is not None:
        raise ValueError("pass mesh= (with optional rules=) or shardings=, not both")
    if rules is not None and mesh is None:
        raise ValueError("rules= needs mesh=")
    if mesh is not None:
        mesh = auto_mesh(mesh)
        try:
            return mesh, decl.shardings(mesh, rules)
        except SplitError as e:
            raise SplitError(f"{path}: {e}", e.axis) from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    shardings = dict(shardings or {})
    unknown = sorted(set(shardings) - {n for n, _ in decl.present()})
    if unknown:
        raise ValueError(f"shardings: no parameter named {', '.join(map(repr, unknown))} in {path}")
    return None, shardings


def fetch_ids(source, name: str, length: int, kinds: str) -> np.ndarray:
    """Index tensor ``name`` (``d2t`` / ``t2d``): shape ``(length,)`` checked before it is
    read, dtype kind in ``kinds`` (numpy kind letters)."""
    file = source.path_of(name)
    if tuple(source.shape(name)) != (length,):
        raise ValueError(f"{file}: tensor {name!r} has shape {tuple(source.shape(name))}, expected ({length},)")
    arr = np.asarray(source.get(name))
    if arr.dtype.kind not in kinds:
        raise ValueError(f"{file}: tensor {name!r} has dtype {arr.dtype}, expected "
                         f"{'integers' if kinds == 'iu' else 'booleans or integers'}")
    return arr
