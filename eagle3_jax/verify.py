"""Lossless tree verification (greedy and sampling).

Draft tokens are deterministic (the draft distribution is one-hot), so the walk is:
at the current node try its children in order, accept child ``x`` with probability
``p(x) / remaining mass`` (equivalently: with probability ``p(x)`` after earlier
rejected siblings were zeroed and ``p`` renormalised); on acceptance move to ``x``,
otherwise continue with the next sibling.  When every child is rejected (or the node
is a leaf) the bonus token is drawn from ``p`` with the children removed.  Every
emitted token is therefore distributed exactly as the target's own sample.
Greedy decoding is the same walk with ``p = one_hot(argmax)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.tree import Tree, children_table


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"{self}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Sampling parameters per row, as arrays: one compiled program serves rows that mix greedy
    (``temperature == 0``) and sampled requests.  A greedy row draws from the one-hot of its
    argmax, which the sampling walk treats exactly as the greedy walk does."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_p: jax.Array  # [B] float32 in (0, 1]
    top_k: jax.Array  # [B] int32, 0 = off

    greedy = False  # the rows decide; never the static greedy path

    @classmethod
    def of(cls, s: SamplingConfig, batch: int) -> "RowSampling":
        full = lambda v, dtype: jnp.full((batch,), v, dtype)  # noqa: E731
        return cls(full(s.temperature, jnp.float32), full(s.top_p, jnp.float32), full(s.top_k, jnp.int32))


def _row_probs(logits_BxxV, s: RowSampling):
    """:func:`target_probs` with per-row parameters (rows on the leading axis)."""
    logits = logits_BxxV.astype(jnp.float32)
    col = lambda x: x.reshape(x.shape + (1,) * (logits.ndim - 1))  # noqa: E731
    greedy = col(s.temperature) == 0
    logits = logits / jnp.where(greedy, 1.0, col(s.temperature))
    onehot = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)

    def top_k(lg):
        return jnp.where((col(s.top_k) > 0) & ~_top_k_mask(lg, col(s.top_k)), -jnp.inf, lg)

    logits = jax.lax.cond((s.top_k > 0).any(), top_k, lambda lg: lg, logits)
    probs = jax.nn.softmax(logits, axis=-1)

    def top_p(pr):
        kept = jnp.where(_top_p_mask(pr, col(s.top_p)), pr, 0.0)
        return jnp.where(col(s.top_p) >= 1, pr, kept / kept.sum(-1, keepdims=True))  # a row's own parameters only

    probs = jax.lax.cond((s.top_p < 1).any(), top_p, lambda pr: pr, probs)
    return jnp.where(greedy, onehot, probs)


def _ordered(x):
    """float32 -> uint32 keys in the same order as the values (-inf first; -0.0 is 0.0)."""
    x = x.astype(jnp.float32)
    b = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(1 << 31))


def _least_key(u, ok):
    """The least ``x`` in ``[min(u), max(u)]`` (each row of the last axis) with ``ok(x)``,
    for an ``ok`` false below some key and true from it on, and true at ``max(u)``: a
    bisection over the 32-bit keys, ``ok`` a few fused reductions over the row per step
    (a sort of every row costs far more on XLA:CPU; the result is the same)."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        good = ok(mid)
        return jnp.where(good, lo, mid + 1), jnp.where(good, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (u.min(-1, keepdims=True), u.max(-1, keepdims=True)))[1]


def _top_k_mask(logits, k):
    """Which logits are among each row's ``k`` largest (``k`` broadcasts against the rows;
    ties with the k-th largest are kept)."""
    u = _ordered(logits)
    return u >= _least_key(u, lambda t: (u > t).sum(-1, keepdims=True) < k)


def _top_p_mask(probs, top_p):
    """The nucleus of each row: the tokens whose strictly more likely tokens hold less than
    ``top_p`` of the mass (the fewest most likely tokens that reach it, ties kept)."""
    u = _ordered(probs)
    return u >= _least_key(u, lambda t: jnp.where(u > t, probs, 0.0).sum(-1, keepdims=True) < top_p)


def target_probs(logits_xV, s: SamplingConfig | RowSampling):
    """The distribution sampling draws from: temperature, then top-k, then top-p."""
    if isinstance(s, RowSampling):
        return _row_probs(logits_xV, s)
    logits = logits_xV.astype(jnp.float32) / s.temperature
    if s.top_k:
        logits = jnp.where(_top_k_mask(logits, s.top_k), logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if s.top_p < 1:
        probs = jnp.where(_top_p_mask(probs, s.top_p), probs, 0.0)
        probs = probs / probs.sum(-1, keepdims=True)
    return probs


def row_keys(key, batch: int):
    """One key per row: ``key`` itself when it already holds ``batch`` keys, else split."""
    return key if key.shape == (batch,) else jax.random.split(key, batch)


def _all_greedy(s: RowSampling):
    return (s.temperature == 0).all()


_GREEDY = SamplingConfig()


def sample(key, logits_BxV, s: SamplingConfig | RowSampling):
    """One token per row: argmax when greedy, else a draw from :func:`target_probs`
    (``key``: one key, or one per row).  Per-row parameters that are all greedy take the
    greedy path at run time (the same tokens: a greedy row draws from its argmax's one-hot)."""
    if s.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    if isinstance(s, RowSampling):
        return jax.lax.cond(_all_greedy(s), lambda: sample(key, logits_BxV, _GREEDY), lambda: _draw(key, logits_BxV, s))
    return _draw(key, logits_BxV, s)


def _draw(key, logits_BxV, s: SamplingConfig | RowSampling):
    keys = row_keys(key, logits_BxV.shape[0])
    probs = target_probs(logits_BxV, s)
    return jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, probs).astype(jnp.int32)


