"""The built-in model pair: a small reasoning target trained by ``train/builtin.py`` and its
EAGLE-3 drafter, shipped in the package so that the main job runs offline.

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
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parent / "assets" / "builtin"
TARGET_DIR = ASSETS / "target"
DRAFTER_DIR = ASSETS / "drafter"
EVAL_FILE = ASSETS / "eval.json"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FAMILIES = ("qa", "math", "code", "tool")
TOOLS = ("calculator", "lookup")
EVAL_SEED = 10_000  # training seeds stay below this
EVAL_TASKS = 200  # the held-out set: make_tasks(EVAL_TASKS, EVAL_SEED), 50 per family
DEFAULT_TREE = "chain14"  # the best budget of the default bench on a 2-core CPU, batch 1 and 32 (README, "Benchmark" and "Decode cost")
# chain14: the shipped drafter is trained on sixteen draft positions (README, "Retraining it")
BENCH_TREES = ("chain4", "chain6", "chain14", "16,4,4", "32,6,8", "60,7,10")
MAX_RESPONSE_TOKENS = 320  # covers every family's longest first turn (math, 12 steps: 279 tokens)
ANSWER_RE = re.compile(r"The answer is (.+?)\.(?:\s|$)")


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


def _calc(expression: str) -> int:
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
            return str(_calc(str(args["expression"])))
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


# ------------------------------------------------------------------ graders (independent of the generators)
def split_response(text: str) -> tuple[str, str]:
    """(thinking, answer part) of a generated response; thinking is empty without ``</think>``."""
    if THINK_CLOSE not in text:
        return "", text.strip()
    thinking, _, answer = text.partition(THINK_CLOSE)
    return thinking.replace(THINK_OPEN, "").strip(), answer.strip()


def _solve_qa(prompt: str) -> str:
    people = {m[0]: int(m[1]) for m in re.findall(r"(\w+) is (\d+) years old\.", prompt)}
    q = prompt.split("Question: ", 1)[1]
    if m := re.fullmatch(r"How old is (\w+)\?", q):
        return str(people[m[1]])
    if m := re.fullmatch(r"Who is (older|younger), (\w+) or (\w+)\?", q):
        return (max if m[1] == "older" else min)(m[2], m[3], key=people.get)
    raise ValueError(f"not a qa question: {q!r}")


def _solve_math(prompt: str) -> str:
    m = re.fullmatch(r"(?:Start at|Begin with) (\d+) and (add|subtract) (\d+), (once|(\d+) times)\.", prompt)
    n = 1 if m[4] == "once" else int(m[5])
    return str(int(m[1]) + (1 if m[2] == "add" else -1) * int(m[3]) * n)


_CODE_NODES = (ast.Module, ast.Assign, ast.Name, ast.Store, ast.Load, ast.Constant, ast.BinOp, ast.Add, ast.Sub,
               ast.Mult, ast.For, ast.If, ast.Compare, ast.Gt, ast.Lt, ast.Expr, ast.Call)


def _solve_code(prompt: str) -> str:
    """Runs the task's program (after checking that it only assigns, loops over ``range``,
    compares, does integer arithmetic and prints) and returns what it printed last."""
    tree = ast.parse(prompt.split("\n", 1)[1])
    for node in ast.walk(tree):
        if not isinstance(node, _CODE_NODES) or (isinstance(node, ast.Constant) and type(node.value) is not int) or (
                isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in ("range", "print"))):
            raise ValueError(f"not a code task: {ast.dump(node)[:60]}")
    printed: list = []
    exec(compile(tree, "<task>", "exec"), {"__builtins__": {"range": range, "print": printed.append}})  # noqa: S102
    return str(printed[-1])


def _expected_call(prompt: str) -> dict:
    if m := re.fullmatch(r"A box holds (\d+) (\w+)\. How many \w+ are in (\d+) boxes\?", prompt):
        return {"name": "calculator", "arguments": {"expression": f"{m[1]} * {m[3]}"}}
    if m := re.fullmatch(r"A box holds (\d+) (\w+)\. \w+ has (\d+) boxes and (\d+) loose \w+\. How many .*", prompt):
        return {"name": "calculator", "arguments": {"expression": f"{m[1]} * {m[3]} + {m[4]}"}}
    if m := re.fullmatch(r"What does one (\w+) cost\?", prompt):
        return {"name": "lookup", "arguments": {"table": "price", "key": m[1]}}
    if m := re.fullmatch(r"\w+ likes (\w+) and \w+, and buys the first one\. What does it cost\?", prompt):
        return {"name": "lookup", "arguments": {"table": "price", "key": m[1]}}
    raise ValueError(f"not a tool task: {prompt!r}")


def expected_answer(task: dict | Task) -> str:
    """The task's answer, re-derived from its prompt alone (the graders' reference)."""
    task = task_from_dict(task)
    if task.family == "tool":
        return call_tool(_expected_call(task.prompt))
    return {"qa": _solve_qa, "math": _solve_math, "code": _solve_code}[task.family](task.prompt)


def final_answer(text: str) -> str | None:
    """The ``X`` of the last ``The answer is X.`` after the thinking (and after any tool call)."""
    _, answer = split_response(text)
    answer = answer.rpartition(CALL_CLOSE)[2] if CALL_CLOSE in answer else answer
    found = ANSWER_RE.findall(answer)
    return found[-1].strip() if found else None


def tool_check(task: dict | Task, text: str) -> dict:
    """A tool task's transcript (first turn, then the final turn) checked part by part:
    ``valid_json``, ``right_tool``, ``right_arguments``, ``right_answer``, ``success`` (all four)."""
    task = task_from_dict(task)
    want = _expected_call(task.prompt)
    _, after = split_response(text)
    call = parse_call(after)
    out = {"valid_json": call is not None, "right_tool": call is not None and call["name"] == want["name"]}
    if out["right_tool"] and want["name"] == "calculator":
        try:
            right = _calc(str(call["arguments"].get("expression"))) == _calc(want["arguments"]["expression"])
        except (ValueError, SyntaxError, RecursionError):
            right = False
    else:
        right = out["right_tool"] and call["arguments"] == want["arguments"]
    out["right_arguments"] = right
    out["right_answer"] = final_answer(text) == expected_answer(task)
    out["success"] = all(out.values())
    return out


def grade(task: dict | Task, text: str) -> bool:
    """True when the response ``text`` is right: its final ``The answer is X.`` matches the
    answer re-derived from the prompt (tool tasks: the whole transcript, call included, is
    right — :func:`tool_check`)."""
    task = task_from_dict(task)
    if task.family == "tool":
        return tool_check(task, text)["success"]
    return final_answer(text) == expected_answer(task)


# ------------------------------------------------------------------ running tasks
def run_tasks(target, tokenizer, tasks, *, drafter=None, max_new_tokens: int = MAX_RESPONSE_TOKENS, tool_tokens: int = 24,
              **generate_kw) -> list[dict]:
    """Runs the tasks end to end with :func:`eagle3_jax.generate` (``generate_kw``: tree,
    thinking_budget, temperature, …): one call for all first turns; tool tasks whose first
    turn holds a call get the tool's result as a ``tool`` turn and a second call (at most
    ``tool_tokens``) for the final answer.  Returns per task ``text`` (the transcript: first
    turn, then the final turn), ``correct``, ``tokens`` (first-turn ids), ``thinking_tokens``,
    ``answer_tokens``, ``status`` (thinking status), ``finish_reason`` (``length``: the first
    turn ran out of ``max_new_tokens``), ``final_tokens`` (the tool tasks' second-turn ids),
    ``tool`` (:func:`tool_check` or None) and ``stats`` (the first call's, shared)."""
    from eagle3_jax.decode import encode_chat, generate

    tasks = [task_from_dict(t) for t in tasks]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t.prompt}]) for t in tasks]
    res = generate(target, drafter, prompts, max_new_tokens=max_new_tokens, tokenizer=tokenizer, **generate_kw)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in res.tokens]
    follow = [i for i, t in enumerate(tasks) if t.family == "tool" and parse_call(texts[i])]
    finals = dict(zip(follow, _tool_turns(target, tokenizer, [tasks[i].prompt for i in follow], [texts[i] for i in follow],
                                          drafter=drafter, max_new_tokens=tool_tokens, **generate_kw)))
    out = []
    for i, t in enumerate(tasks):
        text = texts[i] + ("\n" + tokenizer.decode(finals[i], skip_special_tokens=True) if i in finals else "")
        out.append({"family": t.family, "text": text, "correct": grade(t, text), "tokens": res.tokens[i],
                    "final_tokens": finals.get(i, []), "thinking_tokens": res.thinking_tokens[i],
                    "answer_tokens": res.answer_tokens[i], "status": res.thinking_status[i],
                    "finish_reason": res.finish_reason[i],
                    "tool": tool_check(t, text) if t.family == "tool" else None, "stats": res.stats})
    return out


