"""The jitted decode loop: prefill, then draft → verify → commit rounds inside one
``lax.while_loop`` (no host round-trip per round), for any batch size.

``drafter=None`` runs vanilla autoregressive decoding through the same loop and the
same stop logic; it is the baseline of every speedup figure.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import kv_cache
from eagle3_jax.models.target import check_token_ids
from eagle3_jax.tree import TreeConfig, expand
from eagle3_jax.verify import SamplingConfig, sample, verify


@dataclasses.dataclass
class GenerateResult:
    """Generated tokens per sequence (stop token included, prompt excluded) and stats.

    ``stats``: ``rounds`` (per sequence), ``accept_lengths`` (accepted draft tokens per
    round, per sequence), ``tau`` (mean over rounds of accepted + 1), ``acceptance_rate``
    (per draft position i: P(position i accepted | positions < i accepted)),
    ``proposed`` / ``accepted`` / ``committed`` token counts, ``new_tokens``,
    ``seconds`` and ``tokens_per_second`` (wall clock, compilation excluded).
    """

    tokens: list[list[int]]
    stats: dict
    texts: list[str] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _State:
    tcache: kv_cache.KVCache
    dcache: kv_cache.KVCache | None
    root: jax.Array  # [B] next token to feed (emitted, not yet in the target cache)
    last_hidden: jax.Array | None  # [B, H] drafter output at the last committed position
    out: jax.Array  # [B, max_new]
    n_out: jax.Array  # [B]
    done: jax.Array  # [B]
    accept: jax.Array  # [B, max_rounds] accepted draft tokens per round (-1 = no round)
    step: jax.Array  # scalar round counter
    key: jax.Array


def _emit(st: _State, new_BxP, count_B, stop_ids, max_new: int) -> _State:
    """Appends ``new[:, :count]`` to the output, truncating at a stop token or max_new."""
    P = new_BxP.shape[1]
    j = jnp.arange(P)[None]
    is_stop = jnp.isin(new_BxP, stop_ids) & (j < count_B[:, None])
    has_stop = is_stop.any(1)
    first_stop = jnp.where(has_stop, jnp.argmax(is_stop, 1) + 1, P)
    n = jnp.minimum(jnp.minimum(count_B, first_stop), max_new - st.n_out)
    n = jnp.where(st.done, 0, n)
    slots = jnp.where(j < n[:, None], st.n_out[:, None] + j, max_new)  # max_new = dropped
    out = st.out.at[jnp.arange(new_BxP.shape[0])[:, None], slots].set(new_BxP, mode="drop")
    n_out = st.n_out + n
    done = st.done | (has_stop & (first_stop <= n)) | (n_out >= max_new)
    return dataclasses.replace(st, out=out, n_out=n_out, done=done)


def _prefill(target, drafter, prompt_BxT, lengths_B, key, *, max_len: int, max_new: int, stops, sampling) -> _State:
    """Runs the prompts through the target (and the drafter) and emits the first token."""
    B, T = prompt_BxT.shape
    bidx = jnp.arange(B)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, feats, tcache = target(prompt_BxT, pos, cache=target.init_cache(B, max_len))
    tcache = kv_cache.advance(tcache, lengths_B)
    key, sub = jax.random.split(key)
    first = sample(sub, logits[bidx, lengths_B - 1], sampling)
    dcache = last_hidden = None
    if drafter is not None:
        # drafter position j pairs the feature at j with token j+1 (the first token is the root)
        ids = jnp.where(jnp.arange(T)[None] == lengths_B[:, None] - 1, first[:, None], jnp.roll(prompt_BxT, -1, 1))
        dout, dcache = drafter(feats, ids, pos, cache=drafter.init_cache(B, max_len))
        dcache = kv_cache.advance(dcache, lengths_B)
        last_hidden = dout[bidx, lengths_B - 1]
    st = _State(tcache, dcache, first, last_hidden, jnp.zeros((B, max_new), jnp.int32), jnp.zeros((B,), jnp.int32),
                jnp.zeros((B,), bool), jnp.full((B, max_new), -1, jnp.int32), jnp.int32(0), key)  # ≤ one round per token
    return _emit(st, first[:, None], jnp.ones((B,), jnp.int32), stops, max_new)


def _stop_array(stop_ids: tuple[int, ...]):
    return jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)


def _run(tgraph, tstate, dgraph, dstate, prompt_BxT, lengths_B, key, *, max_len: int, max_new: int,
         stop_ids: tuple[int, ...], sampling: SamplingConfig, tree: TreeConfig | None):
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    stops = _stop_array(stop_ids)
    bidx = jnp.arange(prompt_BxT.shape[0])
    max_rounds = max_new
    with jax.named_scope("prefill"):
        st = _prefill(target, drafter, prompt_BxT, lengths_B, key, max_len=max_len, max_new=max_new, stops=stops,
                      sampling=sampling)

    def vanilla_round(st: _State) -> _State:
        with jax.named_scope("step"):
            logits, _, tcache = target(st.root[:, None], st.tcache.lengths[:, None], cache=st.tcache)
            key, sub = jax.random.split(st.key)
            nxt = sample(sub, logits[:, 0], sampling)
        with jax.named_scope("emit"):
            active = ~st.done
            st = dataclasses.replace(st, tcache=kv_cache.advance(tcache, active.astype(jnp.int32)),
                                     root=jnp.where(active, nxt, st.root), key=key,
                                     accept=st.accept.at[:, st.step].set(jnp.where(active, 0, -1)))
            return _emit(st, nxt[:, None], active.astype(jnp.int32), stops, max_new)

    def spec_round(st: _State) -> _State:
        with jax.named_scope("draft"):
            t = expand(drafter, st.dcache, st.last_hidden, st.root, tree)
        with jax.named_scope("verify"):
            logits, feats, tcache = target(t.tokens, st.tcache.lengths[:, None] + t.depth, cache=st.tcache,
                                           region_mask_BxTxR=t.mask)
            key, sub = jax.random.split(st.key)
            path, accepted, bonus = verify(t, logits, sub, sampling, tree.top_k)
        active = ~st.done
        count = jnp.where(active, accepted + 1, 0)
        node = jnp.maximum(path, 0)
        with jax.named_scope("commit"):
            tcache = kv_cache.commit(tcache, node, count)
        with jax.named_scope("catch_up"):
            # token following each committed node: the next accepted draft token, then the bonus
            nxt_node = jnp.concatenate([node[:, 1:], node[:, :1]], 1)
            new = jnp.where(jnp.arange(node.shape[1])[None] < accepted[:, None],
                            jnp.take_along_axis(t.tokens, nxt_node, 1), bonus[:, None])
            # the drafter consumes the committed nodes' target features (from the tree pass)
            dfeats = jnp.take_along_axis(feats, node[..., None], 1)
            dpos = st.dcache.lengths[:, None] + jnp.arange(node.shape[1])[None]
            dout, dcache = drafter(dfeats, new, dpos, cache=st.dcache)
        with jax.named_scope("emit"):
            st2 = dataclasses.replace(
                st, tcache=tcache, dcache=kv_cache.advance(dcache, count), key=key,
                root=jnp.where(active, bonus, st.root),
                last_hidden=jnp.where(active[:, None], dout[bidx, accepted], st.last_hidden),
                accept=st.accept.at[:, st.step].set(jnp.where(active, accepted, -1)))
            return _emit(st2, new, count, stops, max_new)

    body = vanilla_round if drafter is None else spec_round

    def step(st):
        return dataclasses.replace(body(st), step=st.step + 1)

    st = jax.lax.while_loop(lambda s: (~s.done).any() & (s.step < max_rounds), step, st)
    return st.out, st.n_out, st.accept


_run_jit = jax.jit(_run, static_argnums=(0, 2), static_argnames=("max_len", "max_new", "stop_ids", "sampling", "tree"))


# Compiled loops, least recently used first.  Each holds its executable (and its
# constants) in memory, so the number kept is bounded.
COMPILE_CACHE_SIZE = 16
_COMPILED: collections.OrderedDict = collections.OrderedDict()


def _compiled(tgraph, dgraph, prompt_shape, kw: tuple, tstate, dstate):
    """Compiles the loop once per (models, batch, prompt bucket, limits, tree, sampling);
    keeps the ``COMPILE_CACHE_SIZE`` most recently used programs."""
    cache_key = (tgraph, dgraph, prompt_shape, kw)
    if cache_key in _COMPILED:
        _COMPILED.move_to_end(cache_key)
    else:
        spec = jax.ShapeDtypeStruct
        _COMPILED[cache_key] = _run_jit.lower(
            tgraph, tstate, dgraph, dstate, spec(prompt_shape, jnp.int32), spec(prompt_shape[:1], jnp.int32),
            jax.random.key(0), **dict(kw)).compile()
        while len(_COMPILED) > COMPILE_CACHE_SIZE:
            _COMPILED.popitem(last=False)
    return _COMPILED[cache_key]


def encode_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True)
    return list(out["input_ids"])


def _bucket(n: int, base: int = 32) -> int:
    """Rounds prompt lengths up so that varied prompts share one compilation."""
    return max(base, -(-n // base) * base)


# Below this, temperature sampling is numerically a greedy argmax with extra steps (and
# logits / temperature overflow float32 near 1e-38): pass 0 for greedy decoding.
MIN_TEMPERATURE = 1e-3


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value >= hi):
        raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}), got {value}")
    return int(value)


def _float_arg(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def prompt_rows(prompts, vocab_size: int, tokenizer=None) -> list[np.ndarray]:
    """One int64 array per prompt, from the containers ``generate`` accepts (see there);
    ``TypeError`` / ``ValueError`` naming ``prompts[i]`` otherwise."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim not in (1, 2):
            raise ValueError(f"prompts: an array must be 1-D (one prompt) or 2-D (one row per prompt), got shape {arr.shape}")
        prompts = [arr] if arr.ndim == 1 else list(arr)
    elif isinstance(prompts, (list, tuple)):
        if prompts and all(_is_int(p) for p in prompts):
            prompts = [prompts]  # one prompt given as a flat list of ids
    else:
        raise TypeError(f"prompts must be a list of token-id sequences, a 2-D array or strings, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts: need at least one prompt")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string: pass tokenizer= to encode it")
            p = tokenizer.encode(p)
        if isinstance(p, (np.ndarray, jax.Array)):
            arr = np.asarray(p)
            if arr.ndim != 1:
                raise ValueError(f"prompts[{i}]: expected a 1-D sequence of token ids, got shape {arr.shape}")
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"prompts[{i}]: token ids must be integers, got dtype {arr.dtype}")
        elif isinstance(p, (list, tuple)):
            bad = next((x for x in p if not _is_int(x)), None)
            if bad is not None:
                raise TypeError(f"prompts[{i}]: token ids must be integers, got {type(bad).__name__} {bad!r}")
            arr = np.asarray(p, np.int64)
        else:
            raise TypeError(f"prompts[{i}]: expected a sequence of token ids, got {type(p).__name__}")
        if arr.size == 0:
            raise ValueError(f"prompts[{i}] is empty")
        check_token_ids(arr, vocab_size, f"prompts[{i}]")
        rows.append(arr.astype(np.int64))
    return rows


