"""``eagle3-jax train STEP --config FILE [key=value ...]``: the training pipeline
prepare → regenerate → vocab → fit → export, each step reading the previous step's
files from ``work_dir`` (so any step can be re-run or resumed on its own).

The config (:func:`eagle3_jax.train.config.load_config`: YAML over the defaults of
:class:`~eagle3_jax.train.config.PipelineConfig`, then the overrides) is typed by its
dataclasses, so ``fit.lr=1e-4`` is a float; unknown keys are refused with the closest known
ones.  :func:`run` checks the inputs each requested step needs and that the outputs can be written
before the first step starts.  A fresh ``fit`` never writes over an earlier
run: its outputs are moved to ``work_dir/previous_runs/`` first (see :func:`set_aside_run`).

On several processes (JAX's multi-controller runtime: ``distributed: true``, or
``jax.distributed.initialize`` called before :func:`run`) every process runs every step
over one ``work_dir`` on storage they all see; each step ends on a barrier.  ``prepare``,
``vocab``, ``export``, the setting aside of an old run, ``best/``, ``best.json`` and
``metrics.jsonl`` are written by process 0 alone; ``regenerate`` splits the conversations
in contiguous blocks, each process writes its shard and process 0 joins them in process
order (:func:`eagle3_jax.train.data.merge_shards`); ``fit`` trains on the global mesh, each
process feeding its devices' rows of the global batch (the checkpoints are orbax's
collective saves).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import eagle3_jax
from eagle3_jax.atomic import write_atomic
from eagle3_jax.checkpoint import check_output_path
from eagle3_jax.checkpoint.load import read_target_embedding
from eagle3_jax.config import DrafterConfig, read_config_json
from eagle3_jax.models.drafter import Drafter
from eagle3_jax.sharding import make_mesh
from eagle3_jax.train import data
from eagle3_jax.train.config import PipelineConfig, load_config  # noqa: F401  (load_config: the CLI's entry)
from eagle3_jax.train.trainer import Trainer
from eagle3_jax.vocab import build_vocab_map

STEPS = ("prepare", "regenerate", "vocab", "fit", "export")

# what each step reads from / writes to work_dir
INPUTS = {"prepare": (), "regenerate": ("conversations.json",), "vocab": ("regenerated.npz",),
          "fit": ("vocab.npz", "regenerated.npz"), "export": ("best",)}
OUTPUTS = {"prepare": ("prepared.npz", "conversations.json"), "regenerate": ("regenerated.npz",), "vocab": ("vocab.npz",),
           "fit": ("best",), "export": ()}
RUN_OUTPUTS = ("ckpt", "best", "best.json", "metrics.jsonl")  # one fit's outputs (with the default export/)


def run(step: str, cfg: PipelineConfig, *, resume: bool = True):
    """Runs ``step`` (or ``"all"``) after checking the whole config for it (:func:`check`).
    ``resume=False`` (``--no-resume``) starts ``fit`` over; an earlier run is moved aside
    first (:func:`set_aside_run`), never overwritten."""
    if step not in STEPS + ("all",):
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS + ('all',)}")
    steps = STEPS if step == "all" else (step,)
    if not resume and "fit" not in steps:
        raise ValueError(f"--no-resume applies to fit and all, not to {step}")
    check(cfg, steps)
    work = Path(cfg.work_dir)
    if cfg.distributed:
        if not jax.distributed.is_initialized():
            jax.distributed.initialize()
    if "fit" in steps:
        _before_fit(cfg, work, resume=resume)
    work.mkdir(parents=True, exist_ok=True)
    for s in steps:
        print(f"== {s}")
        globals()[f"_{s}"](cfg, work, resume=resume)
        _barrier(f"train {s}")  # the next step (on any process) reads what this one wrote


def check(cfg: PipelineConfig, steps) -> None:
    """Checks, before any step runs, what ``steps`` need: the required keys, the target
    (``config.json``; ``draft_vocab_size`` and ``seq_len`` against it), the tokenizer, the
    data, the files earlier steps left in ``work_dir`` (unless a step of this run makes
    them), ``drafter.init``, and that ``work_dir`` / ``export_dir`` can be written."""
    def need(key: str, why: str) -> Path:
        if not getattr(cfg, key):
            raise ValueError(f"config: {key!r} is required for {why} (set it in the YAML or as {key}=PATH)")
        return Path(getattr(cfg, key))

    work = need("work_dir", "every step")
    check_output_path(work, "work_dir", directory=True)
    regenerates = "regenerate" in steps and cfg.regenerate.enabled
    if "prepare" in steps:
        data = need("data", "prepare")
        if not data.is_file():
            raise (IsADirectoryError if data.is_dir() else FileNotFoundError)(
                f"data {data}: {'is a directory, expected a JSON/JSONL file' if data.is_dir() else 'no such file'}")
    if "prepare" in steps or regenerates:
        tok = Path(cfg.tokenizer or need("target", "the tokenizer (or set tokenizer=PATH)"))
        if not (tok / "tokenizer.json").is_file() and not (tok / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"{'tokenizer' if cfg.tokenizer else 'target'} {tok}: no tokenizer.json or "
                                    "tokenizer_config.json (set tokenizer=PATH)")
    if set(steps) - {"prepare"}:
        target = need("target", "/".join(s for s in steps if s != "prepare"))
        if not target.is_dir():
            raise (NotADirectoryError if target.exists() else FileNotFoundError)(
                f"target {target}: {'not a directory' if target.exists() else 'no such directory'}")
        tcfg = read_config_json(target)
        if not isinstance(tcfg, dict):
            raise ValueError(f"target {target}: config.json is not a JSON object")
        vocab, max_pos = tcfg.get("vocab_size"), tcfg.get("max_position_embeddings")
        if ({"vocab", "fit"} & set(steps) and isinstance(vocab, int) and cfg.draft_vocab_size > vocab):
            raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} exceeds the target's vocab_size ({vocab})")
        if isinstance(max_pos, int) and cfg.seq_len > max_pos:
            raise ValueError(f"seq_len={cfg.seq_len} exceeds the target's max_position_embeddings ({max_pos})")
    made = set()
    for s in steps:
        inputs = INPUTS[s] if s != "regenerate" or cfg.regenerate.enabled else ("prepared.npz",)
        for name in inputs:
            if name not in made and not (work / name).exists():
                producer = next(p for p in STEPS if name in OUTPUTS[p])
                raise FileNotFoundError(f"{work / name}: missing; run `eagle3-jax train {producer}` first "
                                        f"(or `train all`)")
        made |= set(OUTPUTS[s])
    if "fit" in steps and cfg.drafter.init and not Path(cfg.drafter.init).is_dir():
        raise FileNotFoundError(f"drafter.init {cfg.drafter.init}: no such directory")
    if "export" in steps:
        check_output_path(cfg.export_dir or work / "export", "export_dir", directory=True)


def _before_fit(cfg: PipelineConfig, work: Path, *, resume: bool):
    """The mesh must fit the devices; then the first host sets an earlier run aside."""
    try:
        make_mesh(**cfg.mesh.sizes())
    except ValueError as e:
        raise ValueError(f"mesh {cfg.mesh.sizes()}: {e}") from None
    if _writer():
        set_aside_run(work, resume=resume, export_dir=cfg.export_dir)
    _barrier("set_aside_run")


def _writer() -> bool:
    """Whether this process writes the files shared by all processes (process 0 does)."""
    return jax.process_index() == 0


def _barrier(name: str):
    """Waits until every process gets here (nothing to wait for on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"eagle3_jax {name}")


