"""``eagle3-jax train STEP --config FILE [key=value ...]``: the training pipeline
prepare → regenerate → vocab → fit → export, each step reading the previous step's
files from ``work_dir`` (so any step can be re-run or resumed on its own).

The config (YAML over ``DEFAULTS``, then the overrides) is typed by its schema: every
value is read as its default's type (``FitConfig``'s annotations for ``fit``), so
``fit.lr=1e-4`` is a float; unknown keys are refused with the closest known ones.
:func:`run` checks the ranges, the inputs each requested step needs and that the outputs
can be written before the first step starts.  A fresh ``fit`` never writes over an earlier
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

import copy
import dataclasses
import difflib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import yaml

from eagle3_jax import limits
from eagle3_jax.atomic import write_atomic

STEPS = ("prepare", "regenerate", "vocab", "fit", "export")

DEFAULTS = {
    "target": None,            # Hugging Face target directory
    "tokenizer": None,         # defaults to the target directory
    "data": None,              # ShareGPT JSON / JSONL
    "work_dir": None,
    "seq_len": 2048,
    "last_turn_only": False,
    "draft_vocab_size": 32000,
    "dtype": "float32",        # target weights
    "distributed": False,      # jax.distributed.initialize() (multi-host pods)
    "regenerate": {"enabled": True, "max_new_tokens": 512, "temperature": 0.0, "batch_size": 8,
                   "tensor": 1},  # tensor-parallel size over each process's devices (the rest split the batch)
    # a fresh drafter's shape (ignored with init): decoder layers, their family (llama, or qwen3
    # with q/k norms) and speculators' switches; anything but the official one-layer Llama
    # drafter is exported in the speculators layout
    "drafter": {"init": None, "seed": 0, "num_layers": 1, "layer_family": "llama", "norm_before_residual": False,
                "norm_before_fc": False, "fc_norm": False, "norm_output": False},
    "fit": {},                 # eagle3_jax.train.trainer.FitConfig fields (its defaults)
    "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
    "topology": "",            # the TPU slice the config is meant for, e.g. v6e:2x4 (plan --topology's default)
    "export_dir": None,        # default: work_dir/export
}

# allowed ranges of the keys outside ``fit`` (FitConfig checks its own: eagle3_jax.train.trainer.FIT_LIMITS)
LIMITS = {"seq_len": limits.MAX_LEN, "draft_vocab_size": limits.POSITIVE, "dtype": limits.DTYPE,
          "regenerate.max_new_tokens": limits.MAX_NEW_TOKENS, "regenerate.temperature": limits.TEMPERATURE,
          "regenerate.batch_size": limits.POSITIVE, "regenerate.tensor": limits.POSITIVE,
          "drafter.seed": limits.NON_NEGATIVE, "drafter.num_layers": limits.POSITIVE,
          "drafter.layer_family": limits.Range(str, choices=("llama", "qwen3")), "mesh.data": limits.Range(int, lo=-1),
          "mesh.fsdp": limits.POSITIVE, "mesh.tensor": limits.POSITIVE}

# what each step reads from / writes to work_dir
INPUTS = {"prepare": (), "regenerate": ("conversations.json",), "vocab": ("regenerated.npz",),
          "fit": ("vocab.npz", "regenerated.npz"), "export": ("best",)}
OUTPUTS = {"prepare": ("prepared.npz", "conversations.json"), "regenerate": ("regenerated.npz",), "vocab": ("vocab.npz",),
           "fit": ("best",), "export": ()}
RUN_OUTPUTS = ("ckpt", "best", "best.json", "metrics.jsonl")  # one fit's outputs (with the default export/)

_TRUE, _FALSE, _NULL = ("true", "yes", "on", "1"), ("false", "no", "off", "0"), ("", "null", "none", "~")


def schema() -> dict[str, type | None]:
    """Every config key, dotted (``fit.lr``), → its type: ``int``, ``float``, ``bool``, ``str``,
    ``tuple`` (of ints) or ``None`` (an optional path)."""
    from eagle3_jax.train.trainer import FIT_LIMITS

    out = {}
    for key, value in DEFAULTS.items():
        if key == "fit":
            out.update({f"fit.{name}": rng.kind for name, rng in FIT_LIMITS.items()})
        elif isinstance(value, dict):
            out.update({f"{key}.{k}": None if v is None else type(v) for k, v in value.items()})
        else:
            out[key] = None if value is None else type(value)
    return out


def load_config(path: str | Path, overrides=()) -> dict:
    """YAML config merged over the defaults, then ``a.b=value`` overrides; every value read
    as its key's type (:func:`schema`) and range-checked.  Raises ``ValueError`` naming the
    key (unknown keys with the closest known ones) and where it came from."""
    from eagle3_jax.train.trainer import FitConfig

    path = Path(path)
    kinds = schema()
    flat = _flatten({**copy.deepcopy(DEFAULTS), "fit": dataclasses.asdict(FitConfig())})
    origin = dict.fromkeys(flat, "default")
    for key, value in _flatten(_read_yaml(path), str(path), kinds).items():
        flat[key], origin[key] = _coerce(key, value, kinds[key], str(path)), str(path)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value (e.g. fit.lr=1e-4)")
        _check_known(key, kinds, f"override {item!r}")
        flat[key], origin[key] = _coerce(key, value, kinds[key], "command-line override"), "command-line override"
    for key, value in flat.items():
        if key.startswith("fit."):
            continue  # FitConfig below
        problem = (limits.problem(value, LIMITS[key])[1] if key in LIMITS else None) or (
            "must be -1 (all devices) or >= 1" if key == "mesh.data" and value == 0 else None)
        if problem:
            raise ValueError(f"{key}={value!r} ({origin[key]}): {problem}")
    cfg = {}
    for key, value in flat.items():
        section, _, sub = key.partition(".")
        if sub:
            cfg.setdefault(section, {})[sub] = value
        else:
            cfg[key] = value
    try:
        FitConfig(**cfg["fit"])
    except (TypeError, ValueError) as e:
        item, _, problem = str(e).partition(": ")
        raise ValueError(f"{item} ({origin.get(item.partition('=')[0], 'config')}): {problem}") from None
    return cfg


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise (IsADirectoryError if path.is_dir() else FileNotFoundError)(
            f"--config {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    try:
        user = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"--config {path}: invalid YAML{where} ({getattr(e, 'problem', None) or e})") from None
    if user is None:
        return {}
    if not isinstance(user, dict):
        raise ValueError(f"--config {path}: expected a mapping of config keys, got a {type(user).__name__}")
    return user


def _flatten(tree: dict, source: str | None = None, kinds: dict | None = None) -> dict:
    """``{"fit": {"lr": x}}`` → ``{"fit.lr": x}``; with ``kinds``, unknown keys are refused."""
    out = {}
    for k, v in tree.items():
        k = str(k)
        if kinds is not None and k in DEFAULTS and isinstance(DEFAULTS[k], dict):
            if v is None:
                continue
            if not isinstance(v, dict):
                raise ValueError(f"{source}: {k!r} must be a mapping of its keys, got {v!r}")
            for sub, value in v.items():
                _check_known(f"{k}.{sub}", kinds, source)
                out[f"{k}.{sub}"] = value
        elif kinds is None and isinstance(v, dict):
            out.update({f"{k}.{sub}": value for sub, value in v.items()})
        else:
            if kinds is not None:
                _check_known(k, kinds, source)
            out[k] = v
    return out


def _check_known(key: str, kinds: dict, where: str):
    if key in kinds:
        return
    sections = sorted({k.partition(".")[0] for k in kinds if "." in k})
    section = key.partition(".")[0]
    members = ", ".join(k for k in kinds if k.startswith(section + "."))
    if key in sections:
        raise ValueError(f"{where}: {key!r} is a section; set its keys ({members})")
    close = difflib.get_close_matches(key, [*kinds, *sections] if "." not in key else kinds, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {members}" if section in sections
            else f"known: {', '.join(sorted({k.partition('.')[0] for k in kinds}))}")
    raise ValueError(f"{where}: unknown key {key!r} ({hint})")


def _coerce(key: str, value, kind, origin: str):
    """``value`` (a YAML value or an override's text) as ``kind`` (see :func:`schema`)."""
    text = value.strip() if isinstance(value, str) else None
    if kind is tuple:  # of ints: a YAML list, "[8, 16]" or "8,16"
        try:
            items = value if text is None else yaml.safe_load(text) if text.startswith("[") else \
                [v for v in text.split(",") if v.strip()]
        except yaml.YAMLError:
            items = None
        if isinstance(items, (list, tuple)):
            return tuple(_coerce(f"{key}[{i}]", v, int, origin) for i, v in enumerate(items))
    if kind is None:  # an optional path
        if value is None or (text is not None and text.lower() in _NULL):
            return None
        if text:
            return os.path.expanduser(value)  # ~/data.jsonl as the shell would read it
    else:
        read = value
        if text and kind is bool and text.lower() in _TRUE + _FALSE:
            read = text.lower() in _TRUE
        elif text and kind in (int, float):
            try:
                read = kind(text)  # "1e-4", "1_024"
            except ValueError:
                pass
        read, error = limits.problem(read, limits.Range(kind))
        if error is None:
            return read
    raise ValueError(f"{key}={value!r} ({origin}): expected {'a path or null' if kind is None else limits.KIND_NAMES[kind]}")


def run(step: str, cfg: dict, *, resume: bool = True):
    """Runs ``step`` (or ``"all"``) after checking the whole config for it (:func:`check`).
    ``resume=False`` (``--no-resume``) starts ``fit`` over; an earlier run is moved aside
    first (:func:`set_aside_run`), never overwritten."""
    if step not in STEPS + ("all",):
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS + ('all',)}")
    steps = STEPS if step == "all" else (step,)
    if not resume and "fit" not in steps:
        raise ValueError(f"--no-resume applies to fit and all, not to {step}")
    check(cfg, steps)
    work = Path(cfg["work_dir"])
    if cfg["distributed"]:
        import jax

        if not jax.distributed.is_initialized():
            jax.distributed.initialize()
    if "fit" in steps:
        _before_fit(cfg, work, resume=resume)
    work.mkdir(parents=True, exist_ok=True)
    for s in steps:
        print(f"== {s}")
        globals()[f"_{s}"](cfg, work, resume=resume)
        _barrier(f"train {s}")  # the next step (on any process) reads what this one wrote


