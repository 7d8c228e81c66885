"""The draft vocabulary (``eagle3_jax.vocab``): the map from draft ids to target ids built as
the official EAGLE-3 rule builds it."""

import collections

import numpy as np
import pytest

import eagle3_jax


def _counter_reference(stream, mask, vocab, n):
    counts = collections.Counter(int(t) for t, m in zip(stream, mask) if m)
    used = sorted(k for k, _ in counts.most_common(n))
    for extra in range(vocab):  # official-style padding with unseen ids, smallest first
        if len(used) >= n:
            break
        if extra not in used:
            used.append(extra)
    used.sort()
    return np.array([u - i for i, u in enumerate(used)]), np.array([i in used for i in range(vocab)])


@pytest.mark.parametrize("n", [5, 40])
def test_vocab_builder_matches_official_rule(n):
    rng = np.random.default_rng(0)
    stream = rng.zipf(1.5, size=400) % 64  # many ties among rare tokens
    mask = rng.random(400) < 0.7
    d2t, t2d = eagle3_jax.build_vocab_map(stream, mask, 64, n)
    ref_d2t, ref_t2d = _counter_reference(stream, mask, 64, n)
    np.testing.assert_array_equal(d2t, ref_d2t)
    np.testing.assert_array_equal(t2d, ref_t2d)
    assert d2t.dtype == np.int64 and t2d.sum() == n


def test_vocab_builder_pads_with_unseen_ids():
    d2t, t2d = eagle3_jax.build_vocab_map([7, 7, 3, 9], [1, 1, 1, 0], vocab_size=12, draft_vocab_size=4)
    np.testing.assert_array_equal(np.flatnonzero(t2d), [0, 1, 3, 7])  # 3 and 7 seen; 0 and 1 pad; 9 is masked
    np.testing.assert_array_equal(np.arange(4) + d2t, [0, 1, 3, 7])