@dataclasses.dataclass(frozen=True)
class _Request:
    """A validated ``generate`` call: padded prompts and everything the compiled loop is keyed on."""

    prompt_BxT: np.ndarray
    lengths_B: np.ndarray
    kw: tuple
    seed: int


def _prepare(target, drafter, prompts, *, max_new_tokens, temperature, top_p, top_k, tree, seed, stop_token_ids,
             tokenizer) -> _Request:
    vocab = target.config.vocab_size
    max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 1)
    temperature = _float_arg("temperature", temperature)
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}")
    top_p = _float_arg("top_p", top_p)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    top_k = _int_arg("top_k", top_k, 0, vocab + 1)
    seed = _int_arg("seed", seed, 0, 2 ** 32)
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig (e.g. TreeConfig(60, 7, 10) or TreeConfig.chain(4)), got {type(tree).__name__}")
    if stop_token_ids is None:
        stop_token_ids = ()
    elif _is_int(stop_token_ids) or isinstance(stop_token_ids, (str, bytes)):
        raise TypeError(f"stop_token_ids must be a sequence of token ids, got {type(stop_token_ids).__name__} {stop_token_ids!r}")
    stops = [_int_arg(f"stop_token_ids[{i}]", s, 0, vocab) for i, s in enumerate(stop_token_ids)]
    seqs = prompt_rows(prompts, vocab, tokenizer)
    if drafter is not None:
        if drafter.config.vocab_size != vocab or drafter.config.target_hidden_size != target.config.hidden_size:
            raise ValueError("drafter and target do not match (vocab size or hidden size); load the drafter with target=")
        if tree.top_k > drafter.config.draft_vocab_size:
            raise ValueError(f"tree.top_k={tree.top_k} exceeds the draft vocabulary ({drafter.config.draft_vocab_size})")
    longest = max(s.size for s in seqs)
    T = _bucket(longest)
    scratch = 1 if drafter is None else tree.scratch
    max_len = T + max_new_tokens + scratch
    if max_len > target.config.max_position_embeddings:
        raise ValueError(f"prompts + max_new_tokens: the longest prompt ({longest} tokens, padded to a bucket of {T}) + "
                         f"max_new_tokens ({max_new_tokens}) + {scratch} scratch slot(s) for a round = {max_len} exceeds "
                         f"the target's max_position_embeddings ({target.config.max_position_embeddings})")
    prompt = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        prompt[i, : s.size] = s
    lengths = np.array([s.size for s in seqs], np.int32)
    stop_ids = tuple(sorted(set(target.config.eos_token_ids) | set(stops)))
    kw = dict(max_len=max_len, max_new=max_new_tokens, stop_ids=stop_ids,
              sampling=SamplingConfig(temperature, top_p, top_k), tree=tree if drafter is not None else None)
    return _Request(prompt, lengths, tuple(kw.items()), seed)


