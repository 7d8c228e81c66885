"""The commands on a checkpoint or one prompt: ``info`` (a checkpoint described), ``convert``
(a drafter re-saved in another layout) and ``generate`` (a prompt answered with EAGLE-3 and
compared with vanilla decoding; the built-in pair's tool turn after it)."""

from __future__ import annotations

import json
from pathlib import Path

import eagle3_jax
from eagle3_jax import builtin, checkpoint
from eagle3_jax.checkpoint.load import read_target_embedding
from eagle3_jax.cli import common
from eagle3_jax.serve.text import blank_problem, encoding_problem
from eagle3_jax.speculation import tier_name
from eagle3_jax.tree import parse_tree


def cmd_info(args) -> int:
    """``eagle3-jax info``: prints :func:`eagle3_jax.checkpoint.describe_checkpoint` (``--json``: as JSON)."""
    info = checkpoint.describe_checkpoint(Path(args.path))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def cmd_convert(args) -> int:
    """``eagle3-jax convert``: re-saves a drafter directory in another layout (official <-> speculators)."""
    embed = None if args.target is None else read_target_embedding(args.target)
    drafter = eagle3_jax.load_drafter(args.path, embed=embed)
    verifier = args.target if args.to == "speculators" else None
    out = eagle3_jax.save_drafter(drafter, args.out, dtype=args.dtype, format=args.to, verifier=verifier)
    print(f"wrote {out} ({args.to} layout, {args.dtype})")
    return 0


def cmd_generate(args) -> int:
    """``eagle3-jax generate``: the prompt answered (the faster of two runs), its tau and speed,
    and unless ``--no-compare`` vanilla decoding's speed beside it."""
    given = [name for name, v in (("PROMPT", args.prompt), ("--prompt", args.prompt_flag),
                                  ("--prompt-ids", args.prompt_ids)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one prompt, not {' and '.join(given)}")
    if not given:
        raise ValueError("give a prompt: eagle3-jax generate \"TEXT\" (or --prompt-ids 1,2,3)")
    text = args.prompt if args.prompt is not None else args.prompt_flag
    if text is not None:
        blank = blank_problem(text)
        problem = encoding_problem(text) or (blank and f"{blank}: give the text to answer")
        if problem:
            raise ValueError(f"{given[0]} {problem}")
    target, drafter, tok, is_builtin = common.load_pair(args)
    if args.prompt_ids:
        vocab = target.config.vocab_size
        if max(args.prompt_ids) >= vocab:
            raise ValueError(f"--prompt-ids: token id {max(args.prompt_ids)} is out of range for the target's "
                             f"vocabulary (0..{vocab - 1})")
        prompts = [args.prompt_ids]
    else:
        if tok is None:
            raise ValueError(f"--target {args.target} has no tokenizer: pass --prompt-ids 1,2,3 instead of a text prompt")
        prompts = [common.encode(tok, text, args.raw)]
    tree = args.tree or parse_tree(builtin.DEFAULT_TREE if is_builtin else "60,7,10")
    kw = dict(max_new_tokens=common.max_new_tokens(args, is_builtin), temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, seed=args.seed, tree=tree, mesh=common.mesh(args), rules=common.rules(args),
              **common.thinking_kw(args, tok))

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
    line = f"\n[{st['new_tokens']} tokens; EAGLE-3 {tier_name(tree)}: tau {st['tau']:.2f} over {st['rounds'][0]} rounds, " \
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
    turn = None if first is None or prompt is None or args.raw else \
        builtin.tool_turn(target, tok, prompt, first, drafter=drafter, **{k: v for k, v in kw.items() if k != "tokenizer"})
    if turn is None:
        return 0
    call, result, final = turn
    print(f"\nTool call: {json.dumps(call)}\nTool result: {result}\n\nFinal answer:\n{final.strip()}")
    return 0
