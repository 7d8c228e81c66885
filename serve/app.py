"""The OpenAI-compatible HTTP server (FastAPI + uvicorn + prometheus_client).

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as SSE or
not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.  Chat responses carry the
thinking text in ``reasoning_content`` (and ``reasoning``, vLLM's newer name) and the answer
in ``content``; ``usage`` has ``completion_tokens_details.reasoning_tokens`` and the request's
speculative figures under ``speculative`` (rounds, tau, proposed, accepted, acceptance per
draft position, per phase).  Errors are OpenAI's ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad parameter (named in ``param``; every one is checked before a response
starts, so a stream never opens on a bad request), 404 for an unknown model, 413 for a body
past ``--max-body-bytes`` (before it is read), 429 when the slots and the queue are full, 503
while the engine warms up (``/health`` says ``warming_up``, with the programs compiled of the
total) and when it is down.

Requests are bounded before they cost anything: the body's bytes, then the prompt text's
characters (the most that can fit in the context) before it is tokenized; prompts are
tokenized on worker threads (:class:`TokenizerPool`), off the event loop and the engine
thread.  Content other than text (images, audio, files) and tool calling are refused by name.

Request parameters besides OpenAI's: ``top_k``, ``stop_token_ids``, ``thinking_budget``
(thinking tokens allowed; ``reasoning_effort`` low / medium / high maps to budgets set by the
server), ``return_token_ids`` (the generated token ids, as vLLM's option).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import gc
import json
import secrets
import threading
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle3_jax import limits
from eagle3_jax.atomic import write_atomic
from eagle3_jax.serve.engine import Engine, EngineDown, Params, QueueFull
from eagle3_jax.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from eagle3_jax.serve.text import blank_problem, encoding_problem

# a request's stop strings are matched on the engine's thread at every dispatch, beside every
# other request's: bounded (OpenAI allows 4)
MAX_STOP, MAX_STOP_CHARS = 16, 256
MAX_STOP_IDS = 8  # stop ids a request may add to the target's EOS (the slots' max_stop_ids: build passes it)
EFFORTS = ("low", "medium", "high")
TOKENIZE_WORKERS = 2  # threads that tokenize prompts and apply chat templates
WARMUP_GC_THRESHOLD = 100_000  # the collector's first threshold while serve warms up (Python's default: 700)


# -- errors -------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered in OpenAI's shape (429 and 503 with ``Retry-After``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("rate_limit_error" if status == 429 else "invalid_request_error" if status < 500
                             else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def _param(loc) -> str | None:
    """``("body", "messages", 0, "content", "list[ContentPart]", 1, "text")`` →
    ``"messages[0].content[1].text"`` (pydantic's union members and dictionary keys left out)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part.lower() not in _UNION_TAGS:
            out += ("." if out else "") + part
    return out or None


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON ({detail})" if detail else
                        "the request body is not valid JSON", None, "invalid_json")
    if tuple(first.get("loc", ())) == ("body",):  # JSON, but not an object
        got = first.get("input")
        return ApiError(400, "the request body must be a JSON object of the request's fields, got "
                             + ("null" if got is None else type(got).__name__), None, "invalid_request")
    parts = []
    for e in errors:
        p = _param(e.get("loc", ()))
        parts.append(f"{p}: {e.get('msg')}" if p else str(e.get("msg")))
    return ApiError(400, "; ".join(dict.fromkeys(parts)) or "invalid request", _param(first.get("loc", ())),
                    "invalid_parameter")


# -- requests -----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class ContentPart(_Strict):
    """One part of a message's content: only ``text`` parts are served (others are refused by
    name in :func:`check`)."""

    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Sampling(_Strict):
    """Parameters shared by both endpoints (OpenAI's, plus vLLM's ``top_k`` /
    ``stop_token_ids`` / ``return_token_ids`` and the thinking budget)."""

    model: str | None = None
    max_tokens: int | None = Field(None, **limits.MAX_NEW_TOKENS.pydantic())
    max_completion_tokens: int | None = Field(None, **limits.MAX_NEW_TOKENS.pydantic())
    temperature: float | None = Field(None, le=2, **limits.TEMPERATURE.pydantic())  # OpenAI's upper bound
    top_p: float | None = Field(None, **limits.TOP_P.pydantic())
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, **limits.SEED.pydantic())
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(1, **limits.POSITIVE.pydantic())
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    thinking_budget: int | None = Field(None, **limits.THINKING_BUDGET.pydantic())
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    return_token_ids: bool | None = False
    user: str | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


# parameters whose non-default values this server cannot honour: refused by name, not ignored
# (name → (the values that mean "off", what the parameter asks for))
_UNSUPPORTED = {
    "logprobs": ((None, False, 0), "log probabilities"), "top_logprobs": ((None, 0), "log probabilities"),
    "echo": ((None, False), "echoing the prompt"), "best_of": ((None, 1), "best_of sampling"),
    "suffix": ((None, ""), "a suffix (insertion)"), "tools": ((None, []), "tool calling"),
    "functions": ((None, []), "function calling"), "tool_choice": ((None, "none"), "tool calling"),
    "function_call": ((None, "none"), "function calling"), "logit_bias": ((None, {}), "logit bias"),
    "response_format": ((None, {"type": "text"}), "structured output"),
    "presence_penalty": ((None, 0, 0.0), "a presence penalty"),
    "frequency_penalty": ((None, 0, 0.0), "a frequency penalty"),
    "audio": ((None,), "audio output"), "modalities": ((None, ["text"]), "output other than text"),
    "prediction": ((None,), "predicted outputs"), "web_search_options": ((None,), "web search"),
    # a server setting (--speculation): one compiled program serves all slots
    "speculation": ((None,), "a per-request speculation budget"),
}
_ROLES = ("system", "developer", "user", "assistant")
# content part types a client may send that this text-only server refuses by what they are
_PART_KINDS = {"image_url": "images", "image": "images", "input_image": "images", "input_audio": "audio",
               "audio": "audio", "video_url": "video", "video": "video", "file": "files", "input_file": "files"}


