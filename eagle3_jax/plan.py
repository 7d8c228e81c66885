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
import json
import math
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax import decode, kv_cache, sharding, topology
from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json
from eagle3_jax.models import drafter as drafter_mod, target as target_mod
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"95 GB"``, ``"17179869184"`` → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"device memory {text!r}: expected a size of at least one byte such as 16GiB, 95GB or a "
                         f"byte count")
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


def target_config_for(cfg, config_file: Path, target_config: str | Path | None = None) -> tuple[TargetConfig, str]:
    """The target's architecture and where it was read from (see the module docstring)."""
    if target_config is not None:
        file = Path(target_config)
        if file.is_dir():
            file = file / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"--target-config {target_config}: no such file (give the target's Hugging Face "
                                    f"config.json, or its checkpoint directory)")
    else:
        target = cfg.target
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


def drafter_config_for(cfg, tcfg: TargetConfig) -> DrafterConfig:
    """The drafter ``fit`` trains: ``drafter.init``'s config when that checkpoint is here,
    else the pipeline's fresh drafter (shaped after the target)."""
    init = cfg.drafter.init
    if init and (Path(init) / "config.json").is_file():
        return DrafterConfig.from_dict(read_config_json(init), source=str(Path(init) / "config.json"))
    return DrafterConfig.for_target(tcfg, cfg.draft_vocab_size, **cfg.drafter.options())


def cache_structs(num_layers: int, batch: int, length: int, num_kv_heads: int, head_dim: int, dtype, mesh,
                  rules=None, name: str = "KV cache") -> list[jax.ShapeDtypeStruct]:
    """Keys and values ``[L, B, S, K, D]`` sharded by ``CACHE_AXES`` (batch over data,
    KV heads over tensor, replicated when there are fewer KV heads than tensor devices)."""
    shape = (num_layers, batch, length, num_kv_heads, head_dim)
    s = jax.ShapeDtypeStruct(shape, dtype, sharding=kv_cache.layout(shape, mesh, rules, name=name))
    return [s, s]


