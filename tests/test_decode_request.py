"""A ``generate`` call's request (``eagle3_jax.decode._request``): malformed arguments are
refused before anything compiles, naming the argument; the accepted prompt containers and
scalars mean the same."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax
from eagle3_jax import decode
from eagle3_jax.tree import TreeConfig
from helpers import FIXTURES, golden_drafters


@pytest.fixture(scope="module")
def target():
    return eagle3_jax.load_target(FIXTURES / "target_tiny")


@pytest.fixture(scope="module")
def drafters(target):
    return golden_drafters(target)


@pytest.fixture(scope="module")
def pair(target, drafters):
    """The tiny target and its trained drafter."""
    return target, drafters["drafter_tiny_trained"]



OK = [[1, 2, 3]]


BAD = [
    # (id, kwargs, exception, words the message must contain)
    ("prompt-floats", dict(prompts=[[1.0, 2.0]]), TypeError, "prompts[0]"),
    ("prompt-float-array", dict(prompts=np.array([[1.5, 2.0]])), TypeError, "prompts[0]"),
    ("prompt-bools", dict(prompts=[[True, False]]), TypeError, "prompts[0]"),
    ("prompt-bool-array", dict(prompts=[np.array([True, False])]), TypeError, "prompts[0]"),
    ("prompt-string-no-tokenizer", dict(prompts=["hello"]), ValueError, "tokenizer"),
    ("prompt-empty-list", dict(prompts=[]), ValueError, "prompts"),
    ("prompt-empty-row", dict(prompts=[[1, 2], []]), ValueError, "prompts[1]"),
    ("prompt-3d-array", dict(prompts=np.zeros((1, 2, 3), np.int32)), ValueError, "prompts"),
    ("prompt-nested-row", dict(prompts=[[[1, 2]]]), TypeError, "prompts[0]"),
    ("prompt-none", dict(prompts=None), TypeError, "prompts"),
    ("prompt-int", dict(prompts=5), TypeError, "prompts"),
    ("prompt-dict", dict(prompts={"a": 1}), TypeError, "prompts"),
    ("prompt-id-negative", dict(prompts=[[1, -1]]), ValueError, "prompts[0]"),
    ("prompt-id-too-large", dict(prompts=[[1, 10 ** 6]]), ValueError, "prompts[0]"),
    ("prompt-row-of-strings", dict(prompts=[["a", "b"]]), TypeError, "prompts[0]"),
    ("max-new-zero", dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    ("max-new-float", dict(max_new_tokens=8.0), TypeError, "max_new_tokens"),
    ("max-new-bool", dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    ("max-new-string", dict(max_new_tokens="8"), TypeError, "max_new_tokens"),
    ("too-long", dict(max_new_tokens=10 ** 6), ValueError, "max_position_embeddings"),
    ("temperature-nan", dict(temperature=float("nan")), ValueError, "temperature"),
    ("temperature-inf", dict(temperature=float("inf")), ValueError, "temperature"),
    ("temperature-negative", dict(temperature=-0.5), ValueError, "temperature"),
    ("temperature-tiny", dict(temperature=1e-12), ValueError, "temperature"),
    ("temperature-string", dict(temperature="0.7"), TypeError, "temperature"),
    ("top-p-zero", dict(top_p=0.0), ValueError, "top_p"),
    ("top-p-above-one", dict(top_p=1.5), ValueError, "top_p"),
    ("top-p-nan", dict(top_p=float("nan")), ValueError, "top_p"),
    ("top-k-negative", dict(top_k=-1), ValueError, "top_k"),
    ("top-k-float", dict(top_k=2.5), TypeError, "top_k"),
    ("top-k-above-vocab", dict(top_k=10 ** 6), ValueError, "top_k"),
    ("seed-negative", dict(seed=-1), ValueError, "seed"),
    ("seed-float", dict(seed=1.5), TypeError, "seed"),
    ("seed-huge", dict(seed=2 ** 40), ValueError, "seed"),
    ("tree-tuple", dict(tree=(60, 7, 10)), TypeError, "tree"),
    ("tree-top-k-over-draft-vocab", dict(tree=TreeConfig(4, 1, 10 ** 4 // 2)), ValueError, "top_k"),
    ("stop-int", dict(stop_token_ids=5), TypeError, "stop_token_ids"),
    ("stop-string", dict(stop_token_ids="5"), TypeError, "stop_token_ids"),
    ("stop-float", dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids[0]"),
    ("stop-out-of-vocab", dict(stop_token_ids=[10 ** 6]), ValueError, "stop_token_ids[0]"),
    ("stop-0d-array", dict(stop_token_ids=np.array(5)), TypeError, "stop_token_ids"),
    # a dict's or a set's order is not the prompts' (a dict was read as its keys: budgets 0, 1, ...)
    ("thinking-budget-dict", dict(think_token_ids=(3, 4), thinking_budget={0: 8}), TypeError, "thinking_budget"),
    ("thinking-budget-set", dict(think_token_ids=(3, 4), thinking_budget={8}), TypeError, "thinking_budget"),
    ("end-thinking-0d-array", dict(think_token_ids=(3, 4), thinking_budget=2, end_thinking_ids=np.array(4)), TypeError,
     "end_thinking_ids"),
    ("thinking-budget-0d-float-array", dict(think_token_ids=(3, 4), thinking_budget=np.array(2.0)), TypeError,
     "thinking_budget"),
    # a dict was read as its keys ({3: 4, 1: 2}: open 3, close 1), a set in its own order
    ("think-ids-dict", dict(think_token_ids={3: 4, 1: 2}, thinking_budget=2), TypeError, "think_token_ids"),
    ("think-ids-set", dict(think_token_ids={3, 4}, thinking_budget=2), TypeError, "think_token_ids"),
    ("end-thinking-set", dict(think_token_ids=(3, 4), thinking_budget=2, end_thinking_ids={5, 4}), TypeError,
     "end_thinking_ids"),
    ("end-thinking-dict", dict(think_token_ids=(3, 4), thinking_budget=2, end_thinking_ids={4: 5}), TypeError,
     "end_thinking_ids"),
    ("thinking-grace-negative", dict(think_token_ids=(3, 4), thinking_mode="soft", thinking_grace=-1), ValueError,
     "thinking_grace"),
    ("thinking-grace-without-thinking", dict(thinking_grace=1.5), TypeError, "thinking_grace"),
]


@pytest.mark.parametrize("kwargs,exc,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_generate_argument_is_named(pair, kwargs, exc, words):
    target, drafter = pair
    compiled = []

    class Recording(decode.ProgramCache):
        def get(self, key, build):
            compiled.append(key)
            return super().get(key, build)

    args = dict(prompts=OK, max_new_tokens=8, programs=Recording())  # nothing may compile
    args.update(kwargs)
    prompts = args.pop("prompts")
    with pytest.raises(exc) as info:
        eagle3_jax.generate(target, drafter, prompts, **args)
    assert words in str(info.value)
    assert not compiled


def test_prompt_containers_mean_the_same_prompts(pair):
    """Lists, tuples, numpy int64 scalars, 1-D numpy/jax arrays and a 2-D array (one row per
    prompt) all give the same padded batch; a flat list of ids is one prompt."""
    target, _ = pair
    want = decode.prepare(target, None, [[5, 6, 7], [8, 9, 10]], max_new_tokens=4, temperature=0.0, top_p=1.0,
                           top_k=0, tree=TreeConfig(), seed=0, stop_token_ids=None, tokenizer=None)
    forms = [
        ((5, 6, 7), (8, 9, 10)),
        [np.array([5, 6, 7]), jnp.array([8, 9, 10])],
        np.array([[5, 6, 7], [8, 9, 10]]),
        jnp.array([[5, 6, 7], [8, 9, 10]], jnp.int32),
        [[np.int64(5), np.int64(6), np.int64(7)], [np.int32(8), 9, 10]],
        [[jnp.int32(5), 6, 7], [np.array(8), 9, 10]],
    ]
    for form in forms:
        got = decode.prepare(target, None, form, max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0,
                             tree=TreeConfig(), seed=0, stop_token_ids=None, tokenizer=None)
        np.testing.assert_array_equal(got.prompt_BxT, want.prompt_BxT)
        np.testing.assert_array_equal(got.lengths_B, want.lengths_B)
    one = decode.prepare(target, None, [np.int64(5), 6, 7], max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0,
                          tree=TreeConfig(), seed=0, stop_token_ids=None, tokenizer=None)
    assert one.prompt_BxT.shape[0] == 1 and one.lengths_B.tolist() == [3]


def test_scalar_arguments_read_alike_as_python_numpy_or_jax_scalars(pair):
    """0-d numpy and JAX arrays and numpy scalars are the numbers they hold, for every scalar
    argument (a thinking budget too); a TreeConfig of numpy integers is the same tree."""
    target, drafter = pair
    think = dict(think_token_ids=(3, 4), end_thinking_ids=(4,))

    def request(conv):
        return decode.prepare(target, drafter, [[5, 6, 7], [8, 9]], max_new_tokens=conv(4), temperature=conv(0.5),
                               top_p=conv(0.75), top_k=conv(5), tree=TreeConfig(conv(4), conv(1), conv(3)),
                               seed=conv(3), stop_token_ids=[conv(7)], tokenizer=None, thinking_budget=conv(2), **think)

    want = request(lambda x: x)
    for conv in (np.asarray, lambda x: np.array(x)[()], jnp.asarray):
        got = request(conv)
        assert got.statics == want.statics and got.seed == want.seed
        np.testing.assert_array_equal(got.budget_B, want.budget_B)
    assert hash(TreeConfig(np.int64(4), 1, 3)) == hash(TreeConfig(4, 1, 3))
    assert isinstance(TreeConfig(np.int64(4), 1, 3).total_tokens, int)