def verify(tree: Tree, logits_BxNxV, key, s: SamplingConfig | RowSampling, max_children: int, force_B=None):
    """Walks the tree against the target's logits at every node.

    ``key``: one key, or one per row (a row's draws then depend on its own key only).
    Returns ``(path_BxP, accepted_B, bonus_B)``: the accepted node ids root first
    (``-1`` padded), the number of accepted draft tokens, and the bonus token drawn at
    the last accepted node.  Where ``force_B`` is true every child is accepted (its first
    child at each level: a forced chain, see ``tree.forced_chain``); the bonus is still
    drawn from the target at the chain's end.  Per-row parameters that are all greedy take
    the greedy walk at run time (the same result: see :class:`RowSampling`), so a batch of
    greedy requests in the slot engine pays for no draws.
    """
    if isinstance(s, RowSampling):
        return jax.lax.cond(_all_greedy(s), lambda: _verify(tree, logits_BxNxV, key, _GREEDY, max_children, force_B),
                            lambda: _verify(tree, logits_BxNxV, key, s, max_children, force_B))
    return _verify(tree, logits_BxNxV, key, s, max_children, force_B)


def _verify(tree: Tree, logits_BxNxV, key, s: SamplingConfig | RowSampling, max_children: int, force_B=None):
    B, N = tree.tokens.shape
    P = tree.paths.shape[-1]
    children = jax.vmap(children_table, in_axes=(0, None))(tree.parents, max_children)  # [B, N, K]
    child_tok = jnp.take_along_axis(tree.tokens[:, None, :], jnp.maximum(children, 0).reshape(B, 1, -1), 2).reshape(children.shape)
    if s.greedy:
        best = jnp.argmax(logits_BxNxV, axis=-1)  # [B, N]
        p_child = (child_tok == best[..., None]).astype(jnp.float32)
        u = jnp.zeros((B, P, max_children))
    else:
        probs = target_probs(logits_BxNxV, s)
        p_child = jnp.take_along_axis(probs, child_tok, axis=2)
        keys = jax.vmap(jax.random.split)(row_keys(key, B))  # [B, 2]: the walk's, the bonus's
        u = jax.vmap(lambda k: jax.random.uniform(k, (P, max_children)))(keys[:, 0])
    if force_B is not None:
        p_child = jnp.where(force_B[:, None, None], 1.0, p_child)
    path, accepted, last = jax.vmap(_walk)(children, p_child, u)

    last_children = jnp.take_along_axis(children, last[:, None, None], 1)[:, 0]  # [B, K]
    if s.greedy:
        bonus = jnp.take_along_axis(best, last[:, None], 1)[:, 0]
    else:
        p_last = jnp.take_along_axis(probs, last[:, None, None], 1)[:, 0]  # [B, V]
        rejected = jnp.take_along_axis(tree.tokens, jnp.maximum(last_children, 0), 1)
        keep = (last_children < 0).astype(p_last.dtype)  # a rejected child's token loses its mass
        residual = jax.vmap(lambda p, ids, f: p.at[ids].multiply(f))(p_last, rejected, keep)  # row-local on a mesh
        residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_last)  # measure-zero guard
        bonus = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys[:, 1], residual)
    return path, accepted, bonus.astype(jnp.int32)


def _accepts(u, remaining, p):
    """Accept with probability ``p / remaining`` (p renormalised over unrejected tokens)."""
    return u * remaining < p


def _walk(children_NxK, p_child_NxK, u_PxK):
    P, K = u_PxK.shape

    def level(carry, u_K):
        node, accepted, stopped, path = carry
        ch, pc = children_NxK[node], p_child_NxK[node]

        def try_child(c, j):
            taken, remaining = c
            valid = (ch[j] >= 0) & (taken < 0)
            take = valid & _accepts(u_K[j], remaining, pc[j])
            return (jnp.where(take, ch[j], taken), jnp.where(valid & ~take, remaining - pc[j], remaining)), None

        (taken, _), _ = jax.lax.scan(try_child, (jnp.int32(-1), jnp.float32(1.0)), jnp.arange(K))
        move = ~stopped & (taken >= 0)
        path = path.at[accepted + 1].set(jnp.where(move, taken, path[accepted + 1]))
        return (jnp.where(move, taken, node), accepted + move, stopped | ~move, path), None

    path0 = jnp.full((P,), -1, jnp.int32).at[0].set(0)
    (last, accepted, _, path), _ = jax.lax.scan(level, (jnp.int32(0), jnp.int32(0), False, path0), u_PxK[: P - 1])
    return path, accepted, last
