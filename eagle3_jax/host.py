"""What this host offers a run: its CPU cores and memory (a container's control-group limits
included), a ``data`` mesh of one JAX CPU device per core to split a batch over, and JAX's
persistent compilation cache (per user by default).

* :func:`cores`, :func:`memory`, :func:`cgroup`: the host's probes;
* :func:`use_cores`, :func:`core_mesh`: one JAX CPU device per core, and the mesh of the most
  of them that divides a batch (``eagle3-jax bench``'s ``--mesh auto``);
* :func:`default_compile_cache`, :func:`use_compile_cache`: the compilation cache's directory.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import jax

from eagle3_jax import sharding

COMPILE_CACHE_OFF = "off"
COMPILE_CACHE_BYTES = 4 << 30  # the cache's default bound (least recently used entries go first)
COMPILE_CACHE_MIN_SECONDS = 0.0  # every program is kept: a start loads even the small ones


def cores() -> int:
    """The CPU cores this process may run on: those it may be scheduled on, at most its
    control group's CPU quota (a container's ``--cpus``)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    quota = (cgroup("cpu.max") or "").split()  # "max 100000" or "200000 100000"
    if len(quota) == 2 and quota[0].isdigit() and quota[1].isdigit() and int(quota[1]) > 0:
        count = min(count, max(1, math.ceil(int(quota[0]) / int(quota[1]))))
    return count


def memory() -> int | None:
    """Bytes of memory this process may use: the machine's, at most its control group's
    limit (``None``: unknown)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    limit = cgroup("memory.max")
    return min(total, int(limit)) if limit and limit.isdigit() else total


def cgroup(name: str) -> str | None:
    """A file of this process's (version 2) control group, stripped, or ``None``."""
    try:
        return Path("/sys/fs/cgroup", name).read_text().strip()
    except OSError:
        return None


def use_cores() -> None:
    """Before JAX starts: one JAX CPU device per core (:func:`cores`), for :func:`core_mesh`.
    Left alone where the environment names the count (``XLA_FLAGS``'
    ``--xla_force_host_platform_device_count``, ``JAX_NUM_CPU_DEVICES``) and where JAX's
    backends have already started (a caller that ran JAX before).  A program that runs on one
    device is as fast either way."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "") or "JAX_NUM_CPU_DEVICES" in os.environ:
        return
    try:
        jax.config.update("jax_num_cpu_devices", cores())
    except RuntimeError:  # the backends have started: keep their devices
        pass


def core_mesh(rows: int, weight_dirs, as_float32: bool = False):
    """On a CPU with several JAX devices (one per core, :func:`use_cores`), a ``data`` mesh of
    the most of them that divides ``rows``, so that each device decodes its share of the rows
    (XLA:CPU runs each dot of a small model's step on one core); ``None`` (one device) where
    that is one device (one row), on an accelerator, or where the weights' copies on the mesh
    (one per device, beside the loaded ones) would take more than a quarter of the memory
    (:func:`memory`; unknown: one device).  The weights are the ``.safetensors`` and ``.bin``
    files of ``weight_dirs`` (``None`` entries skipped), counted twice if ``as_float32`` (a
    16-bit checkpoint read as float32: an overestimate for a float32 one)."""
    devices = jax.devices()
    n = max(d for d in range(1, min(len(devices), rows) + 1) if rows % d == 0)
    if n < 2 or devices[0].platform != "cpu":
        return None
    weights = sum(f.stat().st_size for d in weight_dirs if d is not None for f in Path(d).iterdir()
                  if f.suffix in (".safetensors", ".bin"))
    if as_float32:
        weights *= 2
    available = memory()
    if available is None or n * weights > available // 4:
        return None
    return sharding.make_mesh(data=n, devices=devices[:n])


def default_compile_cache() -> Path:
    """The per-user XLA compilation cache: ``$XDG_CACHE_HOME/eagle3-jax/xla`` (by default
    ``~/.cache/eagle3-jax/xla``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagle3-jax" / "xla"


def use_compile_cache(flag: str | None) -> Path | None:
    """Turns on JAX's persistent compilation cache (before anything compiles) in ``flag``'s
    directory (``--compile-cache``), else ``$JAX_COMPILATION_CACHE_DIR``'s (JAX reads it), else
    :func:`default_compile_cache`; ``"off"`` turns it off.  Returns the directory (None: off).

    Safe across versions and processes: JAX keys each entry by its own and the backend's
    versions, the XLA flags, the devices and the program, and a size bound (here
    ``COMPILE_CACHE_BYTES`` unless ``$JAX_COMPILATION_CACHE_MAX_SIZE`` sets one) makes it evict
    the least recently used entries and lock the directory while it reads or writes, so that
    processes sharing it never see half an entry.  Programs that compiled in at least
    ``COMPILE_CACHE_MIN_SECONDS`` are kept (``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` may
    say otherwise).  A default directory that cannot be made is skipped with a warning; a
    ``flag`` directory raises ``OSError``."""
    if flag is not None and flag.lower() == COMPILE_CACHE_OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = Path(flag or jax.config.jax_compilation_cache_dir or default_compile_cache())
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(path))
    except OSError as e:
        if flag is not None:
            raise OSError(f"--compile-cache {path}: cannot keep compiled programs there "
                          f"({e.strerror or e}); give another directory or off") from None
        print(f"eagle3-jax: warning: no compilation cache ({path}: {e.strerror or e}); every start compiles",
              file=sys.stderr)
        return None
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", COMPILE_CACHE_MIN_SECONDS)
    return path
