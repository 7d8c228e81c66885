"""Draft vocabulary mapping (``d2t`` / ``t2d``), built as the official EAGLE-3 recipe."""

from __future__ import annotations

import numpy as np


def build_vocab_map(token_ids, loss_mask, vocab_size: int, draft_vocab_size: int):
    """Builds ``(d2t int64 [draft_vocab], t2d bool [vocab])`` from loss-masked token counts.

    The ``draft_vocab_size`` most frequent target ids (ties: first occurrence first, as
    ``collections.Counter.most_common``) are kept, sorted ascending into ``used``;
    ``d2t[i] = used[i] - i``.  With fewer distinct tokens than the draft vocabulary,
    the smallest unseen ids pad it.  ``target_id = draft_id + d2t[draft_id]``.
    """
    ids = np.asarray(token_ids).reshape(-1)
    mask = np.asarray(loss_mask, bool).reshape(-1)
    if ids.shape != mask.shape:
        raise ValueError(f"token_ids and loss_mask differ in size: {ids.shape} vs {mask.shape}")
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} exceeds vocab_size={vocab_size}")
    seen = ids[mask]
    if seen.size and (seen.min() < 0 or seen.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    uniq, first, counts = np.unique(seen, return_index=True, return_counts=True)
    order = np.lexsort((first, -counts))[:draft_vocab_size]
    used = uniq[order]
    if used.size < draft_vocab_size:
        unseen = np.setdiff1d(np.arange(vocab_size), used)[: draft_vocab_size - used.size]
        used = np.concatenate([used, unseen])
    used = np.sort(used)
    d2t = (used - np.arange(draft_vocab_size)).astype(np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[used] = True
    return d2t, t2d
