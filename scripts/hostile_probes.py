"""Hostile inputs against ``eagle3-jax serve`` and the ``eagle3-jax`` command line (issue 63).

Starts the default server (the built-in pair) on loopback, then two small ones for the queue
limits, sends each probe and classifies its outcome as one of

* ``clear error``: refused, with an error that names what is wrong (OpenAI's shape, ``param``;
  one line on stderr and exit status 2 for the command line);
* ``correct``: a valid input answered as it should be;
* ``unclear``: refused, but the error does not say what is wrong (or a valid input refused);
* ``silent wrong``: a bad input answered as if it were good (or a wrong answer);
* ``loss``: work done and then lost; ``unbounded``: a request that holds others up for longer
  than 2 s past their own service time, or memory that does not come back within 10 %;
* ``crash``: a 5xx, a dead server, a traceback or an internal error; ``hang``: no answer in time.

Prints one line per probe and the counts; exits 1 if any probe is neither a clear error nor
correct.  ``plan`` and ``experiment`` are probed on inputs refused before any long work
(and ``plan``'s estimate on a shipped config).

Usage::

    python scripts/hostile_probes.py [--cache DIR] [--startup] [--json OUT]

``--cache``: the servers' XLA compilation cache (default: a fresh temporary one, so the first
server compiles everything); ``--startup``: also time a first and a second start of the default
``eagle3-jax serve`` on a fresh cache (printed, not counted among the probes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CATEGORIES = ("clear error", "correct", "unclear", "silent wrong", "loss", "unbounded", "crash", "hang")
GOOD = {"clear error", "correct"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Start at 3 and add 2, 3 times."}]
CHAT_BASE = {"model": "builtin", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
COMPLETION_BASE = {"model": "builtin", "prompt": "Step 1:", "max_tokens": 8, "temperature": 0}
TIMEOUT = 120.0

results: list[dict] = []


def read_all(sock: socket.socket) -> str:
    """Everything the server sends until it closes the connection (or 10 s pass): the status
    line and headers may come in one packet and the body in the next."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def record(group: str, name: str, category: str, detail: str = ""):
    assert category in CATEGORIES, category
    detail = " ".join(detail.split())
    results.append({"group": group, "probe": name, "outcome": category, "detail": detail})
    print(f"[{category:>12}] {group}: {name}" + (f" — {detail}" if detail else ""), flush=True)


