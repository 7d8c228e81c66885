"""The measuring commands: ``bench`` (vanilla vs EAGLE-3 on the same prompts, or with
``--cost`` where a step's and a round's time goes) and ``experiment`` (the two-budget
experiment's report)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from eagle3_jax import bench, builtin, cost, experiment, sharding
from eagle3_jax.atomic import check_output_path, write_report, write_report_figure
from eagle3_jax.cli import common
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import parse_tree


def cmd_bench(args) -> int:
    """``eagle3-jax bench``: vanilla vs EAGLE-3 on the same prompts, a report per temperature
    and ``--max-new-tokens-sweep`` value written as JSON and a figure (``--cost``: where the
    time goes instead, :func:`eagle3_jax.cost.report`)."""
    if args.target is not None and args.drafter is None:
        raise ValueError("bench needs --drafter (or no --target, for the built-in pair)")
    json_path, figure_path = common.report_outputs(args)
    if args.prompts and not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts}: no such file")
    target, drafter, tok, is_builtin = common.load_pair(args)
    grade = categories = None
    if args.prompts:
        try:
            prompts = bench.load_prompts(args.prompts, target.config.vocab_size, tok)
        except (ValueError, TypeError) as e:
            raise ValueError(str(e) if str(args.prompts) in str(e) else f"--prompts {args.prompts}: {e}") from None
    elif is_builtin:
        tasks = builtin.eval_tasks()[: args.num_prompts or common.BUILTIN_PROMPTS]
        prompts = [common.encode(tok, t["prompt"]) for t in tasks]
        grade, categories = builtin.Scorer(target, tok, tasks).grade, [t["family"] for t in tasks]
    else:
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(0, target.config.vocab_size, size=16).tolist() for _ in range(args.num_prompts or 4)]
    trees = args.tree or [parse_tree(t) for t in (builtin.BENCH_TREES if is_builtin else ["60,7,10"])]
    if args.adaptive:  # the same trees as tiers (plus no drafting) under the adaptive policy
        trees = [*trees, Speculation((None, *trees))]
    temperatures = args.temperature or ([0.0, 0.7] if is_builtin else [0.0])
    # --cost steps batches of 1, 8 and 32 rows (those the mesh divides on it), the bench its batches
    mesh = common.mesh(args, 8 if args.cost else min(args.batch_size, len(prompts)))
    if mesh is not None and not args.cost:  # placed once for every batch, not in each call
        target = sharding.place_model(target, mesh, common.rules(args))
        drafter = None if drafter is None else sharding.place_model(drafter, mesh, common.rules(args))
    doc = {"target": args.target or str(builtin.TARGET_DIR), "drafter": args.drafter or str(builtin.DRAFTER_DIR),
           "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
           "mesh": None if mesh is None else dict(mesh.shape)}
    if mesh is not None and common.splits_over_cores(args):
        print(f"batches split over {mesh.size} CPU devices (a data={mesh.size} mesh: --mesh auto, the default; "
              "--mesh none for one device)", flush=True)
    if args.cost:
        doc["cost"] = cost.report(target, drafter, prompts[0], args.tree[0] if args.tree else parse_tree("chain4"),
                                  args.max_new_tokens_sweep or [64, 440], sorted({1, args.batch_size}), mesh,
                                  common.rules(args))
        write_report(json_path, json.dumps(doc, indent=2) + "\n", "--json")
        print(f"wrote {json_path}")
        return 0
    parts: dict = {}
    reports = [bench.run_bench(target, drafter, prompts, trees=trees, max_new_tokens=max_new, temperature=t,
                               top_p=args.top_p, top_k=args.top_k, batch_size=args.batch_size, seed=args.seed,
                               repeats=args.repeats, grade=grade, categories=categories, parts=parts,
                               generate_kw={**common.thinking_kw(args, tok), "mesh": mesh, "rules": common.rules(args)})
               for max_new in (args.max_new_tokens_sweep or [common.max_new_tokens(args, is_builtin=False)])
               for t in temperatures]
    doc["reports"] = reports
    write_report(json_path, json.dumps(doc, indent=2) + "\n", "--json")
    write_report_figure(figure_path, lambda: bench.write_figure(reports, figure_path), json_path)
    print(f"wrote {json_path} and {figure_path}")
    return 0


def cmd_experiment(args) -> int:
    """``eagle3-jax experiment``: the two-budget experiment (:func:`eagle3_jax.experiment.run_experiment`),
    its summary printed and its report written to ``--out``."""
    if args.target is not None and args.drafter is None:
        raise ValueError("experiment needs --drafter (or no --target, for the built-in pair)")
    out = check_output_path(args.out, "--out", directory=True)
    target, drafter, tok, is_builtin = common.load_pair(args)
    if tok is None:
        raise ValueError(f"--target {args.target}: the experiment needs a tokenizer with <think> and </think>")
    grade = categories = details = None
    if args.prompts:
        prompts = bench.load_prompts(args.prompts, target.config.vocab_size, tok)[: args.num_prompts]
    elif is_builtin:
        tasks = builtin.eval_tasks()[: args.num_prompts or common.EXPERIMENT_PROMPTS]
        prompts = [common.encode(tok, t["prompt"]) for t in tasks]
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
    report = experiment.run_experiment(target, drafter, tok, prompts, grade=grade, categories=categories,
                                       details=details, batch_size=args.batch_size,
                                       max_new_tokens=common.max_new_tokens(args, is_builtin),
                                       sampled_temperature=args.sampled_temperature or None, seed=args.seed,
                                       repeats=args.repeats, keep_policy_state=args.keep_policy_state, out_dir=out,
                                       **kw)
    print("\n".join(report["summary"]))
    print(f"wrote {out}/report.md, report.json, quality_tokens_latency.png and budget_heatmap.png"
          + (" and goodput_vs_rate.png" if "step3" in report else ""))
    return 0