def compile_generate(target, drafter, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                     top_k: int = 0, tree: TreeConfig = TreeConfig(), seed: int = 0,
                     stop_token_ids: Sequence[int] | None = None, tokenizer=None):
    """The compiled decode loop ``generate`` would run for these arguments, and its inputs:
    ``(compiled, args)`` with ``compiled(*args) -> (out_BxN, n_out_B, accept_BxR)``.  For
    inspecting the program (``compiled.as_text()``, ``eagle3_jax.cost``)."""
    req = _prepare(target, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                   top_k=top_k, tree=tree, seed=seed, stop_token_ids=stop_token_ids, tokenizer=tokenizer)
    tgraph, tstate = nnx.split(target)
    dgraph, dstate = nnx.split(drafter) if drafter is not None else (None, None)
    compiled = _compiled(tgraph, dgraph, req.prompt_BxT.shape, req.kw, tstate, dstate)
    return compiled, (tstate, dstate, jnp.asarray(req.prompt_BxT), jnp.asarray(req.lengths_B), jax.random.key(req.seed))


def generate(target, drafter, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, tree: TreeConfig = TreeConfig(), seed: int = 0,
             stop_token_ids: Sequence[int] | None = None, tokenizer=None) -> GenerateResult:
    """Generates with EAGLE-3 speculative decoding (or vanilla decoding if ``drafter`` is None).

    Greedy output is token-identical to the target's own greedy decoding; with
    ``temperature > 0`` every token is distributed exactly as sampling the target
    (after top-k / top-p).  Stops at ``max_new_tokens``, the target's EOS ids and
    ``stop_token_ids``, counting committed tokens only.

    Args:
      prompts: one prompt (a list/tuple of token ids, a 1-D numpy or jax array, or a string
        with ``tokenizer``), a list of such prompts, or a 2-D integer array (one row per prompt).
      max_new_tokens: the most tokens generated per prompt (>= 1).
      temperature: 0 for greedy, else >= ``MIN_TEMPERATURE``; ``top_p`` in (0, 1], ``top_k``
        >= 0 (0 = off).
      tree: the draft tree budget (``TreeConfig``); ignored without a drafter.
      seed: the sampling seed, in [0, 2**32).
      stop_token_ids: token ids that end a sequence, besides the target's EOS ids.

    Raises ``TypeError`` / ``ValueError`` naming the argument for malformed input.
    """
    compiled, args = compile_generate(target, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, top_k=top_k, tree=tree, seed=seed, stop_token_ids=stop_token_ids,
                                      tokenizer=tokenizer)
    start = time.perf_counter()
    out, n_out, accept = jax.block_until_ready(compiled(*args))
    seconds = time.perf_counter() - start
    out, n_out, accept = np.asarray(out), np.asarray(n_out), np.asarray(accept)
    tokens = [out[b, : n_out[b]].tolist() for b in range(out.shape[0])]
    stats = _stats(accept, n_out, seconds, None if drafter is None else tree)
    texts = [tokenizer.decode(t) for t in tokens] if tokenizer is not None else None
    return GenerateResult(tokens, stats, texts)


def acceptance(accept_lengths, positions: int) -> tuple[float, list[float]]:
    """``(τ, rate per draft position)`` from accepted-draft counts per round: τ = mean of
    accepted + 1; rate[i-1] = P(position i accepted | positions < i accepted)."""
    flat = np.asarray(accept_lengths, np.int64).reshape(-1)
    rate = [float((flat >= i).sum() / max((flat >= i - 1).sum(), 1)) for i in range(1, positions + 1)]
    return (float((flat + 1).mean()) if flat.size else 0.0), rate


def _stats(accept_BxR, n_out_B, seconds: float, tree: TreeConfig | None) -> dict:
    rounds = (accept_BxR >= 0).sum(1)
    acc = [row[row >= 0].tolist() for row in accept_BxR]
    tau, rate = acceptance([a for row in acc for a in row], 0 if tree is None else tree.path_len - 1)
    new_tokens = int(n_out_B.sum())
    return {
        "rounds": rounds.tolist(),
        "accept_lengths": acc,
        "tau": tau,
        "acceptance_rate": rate,
        "proposed": int(rounds.sum() * (tree.total_tokens - 1)) if tree is not None else 0,
        "accepted": int(sum(map(sum, acc))),
        "committed": new_tokens,
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else float("inf"),
    }
