"""The built-in model pair: a small reasoning target trained by ``train/builtin.py`` and its
EAGLE-3 drafter, shipped in the package so that the main job runs offline.

The target answers two task families with a ``<think> … </think>`` phase, then a final
line that :func:`grade` checks:

* **arith**: repeated addition or subtraction, e.g. ``Start at 17 and add 3, 4 times.`` →
  one line per step (``Step 2: 20 + 3 = 23.``) → ``The answer is 29.``
* **reverse**: reverse a list of made-up words, e.g. ``Reverse the list: kamo, tirel, bosu.``
  → walk it back one item at a time (``Before bosu in the list comes tirel.``) →
  ``The reversed list is: bosu, tirel, kamo.``

Each thinking line depends on the previous line and the prompt only, so a small model learns
the procedure; answering without it needs the whole computation in one step, so accuracy
rises with the thinking allowed.  Tasks are generated from a seed (no data set is
downloaded); the held-out evaluation set uses seeds the training data never uses.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parent / "assets" / "builtin"
TARGET_DIR = ASSETS / "target"
DRAFTER_DIR = ASSETS / "drafter"
EVAL_FILE = ASSETS / "eval.json"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FAMILIES = ("arith", "reverse")
EVAL_SEED = 10_000  # training seeds stay below this
DEFAULT_TREE = "chain6"  # the best budget on a 2-core CPU (see the README's benchmark table)
BENCH_TREES = ("chain4", "chain6", "16,4,4", "32,6,8", "60,7,10")


@dataclasses.dataclass(frozen=True)
class Task:
    """One task: the user prompt, the thinking lines, the expected final answer."""

    family: str
    prompt: str
    steps: tuple[str, ...]
    answer: str

    def final_line(self) -> str:
        return f"The answer is {self.answer}." if self.family == "arith" else f"The reversed list is: {self.answer}."

    def response(self, think_lines: int | None = None) -> str:
        """The assistant turn; ``think_lines`` < len(steps) gives a cut-short thinking phase."""
        steps = self.steps if think_lines is None else self.steps[:think_lines]
        return f"{THINK_OPEN}\n" + "".join(s + "\n" for s in steps) + f"{THINK_CLOSE}\n" + self.final_line()


@lru_cache(maxsize=1)
def lexicon(size: int = 600) -> tuple[str, ...]:
    """Pronounceable made-up words (fixed seed), the reverse family's vocabulary."""
    rng = np.random.default_rng(1234)
    onsets = list("bdfgklmnprstvz") + ["br", "tr", "st", "sh", "ch"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "", "", "n", "l", "r", "s"]
    words: set[str] = set()
    while len(words) < size:
        n = int(rng.integers(2, 4))
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(n)) + str(rng.choice(codas)))
    return tuple(sorted(words))


def arith_task(rng: np.random.Generator) -> Task:
    n, d = int(rng.integers(3, 9)), int(rng.integers(2, 10))
    add = rng.random() < 0.5
    start = int(rng.integers(2, 61)) if add else int(rng.integers(n * d, n * d + 60))
    steps, total = [], start
    for i in range(1, n + 1):
        new = total + d if add else total - d
        steps.append(f"Step {i}: {total} {'+' if add else '-'} {d} = {new}.")
        total = new
    template = ["Start at {} and {} {}, {} times.", "Begin with {} and {} {}, {} times."][int(rng.integers(2))]
    return Task("arith", template.format(start, "add" if add else "subtract", d, n), tuple(steps), str(total))


def reverse_task(rng: np.random.Generator) -> Task:
    words = lexicon()
    items = [words[i] for i in rng.choice(len(words), size=int(rng.integers(3, 8)), replace=False)]
    steps = [f"The list ends with {items[-1]}."]
    steps += [f"Before {items[i]} in the list comes {items[i - 1]}." for i in range(len(items) - 1, 0, -1)]
    steps.append(f"Nothing comes before {items[0]}.")
    template = ["Reverse the list: {}.", "Reverse this list: {}.", "Write the list backwards: {}."][int(rng.integers(3))]
    return Task("reverse", template.format(", ".join(items)), tuple(steps), ", ".join(reversed(items)))


def make_tasks(n: int, seed: int) -> list[Task]:
    """``n`` tasks, the two families alternating, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return [(arith_task if i % 2 == 0 else reverse_task)(rng) for i in range(n)]


def split_response(text: str) -> tuple[str, str]:
    """(thinking, answer part) of a generated response; thinking is empty without ``</think>``."""
    if THINK_CLOSE not in text:
        return "", text.strip()
    thinking, _, answer = text.partition(THINK_CLOSE)
    return thinking.replace(THINK_OPEN, "").strip(), answer.strip()


def grade(task: dict | Task, text: str) -> bool:
    """True when the generated ``text`` ends its answer with the task's expected answer."""
    task = task if isinstance(task, Task) else Task(**{**task, "steps": tuple(task["steps"])})
    _, answer = split_response(text)
    pattern = r"The answer is (.+?)\." if task.family == "arith" else r"The reversed list is: (.+?)\."
    m = re.search(pattern, answer)
    return bool(m) and m.group(1).strip() == task.answer


def eval_tasks() -> list[dict]:
    """The shipped held-out evaluation set (task dicts with ``prompt`` and ``answer``)."""
    return json.loads(EVAL_FILE.read_text())


def available() -> bool:
    return (TARGET_DIR / "config.json").exists() and (DRAFTER_DIR / "config.json").exists()


def load(dtype: str = "float32", attention_impl: str = "xla"):
    """``(target, drafter, tokenizer)`` of the built-in pair (float32 compute by default: on a
    CPU bfloat16 matmuls are slower, the shipped weights are bfloat16); ``attention_impl`` as
    in :func:`eagle3_jax.load_target`."""
    from transformers import AutoTokenizer

    from eagle3_jax.checkpoint import load_drafter, load_target

    if not available():
        raise FileNotFoundError(f"the built-in pair is missing under {ASSETS}; rebuild it with `python -m eagle3_jax.train.builtin`")
    target = load_target(TARGET_DIR, dtype=dtype, attention_impl=attention_impl)
    drafter = load_drafter(DRAFTER_DIR, target=target, dtype=dtype)
    return target, drafter, AutoTokenizer.from_pretrained(str(TARGET_DIR), local_files_only=True)
