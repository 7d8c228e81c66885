"""The ``eagle3-jax`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3_jax.layers import ATTENTION_IMPLS


def describe_checkpoint(path: Path) -> dict:
    """A JSON-able description of a target or drafter checkpoint directory."""
    from eagle3_jax.checkpoint import is_drafter_config
    from eagle3_jax.config import DrafterConfig, TargetConfig, read_config_json

    raw = read_config_json(path)
    files = sorted(p.name for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    if is_drafter_config(raw):
        cfg = DrafterConfig.from_dict(raw, source=str(Path(path) / "config.json"))
        return {
            "kind": "EAGLE-3 drafter",
            "architectures": raw.get("architectures"),
            "hidden_size": cfg.hidden_size,
            "fc_in_features": 3 * cfg.target_hidden_size,
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
        "feature_width": 3 * cfg.hidden_size,
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


def _load_pair(args):
    """``(target, drafter, tokenizer, builtin)``: the given checkpoints, or the built-in pair."""
    import eagle3_jax
    from eagle3_jax import builtin

    if args.target is None:
        if args.drafter:
            raise ValueError("--drafter needs --target (without --target the built-in pair is used)")
        return (*builtin.load(args.dtype or "float32", attention_impl=args.attention), True)
    target = eagle3_jax.load_target(args.target, dtype=args.dtype, attention_impl=args.attention)
    drafter = eagle3_jax.load_drafter(args.drafter, target=target) if args.drafter else None
    return target, drafter, _tokenizer(Path(args.target)), False


def _encode(tok, text: str, raw: bool = False) -> list[int]:
    from eagle3_jax.decode import encode_chat

    return encode_chat(tok, [{"role": "user", "content": text}]) if tok.chat_template and not raw else tok.encode(text)


def _cmd_generate(args) -> int:
    import eagle3_jax
    from eagle3_jax import builtin
    from eagle3_jax.bench import parse_tree, tree_name

    target, drafter, tok, is_builtin = _load_pair(args)
    text = args.prompt if args.prompt is not None else args.prompt_flag
    if args.prompt_ids:
        prompts = [[int(x) for x in args.prompt_ids.split(",")]]
    elif text is not None:
        if tok is None:
            raise ValueError(f"{args.target} has no tokenizer: pass --prompt-ids 1,2,3 instead of a text prompt")
        prompts = [_encode(tok, text, args.raw)]
    else:
        raise ValueError("give a prompt: eagle3-jax generate \"TEXT\" (or --prompt-ids 1,2,3)")
    tree = parse_tree(args.tree or (builtin.DEFAULT_TREE if is_builtin else "60,7,10"))
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed, tree=tree)

    def timed(drafter_):  # the faster of two runs (same seed, same output): compilation and warm-up excluded
        return min((eagle3_jax.generate(target, drafter_, prompts, **kw) for _ in range(2)),
                   key=lambda r: r.stats["seconds"])

    res = timed(drafter)
    out = res.tokens[0]
    if tok is None:
        print(" ".join(map(str, out)))
    else:
        thinking, answer = builtin.split_response(tok.decode(out, skip_special_tokens=True))
        print(f"Thinking:\n{thinking}\n\nAnswer:\n{answer}" if thinking else answer)
    st = res.stats
    if drafter is None:
        print(f"\n[{st['new_tokens']} tokens, {st['tokens_per_second']:.1f} tok/s, vanilla]")
        return 0
    line = f"\n[{st['new_tokens']} tokens; EAGLE-3 {tree_name(tree)}: tau {st['tau']:.2f} over {st['rounds'][0]} rounds, " \
           f"{st['tokens_per_second']:.1f} tok/s"
    if not args.no_compare:
        base = timed(None)
        line += f"; vanilla {base.stats['tokens_per_second']:.1f} tok/s; " \
                f"speedup {st['tokens_per_second'] / base.stats['tokens_per_second']:.2f}x"
        if args.temperature == 0:
            line += f"; identical to vanilla: {base.tokens == res.tokens}"
    print(line + "]")
    return 0


def _cmd_bench(args) -> int:
    import jax

    from eagle3_jax import builtin
    from eagle3_jax.bench import load_prompts, parse_tree, run_bench, write_figure

    target, drafter, tok, is_builtin = _load_pair(args)
    if drafter is None:
        raise ValueError("bench needs --drafter (or no --target, for the built-in pair)")
    grade = None
    if args.prompts:
        prompts = load_prompts(args.prompts, tok)
    elif is_builtin:
        tasks = builtin.eval_tasks()[: args.num_prompts]
        prompts = [_encode(tok, t["prompt"]) for t in tasks]
        grade = lambda i, toks: builtin.grade(tasks[i], tok.decode(toks, skip_special_tokens=True))  # noqa: E731
    else:
        import numpy as np

        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(0, target.config.vocab_size, size=16).tolist() for _ in range(args.num_prompts or 4)]
    trees = [parse_tree(t) for t in args.tree or (builtin.BENCH_TREES if is_builtin else ["60,7,10"])]
    temperatures = args.temperature or ([0.0, 0.7] if is_builtin else [0.0])
    parts: dict = {}
    reports = [run_bench(target, drafter, prompts, trees=trees, max_new_tokens=args.max_new_tokens, temperature=t,
                         top_p=args.top_p, top_k=args.top_k, batch_size=args.batch_size, seed=args.seed,
                         repeats=args.repeats, grade=grade, parts=parts) for t in temperatures]
    doc = {"target": args.target or str(builtin.TARGET_DIR), "drafter": args.drafter or str(builtin.DRAFTER_DIR),
           "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "reports": reports}
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    write_figure(reports, args.figure)
    print(f"wrote {args.json} and {args.figure}")
    return 0


def _cmd_train(args) -> int:
    from train import pipeline

    cfg = pipeline.load_config(args.config, args.overrides)
    pipeline.run(args.step, cfg, resume=not args.no_resume)
    return 0


def _common(p):
    p.add_argument("--target", help="Hugging Face target checkpoint directory (default: the built-in pair)")
    p.add_argument("--drafter", help="EAGLE-3 drafter checkpoint directory (omit for vanilla decoding)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's; float32 built in)")
    p.add_argument("--attention", default="xla", choices=ATTENTION_IMPLS,
                   help="target attention: xla, or pallas (the tree-attention kernel where one runs: TPU, Hopper "
                        "GPU with bfloat16; XLA elsewhere); *_interpret: a kernel in its CPU interpreter (slow)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-jax", description="EAGLE-3 speculative decoding on JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="describe a target or drafter checkpoint directory")
    info.add_argument("path")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_cmd_info)

    gen = sub.add_parser("generate", help="answer a prompt with EAGLE-3 (the built-in pair by default) and "
                                          "compare with vanilla decoding")
    gen.add_argument("prompt", nargs="?", help="prompt text (chat template applied when the tokenizer has one)")
    _common(gen)
    gen.add_argument("--prompt", dest="prompt_flag", help="prompt text (same as the positional argument)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--tree", help="tree budget TOTAL,DEPTH,TOPK (e.g. 60,7,10) or chainN "
                                    "(default: the built-in pair's best, else 60,7,10)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    gen.add_argument("--no-compare", action="store_true", help="skip the vanilla run (no speedup figure)")
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="vanilla vs EAGLE-3 on the same prompts, in one process "
                                         "(the built-in pair and its eval set by default)")
    _common(bench)
    bench.add_argument("--temperature", type=float, nargs="+", help="one report per temperature (default: 0 and 0.7 "
                                                                    "for the built-in pair, else 0)")
    bench.add_argument("--tree", nargs="+", help="tree budgets TOTAL,DEPTH,TOPK or chainN")
    bench.add_argument("--prompts", help="JSON list of prompts (token-id lists or strings)")
    bench.add_argument("--num-prompts", type=int, help="first N eval tasks of the built-in pair (default: all), or "
                                                       "N random 16-token prompts when --target has no --prompts (default 4)")
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--repeats", type=int, default=1, help="time each setting as the fastest of N runs")
    bench.add_argument("--json", default="bench.json", help="write the report here")
    bench.add_argument("--figure", default="bench.png", help="write the PNG figure here")
    bench.set_defaults(func=_cmd_bench)

    train = sub.add_parser("train", help="train a drafter: prepare | regenerate | vocab | fit | export | all")
    train.add_argument("step", choices=["prepare", "regenerate", "vocab", "fit", "export", "all"])
    train.add_argument("--config", required=True, help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. fit.lr=1e-4 (anywhere on the line)")
    train.add_argument("--no-resume", action="store_true", help="fit from scratch even if checkpoints exist")
    train.set_defaults(func=_cmd_train)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "train" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"eagle3-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
