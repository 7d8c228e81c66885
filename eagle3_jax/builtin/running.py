"""Running the built-in testbed's tasks end to end with :func:`eagle3_jax.generate`, tool
turns included, and scoring first turns the bench and the experiment produce."""

from __future__ import annotations

from eagle3_jax.builtin.grading import grade, tool_check
from eagle3_jax.builtin.tasks import Task, call_tool, parse_call, task_from_dict
from eagle3_jax.decode import encode_chat, generate

MAX_RESPONSE_TOKENS = 320  # covers every family's longest first turn (math, 12 steps: 279 tokens)


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
