"""EAGLE-2 dynamic draft tree, as the official ``topK_genrate`` builds it, with static
shapes so that the decode loop compiles once.

Scores are cumulative draft log-probs.  Level 1 is the top-k of the drafter's
prediction after the committed context; each of ``depth`` expansions runs the current
``top_k`` beams (each sees the committed context plus its own ancestor beams), takes
``top_k`` children per beam and keeps the best ``top_k`` of the ``top_k²`` as the next
beams.  Of all ``top_k + depth·top_k²`` candidates the best ``total_tokens - 1`` are
kept in candidate-list order, below the root.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax import limits
from eagle3_jax.kv_cache import KVCache, by_rows


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Tree budget: ``total_tokens`` nodes including the root, ``depth`` expansions,
    ``top_k`` beams / children per beam.  ``TreeConfig.chain(n)`` drafts a single
    chain of ``n`` tokens."""

    total_tokens: int = 60
    depth: int = 7
    top_k: int = 10

    def __post_init__(self):
        outside = False
        for name, rng in limits.TREE.items():  # the ranges: limits.TREE
            v = getattr(self, name)
            value, error = limits.problem(v, rng)
            if isinstance(error, TypeError):
                raise TypeError(f"TreeConfig.{name} must be an integer, got {type(v).__name__} {v!r}")
            outside = outside or error is not None
            object.__setattr__(self, name, value)  # numpy integers as ints: one hash, one compiled program
        if outside:
            need = ", ".join(f"{name} >= {rng.lo}" for name, rng in limits.TREE.items())
            raise ValueError(f"{self}: need {need}")
        if self.total_tokens - 1 > self.num_candidates:
            raise ValueError(f"{self}: total_tokens - 1 = {self.total_tokens - 1} exceeds the "
                             f"{self.num_candidates} candidates (top_k + depth*top_k^2)")

    @classmethod
    def chain(cls, n: int) -> "TreeConfig":
        """A chain of ``n`` drafted tokens: ``TreeConfig(n + 1, n - 1, 1)``."""
        length, error = limits.problem(n, limits.CHAIN_LENGTH)
        if error:
            raise ValueError(f"TreeConfig.chain: the chain's length must be an integer >= {limits.CHAIN_LENGTH.lo}, "
                             f"got {n!r}")
        n = length
        return cls(total_tokens=n + 1, depth=n - 1, top_k=1)

    @property
    def num_candidates(self) -> int:
        return self.top_k + self.depth * self.top_k ** 2

    @property
    def path_len(self) -> int:
        """Longest root-to-leaf path in nodes (root + depth + 1 drafted levels)."""
        return self.depth + 2

    @property
    def scratch(self) -> int:
        """Cache slots a round needs past the committed prefix (the verified tree's nodes, the
        drafter's accepted path)."""
        return max(self.total_tokens, self.path_len)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    tokens: jax.Array  # [B, N] target ids, root first
    parents: jax.Array  # [B, N] parent node, -1 for the root
    depth: jax.Array  # [B, N] root 0
    mask: jax.Array  # [B, N, N] bool: self + ancestors
    paths: jax.Array  # [B, N, P] root-to-leaf node paths, one row per leaf (increasing leaf index), -1 padded


def parse_tree(spec: str) -> TreeConfig:
    """``"60,7,10"`` → TreeConfig(60, 7, 10); ``"chain4"`` → a 4-token chain."""
    if spec.startswith("chain"):
        if not spec[5:].isdigit() or int(spec[5:]) < 1:
            raise ValueError(f"--tree {spec!r}: chainN needs a whole number of tokens N >= 1 (e.g. chain4)")
        return TreeConfig.chain(int(spec[5:]))
    try:
        n, d, k = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--tree {spec!r}: expected TOTAL,DEPTH,TOPK (e.g. 60,7,10) or chainN") from None
    return TreeConfig(n, d, k)



