"""The server's request bounds, without a model: a stand-in for the slot engine behind the real
engine, app and tokenizer (the built-in pair's), on loopback.  Bodies past the bound get 413
before they are parsed, prompt text past the context's characters is refused before it is
tokenized, tokenizing runs off the event loop, ``--max-queue`` counts the requests waiting
beyond the free slots, every parameter is checked before a stream starts, content that is not
text is refused by name, and the app answers ``warming_up`` while its engine is built."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from eagle3_jax import builtin
from eagle3_jax.decode import SlotView
from eagle3_jax.serve import app as app_mod
from eagle3_jax.serve.app import ServerConfig, ServerThread, Startup, create_app
from eagle3_jax.serve.engine import Engine, Params, QueueFull


class FakeSlots:
    """A stand-in for ``decode.Slots``: ``num_slots`` rows of ``max_len`` tokens; a running
    request gets ``token`` once per round up to its ``max_new_tokens`` (then it is done), except
    while ``hold`` is set (its rounds make nothing: it keeps its slot).  Records the inserts."""

    thinking = None

    def __init__(self, token: int, eos: int, num_slots: int = 2, max_len: int = 96):
        self.token, self.num_slots, self.max_len = token, num_slots, max_len
        self.stop_ids = (eos,)
        self.request_len, self.max_prompt_len = max_len - 1, max_len - 32
        self.hold = threading.Event()
        self.inserts: list[tuple[list[int], dict]] = []
        self._rows: list[dict | None] = [None] * num_slots
        self._tickets = iter(range(1 << 30))

    def max_new_tokens_for(self, prompt_len: int) -> int:
        return self.request_len - prompt_len if prompt_len <= self.max_prompt_len else 0

    def row_buckets(self):
        out = [1]
        while out[-1] < self.num_slots:
            out.append(min(2 * out[-1], self.num_slots))
        return out

    def warm_buckets(self):
        return [1]

    def prompt_bucket(self, prompt_len: int) -> int:
        return self.max_len

    def reset_policy(self):
        pass

    def insert(self, slot, prompt_ids, *, max_new_tokens, **kw):
        self.inserts.append((list(prompt_ids), {"max_new_tokens": max_new_tokens, **kw}))
        self._rows[slot] = {"tokens": [self.token], "max": max_new_tokens, "ticket": next(self._tickets)}
        return self._rows[slot]["ticket"]

    def run(self, rounds: int):
        time.sleep(0.002)  # a dispatch takes time (the engine thread does not spin)
        for row in self._rows:
            if row is not None and not self.hold.is_set():
                row["tokens"] = (row["tokens"] + [self.token] * rounds)[: row["max"]]

    def poll(self, lag: int = 0):
        return [SlotView(False, [], False, None, 0, 0, "none", {}, -1) if r is None else
                SlotView(len(r["tokens"]) < r["max"], list(r["tokens"]), len(r["tokens"]) >= r["max"],
                         "length" if len(r["tokens"]) >= r["max"] else None, 0, len(r["tokens"]), "none", {},
                         r["ticket"]) for r in self._rows]

    def release(self, slot: int):
        self._rows[slot] = None


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(builtin.TARGET_DIR), local_files_only=True)


def _slots(tok, **kw) -> FakeSlots:
    return FakeSlots(tok.convert_tokens_to_ids("x"), tok.eos_token_id, **kw)


def _serve(tok, slots, *, max_queue: int = 4, **cfg):
    engine = Engine(slots, tok, max_queue=max_queue).start()
    return ServerThread(create_app(engine, ServerConfig("fake", len(tok), temperature=0.0, **cfg), tokenizer=tok))


@pytest.fixture(scope="module")
def server(tok):
    slots = _slots(tok)
    with _serve(tok, slots, max_body_bytes=64 << 10) as srv:
        srv.slots = slots
        yield srv


def _post(server, body, path="/v1/completions", **kw):
    content = json.dumps(body) if isinstance(body, (dict, list)) else body
    return httpx.post(server.url + path, content=content, timeout=30, **kw)


def _error(r, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert code is None or err["code"] == code, err
    assert err["param"] == param, err
    return err


def test_a_body_past_the_bound_is_413_before_it_is_read(server):
    big = json.dumps({"model": "fake", "prompt": "word " * (1 << 20)})  # 5 MB, bound 64 KiB
    start = time.monotonic()
    err = _error(_post(server, big), 413, "request_too_large")
    assert "--max-body-bytes" in err["message"] and str(64 << 10) in err["message"]

    def chunks():  # no Content-Length: refused once its bytes pass the bound
        for i in range(0, len(big), 1 << 16):
            yield big[i: i + (1 << 16)].encode()

    _error(_post(server, chunks()), 413, "request_too_large")
    assert time.monotonic() - start < 5
    r = _post(server, {"prompt": "Step 1:", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_text_past_the_context_is_refused_before_it_is_tokenized(tok, monkeypatch):
    slots = _slots(tok)
    seen = []
    encode = app_mod._completion_prompt
    monkeypatch.setattr(app_mod, "_completion_prompt", lambda t, req: seen.append(req) or encode(t, req))
    with _serve(tok, slots, max_body_bytes=1 << 30) as srv:
        limit = srv.server.config.app.state.config.max_prompt_chars
        assert limit == slots.max_prompt_len * max(map(len, tok.get_vocab()))
        err = _error(_post(srv, {"prompt": "a" * (limit + 1)}), 400, "context_length_exceeded", "prompt")
        assert f"{limit + 1} characters" in err["message"]
        assert not seen  # never tokenized
        r = _post(srv, {"messages": [{"role": "user", "content": "b" * limit}, {"role": "user", "content": "c"}]},
                  "/v1/chat/completions")
        _error(r, 400, "context_length_exceeded", "messages")
        # text within the bound but past the context in tokens: refused on its tokens
        _error(_post(srv, {"prompt": "a " * slots.max_prompt_len}), 400, "context_length_exceeded", "prompt")
        assert len(seen) == 1


def test_a_slow_prompt_delays_no_other_request(tok, monkeypatch):
    """Tokenizing runs on worker threads: while one prompt takes 2 s to tokenize, the event loop
    answers /health and another request's stream at once."""
    slots = _slots(tok)
    encode = app_mod._completion_prompt

    def slow(t, req):
        if req.prompt == "slow":
            time.sleep(2.0)
        return encode(t, req)

    monkeypatch.setattr(app_mod, "_completion_prompt", slow)
    with _serve(tok, slots) as srv:
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


