"""What every part of the checkpoint code shares: the weight dtypes a checkpoint may be
loaded or saved in, the check that a tensor read holds only finite values, and how a
``config.json`` tells a drafter from a target."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

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


def check_finite(arr, file: Path, name: str):
    """Refuses a floating-point tensor ``name`` read from ``file`` that holds NaN or infinity."""
    xp = np if isinstance(arr, np.ndarray) else jnp  # a numpy block is checked on the host
    if jnp.issubdtype(arr.dtype, jnp.inexact) and not bool(xp.isfinite(arr).all()):
        raise ValueError(f"{file}: tensor {name!r} holds NaN or infinite values")


def is_drafter_config(raw: dict) -> bool:
    """Whether the parsed ``config.json`` ``raw`` is an EAGLE-3 drafter's (else a target's)."""
    archs = raw.get("architectures") or []
    archs = archs if isinstance(archs, list) else []
    return ("draft_vocab_size" in raw or "speculators_model_type" in raw
            or any(isinstance(a, str) and "Eagle" in a for a in archs))

