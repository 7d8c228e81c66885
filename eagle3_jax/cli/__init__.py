"""The ``eagle3-jax`` command line."""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import sys
import zipfile
from pathlib import Path

from eagle3_jax import budget, limits
from eagle3_jax.atomic import write_atomic, write_report, write_report_figure
from eagle3_jax.checkpoint import DTYPES, check_output_path
from eagle3_jax.layers import ATTENTION_IMPLS

# errors a user's input can cause: one line on stderr, exit 2 (--debug: the traceback)
INPUT_ERRORS = (OSError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, pickle.UnpicklingError,
                zipfile.BadZipFile, EOFError)


def describe_checkpoint(path: Path) -> dict:
    """A JSON-able description of a target or drafter checkpoint directory."""
    from eagle3_jax.checkpoint import is_drafter_config
    from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json

    raw = read_config_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{Path(path) / 'config.json'}: expected a JSON object, got a {type(raw).__name__}")
    files = sorted(p.name for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    if is_drafter_config(raw):
        cfg = DrafterConfig.from_dict(raw, source=str(Path(path) / "config.json"))
        return {
            "kind": "EAGLE-3 drafter",
            "architectures": raw.get("architectures"),
            "hidden_size": cfg.hidden_size,
            "layout": cfg.layout,
            "layers": f"{cfg.num_layers} {cfg.layer_family}",
            "switches": [n for n in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
                         if getattr(cfg, n)] or "none",
            "fc_in_features": cfg.fused_width,
            "target_hidden_size": cfg.target_hidden_size,
            "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size,
            "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
            "rope": {"theta": cfg.rope.theta, "type": cfg.rope.rope_type},
            "capture_layers": list(cfg.capture_layers) if cfg.capture_layers else "target default (2, L//2, L-3)",
            "dtype": raw.get("torch_dtype") or raw.get("dtype"),
            "files": files,
        }
    cfg = TargetConfig.from_dict(raw, source=str(Path(path) / "config.json"))
    return {
        "kind": "target",
        "family": cfg.family,
        "architectures": raw.get("architectures"),
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
        "vocab_size": cfg.vocab_size,
        "rope": {"theta": cfg.rope.theta, "type": cfg.rope.rope_type},
        "tied_embeddings": cfg.tie_word_embeddings,
        "capture_layers": list(cfg.capture_layers),
        "feature_width": cfg.feature_width,
        "dtype": cfg.torch_dtype,
        "files": files,
    }


def _cmd_info(args) -> int:
    info = describe_checkpoint(Path(args.path))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _tokenizer(path: Path):
    """The target directory's tokenizer, if it ships one (never downloaded)."""
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


BUILTIN_PROMPTS = 64  # the bench's default share of the built-in eval set (16 per family)
EXPERIMENT_PROMPTS = 32  # the experiment's (8 per family): its default run, 3 timed repeats, fits 20 minutes on 2 cores


def _load_pair(args):
    """``(target, drafter, tokenizer, builtin)``: the given checkpoints, or the built-in pair."""
    import eagle3_jax
    from eagle3_jax import builtin

    if args.target is None:
        if args.drafter:
            raise ValueError("--drafter needs --target (without --target the built-in pair is used)")
        return (*builtin.load(args.dtype or "float32", attention_impl=args.attention), True)
    # read straight onto a mesh --mesh names (the built-in pair is placed by generate, or by bench under --mesh auto)
    mesh, rules = _mesh(args), _rules(args)
    target = eagle3_jax.load_target(args.target, dtype=args.dtype, attention_impl=args.attention, mesh=mesh,
                                    rules=rules)
    drafter = eagle3_jax.load_drafter(args.drafter, target=target, mesh=mesh, rules=rules) if args.drafter else None
    return target, drafter, _tokenizer(Path(args.target)), False


DEFAULT_MAX_NEW_TOKENS = 256


def _max_new_tokens(args, is_builtin: bool) -> int:
    """``--max-new-tokens``, or by default enough for the built-in pair's longest answer (its
    12-step math thinking alone is 279 tokens), else 256."""
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    from eagle3_jax import builtin

    return builtin.MAX_RESPONSE_TOKENS if is_builtin else DEFAULT_MAX_NEW_TOKENS


def _encode(tok, text: str, raw: bool = False) -> list[int]:
    from eagle3_jax.decode import encode_chat

    return encode_chat(tok, [{"role": "user", "content": text}]) if tok.chat_template and not raw else tok.encode(text)


def _cmd_convert(args) -> int:
    """Re-saves a drafter directory in another layout (official <-> speculators)."""
    import eagle3_jax
    from eagle3_jax.checkpoint.load import read_target_embedding

    embed = None if args.target is None else read_target_embedding(args.target)
    drafter = eagle3_jax.load_drafter(args.path, embed=embed)
    verifier = args.target if args.to == "speculators" else None
    out = eagle3_jax.save_drafter(drafter, args.out, dtype=args.dtype, format=args.to, verifier=verifier)
    print(f"wrote {out} ({args.to} layout, {args.dtype})")
    return 0


def _cmd_generate(args) -> int:
    import eagle3_jax
    from eagle3_jax import builtin
    from eagle3_jax.bench import tree_name
    from eagle3_jax.tree import parse_tree

    given = [name for name, v in (("PROMPT", args.prompt), ("--prompt", args.prompt_flag),
                                  ("--prompt-ids", args.prompt_ids)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one prompt, not {' and '.join(given)}")
    if not given:
        raise ValueError("give a prompt: eagle3-jax generate \"TEXT\" (or --prompt-ids 1,2,3)")
    text = args.prompt if args.prompt is not None else args.prompt_flag
    if text is not None:
        from eagle3_jax.serve.text import blank_problem, encoding_problem

        blank = blank_problem(text)
        problem = encoding_problem(text) or (blank and f"{blank}: give the text to answer")
        if problem:
            raise ValueError(f"{given[0]} {problem}")
    target, drafter, tok, is_builtin = _load_pair(args)
    if args.prompt_ids:
        vocab = target.config.vocab_size
        if max(args.prompt_ids) >= vocab:
            raise ValueError(f"--prompt-ids: token id {max(args.prompt_ids)} is out of range for the target's "
                             f"vocabulary (0..{vocab - 1})")
        prompts = [args.prompt_ids]
    else:
        if tok is None:
            raise ValueError(f"--target {args.target} has no tokenizer: pass --prompt-ids 1,2,3 instead of a text prompt")
        prompts = [_encode(tok, text, args.raw)]
    tree = args.tree or parse_tree(builtin.DEFAULT_TREE if is_builtin else "60,7,10")
    kw = dict(max_new_tokens=_max_new_tokens(args, is_builtin), temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed, tree=tree, mesh=_mesh(args), rules=_rules(args), **_thinking_kw(args, tok))

    def timed(drafter_):  # the faster of two runs (same seed, same output): compilation and warm-up excluded
        return min((eagle3_jax.generate(target, drafter_, prompts, **kw) for _ in range(2)),
                   key=lambda r: r.stats["seconds"])

    res = timed(drafter)
    out = res.tokens[0]
    first = None if tok is None else tok.decode(out, skip_special_tokens=True)
    if tok is None:
        print(" ".join(map(str, out)))
    else:
        thinking, answer = builtin.split_response(first)
        print(f"Thinking:\n{thinking}\n\nAnswer:\n{answer}" if thinking else answer)
    st = res.stats
    if res.thinking_status[0] != "none":
        print(f"\n[thinking: {res.thinking_tokens[0]} tokens, {res.thinking_status[0]}; answer: {res.answer_tokens[0]} "
              f"tokens; finish: {res.finish_reason[0]}]")
    if drafter is None:
        print(f"\n[{st['new_tokens']} tokens, {st['tokens_per_second']:.1f} tok/s, vanilla]")
        return _tool_turn(args, target, drafter, tok, text, first, kw) if is_builtin else 0
    line = f"\n[{st['new_tokens']} tokens; EAGLE-3 {tree_name(tree)}: tau {st['tau']:.2f} over {st['rounds'][0]} rounds, " \
           f"{st['tokens_per_second']:.1f} tok/s"
    if not args.no_compare:
        base = timed(None)
        line += f"; vanilla {base.stats['tokens_per_second']:.1f} tok/s; " \
                f"speedup {st['tokens_per_second'] / base.stats['tokens_per_second']:.2f}x"
        if args.temperature == 0:
            line += f"; identical to vanilla: {base.tokens == res.tokens}"
    print(line + "]")
    return _tool_turn(args, target, drafter, tok, text, first, kw) if is_builtin else 0


def _tool_turn(args, target, drafter, tok, prompt: str | None, first: str | None, kw: dict) -> int:
    """The built-in pair's tool turn: when the first turn ``first`` holds a tool call, prints
    the call and the tool's result, then generates (same drafter, tree and sampling as the
    first turn) and prints the final answer."""
    from eagle3_jax import builtin

    turn = None if first is None or prompt is None or args.raw else \
        builtin.tool_turn(target, tok, prompt, first, drafter=drafter, **{k: v for k, v in kw.items() if k != "tokenizer"})
    if turn is None:
        return 0
    call, result, final = turn
    print(f"\nTool call: {json.dumps(call)}\nTool result: {result}\n\nFinal answer:\n{final.strip()}")
    return 0


def _thinking_kw(args, tok) -> dict:
    """generate's thinking arguments from the flags (the tokenizer names <think>/</think>)."""
    if args.thinking_budget is not None and tok is None:
        raise ValueError("--thinking-budget needs a tokenizer with <think> and </think> (the target directory has none)")
    return dict(tokenizer=tok, thinking_budget=args.thinking_budget, thinking_mode=args.thinking_mode,
                thinking_grace=args.thinking_grace)


def _cmd_bench(args) -> int:
    import jax

    from eagle3_jax import builtin
    from eagle3_jax.bench import load_prompts, run_bench, write_figure
    from eagle3_jax.tree import parse_tree

    if args.target is not None and args.drafter is None:
        raise ValueError("bench needs --drafter (or no --target, for the built-in pair)")
    json_path, figure_path = _report_outputs(args)
    if args.prompts and not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts}: no such file")
    target, drafter, tok, is_builtin = _load_pair(args)
    grade = categories = None
    if args.prompts:
        try:
            prompts = load_prompts(args.prompts, target.config.vocab_size, tok)
        except (ValueError, TypeError) as e:
            raise ValueError(str(e) if str(args.prompts) in str(e) else f"--prompts {args.prompts}: {e}") from None
    elif is_builtin:
        tasks = builtin.eval_tasks()[: args.num_prompts or BUILTIN_PROMPTS]
        prompts = [_encode(tok, t["prompt"]) for t in tasks]
        grade, categories = builtin.Scorer(target, tok, tasks).grade, [t["family"] for t in tasks]
    else:
        import numpy as np

        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(0, target.config.vocab_size, size=16).tolist() for _ in range(args.num_prompts or 4)]
    trees = args.tree or [parse_tree(t) for t in (builtin.BENCH_TREES if is_builtin else ["60,7,10"])]
    if args.adaptive:  # the same trees as tiers (plus no drafting) under the adaptive policy
        from eagle3_jax.speculation import Speculation

        trees = [*trees, Speculation((None, *trees))]
    temperatures = args.temperature or ([0.0, 0.7] if is_builtin else [0.0])
    # --cost steps batches of 1, 8 and 32 rows (those the mesh divides on it), the bench its batches
    mesh = _mesh(args, 8 if args.cost else min(args.batch_size, len(prompts)))
    if mesh is not None and not args.cost:  # placed once for every batch, not in each call
        from eagle3_jax import sharding

        target = sharding.place_model(target, mesh, _rules(args))
        drafter = None if drafter is None else sharding.place_model(drafter, mesh, _rules(args))
    doc = {"target": args.target or str(builtin.TARGET_DIR), "drafter": args.drafter or str(builtin.DRAFTER_DIR),
           "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
           "mesh": None if mesh is None else dict(mesh.shape)}
    if mesh is not None and _auto(args):
        print(f"batches split over {mesh.size} CPU devices (a data={mesh.size} mesh: --mesh auto, the default; "
              "--mesh none for one device)", flush=True)
    if args.cost:
        doc["cost"] = _cost_report(target, drafter, prompts[0], args.tree[0] if args.tree else parse_tree("chain4"),
                                   args.max_new_tokens_sweep or [64, 440], sorted({1, args.batch_size}), mesh,
                                   _rules(args))
        write_report(json_path, json.dumps(doc, indent=2) + "\n", "--json")
        print(f"wrote {json_path}")
        return 0
    parts: dict = {}
    reports = [run_bench(target, drafter, prompts, trees=trees, max_new_tokens=max_new, temperature=t,
                         top_p=args.top_p, top_k=args.top_k, batch_size=args.batch_size, seed=args.seed,
                         repeats=args.repeats, grade=grade, categories=categories, parts=parts,
                         generate_kw={**_thinking_kw(args, tok), "mesh": mesh, "rules": _rules(args)})
               for max_new in (args.max_new_tokens_sweep or [_max_new_tokens(args, is_builtin=False)]) for t in temperatures]
    doc["reports"] = reports
    write_report(json_path, json.dumps(doc, indent=2) + "\n", "--json")
    write_report_figure(figure_path, lambda: write_figure(reports, figure_path), json_path)
    print(f"wrote {json_path} and {figure_path}")
    return 0


def _budget(text: str):
    """A thinking budget: a non-negative integer or ``unlimited``."""
    if text.lower() in ("unlimited", "none", "inf"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or 'unlimited', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _cmd_experiment(args) -> int:
    from eagle3_jax import builtin
    from eagle3_jax.bench import load_prompts
    from eagle3_jax.experiment import run_experiment

    if args.target is not None and args.drafter is None:
        raise ValueError("experiment needs --drafter (or no --target, for the built-in pair)")
    out = check_output_path(args.out, "--out", directory=True)
    target, drafter, tok, is_builtin = _load_pair(args)
    if tok is None:
        raise ValueError(f"--target {args.target}: the experiment needs a tokenizer with <think> and </think>")
    grade = categories = details = None
    if args.prompts:
        prompts = load_prompts(args.prompts, target.config.vocab_size, tok)[: args.num_prompts]
    elif is_builtin:
        tasks = builtin.eval_tasks()[: args.num_prompts or EXPERIMENT_PROMPTS]
        prompts = [_encode(tok, t["prompt"]) for t in tasks]
        scorer = builtin.Scorer(target, tok, tasks)
        grade, details, categories = scorer.grade, scorer.details, [t["family"] for t in tasks]
    else:
        raise ValueError("--prompts is needed with --target")
    kw = {}
    if args.budgets:
        kw["budgets"] = tuple(args.budgets)
    if args.chosen:
        kw["chosen"] = tuple(args.chosen)
    if args.tree:
        kw["tiers"] = tuple(args.tree)
    if args.replay_rates:  # step 3: the arrival-rate replay, on the built-in eval prompts' texts
        if not is_builtin:
            raise ValueError("--replay-rates needs the built-in pair (its eval prompts); pass --replay-rates with no "
                             "value to skip step 3, or run `eagle3-jax replay` on your pair")
        kw.update(replay_rates=tuple(args.replay_rates), replay_requests=args.replay_requests,
                  replay_prompts=[t["prompt"] for t in builtin.eval_tasks()],
                  server_kw=dict(max_batch=8, max_len=min(target.config.max_position_embeddings, 1024)))
    report = run_experiment(target, drafter, tok, prompts, grade=grade, categories=categories, details=details,
                            batch_size=args.batch_size,
                            max_new_tokens=_max_new_tokens(args, is_builtin), sampled_temperature=args.sampled_temperature or None,
                            seed=args.seed, repeats=args.repeats, keep_policy_state=args.keep_policy_state,
                            out_dir=out, **kw)
    print("\n".join(report["summary"]))
    print(f"wrote {out}/report.md, report.json, quality_tokens_latency.png and budget_heatmap.png"
          + (" and goodput_vs_rate.png" if "step3" in report else ""))
    return 0


def _cost_report(target, drafter, prompt, tree, max_news, batches, mesh=None, rules=None) -> dict:
    """Where a step's and a round's time goes (see ``eagle3_jax.cost``), printed and returned
    (``mesh``: the batches it splits step on it, placed by ``rules``)."""
    from eagle3_jax import cost
    from eagle3_jax.bench import tree_name

    print("decode_step ms at 33 live tokens, by cache slots (batch 1) and by batch (256 slots"
          + (f"; * on the mesh {dict(mesh.shape)}" if mesh is not None else "") + "):")
    # one timing run, all shapes taking turns: the batch-1, 256-slot step divides both ratios
    step_slots, step_batches = (256, 1024, 4096, 16384), (1, 8, 32)
    step = cost.step_ms(target, [(1, s) for s in step_slots] + [(b, 256) for b in step_batches[1:]], mesh=mesh,
                        rules=rules)
    by_slots = {s: step[1, s] for s in step_slots}
    by_batch = {b: step[b, 256] for b in step_batches}
    print("  slots  " + "  ".join(f"{s}: {ms:.2f}" for s, ms in by_slots.items())
          + f"   ({by_slots[16384] / by_slots[256]:.2f}x from 256 to 16384)")
    print("  batch  " + "  ".join(f"{b}{'*' if cost.on_mesh(mesh, b, rules) else ''}: {ms:.2f}"
                                   for b, ms in by_batch.items())
          + f"   ({by_batch[32] / by_batch[1]:.2f}x from 1 to 32)")
    heaviest = {b: cost.step_ops(target, b) for b in (1, 32)}
    for b, ops in heaviest.items():
        print(f"  its heaviest XLA ops at batch {b} (own ms per step, runs per step, result, op_name):")
        for o in ops:
            print(f"    {o['us'] / 1e3:6.3f} ms {o['runs']:4d}x  {o['op']:36s} {o['shape']:22s} {o['scope']}")
    print(f"decode loop, one request, {tree_name(tree)}, the rounds of {min(max_news)} new tokens timed at each "
          "max_new_tokens (the same live prefix, caches of different capacity"
          + ("; on one device" if mesh is not None else "") + "):")
    loops = [rep for b in batches for rep in cost.loop_report(target, drafter, prompt, tree, max_news, batch=b)]
    return {"step_ms_by_slots": by_slots, "step_ms_by_batch": by_batch, "step_heaviest_ops": heaviest, "loops": loops,
            "step_mesh": None if mesh is None else {"axes": dict(mesh.shape),
                                                    "batches": [b for b in by_batch if cost.on_mesh(mesh, b, rules)]}}


def _report_outputs(args) -> tuple[Path, Path]:
    """bench's and replay's ``--json`` and ``--figure``, checked before any work: writable
    paths of the right kind, not the same file, an image format matplotlib writes."""
    json_path = check_output_path(args.json, "--json")
    figure_path = check_output_path(args.figure, "--figure")
    if json_path.absolute() == figure_path.absolute():
        raise ValueError(f"--json and --figure name the same file ({json_path})")
    if figure_path.suffix.lower().lstrip(".") not in _figure_formats():
        raise ValueError(f"--figure {figure_path}: unsupported image format {figure_path.suffix!r} "
                         f"(use one of {', '.join('.' + f for f in _figure_formats())})")
    return json_path, figure_path


def _figure_formats() -> list[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def _cmd_serve(args) -> int:
    from eagle3_jax.serve.app import check_port, serve_main

    check_port(args.host, args.port)
    target, drafter, tok, is_builtin = _load_pair(args)
    return serve_main(args, target, drafter, tok, is_builtin)


def _cmd_replay(args) -> int:
    from eagle3_jax.serve.replay import replay_main

    json_path, figure_path = _report_outputs(args)
    if args.target is not None and args.drafter is None:
        raise ValueError("replay needs --drafter (or no --target, for the built-in pair)")
    target, drafter, tok, is_builtin = _load_pair(args)
    return replay_main(args, target, drafter, tok, is_builtin, json_path, figure_path)


def _speculation(text: str):
    """``--speculation``: ``auto``, ``off`` or one tier (TOTAL,DEPTH,TOPK or chainN)."""
    return text if text in ("auto", "off") else _tree(text)


def _pair_args(p):
    """The model pair's flags, for every command that decodes."""
    p.add_argument("--target", type=_path, help="Hugging Face target checkpoint directory (default: the built-in pair)")
    p.add_argument("--drafter", type=_path, help="EAGLE-3 drafter checkpoint directory (omit for vanilla decoding)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="target weights' dtype (default: the checkpoint's; float32 built in)")


def _serve_common(p):
    """The pair and the slots, for ``serve`` and ``replay``."""
    _pair_args(p)
    p.add_argument("--attention", default="xla", choices=ATTENTION_IMPLS, help="target attention (as for generate)")
    p.add_argument("--max-batch", type=_number("max-batch", limits.POSITIVE), default=8, help="slots decoded together")
    p.add_argument("--max-queue", type=_number("max-queue", limits.NON_NEGATIVE), default=64,
                   help="requests that may wait beyond the free slots before new ones get 429 (0: no waiting line, "
                        "a request is taken only into a free slot)")
    p.add_argument("--max-len", type=_number("max-len", limits.MAX_LEN), default=None,
                   help="tokens per slot, prompt included (default: the target's max_position_embeddings, at most 4096)")
    p.add_argument("--rounds-per-dispatch", type=_number("rounds-per-dispatch", limits.POSITIVE), default=16,
                   help="the most decode rounds per host sync (while no request waits)")
    p.add_argument("--dispatch-ms", type=_number("dispatch-ms", limits.POSITIVE_FLOAT), default=None,
                   help="also at most the rounds that take this long, at the engine's dearest round (measured at "
                        "start-up; default: no time bound)")
    p.add_argument("--reasoning-effort-budgets", type=_budget, nargs=3, metavar=("LOW", "MEDIUM", "HIGH"),
                   help="thinking budgets of reasoning_effort low/medium/high (default: 16 64 unlimited for the "
                        "built-in pair, else 256 1024 unlimited)")
    p.add_argument("--max-body-bytes", type=_number("max-body-bytes", limits.POSITIVE), default=None, metavar="N",
                   help="larger request bodies get 413 before they are parsed (default: sized from --max-len and the "
                        "tokenizer: the longest prompt text that can fit, as JSON)")
    _compile_cache_arg(p)
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")


def _cmd_train(args) -> int:
    from eagle3_jax.train import pipeline

    cfg = pipeline.load_config(args.config, args.overrides)
    pipeline.run(args.step, cfg, resume=not args.no_resume)
    return 0


def _plan_topology(args, mesh) -> int:
    """``plan --topology``: the config's programs compiled for a TPU topology (its report
    printed, and written as JSON to ``--json``, default ``plan-<topology>.json``)."""
    import time

    from eagle3_jax import plan

    out = Path(args.json or f"plan-{args.topology.replace(':', '-')}.json")
    if out.is_dir():
        raise ValueError(f"--json {out}: is a directory; give a file path")
    programs = tuple(args.programs.split(",")) if args.programs else ("decode", "slots", "fit")
    unknown = sorted(set(programs) - {"decode", "slots", "fit"})
    if unknown:
        raise ValueError(f"--programs {args.programs}: unknown {', '.join(unknown)}; choose from decode, slots, fit")
    start = time.perf_counter()

    def progress(name):  # one line a program: a compile takes seconds to minutes
        print(f"[{time.perf_counter() - start:6.0f} s] compiling {name} for {args.topology}", file=sys.stderr,
              flush=True)

    report = plan.plan_topology(args.config, args.topology, mesh=mesh, tau=args.tau, prompt_len=args.prompt_len,
                                attention_impl=args.attention, target_config=args.target_config,
                                overrides=args.overrides, programs=programs, progress=progress)
    report["compile_total_s"] = round(time.perf_counter() - start, 1)
    print(plan.format_topology_report(report))
    print(f"compiled in {report['compile_total_s']:.0f} s; report: {out}")
    write_atomic(out, json.dumps(report, indent=1) + "\n")
    return 0


def _cmd_plan(args) -> int:
    from eagle3_jax import plan
    from eagle3_jax.sharding import parse_mesh

    mesh = None if args.mesh is None else parse_mesh(args.mesh)
    if args.topology == "config":
        from eagle3_jax.train import pipeline

        args.topology = pipeline.load_config(args.config, args.overrides)["topology"]
        if not args.topology:
            raise ValueError(f"{args.config}: names no topology; give --topology NAME (e.g. v6e:2x4)")
    if args.topology is not None:
        return _plan_topology(args, mesh)
    memory = None if args.device_memory is None else plan.parse_bytes(args.device_memory)
    p = plan.plan(args.config, mesh=mesh, batch=args.batch, seq_len=args.seq_len, device_memory=memory,
                  target_config=args.target_config, overrides=args.overrides)
    print(plan.format_plan(p, args.config))
    return 0


class _UsageError(Exception):
    """A command-line usage error (argparse's), reported in one line."""


# what argparse takes for a negative number, not an option, after a space: -1, -.5, and (its own
# pattern has neither) exponents, infinities and comma-separated lists such as --prompt-ids -1,2
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?(,[-+]?\d+)*$|^-(inf|infinity|nan)$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message):
        flag = re.match(r"argument ([^/:]+).*: expected one argument$", message)
        if flag:  # the value began with "-": argparse read it as an option
            message += f" (a value that begins with '-' goes as {flag.group(1)}=VALUE)"
        raise _UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _number(name: str, rng: limits.Range):
    """An argparse ``type``: a number within ``rng`` (one of :mod:`eagle3_jax.limits`' ranges)."""

    def parse(text: str):
        try:
            value = rng.kind(text)
        except ValueError:
            value = text
        value, error = limits.problem(value, rng)
        if isinstance(error, TypeError):
            raise argparse.ArgumentTypeError(f"{error}, got {text!r}")
        if error:
            raise argparse.ArgumentTypeError(f"{error}, got {text}")
        return value

    parse.__name__ = name  # argparse names the type in "invalid <name> value" messages
    return parse


def _path(text: str) -> str:
    """A file or directory argument: ``~`` and ``~user`` expanded as a shell would (it does not
    after ``--flag=``), so ``--target=~/models/x`` names the same directory as ``--target ~/models/x``."""
    return os.path.expanduser(text)


def _tree(text: str):
    from eagle3_jax.tree import parse_tree

    try:
        return parse_tree(text)
    except ValueError as e:
        detail = "" if str(e).startswith("--tree") else f" ({e})"
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOTAL,DEPTH,TOPK (e.g. 60,7,10) or chainN "
                                         f"(e.g. chain4){detail}") from None


class _Trees(argparse.Action):
    """``--tree A B ...``: each budget once (an adaptive policy takes them as its tiers)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from eagle3_jax.speculation import tier_name

        for i, tree in enumerate(values):
            if tree in values[:i]:
                raise argparse.ArgumentError(self, f"{tier_name(tree)} given twice")
        setattr(namespace, self.dest, values)


def _sharding_arg(name: str):
    """An argparse type: ``eagle3_jax.sharding``'s parser ``name`` (``parse_mesh``,
    ``parse_rules``), its ``ValueError`` as the argument's error."""

    def parse(text: str) -> dict:
        from eagle3_jax import sharding

        try:
            return getattr(sharding, name)(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


class _MergeRules(argparse.Action):
    """``--rules`` given more than once: the overrides together (an axis once)."""

    def __call__(self, parser, namespace, values, option_string=None):
        rules = dict(getattr(namespace, self.dest, None) or {})
        twice = sorted(set(rules) & set(values))
        if twice:
            raise argparse.ArgumentError(self, f"axis {twice[0]!r} given twice")
        setattr(namespace, self.dest, {**rules, **values})


def _rules(args):
    """The ``--rules`` of a command (``None``: the default rules)."""
    return getattr(args, "rules", None)


def _mesh(args, rows: int = 1):
    """The ``--mesh`` of a command decoding ``rows`` rows at a time, built on this process's
    devices (``None``: one device): the axes ``--mesh`` names, or under ``bench``'s
    ``--mesh auto`` (its default) :func:`_core_mesh`."""
    mesh = getattr(args, "mesh", None)
    if _rules(args) is not None and not isinstance(mesh, dict):
        raise ValueError("--rules needs --mesh AXES (e.g. --mesh data=2,tensor=4)")
    if isinstance(mesh, dict):
        from eagle3_jax.sharding import make_mesh

        return make_mesh(**mesh)
    return _core_mesh(args, rows) if _auto(args) else None


AUTO_MESH, NO_MESH = "auto", "none"  # --mesh's two words besides mesh axes (see _mesh)


def _mesh_arg(text: str):
    """``--mesh``: ``auto``, ``none`` or mesh axes (``data=2,tensor=4``)."""
    word = text.strip().lower()
    return word if word in (AUTO_MESH, NO_MESH) else _sharding_arg("parse_mesh")(text)


def _auto(args) -> bool:
    """Whether a command splits its batches over the CPU's cores: ``bench`` (``cores`` among
    its defaults) without ``--mesh`` or with ``--mesh auto``."""
    return getattr(args, "cores", False) and getattr(args, "mesh", None) in (None, AUTO_MESH)


def _cores() -> int:
    """The CPU cores this process may run on: those it may be scheduled on, at most its
    control group's CPU quota (a container's ``--cpus``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = (_cgroup("cpu.max") or "").split()  # "max 100000" or "200000 100000"
    if len(quota) == 2 and quota[0].isdigit() and quota[1].isdigit() and int(quota[1]) > 0:
        cores = min(cores, max(1, math.ceil(int(quota[0]) / int(quota[1]))))
    return cores


def _memory() -> int | None:
    """Bytes of memory this process may use: the machine's, at most its control group's
    limit (``None``: unknown)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    limit = _cgroup("memory.max")
    return min(memory, int(limit)) if limit and limit.isdigit() else memory


def _cgroup(name: str) -> str | None:
    """A file of this process's (version 2) control group, stripped, or ``None``."""
    try:
        return Path("/sys/fs/cgroup", name).read_text().strip()
    except OSError:
        return None


def _use_cores(args) -> None:
    """Before JAX starts, for a command that splits its batches over the cores (:func:`_auto`):
    one JAX CPU device per core, for :func:`_core_mesh`.  Left alone where the environment names
    the count (``XLA_FLAGS``' ``--xla_force_host_platform_device_count``,
    ``JAX_NUM_CPU_DEVICES``) and where JAX's backends have already started (a caller that ran
    JAX before ``main``).  A program that runs on one device is as fast either way."""
    if not _auto(args):
        return
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "") or "JAX_NUM_CPU_DEVICES" in os.environ:
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", _cores())
    except RuntimeError:  # the backends have started: keep their devices
        pass