# -- the server's settings ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine.

    ``model_name``: the served model id; ``vocab_size``: the target's; ``temperature``: the
    default when a request gives none; ``effort_budgets``: thinking budgets of
    ``reasoning_effort`` low / medium / high (None: unlimited); ``max_stop_ids``: the stop ids a
    request may add (the slots' ``max_stop_ids``); ``max_prompt_chars``: the most characters of
    prompt text taken to the tokenizer (:func:`prompt_char_limit`); ``max_body_bytes``: the
    largest request body read (:func:`body_byte_limit`).  The two limits left None are sized
    from the engine by :func:`create_app`."""

    model_name: str
    vocab_size: int
    temperature: float = 1.0
    effort_budgets: tuple = (256, 1024, None)
    max_stop_ids: int = MAX_STOP_IDS
    max_prompt_chars: int | None = None
    max_body_bytes: int | None = None

    def __post_init__(self):
        if len(self.effort_budgets) != len(EFFORTS):
            raise ValueError(f"effort_budgets: need 3 budgets (low, medium, high), got {self.effort_budgets!r}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")

    def effort_budget(self, effort: str) -> int | None:
        return dict(zip(EFFORTS, self.effort_budgets))[effort]


def prompt_char_limit(tokenizer, max_prompt_len: int) -> int:
    """The most characters of text that can fit in ``max_prompt_len`` tokens: no token of
    ``tokenizer`` stands for more characters than its longest vocabulary entry has (a
    byte-level entry shows one character per byte), so longer text is refused before it is
    tokenized."""
    return max_prompt_len * max(1, max(map(len, tokenizer.get_vocab()), default=1))


def body_byte_limit(max_prompt_chars: int, max_prompt_len: int) -> int:
    """The default bound on a request body: the prompt's characters as JSON escapes (at most
    12 bytes each, a ``\\uXXXX`` surrogate pair), 64 bytes per token (a token id and its
    separator, a message's fields) and 128 KiB for the other parameters."""
    return 12 * max_prompt_chars + 64 * max_prompt_len + (128 << 10)


# -- checking a request ---------------------------------------------------------------------


def _where(req: _Sampling) -> str:
    return "prompt" if isinstance(req, CompletionRequest) else "messages"


def _texts(req: _Sampling) -> list[tuple[str, str]]:
    """(parameter name, text) of every prompt text of a request."""
    if isinstance(req, ChatRequest):
        out = []
        for i, m in enumerate(req.messages):
            if isinstance(m.content, str):
                out.append((f"messages[{i}].content", m.content))
            else:
                out += [(f"messages[{i}].content[{j}].text", p.text or "") for j, p in enumerate(m.content or ())]
        return out
    p = req.prompt
    if isinstance(p, str):
        return [("prompt", p)]
    return [(f"prompt[{i}]", x) for i, x in enumerate(p) if isinstance(x, str)]


def _check_messages(req: ChatRequest):
    """Roles, content parts and tool calls: only text is served, the rest refused by name."""
    for i, m in enumerate(req.messages):
        if m.role in ("tool", "function"):
            raise ApiError(400, f"messages[{i}].role: {m.role} messages are not supported by this server (it does "
                                "no tool calling)", f"messages[{i}].role", "unsupported_content")
        if m.role not in _ROLES:
            raise ApiError(400, f"messages[{i}].role: {m.role!r} is not a role ({', '.join(_ROLES)})",
                           f"messages[{i}].role", "invalid_parameter")
        for name in ("tool_calls", "function_call", "audio"):
            if (m.model_extra or {}).get(name):
                raise ApiError(400, f"messages[{i}].{name}: {'audio' if name == 'audio' else 'tool calls'} are not "
                                    "supported by this server", f"messages[{i}].{name}", "unsupported_content")
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            if part.type in _PART_KINDS:
                raise ApiError(400, f"{where}: {_PART_KINDS[part.type]} are not supported by this server (a "
                                    f"{part.type!r} part); send text", where, "unsupported_content")
            if part.type != "text":
                raise ApiError(400, f"{where}: a {part.type!r} part is not supported by this server (only text "
                                    "parts)", where, "unsupported_content")
            if part.text is None:
                raise ApiError(400, f"{where}.text: a text part needs its text", f"{where}.text", "invalid_parameter")


def check(req: _Sampling, cfg: ServerConfig, slots) -> None:
    """Every check of a request that needs no tokens (run before it is tokenized, and before
    any response starts): the model, parameters this server cannot honour, the sampling
    parameters, stop strings and ids (their count too, as the slots bound it), thinking, the
    content (text only), the prompt text (not blank, valid Unicode, at most
    ``cfg.max_prompt_chars`` characters) and token-id prompts.  ``ApiError`` names the
    parameter; :func:`resolve` checks the tokenized prompt's length."""
    _check_parameters(req, cfg, slots)
    if isinstance(req, ChatRequest):
        _check_messages(req)
    _check_prompt(req, cfg, slots)


def _check_parameters(req: _Sampling, cfg: ServerConfig, slots):
    if req.model is not None and req.model != cfg.model_name:
        raise ApiError(404, f"The model `{req.model}` does not exist (this server serves `{cfg.model_name}`)", "model",
                       "model_not_found")
    extra = req.model_extra or {}
    for name, (defaults, what) in _UNSUPPORTED.items():
        if name in extra or name in type(req).model_fields:
            value = extra[name] if name in extra else getattr(req, name)
            if value not in defaults:
                hint = " (the speculative budget is the server's: eagle3-jax serve --speculation)" \
                    if name == "speculation" else ""
                raise ApiError(400, f"{name}: {what} is not supported by this server (got {value!r}){hint}", name,
                               "unsupported_parameter")
    if req.n not in (None, 1):
        raise ApiError(400, f"n: only n=1 is supported, got {req.n}", "n", "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, f"max_tokens ({req.max_tokens}) and max_completion_tokens ({req.max_completion_tokens}) "
                            "disagree: give one", "max_completion_tokens")
    if req.top_k is not None and req.top_k > cfg.vocab_size:
        raise ApiError(400, f"top_k={req.top_k} exceeds the vocabulary ({cfg.vocab_size}); -1 or 0 turn it off",
                       "top_k")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
    if any(s == "" or len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop: stop strings must be non-empty and at most {MAX_STOP_CHARS} characters", "stop")
    for i, s in enumerate(stop):
        problem = encoding_problem(s)
        if problem:
            raise ApiError(400, f"stop[{i}] {problem}", "stop", "invalid_encoding")
    stop_ids = list(req.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ApiError(400, f"stop_token_ids: {bad[0]} is out of range for the vocabulary (0..{cfg.vocab_size - 1})",
                       "stop_token_ids")
    added = set(stop_ids) - set(slots.stop_ids)
    if len(added) > cfg.max_stop_ids:
        raise ApiError(400, f"stop_token_ids: at most {cfg.max_stop_ids} stop ids besides the model's end of text, "
                            f"got {len(added)}", "stop_token_ids")
    if req.reasoning_effort is not None and req.thinking_budget is not None:
        raise ApiError(400, "give thinking_budget or reasoning_effort, not both", "reasoning_effort")
    if slots.thinking is None and (req.thinking_budget is not None or req.reasoning_effort is not None):
        name = "thinking_budget" if req.thinking_budget is not None else "reasoning_effort"
        raise ApiError(400, f"{name}: this model has no thinking phase (its tokenizer has no <think>/</think>)", name)


def _check_prompt(req: _Sampling, cfg: ServerConfig, slots):
    texts = _texts(req)
    for name, text in texts:
        problem = encoding_problem(text)
        if problem:
            raise ApiError(400, f"{name} {problem}", name, "invalid_encoding")
    where = _where(req)
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
            raise ApiError(400, f"prompt: only one prompt per request is supported, got {len(p)}", "prompt",
                           "unsupported_parameter")
        p = p[0] if isinstance(p, list) and p and isinstance(p[0], (str, list)) else p
        if isinstance(p, str):
            problem = blank_problem(p)
            if problem:
                raise ApiError(400, f"prompt {problem}: nothing to complete", "prompt", "empty_prompt")
        else:
            if not p:
                raise ApiError(400, "prompt is empty: nothing to complete", "prompt", "empty_prompt")
            bad = [t for t in p if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is out of range for the vocabulary "
                                    f"(0..{cfg.vocab_size - 1})", "prompt")
    elif all(blank_problem(text) for _, text in texts):
        raise ApiError(400, "messages: every message is empty or only whitespace: nothing to answer", "messages",
                       "empty_prompt")
    chars = sum(len(text) for _, text in texts)
    if chars > cfg.max_prompt_chars:
        raise ApiError(400, f"{where}: the prompt text is {chars} characters, more than can fit in this server's "
                            f"context (prompts of up to {slots.max_prompt_len} tokens; text of more than "
                            f"{cfg.max_prompt_chars} characters is not tokenized)", where, "context_length_exceeded")


def resolve(req: _Sampling, prompt_ids: list[int], engine: Engine, cfg: ServerConfig) -> Params:
    """The engine parameters of a request :func:`check` passed, given its prompt's tokens, or
    ``ApiError`` naming the parameter (the prompt too long, ``max_tokens`` /
    ``max_completion_tokens`` beyond the room it leaves, a token outside the vocabulary)."""
    slots = engine.slots
    where = _where(req)
    if not prompt_ids:
        raise ApiError(400, f"{where}: the prompt is empty", where, "empty_prompt")
    if max(prompt_ids) >= cfg.vocab_size:
        raise ApiError(400, f"{where}: the tokenizer gave token id {max(prompt_ids)}, outside the target's vocabulary "
                            f"(0..{cfg.vocab_size - 1})", where)
    room = slots.max_new_tokens_for(len(prompt_ids))
    if room <= 0:
        raise ApiError(400, f"{where}: the prompt is {len(prompt_ids)} tokens, too long for this server: prompts of "
                            f"up to {slots.max_prompt_len} tokens, {slots.request_len} per request with the output",
                       where, "context_length_exceeded")
    limit, name = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        limit, name = req.max_completion_tokens, "max_completion_tokens"
    if limit is not None and limit > room:
        raise ApiError(400, f"{name}={limit} is too large: a prompt of {len(prompt_ids)} tokens leaves room for at most "
                            f"{room} new tokens (context {slots.request_len})", name, "context_length_exceeded")
    temperature = cfg.temperature if req.temperature is None else req.temperature
    if temperature < limits.MIN_TEMPERATURE:
        temperature = 0.0  # greedy
    budget = req.thinking_budget
    if req.reasoning_effort is not None:
        budget = cfg.effort_budget(req.reasoning_effort)
    seed = req.seed if req.seed is not None else secrets.randbelow(2 ** 32)
    return Params(max_new_tokens=limit if limit is not None else room, temperature=float(temperature),
                  top_p=1.0 if req.top_p is None else float(req.top_p),
                  top_k=0 if req.top_k in (None, -1) else req.top_k, seed=seed,
                  stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
                  stop_token_ids=tuple(req.stop_token_ids or ()), thinking_budget=budget)


def _chat_prompt(tokenizer, req: ChatRequest) -> list[int]:
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    except Exception as e:  # a template's own refusal (e.g. roles out of order)
        raise ApiError(400, f"messages: the chat template refused them ({type(e).__name__}: {e})", "messages") from None
    return list(out["input_ids"])


def _completion_prompt(tokenizer, req: CompletionRequest) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]
    return list(tokenizer.encode(p)) if isinstance(p, str) else list(p)


class TokenizerPool:
    """Prompts tokenized (chat templates applied) on ``workers`` threads, off the event loop and
    the engine thread, so that one long prompt delays no other request's stream; each thread
    tokenizes with its own copy of ``tokenizer`` (a fast tokenizer is not used from two threads
    at once).  ``busy`` counts the prompts in the pool (the app bounds it)."""

    def __init__(self, tokenizer, workers: int = TOKENIZE_WORKERS):
        local = threading.local()

        def init():
            local.tokenizer = copy.deepcopy(tokenizer)

        self._local = local
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="eagle3-tokenize",
                                                           initializer=init)
        self.busy = 0  # prompts in the pool (read and written on the event loop only)

    def _call(self, fn, req):
        return fn(self._local.tokenizer, req)

    async def run(self, fn, req) -> list[int]:
        """``fn(tokenizer, req)`` on a worker thread."""
        self.busy += 1
        try:
            return await asyncio.wrap_future(self._pool.submit(self._call, fn, req))
        finally:
            self.busy -= 1

    def shutdown(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


# -- responses ----------------------------------------------------------------------------


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    return x


def usage(res) -> dict:
    """OpenAI's ``usage`` of a finished request, with its speculative figures."""
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "completion_tokens_details": {"reasoning_tokens": res.reasoning_tokens},
            "speculative": _jsonable(res.stats)}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Stream:
    """The chunks of one streamed response (chat or completion)."""

    def __init__(self, kind: str, model: str, include_usage: bool, token_ids: bool):
        self.kind, self.model, self.include_usage, self.token_ids = kind, model, include_usage, token_ids
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def chunk(self, choice: dict | None, usage_: dict | None = None) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": [] if choice is None else [choice]}
        if self.include_usage:
            obj["usage"] = usage_
        return _sse(obj)

    def choice(self, delta: dict | None = None, text: str | None = None, finish: str | None = None, ids=None) -> dict:
        c = {"index": 0}
        if self.kind == "chat":
            c["delta"] = delta or {}
        else:
            c["text"] = text or ""
        c["logprobs"] = None
        c["finish_reason"] = finish
        if self.token_ids and ids is not None:
            c["token_ids"] = list(ids)
        return c

    def deltas(self, texts: dict, ids) -> list[str]:
        out = []
        if self.kind == "chat":
            parts = []
            if texts.get("reasoning"):
                parts.append({"reasoning_content": texts["reasoning"], "reasoning": texts["reasoning"]})
            if texts.get("content"):
                parts.append({"content": texts["content"]})
            if not parts and self.token_ids and ids:
                parts.append({})
            for i, d in enumerate(parts):
                out.append(self.chunk(self.choice(delta=d, ids=ids if i == len(parts) - 1 else [])))
        elif texts.get("text") or (self.token_ids and ids):
            out.append(self.chunk(self.choice(text=texts.get("text", ""), ids=ids)))
        return out


def _finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


# -- the app ------------------------------------------------------------------------------


CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
_ENDPOINTS = {CHAT_PATH: "chat", COMPLETIONS_PATH: "completions"}  # each POST route → its metrics label


class _BodyGuard:
    """Reads every ``POST /v1/...`` body before the app does, as JSON whatever its Content-Type
    (``curl -d`` sends form-encoded), as OpenAI's API does; refuses in OpenAI's error shape,
    before any parsing, a body of more than ``max_bytes`` (413, as soon as its Content-Length or
    its bytes pass the bound: the rest is never read), an empty one and one that is not UTF-8
    (400).  ``on_reject(path, error)`` hears of each refusal."""

    def __init__(self, app, max_bytes: int, on_reject):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"the request body is {size}, more than this server reads ({self.max_bytes} bytes: "
                             "eagle3-jax serve --max-body-bytes)", None, "request_too_large")

    async def __call__(self, scope, receive, send):
        if not (scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/")):
            return await self.app(scope, receive, send)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        length = dict(headers).get(b"content-length", b"")
        err = self._too_large(f"{int(length)} bytes") if length.isdigit() and int(length) > self.max_bytes else None
        body, more = bytearray(), err is None
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            more = message.get("more_body", False)
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                err, body, more = self._too_large(f"over {self.max_bytes} bytes"), None, False
        if err is None and not body.strip():
            err = ApiError(400, "the request body is empty: send a JSON object of the request's fields", None,
                           "empty_body")
        if err is None:
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                err = ApiError(400, "the request body is not UTF-8 text (an encoding error): byte "
                                    f"0x{body[e.start]:02X} at offset {e.start}", None, "invalid_encoding")
        if err is not None:
            self.on_reject(scope["path"], err)
            return await err.response()(scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # http.disconnect, when the client goes
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


class Startup:
    """An engine built on a background thread while the app serves: ``/health`` says
    ``warming_up`` (HTTP 503) with the programs compiled so far, and generation requests get
    503 (``warming_up``) until it is ready.

    ``make(progress)`` builds and starts the engine, calling ``progress(done, total, what)`` as
    it compiles (``total`` None while unknown); ``on_progress`` hears the same,
    ``on_ready(engine)`` the engine once it serves, and ``on_error(exception)`` a failure
    (``error`` holds it)."""

    def __init__(self, make, on_progress=None, on_error=None, on_ready=None):
        self._make, self._on_progress, self._on_error, self._on_ready = make, on_progress, on_error, on_ready
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.done, self.total, self.what = 0, None, "starting"
        self._thread = threading.Thread(target=self._run, name="eagle3-warmup", daemon=True)

    def start(self) -> "Startup":
        self._thread.start()
        return self

    def join(self, timeout: float | None = None):
        self._thread.join(timeout)

    def _progress(self, done: int, total: int | None, what: str):
        self.done, self.total, self.what = done, total, what
        if self._on_progress is not None:
            self._on_progress(done, total, what)

    def _run(self):
        try:
            self.engine = self._make(self._progress)
        except BaseException as e:  # noqa: BLE001  (reported by /health and serve_main, not lost in a thread)
            self.error = e
            if self._on_error is not None:
                self._on_error(e)
            return
        if self._on_ready is not None:
            self._on_ready(self.engine)

    def status(self) -> dict:
        """``/health``'s body while not ready."""
        if self.error is not None:
            return {"status": "failed", "error": f"{type(self.error).__name__}: {self.error}"}
        return {"status": "warming_up", "programs_compiled": self.done, "programs_total": self.total,
                "compiling": self.what}


def create_app(engine: Engine | Startup, cfg: ServerConfig, metrics: Metrics | None = None, tokenizer=None,
               tokenize_workers: int = TOKENIZE_WORKERS) -> FastAPI:
    """The FastAPI app over a started ``engine``, or over a :class:`Startup` that builds one
    (started with the app; ``cfg`` then gives both limits); ``tokenizer`` encodes prompts
    (default: the engine's own) on ``tokenize_workers`` threads (:class:`TokenizerPool`).
    Shutting the app down stops the engine."""
    startup = engine if isinstance(engine, Startup) else None
    if startup is None:
        tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        metrics = metrics if metrics is not None else engine.metrics
        chars = cfg.max_prompt_chars or prompt_char_limit(tokenizer, engine.slots.max_prompt_len)
        cfg = dataclasses.replace(cfg, max_prompt_chars=chars,
                                  max_body_bytes=cfg.max_body_bytes or body_byte_limit(chars, engine.slots.max_len))
    elif tokenizer is None or cfg.max_prompt_chars is None or cfg.max_body_bytes is None:
        raise ValueError("create_app over a Startup needs the tokenizer and cfg's max_prompt_chars and max_body_bytes")
    tokenizers = TokenizerPool(tokenizer, tokenize_workers)

    def ready() -> Engine:
        """The engine, or ``ApiError`` 503 while it warms up (or if it failed to start)."""
        if startup is None:
            return engine
        if startup.engine is not None:
            return startup.engine
        if startup.error is not None:
            raise ApiError(503, f"the engine failed to start ({type(startup.error).__name__}: {startup.error})", None,
                           "engine_down")
        done = f"compiling {startup.what}" if startup.total is None else \
            f"{startup.done} of {startup.total} programs compiled"
        raise ApiError(503, f"the server is warming up ({done}); retry shortly", None, "warming_up")

    async def lifespan(app):
        if startup is not None:
            startup.start()
        yield
        tokenizers.shutdown()
        running = engine if startup is None else startup.engine
        if running is not None:
            await asyncio.to_thread(running.shutdown)

    def reject(err: ApiError) -> JSONResponse:
        if metrics is not None and err.status != 499:  # a request whose client left is counted as cancelled
            metrics.request_rejected(err.status)
        return err.response()

    def refused_body(path: str, err: ApiError):
        if metrics is not None:
            if path in _ENDPOINTS:
                metrics.request_received(_ENDPOINTS[path])
            metrics.request_rejected(err.status)

    app = FastAPI(title="eagle3-jax", lifespan=lifespan)
    app.add_middleware(_BodyGuard, max_bytes=cfg.max_body_bytes, on_reject=refused_body)
    app.state.engine, app.state.startup, app.state.config, app.state.metrics = \
        (engine if startup is None else None), startup, cfg, metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        endpoint = _ENDPOINTS.get(request.url.path)
        if metrics is not None and endpoint is not None:  # refused before its handler counted it
            metrics.request_received(endpoint)
        return reject(_validation_error(exc))

    @app.exception_handler(ApiError)
    async def _api_error(request, exc):
        return reject(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.__cause__ is not None:  # FastAPI's "There was an error parsing the body": say what the error was
            message = "the request body is not valid JSON for this server: it nests too deeply" \
                if isinstance(exc.__cause__, RecursionError) else f"{message} ({type(exc.__cause__).__name__}: " \
                                                                  f"{exc.__cause__})"
            code = "invalid_json"
            refused_body(request.url.path, ApiError(exc.status_code, message))
        return JSONResponse(ApiError(exc.status_code, message, None, code).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        if startup is not None and startup.engine is None:
            return JSONResponse(startup.status(), status_code=503, headers={"Retry-After": "1"})
        eng = ready()
        if eng.alive:
            return {"status": "ok", "running": eng.running, "waiting": eng.waiting,
                    "programs_to_compile": eng.deferred}
        return ApiError(503, eng.error or "the engine is not running").response()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "eagle3-jax", "max_model_len": ready().slots.request_len}]}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are off", None, "not_found")
        eng = startup.engine if startup is not None else engine
        if eng is not None:
            metrics.engine_state(eng.waiting, eng.running)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def admit(body: _Sampling, prompt, split: bool):
        """Checks, tokenizes (on the pool) and submits a request: every refusal before any
        response starts."""
        eng = ready()
        check(body, cfg, eng.slots)
        if tokenizers.busy >= eng.slots.num_slots + eng.max_queue:  # what waits to be tokenized is bounded too
            raise ApiError(429, f"the queue is full: {tokenizers.busy} requests are being tokenized, as many as the "
                                f"{eng.slots.num_slots} slots and the queue (--max-queue {eng.max_queue}) hold", None,
                           "queue_full")
        prompt_ids = await tokenizers.run(prompt, body)
        params = resolve(body, prompt_ids, eng, cfg)
        try:
            return eng.submit(prompt_ids, params, split=split)
        except QueueFull as e:
            raise ApiError(429, str(e), None, "queue_full") from None
        except EngineDown as e:
            raise ApiError(503, str(e), None, "engine_down") from None

    def response(prefix: str, kind: str, choice: dict, res, req, body) -> dict:
        """A non-streamed response around its one choice (token ids on request, as vLLM)."""
        out = {"id": prefix + uuid.uuid4().hex, "object": kind, "created": int(time.time()),
               "model": cfg.model_name, "choices": [choice], "usage": usage(res)}
        if body.return_token_ids:
            choice["token_ids"] = res.tokens
            out["prompt_token_ids"] = req.prompt_ids
        return out

    @app.post(CHAT_PATH)
    async def chat(body: ChatRequest, request: Request):
        if metrics is not None:
            metrics.request_received(_ENDPOINTS[CHAT_PATH])
        req = await admit(body, _chat_prompt, split=True)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return _streaming(req, _Stream("chat", cfg.model_name, include_usage, body.return_token_ids))
        res = await _wait(req, request)
        reasoning = res.texts.get("reasoning", "") if req.engine.slots.thinking is not None else None
        message = {"role": "assistant", "content": res.texts.get("content", ""), "reasoning_content": reasoning,
                   "reasoning": reasoning}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(res.finish_reason)}
        return response("chatcmpl-", "chat.completion", choice, res, req, body)

    @app.post(COMPLETIONS_PATH)
    async def completions(body: CompletionRequest, request: Request):
        if metrics is not None:
            metrics.request_received(_ENDPOINTS[COMPLETIONS_PATH])
        req = await admit(body, _completion_prompt, split=False)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return _streaming(req, _Stream("completion", cfg.model_name, include_usage, body.return_token_ids))
        res = await _wait(req, request)
        choice = {"index": 0, "text": res.texts.get("text", ""), "logprobs": None,
                  "finish_reason": _finish_reason(res.finish_reason)}
        return response("cmpl-", "text_completion", choice, res, req, body)

    return app


