"""``eagle3_jax.serve.schemas``: every parameter of a request is checked before a response
starts (a stream never opens on a bad request), content that is not text is refused by name,
and ``max_completion_tokens`` is honoured; through the app on loopback, over a stand-in for the
slot engine and the built-in pair's tokenizer."""

from __future__ import annotations

import pytest

from helpers import FakeSlots, api_error, builtin_tokenizer, fake_server, post


@pytest.fixture(scope="module")
def server():
    tok = builtin_tokenizer()
    slots = FakeSlots.of(tok)
    with fake_server(tok, slots, max_body_bytes=64 << 10) as srv:
        srv.slots = slots
        yield srv


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
    api_error(post(server, body, path), status, code, param)


def test_completions_honour_max_completion_tokens(server):
    for path, body in (("/v1/completions", {"prompt": "Step 1:"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Step 1:"}]})):
        r = post(server, {**body, "max_completion_tokens": 2}, path)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert server.slots.inserts[-1][1]["max_new_tokens"] == 2
