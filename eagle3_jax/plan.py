"""``eagle3-jax plan``: a dry run of a training config on a mesh, without devices.

From the target's architecture, the pipeline's drafter (``jax.eval_shape`` of the models,
nothing allocated) and the shardings the declarations give on an ``AbstractMesh``, the plan
counts what one device holds: the target's weights, the KV caches for a batch and length,
the drafter's weights, the AdamW state and gradients, and an estimate of a training step's
activations; it says whether decoding (weights + caches) and training (weights + drafter +
optimizer + gradients + activations) fit a given device memory.

The config names its target by directory (``target:``); where that directory (or its
``config.json``) is not on this machine, the plan reads ``targets/<directory name>.json``
beside the YAML file (``configs/targets/`` ships the Hugging Face configs of the targets the
shipped configs name), or the file given by ``--target-config``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp

from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"95 GB"``, ``"17179869184"`` → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"device memory {text!r}: expected a positive size such as 16GiB, 95GB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


def show_bytes(n: float) -> str:
    return f"{n / 2 ** 30:,.2f} GiB"


def shard_bytes(structs) -> int:
    """Bytes one device holds of ``structs`` (``ShapeDtypeStruct`` leaves with shardings;
    the most any device holds, which for these even shardings is every device's share)."""
    total = 0
    for s in jax.tree.leaves(structs):
        shape = s.sharding.shard_shape(s.shape) if s.sharding is not None else s.shape
        total += math.prod(shape) * jnp.dtype(s.dtype).itemsize
    return total


def target_config_for(cfg: dict, config_file: Path, target_config: str | Path | None = None) -> tuple[TargetConfig, str]:
    """The target's architecture and where it was read from (see the module docstring)."""
    if target_config is not None:
        file = Path(target_config)
    else:
        target = cfg.get("target")
        if not target:
            raise ValueError(f"{config_file}: 'target' is not set; give --target-config CONFIG_JSON")
        file = Path(target) / "config.json"
        if not file.is_file():
            known = Path(config_file).parent / "targets" / f"{Path(target).name}.json"
            if not known.is_file():
                raise FileNotFoundError(f"{config_file}: target {target}: no {file} here and no {known}; give "
                                        f"--target-config CONFIG_JSON (the target's Hugging Face config.json)")
            file = known
    return TargetConfig.from_dict(read_config_json(file), source=str(file)), str(file)


def drafter_config_for(cfg: dict, tcfg: TargetConfig) -> DrafterConfig:
    """The drafter ``fit`` trains: ``drafter.init``'s config when that checkpoint is here,
    else the pipeline's fresh drafter (shaped after the target)."""
    init = (cfg.get("drafter") or {}).get("init")
    if init and (Path(init) / "config.json").is_file():
        return DrafterConfig.from_dict(read_config_json(init), source=str(Path(init) / "config.json"))
    return DrafterConfig(vocab_size=tcfg.vocab_size, draft_vocab_size=cfg["draft_vocab_size"],
                         hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                         num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim,
                         rms_norm_eps=tcfg.rms_norm_eps, rope=tcfg.rope, target_hidden_size=tcfg.hidden_size,
                         capture_layers=tcfg.capture_layers, max_position_embeddings=tcfg.max_position_embeddings)


def cache_structs(num_layers: int, batch: int, length: int, num_kv_heads: int, head_dim: int, dtype, mesh,
                  rules=None, name: str = "KV cache") -> list[jax.ShapeDtypeStruct]:
    """Keys and values ``[L, B, S, K, D]`` sharded by ``CACHE_AXES`` (batch over data,
    KV heads over tensor, replicated when there are fewer KV heads than tensor devices)."""
    from eagle3_jax import kv_cache

    shape = (num_layers, batch, length, num_kv_heads, head_dim)
    s = jax.ShapeDtypeStruct(shape, dtype, sharding=kv_cache.layout(shape, mesh, rules, name=name))
    return [s, s]


def activation_bytes(tcfg: TargetConfig, dcfg: DrafterConfig, *, batch: int, seq_len: int, ttt_length: int,
                     compute_dtype, mesh) -> int:
    """A rough per-device estimate of one training step's activations (online: the frozen
    target runs inside the step).  With ``b`` the batch per data shard, ``t`` the tensor
    axis size and ``e`` the compute dtype's bytes, per token:

    * target forward (no gradients; one layer live at a time): float32 logits ``4·V/t``,
      fused features ``3H·e``, one layer's hidden and MLP ``(2H + 2I/t)·e``;
    * TTT, kept for the backward pass for each of the ``ttt_length`` steps: the layer input
      and residuals ``5H·e``, q/k/v ``(Nq + 2Nk)·D/t·e``, the MLP ``3I/t·e``, and float32
      draft logits and their targets ``2·4·Vd/t``.
    """
    shape = dict(mesh.shape)
    data = shape.get("data", 1) * shape.get("fsdp", 1)
    t = shape.get("tensor", 1)
    b = math.ceil(batch / data)
    e = jnp.dtype(compute_dtype).itemsize
    H, I, V = tcfg.hidden_size, tcfg.intermediate_size, tcfg.vocab_size
    target = 4 * V / t + 3 * H * e + (2 * H + 2 * I / t) * e
    D = dcfg.head_dim
    step = (5 * dcfg.hidden_size + (dcfg.num_heads + 2 * dcfg.num_kv_heads) * D / t + 3 * dcfg.intermediate_size / t) * e \
        + 2 * 4 * dcfg.draft_vocab_size / t
    return int(b * seq_len * (target + ttt_length * step))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of a config on a mesh (see :func:`plan`)."""

    mesh: dict
    target_source: str
    target_params: int
    drafter_params: int  # trainable
    batch: int
    seq_len: int
    fit_batch: int
    bytes: dict  # row label -> per-device bytes
    decode_total: int
    fit_total: int
    device_memory: int | None

    def fits(self) -> dict[str, bool] | None:
        if self.device_memory is None:
            return None
        return {"decode": self.decode_total <= self.device_memory, "fit": self.fit_total <= self.device_memory}


def plan(config_file, *, mesh: dict | None = None, batch: int | None = None, seq_len: int | None = None,
         device_memory: int | None = None, target_config=None, overrides=()) -> Plan:
    """Plans ``config_file`` (a training YAML, read by ``eagle3_jax.train.pipeline.load_config``)
    on ``mesh`` (``{"data": 2, "tensor": 4}``; default: the config's, which must then give
    every size) without devices.  ``batch`` / ``seq_len`` size the KV caches (default: the
    config's ``regenerate.batch_size`` and ``seq_len``)."""
    from flax import nnx

    from eagle3_jax import sharding
    from eagle3_jax.models import drafter as drafter_mod, target as target_mod
    from eagle3_jax.train import pipeline
    from eagle3_jax.train.trainer import FitConfig

    cfg = pipeline.load_config(config_file, overrides)
    axes = dict.fromkeys(sharding.MESH_AXES, 1)
    axes.update(mesh if mesh is not None else cfg["mesh"])
    if any(v == -1 for v in axes.values()):
        raise ValueError(f"mesh {axes}: a plan needs every axis size (data=-1 means 'all devices'); give --mesh, "
                         f"e.g. --mesh data=2,tensor=4")
    amesh = sharding.abstract_mesh(**axes)
    tcfg, source = target_config_for(cfg, Path(config_file), target_config)
    dcfg = drafter_config_for(cfg, tcfg)
    fit = FitConfig(**cfg["fit"])
    dtype = jnp.dtype(cfg["dtype"])
    batch = cfg["regenerate"]["batch_size"] if batch is None else batch
    seq_len = cfg["seq_len"] if seq_len is None else seq_len
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")

    # the models as the pipeline builds them, abstract (jax.eval_shape: nothing allocated), on
    # the shardings their declarations give on the mesh
    tdecl, ddecl = target_mod.declare(tcfg), drafter_mod.declare(dcfg)
    target = nnx.eval_shape(lambda: target_mod.Target(tcfg, dtype=dtype))
    drafter = nnx.eval_shape(lambda: drafter_mod.Drafter(dcfg, jnp.zeros((dcfg.vocab_size, dcfg.hidden_size)), dtype=dtype))

    def structs(model, decl):
        shardings = decl.shardings(amesh)
        return {n: jax.ShapeDtypeStruct(getattr(model, n).shape, getattr(model, n).dtype, sharding=shardings[n])
                for n, _ in decl.present()}

    tw, dw = structs(target, tdecl), structs(drafter, ddecl)
    trainable = {n: s for n, s in dw.items() if not ddecl.params[n].frozen}

    rows = {
        "target weights": shard_bytes(tw),
        f"target KV cache ({batch} x {seq_len})": shard_bytes(cache_structs(
            tcfg.num_layers, batch, seq_len, tcfg.num_kv_heads, tcfg.head_dim, dtype, amesh, name="target KV cache")),
        "drafter weights (embedding shared with the target)": shard_bytes(trainable),
        f"drafter KV cache ({batch} x {seq_len})": shard_bytes(cache_structs(
            1, batch, seq_len, dcfg.num_kv_heads, dcfg.head_dim, dtype, amesh, name="drafter KV cache")),
        "optimizer state (AdamW m and v)": 2 * shard_bytes(trainable),
        "gradients": shard_bytes(trainable),
        f"activations, fit step ({fit.batch_size} x {cfg['seq_len']}, estimate)": activation_bytes(
            tcfg, dcfg, batch=fit.batch_size, seq_len=cfg["seq_len"], ttt_length=fit.ttt_length,
            compute_dtype=fit.compute_dtype, mesh=amesh),
    }
    v = list(rows.values())
    return Plan(mesh=axes, target_source=source, target_params=tdecl.count(),
                drafter_params=ddecl.count(frozen=False), batch=batch, seq_len=seq_len, fit_batch=fit.batch_size,
                bytes=rows, decode_total=v[0] + v[1] + v[2] + v[3], fit_total=v[0] + v[2] + v[4] + v[5] + v[6],
                device_memory=device_memory)


def format_plan(p: Plan, config_file) -> str:
    """The plan as the ``plan`` command prints it."""
    devices = math.prod(p.mesh.values())
    mesh = ", ".join(f"{a}={s}" for a, s in p.mesh.items())
    lines = [f"plan for {config_file} on mesh {mesh} ({devices} devices)",
             f"target: {p.target_params / 1e9:.2f} B parameters ({p.target_params:,}), architecture from {p.target_source}",
             f"drafter: {p.drafter_params / 1e9:.2f} B trainable parameters ({p.drafter_params:,})",
             "per device:"]
    rows = {**p.bytes, "decode total (weights + KV caches)": p.decode_total,
            "fit total (weights + drafter + optimizer + gradients + activations)": p.fit_total}
    width = max(map(len, rows)) + 2
    lines += [f"  {label:<{width}}{show_bytes(n):>14}" for label, n in rows.items()]
    fits = p.fits()
    if fits is not None:
        for phase, total in (("decode", p.decode_total), ("fit", p.fit_total)):
            verdict = "fits" if fits[phase] else "does NOT fit"
            lines.append(f"{phase}: {verdict} in {show_bytes(p.device_memory)} per device "
                         f"({100 * total / p.device_memory:.0f}%)")
    return "\n".join(lines)
