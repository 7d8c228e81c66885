"""Compiling for TPU topologies on a host without TPUs: devices, chips and compiled reports.

libtpu (the ``tpu`` extra: ``pip install -e ".[tpu]"``, ``jax[tpu]`` at this jax's version)
compiles for a TPU slice that is not there: ``get_topology_desc("v5e:2x4")`` gives its
devices, a ``Mesh`` over them places ``ShapeDtypeStruct`` s, and ``jax.jit(f).lower(...)
.compile()`` gives the program each device would run, its ``memory_analysis()`` (bytes per
device) and ``cost_analysis()`` (flops and bytes accessed).  :func:`compile_program` turns one
into a :class:`Program` report, judged against :data:`CHIPS`.

XLA's cost analysis counts a loop's body once, whatever its trip count; :func:`per_layer`
therefore reads a layer-stacked program's cost off compiles of the model with 3, 4 and 5
layers unrolled, and :mod:`eagle3_jax.plan` composes a round from such straight-line programs.

libtpu, loaded on a host without TPUs, prints initialisation warnings when JAX starts its
backends; :func:`keep_cpu_default` (called by the CLI and the tests before JAX starts them)
keeps JAX's default backend the CPU there and quiet, and :func:`devices` hides what libtpu
prints while it describes a topology, unless that fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import os
import re
import sys
import tempfile
import time

import jax

INSTALL = 'pip install -e ".[tpu]"  (or: pip install "jax[tpu]==' + jax.__version__ + '")'


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip (one JAX device) as its vendor lists it."""

    name: str
    device_kind: str  # what ``device.device_kind`` says
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    source: str


GIB = 2 ** 30

# Google Cloud's system-architecture pages, per chip (read 2026-12): HBM capacity, HBM
# bandwidth and peak bf16 compute.
CHIPS = {
    "v4": Chip("v4", "TPU v4", 32 * GIB, 1200e9, 275e12, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GIB, 819e9, 197e12, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", "TPU v5", 95 * GIB, 2765e9, 459e12, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GIB, 1640e9, 918e12, "https://cloud.google.com/tpu/docs/v6e"),
}


def have_libtpu() -> bool:
    """Whether libtpu (the ``tpu`` extra) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def _has_tpu_hardware() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _has_gpu_plugin() -> bool:
    return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") or importlib.util.find_spec(f"jax_rocm{v}_plugin")
               for v in (12, 13, 7))


def keep_cpu_default():
    """Where libtpu is installed on a host with no TPU (and no GPU plugin), makes JAX start the
    CPU backend alone (``JAX_PLATFORMS=cpu``), so that libtpu neither prints its warnings nor
    becomes anyone's default; topologies still compile (:func:`devices`).  Does nothing where
    ``JAX_PLATFORMS`` is set or a TPU or a GPU plugin is present (nor once JAX has started
    its backends: call it first)."""
    if "JAX_PLATFORMS" in os.environ or not have_libtpu() or _has_tpu_hardware() or _has_gpu_plugin():
        return
    jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def _stderr_kept(label: str):
    """Runs the body with the process's stderr (file descriptor 2: libtpu's C++ logging)
    captured, and shows what it caught only if the body raises."""
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            caught.seek(0)
            text = caught.read().decode(errors="replace").strip()
            if text:
                print(f"{label}: libtpu said:\n{text}", file=sys.stderr)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def chip(topology: str) -> Chip:
    """The chip of a topology name (``"v5e:2x4"`` → v5e)."""
    kind = str(topology).split(":", 1)[0].lower()
    if kind not in CHIPS:
        raise ValueError(f"--topology {topology!r}: unknown chip {kind!r}; expected one of {', '.join(CHIPS)} "
                         f"(e.g. v5e:2x4, v5p:2x2x2, v6e:2x4)")
    return CHIPS[kind]


def devices(topology: str) -> list:
    """The devices of TPU topology ``topology`` (a name ``get_topology_desc`` takes: ``v5e:2x4``,
    ``v5p:2x2x2``, ``v6e:4x8``), compile-only on a host without TPUs.  Several processes may
    compile at once (libtpu otherwise locks itself to one process per host)."""
    chip(topology)
    if not have_libtpu():
        raise ValueError(f"--topology {topology}: compiling for TPUs needs libtpu, the 'tpu' extra: {INSTALL}")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        with _stderr_kept(f"--topology {topology}"):
            return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # libtpu's refusals (a shape it does not know) are RuntimeErrors / XlaRuntimeErrors
        raise ValueError(f"--topology {topology!r}: libtpu refused it ({str(e).strip().splitlines()[0]}); "
                         f"names look like v5e:2x2, v5e:2x4, v5p:2x2x2, v6e:2x4") from None


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's figures, per device (bytes; seconds)."""

    name: str
    compile_s: float
    arguments: int
    outputs: int
    aliases: int
    temporaries: int
    code: int
    flops: float
    bytes_accessed: float
    xla_seconds: float | None  # XLA's own estimate (``optimal_seconds``), where its cost model gives one
    refused: str | None = None  # the compiler's out-of-memory refusal (then only ``temporaries`` is known)
    note: str | None = None  # how an extrapolated cost was read (see :func:`per_layer`)

    @property
    def total(self) -> int:
        """What the device holds while the program runs: arguments, outputs not aliased to
        an argument (donated buffers), temporaries and code."""
        return self.arguments + self.outputs - self.aliases + self.temporaries + self.code

    def roofline_s(self, c: Chip) -> float:
        """The larger of flops / peak and bytes / bandwidth."""
        return max(self.flops / c.bf16_flops_per_s, self.bytes_accessed / c.hbm_bytes_per_s)