async def _wait(req, request: Request, poll_s: float = 0.25):
    """The finished result of a non-streamed request; cancels it if the client goes away
    (looked for every ``poll_s`` seconds, while its tokens arrive too)."""
    loop = asyncio.get_running_loop()
    look_at = loop.time() + poll_s
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(req.events.get(), max(look_at - loop.time(), 0.0))
            except TimeoutError:
                kind = None
            if kind == "done":
                return payload
            if kind == "error":
                raise ApiError(*payload)
            if loop.time() >= look_at:
                if await request.is_disconnected():
                    req.cancel()
                    raise ApiError(499, "the client closed the request", None, "client_closed")
                look_at = loop.time() + poll_s
    except asyncio.CancelledError:
        req.cancel()
        raise


def _streaming(req, stream: _Stream) -> StreamingResponse:
    async def body():
        done = False
        try:
            first = {"role": "assistant", "content": ""} if stream.kind == "chat" else None
            if first is not None:
                yield stream.chunk(stream.choice(delta=first))
            while True:
                kind, payload = await req.events.get()
                if kind == "delta":
                    for chunk in stream.deltas(*payload):
                        yield chunk
                elif kind == "done":
                    done = True
                    yield stream.chunk(stream.choice(finish=_finish_reason(payload.finish_reason)))
                    if stream.include_usage:
                        yield stream.chunk(None, usage(payload))
                    break
                else:
                    done = True
                    yield _sse(ApiError(*payload).body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (the task was cancelled) or the stream broke
                req.cancel()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- running it ---------------------------------------------------------------------------


class ServerThread:
    """uvicorn serving ``app`` in a background thread on ``host:port`` (port 0: a free one);
    a context manager.  ``url`` is the base URL once started."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="eagle3-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0):
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def sampling_defaults(target_dir) -> float:
    """The default temperature from a target directory's ``generation_config.json``
    (``do_sample: false`` → 0, else its ``temperature``, else 1.0, OpenAI's default)."""
    from pathlib import Path

    path = Path(target_dir) / "generation_config.json"
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError):
        return 1.0
    if not isinstance(gen, dict):
        return 1.0
    if gen.get("do_sample") is False:
        return 0.0
    t = gen.get("temperature", 1.0)
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 else 1.0


class _RoundCosts:
    """The round costs an adaptive policy measured on a server's slots (``Slots.round_ms``),
    kept beside JAX's persistent compilation cache (when it is on) for the next start on the
    same shapes, speculation, JAX version and machine: a round's cost depends on those, not on
    the weights."""

    FILE = "eagle3-jax-round-ms.json"

    def __init__(self, target, drafter, speculation, slots: int, max_len: int):
        import hashlib
        import os

        import jax

        folder = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
        self.path = None if folder is None or drafter is None else os.path.join(folder, self.FILE)
        what = [repr(target.config), repr(drafter and drafter.config), getattr(target, "attention_impl", None),
                str(target.dtype), repr(speculation), slots, max_len, jax.__version__, jax.devices()[0].device_kind,
                os.cpu_count()]
        self.key = hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return {}
        return saved if isinstance(saved, dict) else {}

    def load(self) -> list[float] | None:
        """The costs saved for these settings, or None (then ``Slots`` measures them)."""
        costs = self._read().get(self.key) if self.path else None
        ok = isinstance(costs, list) and costs and all(isinstance(c, (int, float)) and c > 0 for c in costs)
        return costs if ok else None

    def save(self, costs):
        """Keeps ``costs`` (nothing when None, or when the cache is off); a failed write is ignored
        (the next start measures again)."""
        if self.path is None or costs is None:
            return
        try:
            write_atomic(self.path, json.dumps({**self._read(), self.key: list(costs)}))
        except OSError:
            pass


def memory_bytes() -> int | None:
    """The memory of the first JAX device (its allocator's limit), or this machine's physical
    memory for the CPU; None where neither is known."""
    import os

    import jax

    dev = jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        return stats.get("bytes_limit")
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_fits(target, drafter, max_batch: int, max_len: int, memory: int | None = None):
    """``ValueError`` naming ``--max-batch`` and ``--max-len`` when the slots' KV caches (the
    target's and the drafter's, as allocated) alone exceed the device's memory
    (:func:`memory_bytes`): refused before anything is allocated, not an allocation failure
    (or the machine swapping) in the middle of the warm-up."""
    import math

    import jax

    def cache_bytes(model):
        if model is None or not hasattr(model, "init_cache"):
            return 0
        shapes = jax.eval_shape(lambda: model.init_cache(max_batch, max_len))
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    memory = memory_bytes() if memory is None else memory
    need = cache_bytes(target) + cache_bytes(drafter)
    if memory is not None and need > memory:
        raise ValueError(f"--max-batch {max_batch} x --max-len {max_len}: the slots' KV caches take "
                         f"{need / 2 ** 30:,.2f} GiB, more than the device's {memory / 2 ** 30:,.2f} GiB; "
                         f"lower --max-batch or --max-len")


def build(target, drafter, tokenizer, *, max_batch: int = 8, max_len: int = 1024, speculation=None,
          max_queue: int = 64, rounds_per_dispatch: int = 16, dispatch_ms: float | None = None,
          model_name: str = "eagle3-jax", temperature: float = 1.0,
          effort_budgets: tuple = (256, 1024, None), max_body_bytes: int | None = None, warmup: bool = True,
          defer_warmup: bool = False, background: bool = False, progress=None, on_ready=None,
          on_error=None) -> FastAPI:
    """The app over a new engine: ``max_batch`` slots of ``max_len`` tokens on the pair
    (``drafter`` None: vanilla decoding; ``speculation`` as ``eagle3_jax.decode.Slots``);
    ``warmup`` compiles the engine's programs on a short request before serving (and bounds
    the rounds per dispatch by ``dispatch_ms``: ``eagle3_jax.serve.engine.Engine``).
    ``max_body_bytes``: the largest request body read (default :func:`body_byte_limit`);
    ``defer_warmup``: the dispatches of more than one row and the prefills of all but the
    smallest prompt bucket are compiled by the engine thread while it has no request
    (``Engine.warmup(defer=True)``).

    ``background``: the engine is built and warmed up once the app starts (a :class:`Startup`:
    ``/health`` says ``warming_up`` until then), not before this returns.  ``progress(done,
    total, what)`` hears each program compiled; with ``background``, ``on_ready(engine)`` hears
    that it serves and ``on_error(exception)`` a failure to start."""
    from eagle3_jax.decode import Slots

    if tokenizer is None:
        raise ValueError("serving needs the target's tokenizer (tokenizer.json in the target directory)")
    check_cache_fits(target, drafter, max_batch, max_len)
    metrics = Metrics(model_name)
    chars = prompt_char_limit(tokenizer, max_len)  # max_len bounds the slots' longest prompt
    cfg = ServerConfig(model_name, target.config.vocab_size, temperature, tuple(effort_budgets), MAX_STOP_IDS, chars,
                       max_body_bytes or body_byte_limit(chars, max_len))

    def make(report) -> Engine:
        report(0, None, "the slot engine")
        costs = _RoundCosts(target, drafter, speculation, max_batch, max_len)
        slots = Slots(target, drafter, num_slots=max_batch, max_len=max_len, speculation=speculation,
                      tokenizer=tokenizer, max_stop_ids=cfg.max_stop_ids, round_ms=costs.load())
        costs.save(slots.round_ms)
        engine = Engine(slots, tokenizer, max_queue=max_queue, rounds_per_dispatch=rounds_per_dispatch,
                        dispatch_ms=dispatch_ms, metrics=metrics)
        if warmup:
            total = 1 + len(engine.warmup_steps())
            report(1, total, "the slot engine")
            engine.warmup(list(tokenizer.encode("Hello")) or [0], defer=defer_warmup,
                          progress=lambda done, _, what: report(1 + done, total, what))
        return engine.start()

    if background:
        return create_app(Startup(make, progress, on_error, on_ready), cfg, metrics, tokenizer)
    return create_app(make(progress or (lambda *_: None)), cfg, metrics, tokenizer)


# -- the command line (``eagle3-jax serve``) ------------------------------------------------


def auto_speculation():
    """``--speculation auto``: the adaptive policy over no drafting, chains of 2, 4 and 6
    and a (16, 4, 4) tree (the policy picks per round; small tiers win at large batches)."""
    from eagle3_jax.speculation import Speculation
    from eagle3_jax.tree import TreeConfig

    return Speculation((None, TreeConfig.chain(2), TreeConfig.chain(4), TreeConfig.chain(6), TreeConfig(16, 4, 4)),
                       policy="adaptive")


def check_port(host: str, port: int):
    """``OSError`` naming ``--host/--port`` when the address cannot be bound (before any model loads)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def server_settings(args, target, is_builtin: bool) -> dict:
    """``build``'s keyword arguments from the ``serve`` / ``replay`` flags (not the speculation)."""
    from eagle3_jax import builtin

    limit = target.config.max_position_embeddings
    max_len = args.max_len if args.max_len is not None else min(limit, 4096)
    if max_len > limit:
        raise ValueError(f"--max-len {max_len} exceeds the target's max_position_embeddings ({limit})")
    efforts = args.reasoning_effort_budgets or ((16, 64, None) if is_builtin else (256, 1024, None))
    target_dir = builtin.TARGET_DIR if is_builtin else args.target
    return dict(max_batch=args.max_batch, max_len=max_len, max_queue=args.max_queue,
                rounds_per_dispatch=args.rounds_per_dispatch, dispatch_ms=args.dispatch_ms,
                temperature=sampling_defaults(target_dir), effort_budgets=tuple(efforts),
                max_body_bytes=args.max_body_bytes)


def serve_main(args, target, drafter, tokenizer, is_builtin: bool) -> int:
    """``eagle3-jax serve``: listens at once, builds and warms up the engine meanwhile
    (printing the programs compiled of the total; ``/health`` says ``warming_up`` until ready),
    then serves until interrupted.  A failure to start stops the server and is raised."""
    from pathlib import Path

    import uvicorn

    from eagle3_jax.speculation import tier_name

    if tokenizer is None:
        raise ValueError(f"--target {args.target}: serving needs its tokenizer (tokenizer.json), found none")
    if args.speculation != "off" and drafter is None and not isinstance(args.speculation, str):
        raise ValueError(f"--speculation {tier_name(args.speculation)} needs --drafter")
    spec = None if args.speculation == "off" else (auto_speculation() if args.speculation == "auto" else args.speculation)
    name = args.served_model_name or ("builtin" if is_builtin else Path(args.target).resolve().name)
    kw = server_settings(args, target, is_builtin)
    drafter = None if spec is None else drafter
    started = time.monotonic()

    counts = [0, 0]  # programs compiled, of the total

    def progress(done: int, total: int | None, what: str):
        if total is None:
            print(f"warming up: compiling {what} ...", flush=True)
        else:
            counts[:] = done, total
            print(f"warming up: {done}/{total} programs compiled ({what}; {time.monotonic() - started:.1f} s)",
                  flush=True)

    def ready(_):
        gc.set_threshold(*thresholds)
        left = counts[1] - counts[0]
        print(f"ready in {time.monotonic() - started:.1f} s" + (
            f" ({left} more programs compile while no request runs)" if left else ""), flush=True)

    server: uvicorn.Server | None = None

    def failed(_):
        gc.set_threshold(*thresholds)
        if server is not None:
            server.should_exit = True

    # the models and libraries, loaded for good, leave the collector's scans; the warm-up's tracing
    # (millions of short-lived objects, no cycles worth a full scan) runs with a rarer collection
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(thresholds[0], WARMUP_GC_THRESHOLD), *thresholds[1:])
    app = build(target, drafter, tokenizer, speculation=spec, model_name=name, defer_warmup=True, background=True,
                progress=progress, on_ready=ready, on_error=failed, **kw)
    what = "vanilla decoding" if drafter is None else (
        "adaptive speculation" if args.speculation == "auto" else f"speculation {tier_name(spec)}")
    print(f"serving {name} on http://{args.host}:{args.port} ({kw['max_batch']} slots of {kw['max_len']} tokens, "
          f"{what}); /health says warming_up until the programs are compiled; Ctrl-C stops", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    server.run()
    startup = app.state.startup
    if startup.error is not None:
        raise startup.error
    return 0
