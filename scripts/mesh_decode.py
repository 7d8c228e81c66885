"""Greedy decoding on a device mesh gives the tokens of one device, with weights and caches
really sharded.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/mesh_decode.py [--quick]

For the golden tiny pair and the built-in pair, vanilla and speculative, on meshes
(data=2, tensor=4), (tensor=8), (data=8) and (data=2, fsdp=4): the tokens equal one device's, every weight's
per-device shard shape is checked against its declared sharding, and the optimized program
holds the target's KV cache at its per-device shape (batch over data, KV heads over tensor;
replicated, explicitly, when there are fewer KV heads than tensor devices) and never at its
whole shape; where the batch is split, no collective carries every row's keys or values (each
device writes, commits and reads its own rows), and on (data=8) the decode loop runs no
collective but all-reduces of scalars (no row's data moves between devices); on (fsdp=4) no
draft step gathers a drafter weight whole (``weight_gathers``).  Then a batch of 8 whose rows end at
different times, on (data=2, tensor=4), so that it decodes in phases (each device's rows
gathered into fewer on that device): the tokens and round records of one device, vanilla
greedy and speculative sampled.  A random two-layer Qwen3 drafter of the speculators layout
(``fc_norm``, ``norm_output``) with the tiny target, speculative, on (data=2, tensor=4) and
(data=2, fsdp=4).
``--quick`` (the test suite's) runs the tiny pairs, speculative only, and the phases; the
tiny pair's drafter on (data=2, fsdp=4) is left to the full run (the two-layer drafter runs there).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import eagle3_jax
from eagle3_jax import builtin, decode, sharding
from eagle3_jax.config import DrafterConfig
from eagle3_jax.decode import encode_chat
from eagle3_jax.models.drafter import Drafter
from eagle3_jax.models.target import declare
from eagle3_jax.tree import TreeConfig

ROOT = Path(__file__).resolve().parent.parent
MESHES = ({"data": 2, "tensor": 4}, {"tensor": 8}, {"data": 8}, {"data": 2, "fsdp": 4})


def _pairs(quick: bool):
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import FIXTURES

    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    drafter = eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    # --quick: (data=2, fsdp=4) with the two-layer drafter below only (the same target layout and
    # weight-gather check, over two drafter layers)
    yield "tiny", target, drafter, prompts, TreeConfig.chain(3), None, MESHES[:3] if quick else MESHES
    # a speculators-style drafter (random weights): two Qwen3 layers, a norm per captured layer,
    # the normed hidden fed back; its two-layer cache split like the target's
    cfg = DrafterConfig.for_target(target.config, target.config.vocab_size, num_layers=2, layer_family="qwen3",
                                   fc_norm=True, norm_output=True)
    two = Drafter(cfg, target.embed[...], rngs=nnx.Rngs(1))
    yield "tiny-2l", target, two, prompts, TreeConfig(8, 2, 3), None, (MESHES[0], MESHES[3])
    if not quick:
        target, drafter, tok = builtin.load()
        prompts = [encode_chat(tok, [{"role": "user", "content": t["prompt"]}]) for t in builtin.eval_tasks()[:3]]
        # its 910 ids do not split over tensor=4 or 8: the embedding and the head are replicated
        yield "builtin", target, drafter, prompts, TreeConfig.chain(4), {"vocab": None}, MESHES


def check_cache_layout(compiled_text: str, cfg, batch: int, max_len: int, mesh) -> str:
    """The target cache's per-device shape in the program; raises if it is missing or the
    whole cache appears where the mesh splits it."""
    spec = sharding.spec((cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim),
                         eagle3_jax.kv_cache.CACHE_AXES, mesh, name="target KV cache")
    whole = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    shard = jax.sharding.NamedSharding(mesh, spec).shard_shape(whole)
    shapes = {tuple(map(int, m.split(","))) for m in re.findall(r"\w+\[([\d,]+)\]", compiled_text) if m.count(",") == 4}
    assert shard in shapes, (shard, sorted(shapes))
    if shard != whole:
        assert whole not in shapes, f"the whole cache {whole} is materialised on a device"
    return f"cache {whole} -> {shard} per device"


def cache_collectives(compiled_text: str, carries) -> list[str]:
    """The collectives of the program whose result has a five-dimensional array (the layout of
    the KV cache and of the keys and values written to it) for which ``carries(dims)`` holds."""
    found = []
    for line in compiled_text.splitlines():
        m = re.match(r"^\s*(?:ROOT )?%\S+ = (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                     r"(?:-start)?\(", line)
        if m and any(d.count(",") == 4 and carries(tuple(map(int, d.split(","))))
                     for d in re.findall(r"\w+\[([\d,]+)\]", m.group(1))):
            found.append(f"{m.group(2)} {m.group(1)[:80]}")
    return found


def loop_collectives(compiled_text: str) -> list[tuple[str, str]]:
    """The collectives in the program's loops (in a while loop's body or condition, or in what
    those call), as ``(op, result type)``, each instruction once (a loop per phase: each phase's)."""
    comps, calls, comp = {}, {}, None
    for line in compiled_text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if head:
            comp = head.group(2)
            comps[comp], calls[comp] = [], set()
            continue
        if comp is None:
            continue
        for m in re.finditer(r"\b(?:condition|body|calls|to_apply|branch_computations|true_computation|"
                             r"false_computation|called_computations)=(\{[^}]*\}|%[\w.-]+)", line):
            calls[comp].update(re.findall(r"%([\w.-]+)", m.group(1)))
        m = re.match(r"^\s*(?:ROOT )?%\S+ = (.*?) (all-gather|all-reduce|all-to-all|ragged-all-to-all|collective-permute|"
                     r"collective-broadcast|reduce-scatter|send|recv)(?:-start)?\(", line)
        if m:
            comps[comp].append((m.group(2), m.group(1)))
    loops = set(re.findall(r"\b(?:condition|body)=%([\w.-]+)", compiled_text))
    seen, todo = set(), list(loops)
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(calls.get(c, ()))
    return [op for c in sorted(seen) for op in comps.get(c, ())]


def weight_gathers(compiled_text: str, drafter) -> list[str]:
    """The collectives of the drafter's steps (the loop's ``draft`` and ``catch_up`` scopes)
    whose result is one of the drafter's weights whole (its declared shape): with fsdp, the
    draft steps must multiply each device's own slice.  (The target's layers are left to XLA,
    which at these tiny sizes gathers some of their weights: cheaper than moving activations.)"""
    from eagle3_jax.models.drafter import param_shapes

    whole = {tuple(s) for s in param_shapes(drafter.config).values() if s is not None and len(s) >= 2}
    found = []
    for line in compiled_text.splitlines():
        m = re.match(r"^\s*(?:ROOT )?%\S+ = (.*?) (all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(", line)
        scope = re.search(r'op_name="([^"]*)"', line)
        if not (m and scope and re.search(r"/(draft|catch_up)/", scope.group(1))):
            continue
        if any(tuple(map(int, d.split(","))) in whole for d in re.findall(r"\w+\[([\d,]+)\]", m.group(1))):
            found.append(f"{m.group(2)} {m.group(1)[:80]}")
    return found


def scalar_all_reduce(op: str, result: str) -> bool:
    """Whether a collective is an all-reduce of scalars only (one, or a tuple of them)."""
    return op == "all-reduce" and all(dims == "" for dims in re.findall(r"\w+\[([\d,]*)\]", result))


def check_weights(target, mesh, rules=None) -> str:
    """Every declared weight sits on the mesh at its declared per-device shape (by ``rules``)."""
    from flax import nnx

    _, state = nnx.split(target)
    placed = sharding.place(state, declare(target.config), mesh, rules)
    decl = declare(target.config).shardings(mesh, rules)
    for path, x in jax.tree_util.tree_flatten_with_path(placed)[0]:
        name = path[0].key
        if name in decl:
            assert x.sharding.shard_shape(x.shape) == decl[name].shard_shape(x.shape), name
    wq = placed["wq"][...]
    return f"wq {wq.shape} -> {wq.sharding.shard_shape(wq.shape)} per device"


def check_phases(target, drafter, tree) -> str:
    """8 rows on (data=2, tensor=4), greedy rows 0-5 stopping early and 6-7 running to 64
    tokens: each device's 4 rows decode in phases of 4 and then 2 (both of the second device's
    long rows there), and every row's tokens and round records are one device's (greedy, and
    sampled with the drafter); no collective moves cache rows (each device gathers its own)."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, target.config.vocab_size, size=int(n)).tolist() for n in rng.integers(4, 30, size=8)]
    vanilla = eagle3_jax.generate(target, None, prompts, max_new_tokens=64).tokens
    long_rows = set(vanilla[6]) | set(vanilla[7])  # a stop token of each of rows 0-5 that 6 and 7 never make
    stops = sorted({next(t for t in vanilla[r][3 + 6 * r:] if t not in long_rows) for r in range(6)})
    mesh = sharding.make_mesh(data=2, tensor=4)
    assert decode.phase_rows(8, 64, 2) == (8, 4, 2)
    for d, temperature in ((None, 0.0), (drafter, 0.8)):
        kw = dict(max_new_tokens=64, stop_token_ids=stops, temperature=temperature, seed=3, tree=tree)
        want = eagle3_jax.generate(target, d, prompts, **kw)
        got = eagle3_jax.generate(target, d, prompts, mesh=mesh, **kw)
        assert got.tokens == want.tokens, ("phases", d is not None)
        assert got.stats["accept_lengths"] == want.stats["accept_lengths"], ("phases", d is not None)
        compiled, cargs = decode.compile_generate(target, d, prompts, mesh=mesh, **kw)
        max_len = cargs[-1].prompt_BxT.shape[1] + 64 + (1 if d is None else tree.scratch)
        layout = check_cache_layout(compiled.as_text(), target.config, 8, max_len, mesh)
        L = target.config.num_layers
        moved = cache_collectives(compiled.as_text(), lambda dims: max_len in dims or dims[:2] == (L, 8))
        assert not moved, f"phases: a collective moves cache rows or every row's keys/values: {moved}"
        if d is None:
            lengths = [len(t) for t in want.tokens]
            assert max(lengths[:6]) < 40 and lengths[6:] == [64, 64], lengths  # 24+ steps with 2 rows a device
    return f"phases (8, 4, 2) on {dict(mesh.shape)}: tokens identical (row lengths {lengths}); {layout}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny pair, speculative only")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    start = time.perf_counter()
    for name, target, drafter, prompts, tree, rules, meshes in _pairs(args.quick):
        label = f"chain{tree.total_tokens - 1}" if tree.top_k == 1 else f"tree{tree.total_tokens},{tree.depth},{tree.top_k}"
        modes = ((None, "vanilla"), (drafter, label))
        for d, mode in modes[1:] if args.quick else modes:
            kw = dict(max_new_tokens=args.max_new_tokens, tree=tree)
            want = eagle3_jax.generate(target, d, prompts, **kw).tokens
            for axes in meshes:
                mesh = sharding.make_mesh(**axes)
                got = eagle3_jax.generate(target, d, prompts, mesh=mesh, rules=rules, **kw).tokens
                assert got == want, (name, mode, axes)
                compiled, cargs = decode.compile_generate(target, d, prompts, mesh=mesh, rules=rules, **kw)
                batch, T = cargs[-1].prompt_BxT.shape
                max_len = T + args.max_new_tokens + (1 if d is None else tree.scratch)
                layout = check_cache_layout(compiled.as_text(), target.config, batch, max_len, mesh)
                if mesh.shape["data"] > 1:  # each device writes and moves its own rows' keys and values
                    L = target.config.num_layers
                    every_row = cache_collectives(compiled.as_text(), lambda dims: dims[:2] == (L, batch))
                    assert not every_row, f"{axes}: a collective carries every row's keys or values: {every_row}"
                if axes.get("fsdp", 1) > 1 and d is not None:  # the drafter's weights stay split
                    gathered = weight_gathers(compiled.as_text(), d)
                    assert not gathered, f"{axes}: a draft step gathers the drafter's weights whole: {gathered}"
                if set(axes) == {"data"}:  # rows only: a round moves no row's data between devices
                    moving = [f"{op} {result[:80]}" for op, result in loop_collectives(compiled.as_text())
                              if not scalar_all_reduce(op, result)]
                    assert not moving, f"{axes}: the decode loop moves rows' data between devices: {moving}"
                print(f"{name:8s} {mode:8s} {axes}: tokens identical; {check_weights(target, mesh, rules)}; {layout}",
                      flush=True)
        if name == "tiny":
            print(check_phases(target, drafter, tree), flush=True)
    print(f"ok in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