def activation_bytes(tcfg: TargetConfig, dcfg: DrafterConfig, *, batch: int, seq_len: int, ttt_length: int,
                     compute_dtype, mesh, micro_batches: int = 1, loss_chunk: int = 256, remat: bool = True) -> int:
    """A rough per-device estimate of one training step's activations as the step runs them
    (online: the frozen target inside the step; see :func:`eagle3_jax.train.trainer.fit_step_fn`);
    ``plan --topology`` compiles the step instead.  With ``B`` the rows per batch shard, ``b =
    B / micro_batches`` those of one micro-batch, ``T`` the sequence, ``C`` the loss chunk,
    ``t`` the tensor axis size and ``e`` the compute dtype's bytes:

    * kept from the target's pass to the TTT pass, for the whole batch: the fused features and
      the final hidden ``B·T·(F + H)·e``;
    * the target's pass over one micro-batch (one layer live): the hidden and MLP
      ``b·T·(2H + 2I/t)·e``, the float32 attention scores ``b·Nq/t·T²·4`` and one chunk's
      float32 logits ``b·C·V/t·4``;
    * the TTT over one micro-batch: each step's hidden and keys/values, kept for the backward
      pass, ``ttt_length·b·T·(H + 2·Nk·D/t)·e`` a drafter layer; the step being run (recomputed
      in the backward pass with ``remat``, else every step's): its layer ``b·T·(5H + (Nq +
      2Nk)·D/t + 3I/t)·e``, float32 scores, probabilities and their gradient ``3·b·Nq/t·T·(T +
      ttt_length)·4`` and one chunk's float32 draft logits, labels and gradients ``4·b·C·Vd/t·4``.

    The total is the kept features plus the larger of the two passes.  Gathered weights and
    the optimizer's temporaries are not counted (the compiled step has them)."""
    shape = dict(mesh.shape)
    data = shape.get("data", 1) * shape.get("fsdp", 1)
    t = shape.get("tensor", 1)
    B = math.ceil(batch / data)
    b, T, C = math.ceil(B / micro_batches), seq_len, min(loss_chunk, seq_len)
    e = jnp.dtype(compute_dtype).itemsize
    H, I, V = tcfg.hidden_size, tcfg.intermediate_size, tcfg.vocab_size
    kept = B * T * (tcfg.feature_width + H) * e
    target = b * T * (2 * H + 2 * I / t) * e + b * tcfg.num_heads / t * T * T * 4 + b * C * V / t * 4
    D, Nq, Nk = dcfg.head_dim, dcfg.num_heads / t, dcfg.num_kv_heads / t
    saved = ttt_length * dcfg.num_layers * b * T * (dcfg.hidden_size + 2 * Nk * D) * e
    layer = b * T * (5 * dcfg.hidden_size + (Nq + 2 * Nk) * D + 3 * dcfg.intermediate_size / t) * e
    live = dcfg.num_layers * (layer + 3 * b * Nq * T * (T + ttt_length) * 4) + 4 * b * C * dcfg.draft_vocab_size / t * 4
    ttt = saved + live * (1 if remat else ttt_length)
    return int(kept + max(target, ttt))


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
    from eagle3_jax.train import pipeline

    cfg = pipeline.load_config(config_file, overrides)
    axes = dict.fromkeys(sharding.MESH_AXES, 1)
    axes.update(mesh if mesh is not None else cfg.mesh.sizes())
    unsized = [a for a, v in axes.items() if v == -1]
    if unsized:
        raise ValueError(f"mesh {axes}: the config's {', '.join(unsized)}=-1 means 'all devices', which a plan without "
                         f"devices cannot count; give --mesh with every size (e.g. --mesh data=2,fsdp=4), or "
                         f"--topology to compile for a slice")
    amesh = sharding.abstract_mesh(**axes)
    tcfg, source = target_config_for(cfg, Path(config_file), target_config)
    dcfg = drafter_config_for(cfg, tcfg)
    fit = cfg.fit
    dtype = jnp.dtype(cfg.dtype)
    batch = cfg.regenerate.batch_size if batch is None else batch
    seq_len = cfg.seq_len if seq_len is None else seq_len
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
            dcfg.num_layers, batch, seq_len, dcfg.num_kv_heads, dcfg.head_dim, dtype, amesh, name="drafter KV cache")),
        "optimizer state (AdamW m and v)": 2 * shard_bytes(trainable),
        "gradients": shard_bytes(trainable),
        f"activations, fit step ({fit.batch_size} x {cfg.seq_len}, estimate)": activation_bytes(
            tcfg, dcfg, batch=fit.batch_size, seq_len=cfg.seq_len, ttt_length=fit.ttt_length,
            compute_dtype=fit.compute_dtype, mesh=amesh, micro_batches=fit.micro_batches, loss_chunk=fit.loss_chunk,
            remat=fit.remat),
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


# ---------------------------------------------------------------------------- compiled plans
DEFAULT_TAU = 3.0  # committed tokens per round assumed where no acceptance is recorded (--tau)


def _tiers(tcfg):
    """The decode loops ``plan --topology`` compiles: (name, speculation or None).  The adaptive
    loop holds every tier's rounds (a chain's and a tree's loops alone are parts of it), so
    its memory bounds theirs."""
    chain, tree = TreeConfig.chain(4), TreeConfig()
    return [("vanilla", None), ("adaptive (none, chain 4, tree 60,7,10)", Speculation((None, chain, tree)))]


