"""Forged checkpoints for the loading tests and the fuzzer (``scripts/fuzz_checkpoints.py``).

``torch.save`` zips are written by hand: the pickle opcode by opcode (protocol 2, the way
torch writes a state dict) and the zip entry by entry, so a test can give any field any
value: a storage size that lies, a stride past the blob, a zip header that lies, a deflated
bomb.  ``expected`` computes what a tensor must hold with plain index arithmetic (not
``as_strided``), and ``reference_describe`` parses a pickle with the C unpickler, as
independent oracles for the reader.  The ``check_*`` functions each run one fuzz case and
return an outcome label; they raise ``AssertionError`` when the reader misbehaves.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import pickle
import pickletools
import re
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

STORAGE_DTYPES = {
    "FloatStorage": np.dtype(np.float32), "DoubleStorage": np.dtype(np.float64), "HalfStorage": np.dtype(np.float16),
    "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32), "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8), "ByteStorage": np.dtype(np.uint8), "BoolStorage": np.dtype(np.bool_),
    "BFloat16Storage": None,  # filled in lazily (ml_dtypes through jax)
}


def storage_dtype(storage: str) -> np.dtype:
    if storage == "BFloat16Storage":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return STORAGE_DTYPES[storage]


# ------------------------------------------------------------------ pickles
def _uni(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(b)) + b


def _int(v: int) -> bytes:
    if isinstance(v, bool):
        return b"\x88" if v else b"\x89"
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    n = (v.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)


def _value(v) -> bytes:
    if isinstance(v, (bool, int)):
        return _int(v)
    if isinstance(v, float):
        return b"G" + struct.pack(">d", v)
    if isinstance(v, str):
        return _uni(v)
    if isinstance(v, (tuple, list)):
        return b"(" + b"".join(map(_value, v)) + (b"t" if isinstance(v, tuple) else b"l")
    if v is None:
        return b"N"
    raise TypeError(v)


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


_ORDERED_DICT = _global("collections", "OrderedDict") + b")R"


@dataclasses.dataclass
class TensorSpec:
    """One state-dict entry as the pickle describes it (any field may be malformed)."""

    name: str
    key: str  # storage key: zip entry ``archive/data/<key>``
    storage: str  # torch storage type, e.g. "FloatStorage"
    numel: object  # the storage's declared element count
    offset: object
    size: object
    stride: object
    parameter: bool = False


def torch_pickle(specs, *, ordered: bool = True, metadata: bool = True) -> bytes:
    """A ``data.pkl`` as ``torch.save`` writes it for a state dict of ``specs``."""
    out = [b"\x80\x02", _ORDERED_DICT if ordered else b"}", b"("]
    for t in specs:
        pid = b"(" + b"".join([_uni("storage"), _global("torch", t.storage), _value(t.key), _uni("cpu"),
                               _value(t.numel)]) + b"tQ"
        args = b"(" + pid + _value(t.offset) + _value(t.size) + _value(t.stride) + b"\x89" + _ORDERED_DICT + b"t"
        tensor = _global("torch._utils", "_rebuild_tensor_v2") + args + b"R"
        if t.parameter:
            tensor = _global("torch._utils", "_rebuild_parameter") + b"(" + tensor + b"\x88" + _ORDERED_DICT + b"tR"
        out.append(_uni(t.name) + tensor)
    out.append(b"u")
    if ordered and metadata:  # OrderedDict.__reduce__ state: the state dict's _metadata attribute
        out.append(b"}" + _uni("_metadata") + _ORDERED_DICT + b"sb")
    out.append(b".")
    return b"".join(out)


# ------------------------------------------------------------------ zips
@dataclasses.dataclass
class Entry:
    """One zip entry: ``data`` is stored as given (already deflated when ``method`` is 8);
    ``file_size`` / ``crc`` are what the headers claim (default: the truth)."""

    name: str
    data: bytes
    method: int = zipfile.ZIP_STORED
    file_size: int | None = None
    crc: int | None = None


def write_zip(path: Path, entries) -> dict[str, tuple[int, int]]:
    """Writes ``entries`` as a zip; returns each entry's ``(start, end)`` data byte range."""
    body, central, regions = bytearray(), bytearray(), {}
    for e in entries:
        name = e.name.encode()
        size = len(e.data) if e.file_size is None else e.file_size
        crc = zlib.crc32(e.data) if e.crc is None else e.crc
        offset = len(body)
        body += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, e.method, 0, 0, crc, len(e.data), size, len(name), 0)
        body += name
        regions[e.name] = (len(body), len(body) + len(e.data))
        body += e.data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, e.method, 0, 0, crc, len(e.data), size,
                               len(name), 0, 0, 0, 0, 0, offset) + name
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central), len(body), 0)
    Path(path).write_bytes(bytes(body + central + eocd))
    return regions


