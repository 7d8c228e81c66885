"""The built-in testbed's tasks: the four families' generators (qa, math, code, tool), the
words they use, the tools a tool task calls, and :func:`make_tasks` (reproducible from a seed,
the held-out prompts kept out of training sets).  See :mod:`eagle3_jax.builtin`."""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import re
from functools import lru_cache

import numpy as np

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FAMILIES = ("qa", "math", "code", "tool")
TOOLS = ("calculator", "lookup")
EVAL_SEED = 10_000  # training seeds stay below this
EVAL_TASKS = 200  # the held-out set: make_tasks(EVAL_TASKS, EVAL_SEED), 50 per family


@dataclasses.dataclass(frozen=True)
class Task:
    """One task: the user prompt, the thinking lines, the expected final answer; tool tasks
    also carry the expected call (JSON text) and the tool's result."""

    family: str
    prompt: str
    steps: tuple[str, ...]
    answer: str
    call: str = ""
    result: str = ""

    def final_line(self) -> str:
        return f"The answer is {self.answer}."

    def response(self, think_lines: int | None = None) -> str:
        """The (first) assistant turn; ``think_lines`` < len(steps) cuts thinking short."""
        steps = self.steps if think_lines is None else self.steps[:think_lines]
        end = f"{CALL_OPEN}{self.call}{CALL_CLOSE}" if self.family == "tool" else self.final_line()
        return f"{THINK_OPEN}\n" + "".join(s + "\n" for s in steps) + f"{THINK_CLOSE}\n" + end

    def messages(self, think_lines: int | None = None) -> list[dict]:
        """The whole conversation (tool tasks: the call, the tool turn, the final answer)."""
        msgs = [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.response(think_lines)}]
        if self.family == "tool":
            msgs += [{"role": "tool", "content": self.result}, {"role": "assistant", "content": self.final_line()}]
        return msgs


def task_from_dict(task: dict | Task) -> Task:
    return task if isinstance(task, Task) else Task(**{**task, "steps": tuple(task["steps"])})


# ------------------------------------------------------------------ vocabulary and tools
@lru_cache(maxsize=1)
def lexicon(size: int = 600) -> tuple[str, ...]:
    """Pronounceable made-up words (fixed seed): the names and goods of the tasks."""
    rng = np.random.default_rng(1234)
    onsets = list("bdfgklmnprstvz") + ["br", "tr", "st", "sh", "ch"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "", "", "n", "l", "r", "s"]
    words: set[str] = set()
    while len(words) < size:
        n = int(rng.integers(2, 4))
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(n)) + str(rng.choice(codas)))
    return tuple(sorted(words))


# Few names and goods, each seen thousands of times in training: with 200 names (each a
# rare token) the target never learned to copy a name from the prompt (teacher-forced loss on
# names stayed at the uniform ln 200); the tasks still vary by the numbers and the facts.
N_NAMES, N_GOODS = 24, 48


def _names() -> tuple[str, ...]:
    return tuple(w.capitalize() for w in lexicon()[:200:8][:N_NAMES])


def _goods() -> tuple[str, ...]:
    return lexicon()[300::6][:N_GOODS]


def task_words() -> tuple[str, ...]:
    """Every name and good the tasks use."""
    return _names() + _goods()


