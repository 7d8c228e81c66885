"""The ``eagle3-jax`` argument parser: :func:`build_parser`, its argument types (numbers
within :mod:`eagle3_jax.limits`' ranges, paths, tree budgets, ``--mesh`` and ``--rules``, token
ids, thinking budgets) and the flag groups several commands share.  A usage error raises
:class:`UsageError`, one line."""

from __future__ import annotations

import argparse
import os
import re

from eagle3_jax import budget, limits, sharding
from eagle3_jax.checkpoint import DTYPES
from eagle3_jax.cli.common import AUTO_MESH, BUILTIN_PROMPTS, DEFAULT_MAX_NEW_TOKENS, EXPERIMENT_PROMPTS, NO_MESH
from eagle3_jax.layers import ATTENTION_IMPLS
from eagle3_jax.speculation import tier_name
from eagle3_jax.tree import parse_tree


class UsageError(Exception):
    """A command-line usage error (argparse's), reported in one line."""


# what argparse takes for a negative number, not an option, after a space: -1, -.5, and (its own
# pattern has neither) exponents, infinities and comma-separated lists such as --prompt-ids -1,2
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?(,[-+]?\d+)*$|^-(inf|infinity|nan)$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors raised as :class:`UsageError` and negative numbers read as values."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message):
        flag = re.match(r"argument ([^/:]+).*: expected one argument$", message)
        if flag:  # the value began with "-": argparse read it as an option
            message += f" (a value that begins with '-' goes as {flag.group(1)}=VALUE)"
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _number(name: str, rng: limits.Range):
    """An argparse ``type``: a number within ``rng`` (one of :mod:`eagle3_jax.limits`' ranges)."""

    def parse(text: str):
        try:
            value = rng.kind(text)
        except ValueError:
            value = text
        value, error = limits.problem(value, rng)
        if isinstance(error, TypeError):
            raise argparse.ArgumentTypeError(f"{error}, got {text!r}")
        if error:
            raise argparse.ArgumentTypeError(f"{error}, got {text}")
        return value

    parse.__name__ = name  # argparse names the type in "invalid <name> value" messages
    return parse


def _path(text: str) -> str:
    """A file or directory argument: ``~`` and ``~user`` expanded as a shell would (it does not
    after ``--flag=``), so ``--target=~/models/x`` names the same directory as ``--target ~/models/x``."""
    return os.path.expanduser(text)


def _tree(text: str):
    """A tree budget: ``TOTAL,DEPTH,TOPK`` or ``chainN`` (a :class:`eagle3_jax.TreeConfig`)."""
    try:
        return parse_tree(text)
    except ValueError as e:
        detail = "" if str(e).startswith("--tree") else f" ({e})"
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOTAL,DEPTH,TOPK (e.g. 60,7,10) or chainN "
                                         f"(e.g. chain4){detail}") from None


class _Trees(argparse.Action):
    """``--tree A B ...``: each budget once (an adaptive policy takes them as its tiers)."""

    def __call__(self, parser, namespace, values, option_string=None):
        for i, tree in enumerate(values):
            if tree in values[:i]:
                raise argparse.ArgumentError(self, f"{tier_name(tree)} given twice")
        setattr(namespace, self.dest, values)