def set_aside_run(work: Path, *, resume: bool = True, export_dir=None) -> Path | None:
    """Before a fresh ``fit`` (``resume=False``, or no checkpoint to resume) moves an
    earlier run's outputs in ``work`` (``ckpt/``, ``best/``, ``best.json``,
    ``metrics.jsonl`` and the default ``export/``) to ``work/previous_runs/run-<date-time>/``
    (``vocab.npz`` copied beside them) and says so: nothing of it is overwritten, and a later
    ``fit`` resumes the new run.  Returns where they went, or None when there was nothing."""
    ckpt = work / "ckpt"
    if resume and ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir()):
        return None  # fit resumes this run
    names = [n for n in RUN_OUTPUTS if (work / n).exists()]
    if export_dir is None and (work / "export").exists():
        names.append("export")
    if not names:
        return None
    base = work / "previous_runs" / time.strftime("run-%Y%m%d-%H%M%S")
    dest, n = base, 1
    while dest.exists():
        n += 1
        dest = base.with_name(f"{base.name}-{n}")
    dest.mkdir(parents=True)
    for name in names:
        (work / name).rename(dest / name)
    if (work / "vocab.npz").exists():
        shutil.copy2(work / "vocab.npz", dest / "vocab.npz")
    print(f"fit: starting a new run; the previous run's {', '.join(names)} moved to {dest}")
    return dest


def _tokenizer(cfg):
    from transformers import AutoTokenizer

    path = cfg.tokenizer or cfg.target
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {path}: cannot load it ({str(e).strip().splitlines()[0]})") from None
    if not tok.chat_template:
        raise ValueError(f"tokenizer {path}: has no chat template (prepare and regenerate apply it)")
    return tok


def _target(cfg, mesh=None):
    return eagle3_jax.load_target(cfg.target, dtype=cfg.dtype, mesh=mesh)


