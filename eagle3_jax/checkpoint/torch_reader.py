"""A ``torch.save`` zip checkpoint (``pytorch_model.bin``) read *without torch*, as untrusted
input: :class:`TorchPickleSource`.  Its ``data.pkl`` runs in a restricted pure-Python
unpickler that builds nothing but tensor references, ordered dicts and typed storages;
the zip entries are read bounded (sizes checked before inflating, a total inflation
budget) and every tensor's size, stride and offset are checked against its storage before
it is viewed.  Everything the reader trusts is in this file."""

from __future__ import annotations

import collections
import io
import math
import pickle
import reprlib
import struct
import sys
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoint.formats import check_finite

# Bounds on what reading an (untrusted) checkpoint may cost.
MAX_PICKLE_BYTES = 16 << 20  # data.pkl of a torch zip checkpoint
MAX_INFLATION = 64  # zip entries read from one archive inflate to at most 64x its size ...
INFLATION_SLACK = 1 << 20  # ... plus 1 MiB (torch.save stores entries uncompressed)


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
        check_finite(arr, self.file, name)
        return arr

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Block ``index`` of tensor ``name`` as a numpy array (NaN / infinity refused)."""
        self.path_of(name)
        arr = self.tensors[name][index]
        check_finite(arr, self.file, name)
        return arr