def _top_k(cache: KVCache | None, x, k: int):
    """``jax.lax.top_k(x, k)`` of per-row ``x``, on each device's own rows where ``cache``'s
    layout splits the batch (XLA's partitioner gathers a top-k's whole operand to every
    device: at batch 32 on two CPU devices, two all-gathers per drafted token)."""
    if cache is None:
        return jax.lax.top_k(x, k)
    assert x.ndim < 5, x.shape  # by_rows lays out five-dimensional arrays as the cache
    return by_rows(cache, lambda x: jax.lax.top_k(x, k), x)


def expand(drafter, cache: KVCache, last_hidden_BxH, root_B, cfg: TreeConfig) -> Tree:
    """Builds the draft tree below ``root`` from the drafter's output after the
    committed context (read from ``cache``, which is not written)."""
    B = root_B.shape[0]
    k, D = cfg.top_k, cfg.depth
    logp = jax.nn.log_softmax(drafter.logits(last_hidden_BxH), axis=-1)
    scores, draft_ids = _top_k(cache, logp, k)  # [B, k]
    cand_scores = [scores]
    cand_tokens = [drafter.to_target_ids(draft_ids)]
    cand_parents = [jnp.full((B, k), -1, jnp.int32)]  # candidate index of the parent; -1 = root

    beam_hidden = jnp.broadcast_to(last_hidden_BxH[:, None], (B, k, last_hidden_BxH.shape[-1]))
    beam_tokens = cand_tokens[0]
    beam_cand = jnp.broadcast_to(jnp.arange(k), (B, k))
    # ancestors among the expanded beams; expansion i's beams are region slots [i*k, (i+1)*k),
    # their keys/values carried here (the drafter's cache is only read)
    beam_anc = jnp.broadcast_to(jnp.eye(k, D * k, dtype=bool), (B, k, D * k))
    region_kv = None
    for i in range(D):
        pos = jnp.broadcast_to(cache.lengths[:, None] + i, (B, k))
        out, (k_new, v_new) = drafter.step(beam_hidden, beam_tokens, pos, cache=cache, region_mask_BxTxR=beam_anc,
                                           region_kv=region_kv)
        region_kv = (k_new, v_new) if region_kv is None else (
            jnp.concatenate([region_kv[0], k_new], -3), jnp.concatenate([region_kv[1], v_new], -3))  # the token axis
        child_logp, child_ids = _top_k(cache, jax.nn.log_softmax(drafter.logits(out), axis=-1), k)  # [B, k, k]
        cu = (child_logp + scores[:, :, None]).reshape(B, k * k)  # beam-major, child-rank minor
        child_tokens = drafter.to_target_ids(child_ids).reshape(B, k * k)
        cand_scores.append(cu)
        cand_tokens.append(child_tokens)
        cand_parents.append(jnp.repeat(beam_cand, k, axis=1))

        scores, best = _top_k(cache, cu, k)
        parent_beam = best // k
        beam_hidden = jnp.take_along_axis(out, parent_beam[..., None], axis=1)
        beam_tokens = jnp.take_along_axis(child_tokens, best, axis=1)
        beam_cand = k + i * k * k + best
        new_slots = jax.nn.one_hot((i + 1) * k + jnp.arange(k), D * k, dtype=bool) if i + 1 < D else False
        beam_anc = jnp.take_along_axis(beam_anc, parent_beam[..., None], axis=1) | new_slots

    return select(jnp.concatenate(cand_scores, 1), jnp.concatenate(cand_tokens, 1),
                   jnp.concatenate(cand_parents, 1), root_B, cfg, cache)