def recorded_tau(cfg) -> float | None:
    """The drafter's recorded acceptance: ``1 + sim_accept_len`` of the run's ``best.json``
    (tokens committed per round of a chain as long as its TTT), where the run is here."""
    best = Path(cfg.work_dir or ".") / "best.json"
    try:
        return 1.0 + float(json.loads(best.read_text())["sim_accept_len"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# the layer counts the step, round and fit-step costs are compiled at and extrapolated from
# (:func:`eagle3_jax.topology.per_layer`): three, as two let one compile's fusion choices set the
# slope (the 70B's vanilla step on v5p:2x4x4 read 0.82 GB at 3 layers, 0.72 GB at 4, 0.96 at 5)
COST_LAYERS = (3, 4, 5)


def layer_weight_bytes(tcfg: TargetConfig, dtype, mesh) -> float:
    """Bytes of one decoder layer's weights a device holds on ``mesh`` (by the target's
    declaration): what a step or round reads at least per layer."""
    decl = target_mod.declare(tcfg)
    stacked = {n: s for n, s in decl.abstract(dtype, mesh).items() if decl.params[n].stacked}
    return shard_bytes(stacked) / tcfg.num_layers


def _topology_mesh(topology_name: str, devices: list, mesh: dict):
    """The config's (or ``--mesh``'s) axes over the topology's devices; ``-1`` takes the rest."""
    axes = dict.fromkeys(sharding.MESH_AXES, 1)
    axes.update(mesh)
    fixed = math.prod(v for v in axes.values() if v != -1)
    free = [a for a, v in axes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"mesh {axes}: at most one axis may be -1 (the rest of the devices)")
    if free:
        if len(devices) % fixed:
            raise ValueError(f"mesh {axes}: {len(devices)} devices of {topology_name} do not divide by {fixed}")
        axes[free[0]] = len(devices) // fixed
    if math.prod(axes.values()) != len(devices):
        raise ValueError(f"mesh {axes} has {math.prod(axes.values())} devices; {topology_name} has {len(devices)}: "
                         f"give --mesh with a product of {len(devices)}")
    return sharding.make_mesh(**axes, devices=devices), axes


def plan_topology(config_file, topology_name: str, *, mesh: dict | None = None, tau: float | None = None,
                  prompt_len: int | None = None, attention_impl: str = "xla", target_config=None, overrides=(),
                  programs: tuple[str, ...] = ("decode", "slots", "fit"), progress=None) -> dict:
    """Compiles ``config_file``'s programs for TPU topology ``topology_name`` (see
    :mod:`eagle3_jax.topology`) on this host and reports, per program and device, compiled
    memory against the chip's HBM and its flops, bytes and roofline time, and the predicted
    milliseconds per vanilla step and per round of each tier with the speedup at ``tau``.

    Programs: ``decode`` — ``generate``'s loop (vanilla, and the adaptive policy over no
    drafting, chain 4 and the default tree) at ``regenerate.batch_size`` prompts of ``prompt_len`` tokens (default
    ``seq_len // 2``) and ``regenerate.max_new_tokens``, and its prefill; ``slots`` — the
    server's dispatch over that many slots; ``fit`` — the training step at ``fit.batch_size``
    x ``seq_len``.  A loop's cost analysis counts its body once, so the step and round costs
    come from the loop's parts (:func:`eagle3_jax.decode.lower_parts`) compiled with
    :data:`COST_LAYERS` unrolled layers, extrapolated to the target's
    (:func:`eagle3_jax.topology.per_layer`, never below one read of a layer's weights),
    and the fit step's from one micro-batch so compiled, times ``fit.micro_batches``.
    ``progress(name)`` is called before each compile.  Returns a JSON-ready dict."""
    from eagle3_jax.train import pipeline

    chip = topology.chip(topology_name)
    cfg = pipeline.load_config(config_file, overrides)
    devices = topology.devices(topology_name)
    tmesh, axes = _topology_mesh(topology_name, devices, mesh if mesh is not None else cfg.mesh.sizes())
    tcfg, source = target_config_for(cfg, Path(config_file), target_config)
    dcfg = drafter_config_for(cfg, tcfg)
    dtype = jnp.dtype(cfg.dtype)
    fit = cfg.fit
    batch, max_new = cfg.regenerate.batch_size, cfg.regenerate.max_new_tokens
    seq_len = cfg.seq_len
    prompt_len = max(1, seq_len // 2) if prompt_len is None else prompt_len
    tau_source = "--tau"
    if tau is None:
        tau, tau_source = recorded_tau(cfg), "the run's best.json"
    if tau is None:
        tau, tau_source = DEFAULT_TAU, "assumed (no recorded acceptance here; give --tau)"
    note = progress or (lambda name: None)
    compiled: list = []

    def models(tc, *, unroll=False, attention=attention_impl):
        target = nnx.eval_shape(lambda: target_mod.Target(tc, dtype=dtype, attention_impl=attention,
                                                          unroll_layers=unroll))
        drafter = nnx.eval_shape(lambda: drafter_mod.Drafter(
            dcfg, jnp.zeros((tc.vocab_size, tc.hidden_size), dtype), dtype=dtype))
        return target, drafter

    def build(name, lower):
        note(name)
        start = time.perf_counter()
        try:
            lowered, seconds = topology.timed_lower(lower)
            return topology.compile_program(name, lowered, seconds_before=seconds)
        except Exception as e:  # noqa: BLE001 - one program's failure is reported; the others still compile
            message = " ".join(str(e).split())[:300]
            return topology.Program(name, time.perf_counter() - start, 0, 0, 0, 0, 0, 0.0, 0.0, None,
                                    refused=f"failed: {type(e).__name__}: {message}")

    gen = dict(batch=batch, prompt_len=prompt_len, max_new_tokens=max_new, mesh=tmesh)
    target, drafter = models(tcfg)
    layer_bytes = layer_weight_bytes(tcfg, dtype, tmesh)
    costs = {}
    if "decode" in programs:
        for name, spec in _tiers(tcfg):
            compiled.append(build(f"decode loop: {name}", lambda: decode.lower_generate(
                target, drafter if spec else None, speculation=spec, **gen)))
        adaptive = _tiers(tcfg)[-1][1]
        prefill, _ = decode.lower_parts(target, drafter, speculation=adaptive, **gen)
        note("prefill")
        compiled.append(topology.compile_program(f"prefill ({batch} x {prompt_len})", prefill))
        # the step and round costs: the parts with COST_LAYERS layers unrolled
        parts = {}
        for layers_ in COST_LAYERS:
            small = dataclasses.replace(tcfg, num_layers=layers_, capture_layers=(0, 1, 2))
            t_small, d_small = models(small, unroll=True)
            pre, lower_round = decode.lower_parts(t_small, d_small, speculation=adaptive, **gen)
            note(f"step and round costs ({layers_} layers)")
            pre_cost, pre_c = topology.compile_with_report("prefill", pre)
            parts[layers_] = {"prefill": pre_cost}
            for label, tier in (("vanilla step", None), ("chain 4 round", 1), ("tree 60,7,10 round", 2)):
                parts[layers_][label] = topology.compile_program(label, lower_round(tier, pre_c.out_info))
        for label in parts[COST_LAYERS[0]]:
            costs[label] = topology.per_layer({n: parts[n][label] for n in COST_LAYERS}, tcfg.num_layers, label,
                                              layer_bytes=layer_bytes)
    if "slots" in programs:
        adaptive = _tiers(tcfg)[-1][1]
        compiled.append(build(f"server dispatch ({batch} slots)", lambda: decode.lower_slots(
            target, drafter, num_slots=batch, max_len=prompt_len + max_new + adaptive.scratch, mesh=tmesh,
            speculation=adaptive)))
    if "fit" in programs:
        def fit_lowered(tc, fit_cfg, rows, *, unroll=False):
            t, d = models(tc, unroll=unroll, attention="xla")  # the target runs whole sequences, uncached
            return lower_fit_step(t, d, fit_cfg, tmesh, rows=rows, seq_len=seq_len)

        compiled.append(build(f"fit step ({fit.batch_size} x {seq_len}, TTT {fit.ttt_length}, "
                              f"{fit.micro_batches} micro-batches)", lambda: fit_lowered(tcfg, fit, fit.batch_size)))
        micro = fit.batch_size // fit.micro_batches
        one = dataclasses.replace(fit, batch_size=micro, micro_batches=1)
        small = [build(f"fit step costs ({n} layers)", lambda n=n: fit_lowered(
            dataclasses.replace(tcfg, num_layers=n, capture_layers=(0, 1, 2)), one, micro, unroll=True))
                 for n in COST_LAYERS]
        per_micro = topology.per_layer(dict(zip(COST_LAYERS, small)), tcfg.num_layers, "fit step",
                                       layer_bytes=layer_bytes)
        costs["fit step"] = dataclasses.replace(per_micro, flops=per_micro.flops * fit.micro_batches,
                                                bytes_accessed=per_micro.bytes_accessed * fit.micro_batches,
                                                xla_seconds=None)
    return _topology_report(config_file, topology_name, chip, axes, source, compiled, costs, tau, tau_source,
                            batch=batch, prompt_len=prompt_len, max_new=max_new, attention_impl=attention_impl)


def lower_fit_step(target, drafter, fit_cfg, mesh, *, rows: int, seq_len: int) -> jax.stages.Lowered:
    """The training fit step (:func:`eagle3_jax.train.trainer.fit_step_fn`) lowered on abstract
    inputs placed as the trainer places them on ``mesh``: the target's weights by its
    declaration, the drafter's params, frozen arrays and AdamW moments by the drafter's,
    ``rows x seq_len`` token ids and loss mask split by rows.  ``target`` / ``drafter``:
    abstract modules (``nnx.eval_shape``)."""
    from eagle3_jax.train.trainer import fit_step_fn, opt_state_shardings, optimizer

    tgraph, tstate = nnx.split(target)
    tstate = sharding.place(tstate, target.declaration(), mesh)
    dgraph, params, frozen = nnx.split(drafter, nnx.Param, ...)
    params = sharding.place(params, drafter.declaration(), mesh)
    frozen = sharding.place(frozen, drafter.declaration(), mesh)
    opt = optimizer(fit_cfg)
    opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             jax.eval_shape(opt.init, params), opt_state_shardings(opt, params, mesh))
    batch_sh = sharding.batch_sharding(mesh, 2)
    ids = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=batch_sh)
    mask = jax.ShapeDtypeStruct((rows, seq_len), jnp.bool_, sharding=batch_sh)
    step = fit_step_fn(tgraph, dgraph, fit_cfg, opt, jax.tree.map(lambda x: x.sharding, params))
    return jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, frozen, tstate, ids, mask)


