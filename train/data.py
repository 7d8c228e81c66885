"""Training data: ShareGPT-style conversations → chat template → ``input_ids`` +
``loss_mask`` (assistant tokens only), regeneration of the assistant turns by the target,
the draft-vocabulary step, and the grain pipeline.

Records are stored as one ``.npz`` per stage: ``input_ids [n, seq_len] int32``,
``loss_mask [n, seq_len] bool``, ``lengths [n]``.  A step run by several processes (e.g.
regeneration on a pod) splits its items in contiguous blocks (:func:`shard_range`), each
process writes its own shard (:func:`shard_path`) and one process joins them
(:func:`merge_shards`) in process order, so the result is what one process would write.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import grain
import numpy as np
from tqdm.auto import tqdm

from eagle3_jax.atomic import write_atomic
from eagle3_jax.decode import encode_chat, generate

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "system": "system"}


def load_conversations(path: str | Path) -> list[list[dict]]:
    """Reads ShareGPT JSON (a list) / JSONL (one record a line): each record is
    ``{"conversations": [{from, value}]}``, ``{"messages": [{role, content}]}`` or a bare
    list of turns.  Errors name the file and the bad record (and its line in JSONL)."""
    path = Path(path)
    if not path.is_file():
        raise (IsADirectoryError if path.is_dir() else FileNotFoundError)(
            f"{path}: {'is a directory, expected a JSON/JSONL file' if path.is_dir() else 'no such conversations file'}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg})") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of conversations, got a {type(rows).__name__}")
        where = [f"record {i}" for i in range(len(rows))]
    else:
        rows, where = [], []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    hint = " (a JSON list? name the file .json)" if text.lstrip().startswith("[") else ""
                    raise ValueError(f"{path}: line {n}: invalid JSON ({e.msg} at column {e.colno}){hint}") from None
                where.append(f"record {len(rows) - 1} (line {n})")
    if not rows:
        raise ValueError(f"{path}: no conversations")
    convs = []
    for row, at in zip(rows, where):
        turns = row
        if isinstance(row, dict):
            key = next((k for k in ("conversations", "messages") if k in row), None)
            if key is None:
                raise ValueError(f"{path}: {at}: no 'conversations' or 'messages' key (keys: {sorted(row)})")
            turns = row[key]
        if not isinstance(turns, list):
            raise ValueError(f"{path}: {at}: expected a list of turns, got a {type(turns).__name__}")
        if not turns:
            raise ValueError(f"{path}: {at}: empty conversation")
        msgs = []
        for j, t in enumerate(turns):
            if not isinstance(t, dict):
                raise ValueError(f"{path}: {at}, turn {j}: expected an object with from/value or role/content, "
                                 f"got {t!r:.60}")
            role_key = "from" if "from" in t else "role"
            content_key = "value" if "value" in t else "content"
            role = ROLES.get(t.get(role_key)) if isinstance(t.get(role_key), str) else None
            if role is None:
                raise ValueError(f"{path}: {at}, turn {j}: unknown role {t.get(role_key)!r} "
                                 f"(expected one of {', '.join(ROLES)})")
            if not isinstance(t.get(content_key), str):
                raise ValueError(f"{path}: {at}, turn {j}: {content_key!r} must be a string, "
                                 f"got {t.get(content_key)!r:.60}")
            msgs.append({"role": role, "content": t[content_key]})
        convs.append(msgs)
    return convs


def tokenize(tokenizer, messages: list[dict], *, last_turn_only: bool = False):
    """``(input_ids, loss_mask)`` with the mask on the assistant turns' tokens (template included)."""
    ids = _encode_prefix(tokenizer, messages, generation_prompt=False)
    mask = np.zeros(len(ids), bool)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in assistant[-1:] if last_turn_only else assistant:
        before = _encode_prefix(tokenizer, messages[:i], generation_prompt=True)
        upto = _encode_prefix(tokenizer, messages[: i + 1], generation_prompt=False)
        if ids[: len(upto)] != upto or upto[: len(before)] != before:
            raise ValueError("the chat template is not prefix-consistent; cannot locate assistant tokens")
        mask[len(before): len(upto)] = True
    return np.asarray(ids, np.int32), mask


def _encode_prefix(tokenizer, messages, generation_prompt: bool) -> list[int]:
    return encode_chat(tokenizer, messages, add_generation_prompt=generation_prompt)


def to_records(pairs, seq_len: int) -> dict[str, np.ndarray]:
    """Pads / truncates ``(ids, mask)`` pairs to ``seq_len``; drops rows with no loss token."""
    pairs = [(i[:seq_len], m[:seq_len]) for i, m in pairs]
    pairs = [(i, m) for i, m in pairs if m.any()]
    ids = np.zeros((len(pairs), seq_len), np.int32)
    mask = np.zeros((len(pairs), seq_len), bool)
    for r, (i, m) in enumerate(pairs):
        ids[r, : len(i)], mask[r, : len(m)] = i, m
    return {"input_ids": ids, "loss_mask": mask, "lengths": np.array([len(i) for i, _ in pairs], np.int32)}