def _sharding_arg(name: str):
    """An argparse type: ``eagle3_jax.sharding``'s parser ``name`` (``parse_mesh``,
    ``parse_rules``), its ``ValueError`` as the argument's error."""

    def parse(text: str) -> dict:
        try:
            return getattr(sharding, name)(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


class _MergeRules(argparse.Action):
    """``--rules`` given more than once: the overrides together (an axis once)."""

    def __call__(self, parser, namespace, values, option_string=None):
        rules = dict(getattr(namespace, self.dest, None) or {})
        twice = sorted(set(rules) & set(values))
        if twice:
            raise argparse.ArgumentError(self, f"axis {twice[0]!r} given twice")
        setattr(namespace, self.dest, {**rules, **values})


def _mesh_arg(text: str):
    """``--mesh``: ``auto``, ``none`` or mesh axes (``data=2,tensor=4``)."""
    word = text.strip().lower()
    return word if word in (AUTO_MESH, NO_MESH) else _sharding_arg("parse_mesh")(text)


def _token_ids(text: str) -> list[int]:
    """``--prompt-ids``: comma-separated non-negative token ids."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative token ids (e.g. 1,2,3), got {text!r}")
    return ids


def _budget(text: str):
    """A thinking budget: a non-negative integer or ``unlimited``."""
    if text.lower() in ("unlimited", "none", "inf"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or 'unlimited', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _speculation(text: str):
    """``--speculation``: ``auto``, ``off`` or one tier (TOTAL,DEPTH,TOPK or chainN)."""
    return text if text in ("auto", "off") else _tree(text)


def _compile_cache_arg(p):
    """``--compile-cache``, for the commands that compile."""
    p.add_argument("--compile-cache", type=_path, default=None, metavar="DIR",
                   help="keep compiled XLA programs in DIR, so that the next start skips compiling them (default: "
                        "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/eagle3-jax/xla; off: no cache)")


def _pair_args(p):
    """The model pair's flags, for every command that decodes."""
    p.add_argument("--target", type=_path, help="Hugging Face target checkpoint directory (default: the built-in pair)")
    p.add_argument("--drafter", type=_path, help="EAGLE-3 drafter checkpoint directory (omit for vanilla decoding)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="target weights' dtype (default: the checkpoint's; float32 built in)")


def _serve_common(p):
    """The pair and the slots, for ``serve`` and ``replay``."""
    _pair_args(p)
    p.add_argument("--attention", default="xla", choices=ATTENTION_IMPLS, help="target attention (as for generate)")
    p.add_argument("--max-batch", type=_number("max-batch", limits.POSITIVE), default=8, help="slots decoded together")
    p.add_argument("--max-queue", type=_number("max-queue", limits.NON_NEGATIVE), default=64,
                   help="requests that may wait beyond the free slots before new ones get 429 (0: no waiting line, "
                        "a request is taken only into a free slot)")
    p.add_argument("--max-len", type=_number("max-len", limits.MAX_LEN), default=None,
                   help="tokens per slot, prompt included (default: the target's max_position_embeddings, at most 4096)")
    p.add_argument("--rounds-per-dispatch", type=_number("rounds-per-dispatch", limits.POSITIVE), default=16,
                   help="the most decode rounds per host sync (while no request waits)")
    p.add_argument("--dispatch-ms", type=_number("dispatch-ms", limits.POSITIVE_FLOAT), default=None,
                   help="also at most the rounds that take this long, at the engine's dearest round (measured at "
                        "start-up; default: no time bound)")
    p.add_argument("--reasoning-effort-budgets", type=_budget, nargs=3, metavar=("LOW", "MEDIUM", "HIGH"),
                   help="thinking budgets of reasoning_effort low/medium/high (default: 16 64 unlimited for the "
                        "built-in pair, else 256 1024 unlimited)")
    p.add_argument("--max-body-bytes", type=_number("max-body-bytes", limits.POSITIVE), default=None, metavar="N",
                   help="larger request bodies get 413 before they are parsed (default: sized from --max-len and the "
                        "tokenizer: the longest prompt text that can fit, as JSON)")
    _compile_cache_arg(p)
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")


def _common(p, mesh: bool = True):
    """The flags of the decoding commands (``generate``, ``bench``, ``experiment``); ``mesh``: with
    ``--mesh`` and ``--rules``."""
    _pair_args(p)
    p.add_argument("--attention", default="xla", choices=ATTENTION_IMPLS,
                   help="target attention: xla, or pallas (the tree-attention kernel where one runs: TPU, Hopper "
                        "GPU with bfloat16; XLA elsewhere); *_interpret: a kernel in its CPU interpreter (slow)")
    p.add_argument("--max-new-tokens", type=_number("max-new-tokens", limits.MAX_NEW_TOKENS), default=None,
                   help=f"default {DEFAULT_MAX_NEW_TOKENS}; generate and experiment on the built-in pair: enough for "
                        "its longest answer")
    p.add_argument("--top-p", type=_number("top-p", limits.TOP_P), default=1.0,
                   help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=_number("top-k", limits.TOP_K), default=0, help="0: no top-k")
    p.add_argument("--thinking-budget", type=_number("thinking-budget", limits.THINKING_BUDGET), default=None,
                   metavar="B", help="thinking tokens allowed before the end of thinking is forced (default: "
                                     "unlimited; needs a tokenizer with <think>/</think>)")
    p.add_argument("--thinking-mode", choices=budget.MODES, default="hard",
                   help="hard: force at B; soft: the model may close by itself within --thinking-grace more tokens")
    p.add_argument("--thinking-grace", type=_number("thinking-grace", limits.THINKING_GRACE), default=16, metavar="G",
                   help="soft mode's grace in tokens (default 16)")
    p.add_argument("--seed", type=_number("seed", limits.SEED), default=0)
    _compile_cache_arg(p)
    if mesh:  # decoding on a mesh: generate and bench (the experiment runs on one device)
        p.add_argument("--mesh", type=_mesh_arg, default=None, metavar="{auto,none,AXES}",
                       help="decode on a device mesh, e.g. data=2,tensor=4: weights over tensor, KV caches over KV "
                            "heads, the batch over data (on CPU, simulate devices with "
                            "XLA_FLAGS=--xla_force_host_platform_device_count=8); none or auto: one device, except "
                            "that bench's default, auto, splits a batch over a CPU's cores: the eagle3-jax program "
                            "gives JAX one CPU device per core and bench decodes on data=N, N the most devices that "
                            "divide the batch, where the weights' copies fit in a quarter of the memory")
        p.add_argument("--rules", type=_sharding_arg("parse_rules"), action=_MergeRules, default=None, metavar="AXIS=MESH_AXES",
                       help="with --mesh: where logical axes go instead of the default rules, e.g. vocab=none "
                            "(replicate a vocabulary the tensor axis does not divide) or mlp=fsdp+tensor")
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")


def build_parser() -> argparse.ArgumentParser:
    """The ``eagle3-jax`` argument parser (usage errors raise :class:`UsageError`)."""
    parser = _Parser(prog="eagle3-jax", description="EAGLE-3 speculative decoding on JAX. Errors are one line on "
                                                    "stderr with exit status 2; --debug shows the traceback.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="describe a target or drafter checkpoint directory")
    info.add_argument("path", type=_path)
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")

    conv = sub.add_parser("convert", help="re-save an EAGLE-3 drafter in the official or vLLM speculators layout")
    conv.add_argument("path", type=_path, help="the drafter directory (official, SpecForge/SGLang/vLLM or speculators)")
    conv.add_argument("out", type=_path, help="the directory to write (replaced whole)")
    conv.add_argument("--to", choices=("official", "speculators"), required=True, help="the layout to write")
    conv.add_argument("--target", type=_path, default=None,
                      help="the target directory: its embedding where the drafter has none of its own, and "
                           "the verifier a speculators export names")
    conv.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights' dtype (default float32)")
    conv.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")

    temperature = _number("temperature", limits.TEMPERATURE)
    gen = sub.add_parser("generate", help="answer a prompt with EAGLE-3 (the built-in pair by default) and "
                                          "compare with vanilla decoding")
    gen.add_argument("prompt", nargs="?", help="prompt text (chat template applied when the tokenizer has one)")
    _common(gen)
    gen.add_argument("--prompt", dest="prompt_flag", help="prompt text (same as the positional argument)")
    gen.add_argument("--temperature", type=temperature, default=0.0, help="0: greedy (>= 0)")
    gen.add_argument("--tree", type=_tree, help="tree budget TOTAL,DEPTH,TOPK (e.g. 60,7,10) or chainN "
                                                "(default: the built-in pair's best, else 60,7,10)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--prompt-ids", type=_token_ids, help="comma-separated prompt token ids")
    gen.add_argument("--no-compare", action="store_true", help="skip the vanilla run (no speedup figure)")

    bench = sub.add_parser("bench", help="vanilla vs EAGLE-3 on the same prompts, in one process "
                                         "(the built-in pair and its eval set by default)")
    _common(bench)
    bench.add_argument("--temperature", type=temperature, nargs="+", help="one report per temperature (default: 0 "
                                                                          "and 0.7 for the built-in pair, else 0)")
    bench.add_argument("--tree", type=_tree, nargs="+", action=_Trees, help="tree budgets TOTAL,DEPTH,TOPK or chainN")
    bench.add_argument("--prompts", type=_path, help="JSON list of prompts (token-id lists or strings)")
    bench.add_argument("--num-prompts", type=_number("num-prompts", limits.POSITIVE),
                       help=f"first N eval tasks of the built-in pair (default {BUILTIN_PROMPTS}: the families take "
                            "turns, so 16 each), or N random 16-token prompts "
                            "when --target has no --prompts (default 4)")
    bench.add_argument("--batch-size", type=_number("batch-size", limits.POSITIVE), default=1)
    bench.add_argument("--repeats", type=_number("repeats", limits.POSITIVE), default=1,
                       help="time each setting as the fastest of N passes (each pass runs every mode on a batch before the next)")
    bench.add_argument("--json", type=_path, default="bench.json",
                       help="write the report here (missing directories are created)")
    bench.add_argument("--figure", type=_path, default="bench.png",
                       help="write the figure here (.png, .pdf, .svg, ...; missing directories are created)")
    bench.add_argument("--max-new-tokens-sweep", type=_number("max-new-tokens-sweep", limits.MAX_NEW_TOKENS), nargs="+",
                       metavar="N", help="one report per value (the cache grows with it), instead of --max-new-tokens")
    bench.add_argument("--adaptive", action="store_true",
                       help="also run the adaptive policy over the --tree budgets (and no drafting) as tiers")
    bench.add_argument("--cost", action="store_true",
                       help="report where the time goes instead: decode_step by cache size and batch, and the decode "
                            "loop's parts and cache copies per --max-new-tokens-sweep value (default 64 440)")
    bench.set_defaults(cores=True)  # --mesh auto: batches split over a CPU's cores

    exp = sub.add_parser("experiment", help="the two-budget experiment: thinking budget B swept with speculation "
                                            "off, then vanilla vs each tier vs adaptive at chosen B; writes a report")
    _common(exp, mesh=False)
    exp.add_argument("--budgets", type=_budget, nargs="+", default=None, metavar="B",
                     help="step 1's thinking budgets (default 0 8 16 32 64 128 unlimited)")
    exp.add_argument("--chosen", type=_budget, nargs="+", default=None, metavar="B",
                     help="step 2's budgets (default 16 64 unlimited)")
    exp.add_argument("--tree", type=_tree, nargs="+", action=_Trees, help="static tiers (default chain4 chain6 16,4,4)")
    exp.add_argument("--prompts", type=_path,
                     help="JSON list of prompts (token-id lists or strings); default: the built-in eval set")
    exp.add_argument("--num-prompts", type=_number("num-prompts", limits.POSITIVE),
                     help=f"first N prompts (default: all --prompts, or the built-in eval set's first {EXPERIMENT_PROMPTS})")
    exp.add_argument("--batch-size", type=_number("batch-size", limits.POSITIVE), default=1)
    exp.add_argument("--sampled-temperature", type=temperature, default=0.7,
                     help="also compare sampled accuracy at this temperature (0: greedy only)")
    exp.add_argument("--replay-rates", type=_number("replay-rates", limits.POSITIVE_FLOAT), nargs="*",
                     default=[4.0, 16.0, 64.0], metavar="R",
                     help="step 3: arrival rates (requests/s) replayed against a loopback server (default 4 16 64; "
                          "none: skip step 3)")
    exp.add_argument("--replay-requests", type=_number("replay-requests", limits.POSITIVE), default=24,
                     help="requests per mode and rate in step 3")
    exp.add_argument("--repeats", type=_number("repeats", limits.POSITIVE), default=3,
                     help="timed passes of steps 1 and 2, the rows taking turns (default 3): each timing is the median "
                          "with its min-max")
    exp.add_argument("--keep-policy-state", action="store_true",
                     help="carry the adaptive policy's learned state from call to call in the order run (default: "
                          "reset before each row and repeat)")
    exp.add_argument("--out", type=_path, default="experiment", help="report directory (report.md, report.json, figures)")

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (the built-in "
                                       "pair by default)")
    _serve_common(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=_number("port", limits.PORT), default=8000)
    srv.add_argument("--speculation", type=_speculation, default="auto",
                     help="auto (the adaptive policy over a few tiers), off (vanilla), or one tier TOTAL,DEPTH,TOPK "
                          "or chainN")
    srv.add_argument("--served-model-name", help="the model id clients name (default: builtin, or the target "
                                                 "directory's name)")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))

    rep = sub.add_parser("replay", help="Poisson arrivals of the eval prompts against a loopback server, for vanilla, "
                                        "each tier and adaptive: throughput, goodput, TTFT/TPOT, the crossover")
    _serve_common(rep)
    rep.add_argument("--rate", type=_number("rate", limits.POSITIVE_FLOAT), nargs="+", required=True,
                     metavar="R", help="arrival rates in requests per second")
    rep.add_argument("--requests", type=_number("requests", limits.POSITIVE), default=64, metavar="N",
                     help="requests per mode and rate (the eval prompts, cycled)")
    rep.add_argument("--tree", type=_tree, nargs="+", action=_Trees, help="static tiers (default chain4 chain6 16,4,4)")
    rep.add_argument("--max-tokens", type=_number("max-tokens", limits.MAX_NEW_TOKENS), default=256, help="per request")
    rep.add_argument("--temperature", type=_number("temperature", limits.TEMPERATURE), default=0.0)
    rep.add_argument("--ttft-slo", type=_number("ttft-slo", limits.POSITIVE_FLOAT), default=1.0, metavar="S",
                     help="goodput counts requests whose time to first token is at most S seconds")
    rep.add_argument("--tpot-slo", type=_number("tpot-slo", limits.POSITIVE_FLOAT), default=0.02, metavar="S",
                     help="... and whose time per output token is at most S seconds")
    rep.add_argument("--max-seconds", type=_number("max-seconds", limits.POSITIVE_FLOAT), default=120.0,
                     help="wall-clock bound per mode and rate (unfinished requests count as failed)")
    rep.add_argument("--seed", type=_number("seed", limits.SEED), default=0)
    rep.add_argument("--json", type=_path, default="replay.json", help="write the report here")
    rep.add_argument("--figure", type=_path, default="replay.png", help="goodput vs arrival rate per mode")

    train = sub.add_parser("train", help="train a drafter: prepare | regenerate | vocab | fit | export | all")
    train.add_argument("step", choices=["prepare", "regenerate", "vocab", "fit", "export", "all"])
    train.add_argument("--config", type=_path, required=True, help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, read as the key's type, e.g. fit.lr=1e-4 "
                                                    "(anywhere on the line; unknown keys are refused)")
    train.add_argument("--no-resume", action="store_true",
                       help="fit (or all) starts a new run even if work_dir holds checkpoints: the earlier run's "
                            "ckpt/, best/, best.json, metrics.jsonl and export/ are first moved to "
                            "work_dir/previous_runs/run-<date-time>/ (never deleted or overwritten)")
    train.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")

    pl = sub.add_parser("plan", help="dry run of a training config on a mesh: per-device bytes of weights, KV "
                                     "caches, drafter, optimizer state and activations (no devices needed)")
    pl.add_argument("--config", type=_path, required=True, help="YAML config (see configs/)")
    pl.add_argument("overrides", nargs="*", help="key=value config overrides, as for train")
    pl.add_argument("--mesh", help="mesh axes, e.g. data=2,tensor=4 (default: the config's mesh)")
    pl.add_argument("--batch", type=_number("batch", limits.POSITIVE), help="KV-cache batch (default: regenerate.batch_size)")
    pl.add_argument("--seq-len", type=_number("seq-len", limits.POSITIVE), help="KV-cache length (default: seq_len)")
    pl.add_argument("--device-memory", help="memory of one device, e.g. 16GiB: say whether decode and fit fit")
    pl.add_argument("--target-config", type=_path, help="the target's config.json, where the config's target directory is "
                                            "not on this machine (default: configs/targets/<name>.json beside it)")
    pl.add_argument("--topology", help="compile, not estimate: the config's decode loops, prefill, server dispatch and "
                                       "fit step for this TPU topology (e.g. v5e:2x4, v5p:2x2x2, v6e:2x4; 'config': the "
                                       "config's own; needs the 'tpu' extra, no TPU): per-device memory, fits, flops, "
                                       "bytes, roofline times")
    pl.add_argument("--tau", type=_number("tau", limits.Range(float, lo=1)),
                    help="with --topology: committed tokens per round for the predicted speedup (default: the "
                         "run's recorded acceptance, else 3)")
    pl.add_argument("--prompt-len", type=_number("prompt-len", limits.POSITIVE),
                    help="with --topology: prompt tokens of the decode programs (default: seq_len / 2)")
    pl.add_argument("--attention", choices=("xla", "pallas"), default="pallas",
                    help="with --topology: the decode programs' attention (default: pallas, the Mosaic TPU kernel)")
    pl.add_argument("--programs", help="with --topology: which of decode,slots,fit to compile (default: all)")
    pl.add_argument("--json", type=_path, help="with --topology: where to write the report (default: "
                                               "plan-<topology>.json)")
    _compile_cache_arg(pl)
    pl.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    return parser