def check(cfg: dict, steps) -> None:
    """Checks, before any step runs, what ``steps`` need: the required keys, the target
    (``config.json``; ``draft_vocab_size`` and ``seq_len`` against it), the tokenizer, the
    data, the files earlier steps left in ``work_dir`` (unless a step of this run makes
    them), ``drafter.init``, and that ``work_dir`` / ``export_dir`` can be written."""
    from eagle3_jax.checkpoint import check_output_path

    def need(key: str, why: str) -> Path:
        if not cfg.get(key):
            raise ValueError(f"config: {key!r} is required for {why} (set it in the YAML or as {key}=PATH)")
        return Path(cfg[key])

    work = need("work_dir", "every step")
    check_output_path(work, "work_dir", directory=True)
    regenerates = "regenerate" in steps and cfg["regenerate"]["enabled"]
    if "prepare" in steps:
        data = need("data", "prepare")
        if not data.is_file():
            raise (IsADirectoryError if data.is_dir() else FileNotFoundError)(
                f"data {data}: {'is a directory, expected a JSON/JSONL file' if data.is_dir() else 'no such file'}")
    if "prepare" in steps or regenerates:
        tok = Path(cfg["tokenizer"] or need("target", "the tokenizer (or set tokenizer=PATH)"))
        if not (tok / "tokenizer.json").is_file() and not (tok / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"{'tokenizer' if cfg['tokenizer'] else 'target'} {tok}: no tokenizer.json or "
                                    "tokenizer_config.json (set tokenizer=PATH)")
    if set(steps) - {"prepare"}:
        from eagle3_jax.config import read_config_json

        target = need("target", "/".join(s for s in steps if s != "prepare"))
        if not target.is_dir():
            raise (NotADirectoryError if target.exists() else FileNotFoundError)(
                f"target {target}: {'not a directory' if target.exists() else 'no such directory'}")
        tcfg = read_config_json(target)
        if not isinstance(tcfg, dict):
            raise ValueError(f"target {target}: config.json is not a JSON object")
        vocab, max_pos = tcfg.get("vocab_size"), tcfg.get("max_position_embeddings")
        if ({"vocab", "fit"} & set(steps) and isinstance(vocab, int) and cfg["draft_vocab_size"] > vocab):
            raise ValueError(f"draft_vocab_size={cfg['draft_vocab_size']} exceeds the target's vocab_size ({vocab})")
        if isinstance(max_pos, int) and cfg["seq_len"] > max_pos:
            raise ValueError(f"seq_len={cfg['seq_len']} exceeds the target's max_position_embeddings ({max_pos})")
    made = set()
    for s in steps:
        inputs = INPUTS[s] if s != "regenerate" or cfg["regenerate"]["enabled"] else ("prepared.npz",)
        for name in inputs:
            if name not in made and not (work / name).exists():
                producer = next(p for p in STEPS if name in OUTPUTS[p])
                raise FileNotFoundError(f"{work / name}: missing; run `eagle3-jax train {producer}` first "
                                        f"(or `train all`)")
        made |= set(OUTPUTS[s])
    if "fit" in steps and cfg["drafter"]["init"] and not Path(cfg["drafter"]["init"]).is_dir():
        raise FileNotFoundError(f"drafter.init {cfg['drafter']['init']}: no such directory")
    if "export" in steps:
        check_output_path(cfg["export_dir"] or work / "export", "export_dir", directory=True)


