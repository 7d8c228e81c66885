"""The built-in model pair: a small reasoning target trained by its recipe
(:mod:`eagle3_jax.builtin.recipe`) and its EAGLE-3 drafter, shipped in the package so that the
main job runs offline.

The target answers four task families.  Each response is a ``<think> … </think>`` phase of
short lines, each depending on the prompt and the previous lines only (so a small model
learns the procedure), then ``The answer is X.``; :func:`grade` checks it.

* **qa** — a question answered from facts in the prompt (lookup, comparison), little
  thinking: ``Facts: Kamo is 12 years old. Bosu is 31 years old. … Question: How old is Kamo?``
  (or who is older / younger of two); the thinking restates the facts it needs word for
  word, and compares two numbers digit by digit (:func:`compare_line`)
* **math** — repeated addition or subtraction, 1 to 12 steps:
  ``Start at 17 and add 3, 4 times.`` → ``Step 1: 17 + 3 = 20, 3 left.`` … → ``The answer is 29.``
  (each step counts down the steps left, so that when to stop is read off the last line)
* **code** — trace a small program (assignments, a loop, a condition) and give what it prints;
  the thinking copies the ``if`` block from the program before deciding it.
* **tool** — decide on a tool call after thinking and emit it as JSON between
  ``<tool_call>`` and ``</tool_call>``; :func:`run_tasks` runs the tool (:func:`call_tool`: a
  calculator, a price table), appends the result as a ``tool`` turn and the model answers.

Without thinking, math and code need their whole computation in one step, so accuracy rises
with the thinking budget there; qa needs almost none.  Tasks are generated from a seed (no
data set is downloaded); the held-out evaluation set uses seeds the training data never uses
and :func:`make_tasks` skips any prompt of it.  The graders re-derive every answer from the
prompt text with their own parsers (and run the programs with Python), independently of the
generator.

By role: ``tasks`` (the generators, the tools), ``grading`` (the graders), ``running`` (tasks
run end to end, :class:`Scorer`), ``recipe`` (retraining the pair: ``python -m
eagle3_jax.builtin.recipe``, needs the ``train`` extra); this package holds the shipped pair's
paths and loading, and every public name of the first three.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_jax.checkpoint import load_drafter, load_target

from eagle3_jax.builtin.grading import (ANSWER_RE, expected_answer, final_answer, grade, split_response,
                                        tool_check)
from eagle3_jax.builtin.running import MAX_RESPONSE_TOKENS, Scorer, run_tasks, tool_turn, transcript
from eagle3_jax.builtin.tasks import (CALL_CLOSE, CALL_OPEN, EVAL_SEED, EVAL_TASKS, FAMILIES, GENERATORS, N_GOODS,
                                      N_NAMES, THINK_CLOSE, THINK_OPEN, TOOLS, Task, age_facts, calculate, call_tool,
                                      code_task, compare_line, held_out_prompts, lexicon, make_tasks, math_task,
                                      parse_call, price_table, qa_task, task_from_dict, task_words, tool_task)

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "builtin"
TARGET_DIR = ASSETS / "target"
DRAFTER_DIR = ASSETS / "drafter"
EVAL_FILE = ASSETS / "eval.json"
DEFAULT_TREE = "chain14"  # the best budget of the default bench on a 2-core CPU, batch 1 and 32 (README, "Benchmark" and "Decode cost")
# chain14: the shipped drafter is trained on sixteen draft positions (README, "Retraining it")
BENCH_TREES = ("chain4", "chain6", "chain14", "16,4,4", "32,6,8", "60,7,10")

__all__ = [
    "ANSWER_RE", "ASSETS", "BENCH_TREES", "CALL_CLOSE", "CALL_OPEN", "DEFAULT_TREE", "DRAFTER_DIR", "EVAL_FILE",
    "EVAL_SEED", "EVAL_TASKS", "FAMILIES", "GENERATORS", "MAX_RESPONSE_TOKENS", "N_GOODS", "N_NAMES", "Scorer",
    "TARGET_DIR", "THINK_CLOSE", "THINK_OPEN", "TOOLS", "Task", "age_facts", "available", "calculate", "call_tool",
    "code_task", "compare_line", "eval_tasks", "expected_answer", "final_answer", "grade", "held_out_prompts",
    "lexicon", "load", "make_tasks", "math_task", "parse_call", "price_table", "qa_task", "run_tasks",
    "split_response", "task_from_dict", "task_words", "tool_check", "tool_task", "tool_turn", "transcript",
]


def eval_tasks() -> list[dict]:
    """The shipped held-out evaluation set (task dicts with ``family``, ``prompt``, ``answer``)."""
    return json.loads(EVAL_FILE.read_text())


def available() -> bool:
    return (TARGET_DIR / "config.json").exists() and (DRAFTER_DIR / "config.json").exists()


def load(dtype: str = "float32", attention_impl: str = "xla"):
    """``(target, drafter, tokenizer)`` of the built-in pair (float32 compute by default: on a
    CPU bfloat16 matmuls are slower, the shipped weights are bfloat16); ``attention_impl`` as
    in :func:`eagle3_jax.load_target`.  The tokenizer is the fast one of ``tokenizer.json``
    (``PreTrainedTokenizerFast``, what ``AutoTokenizer`` picks for it, without the model
    configuration classes that ``AutoTokenizer`` imports, and torch with them: seconds of a
    server's start)."""
    from transformers import PreTrainedTokenizerFast

    if not available():
        raise FileNotFoundError(f"the built-in pair is missing under {ASSETS}; rebuild it with `python -m eagle3_jax.builtin.recipe`")
    target = load_target(TARGET_DIR, dtype=dtype, attention_impl=attention_impl)
    drafter = load_drafter(DRAFTER_DIR, target=target, dtype=dtype)
    return target, drafter, PreTrainedTokenizerFast.from_pretrained(str(TARGET_DIR), local_files_only=True)