@lru_cache(maxsize=1)
def price_table() -> dict[str, int]:
    """The ``lookup`` tool's ``price`` table: a fixed price (1–99) for each good."""
    rng = np.random.default_rng(4321)
    return {g: int(p) for g, p in zip(_goods(), rng.integers(1, 100, len(_goods())))}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int:
    """Integer ``+ - *`` arithmetic, parsed (never ``eval``-ed)."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"unsupported expression {expression!r}")

    return ev(ast.parse(expression, mode="eval"))


def call_tool(call: dict) -> str:
    """Runs a parsed tool call ``{"name": ..., "arguments": {...}}``: ``calculator``
    (``expression``) or ``lookup`` (``table`` = ``price``, ``key``); an ``error: …`` text
    for anything else."""
    try:
        name, args = call["name"], call["arguments"]
        if name == "calculator":
            return str(calculate(str(args["expression"])))
        if name == "lookup":
            if args.get("table") != "price":
                return f"error: no table {args.get('table')!r}"
            key = str(args["key"])
            return str(price_table()[key]) if key in price_table() else f"error: no {key!r} in the price table"
        return f"error: no tool {name!r}"
    except (KeyError, TypeError, ValueError, SyntaxError, RecursionError) as e:
        return f"error: {type(e).__name__}"


def parse_call(text: str) -> dict | None:
    """The tool call of an assistant turn (the JSON between ``<tool_call>`` tags), or None."""
    m = re.search(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), text, re.S)
    if not m:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) and isinstance(call.get("arguments"), dict) and "name" in call else None


# ------------------------------------------------------------------ generators
def compare_line(a: int, op: str, b: int) -> str:
    """The thinking's comparison of two two-digit numbers, tens first, then the ones only
    where the tens are equal: ``Is 36 < 39? Tens 3 = 3, ones 6 < 9: yes``.  The target never
    compared two numbers at a glance reliably (it wrote ``36 < 39, no``); digit by digit each
    decision is one token against one token."""
    if not (10 <= a <= 99 and 10 <= b <= 99) or op not in ("<", ">"):
        raise ValueError(f"compare_line takes two two-digit numbers and < or >, got {a!r} {op!r} {b!r}")

    def rel(x: int, y: int) -> str:
        return "<" if x < y else ">" if x > y else "="

    parts = [f"tens {a // 10} {rel(a // 10, b // 10)} {b // 10}"]
    if a // 10 == b // 10:
        parts.append(f"ones {a % 10} {rel(a % 10, b % 10)} {b % 10}")
    holds = a < b if op == "<" else a > b
    return f"Is {a} {op} {b}? " + ", ".join(parts).capitalize() + f": {'yes' if holds else 'no'}"


def age_facts(rng: np.random.Generator, n: int) -> tuple[list[str], list[int], list[str]]:
    """``n`` distinct names, distinct ages in [10, 90) and the facts that bind them
    (``Gachotol is 20 years old.``): the prompt of a qa task, and of the recipe's recall drill."""
    names = [_names()[i] for i in rng.choice(len(_names()), n, replace=False)]
    ages = [int(a) for a in rng.choice(np.arange(10, 90), n, replace=False)]
    return names, ages, [f"{p} is {a} years old." for p, a in zip(names, ages)]


def qa_task(rng: np.random.Generator) -> Task:
    n = int(rng.integers(2, 6))
    names, ages, facts = age_facts(rng, n)
    kind = rng.choice(["age", "older", "younger"], p=[0.35, 0.35, 0.3])
    i, j = (int(x) for x in rng.choice(n, 2, replace=False))
    # the thinking restates each fact it needs word for word: after the name (copied from the
    # question) the rest of the line is the fact's own continuation in the prompt, a plain
    # copy; no thinking line starts with a name, so a name has the same token (with its
    # leading space) in the thinking as in the prompt
    if kind == "age":
        q, steps, ans = f"How old is {names[i]}?", [f"Fact: {facts[i]}"], str(ages[i])
    else:
        op, word = (">", "older") if kind == "older" else ("<", "younger")
        win = i if (ages[i] > ages[j]) == (op == ">") else j
        q = f"Who is {word}, {names[i]} or {names[j]}?"
        steps = [f"Fact: {facts[i]}", f"Fact: {facts[j]}",
                 f"{compare_line(ages[i], op, ages[j])}, so {names[win]} is {word}."]
        ans = names[win]
    return Task("qa", "Facts: " + " ".join(facts) + f" Question: {q}", tuple(steps), ans)


def math_task(rng: np.random.Generator) -> Task:
    n, d = int(rng.integers(1, 13)), int(rng.integers(2, 10))
    add = rng.random() < 0.5
    start = int(rng.integers(2, 100)) if add else int(rng.integers(n * d, n * d + 100))
    steps, total = [], start
    for i in range(1, n + 1):
        new = total + d if add else total - d
        steps.append(f"Step {i}: {total} {'+' if add else '-'} {d} = {new}, {n - i} left.")
        total = new
    times = "once" if n == 1 else f"{n} times"
    template = ["Start at {} and {} {}, {}.", "Begin with {} and {} {}, {}."][int(rng.integers(2))]
    return Task("math", template.format(start, "add" if add else "subtract", d, times), tuple(steps), str(total))