def select(scores_BxC, tokens_BxC, parents_BxC, root_B, cfg: TreeConfig, cache: KVCache | None = None) -> Tree:
    """The draft tree of ``expand``'s candidates: keeps the best ``total_tokens - 1``
    candidates (in candidate order) below the root (``cache``: the drafter's, for its layout
    on a mesh)."""
    N, P = cfg.total_tokens, cfg.path_len
    keep = jnp.sort(_top_k(cache, scores_BxC, N - 1)[1], axis=-1)  # [B, N-1]
    tokens = jnp.concatenate([root_B[:, None], jnp.take_along_axis(tokens_BxC, keep, 1)], 1)
    parent_cand = jnp.take_along_axis(parents_BxC, keep, 1)
    parent_node = jax.vmap(jnp.searchsorted)(keep, parent_cand) + 1  # as the official searchsorted
    parents = jnp.concatenate([jnp.full_like(root_B[:, None], -1), jnp.where(parent_cand < 0, 0, parent_node)], 1)
    return jax.vmap(lambda t, p: _structure(t, p, P))(tokens, parents.astype(jnp.int32))


def _structure(tokens_N, parents_N, P: int) -> Tree:
    """Mask, depths and root-to-leaf paths of one tree from its parent pointers."""
    N = tokens_N.shape[0]
    nodes = jnp.arange(N)
    mask = jnp.eye(N, dtype=bool)
    anc = parents_N
    for _ in range(P - 1):  # pointer jumping: the tree is at most P-1 levels deep
        mask = mask | ((anc[:, None] == nodes[None, :]) & (anc[:, None] >= 0))
        anc = jnp.where(anc >= 0, parents_N[jnp.maximum(anc, 0)], -1)
    depth = mask.sum(-1) - 1
    # path[n, d] = the ancestor of n at depth d (or -1)
    at_depth = mask[:, None, :] & (depth[None, None, :] == jnp.arange(P)[None, :, None])  # [N, P, N]
    path = jnp.where(at_depth.any(-1), jnp.argmax(at_depth, -1), -1)
    is_leaf = ~jnp.any(parents_N[None, :] == nodes[:, None], axis=1)
    order = jnp.argsort(~is_leaf, stable=True)  # leaves first, increasing index
    paths = jnp.where(is_leaf[order][:, None], path[order], -1)
    return Tree(tokens_N, parents_N, depth.astype(jnp.int32), mask, paths.astype(jnp.int32))


def children_table(parents_N, max_children: int):
    """``[N, max_children]`` child node ids in increasing order, -1 padded."""
    N = parents_N.shape[0]
    nodes = jnp.arange(N)
    earlier_sibling = (parents_N[None, :] == parents_N[:, None]) & (nodes[None, :] < nodes[:, None])
    rank = earlier_sibling.sum(-1)
    table = jnp.full((N, max_children), -1, jnp.int32)
    return table.at[jnp.where(parents_N >= 0, parents_N, N), rank].set(nodes, mode="drop")


def forced_chain(root_B, ids_BxF, n_B, cfg: TreeConfig) -> Tree:
    """A tree of ``cfg``'s static shape holding the chain ``root → ids[:n]`` (``n <= F =
    min(total_tokens, path_len) - 1``); the remaining nodes hang off the root, after the chain's
    first node, so a walk that accepts the chain never visits them.  Used to commit forced
    tokens (the end-of-thinking sequence) through the same verify and commit as a draft."""
    N, P = cfg.total_tokens, cfg.path_len
    B, F = ids_BxF.shape
    nodes = jnp.arange(1, N)[None]
    in_chain = nodes <= n_B[:, None]
    idx = jnp.clip(nodes - 1, 0, F - 1)
    tokens = jnp.concatenate([root_B[:, None], jnp.where(in_chain, jnp.take_along_axis(ids_BxF, jnp.broadcast_to(idx, (B, N - 1)), 1), 0)], 1)
    parents = jnp.concatenate([jnp.full((B, 1), -1), jnp.where(in_chain, nodes - 1, 0)], 1).astype(jnp.int32)
    return jax.vmap(lambda t, p: _structure(t, p, P))(tokens.astype(jnp.int32), parents)
