"""The OpenAI-compatible HTTP server (FastAPI + uvicorn + prometheus_client).

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as SSE or
not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.  Chat responses carry the
thinking text in ``reasoning_content`` (and ``reasoning``, vLLM's newer name) and the answer
in ``content``; ``usage`` has ``completion_tokens_details.reasoning_tokens`` and the request's
speculative figures under ``speculative`` (rounds, tau, proposed, accepted, acceptance per
draft position, per phase).  Errors are OpenAI's ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad parameter (named in ``param``), 404 for an unknown model, 429 when
the queue is full, 503 when the engine is down.

Request parameters besides OpenAI's: ``top_k``, ``stop_token_ids``, ``thinking_budget``
(thinking tokens allowed; ``reasoning_effort`` low / medium / high maps to budgets set by the
server), ``return_token_ids`` (the generated token ids, as vLLM's option).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
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

from eagle3_jax.serve.engine import Engine, EngineDown, Params, QueueFull
from eagle3_jax.serve.metrics import CONTENT_TYPE_LATEST, Metrics

MIN_TEMPERATURE = 1e-3  # below it, sampling is greedy (as eagle3_jax.decode's)
# a request's stop strings are matched on the engine's thread at every dispatch, beside every
# other request's: bounded (OpenAI allows 4)
MAX_STOP, MAX_STOP_CHARS = 16, 256
EFFORTS = ("low", "medium", "high")


# -- errors -------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("rate_limit_error" if status == 429 else "invalid_request_error" if status < 500
                             else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def _param(loc) -> str | None:
    """``("body", "messages", 0, "content", "str")`` → ``"messages[0].content"``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part.lower() not in _UNION_TAGS:
            out += ("." if out else "") + part
        else:
            break
    return out or None


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON ({detail})" if detail else
                        "the request body is not valid JSON", None, "invalid_json")
    parts = []
    for e in errors:
        p = _param(e.get("loc", ()))
        parts.append(f"{p}: {e.get('msg')}" if p else str(e.get("msg")))
    return ApiError(400, "; ".join(dict.fromkeys(parts)) or "invalid request", _param(first.get("loc", ())),
                    "invalid_parameter")


# -- requests -----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Sampling(_Strict):
    """Parameters shared by both endpoints (OpenAI's, plus vLLM's ``top_k`` /
    ``stop_token_ids`` / ``return_token_ids`` and the thinking budget)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2 ** 32)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    thinking_budget: int | None = Field(None, ge=0, lt=2 ** 31)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    return_token_ids: bool | None = False
    user: str | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


# parameters whose non-default values this server cannot honour: refused, not ignored
_UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
                "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "logit_bias": (None, {}),
                "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "speculation": (None,)}  # a server setting (--speculation): one compiled program serves all slots


# -- the server's settings ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine.

    ``model_name``: the served model id; ``vocab_size``: the target's; ``temperature``: the
    default when a request gives none; ``effort_budgets``: thinking budgets of
    ``reasoning_effort`` low / medium / high (None: unlimited)."""

    model_name: str
    vocab_size: int
    temperature: float = 1.0
    effort_budgets: tuple = (256, 1024, None)

    def __post_init__(self):
        if len(self.effort_budgets) != len(EFFORTS):
            raise ValueError(f"effort_budgets: need 3 budgets (low, medium, high), got {self.effort_budgets!r}")

    def effort_budget(self, effort: str) -> int | None:
        return dict(zip(EFFORTS, self.effort_budgets))[effort]


