"""One loader of YAML config files into typed, frozen, nested dataclasses.

:func:`load` reads a YAML mapping, then ``a.b=value`` overrides (as the command line gives
them), into a dataclass: a field whose type is a dataclass is a *section* (a mapping of its
own keys in the YAML, ``section.key`` in an override); any other field is a value read as its
annotated type (``int``, ``float``, ``bool``, ``str``, ``tuple[int, ...]``, or one of them
``| None``), so ``fit.lr=1e-4`` is a float and YAML 1.1's bare ``1e-4`` too.  A field made by
:func:`path` is a file-system path (``~`` expanded, ``null`` allowed).  A dataclass's
``LIMITS`` (a ``ClassVar``: field name → :class:`eagle3_jax.limits.Range`, bounding each item
of a tuple) range-checks its fields; the dataclass's own ``__post_init__`` may check more.  Unknown keys are refused with
the closest known ones; every error is a ``ValueError`` naming the key, the value and where
it came from (the file, or ``command-line override``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path

import yaml

from eagle3_jax import limits

OVERRIDE = "command-line override"
TRUE, FALSE, NULL = ("true", "yes", "on", "1"), ("false", "no", "off", "0"), ("", "null", "none", "~")


def path(default: str | None = None):
    """A dataclass field holding a file-system path (``~/x`` expanded as a shell does) or None."""
    return dataclasses.field(default=default, metadata={"path": True})


@dataclasses.dataclass(frozen=True)
class Key:
    """One dotted key of a schema: its value's kind (``int``, ``float``, ``bool``, ``str`` or
    ``tuple`` of ints), whether it may be null, whether it is a path, its range."""

    kind: type
    nullable: bool = False
    is_path: bool = False
    range: limits.Range | None = None

    def expected(self) -> str:
        if self.is_path:
            return "a path or null"
        return limits.KIND_NAMES[self.kind] + (" or null" if self.nullable else "")


def schema(cls, prefix: str = "") -> dict[str, Key | type]:
    """Every key of dataclass ``cls``, dotted (``fit.lr``) → its :class:`Key`; a section's own
    name → its dataclass."""
    hints = typing.get_type_hints(cls)
    ranges = getattr(cls, "LIMITS", {})
    out = {}
    for f in dataclasses.fields(cls):
        name, kind = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(kind):
            out[name] = kind
            out.update(schema(kind, name + "."))
            continue
        args = typing.get_args(kind)
        nullable = typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args
        if nullable:
            (kind,) = [a for a in args if a is not type(None)]
        base = typing.get_origin(kind) or kind
        if base not in limits.KIND_NAMES:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported config type {kind!r}")
        out[name] = Key(base, nullable, bool(f.metadata.get("path")), ranges.get(f.name))
    return out


def read_yaml(file: str | Path, label: str = "--config") -> dict:
    """The mapping a YAML file holds ({} when empty); errors name ``label`` and the file."""
    file = Path(file)
    where = f"{label} {file}"
    if not file.is_file():
        raise (IsADirectoryError if file.is_dir() else FileNotFoundError)(
            f"{where}: {'is a directory' if file.is_dir() else 'no such file'}")
    try:
        tree = yaml.safe_load(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{where}: invalid YAML{at} ({getattr(e, 'problem', None) or e})") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ValueError(f"{where}: expected a mapping of config keys, got a {type(tree).__name__}")
    return tree


def load(cls, file: str | Path, overrides=(), *, label: str = "--config"):
    """Dataclass ``cls`` from YAML ``file`` then ``overrides`` (``a.b=value`` texts): keys the
    file leaves out keep the dataclass's defaults (a field without one must be given)."""
    return build(cls, read_yaml(file, label), str(file), overrides)


def build(cls, tree: dict, source: str, overrides=()):
    """Dataclass ``cls`` from a mapping ``tree`` read from ``source`` (as :func:`load`)."""
    keys = schema(cls)
    values, origin = {}, {}
    for key, value in _flatten(tree, keys, source).items():
        values[key], origin[key] = _coerce(key, value, keys[key], source), source
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value (e.g. fit.lr=1e-4)")
        check_known(key, keys, f"override {item!r}")
        values[key], origin[key] = _coerce(key, value, keys[key], OVERRIDE), OVERRIDE
    for key, value in values.items():
        rng = keys[key].range
        if rng is not None and keys[key].kind is tuple:
            rng = dataclasses.replace(rng, kind=tuple)  # an int range bounds each item
        problem = None if rng is None or (value is None and keys[key].nullable) else limits.problem(value, rng)[1]
        if problem:
            raise ValueError(f"{key}={value!r} ({origin[key]}): {problem}")
    return _construct(cls, "", values, origin, source)


