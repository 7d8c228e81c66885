"""The recipe of the built-in pair (``eagle3_jax.builtin``): one command retrains the
reasoning target and its EAGLE-3 drafter on a CPU, then reports their metrics.

    python -m eagle3_jax.builtin.recipe --work-dir runs/builtin --out eagle3_jax/assets/builtin

Its settings are ``configs/builtin_recipe.yaml`` (:class:`Recipe`, :func:`load_recipe`).

By default the target is a 1 500-step fine-tune of ``train/base_target``, the pair's previous
target, which has already learned the families' formats. That base is the target shipped at
commit ``56a2ed4``, a 3 000-step fine-tune with the recall drill at a quarter of the drills; its
own base was shipped at ``ad9d164``, a 2 500-step fine-tune without the recall drill of a target
trained 10 000 steps from scratch (the recipe's ``from_scratch``) on the tasks as they were at commit
``9a961fb``. ``--from-scratch`` trains one from a random initialisation instead.

Stages (each resumes from ``work_dir`` when re-run; their seconds go to ``stages.json``): the
tokenizer (the base's; from scratch, a byte-level BPE, one token per digit, a ``tool`` role,
trained on the task text of the four families, ``eagle3_jax.builtin``); the target, a
16-layer Llama trained as a causal LM on generated tasks (loss on the assistant turns; 15% of
the examples cut their thinking short, with no loss on the forced ``</think>``, so that the
model answers whatever thinking it was allowed but never learns to stop early; a quarter of the
examples are copy / recall / comparison drills, :func:`drill`); the drafter, by the
project's own pipeline (``configs/builtin.yaml``: regenerate → vocab → fit → export) on the
target's own first turns; the drafter's fit continued from its weights at a lower learning
rate on the same data (:func:`polish_drafter`);
then the held-out metrics (per family: accuracy per thinking budget, the tool calls' checks,
drafter τ per tree, greedy identity) written to ``metrics.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

import eagle3_jax
from eagle3_jax import builtin, configfile, limits
from eagle3_jax.checkpoint import load_target, save_target
from eagle3_jax.config import TargetConfig
from eagle3_jax.models.target import Target
from eagle3_jax.train import pipeline
from eagle3_jax.train.config import PipelineConfig
from eagle3_jax.train.data import tokenize
from eagle3_jax.train.tiny import build_tokenizer as bpe
from eagle3_jax.tree import parse_tree

ROOT = Path(__file__).resolve().parents[2]  # the repository: configs/, train/base_target
RECIPE_FILE = ROOT / "configs" / "builtin_recipe.yaml"


@dataclasses.dataclass(frozen=True)
class FromScratch:
    """What ``--from-scratch`` changes: the target's steps and learning rate."""

    target_steps: int
    target_lr: float

    LIMITS: ClassVar[dict] = {"target_steps": limits.POSITIVE, "target_lr": limits.POSITIVE_FLOAT}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The recipe's settings, every one given by ``configs/builtin_recipe.yaml`` (its comments
    say what each is): :func:`load_recipe`."""

    seed: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    tie_embeddings: bool
    max_position_embeddings: int
    target_tasks: int
    cut_fraction: float
    drill_fraction: float
    init_target: str | None  # under the repository; None: from scratch
    target_steps: int
    target_batch: int
    seq_len: int
    target_lr: float
    warmup_steps: int
    decay_fraction: float
    drafter_conversations: int
    polish_steps: int
    polish_lr: float
    eval_tasks: int
    budgets: tuple[int, ...]
    from_scratch: FromScratch

    LIMITS: ClassVar[dict] = {
        "seed": limits.NON_NEGATIVE, "vocab_size": limits.POSITIVE, "hidden_size": limits.POSITIVE,
        "num_layers": limits.POSITIVE, "intermediate_size": limits.POSITIVE, "num_heads": limits.POSITIVE,
        "num_kv_heads": limits.POSITIVE, "max_position_embeddings": limits.MAX_LEN, "target_tasks": limits.POSITIVE,
        "cut_fraction": limits.FRACTION, "drill_fraction": limits.FRACTION, "target_steps": limits.POSITIVE,
        "target_batch": limits.POSITIVE, "seq_len": limits.MAX_LEN, "target_lr": limits.POSITIVE_FLOAT,
        "warmup_steps": limits.NON_NEGATIVE, "decay_fraction": limits.FRACTION,
        "drafter_conversations": limits.POSITIVE, "polish_steps": limits.NON_NEGATIVE,
        "polish_lr": limits.POSITIVE_FLOAT, "eval_tasks": limits.POSITIVE, "budgets": limits.NON_NEGATIVE}

    def scratch(self) -> Recipe:
        """This recipe training its target from a random initialisation (``--from-scratch``)."""
        return dataclasses.replace(self, init_target=None, target_steps=self.from_scratch.target_steps,
                                   target_lr=self.from_scratch.target_lr)


def load_recipe(overrides=(), file: str | Path = RECIPE_FILE) -> Recipe:
    """The recipe of ``configs/builtin_recipe.yaml`` (:mod:`eagle3_jax.configfile`), then
    ``key=value`` overrides."""
    return configfile.load(Recipe, file, overrides, label="recipe")


# ------------------------------------------------------------------ tokenizer
def build_tokenizer(work: Path, recipe: Recipe):
    if (work / "tokenizer" / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(work / "tokenizer"), local_files_only=True)
    tags = (builtin.THINK_OPEN, builtin.THINK_CLOSE, builtin.CALL_OPEN, builtin.CALL_CLOSE)
    corpus = []
    for conv, _ in training_text(20_000, recipe.seed + 1, drill_fraction=recipe.drill_fraction):
        text = " ".join(m["content"] for m in conv)
        for tag in tags:
            text = text.replace(tag, "")
        corpus.append(text)
    return bpe(work / "tokenizer", corpus, recipe.vocab_size, added_tokens=tags, split_digits=True,
               roles=("user", "assistant", "system", "tool"))


def drill(rng: np.random.Generator) -> builtin.Task:
    """A training-only drill: repeat a list of words, give what goes with a key in a list of
    pairs (either way round), restate facts of the qa format by name (``Recall: Bena,
    Gibun.`` → ``Fact: Bena is 54 years old.`` ...) -- nothing but copying from the prompt
    answers those -- or compare two two-digit numbers digit by digit
    (:func:`eagle3_jax.builtin.compare_line`).

    Of the drills, 20% are comparisons, 45% recalls, 15% copies and 20% pairs.  The recall
    drill came after the first fine-tune: its target restated only 28 of 84 facts right (the
    name right, the age another fact's), so qa stayed at 0.38; a qa task has one or two
    lookups, a recall drill up to six.  With a quarter of the drills recalls, the next
    fine-tune restated 62 of 84 (qa 0.78); the base of today's recipe (``train/base_target``)
    is that fine-tune, and recalls are now 45% of the drills.

    The 10 000-step run without drills never learned to copy a name or an operator from the
    prompt (teacher-forced loss on names stayed at ln 24; the input rows of ``<`` and ``>``
    ended at cosine 0.91), so qa answered one name and code misread its condition.  The words
    are the families' own names, goods and comparison operators."""
    kind = rng.random()
    if kind < 0.2:
        a, b = (int(v) for v in rng.integers(10, 100, 2))
        if rng.random() < 0.4:  # equal tens, where the ones decide
            b = 10 * (a // 10) + int(rng.integers(10))
        op = "<>"[int(rng.integers(2))]
        line = builtin.compare_line(a, op, b)
        return builtin.Task("drill", line.split("? ")[0] + "?", (line + ".",), line.rsplit(": ", 1)[1])
    if kind < 0.65:  # recall: restate facts by name, the qa thinking's lookup, several to an example
        n = int(rng.integers(2, 7))
        names, ages, facts = builtin.age_facts(rng, n)
        order = [int(i) for i in rng.permutation(n)[:int(rng.integers(1, n + 1))]]
        return builtin.Task("drill", "Facts: " + " ".join(facts) + " Recall: " + ", ".join(names[i] for i in order) + ".",
                            tuple(f"Fact: {facts[i]}" for i in order), str(ages[order[-1]]))
    words = [*builtin.task_words(), "<", ">"]
    if kind < 0.8:
        k = int(rng.integers(3, 9))
        items = [words[i] for i in rng.choice(len(words) - 2, k, replace=False)]
        for pos in rng.choice(k - 1, int(rng.integers(0, 3)), replace=False):  # operators, never last
            items[pos] = words[-2 + int(rng.integers(2))]
        seq = " ".join(items)
        return builtin.Task("drill", f"Copy: {seq}.", (), seq)
    n = int(rng.integers(2, 7))
    pick = rng.choice(len(words) - 2, 2 * n, replace=False)
    keys = [words[i] for i in pick[:n]]
    numbers = rng.choice(np.arange(10, 100), n, replace=False)
    values = [words[w] if rng.random() < 0.6 else str(v) for w, v in zip(pick[n:], numbers)]
    i = int(rng.integers(n))
    pairs = ", ".join(f"{k} {v}" for k, v in zip(keys, values))
    if rng.random() < 0.6:
        return builtin.Task("drill", f"Pairs: {pairs}. What goes with {keys[i]}?", (), values[i])
    return builtin.Task("drill", f"Pairs: {pairs}. What comes before {values[i]}?", (), keys[i])


def training_text(n: int, seed: int, cut_fraction: float = 0.0, drill_fraction: float = 0.0) -> list[tuple[list[dict], bool]]:
    """Chat conversations for ``n`` tasks, each with whether its thinking was cut short
    (``cut_fraction`` of them think only part of the way); ``drill_fraction`` > 0 adds
    :func:`drill` examples so that they make up that share, shuffled in."""
    if not 0.0 <= drill_fraction < 1.0:
        raise ValueError(f"drill_fraction must be in [0, 1), got {drill_fraction!r}")
    rng = np.random.default_rng(seed + 7)
    out = []
    for task in builtin.make_tasks(n, seed):
        cut = int(rng.integers(0, len(task.steps))) if rng.random() < cut_fraction else None
        out.append((task.messages(cut), cut is not None))
    if drill_fraction > 0:
        out += [(drill(rng).messages(), False) for _ in range(round(n * drill_fraction / (1 - drill_fraction)))]
        out = [out[i] for i in rng.permutation(len(out))]
    return out


# ------------------------------------------------------------------ target
def target_config(recipe: Recipe, tok):
    return TargetConfig.from_dict(dict(
        model_type="llama", hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_layers,
        intermediate_size=recipe.intermediate_size, num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads, vocab_size=len(tok), tie_word_embeddings=recipe.tie_embeddings,
        max_position_embeddings=recipe.max_position_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0,
        eos_token_id=[tok.eos_token_id]), source="recipe")


def lm_stream(examples, tok) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All conversations back to back: ``(ids, loss_mask, example_starts)``.  In a cut-short
    example the ``</think>`` is what a thinking budget forces, not what the model should
    say, so it carries no loss: the model learns to answer after it, never to stop early."""
    close = tok.convert_tokens_to_ids(builtin.THINK_CLOSE)
    pairs = []
    for conv, cut in tqdm(examples, desc="tokenize"):
        ids, mask = tokenize(tok, conv)
        pairs.append((ids, mask & (ids != close) if cut else mask))
    starts = np.cumsum([0] + [len(i) for i, _ in pairs[:-1]])
    return np.concatenate([i for i, _ in pairs]), np.concatenate([m for _, m in pairs]), starts


def lr_schedule(recipe: Recipe):
    """Warmup, constant, linear decay: up to the decay the schedule does not depend on the
    total, so a longer run can resume from any checkpoint taken before its decay began."""
    decay_start = max(recipe.warmup_steps, int(recipe.target_steps * (1 - recipe.decay_fraction)))
    return optax.join_schedules([
        optax.linear_schedule(0.0, recipe.target_lr, recipe.warmup_steps),
        optax.constant_schedule(recipe.target_lr),
        optax.linear_schedule(recipe.target_lr, recipe.target_lr * 0.05, recipe.target_steps - decay_start),
    ], [recipe.warmup_steps, decay_start])


def train_target(work: Path, recipe: Recipe, tok, init: Path | None = None):
    """Trains the target as a causal LM; windows start at an example boundary and run on
    into the next examples.  ``init``: a saved target to fine-tune instead of a random
    initialisation (its tokenizer is the run's).  Checkpoints every 100 steps; a re-run
    resumes."""
    if init is not None:
        model = load_target(init, dtype="float32")
    else:
        model = Target(target_config(recipe, tok), rngs=nnx.Rngs(recipe.seed))
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    ids, mask, starts = lm_stream(training_text(recipe.target_tasks, recipe.seed, recipe.cut_fraction,
                                                recipe.drill_fraction), tok)
    T, B = recipe.seq_len, recipe.target_batch
    starts = starts[starts + T + 1 <= len(ids)]
    schedule = lr_schedule(recipe)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=0.01))
    opt_state = opt.init(params)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    @jax.jit
    def step(params, opt_state, x_BxT1, m_BxT):
        def loss_fn(p):
            logits_BxTxV, _, _ = nnx.merge(graph, p, rest)(x_BxT1[:, :-1], pos)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, x_BxT1[:, 1:])
            return (ce * m_BxT).sum() / jnp.maximum(m_BxT.sum(), 1)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ckpt = ocp.CheckpointManager((work / "target_ckpt").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=30))
    first = 0
    if ckpt.latest_step() is not None:
        state = ckpt.restore(ckpt.latest_step(), args=ocp.args.StandardRestore(
            {"params": nnx.to_pure_dict(params), "opt_state": opt_state}))
        nnx.replace_by_pure_dict(params, state["params"])
        opt_state, first = state["opt_state"], ckpt.latest_step()
    bar = tqdm(range(first, recipe.target_steps), initial=first, total=recipe.target_steps, desc="target")
    with open(work / "target_metrics.jsonl", "a") as log:
        for s in bar:
            rows = np.random.default_rng([recipe.seed, s]).choice(starts, B)
            window = ids[rows[:, None] + np.arange(T + 1)]
            wmask = mask[rows[:, None] + np.arange(1, T + 1)]
            params, opt_state, loss = step(params, opt_state, jnp.asarray(window, jnp.int32), jnp.asarray(wmask, jnp.float32))
            if (s + 1) % 20 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}")
                log.write(json.dumps({"step": s + 1, "loss": float(loss)}) + "\n")
                log.flush()
            if (s + 1) % 100 == 0 or s + 1 == recipe.target_steps:
                ckpt.save(s + 1, args=ocp.args.StandardSave({"params": nnx.to_pure_dict(params), "opt_state": opt_state}))
    ckpt.wait_until_finished()
    return nnx.merge(graph, params, rest)


def export_target(model, tok, path: Path):
    save_target(model, path, dtype="bfloat16", tokenizer=tok,
                generation_config={"eos_token_id": tok.eos_token_id, "do_sample": False})


# ------------------------------------------------------------------ drafter
def train_drafter(work: Path, recipe: Recipe, overrides=()):
    """The project's own pipeline on the exported target: regenerate → vocab → fit → export
    (to ``work/drafter_fit``; run in ``work/drafter_run``)."""
    data = work / "drafter_conversations.jsonl"
    with open(data, "w") as f:
        for conv, _ in training_text(recipe.drafter_conversations, recipe.seed + 2):
            f.write(json.dumps({"conversations": conv[:2]}) + "\n")  # the first turn (tool results are not the target's)
    pipeline.run("all", _drafter_config(work, [f"data={data}", f"work_dir={work / 'drafter_run'}",
                                               f"export_dir={work / 'drafter_fit'}", *overrides]))


def polish_drafter(work: Path, recipe: Recipe, overrides=()):
    """The drafter's fit continued: ``recipe.polish_steps`` more steps from the weights in
    ``work/drafter_fit`` at ``recipe.polish_lr`` (a second warmup and cosine decay) on the same
    regenerated conversations and draft vocabulary (``work/drafter_run``'s), run in
    ``work/drafter_polish_run`` and exported to ``work/drafter``; with no steps, the fitted
    drafter is the pair's.  ``overrides`` as for :func:`train_drafter` (the steps and
    learning rate are the recipe's)."""
    if recipe.polish_steps == 0:
        shutil.copytree(work / "drafter_fit", work / "drafter", dirs_exist_ok=True)
        return
    run = work / "drafter_polish_run"
    run.mkdir(parents=True, exist_ok=True)
    for name in ("regenerated.npz", "vocab.npz"):
        if not (run / name).exists():
            shutil.copy(work / "drafter_run" / name, run / name)
    cfg = _drafter_config(work, [f"work_dir={run}", f"export_dir={work / 'drafter'}", *overrides,
                                 f"fit.steps={recipe.polish_steps}", f"fit.lr={recipe.polish_lr}",
                                 f"drafter.init={work / 'drafter_fit'}"])
    for step in ("fit", "export"):
        pipeline.run(step, cfg)


def _drafter_config(work: Path, overrides) -> PipelineConfig:
    return pipeline.load_config(ROOT / "configs" / "builtin.yaml", [f"target={work / 'target'}", *overrides])


# ------------------------------------------------------------------ evaluation
EVAL_TREES = ("chain4", "16,4,4")


def _family_rows(outcomes: list[dict]) -> dict:
    """Accuracy, mean thinking / answer tokens and the timeout rate, per family and overall."""
    rows = {}
    for fam in [*builtin.FAMILIES, "all"]:
        sel = [o for o in outcomes if fam in ("all", o["family"])]
        if sel:
            rows[fam] = {"accuracy": float(np.mean([o["correct"] for o in sel])),
                         "thinking_tokens": float(np.mean([o["thinking_tokens"] for o in sel])),
                         "answer_tokens": float(np.mean([o["answer_tokens"] for o in sel])),
                         "timeout_rate": float(np.mean([o["finish_reason"] == "length" for o in sel])), "n": len(sel)}
    return rows


def _tool_rows(outcomes: list[dict]) -> dict:
    checks = [o["tool"] for o in outcomes if o["tool"] is not None]
    return {k: float(np.mean([c[k] for c in checks])) for k in checks[0]} if checks else {}


def evaluate(target, drafter, tok, tasks: list[dict], budgets, max_new_tokens: int = builtin.MAX_RESPONSE_TOKENS, trees=EVAL_TREES) -> dict:
    """On the held-out tasks (:func:`eagle3_jax.builtin.run_tasks`, tool turns included):
    per family × thinking budget B, accuracy, thinking / answer tokens and timeouts (vanilla
    greedy); the tool calls' checks at unlimited B; per family × tree, greedy τ and token
    identity with vanilla (both turns)."""
    by_family = {f: [t for t in tasks if t["family"] == f] for f in builtin.FAMILIES}
    by_budget, vanilla = {}, {}
    for b in [*budgets, None]:
        # ``+ 1``: generate() counts the newline this format always writes after ``<think>``
        kw = {} if b is None else {"thinking_budget": b + 1}
        outs = [o for f in builtin.FAMILIES
                for o in builtin.run_tasks(target, tok, by_family[f], max_new_tokens=max_new_tokens, **kw)]
        by_budget["unlimited" if b is None else str(b)] = _family_rows(outs)
        if b is None:
            vanilla = {f: [o for o in outs if o["family"] == f] for f in builtin.FAMILIES}
    taus = {}
    for name in trees:
        row, same = {}, True
        for f in builtin.FAMILIES:
            outs = builtin.run_tasks(target, tok, by_family[f], drafter=drafter, tree=parse_tree(name),
                                     max_new_tokens=max_new_tokens)
            row[f] = outs[0]["stats"]["tau"]
            same &= all((o["tokens"], o["final_tokens"]) == (v["tokens"], v["final_tokens"])
                        for o, v in zip(outs, vanilla[f]))
        taus[name] = {"tau": row, "identical_to_vanilla": same}
    return {"by_thinking_budget": by_budget, "tool_calls": _tool_rows([o for v in vanilla.values() for o in v]),
            "greedy": taus}


def write_eval_set(path: Path, recipe: Recipe):
    tasks = [dataclasses.asdict(t) for t in builtin.make_tasks(recipe.eval_tasks, builtin.EVAL_SEED)]
    path.write_text(json.dumps(tasks, indent=1) + "\n")
    return tasks


def _timed(work: Path, stage: str, fn):
    """Runs ``fn`` and adds its wall-clock seconds to ``work/stages.json`` (kept across resumes)."""
    path = work / "stages.json"
    times = json.loads(path.read_text()) if path.exists() else {}
    start = time.time()
    out = fn()
    times[stage] = times.get(stage, 0.0) + time.time() - start
    path.write_text(json.dumps(times, indent=1) + "\n")
    print(f"{stage}: {times[stage]:.0f} s")
    return out


def main(argv=None):
    default = load_recipe()
    p = argparse.ArgumentParser(description="retrain the built-in target (a fine-tune of train/base_target, or from "
                                            "scratch) and its drafter, evaluate them and install the pair")
    p.add_argument("--work-dir", type=os.path.expanduser, default="runs/builtin")
    p.add_argument("--out", type=os.path.expanduser, default=str(builtin.ASSETS),
                   help="where the pair is installed (the package's assets)")
    p.add_argument("--from-scratch", action="store_true",
                   help=f"train the target from a random initialisation and a tokenizer of its own "
                        f"({default.from_scratch.target_steps} steps at lr {default.from_scratch.target_lr}) instead of "
                        f"fine-tuning {default.init_target}")
    p.add_argument("--init-target", type=os.path.expanduser, default=None,
                   help=f"the saved target to fine-tune (default {default.init_target}); the run keeps its tokenizer")
    p.add_argument("--target-steps", type=int, default=None, help="default: the recipe's (or its from_scratch's)")
    p.add_argument("--target-lr", type=float, default=None, help="default: the recipe's (or its from_scratch's)")
    p.add_argument("--polish-steps", type=int, default=None,
                   help=f"steps of the drafter's continued fit (default {default.polish_steps}; 0: none)")
    p.add_argument("--polish-lr", type=float, default=None, help=f"its learning rate (default {default.polish_lr})")
    p.add_argument("--stage", choices=["all", "target", "drafter", "polish", "eval"], default="all")
    p.add_argument("overrides", nargs="*", help="drafter config overrides for both of its fits, e.g. fit.batch_size=8 "
                                                "(the continued fit's steps and learning rate are --polish-*)")
    args = p.parse_args(argv)
    if args.from_scratch and args.init_target:
        p.error("--from-scratch and --init-target exclude each other")
    if args.polish_steps is not None and args.polish_steps < 0:
        p.error(f"--polish-steps: expected 0 or more, got {args.polish_steps}")
    if args.polish_lr is not None and not args.polish_lr > 0:
        p.error(f"--polish-lr: expected a positive learning rate, got {args.polish_lr}")
    given = {k: v for k, v in (("init_target", args.init_target), ("target_steps", args.target_steps),
                               ("target_lr", args.target_lr), ("polish_steps", args.polish_steps),
                               ("polish_lr", args.polish_lr)) if v is not None}
    recipe = dataclasses.replace(default.scratch() if args.from_scratch else default, **given)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    # the recipe's base lies under the repository; a path given on the command line is the caller's
    init = None
    if recipe.init_target is not None:
        init = Path(args.init_target) if args.init_target else ROOT / recipe.init_target
        if not (init / "config.json").exists():
            p.error(f"--init-target: no saved target (config.json) in {init}")
    if init is not None and not (work / "tokenizer" / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(init), local_files_only=True).save_pretrained(str(work / "tokenizer"))
    tok = build_tokenizer(work, recipe)
    if args.stage in ("all", "target") and not (work / "target" / "config.json").exists():
        _timed(work, "target", lambda: export_target(train_target(work, recipe, tok, init), tok, work / "target"))
    if args.stage in ("all", "drafter") and not (work / "drafter_fit" / "config.json").exists():
        _timed(work, "drafter", lambda: train_drafter(work, recipe, args.overrides))
    if args.stage in ("all", "polish") and not (work / "drafter" / "config.json").exists():
        _timed(work, "polish", lambda: polish_drafter(work, recipe, args.overrides))
    if args.stage in ("all", "eval"):
        tasks = write_eval_set(work / "eval.json", recipe)
        target = eagle3_jax.load_target(work / "target", dtype="float32")
        drafter = eagle3_jax.load_drafter(work / "drafter", target=target)
        metrics = _timed(work, "eval", lambda: evaluate(target, drafter, tok, tasks, recipe.budgets))
        fits = [{"run": run, **json.loads((work / run / "best.json").read_text())}
                for run in ("drafter_run", "drafter_polish_run") if (work / run / "best.json").exists()]
        metrics.update(recipe={k: v for k, v in dataclasses.asdict(recipe).items() if k != "from_scratch"}, drafter_best=fits[-1], drafter_fits=fits,
                       stage_seconds=json.loads((work / "stages.json").read_text()))
        (work / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        print(json.dumps(metrics, indent=2))
        out = Path(args.out)
        for name in ("target", "drafter"):
            shutil.rmtree(out / name, ignore_errors=True)
            shutil.copytree(work / name, out / name)
        for name in ("eval.json", "metrics.json"):
            shutil.copy(work / name, out / name)
        print(f"installed the pair under {out}")


if __name__ == "__main__":
    main()
