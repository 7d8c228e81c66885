"""Malformed arguments to ``save_drafter`` / ``save_target``: each is refused with the right
exception type and a message naming the argument, key or path, before any tensor is
converted (the models here have shapes but no values, so converting one would fail
differently) and without touching the file system."""

from __future__ import annotations

import os
import re
import pathlib

import jax.numpy as jnp
import pytest
from flax import nnx

import eagle3_jax
from eagle3_jax.config import DrafterConfig, RopeConfig, TargetConfig
from eagle3_jax.models.drafter import Drafter
from eagle3_jax.models.target import Target


def _target(**overrides):
    cfg = TargetConfig.from_dict({**dict(model_type="llama", hidden_size=16, num_hidden_layers=8, intermediate_size=24,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64), **overrides})
    return nnx.eval_shape(lambda: Target(cfg))


def _drafter():
    cfg = DrafterConfig(vocab_size=64, draft_vocab_size=32, hidden_size=16, intermediate_size=24, num_heads=2,
                        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope=RopeConfig(), target_hidden_size=16)
    return nnx.eval_shape(lambda: Drafter(cfg, jnp.zeros((64, 16))))


def _dtype(dtype):
    return lambda t: eagle3_jax.save_drafter(_drafter(), t / "o", dtype=dtype)


class _Tokenizer:  # has no save_pretrained
    pass


def _file(tmp):
    (tmp / "f").write_text("x")
    return tmp / "f"


def _foreign(tmp, name, directory=False):
    (tmp / "out").mkdir()
    (tmp / "out" / "config.json").write_text("{}")
    (tmp / "out" / name).mkdir() if directory else (tmp / "out" / name).write_text("mine")
    return tmp / "out"


# (id, call(tmp) -> None, exception type, substrings the message must contain (formatted with tmp))
CASES = [
    ("drafter-none", lambda t: eagle3_jax.save_drafter(None, t / "o"), TypeError, ["drafter", "NoneType"]),
    ("drafter-is-target", lambda t: eagle3_jax.save_drafter(_target(), t / "o"), TypeError, ["drafter", "Target"]),
    ("drafter-dtype-int8", _dtype("int8"), ValueError, ["dtype='int8'"]),
    ("drafter-dtype-float64", _dtype("float64"), ValueError, ["dtype='float64'"]),
    ("drafter-dtype-jnp-int32", _dtype(jnp.int32), ValueError, ["dtype=", "int32"]),
    ("drafter-dtype-number", _dtype(123), TypeError, ["dtype=123"]),
    ("drafter-dtype-empty", _dtype(""), ValueError, ["dtype=''"]),
    ("path-none", lambda t: eagle3_jax.save_drafter(_drafter(), None), TypeError, ["path", "NoneType"]),
    ("path-int", lambda t: eagle3_jax.save_drafter(_drafter(), 42), TypeError, ["path", "int"]),
    ("path-bytes", lambda t: eagle3_jax.save_drafter(_drafter(), b"out"), TypeError, ["path", "bytes"]),
    ("path-empty", lambda t: eagle3_jax.save_drafter(_drafter(), ""), ValueError, ["path", "empty"]),
    ("path-root", lambda t: eagle3_jax.save_drafter(_drafter(), "/"), ValueError, ["path", "root"]),
    ("path-is-file", lambda t: eagle3_jax.save_drafter(_drafter(), _file(t)), NotADirectoryError, ["{t}/f", "not a directory"]),
    ("path-under-file", lambda t: eagle3_jax.save_drafter(_drafter(), _file(t) / "sub"), NotADirectoryError, ["{t}/f", "{t}/f/sub"]),
    ("path-holds-user-file", lambda t: eagle3_jax.save_drafter(_drafter(), _foreign(t, "README.md")), FileExistsError,
     ["{t}/out", "README.md"]),
    ("path-holds-subdir", lambda t: eagle3_jax.save_drafter(_drafter(), _foreign(t, "runs", directory=True)), FileExistsError,
     ["{t}/out", "runs"]),
    ("target-is-drafter", lambda t: eagle3_jax.save_target(_drafter(), t / "o"), TypeError, ["target", "Drafter"]),
    ("target-none", lambda t: eagle3_jax.save_target(None, t / "o"), TypeError, ["target", "NoneType"]),
    ("target-qwen2", lambda t: eagle3_jax.save_target(_target(model_type="qwen2"), t / "o"), ValueError, ["target", "qwen2"]),
    ("target-qwen3", lambda t: eagle3_jax.save_target(_target(model_type="qwen3"), t / "o"), ValueError, ["target", "qwen3"]),
    ("target-llama-biases", lambda t: eagle3_jax.save_target(_target(attention_bias=True), t / "o"), ValueError,
     ["target", "biases"]),
    ("target-dtype-int32", lambda t: eagle3_jax.save_target(_target(), t / "o", dtype="int32"), ValueError, ["dtype='int32'"]),
    ("tokenizer-object", lambda t: eagle3_jax.save_target(_target(), t / "o", tokenizer=_Tokenizer()), TypeError,
     ["tokenizer", "_Tokenizer"]),
    ("tokenizer-name", lambda t: eagle3_jax.save_target(_target(), t / "o", tokenizer="gpt2"), TypeError, ["tokenizer", "str"]),
    ("generation-config-list", lambda t: eagle3_jax.save_target(_target(), t / "o", generation_config=[1]), TypeError,
     ["generation_config", "list"]),
    ("generation-config-unserialisable", lambda t: eagle3_jax.save_target(_target(), t / "o", generation_config={"x": {1j}}),
     TypeError, ["generation_config", "JSON"]),
    ("target-path-is-file", lambda t: eagle3_jax.save_target(_target(), _file(t)), NotADirectoryError, ["{t}/f"]),
]


@pytest.mark.parametrize("call, error, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_saving_refuses_bad_input_clearly(tmp_path, call, error, needles):
    with pytest.raises(error) as info:
        call(tmp_path)
    assert type(info.value) is error
    for needle in needles:
        assert needle.format(t=tmp_path) in str(info.value)
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary directory either


def test_unwritable_parent_is_named_before_any_work(tmp_path, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: make access() answer as the mode bits say
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: not (pathlib.Path(p) == parent and mode & os.W_OK) and real(p, mode))
    try:
        with pytest.raises(PermissionError, match=re.escape(f"path {parent}/out: cannot create it in {parent} (not writable)")):
            eagle3_jax.save_drafter(_drafter(), parent / "out")
        with pytest.raises(PermissionError, match=re.escape(f"cannot create it in {parent} (not writable)")):
            eagle3_jax.save_target(_target(), parent / "a" / "b")  # the nearest existing ancestor is named
    finally:
        parent.chmod(0o755)
    assert list(parent.iterdir()) == []