def _tool_turns(target, tokenizer, prompts: list[str], first_texts: list[str], *, drafter=None, max_new_tokens: int = 24,
                **generate_kw) -> list[list[int]]:
    """The final turns (token ids) after first turns holding a tool call: each call is run
    (:func:`call_tool`) and its result appended as a ``tool`` turn."""
    from eagle3_jax.decode import encode_chat, generate

    if not prompts:
        return []
    second = [encode_chat(tokenizer, [{"role": "user", "content": p}, {"role": "assistant", "content": text},
                                      {"role": "tool", "content": call_tool(parse_call(text))}])
              for p, text in zip(prompts, first_texts)]
    kw = {k: v for k, v in generate_kw.items()
          if k not in ("thinking_budget", "thinking_mode", "thinking_grace", "tokenizer")}
    return generate(target, drafter, second, max_new_tokens=max_new_tokens, tokenizer=tokenizer, **kw).tokens


def tool_turn(target, tokenizer, prompt: str, first_text: str, **generate_kw) -> tuple[dict, str, str] | None:
    """``(call, result, final turn text)`` after a first turn ``first_text`` that holds a tool
    call (None when it holds none): the call is run, its result appended as a ``tool`` turn
    and the final turn generated (``generate_kw`` as for :func:`eagle3_jax.generate`:
    drafter, tree, sampling; greedy by default)."""
    call = parse_call(first_text)
    if call is None:
        return None
    (final,) = _tool_turns(target, tokenizer, [prompt], [first_text], **generate_kw)
    return call, call_tool(call), tokenizer.decode(final, skip_special_tokens=True)


