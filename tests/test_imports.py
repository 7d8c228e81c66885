"""The package's imports point down, form no cycle and reach no other module's private names
(issue 60, point 2), read from the source with ``ast`` (nothing is imported).

Layers, lowest first: the core library, then ``train`` and ``serve``, then the tools, then the
CLI.  A module may import its own layer or a lower one.  Where the tree breaks a rule today the
break is listed in an allow-list below, each entry named and explained; any other break fails,
and an allow-list entry that no longer occurs fails too (so that a fixed break is struck off).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the package's directories (pyproject's package-dir: train/, serve/ and pallas_kernels/ install
# under eagle3_jax)
PACKAGES = {"eagle3_jax": ROOT / "eagle3_jax", "eagle3_jax.train": ROOT / "train",
            "eagle3_jax.serve": ROOT / "serve", "eagle3_jax.pallas_kernels": ROOT / "pallas_kernels"}
CORE = ("config", "config_json", "params", "layers", "models", "kv_cache", "tree", "verify", "budget", "speculation", "decode",
        "checkpoint", "sharding", "atomic", "vocab", "limits", "configfile", "host", "pallas_kernels")
TOOLS = ("bench", "experiment", "experiment_report", "cost", "plan", "topology", "builtin", "device_check")
LAYERS = {**dict.fromkeys(CORE, 0), "train": 1, "serve": 1, **dict.fromkeys(TOOLS, 2), "cli": 3}
LAYER_NAMES = ("core", "train/serve", "tools", "cli")

# Breaks the tree has today, each to be struck off when fixed (issue 60, point 2).
UPWARD_ALLOWED = {
}
CYCLES_ALLOWED: set[frozenset[str]] = set()
PRIVATE_ALLOWED: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package as its ``__init__``)."""
    out = {}
    for pkg, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                continue
            out[".".join([pkg, *parts])] = path
    return out


def layer(module: str) -> int | None:
    """The layer of ``module`` (``None``: the package's root, outside the layers)."""
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every project import of ``module``
    (at any depth: function-local imports count), a name resolved to a submodule where it is one."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base not in known:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in known else (base, a.name, node.lineno))
    return out


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(mods: dict[str, Path]):
    known = set(mods)
    upward, private, graph = [], [], {m: set() for m in mods}
    for mod, path in mods.items():
        for target, name, line in imports(mod, path, known):
            if target == mod:
                continue
            graph[mod].add(target)
            lo, hi = layer(mod), layer(target)
            if lo is not None and hi is not None and hi > lo and (mod, target) not in UPWARD_ALLOWED:
                upward.append(f"{mod}:{line} ({LAYER_NAMES[lo]}) imports {target} ({LAYER_NAMES[hi]})")
            # a private module is private to its own package
            hidden = [p for p in target.split(".")[1:] if is_private(p)]
            own = mod.startswith(target.rpartition(".")[0] + ".") or mod == target.rpartition(".")[0]
            if hidden and not own and (mod, target) not in PRIVATE_ALLOWED:
                private.append(f"{mod}:{line} imports the private module {target}")
            if name is not None and is_private(name) and (mod, f"{target}.{name}") not in PRIVATE_ALLOWED:
                private.append(f"{mod}:{line} imports {target}'s private {name}")
    return upward, private, graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_walked():
    mods = modules()
    assert "eagle3_jax.decode" in mods and "eagle3_jax.train.trainer" in mods and "eagle3_jax.serve.app" in mods
    assert "eagle3_jax.pallas_kernels.tree_attention" in mods
    unplaced = sorted(m for m in mods if m != "eagle3_jax" and layer(m) is None)
    assert unplaced == [], f"modules in no layer (add them to LAYERS): {unplaced}"


def test_imports_point_down():
    upward, _, graph = violations(modules())
    assert upward == [], "upward imports:\n" + "\n".join(upward)
    stale = sorted(e for e in UPWARD_ALLOWED if e[1] not in graph.get(e[0], ()))
    assert stale == [], f"allow-listed upward imports that no longer occur (strike them off): {stale}"


