"""The server's parts that need no model: output parsing (the thinking / answer split,
incremental detokenization with partial UTF-8, stop strings, token counts; the built-in
tokenizer), the replay's statistics, and the serve / replay command lines' argument errors."""

from __future__ import annotations

import random

import pytest

from eagle3_jax import budget, builtin
from eagle3_jax.serve.output import OutputParser


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(builtin.TARGET_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def think(tok):
    open_id, close_id = tok.convert_tokens_to_ids(["<think>", "</think>"])
    return budget.ThinkingConfig(open_id, close_id, (close_id,))


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _run(parser, tokens, sizes):
    """Feeds ``tokens`` in chunks of the given sizes; returns the joined stream per field."""
    out, i = {}, 0
    for n in sizes:
        for k, v in parser.feed(tokens[i: i + n]).items():
            assert "\ufffd" not in v, f"a partial character was streamed in {k}: {v!r}"
            out[k] = out.get(k, "") + v
        i += n
        if parser.stopped:
            break
    for k, v in parser.finish().items():
        out[k] = out.get(k, "") + v
    return out


def _chunkings(n, seed):
    rng = random.Random(seed)
    yield [1] * n
    yield [n]
    for _ in range(3):
        sizes, left = [], n
        while left > 0:
            sizes.append(min(left, rng.randint(1, 7)))
            left -= sizes[-1]
        yield sizes


def test_split_at_close_token_any_chunking(tok, think):
    eos = builtin_eos(tok)
    thinking = "\nStep 1: 40 - 6 = 34.\nStep 2: 34 - 6 = 28.\n"
    answer = "\nThe answer is 28."
    tokens = [think.open_id, *_ids(tok, thinking), think.close_id, *_ids(tok, answer), eos]
    for seed, sizes in enumerate(_chunkings(len(tokens), 0)):
        p = OutputParser(tok, split=True, thinking=think, prompt_ids=[1, 2], stop_ids=[eos])
        out = _run(p, tokens, sizes)
        assert out == {"reasoning": thinking, "content": answer}, sizes
        assert p.texts == out
        assert p.completion_tokens == len(tokens)
        assert p.reasoning_tokens == 1 + len(_ids(tok, thinking)) + 1  # open, content, close
        assert not p.stopped


def test_prompt_ending_inside_thinking(tok, think):
    tokens = [*_ids(tok, "abc"), think.close_id, *_ids(tok, "done")]
    p = OutputParser(tok, split=True, thinking=think, prompt_ids=[5, think.open_id])
    assert _run(p, tokens, [2, 3, 10]) == {"reasoning": "abc", "content": "done"}
    assert p.reasoning_tokens == len(_ids(tok, "abc")) + 1
    # without thinking markers nothing is reasoning, and a raw completion keeps the markers
    p = OutputParser(tok, split=True, thinking=None, prompt_ids=[5])
    assert p.feed(_ids(tok, "abc")) == {"content": "abc"} and p.reasoning_tokens == 0
    p = OutputParser(tok, split=False, thinking=think, prompt_ids=[5])
    tokens = [think.open_id, *_ids(tok, "x"), think.close_id, *_ids(tok, "y")]
    assert _run(p, tokens, [1, 1, 1, 1]) == {"text": "<think>x</think>y"}
    assert p.reasoning_tokens == 3


def test_partial_utf8_is_held_until_complete(tok):
    text = "é€😀 ok ü"
    tokens = _ids(tok, text)
    assert len(tokens) > len(text) - 3  # byte-level: characters span several tokens
    for sizes in _chunkings(len(tokens), 1):
        p = OutputParser(tok, split=False, thinking=None)
        assert _run(p, tokens, sizes) == {"text": text}
    # a stream that ends inside a character flushes what the tokenizer makes of it
    p = OutputParser(tok, split=False, thinking=None)
    assert p.feed(tokens[:1]) == {}
    assert p.finish() == {"text": tok.decode(tokens[:1])}


@pytest.mark.parametrize("stop", [["28"], ["answer is"], ["zzz", "34 -"], ["Step 2"]])
def test_stop_strings_cut_and_count(tok, think, stop):
    eos = builtin_eos(tok)
    thinking = "\nStep 1: 40 - 6 = 34.\nStep 2: 34 - 6 = 28.\n"
    answer = "\nThe answer is 28."
    tokens = [think.open_id, *_ids(tok, thinking), think.close_id, *_ids(tok, answer), eos]
    full = {"reasoning": thinking, "content": answer}
    for sizes in _chunkings(len(tokens), 2):
        p = OutputParser(tok, split=True, thinking=think, prompt_ids=[1], stop=tuple(stop), stop_ids=[eos])
        out = _run(p, tokens, sizes)
        assert p.stopped
        # the text ends just before the first stop string, in the field where it occurs
        field = "reasoning" if any(s in thinking for s in stop) else "content"
        cut = min(full[field].find(s) for s in stop if s in full[field])
        assert out.get(field, "") == full[field][:cut]
        assert out.get("content", "") == ("" if field == "reasoning" else full["content"][:cut])
        # the counts stop at the token that completed the match
        n = next(k for k in range(1, len(tokens) + 1)
                 if any(s in tok.decode(tokens[:k], skip_special_tokens=True).replace("<think>", "")
                        .replace("</think>", "") for s in stop))
        assert p.completion_tokens == n
        assert p.reasoning_tokens == min(n, len(_ids(tok, thinking)) + 2)


def test_stop_prefix_held_back_then_released(tok):
    p = OutputParser(tok, split=False, thinking=None, stop=("STOPX",))
    first = p.feed(_ids(tok, "hello ST"))
    assert first == {"text": "hello "}  # "ST" could still become "STOPX"
    assert p.feed(_ids(tok, "OP now")) == {"text": "STOP now"}
    assert p.finish() == {} and not p.stopped


def builtin_eos(tok):
    return tok.convert_tokens_to_ids("<|end|>")


def test_replay_statistics():
    from eagle3_jax.serve.replay import arrivals, crossover, summarize, table

    times = arrivals(50.0, 2000, seed=1)
    assert times == sorted(times) and abs(len(times) / times[-1] - 50.0) < 5  # a Poisson process of rate 50
    assert arrivals(50.0, 10, seed=1) == times[:10]
    ok = lambda ttft, lat, n: {"status": 200, "ttft": ttft, "latency": lat, "tokens": n}  # noqa: E731
    records = [ok(0.1, 1.1, 101), ok(2.0, 2.5, 51), ok(0.2, 5.2, 101), {"status": 429, "ttft": None, "latency": None,
                                                                      "tokens": 0}, {"status": "timeout"}]
    s = summarize(records, wall=10.0, ttft_slo=1.0, tpot_slo=0.02)
    # TPOTs: 10 ms, 10 ms, 50 ms: only the first meets both objectives
    assert (s["completed"], s["rejected_429"], s["failed"]) == (3, 1, 1)
    assert s["goodput"] == pytest.approx(0.1) and s["tokens_per_second"] == pytest.approx(25.3)
    assert s["tpot_s"]["p50"] == pytest.approx(0.01) and s["ttft_s"]["p50"] == pytest.approx(0.2)
    row = lambda g: {"goodput": g, "tokens_per_second": 1.0, "tpot_s": {"p50": 0.001}}  # noqa: E731
    modes = {"vanilla": [row(1), row(2), row(3)], "chain4": [row(2), row(2.5), row(2)], "adaptive": [row(1), row(3), row(3)]}
    assert crossover(modes, [1, 2, 4]) == 4  # at rate 4 neither beats vanilla
    modes["adaptive"][2] = row(3.5)
    assert crossover(modes, [1, 2, 4]) is None
    text = table({"rates": [1, 2, 4], "modes": modes, "ttft_slo_s": 1.0, "tpot_slo_s": 0.02, "crossover_rate": None})
    assert "| chain4 | 2.00" in text and "no measured rate" in text


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--speculation", "wide"], "--speculation"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-batch", "0"], "--max-batch"),
    (["serve", "--reasoning-effort-budgets", "1", "2"], "--reasoning-effort-budgets"),
    (["replay", "--requests", "4"], "--rate"),
    (["replay", "--rate", "0"], "--rate"),
    (["replay", "--rate", "2", "--json", "x.json", "--figure", "x.json"], "--json"),
    (["replay", "--rate", "2", "--target", "somewhere"], "--drafter"),
])
def test_serve_and_replay_arguments(argv, needle, capsys, tmp_path, monkeypatch):
    from eagle3_jax import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_serve_refuses_a_busy_port_before_loading(capsys):
    import socket

    from eagle3_jax import cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "cannot listen" in err


