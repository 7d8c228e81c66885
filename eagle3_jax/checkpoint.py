"""Checkpoint I/O: Hugging Face safetensors targets, official / SpecForge / vLLM
EAGLE-3 drafters (``pytorch_model.bin`` read without torch, or safetensors), and
drafter export in the official format.

Names, shapes and layouts come from the models' parameter declarations (``declare(cfg)``).
Tensors are read one at a time straight onto the device; with a mesh (or shardings) each
parameter is assembled from per-device blocks read from the files.  PyTorch ``Linear``
weights ``[out, in]`` become Flax ``[in, out]``.
"""

from __future__ import annotations

import collections
import errno
import functools
import io
import json
import math
import os
import pickle
import re
import reprlib
import secrets
import shutil
import struct
import sys
import zipfile
from pathlib import Path, PureWindowsPath

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json
from eagle3_jax.sharding import SplitError, auto_mesh

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype, default: str = "float32"):
    """``dtype`` (a name in ``DTYPES``, one of their jnp/numpy types, or ``None`` for
    ``default``) as a jnp scalar type; anything else is an error naming ``dtype``."""
    name = dtype if isinstance(dtype, str) else None
    if dtype is None:
        name = default
    if name is not None:
        if name not in DTYPES:
            raise ValueError(f"dtype={name!r}: expected one of {sorted(DTYPES)}")
        return DTYPES[name]
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)} or their jnp types") from None
    if resolved.name not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    return resolved.type


# --------------------------------------------------------------------------- sources
# Bounds on what reading an (untrusted) checkpoint may cost.
MAX_PICKLE_BYTES = 16 << 20  # data.pkl of a torch zip checkpoint
MAX_INDEX_BYTES = 16 << 20  # model.safetensors.index.json
MAX_INFLATION = 64  # zip entries read from one archive inflate to at most 64x its size ...
INFLATION_SLACK = 1 << 20  # ... plus 1 MiB (torch.save stores entries uncompressed)


def _check_finite(arr, file: Path, name: str):
    xp = np if isinstance(arr, np.ndarray) else jnp  # a numpy block is checked on the host
    if jnp.issubdtype(arr.dtype, jnp.inexact) and not bool(xp.isfinite(arr).all()):
        raise ValueError(f"{file}: tensor {name!r} holds NaN or infinite values")


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index, each file checked to lie inside the index's
    directory (relative, no ``..``, symlinks resolving inside it or into the ``blobs/``
    folder of a Hugging Face cache snapshot)."""
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise ValueError(f"{index}: {index.stat().st_size} bytes, more than a safetensors index may hold "
                         f"({MAX_INDEX_BYTES})")
    try:
        raw = json.loads(index.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{index}: malformed safetensors index ({type(e).__name__}: {str(e)[:200]})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ValueError(f"{index}: malformed safetensors index: 'weight_map' must be an object "
                         f"mapping tensor names to file names")
    root = index.parent.resolve()
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    for file in set(weight_map.values()):
        parts = file.replace("\\", "/").split("/")
        inside = bool(file) and "\0" not in file and not file.startswith(("/", "\\")) \
            and not PureWindowsPath(file).drive and ".." not in parts
        if inside:
            try:
                real = (index.parent / file).resolve()
            except (OSError, RuntimeError):  # a symlink loop
                inside = False
            else:
                inside = real.is_relative_to(root) or (blobs is not None and real.is_relative_to(blobs))
        if not inside:
            tensor = next(k for k, v in weight_map.items() if v == file)
            raise ValueError(f"{index}: weight_map puts tensor {tensor!r} in {file!r}, which is not a file "
                             f"inside the checkpoint directory")
    return weight_map


class SafetensorsSource:
    """Tensor-by-tensor reader over ``model.safetensors`` or an indexed shard set.

    The index may only name files inside ``directory`` (see ``_read_index``); a tensor's
    shape is read from its file header before its data, and data holding NaN or infinity is
    refused.  Errors name the file and the tensor (``KeyError`` for a missing tensor,
    ``FileNotFoundError`` for a missing shard, ``ValueError`` for the rest).
    """

    def __init__(self, directory: Path, prefix: str = "model"):
        self.directory = directory = Path(directory)
        self._handles = {}
        index = directory / f"{prefix}.safetensors.index.json"
        single = directory / f"{prefix}.safetensors"
        if index.exists():
            self.weight_map = _read_index(index)
        elif single.exists():
            self.weight_map = {name: single.name for name in self._open(single).keys()}
        else:
            raise FileNotFoundError(f"{directory}: no {single.name} or {index.name}")

    def _open(self, file: Path):
        if file not in self._handles:
            if not file.exists():
                raise FileNotFoundError(f"{file}: shard listed in the index is missing")
            try:
                self._handles[file] = safe_open(str(file), framework="flax")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file}: corrupt or unreadable safetensors file ({e})") from None
        return self._handles[file]

    def names(self):
        return self.weight_map.keys()

    def path_of(self, name: str) -> Path:
        """The file holding tensor ``name`` (``KeyError`` if the checkpoint lacks it)."""
        if name not in self.weight_map:
            raise KeyError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        return self.directory / self.weight_map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        file = self.path_of(name)
        try:
            return tuple(self._open(file).get_slice(name).get_shape())
        except SafetensorError as e:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from None

    def get(self, name: str) -> jax.Array:
        file = self.path_of(name)
        try:
            arr = self._open(file).get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from None
        _check_finite(arr, file, name)
        return arr

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Block ``index`` of tensor ``name`` (stored layout) as a numpy array, read alone
        through ``get_slice``: the file is mapped only while the block is read.  NaN or
        infinity in the block is refused."""
        file = self.path_of(name)
        self._open(file)  # a missing or corrupt shard fails here, as in get()
        try:
            with safe_open(str(file), framework="numpy") as f:
                arr = f.get_slice(name)[index]
        except SafetensorError as e:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from None
        _check_finite(arr, file, name)
        return arr


