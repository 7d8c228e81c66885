"""A ``generate`` call's arguments normalised and validated (``TypeError`` / ``ValueError``
naming the argument) into a ``Request``: padded prompts, per-row budgets and the
``LoopStatics`` its compiled loop is keyed on; the argument checks the slot engine shares."""

from __future__ import annotations

import collections.abc
import dataclasses

import jax
import numpy as np

from eagle3_jax import budget, kv_cache, limits, sharding
from eagle3_jax.config import integer
from eagle3_jax.decode._loop import phase_rows
from eagle3_jax.decode._state import LoopStatics
from eagle3_jax.models.target import check_token_ids
from eagle3_jax.speculation import Speculation
from eagle3_jax.tree import TreeConfig
from eagle3_jax.verify import SamplingConfig


def encode_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True)
    return list(out["input_ids"])


def bucket(n: int, base: int = 32) -> int:
    """Rounds prompt lengths up so that varied prompts share one compilation."""
    return max(base, -(-n // base) * base)


def is_int(x) -> bool:
    return integer(x) is not None


def prompt_rows(prompts, vocab_size: int, tokenizer=None, *, row_name: str | None = None) -> list[np.ndarray]:
    """One int64 array per prompt, from the containers ``generate`` accepts (see there);
    ``TypeError`` / ``ValueError`` naming ``prompts[i]`` (or ``row_name``) otherwise."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim not in (1, 2):
            raise ValueError(f"prompts: an array must be 1-D (one prompt) or 2-D (one row per prompt), got shape {arr.shape}")
        prompts = [arr] if arr.ndim == 1 else list(arr)
    elif isinstance(prompts, (list, tuple)):
        if prompts and all(is_int(p) for p in prompts):
            prompts = [prompts]  # one prompt given as a flat list of ids
    else:
        raise TypeError(f"prompts must be a list of token-id sequences, a 2-D array or strings, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts: need at least one prompt")
    rows = []
    for i, p in enumerate(prompts):
        label = row_name or f"prompts[{i}]"
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"{label} is a string: pass tokenizer= to encode it")
            p = tokenizer.encode(p)
        if isinstance(p, (np.ndarray, jax.Array)):
            arr = np.asarray(p)
            if arr.ndim != 1:
                raise ValueError(f"{label}: expected a 1-D sequence of token ids, got shape {arr.shape}")
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"{label}: token ids must be integers, got dtype {arr.dtype}")
        elif isinstance(p, (list, tuple)):
            bad = next((x for x in p if not is_int(x)), None)
            if bad is not None:
                raise TypeError(f"{label}: token ids must be integers, got {type(bad).__name__} {bad!r}")
            arr = np.asarray(p, np.int64)
        else:
            raise TypeError(f"{label}: expected a sequence of token ids, got {type(p).__name__}")
        if arr.size == 0:
            raise ValueError(f"{label} is empty")
        check_token_ids(arr, vocab_size, label)
        rows.append(arr.astype(np.int64))
    return rows


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated ``generate`` call: padded prompts and everything the compiled loop is keyed on."""

    prompt_BxT: np.ndarray
    lengths_B: np.ndarray
    statics: LoopStatics
    seed: int
    budget_B: np.ndarray  # thinking-content tokens allowed per sequence, -1 = unlimited
    phase_B: np.ndarray  # the thinking phase after each prompt
    round_ms: np.ndarray | None  # per speculation tier (None: measured when the policy adapts)
    rows: int  # the caller's prompts (the first rows; the rest pad the batch to the mesh)
    mesh: jax.sharding.Mesh | None = None
    rules: tuple | None = None

    @property
    def spec(self) -> Speculation | None:
        return self.statics.spec

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.statics.stop_ids

    @property
    def thinking(self) -> budget.ThinkingConfig | None:
        return self.statics.thinking


def thinking_config(tokenizer, think_token_ids, end_thinking_ids, mode, grace, vocab: int):
    """The static thinking setup from explicit ids or the tokenizer's ``<think>``/``</think>``,
    or ``None`` when neither names them."""
    mode = budget.check_mode(mode)  # with or without a thinking phase
    grace = limits.check("thinking_grace", grace, limits.THINKING_GRACE)
    if think_token_ids is None and tokenizer is not None:
        ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")]
        unk = getattr(tokenizer, "unk_token_id", None)
        if all(is_int(i) and i != unk for i in ids):
            think_token_ids = tuple(ids)
    if think_token_ids is None:
        if end_thinking_ids is not None:
            raise ValueError("end_thinking_ids needs the think-open/close tokens: pass think_token_ids=(open, close) "
                             "or a tokenizer with <think> and </think>")
        return None
    if not is_sequence(think_token_ids) or len(think_token_ids) != 2:
        raise TypeError(f"think_token_ids must be (open_id, close_id), got {think_token_ids!r}")
    token_id = limits.TOKEN_ID.below(vocab)
    open_id, close_id = (limits.check(f"think_token_ids[{i}]", x, token_id) for i, x in enumerate(think_token_ids))
    if end_thinking_ids is None:
        newline = tokenizer.encode("\n", add_special_tokens=False) if tokenizer is not None else []
        end_thinking_ids = (*newline, close_id) if len(newline) == 1 else (close_id,)
    elif not is_sequence(end_thinking_ids) or not len(end_thinking_ids):
        raise TypeError(f"end_thinking_ids must be a non-empty sequence of token ids, got {end_thinking_ids!r}")
    end = tuple(limits.check(f"end_thinking_ids[{i}]", x, token_id) for i, x in enumerate(end_thinking_ids))
    return budget.ThinkingConfig(open_id, close_id, end, mode, grace if mode == "soft" else 0)


def is_sequence(x) -> bool:
    """An ordered run of values (list, tuple, 1-D array): not a string, nor a dict or a set,
    whose order is not the caller's (a dict would be read as its keys), nor a 0-d array."""
    return (hasattr(x, "__len__") and getattr(x, "ndim", 1) > 0
            and not isinstance(x, (str, bytes, collections.abc.Mapping, collections.abc.Set)))


def budget_rows(thinking_budget, n: int) -> np.ndarray:
    if thinking_budget is None or is_int(thinking_budget):
        values = [thinking_budget] * n
    elif not is_sequence(thinking_budget):
        raise TypeError(f"thinking_budget must be None, an int or one value per prompt (a list, tuple or array), "
                        f"got {type(thinking_budget).__name__} {thinking_budget!r}")
    else:
        values = list(thinking_budget)
        if len(values) != n:
            raise ValueError(f"thinking_budget: {len(values)} values for {n} prompts")
    return np.array([-1 if v is None else limits.check(f"thinking_budget[{i}]", v, limits.THINKING_BUDGET)
                     for i, v in enumerate(values)], np.int32)


def sampling_args(temperature, top_p, top_k, vocab: int) -> SamplingConfig:
    temperature = limits.check("temperature", temperature, limits.TEMPERATURE)
    if 0 < temperature < limits.MIN_TEMPERATURE:
        raise ValueError(f"temperature={temperature!r}: must be 0 (greedy) or >= {limits.MIN_TEMPERATURE}")
    return SamplingConfig(temperature, limits.check("top_p", top_p, limits.TOP_P),
                          limits.check("top_k", top_k, limits.TOP_K.below(vocab + 1)))


def stop_args(stop_token_ids, vocab: int) -> list[int]:
    if stop_token_ids is None:
        return []
    if is_int(stop_token_ids) or isinstance(stop_token_ids, (str, bytes)):
        raise TypeError(f"stop_token_ids must be a sequence of token ids, got {type(stop_token_ids).__name__} {stop_token_ids!r}")
    return [limits.check(f"stop_token_ids[{i}]", s, limits.TOKEN_ID.below(vocab)) for i, s in enumerate(stop_token_ids)]


def speculation_arg(target, drafter, speculation) -> Speculation:
    """``speculation`` as a ``Speculation`` (a ``TreeConfig`` is one fixed tier), checked against the pair."""
    if isinstance(speculation, TreeConfig):
        speculation = Speculation.fixed(speculation)
    elif not isinstance(speculation, Speculation):
        raise TypeError(f"speculation must be a TreeConfig or a Speculation, got {type(speculation).__name__}")
    if drafter is not None:
        if (drafter.config.vocab_size != target.config.vocab_size
                or drafter.config.target_hidden_size != target.config.hidden_size):
            raise ValueError("drafter and target do not match (vocab size or hidden size); load the drafter with target=")
        if speculation.max_top_k > drafter.config.draft_vocab_size:
            raise ValueError(f"tree.top_k={speculation.max_top_k} exceeds the draft vocabulary "
                             f"({drafter.config.draft_vocab_size})")
    return speculation


def prepare(target, drafter, prompts, *, max_new_tokens, temperature, top_p, top_k, tree, seed, stop_token_ids,
            tokenizer, thinking_budget=None, thinking_mode="hard", thinking_grace=0, think_token_ids=None,
            end_thinking_ids=None, speculation=None, round_ms=None, mesh=None, rules=None, phases=True) -> Request:
    vocab = target.config.vocab_size
    max_new_tokens = limits.check("max_new_tokens", max_new_tokens, limits.MAX_NEW_TOKENS)
    sampling = sampling_args(temperature, top_p, top_k, vocab)
    seed = limits.check("seed", seed, limits.SEED)
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig (e.g. TreeConfig(60, 7, 10) or TreeConfig.chain(4)), got {type(tree).__name__}")
    stops = stop_args(stop_token_ids, vocab)
    seqs = prompt_rows(prompts, vocab, tokenizer)
    speculation = speculation_arg(target, drafter, Speculation.fixed(tree) if speculation is None else speculation)
    if round_ms is not None:
        given = round_ms
        try:
            round_ms = np.asarray(round_ms, np.float64)
        except (TypeError, ValueError):
            round_ms = None
        if round_ms is None or round_ms.shape != (len(speculation.tiers),) or not np.isfinite(round_ms).all() \
                or (round_ms <= 0).any():
            raise ValueError(f"round_ms: need one positive time per tier ({len(speculation.tiers)}), got {given!r}")
    rows = len(seqs)
    if mesh is not None:  # pad the batch to a multiple of the devices it is split over
        mesh = sharding.auto_mesh(mesh)
        seqs = seqs + [seqs[0]] * (-len(seqs) % sharding.batch_shards(mesh, rules))
    longest = max(s.size for s in seqs)
    T = bucket(longest)
    scratch = 1 if drafter is None else speculation.scratch
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
    thinking = thinking_config(tokenizer, think_token_ids, end_thinking_ids, thinking_mode, thinking_grace, vocab)
    budgets = budget_rows(thinking_budget, rows)
    budgets = np.concatenate([budgets, np.full((len(seqs) - rows,), budgets[0], np.int32)])
    if thinking is None and (budgets >= 0).any():
        raise ValueError("thinking_budget needs the think-open/close tokens: pass think_token_ids=(open, close) or a "
                         "tokenizer with <think> and </think>")
    phase = np.array([budget.initial_phase(s, thinking) if thinking else budget.BEFORE for s in seqs], np.int32)
    cache_shardings = cache_layouts(target, drafter, len(seqs), max_len, mesh, rules)
    statics = LoopStatics(max_len=max_len, max_new=max_new_tokens, stop_ids=stop_ids, sampling=sampling,
                          spec=speculation if drafter is not None else None, thinking=thinking,
                          cache_shardings=cache_shardings,
                          phases=phase_rows(len(seqs), max_new_tokens, kv_cache.row_shards(cache_shardings[0]))
                          if phases else (len(seqs),),
                          hidden_sharding=None if mesh is None or drafter is None else sharding.hidden_sharding(
                              mesh, len(seqs), drafter.config.hidden_size, rules, name="drafter hidden states"))
    return Request(prompt, lengths, statics, seed, budgets, phase, round_ms, rows, mesh,
                   None if rules is None else tuple(rules.items()))


def cache_layouts(target, drafter, batch: int, max_len: int, mesh, rules) -> tuple:
    """The target's and the drafter's cache layouts on ``mesh`` (by ``kv_cache.CACHE_AXES``)."""
    if mesh is None:
        return (None, None)
    out = []
    for name, model, layers_ in (("target", target, target.config.num_layers), ("drafter", drafter, None if drafter is None else drafter.config.num_layers)):
        if model is None:
            out.append(None)
            continue
        shape = (layers_, batch, max_len, model.config.num_kv_heads, model.config.head_dim)
        out.append(kv_cache.layout(shape, mesh, rules, name=f"{name} KV cache"))
    return tuple(out)