def _before_fit(cfg: dict, work: Path, *, resume: bool):
    """The mesh must fit the devices; then the first host sets an earlier run aside."""
    import jax

    from eagle3_jax.sharding import make_mesh

    try:
        make_mesh(**cfg["mesh"])
    except ValueError as e:
        raise ValueError(f"mesh {cfg['mesh']}: {e}") from None
    if _writer():
        set_aside_run(work, resume=resume, export_dir=cfg["export_dir"])
    _barrier("set_aside_run")


def _writer() -> bool:
    """Whether this process writes the files shared by all processes (process 0 does)."""
    import jax

    return jax.process_index() == 0


def _barrier(name: str):
    """Waits until every process gets here (nothing to wait for on one process)."""
    import jax

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

    path = cfg["tokenizer"] or cfg["target"]
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {path}: cannot load it ({str(e).strip().splitlines()[0]})") from None
    if not tok.chat_template:
        raise ValueError(f"tokenizer {path}: has no chat template (prepare and regenerate apply it)")
    return tok


def _target(cfg, mesh=None):
    import eagle3_jax

    return eagle3_jax.load_target(cfg["target"], dtype=cfg["dtype"], mesh=mesh)


def _local_mesh(tensor: int):
    """A mesh over this process's devices (``tensor``-way tensor parallel, the rest over the
    batch), or ``None`` on one device."""
    import jax

    from eagle3_jax.sharding import make_mesh

    local = jax.local_devices()
    if len(local) % tensor:
        raise ValueError(f"regenerate.tensor={tensor} must divide this process's {len(local)} devices")
    return None if len(local) == 1 else make_mesh(data=len(local) // tensor, tensor=tensor, devices=local)


def _prepare(cfg, work: Path, **_):
    from eagle3_jax.train import data

    if not _writer():
        return  # process 0 writes; the others wait at the step's barrier
    convs = data.load_conversations(cfg["data"])
    records = data.prepare(convs, _tokenizer(cfg), cfg["seq_len"], last_turn_only=cfg["last_turn_only"])
    data.save_records(records, work / "prepared.npz")
    data.write_json(convs, work / "conversations.json")
    print(f"{len(records['input_ids'])} records, {int(records['loss_mask'].sum())} loss tokens")


def _regenerate(cfg, work: Path, **_):
    """Each process regenerates its block of the conversations with the target on its own
    devices (``regenerate.tensor``-way tensor parallel, the batch over the rest) and writes its
    shard; process 0 then joins the shards in process order."""
    import jax

    from eagle3_jax.train import data

    if not cfg["regenerate"]["enabled"]:
        if _writer():
            with open(work / "prepared.npz", "rb") as src:
                write_atomic(work / "regenerated.npz", lambda f: shutil.copyfileobj(src, f))
        return
    convs = json.loads((work / "conversations.json").read_text())
    index, count = jax.process_index(), jax.process_count()
    mine = data.shard_range(len(convs), index, count)
    r = cfg["regenerate"]
    mesh = _local_mesh(r["tensor"])
    new, records = data.regenerate([convs[i] for i in mine], _tokenizer(cfg), _target(cfg, mesh), seq_len=cfg["seq_len"],
                                   max_new_tokens=r["max_new_tokens"], temperature=r["temperature"],
                                   batch_size=r["batch_size"], seed=mine.start, last_turn_only=cfg["last_turn_only"],
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
    from eagle3_jax.config import read_config_json
    from eagle3_jax.vocab import build_vocab_map
    from eagle3_jax.train import data

    if not _writer():
        return
    records = data.load_records(work / "regenerated.npz")
    vocab = int(read_config_json(cfg["target"])["vocab_size"])
    d2t, t2d = build_vocab_map(records["input_ids"], records["loss_mask"], vocab, cfg["draft_vocab_size"])
    data.save_records({"d2t": d2t, "t2d": t2d}, work / "vocab.npz")
    print(f"draft vocab {cfg['draft_vocab_size']} of {vocab}")


def drafter_options(cfg: dict) -> dict:
    """The ``drafter`` section's shape options (``num_layers``, ``layer_family``, the
    switches) as :meth:`eagle3_jax.config.DrafterConfig.for_target` keywords."""
    section = cfg.get("drafter") or {}
    return {k: section[k] for k in DEFAULTS["drafter"] if k not in ("init", "seed") and k in section}


def new_drafter(target, d2t, *, draft_vocab_size: int, seed: int = 0, **options):
    """A freshly initialised EAGLE-3 drafter shaped after ``target`` (its RoPE settings too);
    ``options``: :func:`drafter_options` (layers, layer family, switches)."""
    from flax import nnx

    from eagle3_jax.config import DrafterConfig
    from eagle3_jax.models.drafter import Drafter

    cfg = DrafterConfig.for_target(target.config, draft_vocab_size, **options)
    return Drafter(cfg, target.embed[...], d2t=d2t if cfg.has_vocab_map else None, dtype=target.dtype, rngs=nnx.Rngs(seed))


def _fit(cfg, work: Path, *, resume: bool = True):
    import eagle3_jax
    from eagle3_jax.sharding import make_mesh
    from eagle3_jax.train import data
    from eagle3_jax.train.trainer import FitConfig, Trainer

    mesh = make_mesh(**cfg["mesh"])
    target = eagle3_jax.load_target(cfg["target"], dtype=cfg["dtype"], mesh=mesh)  # each process reads its blocks
    vocab = np.load(work / "vocab.npz")
    if cfg["drafter"]["init"]:
        drafter = eagle3_jax.load_drafter(cfg["drafter"]["init"], target=target)
    else:
        drafter = new_drafter(target, vocab["d2t"], draft_vocab_size=cfg["draft_vocab_size"], seed=cfg["drafter"]["seed"],
                              **drafter_options(cfg))
    trainer = Trainer(target, drafter, data.load_records(work / "regenerated.npz"), FitConfig(**cfg["fit"]),
                      work_dir=work, mesh=mesh)
    best = trainer.fit(resume=resume)
    if _writer():
        write_atomic(work / "best.json", lambda f: f.write((json.dumps(best) + "\n").encode()))
    print(f"best simulated acceptance length {best['sim_accept_len']:.3f} at step {best['step']}")


def _export(cfg, work: Path, **_):
    """Process 0 re-saves ``best/``; of the target it reads only the embedding (a drafter
    without its own shares it), so no device needs room for the whole target."""
    import eagle3_jax
    from eagle3_jax.checkpoint.load import read_target_embedding

    if not _writer():
        return
    out = Path(cfg["export_dir"] or work / "export")
    drafter = eagle3_jax.load_drafter(work / "best", embed=read_target_embedding(cfg["target"]), dtype=cfg["dtype"])
    speculators = not drafter.config.is_official or drafter.config.layout == "speculators"
    eagle3_jax.save_drafter(drafter, out, verifier=cfg["target"] if speculators else None)
    print(f"exported {out}")