def _core_mesh(args, rows: int):
    """``--mesh auto``: on a CPU with several JAX devices (one per core, :func:`_use_cores`), a
    ``data`` mesh of the most of them that divides ``rows``, so that each device decodes its
    share of the rows (XLA:CPU runs each dot of a small model's step on one core); ``None``
    (one device) where that is one device (one row), on an accelerator, or where the weights'
    copies on the mesh (one per device, beside the loaded ones) would take more than a quarter
    of the memory (:func:`_memory`; unknown: one device)."""
    import jax

    devices = jax.devices()
    n = max(d for d in range(1, min(len(devices), rows) + 1) if rows % d == 0)
    if n < 2 or devices[0].platform != "cpu":
        return None
    from eagle3_jax import builtin
    from eagle3_jax.sharding import make_mesh

    dirs = [args.target, args.drafter] if args.target is not None else [builtin.TARGET_DIR, builtin.DRAFTER_DIR]
    weights = sum(f.stat().st_size for d in dirs if d is not None for f in Path(d).iterdir()
                  if f.suffix in (".safetensors", ".bin"))
    if (args.dtype or ("float32" if args.target is None else None)) == "float32":
        weights *= 2  # a 16-bit checkpoint read as float32 (an overestimate for a float32 one)
    memory = _memory()
    if memory is None or n * weights > memory // 4:
        return None
    return make_mesh(data=n, devices=devices[:n])


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative token ids (e.g. 1,2,3), got {text!r}")
    return ids