def resolve(req: _Sampling, prompt_ids: list[int], engine: Engine, cfg: ServerConfig) -> Params:
    """The engine parameters of a validated request, or ``ApiError`` naming the parameter."""
    if req.model is not None and req.model != cfg.model_name:
        raise ApiError(404, f"The model `{req.model}` does not exist (this server serves `{cfg.model_name}`)", "model",
                       "model_not_found")
    extra = req.model_extra or {}
    for name, defaults in _UNSUPPORTED.items():
        if name in extra or name in type(req).model_fields:
            value = extra[name] if name in extra else getattr(req, name)
            if value not in defaults:
                hint = " (the speculative budget is the server's: eagle3-jax serve --speculation)" \
                    if name == "speculation" else ""
                raise ApiError(400, f"{name} is not supported by this server (got {value!r}){hint}", name,
                               "unsupported_parameter")
    if req.n not in (None, 1):
        raise ApiError(400, f"n: only n=1 is supported, got {req.n}", "n", "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    slots = engine.slots
    where = "prompt" if isinstance(req, CompletionRequest) else "messages"
    if not prompt_ids:
        raise ApiError(400, f"{where}: the prompt is empty", where)
    room = slots.max_new_tokens_for(len(prompt_ids))
    if room <= 0:
        raise ApiError(400, f"{where}: the prompt is {len(prompt_ids)} tokens, too long for this server: prompts of "
                            f"up to {slots.max_prompt_len} tokens, {slots.request_len} per request with the output",
                       where, "context_length_exceeded")
    limit, name = req.max_tokens, "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise ApiError(400, f"max_tokens ({req.max_tokens}) and max_completion_tokens ({req.max_completion_tokens}) "
                                "disagree: give one", "max_completion_tokens")
        limit, name = req.max_completion_tokens, "max_completion_tokens"
    if limit is not None and limit > room:
        raise ApiError(400, f"{name}={limit} is too large: a prompt of {len(prompt_ids)} tokens leaves room for at most "
                            f"{room} new tokens (context {slots.request_len})", name, "context_length_exceeded")
    temperature = cfg.temperature if req.temperature is None else req.temperature
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # greedy
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k > cfg.vocab_size:
        raise ApiError(400, f"top_k={top_k} exceeds the vocabulary ({cfg.vocab_size}); -1 or 0 turn it off", "top_k")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
    if any(s == "" or len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop: stop strings must be non-empty and at most {MAX_STOP_CHARS} characters", "stop")
    stop_ids = list(req.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ApiError(400, f"stop_token_ids: {bad[0]} is out of range for the vocabulary (0..{cfg.vocab_size - 1})",
                       "stop_token_ids")
    budget = req.thinking_budget
    if req.reasoning_effort is not None:
        if budget is not None:
            raise ApiError(400, "give thinking_budget or reasoning_effort, not both", "reasoning_effort")
        budget = cfg.effort_budget(req.reasoning_effort)
    if slots.thinking is None and (req.thinking_budget is not None or req.reasoning_effort is not None):
        name = "thinking_budget" if req.thinking_budget is not None else "reasoning_effort"
        raise ApiError(400, f"{name}: this model has no thinking phase (its tokenizer has no <think>/</think>)", name)
    seed = req.seed if req.seed is not None else secrets.randbelow(2 ** 32)
    return Params(max_new_tokens=limit if limit is not None else room, temperature=float(temperature),
                  top_p=1.0 if req.top_p is None else float(req.top_p), top_k=top_k, seed=seed, stop=tuple(stop),
                  stop_token_ids=tuple(stop_ids), thinking_budget=budget)


def _chat_prompt(req: ChatRequest, tokenizer) -> list[int]:
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


def _completion_prompt(req: CompletionRequest, tokenizer, vocab: int) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ApiError(400, f"prompt: only one prompt per request is supported, got {len(p)}", "prompt",
                           "unsupported_parameter")
        p = p[0]
    if isinstance(p, str):
        return list(tokenizer.encode(p))
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"prompt: token id {bad[0]} is out of range for the vocabulary (0..{vocab - 1})", "prompt")
    return list(p)


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


class _JsonBody:
    """Reads every ``POST /v1/...`` body as JSON whatever its Content-Type (``curl -d`` sends
    form-encoded), as OpenAI's API does."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def create_app(engine: Engine, cfg: ServerConfig, metrics: Metrics | None = None, tokenizer=None) -> FastAPI:
    """The FastAPI app over a started ``engine``; ``tokenizer`` encodes prompts (default:
    the engine's own).  Shutting the app down stops the engine."""
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    metrics = metrics if metrics is not None else engine.metrics

    async def lifespan(app):
        yield
        tokenize_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="eagle3-jax", lifespan=lifespan)
    app.add_middleware(_JsonBody)
    app.state.engine, app.state.config, app.state.metrics = engine, cfg, metrics

    def reject(err: ApiError) -> JSONResponse:
        if metrics is not None and err.status != 499:  # a request whose client left is counted as cancelled
            metrics.request_rejected(err.status)
        return err.response()

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
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), None, code).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        if engine.alive:
            return {"status": "ok", "running": engine.running, "waiting": engine.waiting}
        return ApiError(503, engine.error or "the engine is not running").response()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "eagle3-jax", "max_model_len": engine.slots.request_len}]}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are off", None, "not_found")
        metrics.engine_state(engine.waiting, engine.running)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # prompts are tokenized on one worker thread: a long prompt does not stall the event loop
    # (every stream), and a fast tokenizer is not used from two threads at once
    tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eagle3-tokenize")

    async def encode(fn, *args):
        return await asyncio.wrap_future(tokenize_pool.submit(fn, *args))

    def submit(body: _Sampling, prompt_ids: list[int], split: bool):
        params = resolve(body, prompt_ids, engine, cfg)
        try:
            return engine.submit(prompt_ids, params, split=split)
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
        req = submit(body, await encode(_chat_prompt, body, tokenizer), split=True)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return _streaming(req, _Stream("chat", cfg.model_name, include_usage, body.return_token_ids))
        res = await _wait(req, request)
        reasoning = res.texts.get("reasoning", "") if engine.slots.thinking is not None else None
        message = {"role": "assistant", "content": res.texts.get("content", ""), "reasoning_content": reasoning,
                   "reasoning": reasoning}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(res.finish_reason)}
        return response("chatcmpl-", "chat.completion", choice, res, req, body)

    @app.post(COMPLETIONS_PATH)
    async def completions(body: CompletionRequest, request: Request):
        if metrics is not None:
            metrics.request_received(_ENDPOINTS[COMPLETIONS_PATH])
        req = submit(body, await encode(_completion_prompt, body, tokenizer, cfg.vocab_size), split=False)
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