# -- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``eagle3-jax serve ARGS`` on a free loopback port, its output in ``log``; a context
    manager that waits until ``/health`` says ok (recording what it said before) and kills the
    server at the end."""

    def __init__(self, cache: Path, *args: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), "--log-level", "warning", "--compile-cache", str(cache), *args]
        self.log = log
        self.statuses: list[dict] = []
        self.ready_s: float | None = None
        self.ready_cpu_s: float | None = None  # the server's CPU time (all its threads) when it was ready
        self.early_answer: httpx.Response | None = None  # a generation request sent while it warmed up

    def __enter__(self) -> "Server":
        start = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "eagle3_jax.cli", "serve", *self.args], cwd=ROOT,
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - start < 900:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                body = r.json()
                self.statuses.append(body)
                if body.get("status") == "ok":
                    self.ready_s = time.monotonic() - start
                    stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                    self.ready_cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
                    return self
                if body.get("status") == "warming_up" and self.early_answer is None:
                    self.early_answer = httpx.post(self.url + CHAT, json=CHAT_BASE, timeout=30)
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready in 900 s; see {self.log}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


# -- classifying HTTP answers ---------------------------------------------------------------------


def post(server: Server, path: str, body, headers=None, timeout: float = TIMEOUT):
    """The response, or the exception that stood for one."""
    content = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    try:
        return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        return e


def judge_error(server: Server, r, status: int | tuple, names=(), param=...) -> tuple[str, str]:
    """A bad input: a clear error is the expected status, OpenAI's error shape and a message
    that names every one of ``names`` (and ``param``, when given, is the error's)."""
    if isinstance(r, httpx.TimeoutException):
        return "hang", type(r).__name__
    if isinstance(r, Exception) or server.proc.poll() is not None:
        return "crash", repr(r) if isinstance(r, Exception) else "the server exited"
    statuses = status if isinstance(status, tuple) else (status,)
    if r.status_code >= 500 and r.status_code not in statuses:
        return "crash", f"{r.status_code} {r.text[:160]}"
    if r.status_code == 200:
        return "silent wrong", f"200: {r.text[:160]}"
    try:
        err = r.json()["error"]
        shaped = set(err) == {"message", "type", "param", "code"} and err["message"]
    except (ValueError, KeyError, TypeError):
        return "unclear", f"{r.status_code}, not OpenAI's error shape: {r.text[:160]}"
    named = all(n.lower() in err["message"].lower() for n in names)
    if shaped and r.status_code in statuses and named and (param is ... or err["param"] == param):
        return "clear error", f"{r.status_code} {err['code']}: {err['message'][:140]}"
    return "unclear", f"{r.status_code} param={err.get('param')!r}: {err.get('message', '')[:160]}"


def judge_ok(server: Server, r, check=None) -> tuple[str, str]:
    """A good input: 200, and ``check(response)`` (a string saying what is wrong, or None)."""
    if isinstance(r, httpx.TimeoutException):
        return "hang", type(r).__name__
    if isinstance(r, Exception) or server.proc.poll() is not None:
        return "crash", repr(r) if isinstance(r, Exception) else "the server exited"
    if r.status_code >= 500:
        return "crash", f"{r.status_code} {r.text[:160]}"
    if r.status_code != 200:
        return "unclear", f"a valid request refused: {r.status_code} {r.text[:160]}"
    wrong = check(r) if check is not None else None
    return ("silent wrong", wrong) if wrong else ("correct", r.text[:100].replace("\n", " "))


def _usage(r) -> dict:
    return r.json()["usage"]


def _tokens(r, most: int) -> str | None:
    """Whether a response generated at least one and at most ``most`` tokens (the end of text may come first)."""
    n = _usage(r)["completion_tokens"]
    return None if 0 < n <= most else f"{n} tokens, the limit was {most}"


def _stream_ok(r) -> str | None:
    lines = [x for x in r.text.splitlines() if x.startswith("data: ")]
    if not lines or lines[-1] != "data: [DONE]":
        return "the stream does not end with [DONE]"
    if any('"error"' in x for x in lines):
        return "an error chunk in the stream"
    return None


# -- the probes ---------------------------------------------------------------------------------


def chat(**kw) -> dict:
    return {**CHAT_BASE, **kw}


def completion(**kw) -> dict:
    return {**COMPLETION_BASE, **kw}


def messages(*contents, role="user") -> list[dict]:
    return [{"role": role, "content": c} for c in contents]


# (name, path, body, status, names the message must hold, param) of inputs to refuse
REFUSE = [
    # bodies
    ("empty body", CHAT, b"", 400, ["empty"], None),
    ("whitespace body", COMPLETIONS, b" \r\n\t ", 400, ["empty"], None),
    ("JSON null", CHAT, b"null", 400, ["JSON object", "null"], None),
    ("JSON array", CHAT, b"[1, 2]", 400, ["JSON object", "list"], None),
    ("JSON number", COMPLETIONS, b"123", 400, ["JSON object", "int"], None),
    ("JSON string", COMPLETIONS, b'"hello"', 400, ["JSON object", "str"], None),
    ("not JSON", CHAT, b"{not json", 400, ["not valid JSON"], None),
    ("truncated JSON", COMPLETIONS, json.dumps(COMPLETION_BASE).encode()[:-5], 400, ["not valid JSON"], None),
    ("trailing garbage", COMPLETIONS, json.dumps(COMPLETION_BASE).encode() + b" }}", 400, ["not valid JSON"], None),
    ("latin-1 body", COMPLETIONS, b'{"prompt": "caf\xe9"}', 400, ["UTF-8", "encoding", "0xE9"], None),
    ("UTF-16 body", CHAT, json.dumps(CHAT_BASE).encode("utf-16"), 400, ["UTF-8", "encoding"], None),
    ("nested 30000 deep", COMPLETIONS, b"[" * 30_000 + b"]" * 30_000, 400, ["nests too deeply"], None),
    ("nested prompt", COMPLETIONS, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, ["JSON"], None),
    ("NaN temperature", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     ["temperature", "finite"], "temperature"),
    ("Infinity top_p", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400, ["top_p"],
     "top_p"),
    # sampling parameters
    ("max_tokens 0", CHAT, chat(max_tokens=0), 400, ["max_tokens"], "max_tokens"),
    ("max_tokens -1", CHAT, chat(max_tokens=-1), 400, ["max_tokens"], "max_tokens"),
    ("max_tokens 1.5", CHAT, chat(max_tokens=1.5), 400, ["max_tokens"], "max_tokens"),
    ("max_tokens '5'", CHAT, chat(max_tokens="5"), 400, ["max_tokens"], "max_tokens"),
    ("max_tokens true", CHAT, chat(max_tokens=True), 400, ["max_tokens"], "max_tokens"),
    ("max_tokens 1e30", COMPLETIONS, completion(max_tokens=10 ** 30), 400, ["max_tokens", "too large"], "max_tokens"),
    ("max_tokens 100000", CHAT, chat(max_tokens=100_000), 400, ["max_tokens", "room"], "max_tokens"),
    ("max_completion_tokens 0", COMPLETIONS, completion(max_completion_tokens=0), 400, ["max_completion_tokens"],
     "max_completion_tokens"),
    ("max_completion_tokens past the context", COMPLETIONS, completion(max_tokens=None, max_completion_tokens=5000),
     400, ["max_completion_tokens", "too large"], "max_completion_tokens"),
    ("max_tokens and max_completion_tokens disagree", COMPLETIONS, completion(max_tokens=2, max_completion_tokens=3),
     400, ["disagree"], "max_completion_tokens"),
    ("temperature -0.1", CHAT, chat(temperature=-0.1), 400, ["temperature"], "temperature"),
    ("temperature 2.5", CHAT, chat(temperature=2.5), 400, ["temperature"], "temperature"),
    ("temperature 1e308", CHAT, chat(temperature=1e308), 400, ["temperature"], "temperature"),
    ("temperature 'hot'", COMPLETIONS, completion(temperature="hot"), 400, ["temperature"], "temperature"),
    ("top_p 0", CHAT, chat(top_p=0), 400, ["top_p"], "top_p"),
    ("top_p 1.5", CHAT, chat(top_p=1.5), 400, ["top_p"], "top_p"),
    ("top_p -1", COMPLETIONS, completion(top_p=-1), 400, ["top_p"], "top_p"),
    ("top_k -2", CHAT, chat(top_k=-2), 400, ["top_k"], "top_k"),
    ("top_k past the vocabulary", CHAT, chat(top_k=5000), 400, ["top_k", "vocabulary"], "top_k"),
    ("top_k 1.5", COMPLETIONS, completion(top_k=1.5), 400, ["top_k"], "top_k"),
    ("seed -1", CHAT, chat(seed=-1), 400, ["seed"], "seed"),
    ("seed 2**32", CHAT, chat(seed=2 ** 32), 400, ["seed"], "seed"),
    ("seed 2**64", COMPLETIONS, completion(seed=2 ** 64), 400, ["seed"], "seed"),
    ("seed '1'", COMPLETIONS, completion(seed="1"), 400, ["seed"], "seed"),
    ("n 2", CHAT, chat(n=2), 400, ["n=1"], "n"),
    ("n 0", COMPLETIONS, completion(n=0), 400, ["n"], "n"),
    ("stream 'yes'", CHAT, chat(stream="yes"), 400, ["stream"], "stream"),
    ("stream 1", COMPLETIONS, completion(stream=1), 400, ["stream"], "stream"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, ["stream_options"],
     "stream_options"),
    ("stream_options.include_usage 'x'", CHAT, chat(stream=True, stream_options={"include_usage": "x"}), 400,
     ["include_usage"], "stream_options.include_usage"),
    # stop strings and ids
    ("stop ''", CHAT, chat(stop=""), 400, ["stop"], "stop"),
    ("stop ['ok', '']", CHAT, chat(stop=["ok", ""]), 400, ["stop"], "stop"),
    ("17 stop strings", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, ["stop", "16"], "stop"),
    ("a 300-character stop string", COMPLETIONS, completion(stop="x" * 300), 400, ["stop", "256"], "stop"),
    ("stop 5", COMPLETIONS, completion(stop=5), 400, ["stop"], "stop"),
    ("stop [1, 2]", COMPLETIONS, completion(stop=[1, 2]), 400, ["stop"], "stop"),
    ("stop with a lone surrogate", CHAT, chat(stop=["\ud800"]), 400, ["stop", "encoding"], "stop"),
    ("stop_token_ids [99999]", CHAT, chat(stop_token_ids=[99999]), 400, ["stop_token_ids", "range"], "stop_token_ids"),
    ("stop_token_ids [-1]", CHAT, chat(stop_token_ids=[-1]), 400, ["stop_token_ids"], "stop_token_ids"),
    ("stop_token_ids '5'", COMPLETIONS, completion(stop_token_ids="5"), 400, ["stop_token_ids"], "stop_token_ids"),
    ("11 stop_token_ids, streamed", CHAT, chat(stop_token_ids=list(range(10, 21)), stream=True), 400,
     ["stop_token_ids", "at most 8"], "stop_token_ids"),
    ("11 stop_token_ids, completions streamed", COMPLETIONS,
     completion(stop_token_ids=list(range(10, 21)), stream=True), 400, ["stop_token_ids", "at most 8"],
     "stop_token_ids"),
    ("9 stop_token_ids", CHAT, chat(stop_token_ids=list(range(10, 19))), 400, ["stop_token_ids"], "stop_token_ids"),
    # thinking
    ("thinking_budget -3", CHAT, chat(thinking_budget=-3), 400, ["thinking_budget"], "thinking_budget"),
    ("thinking_budget 2**31", CHAT, chat(thinking_budget=2 ** 31), 400, ["thinking_budget"], "thinking_budget"),
    ("thinking_budget '5'", CHAT, chat(thinking_budget="5"), 400, ["thinking_budget"], "thinking_budget"),
    ("reasoning_effort 'extreme'", CHAT, chat(reasoning_effort="extreme"), 400, ["reasoning_effort"],
     "reasoning_effort"),
    ("reasoning_effort and thinking_budget", CHAT, chat(reasoning_effort="low", thinking_budget=3), 400,
     ["reasoning_effort", "thinking_budget"], "reasoning_effort"),
    # what this server does not do: refused by name
    ("logprobs", CHAT, chat(logprobs=True), 400, ["logprobs", "not supported"], "logprobs"),
    ("top_logprobs", CHAT, chat(top_logprobs=5), 400, ["top_logprobs"], "top_logprobs"),
    ("echo", COMPLETIONS, completion(echo=True), 400, ["echo"], "echo"),
    ("best_of 2", COMPLETIONS, completion(best_of=2), 400, ["best_of"], "best_of"),
    ("suffix", COMPLETIONS, completion(suffix="!"), 400, ["suffix"], "suffix"),
    ("logit_bias", CHAT, chat(logit_bias={"5": 100}), 400, ["logit_bias"], "logit_bias"),
    ("response_format json", CHAT, chat(response_format={"type": "json_object"}), 400, ["response_format"],
     "response_format"),
    ("presence_penalty", CHAT, chat(presence_penalty=1.0), 400, ["presence_penalty"], "presence_penalty"),
    ("frequency_penalty", COMPLETIONS, completion(frequency_penalty=0.5), 400, ["frequency_penalty"],
     "frequency_penalty"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400,
     ["tools", "tool calling"], "tools"),
    ("tool_choice required", CHAT, chat(tool_choice="required"), 400, ["tool_choice"], "tool_choice"),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), 400, ["functions"], "functions"),
    ("audio output", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), 400, ["audio"], "audio"),
    ("modalities audio", CHAT, chat(modalities=["text", "audio"]), 400, ["modalities"], "modalities"),
    ("prediction", CHAT, chat(prediction={"type": "content", "content": "x"}), 400, ["prediction"], "prediction"),
    ("web_search_options", CHAT, chat(web_search_options={}), 400, ["web_search_options"], "web_search_options"),
    ("speculation per request", CHAT, chat(speculation={"tree": "chain4"}), 400, ["speculation", "--speculation"],
     "speculation"),
    # the model
    ("model gpt-4o", CHAT, chat(model="gpt-4o"), 404, ["gpt-4o", "builtin"], "model"),
    ("model ''", CHAT, chat(model=""), 404, ["builtin"], "model"),
    ("model 5", COMPLETIONS, completion(model=5), 400, ["model"], "model"),
    # messages
    ("messages missing", CHAT, {"model": "builtin"}, 400, ["messages"], "messages"),
    ("messages 'hi'", CHAT, chat(messages="hi"), 400, ["messages"], "messages"),
    ("messages []", CHAT, chat(messages=[]), 400, ["messages"], "messages"),
    ("messages [null]", CHAT, chat(messages=[None]), 400, ["messages[0]"], "messages[0]"),
    ("role robot", CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), 400, ["role", "robot"],
     "messages[0].role"),
    ("role missing", CHAT, chat(messages=[{"content": "hi"}]), 400, ["role"], "messages[0].role"),
    ("role tool", CHAT, chat(messages=[{"role": "tool", "content": "4", "tool_call_id": "a"}]), 400,
     ["tool", "not supported"], "messages[0].role"),
    ("role function", CHAT, chat(messages=[{"role": "function", "name": "f", "content": "4"}]), 400,
     ["function", "not supported"], "messages[0].role"),
    ("assistant tool_calls", CHAT,
     chat(messages=[{"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}, *MESSAGES]), 400,
     ["tool calls"], "messages[0].tool_calls"),
    ("content 5", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, ["content"], "messages[0].content"),
    ("content {}", CHAT, chat(messages=[{"role": "user", "content": {}}]), 400, ["content"], "messages[0].content"),
    ("content missing", CHAT, chat(messages=[{"role": "user"}]), 400, ["empty"], "messages"),
    ("content ''", CHAT, chat(messages=messages("")), 400, ["empty"], "messages"),
    ("content whitespace", CHAT, chat(messages=messages("  \n\t ")), 400, ["whitespace"], "messages"),
    ("every message blank", CHAT, chat(messages=[*messages(" ", role="system"), *messages("")]), 400, ["empty"],
     "messages"),
    ("image_url part", CHAT, chat(messages=messages([{"type": "text", "text": "what is this?"},
                                                     {"type": "image_url", "image_url": {"url": "http://x/y.png"}}])),
     400, ["images", "not supported"], "messages[0].content[1]"),
    ("image part", CHAT, chat(messages=messages([{"type": "image", "image": "..."}])), 400, ["images"],
     "messages[0].content[0]"),
    ("input_audio part", CHAT, chat(messages=messages([{"type": "input_audio", "input_audio": {"data": "",
                                                                                                "format": "wav"}}])),
     400, ["audio", "not supported"], "messages[0].content[0]"),
    ("file part", CHAT, chat(messages=messages([{"type": "file", "file": {"file_id": "f"}}])), 400, ["files"],
     "messages[0].content[0]"),
    ("video part", CHAT, chat(messages=messages([{"type": "video_url", "video_url": {"url": "x"}}])), 400, ["video"],
     "messages[0].content[0]"),
    ("unknown part type", CHAT, chat(messages=messages([{"type": "hologram"}])), 400, ["hologram", "only text"],
     "messages[0].content[0]"),
    ("text part without text", CHAT, chat(messages=messages([{"type": "text"}])), 400, ["text"],
     "messages[0].content[0].text"),
    ("text part text 5", CHAT, chat(messages=messages([{"type": "text", "text": 5}])), 400, ["content[0].text"],
     "messages[0].content"),
    ("part without type", CHAT, chat(messages=messages([{"text": "hi"}])), 400, ["content[0].type"],
     "messages[0].content"),
    ("content [[1]]", CHAT, chat(messages=messages([[1]])), 400, ["content"], "messages[0].content"),
    ("lone surrogate in a message", CHAT, chat(messages=messages("a\ud800b")), 400, ["encoding", "U+D800"],
     "messages[0].content"),
    ("lone low surrogate in a text part", CHAT, chat(messages=messages([{"type": "text", "text": "\udfff"}])), 400,
     ["encoding"], "messages[0].content[0].text"),
    ("a message past the context, in characters", CHAT, chat(messages=messages("a" * 200_000)), (400, 413), [], ...),
    ("a message past the context, in tokens", CHAT, chat(messages=messages("7 " * 600)), 400,
     ["tokens", "too long"], "messages"),
    ("2000 short messages", CHAT, chat(messages=messages(*["hi"] * 2000)), (400, 413), [], ...),
    # completion prompts
    ("prompt missing", COMPLETIONS, {"model": "builtin"}, 400, ["prompt"], "prompt"),
    ("prompt ''", COMPLETIONS, completion(prompt=""), 400, ["prompt", "empty"], "prompt"),
    ("prompt whitespace", COMPLETIONS, completion(prompt="   "), 400, ["prompt", "whitespace"], "prompt"),
    ("prompt []", COMPLETIONS, completion(prompt=[]), 400, ["prompt", "empty"], "prompt"),
    ("prompt [[]]", COMPLETIONS, completion(prompt=[[]]), 400, ["prompt", "empty"], "prompt"),
    ("prompt ['']", COMPLETIONS, completion(prompt=[""]), 400, ["prompt", "empty"], "prompt"),
    ("prompt [-1]", COMPLETIONS, completion(prompt=[-1]), 400, ["prompt", "-1"], "prompt"),
    ("prompt [99999]", COMPLETIONS, completion(prompt=[99999]), 400, ["prompt", "99999"], "prompt"),
    ("two prompts", COMPLETIONS, completion(prompt=["a", "b"]), 400, ["one prompt"], "prompt"),
    ("two token-id prompts", COMPLETIONS, completion(prompt=[[1, 2], [3]]), 400, ["one prompt"], "prompt"),
    ("prompt [1.5]", COMPLETIONS, completion(prompt=[1.5]), 400, ["prompt"], "prompt"),
    ("prompt 5", COMPLETIONS, completion(prompt=5), 400, ["prompt"], "prompt"),
    ("prompt null", COMPLETIONS, completion(prompt=None), 400, ["prompt"], "prompt"),
    ("prompt {}", COMPLETIONS, completion(prompt={}), 400, ["prompt"], "prompt"),
    ("prompt with a lone surrogate", COMPLETIONS, completion(prompt="x\udc80"), 400, ["encoding", "U+DC80"], "prompt"),
    ("prompt past the context, in characters", COMPLETIONS, completion(prompt="b" * 100_000), (400, 413), [], ...),
    ("prompt past the context, in token ids", COMPLETIONS, completion(prompt=[7] * 600), 400, ["tokens"], "prompt"),
    # paths and methods
    ("GET a POST endpoint", None, None, 405, [], None),
    ("POST an unknown path", "/v1/nothing", chat(), 404, [], None),
]

# (name, path, body, check) of inputs to answer
ANSWER = [
    ("a chat", CHAT, chat(),
     lambda r: None if r.json()["choices"][0]["message"]["content"] is not None else "no content"),
    ("a completion", COMPLETIONS, completion(), lambda r: _tokens(r, 8)),
    ("max_completion_tokens 2 on completions", COMPLETIONS, completion(max_tokens=None, max_completion_tokens=2),
     lambda r: _tokens(r, 2)),
    ("max_completion_tokens 3 on chat", CHAT, chat(max_tokens=None, max_completion_tokens=3), lambda r: _tokens(r, 3)),
    ("max_tokens equal to max_completion_tokens", COMPLETIONS, completion(max_tokens=2, max_completion_tokens=2),
     lambda r: _tokens(r, 2)),
    ("explicit nulls", COMPLETIONS, completion(n=None, stream=None, presence_penalty=None, stop=None, seed=None,
                                               top_p=None, top_k=None, user=None), None),
    ("top_k -1 and 0", COMPLETIONS, completion(top_k=-1), None),
    ("8 stop_token_ids", CHAT, chat(stop_token_ids=list(range(10, 18))), None),
    ("stop_token_ids with the end of text", CHAT, chat(stop_token_ids=[5] + list(range(10, 18))), None),
    ("16 stop strings", CHAT, chat(stop=[f"never{i}" for i in range(16)]), None),
    ("reasoning_effort low", CHAT, chat(reasoning_effort="low"), None),
    ("thinking_budget 0", CHAT, chat(thinking_budget=0), None),
    ("an emoji prompt", CHAT, chat(messages=messages("Start at 3 and add 2, 3 times. 🙂🚀")), None),
    ("a NUL character", COMPLETIONS, completion(prompt="Step\u00001:"), None),
    ("right-to-left and zero-width text", CHAT, chat(messages=messages("\u202eStart\u200b at 3 and add 2.")), None),
    ("a text part", CHAT, chat(messages=messages([{"type": "text", "text": "Start at 3 and add 2, 3 times."}])), None),
    ("developer and assistant turns", CHAT, chat(messages=[{"role": "developer", "content": "Be brief."}, *MESSAGES,
                                                           {"role": "assistant", "content": "ok"}, *MESSAGES]), None),
    ("an unknown extra field", CHAT, chat(metadata={"x": 1}, store=False, service_tier="auto"), None),
    ("tool_choice none", CHAT, chat(tool_choice="none", tools=[]), None),
    ("a token-id prompt", COMPLETIONS, completion(prompt=[12, 40, 7]), None),
    ("a list of one token-id prompt", COMPLETIONS, completion(prompt=[[12, 40, 7]]), None),
    ("a streamed chat with usage", CHAT, chat(stream=True, stream_options={"include_usage": True}), _stream_ok),
    ("a streamed completion", COMPLETIONS, completion(stream=True), _stream_ok),
    ("return_token_ids", COMPLETIONS, completion(return_token_ids=True),
     lambda r: None if len(r.json()["choices"][0]["token_ids"]) == _usage(r)["completion_tokens"] else
     "token ids miscounted"),
    ("duplicate keys (the last wins, as JSON parsers read them)", COMPLETIONS,
     b'{"prompt": "x", "prompt": "Step 1:", "max_tokens": 3, "max_tokens": 2, "temperature": 0}',
     lambda r: _tokens(r, 2)),
    ("a form Content-Type (curl -d)", COMPLETIONS, completion(), None),
]


def run_table(server: Server):
    base = {"content-type": "application/json"}
    for name, path, body, status, names, param in REFUSE:
        if path is None:  # the method probe
            r = httpx.get(server.url + CHAT, timeout=30)
        else:
            r = post(server, path, body, base)
        record("http", name, *judge_error(server, r, status, names, param))
    for name, path, body, check in ANSWER:
        headers = {"content-type": "application/x-www-form-urlencoded"} if "form" in name else base
        record("http", name, *judge_ok(server, post(server, path, body, headers), check))


def run_transport(server: Server):
    """Headers, methods, compressed and chunked bodies, lying lengths, disconnects."""
    url = server.url
    r = post(server, CHAT, b"\x1f\x8b\x08\x00" + os.urandom(64), {"content-encoding": "gzip"})
    record("http", "a gzip body (not decoded by the server)", *judge_error(server, r, 400, ["UTF-8"]))

    def pieces():
        data = json.dumps(completion()).encode()
        for i in range(0, len(data), 7):
            yield data[i: i + 7]

    record("http", "a small chunked body", *judge_ok(server, post(server, COMPLETIONS, pieces())))
    # a Content-Length that claims a terabyte: refused before anything is read
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000000\r\n\r\n{")
        s.shutdown(socket.SHUT_WR)
        answer = read_all(s)
    ok = answer.startswith("HTTP/1.1 413") and "request_too_large" in answer
    record("http", "a Content-Length of a terabyte", "clear error" if ok else "unclear", answer.split("\r\n")[0])
    # a client that leaves mid-body, and one that leaves mid-stream: the server goes on, nothing stays running
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{\"messages\": [")
    with httpx.stream("POST", url + COMPLETIONS, json=completion(max_tokens=200, temperature=1.0, seed=3, stream=True),
                      timeout=30) as r:
        next(r.iter_lines())
    time.sleep(1.0)
    for _ in range(50):
        health = httpx.get(url + "/health", timeout=10).json()
        if health.get("running") == 0:
            break
        time.sleep(0.2)
    good = health.get("status") == "ok" and health.get("running") == 0 and server.proc.poll() is None
    record("http", "clients that leave mid-body and mid-stream", "correct" if good else "unbounded", json.dumps(health))
    for method in ("PUT", "DELETE", "PATCH"):
        r = httpx.request(method, url + CHAT, timeout=30)
        record("http", f"{method} a POST endpoint", *judge_error(server, r, 405, [], None))
    models = httpx.get(url + "/v1/models", timeout=30)
    record("http", "GET /v1/models",
           *judge_ok(server, models, lambda r: None if r.json()["data"][0]["id"] == "builtin" else "wrong id"))
    record("http", "GET /metrics", *judge_ok(server, httpx.get(url + "/metrics", timeout=30),
                                             lambda r: None if "eagle3:requests_total" in r.text else "no counter"))
    record("http", "HEAD /health", "correct" if httpx.head(url + "/health", timeout=30).status_code in (200, 405)
           else "unclear")


def run_load(server: Server):
    """The 20 MB prompt, four 2 MB prompts and a burst: bounded, and nobody waits on them."""
    small = chat(max_tokens=16)
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        httpx.post(server.url + CHAT, json=small, timeout=TIMEOUT).raise_for_status()
        times.append(time.monotonic() - t0)
    service = min(times)
    rss0 = server.rss_mb()

    async def beside(big_bodies: list[bytes]):
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            bigs = [asyncio.ensure_future(c.post(CHAT, content=b, headers={"content-type": "application/json"}))
                    for b in big_bodies]
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            r = await c.post(CHAT, json=small)
            took = time.monotonic() - t0
            return r, took, await asyncio.gather(*bigs, return_exceptions=True)

    for name, bodies in (("a 20 MB chat request", [json.dumps(chat(messages=messages("word " * 4_000_000))).encode()]),
                         ("four 2 MB chat requests at once",
                          [json.dumps(chat(messages=messages("word " * 400_000))).encode()] * 4)):
        r, took, bigs = asyncio.run(beside(bodies))
        rss1 = server.rss_mb()
        refused = all(isinstance(b, httpx.Response) and b.status_code == 413 and
                      b.json()["error"]["code"] == "request_too_large" for b in bigs)
        detail = (f"{[getattr(b, 'status_code', repr(b)) for b in bigs]}; a small request took {took:.2f} s (alone "
                  f"{service:.2f} s); RSS {rss0:.0f} -> {rss1:.0f} MB")
        bounded = r.status_code == 200 and took <= service + 2.0 and rss1 <= 1.1 * rss0
        record("load", name, "clear error" if refused and bounded else "unbounded" if refused else "unclear", detail)
    # text just within the body bound but far past the context: refused before it is tokenized, at once
    body = json.dumps(chat(messages=messages("word " * 20_000))).encode()
    t0 = time.monotonic()
    r = post(server, CHAT, body, {"content-type": "application/json"})
    took = time.monotonic() - t0
    category, detail = judge_error(server, r, (400, 413), [], ...)
    record("load", "100 kB of words (past the context)", category if took < 2 else "unbounded",
           f"{took:.2f} s; {detail}")

    async def burst(n):
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(c.post(CHAT, json=small) for _ in range(n)), return_exceptions=True)

    answers = asyncio.run(burst(24))
    codes = [getattr(a, "status_code", repr(a)) for a in answers]
    texts = {a.json()["choices"][0]["message"]["content"] for a in answers if getattr(a, "status_code", 0) == 200}
    good = codes.count(200) == 24 and len(texts) == 1
    record("load", "24 identical greedy requests at once", "correct" if good else "silent wrong",
           f"codes {sorted(set(map(str, codes)))}, {len(texts)} distinct answers")
    rss2 = server.rss_mb()
    record("load", "memory after every refused request", "correct" if rss2 <= 1.1 * rss0 else "unbounded",
           f"RSS {rss0:.0f} -> {rss2:.0f} MB")


def run_queue(cache: Path, logs: Path):
    """``--max-queue`` counts the requests waiting beyond the free slots: long streamed requests
    fill the slots and the queue exactly (all taken), then one more is refused."""
    long = completion(prompt=[17, 301, 55, 808, 9], max_tokens=None, temperature=2.0, top_k=0, stream=True)

    async def fill_then_one_more(url: str, n: int):
        """(the statuses of ``n`` long streamed requests, the response to one more sent while
        ``/health`` shows all ``n`` running or waiting); a fill that ended first is tried again."""
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as c:
            for attempt in range(5):
                async with contextlib.AsyncExitStack() as held:
                    fills = [await held.enter_async_context(c.stream("POST", COMPLETIONS,
                                                                     json={**long, "seed": 10 * attempt + i}))
                             for i in range(n)]
                    health = (await c.get("/health")).json()
                    if health.get("running", 0) + health.get("waiting", 0) == n:
                        return [f.status_code for f in fills], await c.post(COMPLETIONS, json=completion())
        raise RuntimeError("no attempt held the slots and the queue full")

    with Server(cache, "--max-batch", "1", "--max-queue", "0", "--max-len", "256", log=logs / "queue0.log") as srv:
        r = post(srv, COMPLETIONS, completion())
        record("queue", "--max-batch 1 --max-queue 0: one request on an idle server", *judge_ok(srv, r))
        fills, more = asyncio.run(fill_then_one_more(srv.url, 1))
        record("queue", "--max-batch 1 --max-queue 0: a request while the slot is busy",
               *judge_error(srv, more, 429, ["--max-queue 0"]) if fills == [200] else ("silent wrong", str(fills)))
    with Server(cache, "--max-batch", "2", "--max-queue", "1", "--max-len", "256", log=logs / "queue1.log") as srv:
        fills, more = asyncio.run(fill_then_one_more(srv.url, 3))
        record("queue", "--max-batch 2 --max-queue 1: three long requests (slots and queue exactly full)",
               "correct" if fills == [200] * 3 else "silent wrong", str(fills))
        record("queue", "--max-batch 2 --max-queue 1: one more", *judge_error(srv, more, 429, ["--max-queue 1"]))


# -- the command line -----------------------------------------------------------------------------


def cli_run(argv: list[str], timeout: float = 600) -> tuple[int | None, str, str]:
    """``eagle3-jax ARGV`` in this process: (exit status or None on a hang, stdout, stderr)."""
    from eagle3_jax.cli import main

    out, err, box = io.StringIO(), io.StringIO(), {}

    def run():
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                box["rc"] = main(argv)
            except BaseException as e:  # noqa: BLE001  (a probe records whatever escaped)
                box["rc"] = 1
                print(f"Traceback (escaped): {type(e).__name__}: {e}", file=err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return box.get("rc"), out.getvalue(), err.getvalue()


# (argv, the words its one-line error must hold; None: it must succeed)
CLI = [
    (["generate", ""], ["PROMPT", "empty"]),
    (["generate", "   "], ["PROMPT", "whitespace"]),
    (["generate", "\t\n"], ["PROMPT", "whitespace"]),
    (["generate", "", "--raw"], ["PROMPT", "empty"]),
    (["generate", "--prompt", ""], ["--prompt", "empty"]),
    (["generate", "--prompt", "   "], ["--prompt", "whitespace"]),
    (["generate", "caf\udce9"], ["PROMPT", "encoding", "0xE9"]),
    (["generate", "a\ud800"], ["PROMPT", "encoding", "U+D800"]),
    (["generate"], ["give a prompt"]),
    (["generate", "x", "--prompt", "y"], ["PROMPT", "--prompt"]),
    (["generate", "--prompt-ids", "1", "--temperature", "-1e-3"], ["--temperature", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--temperature", "-inf"], ["--temperature", "finite"]),
    (["generate", "--prompt-ids", "1", "--temperature", "-.5"], ["--temperature", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--temperature", "1e309"], ["--temperature", "finite"]),
    (["generate", "--prompt-ids", "1", "--temperature", "nan"], ["--temperature", "finite"]),
    (["generate", "--prompt-ids", "1", "--top-p", "-1E2"], ["--top-p", "> 0"]),
    (["generate", "--prompt-ids", "1", "--top-p", "0"], ["--top-p", "> 0"]),
    (["generate", "--prompt-ids", "1", "--top-k", "-1"], ["--top-k", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--seed", "-1"], ["--seed", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--seed", str(2 ** 32)], ["--seed", "<"]),
    (["generate", "--prompt-ids", "1", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["generate", "--prompt-ids", "1", "--max-new-tokens", "-5"], ["--max-new-tokens", ">= 1"]),
    (["generate", "--prompt-ids", "1", "--max-new-tokens", "2.5"], ["--max-new-tokens", "integer"]),
    (["generate", "--prompt-ids", "-1,2"], ["--prompt-ids", "non-negative"]),
    (["generate", "--prompt-ids", "1,,2"], ["--prompt-ids", "'1,,2'"]),
    (["generate", "--prompt-ids", ""], ["--prompt-ids"]),
    (["generate", "--prompt-ids", "99999"], ["--prompt-ids", "99999", "vocabulary"]),
    (["generate", "--prompt", "-x"], ["--prompt", "--prompt=VALUE"]),
    (["generate", "--prompt-ids", "1", "--tree", "chain0"], ["--tree"]),
    (["generate", "--prompt-ids", "1", "--thinking-budget", "-1"], ["--thinking-budget", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--thinking-grace", "-1"], ["--thinking-grace", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--dtype", "fp8"], ["--dtype", "'fp8'"]),
    (["generate", "--prompt-ids", "1", "--attention", "flash"], ["--attention", "'flash'"]),
    (["generate", "--prompt-ids", "1", "--mesh", "garbage"], ["--mesh"]),
    (["generate", "--prompt-ids", "1", "--compile-cache", "{file}"], ["--compile-cache", "off"]),
    (["generate", "--prompt-ids", "1", "--compile-cache", "/proc/nope"], ["--compile-cache", "/proc/nope"]),
    (["generate", "--bogus"], ["--bogus"]),
    (["serve", "--port", "70000"], ["--port", "< 65536"]),
    (["serve", "--port", "-1"], ["--port", ">= 0"]),
    (["serve", "--max-queue", "-1"], ["--max-queue", ">= 0"]),
    (["serve", "--max-batch", "0"], ["--max-batch", ">= 1"]),
    (["serve", "--max-len", "1"], ["--max-len", ">= 2"]),
    (["serve", "--max-len", "100000", "--port", "0"], ["--max-len", "max_position_embeddings"]),
    (["serve", "--max-body-bytes", "0"], ["--max-body-bytes", ">= 1"]),
    (["serve", "--max-body-bytes", "-5"], ["--max-body-bytes", ">= 1"]),
    (["serve", "--dispatch-ms", "0"], ["--dispatch-ms", "> 0"]),
    (["serve", "--rounds-per-dispatch", "0"], ["--rounds-per-dispatch", ">= 1"]),
    (["serve", "--speculation", "wide"], ["--speculation", "'wide'"]),
    (["serve", "--reasoning-effort-budgets", "-1", "2", "3"], ["--reasoning-effort-budgets", ">= 0"]),
    (["serve", "--reasoning-effort-budgets", "1", "2"], ["--reasoning-effort-budgets"]),
    (["serve", "--host", "256.1.1.1"], ["--host", "256.1.1.1"]),
    (["serve", "--compile-cache", "{file}"], ["--compile-cache", "off"]),
    (["serve", "--target", "/nowhere"], ["/nowhere"]),
    (["replay", "--rate", "0"], ["--rate", "> 0"]),
    (["replay", "--rate", "-1e-3"], ["--rate", "> 0"]),
    (["replay", "--rate", "1", "--requests", "0"], ["--requests", ">= 1"]),
    (["bench", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    (["bench", "--temperature", "0", "-0.5"], ["--temperature", ">= 0"]),
    (["bench", "--json", "{dir}"], ["--json", "directory"]),
    # plan: the config, sizes, meshes, overrides (it estimates in seconds; --topology compiles)
    (["plan"], ["--config"]),
    (["plan", "--config", "/nope.yaml"], ["--config", "/nope.yaml"]),
    (["plan", "--config", "{dir}/bad.yaml"], ["--config", "bad.yaml", "YAML"]),
    (["plan", "--config", "{dir}/list.yaml"], ["--config", "list.yaml", "mapping"]),
    (["plan", "--config", "{root}/configs/llama31_8b.yaml"], ["mesh", "data=-1", "--mesh"]),
    (["plan", "--config", "{root}/configs/llama31_8b.yaml", "--mesh", "data=2,fsdp=4"], None),
    (["plan", "--config", "{tiny}", "--device-memory", "0.5B"], ["device memory", "0.5B"]),
    (["plan", "--config", "{tiny}", "--device-memory", "0"], ["device memory", "'0'"]),
    (["plan", "--config", "{tiny}", "--device-memory", "-1GiB"], ["--device-memory", "--device-memory=VALUE"]),
    (["plan", "--config", "{tiny}", "--device-memory", "16XB"], ["device memory", "16XB"]),
    (["plan", "--config", "{tiny}", "--device-memory", "nan"], ["device memory", "nan"]),
    (["plan", "--config", "{tiny}", "--device-memory", "1e400GiB"], ["device memory", "1e400GiB"]),
    (["plan", "--config", "{tiny}", "--mesh", "data=0"], ["mesh", "data=0", ">= 1"]),
    (["plan", "--config", "{tiny}", "--mesh", "data=-2"], ["mesh", "data=-2"]),
    (["plan", "--config", "{tiny}", "--mesh", "data=x"], ["mesh", "data=x"]),
    (["plan", "--config", "{tiny}", "--mesh", "bogus=2"], ["mesh", "bogus"]),
    (["plan", "--config", "{tiny}", "--batch", "0"], ["--batch", ">= 1"]),
    (["plan", "--config", "{tiny}", "--batch", "-1"], ["--batch", ">= 1"]),
    (["plan", "--config", "{tiny}", "--seq-len", "0"], ["--seq-len", ">= 1"]),
    (["plan", "--config", "{tiny}", "--seq-len", "-5"], ["--seq-len", ">= 1"]),
    (["plan", "--config", "{tiny}", "--seq-len", "1.5"], ["--seq-len", "integer"]),
    (["plan", "--config", "{tiny}", "--tau", "0"], ["--tau", ">= 1"]),
    (["plan", "--config", "{tiny}", "--tau", "-1"], ["--tau", ">= 1"]),
    (["plan", "--config", "{tiny}", "--tau", "nan"], ["--tau", "finite"]),
    (["plan", "--config", "{tiny}", "--prompt-len", "-1"], ["--prompt-len", ">= 1"]),
    (["plan", "--config", "{tiny}", "--target-config", "/nope.json"], ["--target-config", "/nope.json"]),
    (["plan", "--config", "{tiny}", "--target-config", "{dir}/bad.json"], ["bad.json", "JSON"]),
    (["plan", "--config", "{tiny}", "--topology", "v9z:2x2"], ["--topology", "v9z"]),
    (["plan", "--config", "{tiny}", "--topology", "v5e:2x4", "--json", "{dir}"], ["--json", "directory"]),
    (["plan", "--config", "{tiny}", "bogus_key=1"], ["bogus_key"]),
    (["plan", "--config", "{tiny}", "seq_len=-1"], ["seq_len", ">= 2"]),
    (["plan", "--config", "{tiny}", "seq_len=abc"], ["seq_len", "integer"]),
    (["plan", "--config", "{tiny}", "fit.batch_size=0"], ["fit.batch_size", ">= 1"]),
    # experiment: refused before its first step (outputs, counts, rates, prompts)
    (["experiment", "--budgets", "-1"], ["--budgets", ">= 0"]),
    (["experiment", "--budgets"], ["--budgets"]),
    (["experiment", "--repeats", "0"], ["--repeats", ">= 1"]),
    (["experiment", "--repeats", "-1"], ["--repeats", ">= 1"]),
    (["experiment", "--num-prompts", "0"], ["--num-prompts", ">= 1"]),
    (["experiment", "--num-prompts", "-3"], ["--num-prompts", ">= 1"]),
    (["experiment", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    (["experiment", "--sampled-temperature", "-1"], ["--sampled-temperature", ">= 0"]),
    (["experiment", "--sampled-temperature", "nan"], ["--sampled-temperature", "finite"]),
    (["experiment", "--replay-rates", "0"], ["--replay-rates", "> 0"]),
    (["experiment", "--replay-rates", "-2"], ["--replay-rates", "> 0"]),
    (["experiment", "--replay-rates", "nan"], ["--replay-rates", "finite"]),
    (["experiment", "--replay-requests", "0"], ["--replay-requests", ">= 1"]),
    (["experiment", "--out", "{file}"], ["--out", "not a directory"]),
    (["experiment", "--out", "{file}/x"], ["--out", "not a directory"]),
    (["experiment", "--out", "{dir}/outdir"], ["report.json", "directory"]),
    (["experiment", "--tree", "chain0"], ["--tree", "chain0"]),
    (["experiment", "--prompts", "/nope.json", "--out", "{dir}/o1"], ["/nope.json"]),
    (["experiment", "--prompts", "{dir}/emptylist.json", "--out", "{dir}/o2"], ["emptylist.json", "non-empty"]),
    (["experiment", "--prompts", "{dir}/bad.json", "--out", "{dir}/o3"], ["bad.json", "prompts"]),
    (["experiment", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["experiment", "--max-new-tokens", "-1"], ["--max-new-tokens", ">= 1"]),
    (["experiment", "--top-p", "2"], ["--top-p", "<= 1"]),
    (["experiment", "--thinking-budget", "-4"], ["--thinking-budget", ">= 0"]),
    (["experiment", "--target", "/nope"], ["--drafter"]),
    # bench and replay outputs (checked before anything loads), counts and sizes
    (["replay", "--rate", "1", "--json", "{dir}"], ["--json", "directory"]),
    (["replay", "--rate", "1", "--figure", "{dir}/f.xyz"], ["--figure", "'.xyz'"]),
    (["replay", "--rate", "1", "--json", "{file}/r.json"], ["--json", "not a directory"]),
    (["replay", "--rate", "1", "--json", "{dir}/same.png", "--figure", "{dir}/same.png"], ["--json", "--figure"]),
    (["replay", "--rate", "1", "--requests", "-3"], ["--requests", ">= 1"]),
    (["replay", "--rate", "1", "--max-tokens", "0"], ["--max-tokens", ">= 1"]),
    (["replay", "--rate", "1", "--ttft-slo", "-1"], ["--ttft-slo", "> 0"]),
    (["replay", "--rate", "1", "--max-batch", "1000000"], ["--max-batch 1000000", "--max-len", "GiB"]),
    (["bench", "--figure", "{dir}/f.xyz"], ["--figure", "'.xyz'"]),
    (["bench", "--json", "{file}/r.json"], ["--json", "not a directory"]),
    (["bench", "--num-prompts", "-3"], ["--num-prompts", ">= 1"]),
    (["bench", "--repeats", "-1"], ["--repeats", ">= 1"]),
    (["bench", "--max-new-tokens", "-1"], ["--max-new-tokens", ">= 1"]),
    (["bench", "--batch-size", "-2"], ["--batch-size", ">= 1"]),
    # numeric limits: huge values (refused by what they exceed), negatives after a space
    (["serve", "--max-batch", "1000000", "--port", "0"], ["--max-batch 1000000", "--max-len", "GiB"]),
    (["serve", "--max-queue", "1e3"], ["--max-queue", "integer"]),
    (["serve", "--dispatch-ms", "-5"], ["--dispatch-ms", "> 0"]),
    (["serve", "--max-len", "-1"], ["--max-len", ">= 2"]),
    (["generate", "--prompt-ids", "1", "--max-new-tokens", "1000000000", "--no-compare"],
     ["max_new_tokens", "1000000000", "max_position_embeddings"]),
    (["generate", "--prompt-ids", "1", "--top-k", "1000000000", "--no-compare"], ["top_k", "1000000000"]),
    (["generate", "-5", "--max-new-tokens", "24", "--no-compare"], None),
    (["generate", "Start at 3 and add 2, 3 times.", "--max-new-tokens", "40", "--no-compare"], None),
]


def run_cli(tmp: Path):
    (tmp / "a_file").write_text("")
    (tmp / "bad.yaml").write_text('"a: [1')
    (tmp / "list.yaml").write_text("- 1\n")
    (tmp / "bad.json").write_text("{\n")
    (tmp / "emptylist.json").write_text("[]")
    (tmp / "outdir" / "report.json").mkdir(parents=True, exist_ok=True)  # a directory where a report goes
    for argv, words in CLI:
        argv = [a.format(file=tmp / "a_file", dir=tmp, root=ROOT, tiny=ROOT / "configs" / "tiny.yaml") for a in argv]
        rc, out, err = cli_run(argv)
        name = " ".join(repr(a) if not a or " " in a or not a.isprintable() else a for a in argv)
        if rc is None:
            record("cli", name, "hang")
        elif "Traceback" in err or rc == 1:
            record("cli", name, "crash", err.strip()[-160:])
        elif words is None:
            record("cli", name, "correct" if rc == 0 and out.strip() else "unclear", (out or err).strip()[-120:])
        elif rc == 0:
            record("cli", name, "silent wrong", out.strip()[-120:])
        else:
            lines = err.strip().splitlines()
            named = all(w.lower() in err.lower() for w in words)
            record("cli", name, "clear error" if rc == 2 and len(lines) == 1 and named else "unclear",
                   err.strip()[-160:])


# -- start-up -----------------------------------------------------------------------------------


def run_startup(logs: Path) -> dict:
    """A first and a second start of the default ``eagle3-jax serve`` on a fresh cache
    (``scripts/serve_startup.py``'s): seconds from launch to ``/health`` ok, the server's CPU
    seconds by then, and the machine's load."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_startup import start

    cache = Path(tempfile.mkdtemp(prefix="eagle3-probe-startup-"))
    try:
        times = {}
        for which in ("first", "second"):
            res = start(cache, logs / f"startup_{which}.log")
            if res["ready_s"] is None:
                raise RuntimeError(f"the {which} start was not ready: {res.get('error')}")
            times[which] = {"ready_s": res["ready_s"], "cpu_s": res["cpu_s"], "uptime": res["uptime_after"]}
            print(f"{which} start of eagle3-jax serve: ready in {res['ready_s']:.1f} s ({res['cpu_s']:.1f} s of CPU; "
                  f"{res['uptime_after']})", flush=True)
        return times
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, help="the servers' compilation cache (default: a fresh temporary one)")
    ap.add_argument("--startup", action="store_true", help="also time a first and a second start on a fresh cache")
    ap.add_argument("--json", type=Path, help="write every probe's outcome here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-probes-"))
    cache = args.cache or tmp / "xla"
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)  # the in-process command line shares it
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logs = tmp / "logs"
    logs.mkdir()
    print(f"logs in {logs}", flush=True)
    times = None
    try:
        if args.startup:
            times = run_startup(logs)
        with Server(cache, log=logs / "default.log") as srv:
            warming = [s for s in srv.statuses if s.get("status") == "warming_up"]
            shown = any(s.get("programs_total") for s in warming)
            record("startup", "/health says warming_up with programs compiled of the total until ready",
                   "correct" if shown else "unclear", json.dumps(warming[-1]) if warming else "never seen")
            if srv.early_answer is not None:
                record("startup", "a request during warm-up", *judge_error(srv, srv.early_answer, 503, ["warming up"]))
            run_table(srv)
            run_transport(srv)
            run_load(srv)
            if srv.proc.poll() is not None:
                record("http", "the server after every probe", "crash", f"exited {srv.proc.returncode}")
        run_queue(cache, logs)
        run_cli(tmp)
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)
    counts = {c: sum(r["outcome"] == c for r in results) for c in CATEGORIES}
    print(f"\n{len(results)} probes: " + ", ".join(f"{n} {c}" for c, n in counts.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "startup_s": times, "probes": results}, indent=1) + "\n")
    return 0 if all(r["outcome"] in GOOD for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
