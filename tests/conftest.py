import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

# One XLA compilation cache for the whole run: many tests compile the same programs (the same
# models, shapes and settings) in different test processes (the xdist workers, the multi-host
# and CLI subprocesses), which inherit this variable.  The process that made the directory
# (pytest's, or the xdist controller) removes it at the end.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="eagle3-jax-tests-xla-")
    # a size bound switches on the cache's file lock (jax._src.lru_cache): without it one process
    # can read an entry another is still writing
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
    # each module's programs are freed at its end (below): keep those that a later module on the
    # same worker compiles again
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
# The suite's time is mostly XLA:CPU compiling small programs that then run for milliseconds:
# LLVM's cheap pipeline (backend optimization level 0, no expensive passes; no floating-point
# reassociation either way, so the same numbers), for this process and the subprocesses tests
# start.  The few tests that run their programs far longer than they compile them (thousands
# of sampled rows, a hundred training steps) ask for full optimization (``optimized``).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# XLA:CPU's MLIR fusion emitters build an MLIR context and pass pipeline per fused kernel, and
# the decode loops hold hundreds of small fusions: its older LLVM IR emitters compile them in
# about half the CPU time (``scripts/compile_bench.py``; docs/measurements.md, "The suite's
# time").  XLA reads its flags once per process: this one's and the subprocesses' (which
# inherit them).  An XLA_FLAGS that names the setting is left as it is.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ.pop("JAX_COMPILATION_CACHE_DIR"), ignore_errors=True)



@pytest.fixture
def optimized():
    """Compiles the test's programs with XLA's full optimization (see above)."""
    from helpers import full_optimization

    with full_optimization():
        yield


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Frees a module's compiled programs when it ends.  XLA:CPU maps a few pages per kernel and
    unmaps them only with their executable, so a worker that kept every module's programs
    passed the kernel's limit on memory maps (vm.max_map_count, 65 530) and crashed inside a
    compilation; a module's own programs stay shared by its tests, and the persistent cache
    above makes a program compiled again cheap."""
    yield
    import gc

    import jax

    import eagle3_jax.decode

    jax.clear_caches()
    eagle3_jax.decode.clear_compiled()
    gc.collect()