def _topology_report(config_file, topology_name, chip, axes, source, compiled, costs, tau, tau_source, **shape) -> dict:
    """``plan_topology``'s JSON-ready report."""
    def ms(p):
        return 1e3 * p.roofline_s(chip)

    programs = [{"program": p.name, "compile_s": round(p.compile_s, 1), "arguments": p.arguments,
                 "outputs": p.outputs, "aliases": p.aliases, "temporaries": p.temporaries, "code": p.code,
                 "total": p.total, "hbm_fraction": p.total / chip.hbm_bytes,
                 "fits": p.refused is None and p.total <= chip.hbm_bytes, "margin": chip.hbm_bytes - p.total,
                 "refused": p.refused} for p in compiled]
    cost_rows = [{"program": name, "compile_s": round(p.compile_s, 1), "flops": p.flops, "bytes_accessed": p.bytes_accessed,
                  "roofline_ms": ms(p), "bound": "compute" if p.flops / chip.bf16_flops_per_s
                  >= p.bytes_accessed / chip.hbm_bytes_per_s else "memory", "note": p.note} for name, p in costs.items()]
    predicted = {}
    if "vanilla step" in costs:
        step = ms(costs["vanilla step"])
        predicted["vanilla_step_ms"] = step
        for label, most in (("chain 4 round", 5), ("tree 60,7,10 round", 9)):
            t = min(tau, most)  # a round commits at most its path
            predicted[label] = {"round_ms": ms(costs[label]), "tau": t, "speedup": t * step / ms(costs[label])}
        best = max((v for k, v in predicted.items() if k.endswith("round")), key=lambda v: v["speedup"])
        predicted["adaptive"] = {"speedup": max(1.0, best["speedup"]),
                                 "note": "the best of its tiers (no drafting: 1.0x) at this tau"}
    return {"config": str(config_file), "topology": topology_name, "mesh": axes,
            "chip": dataclasses.asdict(chip), "target_source": source, "shape": shape,
            "tau": tau, "tau_source": tau_source, "programs": programs, "costs": cost_rows, "predicted": predicted}


