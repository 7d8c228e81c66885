"""``eagle3_jax.serve.server``: the OpenAI-compatible server built on the built-in pair, on
loopback, driven by the official ``openai`` client (one server, 4 slots of 512 tokens, a chain
of 4, shared by the module); the checks before a start (the slots' caches against the memory)
and a start's imports."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re

import httpx
import pytest

import eagle3_jax
from eagle3_jax import builtin
from eagle3_jax.decode import encode_chat
from eagle3_jax.serve.server import ServerThread, build, check_cache_fits

openai = pytest.importorskip("openai")

MAX_NEW = 100
TREE = eagle3_jax.TreeConfig.chain(4)
# eight requests: (eval task, max_tokens, thinking_budget, arrival delay s, streamed)
MIX = [(0, MAX_NEW, None, 0.0, True), (1, 30, 0, 0.02, False), (2, MAX_NEW, 3, 0.0, True), (3, 50, 10, 0.1, False),
       (4, 12, None, 0.05, True), (5, MAX_NEW, 5, 0.15, False), (6, 64, 20, 0.03, True), (7, 25, None, 0.2, False)]


@pytest.fixture(scope="module")
def pair():
    return builtin.load()


def _reference(pair):
    """``generate``'s greedy tokens for the MIX prompts (one batch: greedy rows do not depend on
    each other) at MAX_NEW tokens and each request's thinking budget."""
    target, drafter, tok = pair
    tasks = builtin.eval_tasks()
    prompts = [encode_chat(tok, [{"role": "user", "content": tasks[i]["prompt"]}]) for i, *_ in MIX]
    res = eagle3_jax.generate(target, drafter, prompts, max_new_tokens=MAX_NEW, tree=TREE, tokenizer=tok,
                              thinking_budget=[b for _, _, b, _, _ in MIX])
    return [tasks[i]["prompt"] for i, *_ in MIX], prompts, res


@pytest.fixture(scope="module")
def started(pair):
    """The server (running) and the reference, compiled side by side."""
    target, drafter, tok = pair
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref = pool.submit(_reference, pair)
        app = build(target, drafter, tok, max_batch=4, max_len=512, speculation=TREE, max_queue=8,
                    model_name="builtin", temperature=0.0, effort_budgets=(5, 20, None))
        ref = ref.result()
    with ServerThread(app) as srv:
        srv.engine = app.state.engine
        yield srv, ref


@pytest.fixture(scope="module")
def server(started):
    return started[0]


