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
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle3_jax.serve.engine import Engine, EngineDown, QueueFull
from eagle3_jax.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from eagle3_jax.serve.responses import Stream, finish_reason, streaming, usage, wait_for_result
from eagle3_jax.serve.schemas import (ApiError, ChatRequest, CompletionRequest, SamplingRequest, ServerConfig,
                                      body_byte_limit, check, prompt_char_limit, resolve, validation_error)

TOKENIZE_WORKERS = 2  # threads that tokenize prompts and apply chat templates


# -- tokenizing prompts ---------------------------------------------------------------------


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
        except BaseException as e:  # noqa: BLE001  (reported by /health and server.run, not lost in a thread)
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
        return reject(validation_error(exc))

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

    async def admit(body: SamplingRequest, prompt, split: bool):
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
            return streaming(req, Stream("chat", cfg.model_name, include_usage, body.return_token_ids))
        res = await wait_for_result(req, request)
        reasoning = res.texts.get("reasoning", "") if req.engine.slots.thinking is not None else None
        message = {"role": "assistant", "content": res.texts.get("content", ""), "reasoning_content": reasoning,
                   "reasoning": reasoning}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(res.finish_reason)}
        return response("chatcmpl-", "chat.completion", choice, res, req, body)

    @app.post(COMPLETIONS_PATH)
    async def completions(body: CompletionRequest, request: Request):
        if metrics is not None:
            metrics.request_received(_ENDPOINTS[COMPLETIONS_PATH])
        req = await admit(body, _completion_prompt, split=False)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return streaming(req, Stream("completion", cfg.model_name, include_usage, body.return_token_ids))
        res = await wait_for_result(req, request)
        choice = {"index": 0, "text": res.texts.get("text", ""), "logprobs": None,
                  "finish_reason": finish_reason(res.finish_reason)}
        return response("cmpl-", "text_completion", choice, res, req, body)

    return app

