"""``eagle3-jax serve`` and ``eagle3-jax replay``: their flags and outputs checked before any
model loads, then turned into the keyword arguments of :func:`eagle3_jax.serve.server.run` and
:func:`eagle3_jax.serve.replay.run_replay` (the built-in pair's directory and eval prompts
included).  Imported by the command line only when one of those commands runs: the ``serve``
extra (FastAPI, uvicorn) loads with it.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_jax import builtin
from eagle3_jax.cli import common
from eagle3_jax.serve import replay, server
from eagle3_jax.speculation import Speculation, tier_name
from eagle3_jax.tree import TreeConfig, parse_tree

REPLAY_TIERS = ("chain4", "chain6", "16,4,4")  # replay's tiers when --tree gives none


def auto_speculation() -> Speculation:
    """``--speculation auto``: the adaptive policy over no drafting, chains of 2, 4 and 6
    and a (16, 4, 4) tree (the policy picks per round; small tiers win at large batches)."""
    return Speculation((None, TreeConfig.chain(2), TreeConfig.chain(4), TreeConfig.chain(6), TreeConfig(16, 4, 4)),
                       policy="adaptive")


def server_settings(args, target, is_builtin: bool) -> dict:
    """``build``'s keyword arguments from the ``serve`` / ``replay`` flags (not the speculation)."""
    limit = target.config.max_position_embeddings
    max_len = args.max_len if args.max_len is not None else min(limit, 4096)
    if max_len > limit:
        raise ValueError(f"--max-len {max_len} exceeds the target's max_position_embeddings ({limit})")
    efforts = args.reasoning_effort_budgets or ((16, 64, None) if is_builtin else (256, 1024, None))
    target_dir = builtin.TARGET_DIR if is_builtin else args.target
    return dict(max_batch=args.max_batch, max_len=max_len, max_queue=args.max_queue,
                rounds_per_dispatch=args.rounds_per_dispatch, dispatch_ms=args.dispatch_ms,
                temperature=server.sampling_defaults(target_dir), effort_budgets=tuple(efforts),
                max_body_bytes=args.max_body_bytes)


def serve_main(args, target, drafter, tokenizer, is_builtin: bool) -> int:
    """``eagle3-jax serve``: :func:`eagle3_jax.serve.server.run` with the flags' settings."""
    if tokenizer is None:
        raise ValueError(f"--target {args.target}: serving needs its tokenizer (tokenizer.json), found none")
    if args.speculation != "off" and drafter is None and not isinstance(args.speculation, str):
        raise ValueError(f"--speculation {tier_name(args.speculation)} needs --drafter")
    spec = None if args.speculation == "off" else (auto_speculation() if args.speculation == "auto" else args.speculation)
    name = args.served_model_name or ("builtin" if is_builtin else Path(args.target).resolve().name)
    return server.run(target, drafter, tokenizer, host=args.host, port=args.port, speculation=spec, model_name=name,
                      log_level=args.log_level, **server_settings(args, target, is_builtin))


def replay_main(args, target, drafter, tokenizer, is_builtin: bool, json_path, figure_path) -> int:
    """``eagle3-jax replay``: :func:`eagle3_jax.serve.replay.run_replay` of the built-in eval
    prompts with the flags' settings."""
    if tokenizer is None:
        raise ValueError(f"--target {args.target}: replay needs its tokenizer (tokenizer.json), found none")
    prompts = [t["prompt"] for t in builtin.eval_tasks()]
    tiers = args.tree or [parse_tree(t) for t in REPLAY_TIERS]
    kw = server_settings(args, target, is_builtin)
    kw.pop("temperature")
    replay.run_replay(target, drafter, tokenizer, prompts=prompts, rates=args.rate, requests=args.requests,
                      tiers=tiers, json_path=json_path, figure_path=figure_path, max_tokens=args.max_tokens,
                      temperature=args.temperature, ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo,
                      max_seconds=args.max_seconds, seed=args.seed, **kw)
    return 0


def cmd_serve(args) -> int:
    """``eagle3-jax serve``: the address checked before any model loads, then the server."""
    server.check_port(args.host, args.port)
    target, drafter, tok, is_builtin = common.load_pair(args)
    return serve_main(args, target, drafter, tok, is_builtin)


def cmd_replay(args) -> int:
    """``eagle3-jax replay``: the outputs checked before any model loads, then the replay."""
    json_path, figure_path = common.report_outputs(args)
    if args.target is not None and args.drafter is None:
        raise ValueError("replay needs --drafter (or no --target, for the built-in pair)")
    target, drafter, tok, is_builtin = common.load_pair(args)
    return replay_main(args, target, drafter, tok, is_builtin, json_path, figure_path)
