"""The bodies of the server's answers: OpenAI's ``usage`` (with the request's speculative
figures), the chunks of a streamed response as server-sent events (:func:`streaming`) and the
wait for a non-streamed one (:func:`wait_for_result`); either cancels its request when the
client goes away.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from eagle3_jax.serve.schemas import ApiError

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


class Stream:
    """The chunks of one streamed response (chat or completion)."""

    def __init__(self, kind: str, model: str, include_usage: bool, token_ids: bool):
        self.kind, self.model, self.include_usage, self.token_ids = kind, model, include_usage, token_ids
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def chunk(self, choice: dict | None, usage_: dict | None = None) -> str:
        """One SSE event of the response around ``choice`` (none: the usage chunk)."""
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": [] if choice is None else [choice]}
        if self.include_usage:
            obj["usage"] = usage_
        return _sse(obj)

    def choice(self, delta: dict | None = None, text: str | None = None, finish: str | None = None, ids=None) -> dict:
        """The response's one choice: a chat ``delta`` or a completion's ``text``."""
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
        """The events of one engine delta (``texts`` by field, the new token ``ids``)."""
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


def finish_reason(reason: str) -> str:
    """OpenAI's ``finish_reason`` of an engine's reason (``stop`` or ``length``; any other: ``stop``)."""
    return reason if reason in ("stop", "length") else "stop"


async def wait_for_result(req, request: Request, poll_s: float = 0.25):
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


def streaming(req, stream: Stream) -> StreamingResponse:
    """The SSE response of a streamed request: its chunks as its events arrive, then ``[DONE]``
    (an engine error as OpenAI's error object); a stream cut short cancels the request."""
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
                    yield stream.chunk(stream.choice(finish=finish_reason(payload.finish_reason)))
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