@pytest.mark.parametrize("max_queue", [0, 2])
def test_max_queue_counts_requests_beyond_the_free_slots(tok, max_queue):
    """2 slots and ``max_queue`` waiting: exactly that many requests are taken, one more is
    refused; ``--max-queue 0`` takes a request into a free slot (never "refuse all")."""
    slots = _slots(tok)
    slots.hold.set()
    engine = Engine(slots, tok, max_queue=max_queue).start()

    async def main():
        taken = [engine.submit([1, 2], Params(max_new_tokens=4), split=False) for _ in range(2 + max_queue)]
        with pytest.raises(QueueFull, match=f"--max-queue {max_queue}"):
            engine.submit([1, 2], Params(max_new_tokens=4), split=False)
        slots.hold.clear()
        for req in taken:  # every request taken is answered
            kind = None
            while kind != "done":
                kind, _ = await asyncio.wait_for(req.events.get(), 10)
        engine.submit([1, 2], Params(max_new_tokens=4), split=False)  # the slots are free again
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(main())


@pytest.mark.parametrize("body,path,status,code,param", [
    ({"prompt": "x", "stop_token_ids": list(range(10, 19)), "stream": True}, "/v1/completions", 400, None,
     "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_token_ids": list(range(10, 19)), "stream": True},
     "/v1/chat/completions", 400, None, "stop_token_ids"),
    ({"prompt": "x", "max_tokens": 2, "max_completion_tokens": 3}, "/v1/completions", 400, None,
     "max_completion_tokens"),
    ({"prompt": "x", "max_completion_tokens": 10_000}, "/v1/completions", 400, "context_length_exceeded",
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "/v1/chat/completions", 400, "unsupported_content", "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                 "input_audio": {"data": "", "format": "wav"}}]}]},
     "/v1/chat/completions", 400, "unsupported_content", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "/v1/chat/completions", 400, "unsupported_parameter", "tools"),
    ({"messages": [{"role": "tool", "content": "4", "tool_call_id": "a"}]}, "/v1/chat/completions", 400,
     "unsupported_content", "messages[0].role"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a"}]}, {"role": "user", "content": "x"}]},
     "/v1/chat/completions", 400, "unsupported_content", "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}, "/v1/chat/completions", 400,
     "unsupported_parameter", "modalities"),
    ({"prompt": ""}, "/v1/completions", 400, "empty_prompt", "prompt"),
    ({"prompt": "  \n\t"}, "/v1/completions", 400, "empty_prompt", "prompt"),
    ({"prompt": []}, "/v1/completions", 400, "empty_prompt", "prompt"),
    ({"messages": [{"role": "system", "content": " "}, {"role": "user", "content": ""}]}, "/v1/chat/completions",
     400, "empty_prompt", "messages"),
    ({"prompt": "a\ud800b"}, "/v1/completions", 400, "invalid_encoding", "prompt"),
    ({"messages": [{"role": "user", "content": "fine"}, {"role": "user", "content": "\udcff"}]},
     "/v1/chat/completions", 400, "invalid_encoding", "messages[1].content"),
    ({"prompt": "x", "stop": ["\udfff"]}, "/v1/completions", 400, "invalid_encoding", "stop"),
    (b'{"prompt": "caf\xe9"}', "/v1/completions", 400, "invalid_encoding", None),
    (b"", "/v1/completions", 400, "empty_body", None),
    (b"  \n", "/v1/chat/completions", 400, "empty_body", None),
    (b"null", "/v1/completions", 400, "invalid_request", None),
    (b"[" * 30_000, "/v1/completions", 400, "invalid_json", None),
])
def test_requests_are_checked_before_any_response_starts(server, body, path, status, code, param):
    _error(_post(server, body, path), status, code, param)