def test_serve_refuses_slots_whose_caches_exceed_the_memory(capsys):
    """--max-batch x --max-len whose KV caches alone exceed the device's memory: one line
    naming both and the sizes, before any cache is allocated (not an allocation failure, or
    a machine swapping, in the warm-up); sizes that fit pass the check."""
    from eagle3_jax import builtin, cli
    from eagle3_jax.serve.app import check_cache_fits

    assert cli.main(["serve", "--max-batch", "1000000", "--port", "0", "--compile-cache", "off"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "--max-batch 1000000" in err and "--max-len" in err and "GiB" in err, err
    target, drafter, _ = builtin.load()
    check_cache_fits(target, drafter, 8, 512)
    with pytest.raises(ValueError, match="--max-batch 2 x --max-len 64"):
        check_cache_fits(target, drafter, 2, 64, memory=1 << 20)
    check_cache_fits(target, drafter, 2, 64, memory=1 << 30)


class _RecordingSlots:
    """A stand-in for ``decode.Slots`` (one slot, a request of ``n`` tokens, one per program):
    records the engine's calls; ``poll(lag=1)`` shows the program before the last, as Slots does."""

    num_slots, thinking = 1, None

    def __init__(self, eos: int, n: int = 3):
        self.stop_ids, self.n, self.calls, self.states, self.ticket = (eos,), n, [], [], -1

    def _program(self, tokens):
        from eagle3_jax.decode import SlotView

        done = len(tokens) >= self.n
        self.states.append(SlotView(not done, list(tokens), done, "length" if done else None, 0, len(tokens), "none", {},
                                    self.ticket))

    def insert(self, slot, prompt_ids, **kw):
        self.calls.append("insert")
        self.ticket += 1
        self._program([5])
        return self.ticket

    def run(self, rounds):
        self.calls.append(f"run({rounds})")
        last = self.states[-1]
        self._program((last.tokens + [5] * rounds)[: self.n])

    def poll(self, lag=0):
        self.calls.append(f"poll(lag={lag})")
        return [self.states[-2 if lag and len(self.states) > 1 else -1]]

    def release(self, slot):
        self.calls.append("release")


def test_engine_runs_an_admission_at_once_and_reads_its_first_token_from_the_prefill(tok):
    """After an admission the engine dispatches rounds before it polls, and that lagged poll
    shows the prefill's first token (the device never waits for the host between a prefill and
    its rounds); the rounds per dispatch then double up to ``rounds_per_dispatch``."""
    import asyncio

    from eagle3_jax.serve.engine import Engine, Params

    slots = _RecordingSlots(tok.eos_token_id, n=40)
    engine = Engine(slots, tok, rounds_per_dispatch=8)

    async def go():
        engine.start()
        req = engine.submit([1, 2, 3], Params(max_new_tokens=40), split=False)
        kind, (_, first) = await asyncio.wait_for(req.events.get(), 30)
        while kind != "done":
            kind, _ = await asyncio.wait_for(req.events.get(), 30)
        engine.shutdown()
        return first, req.result

    first, result = asyncio.run(go())
    assert slots.calls[:5] == ["insert", "run(2)", "poll(lag=1)", "run(4)", "poll(lag=1)"]
    assert first == [5] and len(result.tokens) == 40  # the first delta: the prefill's token, read by the first poll
    assert "poll(lag=0)" not in slots.calls and slots.calls.count("run(8)") >= 2


def test_an_abandoned_request_is_cancelled_while_its_tokens_flow():
    """``_wait`` looks for a departed client every ``poll_s`` even when events arrive more often
    than that (a non-streamed request that is generating): it cancels the request and answers 499."""
    import asyncio

    from eagle3_jax.serve.app import ApiError, _wait

    class Req:
        def __init__(self):
            self.events, self.cancelled = asyncio.Queue(), False

        def cancel(self):
            self.cancelled = True

    class Client:
        async def is_disconnected(self):
            return True

    async def main():
        req = Req()

        async def tokens():  # a delta every 10 ms, never done
            while True:
                req.events.put_nowait(("delta", None))
                await asyncio.sleep(0.01)

        feeder = asyncio.create_task(tokens())
        try:
            with pytest.raises(ApiError) as e:
                await asyncio.wait_for(_wait(req, Client(), poll_s=0.05), 5.0)
        finally:
            feeder.cancel()
        return req, e.value

    req, err = asyncio.run(main())
    assert err.status == 499 and req.cancelled



def test_the_built_in_pair_loads_without_torch():
    """The server's start loads the built-in pair and its tokenizer without importing torch
    (seconds of every start; the library never needs it): in a fresh interpreter."""
    import os
    import subprocess
    import sys

    code = ("import sys; from eagle3_jax import builtin; import eagle3_jax.serve.app; "
            "t, d, tok = builtin.load(); assert tok.encode('Hello'), 'no tokens'; "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False", "the start imported torch"