def format_topology_report(r: dict) -> str:
    """``plan --topology``'s printed tables."""
    c = r["chip"]
    mesh = ", ".join(f"{a}={s}" for a, s in r["mesh"].items())
    sh = r["shape"]
    gib = lambda n: f"{n / 2 ** 30:.2f}"  # noqa: E731
    lines = [f"plan for {r['config']} compiled for {r['topology']} ({math.prod(r['mesh'].values())} x {c['device_kind']}: "
             f"{gib(c['hbm_bytes'])} GiB HBM, {c['hbm_bytes_per_s'] / 1e9:.0f} GB/s, "
             f"{c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s bf16; {c['source']}) on mesh {mesh}",
             f"target from {r['target_source']}; decode: {sh['batch']} prompts of {sh['prompt_len']} tokens + "
             f"{sh['max_new']} new, attention {sh['attention_impl']}",
             "",
             "compiled memory per device (GiB)",
             f"  {'program':<52}{'compile':>9}{'args':>8}{'out':>8}{'alias':>8}{'temp':>8}{'code':>7}{'total':>8}{'HBM':>7}  verdict"]
    for p in r["programs"]:
        lines.append(f"  {p['program']:<52}{p['compile_s']:>8.1f}s{gib(p['arguments']):>8}{gib(p['outputs']):>8}"
                     f"{gib(p['aliases']):>8}{gib(p['temporaries']):>8}{gib(p['code']):>7}{gib(p['total']):>8}"
                     f"{100 * p['hbm_fraction']:>6.0f}%  "
                     f"{'fits' if p['fits'] else 'FAILED' if (p['refused'] or '').startswith('failed') else 'does NOT fit'}"
                     + (f" (the compiler: {p['refused']})" if p["refused"] else
                        f" ({'margin' if p['fits'] else 'over by'} {gib(abs(p['margin']))} GiB)"))
    if r["costs"]:
        lines += ["", f"cost per device (compiled: {', '.join(map(str, COST_LAYERS))} unrolled layers, extrapolated)",
                  f"  {'program':<28}{'compile':>9}{'GFLOP':>11}{'GB':>9}{'roofline':>12}  bound"]
        for p in r["costs"]:
            lines.append(f"  {p['program']:<28}{p['compile_s']:>8.1f}s{p['flops'] / 1e9:>11.1f}"
                         f"{p['bytes_accessed'] / 1e9:>9.2f}{p['roofline_ms']:>10.2f}ms  {p['bound']}")
        lines += [f"  note, {p['program']}: {p['note']}" for p in r["costs"] if p.get("note")]
        if sh["attention_impl"] == "pallas":
            lines.append("  steps and rounds read each layer's whole cache (the kernel's cost estimate: an upper "
                         "bound; it skips the blocks past a prefix)")
    pr = r["predicted"]
    if pr:
        lines += ["", f"predicted at tau = {r['tau']:.2f} ({r['tau_source']}): vanilla {pr['vanilla_step_ms']:.2f} ms/step"]
        for k, v in pr.items():
            if k.endswith("round"):
                lines.append(f"  {k}: {v['round_ms']:.2f} ms/round, {v['tau']:.2f} tokens/round -> {v['speedup']:.2f}x")
        lines.append(f"  adaptive: {pr['adaptive']['speedup']:.2f}x ({pr['adaptive']['note']})")
    return "\n".join(lines)