def torch_entries(pkl: bytes, blobs: dict[str, bytes], root: str = "archive") -> list[Entry]:
    """The entries of a ``torch.save`` zip: pickle, byte order, storages, version."""
    return ([Entry(f"{root}/data.pkl", pkl), Entry(f"{root}/byteorder", b"little")]
            + [Entry(f"{root}/data/{k}", v) for k, v in blobs.items()] + [Entry(f"{root}/version", b"3\n")])


def deflated_zeros(n_mib: int) -> bytes:
    """A raw deflate stream of ``n_mib`` MiB of zeros, built in milliseconds: one fully
    flushed 1 MiB block (~1 KB) repeated, then the final block."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    assert block == again  # a full flush resets the compressor: every block is the same bytes
    return block * n_mib + c.flush()


# ------------------------------------------------------------------ a base state dict
def pattern(nbytes: int, seed: int) -> bytes:
    """Bytes with no zero byte, distinct windows: heap memory read by mistake shows up."""
    return bytes((i * 131 + seed * 29 + (i >> 8) * 7) % 251 + 1 for i in range(nbytes))


def base_checkpoint():
    """``(specs, blobs)``: views with offsets, transposes, shared storages, several dtypes."""
    specs = [
        TensorSpec("w", "0", "FloatStorage", 12, 0, (3, 4), (4, 1), parameter=True),
        TensorSpec("w_t", "0", "FloatStorage", 12, 0, (4, 3), (1, 4)),
        TensorSpec("w_col", "0", "FloatStorage", 12, 5, (2,), (3,)),
        TensorSpec("h", "1", "BFloat16Storage", 6, 0, (2, 3), (3, 1)),
        TensorSpec("ids", "2", "LongStorage", 5, 0, (5,), (1,)),
        TensorSpec("mask", "3", "BoolStorage", 4, 0, (4,), (1,)),
        TensorSpec("scalar", "4", "DoubleStorage", 2, 1, (), ()),
        TensorSpec("empty", "5", "HalfStorage", 0, 0, (0, 3), (3, 1)),
    ]
    sizes = {"0": 48, "1": 12, "2": 40, "3": 4, "4": 16, "5": 0}
    blobs = {k: pattern(n, int(k)) for k, n in sizes.items()}
    return specs, blobs


def expected(spec: TensorSpec, blobs: dict[str, bytes]) -> np.ndarray:
    """What tensor ``spec`` must hold, by index arithmetic over its storage."""
    dtype = storage_dtype(spec.storage)
    raw = blobs[spec.key]
    data = np.frombuffer(raw, np.uint8) != 0 if dtype == np.bool_ else np.frombuffer(raw, dtype)
    if math.prod(spec.size) == 0:
        return np.zeros(spec.size, data.dtype)
    if spec.size == ():
        return data[spec.offset:spec.offset + 1].reshape(())
    grid = np.indices(spec.size, dtype=np.int64).reshape(len(spec.size), -1)
    flat = spec.offset + (np.asarray(spec.stride, np.int64)[:, None] * grid).sum(0)
    return data[flat].reshape(spec.size)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def invalid(specs, blobs) -> set[str]:
    """Names of the tensors the reader must refuse (empty: the whole file must load)."""
    bad, seen = set(), {}
    for t in specs:
        ok = (t.storage in STORAGE_DTYPES and isinstance(t.key, str) and _is_int(t.numel) and t.numel >= 0
              and isinstance(t.size, tuple) and isinstance(t.stride, tuple) and len(t.size) == len(t.stride) <= 32
              and all(_is_int(v) and v >= 0 for v in (*t.size, *t.stride, t.offset)))
        if ok:
            count = math.prod(t.size)
            last = t.offset + sum((n - 1) * s for n, s in zip(t.size, t.stride))
            ok = math.prod(n for n in t.size if n) < 2**31 if count == 0 else (count <= t.numel and last < t.numel)
            ok = ok and t.key in blobs and len(blobs[t.key]) == t.numel * storage_dtype(t.storage).itemsize
            ok = ok and seen.setdefault(t.key, (t.storage, t.numel)) == (t.storage, t.numel)
        if not ok:
            bad.add(t.name)
    return bad


# ------------------------------------------------------------------ oracles
class _Reference(pickle.Unpickler):
    """The C unpickler, recording what the pickle says (never what the reader does)."""

    def find_class(self, module, name):
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return lambda st, off, size, stride, *_: ("tensor", st, off, size, stride)
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda t, *_: t
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return ("storage-ref", pid)


def reference_describe(pkl: bytes):
    """``[TensorSpec]`` the pickle describes (by the C unpickler), or ``None`` if it does not
    describe a plain state dict of tensors.  Memo indices are bounded first: the C
    unpickler sizes its memo by the largest index it is given."""
    try:
        for op, arg, _ in pickletools.genops(pkl):
            if "PUT" in op.name and arg > 10_000:
                return None
        obj = _Reference(io.BytesIO(pkl)).load()
    except Exception:
        return None
    if not isinstance(obj, dict):
        return None
    specs = []
    for name, t in obj.items():
        if not (isinstance(name, str) and isinstance(t, tuple) and len(t) == 5 and t[0] == "tensor"):
            return None
        st = t[1]
        if not (isinstance(st, tuple) and st[0] == "storage-ref"):
            return None
        pid = st[1]
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], str)
                and isinstance(pid[2], str)):
            return None
        specs.append(TensorSpec(name, pid[2], pid[1], pid[4], t[2], t[3], t[4]))
    return specs


def windows(blobs: dict[str, bytes]) -> dict[int, set[bytes]]:
    """Every itemsize-aligned window of every blob, per itemsize."""
    return {n: {b[i:i + n] for b in blobs.values() for i in range(0, len(b) - n + 1, n)} for n in (1, 2, 4, 8)}


def assert_inside_blobs(tensors: dict, blobs: dict[str, bytes]):
    """Every element of every tensor is bytes some blob holds (no memory outside a blob)."""
    wins = windows(blobs)
    for name, arr in tensors.items():
        if arr.dtype == np.bool_ or arr.size == 0:
            continue
        raw = np.ascontiguousarray(arr).tobytes()
        n = arr.dtype.itemsize
        stray = [raw[i:i + n] for i in range(0, len(raw), n) if raw[i:i + n] not in wins[n]]
        assert not stray, f"tensor {name!r} holds bytes from outside every storage: {stray[:3]}"


def assert_equal(tensors: dict, specs, blobs):
    assert list(tensors) == [t.name for t in specs]
    for t in specs:
        want, got = expected(t, blobs), tensors[t.name]
        assert got.dtype == want.dtype and got.shape == want.shape, (t.name, got.dtype, got.shape, want.shape)
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), t.name


# ------------------------------------------------------------------ fuzz cases
def _load(file: Path):
    """``(tensors, None)`` or ``(None, error)``; any error but a ValueError naming ``file`` fails."""
    from eagle3_jax.checkpoint import TorchPickleSource

    try:
        return TorchPickleSource(file).tensors, None
    except ValueError as e:
        assert str(file) in str(e), f"error does not name the file: {e}"
        return None, e


def check_fields(file: Path, edits) -> str:
    """A base checkpoint whose specs / blobs get ``edits`` (``(tensor index, field, value)``;
    field ``"blob"`` replaces that tensor's storage bytes): the reader must load exactly the
    oracle's values, or refuse with a ``ValueError`` naming the file and an offending tensor."""
    specs, blobs = base_checkpoint()
    for i, field, value in edits:
        if field == "blob":
            blobs[specs[i].key] = value
        else:
            setattr(specs[i], field, value)
    write_zip(file, torch_entries(torch_pickle(specs), blobs))
    bad = invalid(specs, blobs)
    tensors, err = _load(file)
    if err is None:
        assert not bad, f"loaded, but {sorted(bad)} should have been refused"
        assert_equal(tensors, specs, blobs)
        return "loaded (as the oracle computes)"
    assert bad, f"refused a valid checkpoint: {err}"
    if any(m in str(err) for m in ("malformed data.pkl", "unsupported storage", "malformed storage",
                                   "refusing to load global")):
        return "refused while unpickling"  # before any tensor has a name
    assert any(repr(n) in str(err) for n in bad), f"error names none of {sorted(bad)}: {err}"
    return "refused, naming the tensor"


def check_pickle_bytes(file: Path, pkl: bytes) -> str:
    """A mutated ``data.pkl`` in an otherwise good zip: refused clearly, or loaded as the C
    unpickler reads the same pickle (and never with bytes from outside the storages)."""
    _, blobs = base_checkpoint()
    write_zip(file, torch_entries(pkl, blobs))
    tensors, err = _load(file)
    if err is not None:
        return "refused"
    assert_inside_blobs(tensors, blobs)
    ref = reference_describe(pkl)
    if ref is not None:
        assert not invalid(ref, blobs), f"loaded tensors {sorted(invalid(ref, blobs))} the reader must refuse"
        assert_equal(tensors, ref, blobs)
        return "loaded (as the C unpickler reads it)"
    return "loaded (no reference)"


def check_zip_bytes(file: Path, flips) -> str:
    """A good checkpoint with bytes ``flips`` (``(position fraction, xor mask)``) changed
    anywhere in the zip: refused clearly, or loaded; loaded unchanged when no pickle or
    storage byte was touched."""
    specs, blobs = base_checkpoint()
    path = Path(file)
    regions = write_zip(path, torch_entries(torch_pickle(specs), blobs))
    good = path.read_bytes()
    raw = bytearray(good)
    for frac, mask in flips:
        raw[min(int(frac * len(raw)), len(raw) - 1)] ^= mask
    touched = [i for i, (a, b) in enumerate(zip(good, raw)) if a != b]
    path.write_bytes(bytes(raw))
    tensors, err = _load(path)
    if err is not None:
        return "refused"
    assert_inside_blobs(tensors, blobs)
    payload = [r for n, r in regions.items() if n.endswith("data.pkl") or "/data/" in n]
    if not any(a <= p < b for p in touched for a, b in payload):
        assert_equal(tensors, specs, blobs)
        return "loaded unchanged (only headers touched)"
    return "loaded"


def base_configs():
    """``(target config, drafter config)`` dicts, tiny and valid."""
    target = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96,
                  num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  eos_token_id=[2], torch_dtype="float32", initializer_range=0.02)
    drafter = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=64,
                   intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   vocab_size=128, draft_vocab_size=64, target_hidden_size=64, rms_norm_eps=1e-5,
                   rope_theta=10000.0, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]},
                   initializer_range=0.02)
    return target, drafter