@pytest.fixture(scope="module")
def reference(started):
    return started[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _metric(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _split(tok, tokens):
    """(reasoning text, answer text) of a generated token list that opens with <think>."""
    open_id, close_id = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert tokens[0] == open_id
    close = tokens.index(close_id) if close_id in tokens else len(tokens)
    answer = [t for t in tokens[close + 1:] if t not in (tok.eos_token_id, close_id)]  # a stray second close is dropped
    return tok.decode(tokens[1:close], skip_special_tokens=True), tok.decode(answer, skip_special_tokens=True)


def _stream(client, **kw):
    """A streamed chat request's joined reasoning, content and token ids, finish reason and usage."""
    out = {"reasoning": "", "content": "", "ids": [], "finish": None, "usage": None, "role": None}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            assert not chunk.choices
            out["usage"] = chunk.usage
        for c in chunk.choices:
            out["role"] = out["role"] or c.delta.role
            out["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            out["content"] += c.delta.content or ""
            out["ids"] += (c.model_extra or {}).get("token_ids") or []
            out["finish"] = c.finish_reason or out["finish"]
    return out


def test_chat_matches_generate_streamed_and_not(server, client, reference, pair):
    tok = pair[2]
    texts, prompts, ref = reference
    tokens = ref.tokens[0]
    reasoning, answer = _split(tok, tokens)
    kw = dict(model="builtin", messages=[{"role": "user", "content": texts[0]}], max_tokens=MAX_NEW, temperature=0,
              extra_body={"return_token_ids": True})
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.model_extra["token_ids"] == tokens
    assert (choice.message.content, choice.message.reasoning_content, choice.message.reasoning) == \
        (answer, reasoning, reasoning)
    assert choice.finish_reason == ref.finish_reason[0] == "stop"
    u = full.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(prompts[0]), len(tokens),
                                                                     len(prompts[0]) + len(tokens))
    assert u.completion_tokens_details.reasoning_tokens == ref.thinking_tokens[0]
    spec = u.model_extra["speculative"]
    assert spec["rounds"] >= 1 and spec["tau"] > 1 and spec["accepted"] <= spec["proposed"]
    assert set(spec["phases"]) == {"thinking", "answer"}
    assert sum(p["rounds"] for p in spec["phases"].values()) == spec["rounds"]

    s = _stream(client, **kw)
    assert s["role"] == "assistant"
    assert (s["reasoning"], s["content"], s["ids"], s["finish"]) == (reasoning, answer, tokens, "stop")
    assert (s["usage"].completion_tokens, s["usage"].prompt_tokens) == (len(tokens), len(prompts[0]))
    assert s["usage"].completion_tokens_details.reasoning_tokens == ref.thinking_tokens[0]


def test_completions_streamed_and_not(client, reference, pair):
    tok = pair[2]
    _, prompts, ref = reference
    tokens = ref.tokens[0]
    text = tok.decode(tokens, skip_special_tokens=True)  # raw: the think markers stay in the text
    kw = dict(model="builtin", prompt=prompts[0], max_tokens=MAX_NEW, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].text == text and "</think>" in text
    assert full.choices[0].finish_reason == "stop"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompts[0]), len(tokens))
    assert full.usage.completion_tokens_details.reasoning_tokens == ref.thinking_tokens[0]
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == text and len([p for p in parts if p]) > 1
    # a text prompt is encoded without the chat template
    out = client.completions.create(model="builtin", prompt="Step 1: 3 + 4 = 7.\n", max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens == len(tok.encode("Step 1: 3 + 4 = 7.\n"))


def test_concurrent_requests_get_their_solo_tokens(server, reference, pair):
    """Eight greedy requests of different lengths, thinking budgets and arrival times, four
    slots: each gets exactly generate's tokens for its prompt and budget, cut at its max_tokens."""
    tok = pair[2]
    texts, prompts, ref = reference

    async def one(aclient, i):
        _, max_tokens, budget, delay, streamed = MIX[i]
        await asyncio.sleep(delay)
        kw = dict(model="builtin", messages=[{"role": "user", "content": texts[i]}], max_tokens=max_tokens,
                  temperature=0, stream=streamed, extra_body={"return_token_ids": True, "thinking_budget": budget})
        if not streamed:
            r = await aclient.chat.completions.create(**kw)
            c = r.choices[0]
            return c.model_extra["token_ids"], c.finish_reason, r.usage, c.message.reasoning_content, c.message.content
        ids, finish, usage, reasoning, content = [], None, None, "", ""
        async for chunk in await aclient.chat.completions.create(stream_options={"include_usage": True}, **kw):
            usage = chunk.usage or usage
            for c in chunk.choices:
                ids += (c.model_extra or {}).get("token_ids") or []
                finish = c.finish_reason or finish
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
                content += c.delta.content or ""
        return ids, finish, usage, reasoning, content

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(len(MIX))))

    results = asyncio.run(main())
    for i, (ids, finish, usage, reasoning, content) in enumerate(results):
        max_tokens = MIX[i][1]
        want = ref.tokens[i][:max_tokens]
        assert ids == want, f"request {i}"
        assert finish == ("length" if len(ref.tokens[i]) > max_tokens else ref.finish_reason[i]), f"request {i}"
        assert usage.completion_tokens == len(want) and usage.prompt_tokens == len(prompts[i])
        assert usage.completion_tokens_details.reasoning_tokens == min(max_tokens, ref.thinking_tokens[i])
        assert (reasoning, content) == _split(tok, want), f"request {i}"
    assert [r[0] for r in results] != [ref.tokens[0][: m] for _, m, *_ in MIX]  # the budgets mattered