COMPILE_CACHE_OFF = "off"
COMPILE_CACHE_BYTES = 4 << 30  # the cache's default bound (least recently used entries go first)
COMPILE_CACHE_MIN_SECONDS = 0.0  # every program is kept: a start loads even the small ones


def default_compile_cache() -> Path:
    """The per-user XLA compilation cache: ``$XDG_CACHE_HOME/eagle3-jax/xla`` (by default
    ``~/.cache/eagle3-jax/xla``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagle3-jax" / "xla"


def _compile_cache_arg(p):
    p.add_argument("--compile-cache", type=_path, default=None, metavar="DIR",
                   help="keep compiled XLA programs in DIR, so that the next start skips compiling them (default: "
                        "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/eagle3-jax/xla; off: no cache)")


def use_compile_cache(flag: str | None) -> Path | None:
    """Turns on JAX's persistent compilation cache (before anything compiles) in ``flag``'s
    directory, else ``$JAX_COMPILATION_CACHE_DIR``'s (JAX reads it), else
    :func:`default_compile_cache`; ``"off"`` turns it off.  Returns the directory (None: off).

    Safe across versions and processes: JAX keys each entry by its own and the backend's
    versions, the XLA flags, the devices and the program, and a size bound (here
    ``COMPILE_CACHE_BYTES`` unless ``$JAX_COMPILATION_CACHE_MAX_SIZE`` sets one) makes it evict
    the least recently used entries and lock the directory while it reads or writes, so that
    processes sharing it never see half an entry.  Programs that compiled in at least
    ``COMPILE_CACHE_MIN_SECONDS`` are kept (``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` may
    say otherwise).  A default directory that cannot be made is skipped with a warning; a
    ``flag`` directory raises ``OSError``."""
    import jax

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


def _common(p, mesh: bool = True):
    _pair_args(p)
    p.add_argument("--attention", default="xla", choices=ATTENTION_IMPLS,
                   help="target attention: xla, or pallas (the tree-attention kernel where one runs: TPU, Hopper "
                        "GPU with bfloat16; XLA elsewhere); *_interpret: a kernel in its CPU interpreter (slow)")
    p.add_argument("--max-new-tokens", type=_number("max-new-tokens", limits.MAX_NEW_TOKENS), default=None,
                   help=f"default {DEFAULT_MAX_NEW_TOKENS}; generate and experiment on the built-in pair: enough for "
                        "its longest answer")
    p.add_argument("--top-p", type=_number("top-p", limits.TOP_P), default=1.0,
                   help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=_number("top-k", limits.TOP_K), default=0, help="0: no top-k")
    p.add_argument("--thinking-budget", type=_number("thinking-budget", limits.THINKING_BUDGET), default=None,
                   metavar="B", help="thinking tokens allowed before the end of thinking is forced (default: "
                                     "unlimited; needs a tokenizer with <think>/</think>)")
    p.add_argument("--thinking-mode", choices=budget.MODES, default="hard",
                   help="hard: force at B; soft: the model may close by itself within --thinking-grace more tokens")
    p.add_argument("--thinking-grace", type=_number("thinking-grace", limits.THINKING_GRACE), default=16, metavar="G",
                   help="soft mode's grace in tokens (default 16)")
    p.add_argument("--seed", type=_number("seed", limits.SEED), default=0)
    _compile_cache_arg(p)
    if mesh:  # decoding on a mesh: generate and bench (the experiment runs on one device)
        p.add_argument("--mesh", type=_mesh_arg, default=None, metavar="{auto,none,AXES}",
                       help="decode on a device mesh, e.g. data=2,tensor=4: weights over tensor, KV caches over KV "
                            "heads, the batch over data (on CPU, simulate devices with "
                            "XLA_FLAGS=--xla_force_host_platform_device_count=8); none or auto: one device, except "
                            "that bench's default, auto, splits a batch over a CPU's cores: the eagle3-jax program "
                            "gives JAX one CPU device per core and bench decodes on data=N, N the most devices that "
                            "divide the batch, where the weights' copies fit in a quarter of the memory")
        p.add_argument("--rules", type=_sharding_arg("parse_rules"), action=_MergeRules, default=None, metavar="AXIS=MESH_AXES",
                       help="with --mesh: where logical axes go instead of the default rules, e.g. vocab=none "
                            "(replicate a vocabulary the tensor axis does not divide) or mlp=fsdp+tensor")
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")


def build_parser() -> argparse.ArgumentParser:
    """The ``eagle3-jax`` argument parser (usage errors raise ``_UsageError``)."""
    parser = _Parser(prog="eagle3-jax", description="EAGLE-3 speculative decoding on JAX. Errors are one line on "
                                                    "stderr with exit status 2; --debug shows the traceback.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="describe a target or drafter checkpoint directory")
    info.add_argument("path", type=_path)
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    info.set_defaults(func=_cmd_info)

    conv = sub.add_parser("convert", help="re-save an EAGLE-3 drafter in the official or vLLM speculators layout")
    conv.add_argument("path", type=_path, help="the drafter directory (official, SpecForge/SGLang/vLLM or speculators)")
    conv.add_argument("out", type=_path, help="the directory to write (replaced whole)")
    conv.add_argument("--to", choices=("official", "speculators"), required=True, help="the layout to write")
    conv.add_argument("--target", type=_path, default=None,
                      help="the target directory: its embedding where the drafter has none of its own, and "
                           "the verifier a speculators export names")
    conv.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype (default float32)")
    conv.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    conv.set_defaults(func=_cmd_convert)

    temperature = _number("temperature", limits.TEMPERATURE)
    gen = sub.add_parser("generate", help="answer a prompt with EAGLE-3 (the built-in pair by default) and "
                                          "compare with vanilla decoding")
    gen.add_argument("prompt", nargs="?", help="prompt text (chat template applied when the tokenizer has one)")
    _common(gen)
    gen.add_argument("--prompt", dest="prompt_flag", help="prompt text (same as the positional argument)")
    gen.add_argument("--temperature", type=temperature, default=0.0, help="0: greedy (>= 0)")
    gen.add_argument("--tree", type=_tree, help="tree budget TOTAL,DEPTH,TOPK (e.g. 60,7,10) or chainN "
                                                "(default: the built-in pair's best, else 60,7,10)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--prompt-ids", type=_token_ids, help="comma-separated prompt token ids")
    gen.add_argument("--no-compare", action="store_true", help="skip the vanilla run (no speedup figure)")
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="vanilla vs EAGLE-3 on the same prompts, in one process "
                                         "(the built-in pair and its eval set by default)")
    _common(bench)
    bench.add_argument("--temperature", type=temperature, nargs="+", help="one report per temperature (default: 0 "
                                                                          "and 0.7 for the built-in pair, else 0)")
    bench.add_argument("--tree", type=_tree, nargs="+", action=_Trees, help="tree budgets TOTAL,DEPTH,TOPK or chainN")
    bench.add_argument("--prompts", type=_path, help="JSON list of prompts (token-id lists or strings)")
    bench.add_argument("--num-prompts", type=_number("num-prompts", limits.POSITIVE),
                       help=f"first N eval tasks of the built-in pair (default {BUILTIN_PROMPTS}: the families take "
                            "turns, so 16 each), or N random 16-token prompts "
                            "when --target has no --prompts (default 4)")
    bench.add_argument("--batch-size", type=_number("batch-size", limits.POSITIVE), default=1)
    bench.add_argument("--repeats", type=_number("repeats", limits.POSITIVE), default=1,
                       help="time each setting as the fastest of N passes (each pass runs every mode on a batch before the next)")
    bench.add_argument("--json", type=_path, default="bench.json",
                       help="write the report here (missing directories are created)")
    bench.add_argument("--figure", type=_path, default="bench.png",
                       help="write the figure here (.png, .pdf, .svg, ...; missing directories are created)")
    bench.add_argument("--max-new-tokens-sweep", type=_number("max-new-tokens-sweep", limits.MAX_NEW_TOKENS), nargs="+",
                       metavar="N", help="one report per value (the cache grows with it), instead of --max-new-tokens")
    bench.add_argument("--adaptive", action="store_true",
                       help="also run the adaptive policy over the --tree budgets (and no drafting) as tiers")
    bench.add_argument("--cost", action="store_true",
                       help="report where the time goes instead: decode_step by cache size and batch, and the decode "
                            "loop's parts and cache copies per --max-new-tokens-sweep value (default 64 440)")
    bench.set_defaults(func=_cmd_bench, cores=True)  # --mesh auto: batches split over a CPU's cores

    exp = sub.add_parser("experiment", help="the two-budget experiment: thinking budget B swept with speculation "
                                            "off, then vanilla vs each tier vs adaptive at chosen B; writes a report")
    _common(exp, mesh=False)
    exp.add_argument("--budgets", type=_budget, nargs="+", default=None, metavar="B",
                     help="step 1's thinking budgets (default 0 8 16 32 64 128 unlimited)")
    exp.add_argument("--chosen", type=_budget, nargs="+", default=None, metavar="B",
                     help="step 2's budgets (default 16 64 unlimited)")
    exp.add_argument("--tree", type=_tree, nargs="+", action=_Trees, help="static tiers (default chain4 chain6 16,4,4)")
    exp.add_argument("--prompts", type=_path,
                     help="JSON list of prompts (token-id lists or strings); default: the built-in eval set")
    exp.add_argument("--num-prompts", type=_number("num-prompts", limits.POSITIVE),
                     help=f"first N prompts (default: all --prompts, or the built-in eval set's first {EXPERIMENT_PROMPTS})")
    exp.add_argument("--batch-size", type=_number("batch-size", limits.POSITIVE), default=1)
    exp.add_argument("--sampled-temperature", type=temperature, default=0.7,
                     help="also compare sampled accuracy at this temperature (0: greedy only)")
    exp.add_argument("--replay-rates", type=_number("replay-rates", limits.POSITIVE_FLOAT), nargs="*",
                     default=[4.0, 16.0, 64.0], metavar="R",
                     help="step 3: arrival rates (requests/s) replayed against a loopback server (default 4 16 64; "
                          "none: skip step 3)")
    exp.add_argument("--replay-requests", type=_number("replay-requests", limits.POSITIVE), default=24,
                     help="requests per mode and rate in step 3")
    exp.add_argument("--repeats", type=_number("repeats", limits.POSITIVE), default=3,
                     help="timed passes of steps 1 and 2, the rows taking turns (default 3): each timing is the median "
                          "with its min-max")
    exp.add_argument("--keep-policy-state", action="store_true",
                     help="carry the adaptive policy's learned state from call to call in the order run (default: "
                          "reset before each row and repeat)")
    exp.add_argument("--out", type=_path, default="experiment", help="report directory (report.md, report.json, figures)")
    exp.set_defaults(func=_cmd_experiment)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (the built-in "
                                       "pair by default)")
    _serve_common(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=_number("port", limits.PORT), default=8000)
    srv.add_argument("--speculation", type=_speculation, default="auto",
                     help="auto (the adaptive policy over a few tiers), off (vanilla), or one tier TOTAL,DEPTH,TOPK "
                          "or chainN")
    srv.add_argument("--served-model-name", help="the model id clients name (default: builtin, or the target "
                                                 "directory's name)")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    srv.set_defaults(func=_cmd_serve)

    rep = sub.add_parser("replay", help="Poisson arrivals of the eval prompts against a loopback server, for vanilla, "
                                        "each tier and adaptive: throughput, goodput, TTFT/TPOT, the crossover")
    _serve_common(rep)
    rep.add_argument("--rate", type=_number("rate", limits.POSITIVE_FLOAT), nargs="+", required=True,
                     metavar="R", help="arrival rates in requests per second")
    rep.add_argument("--requests", type=_number("requests", limits.POSITIVE), default=64, metavar="N",
                     help="requests per mode and rate (the eval prompts, cycled)")
    rep.add_argument("--tree", type=_tree, nargs="+", action=_Trees, help="static tiers (default chain4 chain6 16,4,4)")
    rep.add_argument("--max-tokens", type=_number("max-tokens", limits.MAX_NEW_TOKENS), default=256, help="per request")
    rep.add_argument("--temperature", type=_number("temperature", limits.TEMPERATURE), default=0.0)
    rep.add_argument("--ttft-slo", type=_number("ttft-slo", limits.POSITIVE_FLOAT), default=1.0, metavar="S",
                     help="goodput counts requests whose time to first token is at most S seconds")
    rep.add_argument("--tpot-slo", type=_number("tpot-slo", limits.POSITIVE_FLOAT), default=0.02, metavar="S",
                     help="... and whose time per output token is at most S seconds")
    rep.add_argument("--max-seconds", type=_number("max-seconds", limits.POSITIVE_FLOAT), default=120.0,
                     help="wall-clock bound per mode and rate (unfinished requests count as failed)")
    rep.add_argument("--seed", type=_number("seed", limits.SEED), default=0)
    rep.add_argument("--json", type=_path, default="replay.json", help="write the report here")
    rep.add_argument("--figure", type=_path, default="replay.png", help="goodput vs arrival rate per mode")
    rep.set_defaults(func=_cmd_replay)

    train = sub.add_parser("train", help="train a drafter: prepare | regenerate | vocab | fit | export | all")
    train.add_argument("step", choices=["prepare", "regenerate", "vocab", "fit", "export", "all"])
    train.add_argument("--config", type=_path, required=True, help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, read as the key's type, e.g. fit.lr=1e-4 "
                                                    "(anywhere on the line; unknown keys are refused)")
    train.add_argument("--no-resume", action="store_true",
                       help="fit (or all) starts a new run even if work_dir holds checkpoints: the earlier run's "
                            "ckpt/, best/, best.json, metrics.jsonl and export/ are first moved to "
                            "work_dir/previous_runs/run-<date-time>/ (never deleted or overwritten)")
    train.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    train.set_defaults(func=_cmd_train)

    pl = sub.add_parser("plan", help="dry run of a training config on a mesh: per-device bytes of weights, KV "
                                     "caches, drafter, optimizer state and activations (no devices needed)")
    pl.add_argument("--config", type=_path, required=True, help="YAML config (see configs/)")
    pl.add_argument("overrides", nargs="*", help="key=value config overrides, as for train")
    pl.add_argument("--mesh", help="mesh axes, e.g. data=2,tensor=4 (default: the config's mesh)")
    pl.add_argument("--batch", type=_number("batch", limits.POSITIVE), help="KV-cache batch (default: regenerate.batch_size)")
    pl.add_argument("--seq-len", type=_number("seq-len", limits.POSITIVE), help="KV-cache length (default: seq_len)")
    pl.add_argument("--device-memory", help="memory of one device, e.g. 16GiB: say whether decode and fit fit")
    pl.add_argument("--target-config", type=_path, help="the target's config.json, where the config's target directory is "
                                            "not on this machine (default: configs/targets/<name>.json beside it)")
    pl.add_argument("--topology", help="compile, not estimate: the config's decode loops, prefill, server dispatch and "
                                       "fit step for this TPU topology (e.g. v5e:2x4, v5p:2x2x2, v6e:2x4; 'config': the "
                                       "config's own; needs the 'tpu' extra, no TPU): per-device memory, fits, flops, "
                                       "bytes, roofline times")
    pl.add_argument("--tau", type=_number("tau", limits.Range(float, lo=1)),
                    help="with --topology: committed tokens per round for the predicted speedup (default: the "
                         "run's recorded acceptance, else 3)")
    pl.add_argument("--prompt-len", type=_number("prompt-len", limits.POSITIVE),
                    help="with --topology: prompt tokens of the decode programs (default: seq_len / 2)")
    pl.add_argument("--attention", choices=("xla", "pallas"), default="pallas",
                    help="with --topology: the decode programs' attention (default: pallas, the Mosaic TPU kernel)")
    pl.add_argument("--programs", help="with --topology: which of decode,slots,fit to compile (default: all)")
    pl.add_argument("--json", type=_path, help="with --topology: where to write the report (default: "
                                               "plan-<topology>.json)")
    _compile_cache_arg(pl)
    pl.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    pl.set_defaults(func=_cmd_plan)
    return parser


def _one_line(e: BaseException) -> str:
    """An exception as one line: its message (a KeyError's unquoted), else its type."""
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        msg = e.args[0]
    elif isinstance(e, OSError) and e.filename is not None and e.strerror:
        msg = f"{e.filename}: {e.strerror}"
    else:
        msg = str(e)
    msg = " ".join(msg.split())
    if not isinstance(e, (ValueError, KeyError, OSError)) or not msg:
        msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return msg


def main(argv=None, cores: bool | None = None) -> int:
    """Runs the command line; returns the exit status (2 for any input error, one line on
    stderr; 130 when interrupted).  ``--debug`` re-raises errors with their traceback.
    ``cores``: one JAX CPU device per core for ``bench``'s ``--mesh auto`` (:func:`_use_cores`);
    by default when ``argv`` is ``None`` (the program's own command line), so that a caller
    passing its own arguments keeps its JAX devices."""
    from eagle3_jax import topology

    topology.keep_cpu_default()  # libtpu installed on a host without TPUs: the CPU, quietly
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command in ("train", "plan") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code or 0
    if (argv is None) if cores is None else cores:
        _use_cores(args)
    try:
        if hasattr(args, "compile_cache"):  # the commands that compile: serve, replay, generate, bench, experiment, plan
            use_compile_cache(args.compile_cache)
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"eagle3-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        from safetensors import SafetensorError
        import yaml

        from eagle3_jax.sharding import SplitError

        known = isinstance(e, INPUT_ERRORS + (SafetensorError, yaml.YAMLError))
        hint = ""
        if isinstance(e, SplitError) and hasattr(args, "rules"):  # a command that takes --rules
            rules = {**(args.rules or {}), e.axis: None}
            hint = " (on the command line: --rules " + ",".join(
                f"{k}={'+'.join(v.mesh_axes) if v else 'none'}" for k, v in rules.items()) + ")"
        print(f"eagle3-jax {args.command}: {'error' if known else 'internal error'}: {_one_line(e)}{hint}"
              + ("" if known else " (rerun with --debug for the traceback)"), file=sys.stderr)
        return 2 if known else 1


def program() -> int:
    """The ``eagle3-jax`` program (``python -m eagle3_jax.cli``): :func:`main` on ``sys.argv``,
    with one JAX CPU device per core for ``bench``'s batches."""
    return main(cores=True)


if __name__ == "__main__":
    sys.exit(program())
