"""Installing the project claims no generic top-level import name, and ``import eagle3_jax``
stays light (no training, serving or test dependencies)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_install_puts_train_and_serve_under_the_package(tmp_path):
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", str(ROOT), "--no-deps", "--no-build-isolation",
                          "--target", str(site)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["bin", "eagle3_jax"]
    # every source module is installed (a subpackage missing from pyproject's list would be dropped)
    sources = {"eagle3_jax": ROOT / "eagle3_jax", "eagle3_jax/train": ROOT / "train", "eagle3_jax/serve": ROOT / "serve",
               "eagle3_jax/pallas_kernels": ROOT / "pallas_kernels"}
    want = {f"{dest}/{p.relative_to(src)}" for dest, src in sources.items() for p in src.rglob("*.py")
            if "__pycache__" not in p.parts}
    installed = {str(p.relative_to(site)) for p in (site / "eagle3_jax").rglob("*.py")}
    assert sorted(want - installed) == [], "modules left out of the install (pyproject's packages)"
    script = """
import sys
try:
    import train
except ImportError:
    pass
else:
    raise SystemExit("a top-level train was installed: " + train.__file__)
import eagle3_jax
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"orbax", "grain", "matplotlib", "torch", "fastapi", "uvicorn"})
assert not heavy, heavy
import eagle3_jax.train.pipeline, eagle3_jax.serve, eagle3_jax.pallas_kernels.tree_attention
assert eagle3_jax.train.pipeline.__file__.startswith(sys.argv[1]), eagle3_jax.train.pipeline.__file__
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", script, str(site)], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]