def test_stop_strings_and_reasoning_effort(client, reference, pair):
    tok = pair[2]
    texts, _, ref = reference
    reasoning, _ = _split(tok, ref.tokens[0])  # MIX[0]: a qa task (`Age of NAME: AGE.` lines), unlimited thinking
    assert reasoning.index(":") > 0
    r = client.chat.completions.create(model="builtin", messages=[{"role": "user", "content": texts[0]}],
                                       max_tokens=MAX_NEW, temperature=0, stop=[":", "never"],
                                       extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.reasoning_content == reasoning[: reasoning.index(":")]
    assert c.message.content == ""
    ids = c.model_extra["token_ids"]
    assert ids == ref.tokens[0][: len(ids)] and r.usage.completion_tokens == len(ids) < len(ref.tokens[0])
    assert ":" in tok.decode(ids) and ":" not in tok.decode(ids[:-1])  # counted to the completing token
    # reasoning_effort "low" is the server's low budget (5): the same tokens as thinking_budget=5
    low = client.chat.completions.create(model="builtin", messages=[{"role": "user", "content": texts[5]}],
                                         max_tokens=MAX_NEW, temperature=0, reasoning_effort="low",
                                         extra_body={"return_token_ids": True})
    assert low.choices[0].model_extra["token_ids"] == ref.tokens[5] and MIX[5][2] == 5
    assert low.usage.completion_tokens_details.reasoning_tokens == ref.thinking_tokens[5]


def _post(server, path, body, raw=False):
    content = body if raw else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("body,param,status", [
    ("{not json", None, 400),
    ([1, 2], None, 400),
    ({"messages": "hi"}, "messages", 400),
    ({"messages": []}, "messages", 400),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", 400),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", 400),
    ({"temperature": "hot"}, "temperature", 400),
    ({"temperature": 2.5}, "temperature", 400),
    ({"top_p": 0}, "top_p", 400),
    ({"top_k": 5000}, "top_k", 400),
    ({"max_tokens": 0}, "max_tokens", 400),
    ({"max_tokens": 1.5}, "max_tokens", 400),
    ({"max_tokens": 10_000}, "max_tokens", 400),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", 400),
    ({"seed": -1}, "seed", 400),
    ({"n": 2}, "n", 400),
    ({"stream": "yes"}, "stream", 400),
    ({"stop": ["ok", ""]}, "stop", 400),
    ({"stop": [f"never {i}" for i in range(17)]}, "stop", 400),
    ({"stop": "x" * 257}, "stop", 400),
    ({"stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"stop_token_ids": [99999]}, "stop_token_ids", 400),
    ({"stop_token_ids": list(range(10, 19)), "stream": True}, "stop_token_ids", 400),  # 9: more than the slots take
    ({"thinking_budget": -3}, "thinking_budget", 400),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", 400),
    ({"reasoning_effort": "low", "thinking_budget": 3}, "reasoning_effort", 400),
    ({"logprobs": True}, "logprobs", 400),
    ({"messages": [{"role": "user", "content": "Reverse the list: " + ", ".join(builtin.lexicon()[:500])}]},
     "messages", 400),
    ({"model": "gpt-4o"}, "model", 404),
])
def test_bad_requests_get_openai_errors(server, body, param, status):
    if isinstance(body, dict):
        body = {"model": "builtin", "messages": [{"role": "user", "content": "Start at 3 and add 2, 3 times."}],
                **body}
    r = _post(server, "/v1/chat/completions", body, raw=isinstance(body, str))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err["message"]
    if "lexicon" in str(body) or param == "max_tokens" and "10000" in str(body):
        assert err["code"] == "context_length_exceeded"


def test_errors_through_the_openai_client(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="builtin", prompt=[5, 2 ** 20])
    assert e.value.body["param"] == "prompt"
    # explicit nulls are the defaults, as OpenAI's API reads them
    nulls = {"model": "builtin", "prompt": "Step 1:", "max_tokens": 3, "temperature": 0, "n": None, "stream": None,
             "presence_penalty": None, "frequency_penalty": None, "return_token_ids": None, "stream_options": None}
    r = _post(server, "/v1/completions", nulls)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = _post(server, "/v1/completions", {**nulls, "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    # a request refused by validation is counted as received and as rejected
    before = httpx.get(server.url + "/metrics").text
    r = _post(server, "/v1/chat/completions", '{"model": "builtin", "messages": [{"role": "user", "content": "hi"}], '
                                               '"temperature": NaN}', raw=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature" and "finite" in r.text, r.text
    after = httpx.get(server.url + "/metrics").text
    for name, labels in (("eagle3:requests_total", {"endpoint": "chat"}), ("eagle3:requests_rejected_total", {"code": "400"})):
        assert _metric(after, name, **labels) == _metric(before, name, **labels) + 1, name
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    # curl -d sends a form Content-Type: the body is read as JSON all the same
    body = json.dumps({"model": "builtin", "prompt": "Step 1:", "max_tokens": 3, "temperature": 0})
    form = {"content-type": "application/x-www-form-urlencoded"}
    assert httpx.post(server.url + "/v1/completions", content=body, headers=form).json()["usage"]["completion_tokens"] == 3
    r = httpx.post(server.url + "/v1/completions", content=body[:-3], headers=form)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert [m.id for m in client.models.list()] == ["builtin"]
    # max_model_len is what a request can hold: a prompt of that many tokens less one gets one new token
    n = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    assert n == server.engine.slots.request_len < server.engine.slots.max_len
    r = _post(server, "/v1/completions", {"model": "builtin", "prompt": [7] * (n - 1), "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    r = _post(server, "/v1/completions", {"model": "builtin", "prompt": [7] * n, "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_queue_full_gets_429_and_every_request_an_answer(server):
    engine = server.engine
    body = {"model": "builtin", "messages": [{"role": "user", "content": "Start at 93 and add 5, once."}],
            "max_tokens": 90, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(server.url + "/v1/chat/completions", json=body) for _ in range(12)))

    old, engine.max_queue = engine.max_queue, 1
    try:
        responses = asyncio.run(main())
    finally:
        engine.max_queue = old
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    answers = {r.json()["choices"][0]["message"]["content"] for r in responses if r.status_code == 200}
    assert len(answers) == 1 and "The answer is" in answers.pop()
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
    metrics = httpx.get(server.url + "/metrics").text
    assert _metric(metrics, "eagle3:requests_rejected_total", code="429") == codes.count(429)


def test_cut_stream_frees_its_slot(server, client, pair):
    """A client that drops a long streamed request: the slot is released (cancelled in
    /metrics, nothing left running) long before the request would have ended."""
    prompt = encode_chat(pair[2], [{"role": "user", "content": "Start at 96 and subtract 5, 12 times."}])
    body = dict(model="builtin", prompt=prompt, temperature=1.0, max_tokens=400)
    for seed in range(16):  # a seed whose (uncut) sample runs long: sampled tokens depend only on the seed
        n_full = client.completions.create(seed=seed, **body).usage.completion_tokens
        if n_full >= 150:
            break
    assert n_full >= 150, "no seed found whose request runs long enough for the cut to land mid-way"
    before = httpx.get(server.url + "/metrics").text
    stream = client.completions.create(seed=seed, stream=True, **body)
    next(iter(stream))  # the first tokens arrived: the request runs
    stream.close()
    for _ in range(200):
        after = httpx.get(server.url + "/metrics").text
        if _metric(after, "eagle3:request_success_total", finished_reason="cancelled") > \
                _metric(before, "eagle3:request_success_total", finished_reason="cancelled"):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert _metric(after, "eagle3:request_success_total", finished_reason="cancelled") == \
        _metric(before, "eagle3:request_success_total", finished_reason="cancelled") + 1
    assert _metric(after, "eagle3:num_requests_running") == 0
    sent = _metric(after, "eagle3:generation_tokens_total") - _metric(before, "eagle3:generation_tokens_total")
    assert 0 < sent < n_full
    assert server.engine.running == 0 and server.engine.waiting == 0


def test_metrics_page(server, client):
    client.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "Start at 3 and add 2, 3 times."}],
                                   max_tokens=40, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("eagle3:num_requests_running", "eagle3:num_requests_waiting", "eagle3:generation_tokens_total",
                 "eagle3:prompt_tokens_total", "eagle3:time_to_first_token_seconds_count",
                 "eagle3:time_per_output_token_seconds_count", "eagle3:e2e_request_latency_seconds_count"):
        assert name in text, name
    assert _metric(text, "eagle3:time_to_first_token_seconds_count") >= 1
    for phase in ("thinking", "answer"):
        drafts = _metric(text, "eagle3:spec_decode_num_drafts_total", phase=phase)
        proposed = _metric(text, "eagle3:spec_decode_num_draft_tokens_total", phase=phase)
        accepted = _metric(text, "eagle3:spec_decode_num_accepted_tokens_total", phase=phase)
        per_pos = [_metric(text, "eagle3:spec_decode_num_accepted_tokens_per_pos_total", phase=phase, position=str(i))
                   for i in range(4)]
        assert drafts > 0 and proposed == 4 * drafts and 0 < accepted <= proposed
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_serve_refuses_slots_whose_caches_exceed_the_memory(capsys):
    """--max-batch x --max-len whose KV caches alone exceed the device's memory: one line
    naming both and the sizes, before any cache is allocated (not an allocation failure, or
    a machine swapping, in the warm-up); sizes that fit pass the check."""
    from eagle3_jax import cli

    assert cli.main(["serve", "--max-batch", "1000000", "--port", "0", "--compile-cache", "off"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "--max-batch 1000000" in err and "--max-len" in err and "GiB" in err, err
    target, drafter, _ = builtin.load()
    check_cache_fits(target, drafter, 8, 512)
    with pytest.raises(ValueError, match="--max-batch 2 x --max-len 64"):
        check_cache_fits(target, drafter, 2, 64, memory=1 << 20)
    check_cache_fits(target, drafter, 2, 64, memory=1 << 30)


def test_the_built_in_pair_loads_without_torch():
    """The server's start loads the built-in pair and its tokenizer without importing torch
    (seconds of every start; the library never needs it): in a fresh interpreter."""
    import os
    import subprocess
    import sys

    code = ("import sys; from eagle3_jax import builtin; import eagle3_jax.serve.server; "
            "t, d, tok = builtin.load(); assert tok.encode('Hello'), 'no tokens'; "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False", "the start imported torch"