def transcript(target, tokenizer, task: dict | Task, first_text: str, **generate_kw) -> str:
    """A task's whole response from its first turn ``first_text``: for a tool task whose first
    turn holds a call, the first turn, a newline and the final turn (:func:`tool_turn`);
    otherwise ``first_text``."""
    task = task_from_dict(task)
    turn = tool_turn(target, tokenizer, task.prompt, first_text, **generate_kw) if task.family == "tool" else None
    return first_text if turn is None else first_text + "\n" + turn[2]


class Scorer:
    """Scores first-turn tokens of ``tasks`` (as the bench and the experiment produce them):
    ``grade(i, tokens) -> bool`` and ``details(i, tokens) -> dict`` (:func:`tool_check` for
    tool tasks, empty otherwise).  Tool tasks get their final turn (:func:`transcript`,
    greedy, vanilla) once per distinct first turn."""

    def __init__(self, target, tokenizer, tasks: list[dict]):
        self.target, self.tokenizer, self.tasks = target, tokenizer, tasks
        self._texts: dict = {}

    def transcript(self, i: int, tokens) -> str:
        first = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        if (i, first) not in self._texts:
            self._texts[i, first] = transcript(self.target, self.tokenizer, self.tasks[i], first)
        return self._texts[i, first]

    def grade(self, i: int, tokens) -> bool:
        return grade(self.tasks[i], self.transcript(i, tokens))

    def details(self, i: int, tokens) -> dict:
        return tool_check(self.tasks[i], self.transcript(i, tokens)) if self.tasks[i]["family"] == "tool" else {}


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

    from eagle3_jax.checkpoint import load_drafter, load_target

    if not available():
        raise FileNotFoundError(f"the built-in pair is missing under {ASSETS}; rebuild it with `python -m eagle3_jax.train.builtin`")
    target = load_target(TARGET_DIR, dtype=dtype, attention_impl=attention_impl)
    drafter = load_drafter(DRAFTER_DIR, target=target, dtype=dtype)
    return target, drafter, PreTrainedTokenizerFast.from_pretrained(str(TARGET_DIR), local_files_only=True)