def _local_mesh(tensor: int):
    """A mesh over this process's devices (``tensor``-way tensor parallel, the rest over the
    batch), or ``None`` on one device."""
    local = jax.local_devices()
    if len(local) % tensor:
        raise ValueError(f"regenerate.tensor={tensor} must divide this process's {len(local)} devices")
    return None if len(local) == 1 else make_mesh(data=len(local) // tensor, tensor=tensor, devices=local)


def _prepare(cfg, work: Path, **_):
    if not _writer():
        return  # process 0 writes; the others wait at the step's barrier
    convs = data.load_conversations(cfg.data)
    records = data.prepare(convs, _tokenizer(cfg), cfg.seq_len, last_turn_only=cfg.last_turn_only)
    data.save_records(records, work / "prepared.npz")
    data.write_json(convs, work / "conversations.json")
    print(f"{len(records['input_ids'])} records, {int(records['loss_mask'].sum())} loss tokens")


def _regenerate(cfg, work: Path, **_):
    """Each process regenerates its block of the conversations with the target on its own
    devices (``regenerate.tensor``-way tensor parallel, the batch over the rest) and writes its
    shard; process 0 then joins the shards in process order."""
    if not cfg.regenerate.enabled:
        if _writer():
            with open(work / "prepared.npz", "rb") as src:
                write_atomic(work / "regenerated.npz", lambda f: shutil.copyfileobj(src, f))
        return
    convs = json.loads((work / "conversations.json").read_text())
    index, count = jax.process_index(), jax.process_count()
    mine = data.shard_range(len(convs), index, count)
    r = cfg.regenerate
    mesh = _local_mesh(r.tensor)
    new, records = data.regenerate([convs[i] for i in mine], _tokenizer(cfg), _target(cfg, mesh), seq_len=cfg.seq_len,
                                   max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                   batch_size=r.batch_size, seed=mine.start, last_turn_only=cfg.last_turn_only,
                                   mesh=mesh)
    data.save_records(records, data.shard_path(work / "regenerated.npz", index, count))
    data.write_json(new, data.shard_path(work / "regenerated.json", index, count))
    print(f"regenerate: process {index} of {count}: conversations [{mine.start}, {mine.stop}): "
          f"{len(records['input_ids'])} records")
    _barrier("regenerate shards")
    if _writer():
        for name in ("regenerated.npz", "regenerated.json"):
            data.merge_shards(work / name, count)


def _vocab(cfg, work: Path, **_):
    if not _writer():
        return
    records = data.load_records(work / "regenerated.npz")
    vocab = int(read_config_json(cfg.target)["vocab_size"])
    d2t, t2d = build_vocab_map(records["input_ids"], records["loss_mask"], vocab, cfg.draft_vocab_size)
    data.save_records({"d2t": d2t, "t2d": t2d}, work / "vocab.npz")
    print(f"draft vocab {cfg.draft_vocab_size} of {vocab}")


def drafter_options(cfg: PipelineConfig) -> dict:
    """The ``drafter`` section's shape options (``num_layers``, ``layer_family``, the
    switches) as :meth:`eagle3_jax.config.DrafterConfig.for_target` keywords."""
    return cfg.drafter.options()


def new_drafter(target, d2t, *, draft_vocab_size: int, seed: int = 0, **options):
    """A freshly initialised EAGLE-3 drafter shaped after ``target`` (its RoPE settings too);
    ``options``: :func:`drafter_options` (layers, layer family, switches)."""
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size, **options)
    return Drafter(cfg, target.embed[...], d2t=d2t if cfg.has_vocab_map else None, dtype=target.dtype, rngs=nnx.Rngs(seed))


def _fit(cfg, work: Path, *, resume: bool = True):
    mesh = make_mesh(**cfg.mesh.sizes())
    target = eagle3_jax.load_target(cfg.target, dtype=cfg.dtype, mesh=mesh)  # each process reads its blocks
    vocab = np.load(work / "vocab.npz")
    if cfg.drafter.init:
        drafter = eagle3_jax.load_drafter(cfg.drafter.init, target=target)
    else:
        drafter = new_drafter(target, vocab["d2t"], draft_vocab_size=cfg.draft_vocab_size, seed=cfg.drafter.seed,
                              **drafter_options(cfg))
    trainer = Trainer(target, drafter, data.load_records(work / "regenerated.npz"), cfg.fit,
                      work_dir=work, mesh=mesh)
    best = trainer.fit(resume=resume)
    if _writer():
        write_atomic(work / "best.json", lambda f: f.write((json.dumps(best) + "\n").encode()))
    print(f"best simulated acceptance length {best['sim_accept_len']:.3f} at step {best['step']}")


def _export(cfg, work: Path, **_):
    """Process 0 re-saves ``best/``; of the target it reads only the embedding (a drafter
    without its own shares it), so no device needs room for the whole target."""
    if not _writer():
        return
    out = Path(cfg.export_dir or work / "export")
    drafter = eagle3_jax.load_drafter(work / "best", embed=read_target_embedding(cfg.target), dtype=cfg.dtype)
    speculators = not drafter.config.is_official or drafter.config.layout == "speculators"
    eagle3_jax.save_drafter(drafter, out, verifier=cfg.target if speculators else None)
    print(f"exported {out}")