def _construct(cls, prefix: str, values: dict, origin: dict, source: str, default=None):
    """``cls`` from the ``values`` under ``prefix``; a key not given keeps ``default``'s value
    (a section's default instance), else the field's default."""
    kw, hints, missing = {}, typing.get_type_hints(cls), dataclasses.MISSING
    for f in dataclasses.fields(cls):
        name, kind = prefix + f.name, hints[f.name]
        fallback = (getattr(default, f.name) if default is not None else
                    f.default_factory() if f.default_factory is not missing else f.default)
        if dataclasses.is_dataclass(kind):
            kw[f.name] = _construct(kind, name + ".", values, origin, source, None if fallback is missing else fallback)
        elif name in values:
            kw[f.name] = values[name]
        elif fallback is not missing:
            kw[f.name] = fallback
        else:
            raise ValueError(f"{source}: {name!r} is required")
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:  # the dataclass's own checks: "key=value: problem"
        item, _, problem = str(e).partition(": ")
        raise ValueError(f"{item} ({origin.get(item.partition('=')[0], source)}): {problem}") from None


def _flatten(tree: dict, keys: dict, source: str, prefix: str = "") -> dict:
    """``{"fit": {"lr": x}}`` → ``{"fit.lr": x}``, refusing unknown keys."""
    out = {}
    for k, v in tree.items():
        name = prefix + str(k)
        check_known(name, keys, source, sections_too=True)
        if isinstance(keys[name], Key):
            out[name] = v
        elif v is not None:
            if not isinstance(v, dict):
                raise ValueError(f"{source}: {name!r} must be a mapping of its keys, got {v!r}")
            out.update(_flatten(v, keys, source, name + "."))
    return out


def check_known(key: str, keys: dict, where: str, sections_too: bool = False):
    """Refuses ``key`` unless ``keys`` (a :func:`schema`) has it as a value (or, with
    ``sections_too``, as a section), naming the closest known keys."""
    if isinstance(keys.get(key), Key) or (sections_too and key in keys):
        return
    values = [k for k, v in keys.items() if isinstance(v, Key)]
    sections = sorted(k for k, v in keys.items() if not isinstance(v, Key))
    section = key.rpartition(".")[0] if key.rpartition(".")[0] in sections else key.partition(".")[0]
    members = ", ".join(k for k in values if k.startswith(section + "."))
    if key in sections:
        raise ValueError(f"{where}: {key!r} is a section; set its keys ({members})")
    close = difflib.get_close_matches(key, [*values, *sections] if "." not in key else values, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {members}" if section in sections
            else f"known: {', '.join(sorted({k.partition('.')[0] for k in keys}))}")
    raise ValueError(f"{where}: unknown key {key!r} ({hint})")


def _coerce(key: str, value, spec: Key, origin: str):
    """``value`` (a YAML value or an override's text) as ``spec`` says."""
    text = value.strip() if isinstance(value, str) else None
    if spec.nullable and (value is None or (text is not None and text.lower() in NULL)):
        return None
    if spec.is_path:
        if text:
            return os.path.expanduser(value)  # ~/data.jsonl as the shell would read it
    elif spec.kind is tuple:  # of ints: a YAML list, "[8, 16]" or "8,16"
        try:
            items = value if text is None else yaml.safe_load(text) if text.startswith("[") else \
                [v for v in text.split(",") if v.strip()]
        except yaml.YAMLError:
            items = None
        if isinstance(items, (list, tuple)):
            return tuple(_coerce(f"{key}[{i}]", v, Key(int), origin) for i, v in enumerate(items))
    else:
        read = value
        if text and spec.kind is bool and text.lower() in TRUE + FALSE:
            read = text.lower() in TRUE
        elif text and spec.kind in (int, float):
            try:
                read = spec.kind(text)  # "1e-4", "1_024"
            except ValueError:
                pass
        read, error = limits.problem(read, limits.Range(spec.kind))
        if error is None:
            return read
    raise ValueError(f"{key}={value!r} ({origin}): expected {spec.expected()}")
