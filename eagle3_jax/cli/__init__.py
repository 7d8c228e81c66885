"""The ``eagle3-jax`` command line: an argparse parser (``_parser``) and calls.

:func:`main` parses the command line, then calls the command's function, ``cmd_<command>``,
from the module ``COMMANDS`` names, imported only then, so that a command loads only what it
needs (``serve`` the ``serve`` extra, ``train`` the ``train`` extra):

* ``_generate``: ``info``, ``convert``, ``generate``;
* ``_bench``: ``bench``, ``experiment``;
* ``_serve``: ``serve``, ``replay``;
* ``_train``: ``train``; ``_plan``: ``plan``;
* :mod:`eagle3_jax.cli.common`: what the decoding commands share (the model pair, prompt
  encoding, the mesh, the report files).

An error a user's input causes is one line on stderr with exit status 2 (``--debug``: the
traceback).  ``python -m eagle3_jax.cli`` runs :func:`program`.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import zipfile

import yaml
from safetensors import SafetensorError

from eagle3_jax import host, topology
from eagle3_jax.cli import common
from eagle3_jax.cli._parser import UsageError, build_parser
from eagle3_jax.sharding import SplitError

__all__ = ["COMMANDS", "INPUT_ERRORS", "UsageError", "build_parser", "main", "program", "run"]

# errors a user's input can cause: one line on stderr, exit 2 (--debug: the traceback)
INPUT_ERRORS = (OSError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, pickle.UnpicklingError,
                zipfile.BadZipFile, EOFError)

# each command's module in this package, imported when the command runs; it defines cmd_<command>(args)
COMMANDS = {"info": "_generate", "convert": "_generate", "generate": "_generate", "bench": "_bench",
            "experiment": "_bench", "serve": "_serve", "replay": "_serve", "train": "_train",
            "plan": "_plan"}


def run(args) -> int:
    """Runs the parsed command ``args.command`` (its module imported now); returns its exit status."""
    module = importlib.import_module(f"{__name__}.{COMMANDS[args.command]}")
    return getattr(module, f"cmd_{args.command}")(args)


def _one_line(e: BaseException) -> str:
    """An exception as one line: its message (a KeyError's unquoted), else its type."""
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        msg = e.args[0]
    elif isinstance(e, OSError) and e.filename is not None and e.strerror:
        msg = f"{e.filename}: {e.strerror}"
    else:
        msg = str(e)
    msg = " ".join(msg.split())
    if not isinstance(e, (ValueError, KeyError, OSError)) or not msg:
        msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return msg


def main(argv=None, cores: bool | None = None) -> int:
    """Runs the command line; returns the exit status (2 for any input error, one line on
    stderr; 130 when interrupted).  ``--debug`` re-raises errors with their traceback.
    ``cores``: one JAX CPU device per core for ``bench``'s ``--mesh auto``
    (:func:`eagle3_jax.host.use_cores`); by default when ``argv`` is ``None`` (the program's
    own command line), so that a caller passing its own arguments keeps its JAX devices."""
    topology.keep_cpu_default()  # libtpu installed on a host without TPUs: the CPU, quietly
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command in ("train", "plan") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code or 0
    if ((argv is None) if cores is None else cores) and common.splits_over_cores(args):
        host.use_cores()
    try:
        if hasattr(args, "compile_cache"):  # the commands that compile: serve, replay, generate, bench, experiment, plan
            host.use_compile_cache(args.compile_cache)
        return run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"eagle3-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        known = isinstance(e, INPUT_ERRORS + (SafetensorError, yaml.YAMLError))
        hint = ""
        if isinstance(e, SplitError) and hasattr(args, "rules"):  # a command that takes --rules
            rules = {**(args.rules or {}), e.axis: None}
            hint = " (on the command line: --rules " + ",".join(
                f"{k}={'+'.join(v.mesh_axes) if v else 'none'}" for k, v in rules.items()) + ")"
        print(f"eagle3-jax {args.command}: {'error' if known else 'internal error'}: {_one_line(e)}{hint}"
              + ("" if known else " (rerun with --debug for the traceback)"), file=sys.stderr)
        return 2 if known else 1


def program() -> int:
    """The ``eagle3-jax`` program (``python -m eagle3_jax.cli``): :func:`main` on ``sys.argv``,
    with one JAX CPU device per core for ``bench``'s batches."""
    return main(cores=True)
