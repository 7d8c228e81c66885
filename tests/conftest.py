import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

# One XLA compilation cache for the whole run: many tests compile the same programs (the same
# models, shapes and settings) in different test processes (the xdist workers, the multi-host
# and CLI subprocesses), which inherit this variable.  The process that made the directory
# (pytest's, or the xdist controller) removes it at the end.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="eagle3-jax-tests-xla-")


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ.pop("JAX_COMPILATION_CACHE_DIR"), ignore_errors=True)
