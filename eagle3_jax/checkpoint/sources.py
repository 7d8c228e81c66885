"""Safetensors checkpoints read tensor by tensor (``model.safetensors`` or an indexed shard
set, the index checked to name only files inside the checkpoint), and :func:`open_weights`,
which picks the reader of a checkpoint directory (safetensors first, then the torch reader
of :mod:`eagle3_jax.checkpoint.torch_reader`)."""

from __future__ import annotations

import json
from pathlib import Path, PureWindowsPath

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from eagle3_jax.checkpoint.formats import check_finite
from eagle3_jax.checkpoint.torch_reader import TorchPickleSource

# Bounds on what reading an (untrusted) checkpoint may cost.
MAX_INDEX_BYTES = 16 << 20  # model.safetensors.index.json


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
        check_finite(arr, file, name)
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
        check_finite(arr, file, name)
        return arr


def open_weights(directory: Path):
    """The weight source of a checkpoint directory (safetensors first, then pytorch_model.bin)."""
    if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        return SafetensorsSource(directory)
    if (directory / "pytorch_model.bin").exists():
        return TorchPickleSource(directory / "pytorch_model.bin")
    raise FileNotFoundError(f"{directory}: no model.safetensors(.index.json) or pytorch_model.bin")