def code_task(rng: np.random.Generator) -> Task:
    n, y = int(rng.integers(1, 9)), int(rng.integers(2, 10))
    add = rng.random() < 0.6
    # x stays two-digit throughout, so that the condition compares two two-digit numbers
    x = int(rng.integers(10, min(50, 100 - n * y))) if add else int(rng.integers(n * y + 10, n * y + 50))
    lines, steps = [f"x = {x}", f"y = {y}", f"for i in range({n}):", f"    x = x {'+' if add else '-'} y"], [f"x = {x} and y = {y}."]
    for i in range(n):
        new = x + y if add else x - y
        steps.append(f"i = {i}: x = {x} {'+' if add else '-'} {y} = {new}, {n - 1 - i} left.")
        x = new
    c, k = int(rng.integers(max(x - 20, 10), min(x + 20, 100))), int(rng.integers(1, 10))
    gt, has_else = rng.random() < 0.5, rng.random() < 0.5
    op = ">" if gt else "<"
    lines += [f"if x {op} {c}:", f"    x = x - {k}"] + (["else:", f"    x = x + {k}"] if has_else else []) + ["print(x)"]
    holds = x > c if gt else x < c
    # the condition and its branches, copied line for line from the program (a plain copy
    # from where `if x` stands in the prompt), then decided against x's value
    steps += lines[4:-1]
    line = compare_line(x, op, c)
    if holds:
        steps.append(f"{line}. x = {x} - {k} = {x - k}.")
        x -= k
    elif has_else:
        steps.append(f"{line}. x = {x} + {k} = {x + k}.")
        x += k
    else:
        steps.append(f"{line}.")
    return Task("code", "What does this program print?\n" + "\n".join(lines), tuple(steps), str(x))


def tool_task(rng: np.random.Generator) -> Task:
    who = _names()[int(rng.integers(len(_names())))]
    goods = _goods()
    if rng.random() < 0.5:  # calculator
        per, count = int(rng.integers(12, 100)), int(rng.integers(12, 100))
        item = goods[int(rng.integers(len(goods)))]
        if rng.random() < 0.5:
            prompt = f"A box holds {per} {item}. How many {item} are in {count} boxes?"
            steps, expr = [f"Each of {count} boxes holds {per} {item}.", f"That is {per} * {count}."], f"{per} * {count}"
        else:
            extra = int(rng.integers(2, 10))
            prompt = f"A box holds {per} {item}. {who} has {count} boxes and {extra} loose {item}. How many {item} does {who} have?"
            steps = [f"Each of {count} boxes holds {per} {item}.", f"That is {per} * {count}.",
                     f"Plus {extra} loose: {per} * {count} + {extra}."]
            expr = f"{per} * {count} + {extra}"
        call = {"name": "calculator", "arguments": {"expression": expr}}
    else:  # price lookup
        item = goods[int(rng.integers(len(goods)))]
        if rng.random() < 0.5:
            prompt = f"What does one {item} cost?"
            steps = ["Prices are in the price table."]
        else:
            other = goods[int(rng.integers(len(goods)))]
            prompt = f"{who} likes {item} and {other}, and buys the first one. What does it cost?"
            steps = [f"The first one is {item}.", "Prices are in the price table."]
        call = {"name": "lookup", "arguments": {"table": "price", "key": item}}
    steps.append(f"I will call {call['name']}.")
    result = call_tool(call)
    return Task("tool", prompt, tuple(steps), result, json.dumps(call), result)


@lru_cache(maxsize=1)
def held_out_prompts() -> frozenset[str]:
    """The prompts of the held-out set, which :func:`make_tasks` keeps out of training data."""
    return frozenset(t.prompt for t in make_tasks(EVAL_TASKS, EVAL_SEED))


GENERATORS = {"qa": qa_task, "math": math_task, "code": code_task, "tool": tool_task}


def make_tasks(n: int, seed: int, families=FAMILIES, exclude=None) -> list[Task]:
    """``n`` tasks, the families in turn, reproducible from ``seed``.  Training sets pass the
    held-out prompts as ``exclude`` (default: the shipped eval set's, when ``seed`` is not
    the eval seed), so that no eval prompt ever occurs in training data."""
    unknown = sorted(set(families) - set(GENERATORS))
    if unknown or not families:
        raise ValueError(f"families must name some of {FAMILIES}, got {tuple(families)!r}")
    if exclude is None:
        exclude = set() if seed == EVAL_SEED else held_out_prompts()
    rng = np.random.default_rng(seed)
    out: list[Task] = []
    while len(out) < n:
        task = GENERATORS[families[len(out) % len(families)]](rng)
        if task.prompt not in exclude:
            out.append(task)
    return out