def test_no_import_cycles():
    found = cycles(violations(modules())[2])
    new = [sorted(c) for c in found if c not in CYCLES_ALLOWED]
    assert new == [], f"import cycles: {new}"
    stale = [sorted(a) for a in CYCLES_ALLOWED if a not in found]
    assert stale == [], f"allow-listed cycles that no longer occur (strike them off): {stale}"


def test_no_private_names_cross_modules():
    _, private, _ = violations(modules())
    assert private == [], "private names imported from another module:\n" + "\n".join(private)


def made_up_package(tmp_path, sources: dict[str, str]) -> dict[str, Path]:
    """A package ``eagle3_jax`` of ``{submodule: source}`` under ``tmp_path``: dotted name -> file."""
    pkg = tmp_path / "eagle3_jax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    mods = {"eagle3_jax": pkg / "__init__.py"}
    for name, source in sources.items():
        (pkg / f"{name}.py").write_text(source)
        mods[f"eagle3_jax.{name}"] = pkg / f"{name}.py"
    return mods


def test_the_checks_catch_a_new_break(tmp_path):
    """The walk itself: an upward import, a cycle and a private name in a made-up package fail."""
    mods = made_up_package(tmp_path, {"tree": "from eagle3_jax import cli\n",
                                      "cli": "from eagle3_jax.tree import _secret\nimport eagle3_jax.tree\n"})
    upward, private, graph = violations(mods)
    assert upward == ["eagle3_jax.tree:1 (core) imports eagle3_jax.cli (cli)"]
    assert private == ["eagle3_jax.cli:1 imports eagle3_jax.tree's private _secret"]
    assert cycles(graph) == [frozenset({"eagle3_jax.tree", "eagle3_jax.cli"})]


# Function-local project imports allowed beyond the optional extras and the CLI's dispatch,
# each named and explained (issue 60, point 2).
LOCAL_ALLOWED = {
    # the Mosaic GPU kernel imports jax's Mosaic GPU stack, which only a GPU build needs
    ("eagle3_jax.pallas_kernels.tree_attention", "eagle3_jax.pallas_kernels.tree_attention_mgpu"),
}
EXTRAS = ("eagle3_jax.train", "eagle3_jax.serve")  # the `train` and `serve` extras' packages
MAX_LINES = 600  # a module longer than this holds more than one concept (none does today)


def local_imports(mods: dict[str, Path]) -> list[str]:
    """``module:line -> target`` for every project import inside a function that is neither of
    an optional extra's package (from outside it), nor the CLI's lazy dispatch, nor allow-listed."""
    known, out = set(mods), []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        body_imports = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body_imports |= {n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for target, _, line in imports(mod, path, known):
            if line not in body_imports or mod.startswith("eagle3_jax.cli") or (mod, target) in LOCAL_ALLOWED:
                continue
            if target.startswith(EXTRAS) and not mod.startswith(EXTRAS):
                continue
            out.append(f"{mod}:{line} -> {target}")
    return sorted(set(out))


def test_project_imports_sit_at_the_top():
    """A module imports the project at its top; inside a function only an optional extra's
    package (train, serve), the CLI's per-command modules, or an allow-listed kernel."""
    found = local_imports(modules())
    assert found == [], "function-local project imports (move them to the module's top):\n" + "\n".join(found)
    walked = {(m, t) for m, p in modules().items() for t, _, _ in imports(m, p, set(modules()))}
    stale = sorted(LOCAL_ALLOWED - walked)
    assert stale == [], f"allow-listed local imports that no longer occur (strike them off): {stale}"


def test_modules_stay_small():
    long = sorted(f"{m} ({n} lines)" for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert long == [], f"modules over {MAX_LINES} lines (split them by role): {long}"


def test_local_import_walk_catches_one(tmp_path):
    mods = made_up_package(tmp_path, {"tree": "def f():\n    from eagle3_jax import verify\n",
                                      "verify": "from eagle3_jax import tree\n\n\ndef g():\n    from eagle3_jax.train import x\n",
                                      "train": ""})
    assert local_imports(mods) == ["eagle3_jax.tree:2 -> eagle3_jax.verify"]