def prepare(conversations, tokenizer, seq_len: int, *, last_turn_only: bool = False) -> dict[str, np.ndarray]:
    """Tokenizes every conversation (:func:`tokenize`) into padded records (:func:`to_records`)."""
    pairs = []
    for i, c in enumerate(tqdm(conversations, desc="prepare")):
        try:
            pairs.append(tokenize(tokenizer, c, last_turn_only=last_turn_only))
        except ValueError as e:
            raise ValueError(f"conversation {i}: {e}") from None
    return to_records(pairs, seq_len)


def regenerate(conversations, tokenizer, target, *, seq_len: int, max_new_tokens: int, temperature: float = 0.0,
               batch_size: int = 8, seed: int = 0, last_turn_only: bool = False, mesh=None) -> tuple[list, dict]:
    """Replaces every assistant turn by the target's own answer (thinking kept), turn by
    turn, with batched jitted generation.  Returns the new conversations (text) and
    records whose last answer holds the target's *exact* token ids (a decode/encode round
    trip would hand the drafter token sequences the target never produces).  ``mesh``: decode
    on it (``eagle3_jax.generate``'s ``mesh``)."""
    convs = [[m for m in c if m["role"] != "assistant"] for c in conversations]
    out = [[] for _ in convs]
    last = [None] * len(convs)  # (prompt ids, generated ids) of each conversation's latest turn
    cursor = [0] * len(convs)
    pending = list(range(len(convs)))
    bar = tqdm(total=sum(sum(m["role"] == "user" for m in c) for c in convs), desc="regenerate")
    eos = set(target.config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    while pending:
        prompts, owners = [], []
        for i in pending:  # advance each conversation to its next user turn
            while cursor[i] < len(convs[i]) and convs[i][cursor[i]]["role"] != "user":
                out[i].append(convs[i][cursor[i]])
                cursor[i] += 1
            if cursor[i] < len(convs[i]):
                out[i].append(convs[i][cursor[i]])
                cursor[i] += 1
                prompts.append(_encode_prefix(tokenizer, out[i], generation_prompt=True)[: seq_len - 1])
                owners.append(i)
        for s in range(0, len(prompts), batch_size):
            res = generate(target, None, prompts[s: s + batch_size], max_new_tokens=max_new_tokens,
                           temperature=temperature, seed=seed + s, stop_token_ids=sorted(eos), mesh=mesh)
            for i, prompt, toks in zip(owners[s: s + batch_size], prompts[s: s + batch_size], res.tokens):
                text = toks[:-1] if toks and toks[-1] in eos else toks
                out[i].append({"role": "assistant", "content": tokenizer.decode(text, skip_special_tokens=False)})
                last[i] = (prompt, toks)
            bar.update(len(res.tokens))
        pending = [i for i in owners if cursor[i] < len(convs[i])]
    bar.close()
    pairs = []
    for msgs, turn in zip(out, last):
        if turn is None:
            continue
        prompt, toks = turn
        mask = np.zeros(len(prompt), bool)
        if not last_turn_only and any(m["role"] == "assistant" for m in msgs[:-1]):
            earlier = tokenize(tokenizer, msgs[:-1])[1][: len(prompt)]  # earlier answers: text spans
            mask[: len(earlier)] = earlier
        pairs.append((np.asarray(prompt + toks, np.int32), np.concatenate([mask, np.ones(len(toks), bool)])))
    return out, to_records(pairs, seq_len)


def save_records(records: dict, path: str | Path):
    """Writes ``records`` (or any arrays) to the ``.npz`` file ``path`` atomically
    (:func:`eagle3_jax.atomic.write_atomic`)."""
    write_atomic(path, lambda f: np.savez(f, **records))


def write_json(obj, path: str | Path):
    """Writes ``obj`` as JSON to ``path`` atomically (:func:`eagle3_jax.atomic.write_atomic`)."""
    write_atomic(path, json.dumps(obj))


def shard_range(n: int, index: int, count: int) -> range:
    """The items ``[lo, hi)`` of process ``index`` of ``count`` when ``n`` items are split in
    contiguous blocks whose sizes differ by at most one: the blocks in process order are
    ``range(n)``, each item in exactly one."""
    if not 0 <= index < count:
        raise ValueError(f"process index {index} is not in [0, {count})")
    return range(n * index // count, n * (index + 1) // count)


def shard_path(path: str | Path, index: int, count: int) -> Path:
    """Where process ``index`` of ``count`` writes its shard of ``path``:
    ``regenerated.npz`` → ``regenerated.shard-00001-of-00002.npz``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.shard-{index:05d}-of-{count:05d}{path.suffix}")


def merge_shards(path: str | Path, count: int) -> Path:
    """Joins the ``count`` shards of ``path`` (:func:`shard_path`) in process order into
    ``path``, written atomically, then deletes them and any shards of ``path`` an earlier,
    killed run left.  ``.npz`` records are concatenated row-wise (same keys and
    ``seq_len`` required); ``.json`` shards hold lists, concatenated.  A missing or
    mismatched shard raises naming it, before ``path`` is touched."""
    path = Path(path)
    shards = [shard_path(path, i, count) for i in range(count)]
    for shard in shards:
        if not shard.is_file():
            raise FileNotFoundError(f"{shard}: missing (process {shards.index(shard)} of {count} wrote no shard)")
    if path.suffix == ".json":
        parts = [json.loads(s.read_text()) for s in shards]
        for shard, part in zip(shards, parts):
            if not isinstance(part, list):
                raise ValueError(f"{shard}: expected a JSON list, got a {type(part).__name__}")
        write_json([x for part in parts for x in part], path)
    else:
        parts = [load_records(s) for s in shards]
        for shard, part in zip(shards[1:], parts[1:]):
            if sorted(part) != sorted(parts[0]) or part["input_ids"].shape[1:] != parts[0]["input_ids"].shape[1:]:
                raise ValueError(f"{shard}: arrays {sorted(part)} of seq_len {part['input_ids'].shape[1]} disagree "
                                 f"with {shards[0]} ({sorted(parts[0])}, seq_len {parts[0]['input_ids'].shape[1]})")
        save_records({k: np.concatenate([part[k] for part in parts]) for k in parts[0]}, path)
    mine = re.compile(rf"{re.escape(path.stem)}\.shard-\d{{5}}-of-\d{{5}}{re.escape(path.suffix)}")
    for stale in path.parent.iterdir():
        if mine.fullmatch(stale.name):
            stale.unlink(missing_ok=True)
    return path


def load_records(path: str | Path) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing (run the earlier training step first)")
    try:
        with np.load(path) as f:
            records = {k: f[k] for k in f.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a records file ({e})") from None
    for key in ("input_ids", "loss_mask"):
        if key not in records:
            raise ValueError(f"{path}: no {key!r} array (has {sorted(records)})")
    ids, mask = records["input_ids"], records["loss_mask"]
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or mask.shape != ids.shape:
        raise ValueError(f"{path}: expected integer 'input_ids' [n, seq_len] and 'loss_mask' of the same shape, "
                         f"got {ids.dtype} {ids.shape} and {mask.dtype} {mask.shape}")
    return records


def dataset(records: dict, *, batch_size: int, seed: int, buckets: tuple[int, ...] = ()):
    """An endless, shuffled, batched grain iterator over the records' global batches.

    Every process builds the same sequence from the same ``seed`` (the trainer puts on each
    process only the rows its devices hold), so a run on several processes sees the
    batches of a single-process run.  Each batch is ``{input_ids, loss_mask, rows}``
    (``rows``: the record indices, e.g. for cached per-record arrays).
    ``buckets``: length bucketing — batches hold rows of one bucket only, cut to that
    bucket's length (one compilation per bucket); default one bucket of ``seq_len``.
    ``iterator.get_state()`` / ``set_state()`` make resumption exact.
    """
    n, seq_len = records["input_ids"].shape
    if n == 0:
        raise ValueError("no training records (every row lacked assistant tokens?)")
    edges = sorted({min(b, seq_len) for b in buckets} | {seq_len})
    lengths = records.get("lengths", np.full(n, seq_len))
    rng = np.random.default_rng(seed)
    batches, carry = [], np.zeros(0, np.int64)
    for lo, hi in zip([0] + edges[:-1], edges):
        rows = np.flatnonzero((lo < lengths) & (lengths <= hi)).astype(np.int64)
        rows = np.concatenate([carry, rows[rng.permutation(len(rows))]])  # a bucket's remainder joins the next
        full = len(rows) // batch_size * batch_size
        batches += [(hi, rows[s: s + batch_size]) for s in range(0, full, batch_size)]
        carry = rows[full:]
    if not batches:
        raise ValueError(f"fewer than batch_size={batch_size} records per bucket")

    def load(batch):
        length, idx = batch
        return {"input_ids": records["input_ids"][idx, :length], "loss_mask": records["loss_mask"][idx, :length],
                "rows": idx}

    ds = grain.MapDataset.source(batches).shuffle(seed=seed).repeat(None).map(load)
    return ds.to_iter_dataset().__iter__()
