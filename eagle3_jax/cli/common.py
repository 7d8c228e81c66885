"""What the commands that decode share: the model pair their flags name (or the built-in one),
prompts encoded as the tokenizer's chat, the defaults of their lengths and thinking budget,
the device mesh (``--mesh``, ``--rules``, ``bench``'s ``--mesh auto``) and the report files
``bench`` and ``replay`` write.

Each takes the parsed command line (``args``) and is looked up on this module when it runs,
so that a test may stand in for one (``monkeypatch.setattr(common, "load_pair", ...)``).
"""

from __future__ import annotations

from pathlib import Path

import eagle3_jax
from eagle3_jax import builtin, host, sharding
from eagle3_jax.atomic import check_output_path
from eagle3_jax.decode import encode_chat

BUILTIN_PROMPTS = 64  # the bench's default share of the built-in eval set (16 per family)
EXPERIMENT_PROMPTS = 32  # the experiment's (8 per family): its default run, 3 timed repeats, fits 20 minutes on 2 cores
DEFAULT_MAX_NEW_TOKENS = 256
AUTO_MESH, NO_MESH = "auto", "none"  # --mesh's two words besides mesh axes (see mesh)


def tokenizer(path: Path):
    """The target directory's tokenizer, if it ships one (never downloaded)."""
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer  # heavy: only where a directory ships a tokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_pair(args):
    """``(target, drafter, tokenizer, builtin)``: the given checkpoints, or the built-in pair."""
    if args.target is None:
        if args.drafter:
            raise ValueError("--drafter needs --target (without --target the built-in pair is used)")
        return (*builtin.load(args.dtype or "float32", attention_impl=args.attention), True)
    # read straight onto a mesh --mesh names (the built-in pair is placed by generate, or by bench under --mesh auto)
    on, by = mesh(args), rules(args)
    target = eagle3_jax.load_target(args.target, dtype=args.dtype, attention_impl=args.attention, mesh=on, rules=by)
    drafter = eagle3_jax.load_drafter(args.drafter, target=target, mesh=on, rules=by) if args.drafter else None
    return target, drafter, tokenizer(Path(args.target)), False


def max_new_tokens(args, is_builtin: bool) -> int:
    """``--max-new-tokens``, or by default enough for the built-in pair's longest answer (its
    12-step math thinking alone is 279 tokens), else 256."""
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    return builtin.MAX_RESPONSE_TOKENS if is_builtin else DEFAULT_MAX_NEW_TOKENS


def encode(tok, text: str, raw: bool = False) -> list[int]:
    """``text`` as the user's turn of the tokenizer's chat template (plain tokens with ``raw``
    or where the tokenizer has no template)."""
    return encode_chat(tok, [{"role": "user", "content": text}]) if tok.chat_template and not raw else tok.encode(text)


def thinking_kw(args, tok) -> dict:
    """generate's thinking arguments from the flags (the tokenizer names <think>/</think>)."""
    if args.thinking_budget is not None and tok is None:
        raise ValueError("--thinking-budget needs a tokenizer with <think> and </think> (the target directory has none)")
    return dict(tokenizer=tok, thinking_budget=args.thinking_budget, thinking_mode=args.thinking_mode,
                thinking_grace=args.thinking_grace)


def rules(args):
    """The ``--rules`` of a command (``None``: the default rules)."""
    return getattr(args, "rules", None)


def splits_over_cores(args) -> bool:
    """Whether a command splits its batches over the CPU's cores: ``bench`` (``cores`` among
    its defaults) without ``--mesh`` or with ``--mesh auto``."""
    return getattr(args, "cores", False) and getattr(args, "mesh", None) in (None, AUTO_MESH)


def mesh(args, rows: int = 1):
    """The ``--mesh`` of a command decoding ``rows`` rows at a time, built on this process's
    devices (``None``: one device): the axes ``--mesh`` names, or under ``bench``'s
    ``--mesh auto`` (its default) :func:`eagle3_jax.host.core_mesh` over the pair's weights."""
    axes = getattr(args, "mesh", None)
    if rules(args) is not None and not isinstance(axes, dict):
        raise ValueError("--rules needs --mesh AXES (e.g. --mesh data=2,tensor=4)")
    if isinstance(axes, dict):
        return sharding.make_mesh(**axes)
    if not splits_over_cores(args):
        return None
    dirs = [args.target, args.drafter] if args.target is not None else [builtin.TARGET_DIR, builtin.DRAFTER_DIR]
    return host.core_mesh(rows, dirs, as_float32=(args.dtype or ("float32" if args.target is None else None)) == "float32")


def report_outputs(args) -> tuple[Path, Path]:
    """bench's and replay's ``--json`` and ``--figure``, checked before any work: writable
    paths of the right kind, not the same file, an image format matplotlib writes."""
    json_path = check_output_path(args.json, "--json")
    figure_path = check_output_path(args.figure, "--figure")
    if json_path.absolute() == figure_path.absolute():
        raise ValueError(f"--json and --figure name the same file ({json_path})")
    formats = figure_formats()
    if figure_path.suffix.lower().lstrip(".") not in formats:
        raise ValueError(f"--figure {figure_path}: unsupported image format {figure_path.suffix!r} "
                         f"(use one of {', '.join('.' + f for f in formats)})")
    return json_path, figure_path


def figure_formats() -> list[str]:
    """The image formats matplotlib writes (``png``, ``pdf``, ``svg``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase  # the train and serve extras

    return sorted(FigureCanvasBase.get_supported_filetypes())