# config key -> the config field it sets (keys read by from_dict; any other key is ignored)
CONFIG_FIELDS = {
    "hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "vocab_size": "vocab_size", "draft_vocab_size": "draft_vocab_size", "target_hidden_size": "target_hidden_size",
    "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
    "rope_theta": None, "tie_word_embeddings": "tie_word_embeddings", "eos_token_id": None,
    "torch_dtype": "torch_dtype", "model_type": "family", "eagle_config": None, "rope_scaling": None,
    "rope_parameters": None, "hidden_act": None, "sliding_window": "sliding_window", "attention_bias": None,
    "mlp_bias": "mlp_bias", "dtype": None, "use_sliding_window": None,
}


def check_config(kind: str, edits) -> str:
    """A base config with ``edits`` (``(key, value)``; value ``DELETE`` removes the key): parsed
    into the same config when only ignored keys changed, into a config holding the new
    integer when an integer size changed, or refused with a ``ValueError`` naming the file
    and a changed key."""
    from eagle3_jax.config import DrafterConfig, TargetConfig

    cls = TargetConfig if kind == "target" else DrafterConfig
    base = base_configs()[0 if kind == "target" else 1]
    d = dict(base)
    for key, value in edits:
        if value is DELETE:
            d.pop(key, None)
        else:
            d[key] = value
    source = f"fuzz/{kind}/config.json"
    try:
        cfg = cls.from_dict(d, source=source)
    except ValueError as e:
        msg = str(e)
        assert source in msg, f"error does not name the file: {msg}"
        assert any(re.search(rf"\b{re.escape(k)}\b", msg) for k, _ in edits), f"error names no changed key: {msg}"
        return "refused, naming the key"
    want = cls.from_dict(base, source=source)
    if all(k not in CONFIG_FIELDS for k, _ in edits):
        assert cfg == want, "an ignored key changed the config"
        return "parsed unchanged (ignored keys)"
    for key, value in edits:
        field = CONFIG_FIELDS.get(key)
        if field and hasattr(cfg, field) and d.get(key) is value is not None and type(base.get(key)) in (int, bool):
            got = getattr(cfg, field)  # an integer or flag key that parsed holds the file's value (null: default)
            assert got == value and type(got) is type(value), (key, value, got)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
        v = getattr(cfg, name)
        assert _is_int(v) and v >= 1, (name, v)
    assert cfg.head_dim % 2 == 0 and cfg.head_dim <= 4096 and cfg.num_heads % cfg.num_kv_heads == 0
    assert math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0 and math.isfinite(cfg.rope.theta)
    return "parsed (checked values)"