class _PickleError(ValueError):
    """A malformed or out-of-bounds torch checkpoint (raised with the file named)."""


class _RefusedPickle(pickle.UnpicklingError, _PickleError):
    """A pickle asking for a global or storage the checkpoint reader never builds."""


class _Storage:
    """A storage the pickle references (zip entry ``data/<key>``); read when a tensor needs it."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """A tensor the pickle describes; checked against its storage before it is viewed."""

    __slots__ = ("storage", "offset", "size", "stride")

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild_tensor(storage, offset, size, stride, *_):
    return _TensorRef(storage, offset, size, stride)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler (its memo is a dict: a hostile memo index cannot make it
    allocate), restricted to what a torch state dict uses: tensor and parameter rebuilds,
    ordered dicts and typed storages.  Tensors come out as unchecked ``_TensorRef``."""

    _STORAGE_DTYPES = {
        "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
        "BFloat16Storage": jnp.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
        "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    }
    _GLOBALS = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): lambda tensor, *_: tensor,
        ("torch._utils", "_rebuild_parameter_with_state"): lambda tensor, *_: tensor,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, file: Path):
        super().__init__(io.BytesIO(data))
        self.file = file

    def find_class(self, module, name):
        if (module, name) in self._GLOBALS:
            return self._GLOBALS[module, name]
        if module == "torch" and name in self._STORAGE_DTYPES:
            return name
        raise _RefusedPickle(f"{self.file}: refusing to load global {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _PickleError(f"{self.file}: malformed storage reference {reprlib.repr(pid)}")
        _, storage_type, key, _location, numel = pid
        if not (isinstance(storage_type, str) and storage_type in self._STORAGE_DTYPES):
            raise _RefusedPickle(f"{self.file}: unsupported storage {reprlib.repr(storage_type)}")
        if not isinstance(key, str) or not _is_int(numel) or numel < 0:
            raise _PickleError(f"{self.file}: malformed storage reference {reprlib.repr(pid)}")
        return _Storage(key, self._STORAGE_DTYPES[storage_type], numel)

    def _load_build(self):  # BUILD only sets the attributes (``_metadata``) of an OrderedDict
        if len(self.stack) < 2 or type(self.stack[-2]) is not collections.OrderedDict \
                or type(self.stack[-1]) is not dict:
            raise _RefusedPickle(f"{self.file}: refusing to set the state of a "
                                 f"{type(self.stack[-2]).__name__ if len(self.stack) > 1 else 'missing object'}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    """A zip entry's name as the bytes the archive holds, which is what torch's reader matches
    (``zipfile`` decodes a name without the UTF-8 flag as cp437, and cuts ``filename`` at a NUL)."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


class _TorchZip:
    """One pass over a torch zip checkpoint: its pickle, then the storages its tensors use.
    Entries are found by their names' bytes (a storage key is the UTF-8 of the pickle's string)."""

    def __init__(self, file: Path, zf: zipfile.ZipFile):
        self.file, self.zf, self.storages = file, zf, {}
        self.entries = {_raw_name(info): info for info in zf.infolist()}  # the last of a repeated name, as zipfile
        pkl = next((info for raw, info in self.entries.items() if raw == b"data.pkl" or raw.endswith(b"/data.pkl")),
                   None)
        if pkl is None:
            raise _PickleError(f"{file}: not a torch zip checkpoint (no data.pkl)")
        self.root = _raw_name(pkl)[: -len(b"data.pkl")]
        self.budget = MAX_INFLATION * file.stat().st_size + INFLATION_SLACK
        native = sys.byteorder.encode()
        order_entry = self.entries.get(self.root + b"byteorder")
        order = native if order_entry is None else self.read(order_entry, "byte order", limit=16)
        if order != native:
            raise _PickleError(f"{file}: byte order {order!r}: only {sys.byteorder}-endian checkpoints are supported")
        data = self.read(pkl, "the pickle", limit=MAX_PICKLE_BYTES)
        try:
            self.obj = _Unpickler(data, file).load()
        except _PickleError:
            raise
        except Exception as e:  # the pickle is untrusted: any failure inside it is a malformed file
            detail = (f"unknown opcode {e}" if type(e) is KeyError
                      else "truncated" if isinstance(e, (EOFError, struct.error))
                      else f"{type(e).__name__}: {str(e)[:200]}")
            raise _PickleError(f"{file}: malformed data.pkl ({detail})") from None

    def read(self, info: zipfile.ZipInfo, what: str, *, size: int | None = None, limit: int | None = None) -> bytes:
        """Entry ``info``, its declared size checked before it is inflated and its reading bounded."""
        where = f"{self.file}: {what} (zip entry {info.orig_filename!r})"
        if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise _PickleError(f"{where} is encrypted or uses compression method {info.compress_type}")
        if size is not None and info.file_size != size:
            raise _PickleError(f"{where} holds {info.file_size} bytes, the pickle declares {size}")
        if limit is not None and info.file_size > limit:
            raise _PickleError(f"{where} holds {info.file_size} bytes, more than the {limit} allowed")
        self.budget -= info.file_size
        if self.budget < 0:
            raise _PickleError(f"{where}: the entries read inflate to more than {MAX_INFLATION}x the "
                               f"archive's size (a zip bomb?)")
        try:
            with self.zf.open(info) as f:
                data = f.read(info.file_size + 1)  # zipfile stops at the header's size (bad CRC if it lies)
        except Exception as e:  # BadZipFile, zlib.error, EOFError, ...: a corrupt entry
            raise _PickleError(f"{where} is corrupt ({type(e).__name__}: {str(e)[:200]})") from None
        if len(data) != info.file_size:
            raise _PickleError(f"{where} is corrupt: {len(data)} bytes read, the header says {info.file_size}")
        return data

    def storage(self, tensor: str, st: _Storage) -> np.ndarray:
        if st.key in self.storages:
            dtype, numel, data = self.storages[st.key]
            if (dtype, numel) != (st.dtype, st.numel):
                raise _PickleError(f"{self.file}: tensor {tensor!r}: storage {st.key!r} is declared twice "
                                   f"with different types or sizes")
            return data
        name = self.root + b"data/" + st.key.encode("utf-8", "surrogatepass")
        if name not in self.entries:
            raise _PickleError(f"{self.file}: tensor {tensor!r}: storage {st.key!r} (zip entry "
                               f"{name.decode('utf-8', 'replace')!r}) is missing")
        itemsize = np.dtype(st.dtype).itemsize
        blob = self.read(self.entries[name], f"tensor {tensor!r}: storage {st.key!r}", size=st.numel * itemsize)
        data = np.frombuffer(blob, np.uint8) != 0 if st.dtype is np.bool_ else np.frombuffer(blob, st.dtype)
        self.storages[st.key] = (st.dtype, st.numel, data)
        return data

    def tensor(self, name: str, ref) -> np.ndarray:
        """The tensor ``ref`` describes, its size/stride/offset checked against its storage."""
        where = f"{self.file}: tensor {name!r}"
        if not isinstance(ref, _TensorRef):
            raise _PickleError(f"{where} is not a tensor (got {type(ref).__name__})")
        st, size, stride, offset = ref.storage, ref.size, ref.stride, ref.offset
        if not isinstance(st, _Storage):
            raise _PickleError(f"{where} is built on a {type(st).__name__}, not a storage")
        if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride) <= 32
                and all(map(_is_int, (*size, *stride, offset)))):
            raise _PickleError(f"{where}: malformed size/stride/offset {reprlib.repr((size, stride, offset))}")
        if min((*size, *stride, offset)) < 0:
            raise _PickleError(f"{where}: negative size, stride or offset {(size, stride, offset)}")
        count = math.prod(size)
        if count == 0:
            if math.prod(n for n in size if n) >= 1 << 31:
                raise _PickleError(f"{where}: absurd size {size}")
            return np.zeros(size, self.storage(name, st).dtype)
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if count > st.numel or last >= st.numel:  # checked against the declared size, before reading
            raise _PickleError(f"{where}: size {size}, stride {stride} and offset {offset} reach "
                               f"{count} elements up to index {last}, outside storage {st.key!r} of "
                               f"{st.numel} {np.dtype(st.dtype).name} elements")
        data = self.storage(name, st)  # its size is checked to be the declared one
        strides = tuple(s * data.itemsize if n > 1 else 0 for n, s in zip(size, stride))
        return np.lib.stride_tricks.as_strided(data[offset:], shape=size, strides=strides).copy()

    def state_dict(self) -> dict[str, np.ndarray]:
        if not isinstance(self.obj, dict):
            raise _PickleError(f"{self.file}: expected a state dict, got {type(self.obj).__name__}")
        out = {}
        for name, ref in self.obj.items():
            if not isinstance(name, str):
                raise _PickleError(f"{self.file}: state-dict key {reprlib.repr(name)} is not a string")
            out[name] = self.tensor(name, ref)
        return out


