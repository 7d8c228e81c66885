"""``eagle3_jax.serve.app`` without a model: a stand-in for the slot engine behind the real
engine, app and tokenizer (the built-in pair's), on loopback.  Bodies past the bound get 413
before they are parsed, prompt text past the context's characters is refused before it is
tokenized, tokenizing runs off the event loop, and the app answers ``warming_up`` while its
engine is built."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import httpx
import pytest

from eagle3_jax.serve.app import Startup, create_app
from eagle3_jax.serve.engine import Engine
from eagle3_jax.serve.schemas import ServerConfig
from eagle3_jax.serve.server import ServerThread
from helpers import FakeSlots, api_error, builtin_tokenizer, fake_server, post


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    slots = FakeSlots.of(tok)
    with fake_server(tok, slots, max_body_bytes=64 << 10) as srv:
        yield srv


class HookedTokenizer:
    """``tok`` with ``hook(text)`` called before each ``encode``; the copies the app's
    tokenizing threads make share the hook."""

    def __init__(self, tok, hook):
        self.tok, self.hook = tok, hook

    def __getattr__(self, name):
        if name == "tok":  # not set yet (an object being copied)
            raise AttributeError(name)
        return getattr(self.tok, name)

    def __deepcopy__(self, memo):
        return HookedTokenizer(copy.deepcopy(self.tok, memo), self.hook)

    def encode(self, text, *args, **kw):
        self.hook(text)
        return self.tok.encode(text, *args, **kw)


def test_a_body_past_the_bound_is_413_before_it_is_read(server):
    big = json.dumps({"model": "fake", "prompt": "word " * (1 << 20)})  # 5 MB, bound 64 KiB
    start = time.monotonic()
    err = api_error(post(server, big), 413, "request_too_large")
    assert "--max-body-bytes" in err["message"] and str(64 << 10) in err["message"]

    def chunks():  # no Content-Length: refused once its bytes pass the bound
        for i in range(0, len(big), 1 << 16):
            yield big[i: i + (1 << 16)].encode()

    api_error(post(server, chunks()), 413, "request_too_large")
    assert time.monotonic() - start < 5
    r = post(server, {"prompt": "Step 1:", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_text_past_the_context_is_refused_before_it_is_tokenized(tok):
    slots = FakeSlots.of(tok)
    seen = []
    with fake_server(tok, slots, max_body_bytes=1 << 30, app_tokenizer=HookedTokenizer(tok, seen.append)) as srv:
        limit = srv.server.config.app.state.config.max_prompt_chars
        assert limit == slots.max_prompt_len * max(map(len, tok.get_vocab()))
        err = api_error(post(srv, {"prompt": "a" * (limit + 1)}), 400, "context_length_exceeded", "prompt")
        assert f"{limit + 1} characters" in err["message"]
        assert not seen  # never tokenized
        r = post(srv, {"messages": [{"role": "user", "content": "b" * limit}, {"role": "user", "content": "c"}]},
                 "/v1/chat/completions")
        api_error(r, 400, "context_length_exceeded", "messages")
        # text within the bound but past the context in tokens: refused on its tokens
        api_error(post(srv, {"prompt": "a " * slots.max_prompt_len}), 400, "context_length_exceeded", "prompt")
        assert len(seen) == 1


def test_a_slow_prompt_delays_no_other_request(tok):
    """Tokenizing runs on worker threads: while one prompt takes 2 s to tokenize, the event loop
    answers /health and another request's stream at once."""
    slots = FakeSlots.of(tok)

    def slow(text):
        if text == "slow":
            time.sleep(2.0)

    with fake_server(tok, slots, app_tokenizer=HookedTokenizer(tok, slow)) as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                slow_req = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "slow", "max_tokens": 2}))
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                health = await c.get("/health")
                fast = await c.post("/v1/completions", json={"prompt": "fast", "max_tokens": 2})
                took = time.monotonic() - t0
                return health, fast, took, await slow_req

        health, fast, took, slow_r = asyncio.run(main())
    assert health.status_code == 200 and fast.status_code == 200 and slow_r.status_code == 200
    assert took < 1.0, took


def test_health_says_warming_up_until_the_engine_is_built(tok):
    slots, go = FakeSlots.of(tok), threading.Event()

    def make(progress):
        progress(0, None, "the slot engine")
        progress(1, 3, "dispatch of 2 rows")
        assert go.wait(30)
        return Engine(slots, tok, max_queue=4).start()

    cfg = ServerConfig("fake", len(tok), temperature=0.0, max_prompt_chars=1000, max_body_bytes=1 << 20)
    with ServerThread(create_app(Startup(make), cfg, tokenizer=tok)) as srv:
        for _ in range(100):
            health = httpx.get(srv.url + "/health")
            if health.json().get("programs_compiled") == 1:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and health.json() == {
            "status": "warming_up", "programs_compiled": 1, "programs_total": 3, "compiling": "dispatch of 2 rows"}
        api_error(post(srv, {"prompt": "x"}), 503, "warming_up")
        go.set()
        for _ in range(100):
            if httpx.get(srv.url + "/health").status_code == 200:
                break
            time.sleep(0.05)
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        assert post(srv, {"prompt": "x", "max_tokens": 2}).status_code == 200