def build(target, drafter, tokenizer, *, max_batch: int = 8, max_len: int = 1024, speculation=None,
          max_queue: int = 64, rounds_per_dispatch: int = 16, dispatch_ms: float | None = None,
          model_name: str = "eagle3-jax", temperature: float = 1.0,
          effort_budgets: tuple = (256, 1024, None), warmup: bool = True) -> FastAPI:
    """The app over a new engine: ``max_batch`` slots of ``max_len`` tokens on the pair
    (``drafter`` None: vanilla decoding; ``speculation`` as ``eagle3_jax.decode.Slots``);
    ``warmup`` compiles the engine's programs on a short request before serving (and bounds
    the rounds per dispatch by ``dispatch_ms``: ``eagle3_jax.serve.engine.Engine``)."""
    from eagle3_jax.decode import Slots

    if tokenizer is None:
        raise ValueError("serving needs the target's tokenizer (tokenizer.json in the target directory)")
    slots = Slots(target, drafter, num_slots=max_batch, max_len=max_len, speculation=speculation, tokenizer=tokenizer)
    metrics = Metrics(model_name)
    engine = Engine(slots, tokenizer, max_queue=max_queue, rounds_per_dispatch=rounds_per_dispatch,
                    dispatch_ms=dispatch_ms, metrics=metrics)
    if warmup:
        engine.warmup(list(tokenizer.encode("Hello")) or [0])
    engine.start()
    cfg = ServerConfig(model_name, target.config.vocab_size, temperature, tuple(effort_budgets))
    return create_app(engine, cfg, metrics, tokenizer)


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
                temperature=sampling_defaults(target_dir),
                effort_budgets=tuple(efforts))


def serve_main(args, target, drafter, tokenizer, is_builtin: bool) -> int:
    """``eagle3-jax serve``: builds the engine and serves until interrupted."""
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
    app = build(target, drafter, tokenizer, speculation=spec, model_name=name, **kw)
    what = "vanilla decoding" if drafter is None else (
        "adaptive speculation" if args.speculation == "auto" else f"speculation {tier_name(spec)}")
    print(f"serving {name} on http://{args.host}:{args.port} ({kw['max_batch']} slots of {kw['max_len']} tokens, "
          f"{what}); Ctrl-C stops", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
