"""``eagle3_jax.serve.output`` without a model: the thinking / answer split, incremental
detokenization with partial UTF-8, stop strings and token counts, on the built-in tokenizer."""

from __future__ import annotations

import random

import pytest

from eagle3_jax import budget
from eagle3_jax.serve.output import OutputParser
from helpers import builtin_tokenizer


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


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