class TorchPickleSource:
    """Reads a ``torch.save`` zip checkpoint (``pytorch_model.bin``) *without torch*.

    The file is untrusted input.  Its ``data.pkl`` (at most ``MAX_PICKLE_BYTES``) runs in the
    pure-Python unpickler restricted to tensors, parameters and ordered dicts: any other
    global is refused, so a malicious file cannot run code.  Only the zip entries the
    pickle's tensors reference are read, each once, after checking that its size is the one
    the pickle declares and that everything read stays within ``MAX_INFLATION`` times the
    archive's size (plus ``INFLATION_SLACK``); a read never goes past the size the zip header
    states, so a zip bomb is refused before it is inflated.  Every tensor's size, stride and
    offset are checked against its storage before it is viewed: no negative values, no
    element past the storage's end, no more elements than the storage holds.

    Every problem is a ``ValueError`` naming the file (and the tensor or zip entry); a
    refused global or storage type is also a ``pickle.UnpicklingError``.
    """

    def __init__(self, file: Path):
        self.file = file = Path(file)
        try:
            zf = zipfile.ZipFile(file)
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except Exception as e:  # BadZipFile, or the other ways zipfile reports a corrupt directory
            raise ValueError(f"{file}: corrupt or legacy (non-zip) torch checkpoint "
                             f"({type(e).__name__}: {str(e)[:200]})") from None
        with zf:
            self.tensors = _TorchZip(file, zf).state_dict()

    def names(self):
        return self.tensors.keys()

    def path_of(self, name: str) -> Path:
        """The file holding tensor ``name`` (``KeyError`` if the checkpoint lacks it)."""
        if name not in self.tensors:
            raise KeyError(f"{self.file}: tensor {name!r} is missing from the checkpoint")
        return self.file

    def shape(self, name: str) -> tuple[int, ...]:
        self.path_of(name)
        return tuple(self.tensors[name].shape)

    def get(self, name: str) -> jax.Array:
        self.path_of(name)
        arr = jnp.asarray(self.tensors[name])
        _check_finite(arr, self.file, name)
        return arr

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Block ``index`` of tensor ``name`` as a numpy array (NaN / infinity refused)."""
        self.path_of(name)
        arr = self.tensors[name][index]
        _check_finite(arr, self.file, name)
        return arr


def open_weights(directory: Path):
    """The weight source of a checkpoint directory (safetensors first, then pytorch_model.bin)."""
    if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        return SafetensorsSource(directory)
    if (directory / "pytorch_model.bin").exists():
        return TorchPickleSource(directory / "pytorch_model.bin")
    raise FileNotFoundError(f"{directory}: no model.safetensors(.index.json) or pytorch_model.bin")


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


def _fetch(source, name: str, shape, transpose: bool, dtype, sharding=None):
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


def _fetch_sharded(source, info, dtype, sharding: jax.sharding.Sharding) -> jax.Array:
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


def _replicated(value, mesh):
    """``value`` on every device of ``mesh`` (as is without a mesh)."""
    return value if mesh is None else jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _param_shardings(decl, path: Path, mesh, rules, shardings) -> tuple:
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


def _fetch_ids(source, name: str, length: int, kinds: str) -> np.ndarray:
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


# --------------------------------------------------------------------------- target
def load_target(path, *, dtype=None, capture_layers=None, attention_impl: str = "xla",
                shardings: dict[str, jax.sharding.Sharding] | None = None, mesh=None, rules=None):
    """Loads a Hugging Face Llama / Mistral / Qwen2 / Qwen3 checkpoint directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``).
      dtype: ``"float32"`` / ``"bfloat16"`` / a jnp dtype; default: the checkpoint's.
      capture_layers: three decoder-layer ids whose *inputs* form the EAGLE-3
        features; default ``(2, L//2, L-3)``.
      attention_impl: ``"xla"``, ``"pallas"`` (the tree-attention kernel on a TPU, or on a
        Hopper GPU for bfloat16/float16; the XLA reference elsewhere), or
        ``"pallas_interpret"`` / ``"pallas_interpret_gpu"`` (the TPU / GPU kernel in its
        CPU interpreter).
      shardings: optional ``{parameter: Sharding}``; those parameters are built from
        per-device blocks as with ``mesh``.
      mesh: a ``jax.sharding.Mesh``: every parameter is sharded by its declared logical axes
        (:func:`eagle3_jax.models.target.declare`) and ``rules`` (entries over
        ``eagle3_jax.sharding.RULES``), each global array assembled from per-device blocks
        read straight from the safetensors files (stacked layers one layer at a time), so no
        host or device holds more than its share plus one block in flight.  A dimension the
        mesh cannot split raises before anything is read.  Without a mesh (and without
        ``shardings``) every tensor goes to the default device.
      rules: logical-axis rules overriding ``eagle3_jax.sharding.RULES`` (with ``mesh``).

    Returns:
      A :class:`~eagle3_jax.models.target.Target`.
    """
    from eagle3_jax.models.target import Target, declare

    from eagle3_jax.layers import ATTENTION_IMPLS

    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={attention_impl!r}: expected one of {ATTENTION_IMPLS}")
    path = Path(path)
    raw = read_config_json(path)
    cfg = TargetConfig.from_dict(raw, source=str(path / "config.json"), capture_layers=capture_layers)
    if dtype is None and cfg.torch_dtype not in DTYPES:
        raise ValueError(f"{path / 'config.json'}: key 'torch_dtype' = {cfg.torch_dtype!r} is not one of "
                         f"{sorted(DTYPES)}; pass dtype= to choose one")
    dtype = resolve_dtype(dtype, cfg.torch_dtype)
    decl = declare(cfg)
    mesh, shardings = _param_shardings(decl, path, mesh, rules, shardings)
    source = open_weights(path)
    model = nnx.eval_shape(lambda: Target(cfg, dtype=dtype, attention_impl=attention_impl))
    for name, info in decl.present():
        pdtype = decl.dtype_of(name, dtype)
        if name in shardings:
            value = _fetch_sharded(source, info, pdtype, shardings[name])
        elif info.stacked:
            per_layer = [_fetch(source, n, info.shape[1:], info.transpose, pdtype) for n in info.checkpoint_names()]
            value = jnp.stack(per_layer)
            del per_layer
        else:
            value = _fetch(source, info.checkpoint, info.shape, info.transpose, pdtype)
        getattr(model, name).set_value(value)
    model.inv_freq.set_value(_replicated(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)), mesh))
    return model


# --------------------------------------------------------------------------- drafter
def is_drafter_config(raw: dict) -> bool:
    archs = raw.get("architectures") or []
    archs = archs if isinstance(archs, list) else []
    return "draft_vocab_size" in raw or any(isinstance(a, str) and "Eagle" in a for a in archs)


class _Renamed:
    """Accepts exports that prefix names with ``model.`` or call the layer ``layers.0``
    (two stored names for one tensor are refused)."""

    def __init__(self, source):
        self.source = source
        self.alias = {}
        for name in source.names():
            canon = name[len("model."):] if name.startswith("model.") else name
            canon = canon.replace("layers.0.", "midlayer.", 1) if canon.startswith("layers.0.") else canon
            if canon in self.alias:
                raise ValueError(f"{source.path_of(name)}: tensors {self.alias[canon]!r} and {name!r} "
                                 f"both name {canon!r}")
            self.alias[canon] = name

    def names(self):
        return self.alias.keys()

    def path_of(self, name):  # a name not stored raises the source's "missing tensor" error
        return self.source.path_of(self.alias.get(name, name))

    def shape(self, name):
        return self.source.shape(self.alias.get(name, name))

    def get(self, name):
        return self.source.get(self.alias.get(name, name))

    def read(self, name, index):
        return self.source.read(self.alias.get(name, name), index)


def load_drafter(path, *, target=None, embed=None, dtype=None, mesh=None, rules=None):
    """Loads an EAGLE-3 drafter checkpoint directory.

    Reads the official release layout (``config.json`` + ``pytorch_model.bin``, read
    without torch) and safetensors exports (SpecForge / SGLang / vLLM
    ``LlamaForCausalLMEagle3``).  The drafter shares ``target``'s embedding (frozen)
    unless the checkpoint carries ``embed_tokens.weight``; pass ``embed`` instead of a
    target to give the table directly.  The pair is validated: hidden sizes, vocab
    size, ``d2t`` range and ``t2d`` consistency, captured-layer ids.

    ``mesh`` / ``rules``: as in :func:`load_target` (parameters sharded by their declared
    logical axes, :func:`eagle3_jax.models.drafter.declare`, and built from per-device
    blocks; the shared embedding placed on its declared sharding; the vocabulary map and
    rotary frequencies replicated).
    """
    from eagle3_jax.models.drafter import Drafter, declare
    from eagle3_jax.models.target import Target

    if target is not None and not isinstance(target, Target):
        raise TypeError(f"target: expected a loaded Target (eagle3_jax.load_target(...)), got {type(target).__name__} "
                        f"{target!r}")
    path = Path(path)
    raw = read_config_json(path)
    cfg = DrafterConfig.from_dict(raw, source=str(path / "config.json"))
    decl = declare(cfg)
    mesh, shardings = _param_shardings(decl, path, mesh, rules, None)
    source = _Renamed(open_weights(path))
    dtype = resolve_dtype(dtype, "float32" if target is None else jnp.dtype(target.dtype).name)
    if target is not None:
        _check_pair(cfg, target.config, path)
    embed_info = decl.params["embed"]
    own = embed_info.checkpoint in source.names()
    if own:
        embed = (_fetch_sharded(source, embed_info, dtype, shardings["embed"]) if mesh is not None
                 else _fetch(source, embed_info.checkpoint, embed_info.shape, False, dtype))
    elif target is not None:
        embed = target.embed[...]
    elif embed is None:
        raise ValueError(f"{path}: the checkpoint has no {embed_info.checkpoint}; pass target= (or embed=) to share "
                         f"the target's")
    if tuple(jnp.shape(embed)) != embed_info.shape:
        raise ValueError(f"{path}: embedding shape {tuple(jnp.shape(embed))} does not match the drafter's "
                         f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})")

    d2t = None
    if cfg.has_vocab_map:
        d2t = _fetch_ids(source, "d2t", cfg.draft_vocab_size, "iu").astype(np.int64)
        t2d = _fetch_ids(source, "t2d", cfg.vocab_size, "biu") if "t2d" in source.names() else None
        _check_vocab_map(d2t, t2d, cfg, path)
    model = nnx.eval_shape(lambda: Drafter(cfg, jnp.zeros(embed_info.shape), dtype=dtype))
    for name, info in decl.present():
        if info.frozen:
            continue
        pdtype = decl.dtype_of(name, dtype)
        getattr(model, name).set_value(_fetch_sharded(source, info, pdtype, shardings[name]) if mesh is not None
                                       else _fetch(source, info.checkpoint, info.shape, info.transpose, pdtype))
    embed = jnp.asarray(embed, dtype)
    model.embed.set_value(embed if mesh is None else jax.device_put(embed, shardings["embed"]))
    model.d2t.set_value(_replicated(jnp.zeros((cfg.draft_vocab_size,), jnp.int32) if d2t is None
                                    else jnp.asarray(d2t, jnp.int32), mesh))
    model.inv_freq.set_value(_replicated(jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)), mesh))
    model.own_embedding = own
    return model


def _check_pair(cfg: DrafterConfig, tcfg: TargetConfig, path: Path):
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(f"{path}: drafter expects target hidden size {cfg.target_hidden_size} "
                         f"(fc takes {3 * cfg.target_hidden_size}), the target has {tcfg.hidden_size}")
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"{path}: drafter vocab_size {cfg.vocab_size} != target vocab_size {tcfg.vocab_size}")
    if cfg.capture_layers is not None and tuple(cfg.capture_layers) != tuple(tcfg.capture_layers):
        raise ValueError(f"{path}: drafter was trained on target layers {list(cfg.capture_layers)}, the target "
                         f"captures {list(tcfg.capture_layers)}; load it with load_target(..., "
                         f"capture_layers={list(cfg.capture_layers)})")


def _check_vocab_map(d2t: np.ndarray, t2d, cfg: DrafterConfig, path: Path):
    if d2t.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"{path}: tensor 'd2t' has shape {d2t.shape}, expected ({cfg.draft_vocab_size},)")
    target_ids = np.arange(cfg.draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size or np.any(np.diff(target_ids) <= 0):
        raise ValueError(f"{path}: tensor 'd2t' maps draft ids outside [0, {cfg.vocab_size}) or not strictly increasing")
    if t2d is not None:
        if t2d.shape != (cfg.vocab_size,) or not np.array_equal(np.flatnonzero(t2d), target_ids):
            raise ValueError(f"{path}: tensor 't2d' disagrees with 'd2t' (it must mark exactly the mapped target ids)")


def save_drafter(drafter, path, *, dtype="float32") -> Path:
    """Writes ``config.json`` + ``model.safetensors`` in the official EAGLE-3 layout
    (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` as PyTorch
    ``[out, in]`` in ``dtype``, ``d2t`` int64, ``t2d`` bool), read alike by the official
    EAGLE code, SGLang and vLLM.

    As in the published EAGLE-3 configs, ``target_hidden_size`` is written only where it
    differs from ``hidden_size``: the official runtime takes the key to mean that the
    checkpoint brings its own embedding, and without it loads the target's
    ``model.embed_tokens.weight`` through the target's ``model.safetensors.index.json``
    (which :func:`save_target` writes).  So ``embed_tokens.weight`` is shipped when the
    drafter owns its embedding and whenever ``target_hidden_size`` is written.

    ``path`` is replaced whole and atomically, as described in :func:`save_target`.
    """
    from eagle3_jax.models.drafter import Drafter, declare

    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter: expected an eagle3_jax Drafter (e.g. from load_drafter), got {type(drafter).__name__}")
    dtype = _save_dtype(dtype)
    _check_output(path)
    cfg = drafter.config
    config = {**cfg.to_dict(), "torch_dtype": jnp.dtype(dtype).name}
    if cfg.target_hidden_size == cfg.hidden_size:
        config.pop("target_hidden_size", None)
    ship_embed = drafter.own_embedding or "target_hidden_size" in config
    tensors = {}
    for name, info in declare(cfg).present():
        if name == "embed" and not ship_embed:
            continue
        arr = getattr(drafter, name)[...].astype(dtype)
        tensors[info.checkpoint] = arr.T if info.transpose else arr
    if cfg.has_vocab_map:
        tensors["d2t"] = np.asarray(drafter.d2t[...]).astype(np.int64)  # numpy: int64 even without jax x64
        tensors["t2d"] = np.asarray(drafter.t2d)
    return _write(path, tensors, {"config.json": config})


def save_target(target, path, *, dtype="float32", tokenizer=None, generation_config: dict | None = None) -> Path:
    """Writes a Hugging Face checkpoint that :func:`load_target`, transformers and the
    official EAGLE runtime load: ``config.json``, ``model.safetensors`` with
    ``LlamaForCausalLM`` names, ``model.safetensors.index.json`` (for a single file too:
    the official runtime finds the embedding for a drafter without ``target_hidden_size``
    through it), and the tokenizer and ``generation_config.json`` when given.
    Llama-architecture targets only.

    Both savers write atomically: the checkpoint is assembled in a fresh directory beside
    ``path`` (``.NAME.tmp-*``), fsynced, and swapped in whole (one ``renameat2`` exchange
    on Linux; elsewhere rename aside, rename in, restore on failure).  ``path`` never holds
    a partial checkpoint, files of another layout (shards and their index,
    ``pytorch_model.bin``) go with the old directory, and on any failure the previous
    contents stay as they were.  A writer killed mid-swap may leave the previous version
    beside ``path`` (``.NAME.old-*``); the next save into ``path`` restores or removes
    such leftovers.  A ``path`` holding anything but checkpoint files (weights, indexes,
    configs, tokenizer files) is refused before any tensor is converted, naming the
    files.  Files get the mode a plain ``open`` gives (umask); a replaced directory keeps
    its mode.
    """
    from eagle3_jax.models.target import Target, declare

    if not isinstance(target, Target):
        raise TypeError(f"target: expected an eagle3_jax Target (e.g. from load_target), got {type(target).__name__}")
    cfg = target.config
    if cfg.family != "llama" or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm or cfg.sliding_window:
        raise ValueError(f"target: save_target writes plain Llama checkpoints; this target is {cfg.family!r}"
                         + (" with biases, q/k norms or a sliding window" if cfg.family == "llama" else ""))
    dtype = _save_dtype(dtype)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer: expected a transformers tokenizer (with save_pretrained), got {type(tokenizer).__name__}")
    if generation_config is not None:
        if not isinstance(generation_config, dict):
            raise TypeError(f"generation_config: expected a dict, got {type(generation_config).__name__}")
        try:
            json.dumps(generation_config)
        except (TypeError, ValueError) as e:
            raise TypeError(f"generation_config: not JSON-serialisable ({e})") from None
    _check_output(path)
    tensors = {}
    for name, info in declare(cfg).present():
        value = getattr(target, name)[...].astype(dtype)
        blocks = list(value) if info.stacked else [value]
        for hf, block in zip(info.checkpoint_names(), blocks):
            tensors[hf] = block.T if info.transpose else block
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": jnp.dtype(dtype).name,
    }
    if cfg.rope.rope_type != "default":  # without it, transformers would rotate unscaled
        config["rope_scaling"] = {"rope_type": cfg.rope.rope_type, "factor": cfg.rope.factor}
        if cfg.rope.rope_type == "llama3":
            config["rope_scaling"].update(low_freq_factor=cfg.rope.low_freq_factor, high_freq_factor=cfg.rope.high_freq_factor,
                                          original_max_position_embeddings=cfg.rope.original_max_position_embeddings)
    files = {"config.json": config}
    if generation_config is not None:
        files["generation_config.json"] = generation_config
    return _write(path, tensors, files, index=True,
                  extra=None if tokenizer is None else lambda d: tokenizer.save_pretrained(str(d)))


# The files a checkpoint directory may hold (our layout, sharded and torch layouts, tokenizer
# files): saving replaces them together; anything else in the directory makes a save refuse.
_CHECKPOINT_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "model.safetensors.tmp", "pytorch_model.bin", "pytorch_model.bin.index.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
    "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
}
_SHARD = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")


def _save_dtype(dtype):
    msg = f"dtype={dtype!r}: expected one of {sorted(DTYPES)}"
    try:
        resolved = resolve_dtype(dtype)
    except TypeError:
        raise TypeError(msg) from None
    except ValueError:
        raise ValueError(msg) from None
    if jnp.dtype(resolved).name not in DTYPES:
        raise ValueError(msg)
    return resolved


def check_output_path(path, name: str, *, directory: bool = False) -> Path:
    """Checks, before any long work, that ``path`` (a file, or with ``directory`` a
    directory) can be written: an existing one must be of that kind and writable, else its
    nearest existing parent must be a writable directory (missing parents are created when
    the output is written).  Raises ``NotADirectoryError`` / ``IsADirectoryError`` /
    ``PermissionError`` naming ``name`` and the path."""
    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            raise NotADirectoryError(f"{name} {path}: exists and is not a directory")
        if not directory and path.is_dir():
            raise IsADirectoryError(f"{name} {path}: is a directory, expected a file path")
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{name} {path}: not writable")
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"{name} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{name} {path}: cannot create it in {parent} (not writable)")
    return path


def _check_output(path) -> Path:
    """The export directory ``path`` (symlinks followed), checked before any work: a path,
    not a file, a writable existing ancestor, and no files other than checkpoint files."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise TypeError(f"path: expected a directory path (str or os.PathLike), got {type(path).__name__}")
    if not os.fspath(path):
        raise ValueError("path: empty; expected a directory path")
    path = Path(os.path.realpath(path))
    if path.parent == path:
        raise ValueError(f"path: {path} is the file-system root; cannot replace it")
    check_output_path(path, "path", directory=True)
    if path.is_dir():
        foreign = sorted(p.name for p in path.iterdir()
                         if not (p.is_file() and (p.name in _CHECKPOINT_FILES or _SHARD.fullmatch(p.name))))
        if foreign:
            raise FileExistsError(f"{path}: holds files that are not checkpoint files ({', '.join(foreign)}); saving "
                                  "replaces the directory whole, so move them away or save to another path")
    return path


def _write(path, tensors: dict, jsons: dict[str, dict], *, index: bool = False, extra=None) -> Path:
    """Assembles ``model.safetensors`` (+ its index), the ``jsons`` and whatever ``extra(dir)``
    writes in a fresh directory beside ``path``, fsyncs it and swaps it in whole."""
    from safetensors.numpy import save_file

    given, path = Path(path), _check_output(path)
    tmp = _sibling(path, "tmp")
    try:
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True)
        _recover(path)
        tmp.mkdir()
        if extra is not None:
            extra(tmp)
        arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}
        save_file(arrays, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if index:
            jsons = {**jsons, "model.safetensors.index.json": {
                "metadata": {"total_size": sum(a.nbytes for a in arrays.values())},
                "weight_map": {k: "model.safetensors" for k in sorted(arrays)}}}
        for name, obj in jsons.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        mode = (tmp / "config.json").stat().st_mode & 0o777  # what open() gave: umask applied
        for f in tmp.iterdir():
            os.chmod(f, mode)  # safetensors writes 0600
            _fsync(f)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        _fsync(tmp)
        _swap_in(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, SafetensorError):
            code = re.search(r"os error (\d+)", str(e))
            e = OSError(*((int(code.group(1)),) if code else ()), str(e))
        if isinstance(e, OSError):
            why = e.strerror or str(e)
            raise OSError(*((e.errno,) if e.errno else ()), f"{path}: writing the checkpoint failed ({why}); "
                          f"{path} was left as it was") from e
        raise
    return given


def _sibling(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _fsync(path: Path):
    if path.is_dir() and os.name != "posix":
        return  # directories cannot be opened for fsync there
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_in(tmp: Path, path: Path):
    """Puts ``tmp`` at ``path`` in one step; the old ``path`` is then deleted."""
    if not path.exists():
        os.rename(tmp, path)
        old = None
    elif _exchange(tmp, path):
        old = tmp
    else:
        old = _sibling(path, "old")
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    try:  # best effort: the new checkpoint is in place
        _fsync(path.parent)
    except OSError:
        pass
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two directories (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the platform or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _recover(path: Path):
    """Cleans up after writers into ``path`` that were killed: puts a previous version that
    was moved aside back if ``path`` is missing, and removes their temporary directories."""
    mine = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-(\d+)-[0-9a-f]+")
    found = sorted((m.group(1) == "tmp", p) for p in path.parent.iterdir()
                   if (m := mine.fullmatch(p.name)) and not _alive(int(m.group(2))))
    for _, p in found:  # "old" first
        if p.name.startswith(f".{path.name}.old-") and not path.exists():
            os.rename(p, path)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:  # this process counts: another thread may be saving
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