_OUT_OF_HBM = re.compile(r"memory required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \([\d.]+[KMGT]?\)")
_SIZE = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def compile_program(name: str, lowered: jax.stages.Lowered, *, seconds_before: float = 0.0) -> Program:
    """Compiles ``lowered`` and reads its memory and cost analyses (``seconds_before``: time
    already spent tracing and lowering, counted as compile time)."""
    return compile_with_report(name, lowered, seconds_before=seconds_before)[0]


def compile_with_report(name: str, lowered: jax.stages.Lowered, *,
                        seconds_before: float = 0.0) -> tuple[Program, jax.stages.Compiled]:
    """:func:`compile_program`, and the compiled program itself (``None`` where the compiler
    refused it for want of HBM: the report says how much its temporaries need)."""
    start = time.perf_counter()
    try:
        with _stderr_kept(name):
            compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that cannot fit HBM
        found = _OUT_OF_HBM.search(str(e))
        if not found:
            raise
        temporaries = int(float(found.group(1)) * _SIZE[found.group(2)])
        return Program(name, seconds_before + time.perf_counter() - start, 0, 0, 0, temporaries, 0, 0.0, 0.0, None,
                       refused=found.group(0)), None
    seconds = seconds_before + time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    xla_seconds = cost.get("optimal_seconds")
    return Program(name, seconds, mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
                   mem.temp_size_in_bytes, mem.generated_code_size_in_bytes, float(cost.get("flops", 0.0)),
                   float(cost.get("bytes accessed", 0.0)),
                   xla_seconds if xla_seconds is not None and xla_seconds > 0 else None), compiled


def timed_lower(fn, *args, **kwargs) -> tuple[jax.stages.Lowered, float]:
    """``fn(*args, **kwargs)`` (something returning a ``Lowered``) and the seconds it took."""
    start = time.perf_counter()
    lowered = fn(*args, **kwargs)
    return lowered, time.perf_counter() - start


def per_layer(costs: dict[int, Program], num_layers: int, name: str, *, layer_bytes: float = 0.0) -> Program:
    """A ``num_layers``-layer program's cost from the same program compiled with a few layer
    counts unrolled (``costs``: layers -> program; every decoder layer costs the same, so cost
    is a line in the layer count), read off the least-squares line through them: one compile
    whose fusion differs from its neighbours' moves the line less than it would move the
    difference of two.  ``layer_bytes``: what one layer must read at least per device (its
    weights, each read once); where the compiles' slope in bytes falls below it the compiler's
    choices at these small layer counts do not extrapolate, and the floor is used instead,
    said in the program's ``note``.  The compile time is that of all of them."""
    if len(costs) < 2:
        raise ValueError(f"{name}: the cost extrapolation needs two layer counts or more, got {sorted(costs)}")
    xs = sorted(costs)
    mean_x = sum(xs) / len(xs)
    var = sum((x - mean_x) ** 2 for x in xs)

    def line(field, floor=0.0):
        ys = [getattr(costs[x], field) for x in xs]
        mean_y = sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
        return mean_y + max(slope, floor) * (num_layers - mean_x), slope

    flops, _ = line("flops")
    bytes_accessed, slope = line("bytes_accessed", layer_bytes)
    note = None
    if slope < layer_bytes:
        note = (f"the compiles' bytes per layer ({slope / 1e6:.1f} MB, layers {', '.join(map(str, xs))}) are below "
                f"one read of a layer's weights ({layer_bytes / 1e6:.1f} MB a device), which is used instead")
    xla = None if any(costs[x].xla_seconds is None for x in xs) else line("xla_seconds")[0]
    return Program(name, sum(c.compile_s for c in costs.values()), 0, 0, 0, 0, 0, flops, bytes_accessed, xla,
                   note=note)
