"""The built-in testbed's graders, independent of the generators: each re-derives a task's
answer from its prompt text with its own parser (and runs the programs with Python), then
checks a response's final ``The answer is X.`` (tool tasks: the call too)."""

from __future__ import annotations

import ast
import re

from eagle3_jax.builtin.tasks import CALL_CLOSE, THINK_CLOSE, THINK_OPEN, Task, calculate, call_tool, parse_call, task_from_dict

ANSWER_RE = re.compile(r"The answer is (.+?)\.(?:\s|$)")


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
            right = calculate(str(call["arguments"].get("expression"))) == calculate(want["arguments"]["expression"])
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