DELETE = object()


# ------------------------------------------------------------------ hypothesis strategies
def strategies():
    """Hypothesis strategies for the four fuzz cases (imported lazily: a test-only extra)."""
    from hypothesis import strategies as st

    specs, _ = base_checkpoint()
    ints = st.one_of(st.integers(-3, 20), st.sampled_from([2**31, 2**31 - 1, 2**32, 2**62, 2**63, 2**64, 10**12]),
                     st.integers(-(2**70), 2**70))
    anything = st.one_of(ints, st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4),
                         st.lists(ints, max_size=3).map(tuple))
    shapes = st.one_of(st.lists(ints, max_size=4).map(tuple), anything,
                       st.lists(st.sampled_from([0, 1, 3, 2**31 - 1, 2**40]), min_size=2, max_size=4).map(tuple))
    storages = st.sampled_from(sorted(STORAGE_DTYPES) + ["UntypedStorage", "Float"])
    edit = st.one_of(
        st.tuples(st.integers(0, len(specs) - 1), st.sampled_from(["offset", "numel"]), st.one_of(ints, anything)),
        st.tuples(st.integers(0, len(specs) - 1), st.sampled_from(["size", "stride"]), shapes),
        st.tuples(st.integers(0, len(specs) - 1), st.just("storage"), storages),
        st.tuples(st.integers(0, len(specs) - 1), st.just("key"),
                  st.one_of(st.sampled_from("012345"), st.text(max_size=3))),
        st.tuples(st.integers(0, len(specs) - 1), st.just("parameter"), st.booleans()),
        st.tuples(st.integers(0, len(specs) - 1), st.just("blob"), st.binary(max_size=64)),
    )
    fields = st.lists(edit, min_size=1, max_size=3)

    base_pkl = torch_pickle(specs)
    # fixed-width arguments (ints, memo indices) of the base pickle: (start, width)
    widths = {"K": 1, "M": 2, "J": 4, "h": 1, "q": 1}
    args = [(pos + 1, widths[op.code]) for op, _, pos in pickletools.genops(base_pkl) if op.code in widths]

    @st.composite
    def pickles(draw):
        pkl = bytearray(base_pkl)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["arg", "arg", "flip", "set", "insert", "delete", "truncate"]))
            pos = draw(st.integers(0, max(len(pkl) - 1, 0)))
            if op == "arg" and len(pkl) == len(base_pkl):  # a new value for one argument: still parses
                start, width = draw(st.sampled_from(args))
                pkl[start:start + width] = draw(st.binary(min_size=width, max_size=width))
            elif op == "flip" and pkl:
                pkl[pos] ^= draw(st.integers(1, 255))
            elif op == "set" and pkl:
                pkl[pos] = draw(st.sampled_from(list(b"\x00\xff\x7fKMJq\x8a(tRQhcu.b")))
            elif op == "insert":
                pkl[pos:pos] = draw(st.binary(min_size=1, max_size=8))
            elif op == "delete":
                del pkl[pos:pos + draw(st.integers(1, 8))]
            else:
                del pkl[pos:]
        return bytes(pkl)

    flips = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=3)
    values = st.one_of(anything, st.integers(-(2**40), 2**40), st.floats(-1e30, 1e30), st.just(DELETE),
                       st.dictionaries(st.text(max_size=3), ints, max_size=2), st.text(max_size=6))
    keys = st.sampled_from(sorted(CONFIG_FIELDS) + ["initializer_range", "bos_token_id"])
    configs = st.tuples(st.sampled_from(["target", "drafter"]),
                        st.lists(st.tuples(keys, values), min_size=1, max_size=3))
    return fields, pickles(), flips, configs