def test_completions_honour_max_completion_tokens(server):
    for path, body in (("/v1/completions", {"prompt": "Step 1:"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Step 1:"}]})):
        r = _post(server, {**body, "max_completion_tokens": 2}, path)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert server.slots.inserts[-1][1]["max_new_tokens"] == 2


def test_health_says_warming_up_until_the_engine_is_built(tok):
    slots, go = _slots(tok), threading.Event()

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
        _error(_post(srv, {"prompt": "x"}), 503, "warming_up")
        go.set()
        for _ in range(100):
            if httpx.get(srv.url + "/health").status_code == 200:
                break
            time.sleep(0.05)
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        assert _post(srv, {"prompt": "x", "max_tokens": 2}).status_code == 200


class BucketSlots(FakeSlots):
    """FakeSlots with prompt buckets of 8, 16 and 32 tokens."""

    def warm_buckets(self):
        return [8, 16, 32]

    def prompt_bucket(self, prompt_len: int) -> int:
        return next(b for b in self.warm_buckets() if prompt_len <= b)


def test_deferred_warm_up_leaves_the_larger_prompt_buckets_to_the_engine_thread(tok):
    """``warmup(defer=True)`` compiles the one-row dispatch and the smallest prefill before
    the engine serves; the other prefills and dispatches follow on the engine thread while it
    is idle, a prefill and a dispatch in turn, smallest first (every one counted of the total)."""
    slots = BucketSlots(tok.convert_tokens_to_ids("x"), tok.eos_token_id, num_slots=8, max_len=64)
    seen = []
    engine = Engine(slots, tok, max_queue=4)
    engine.warmup([1, 2], progress=lambda done, total, what: seen.append((done, total, what)), defer=True)
    assert seen == [(1, 7, "dispatch of 1 rows"), (2, 7, "prefill of 8-token prompts")]
    assert engine.deferred == 5 and [len(p) for p, _ in slots.inserts][-1] == 8
    engine.start()
    try:
        for _ in range(400):
            if engine.deferred == 0 and len(seen) == 7:
                break
            time.sleep(0.01)
        assert seen[2:] == [(3, 7, "prefill of 16-token prompts"), (4, 7, "dispatch of 2 rows"),
                            (5, 7, "prefill of 32-token prompts"), (6, 7, "dispatch of 4 rows"),
                            (7, 7, "dispatch of 8 rows")]
    finally:
        engine.shutdown()


def test_deferred_warm_up_compiles_while_no_request_runs(tok):
    """``warmup(defer=True)`` compiles the one-row dispatch and the prefills at once, the
    dispatches of more rows on the engine thread while it is idle; the progress counts every
    program of the total."""
    slots = _slots(tok, num_slots=8)
    seen = []
    engine = Engine(slots, tok, max_queue=4)
    engine.warmup([1, 2], progress=lambda done, total, what: seen.append((done, total, what)), defer=True)
    steps = engine.warmup_steps()
    assert [what for *_, what in seen] == ["dispatch of 1 rows", "prefill of 96-token prompts"]
    assert engine.deferred == 3 and [d for d, *_ in seen] == [1, 2] and {t for _, t, _ in seen} == {len(steps)}
    engine.start()
    try:
        for _ in range(200):
            if engine.deferred == 0 and len(seen) == len(steps):
                break
            time.sleep(0.01)
        assert seen[2:] == [(3, 5, "dispatch of 2 rows"), (4, 5, "dispatch of 4 rows"), (5, 5, "dispatch of 8 rows")]
    finally:
        engine.shutdown()
