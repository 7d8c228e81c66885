"""The server's requests: their pydantic models, the errors answered in OpenAI's shape, the
settings the HTTP layer checks them against, and the checks themselves.

:class:`ChatRequest` and :class:`CompletionRequest` are the bodies of ``/v1/chat/completions``
and ``/v1/completions`` (OpenAI's parameters, plus vLLM's ``top_k`` / ``stop_token_ids`` /
``return_token_ids`` and the thinking budget).  :func:`check` refuses a request before it costs
anything (every parameter, content that is not text, prompt text past the characters that can
fit in the context: :func:`prompt_char_limit`); :func:`resolve` turns a checked request and its
prompt's tokens into the engine's :class:`~eagle3_jax.serve.engine.Params`.  Every refusal is
an :class:`ApiError` naming the parameter.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from eagle3_jax import limits
from eagle3_jax.serve.engine import Engine, Params
from eagle3_jax.serve.text import blank_problem, encoding_problem

# a request's stop strings are matched on the engine's thread at every dispatch, beside every
# other request's: bounded (OpenAI allows 4)
MAX_STOP, MAX_STOP_CHARS = 16, 256
MAX_STOP_IDS = 8  # stop ids a request may add to the target's EOS (the slots' max_stop_ids: build passes it)
EFFORTS = ("low", "medium", "high")


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


def validation_error(exc: RequestValidationError) -> ApiError:
    """The :class:`ApiError` (400) of a body that FastAPI's validation refused: not JSON, not an
    object, or the parameters named with pydantic's messages."""
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


class SamplingRequest(_Strict):
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


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingRequest):
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


def _where(req: SamplingRequest) -> str:
    return "prompt" if isinstance(req, CompletionRequest) else "messages"


def _texts(req: SamplingRequest) -> list[tuple[str, str]]:
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


def check(req: SamplingRequest, cfg: ServerConfig, slots) -> None:
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


def _check_parameters(req: SamplingRequest, cfg: ServerConfig, slots):
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


def _check_prompt(req: SamplingRequest, cfg: ServerConfig, slots):
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


def resolve(req: SamplingRequest, prompt_ids: list[int], engine: Engine, cfg: ServerConfig) -> Params:
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

