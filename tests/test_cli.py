"""The command line (:mod:`eagle3_jax.cli`): its parser, and on malformed input one line on
stderr naming the argument or file, exit status 2, never a traceback (``--debug`` shows it);
output paths checked before the work, and a finished benchmark is never thrown away."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_jax import checkpoint, cli, cost
from eagle3_jax.cli import common, main
from helpers import FIXTURES

ROOT = Path(__file__).parent.parent
TARGET = FIXTURES / "target_tiny"
TINY = ROOT / "configs" / "tiny.yaml"


def _one_line_error(capsys, argv, *named, code=2):
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == code, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for part in named:
        assert part in err, err
    return err


def _files(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "config.json").write_text("{oops")
    (tmp_path / "list_json").mkdir()
    (tmp_path / "list_json" / "config.json").write_text("[1, 2]")
    return {"tmp": tmp_path, "target": TARGET, "tiny": TINY}


# each: argv (formatted with tmp/target/tiny) and what the one-line message must name
CASES = [
    # generate: sampling and decoding arguments
    (["generate", "--prompt-ids", "1", "--top-p", "0"], ["--top-p", "> 0"]),
    (["generate", "--prompt-ids", "1", "--top-p", "1.5"], ["--top-p", "<= 1"]),
    (["generate", "--prompt-ids", "1", "--top-p", "nan"], ["--top-p", "finite"]),
    (["generate", "--prompt-ids", "1", "--temperature", "-1"], ["--temperature", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--temperature", "nan"], ["--temperature", "finite"]),
    (["generate", "--prompt-ids", "1", "--temperature", "inf"], ["--temperature", "finite"]),
    (["generate", "--prompt-ids", "1", "--temperature", "hot"], ["--temperature", "'hot'"]),
    (["generate", "--prompt-ids", "1", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["generate", "--prompt-ids", "1", "--max-new-tokens", "1.5"], ["--max-new-tokens", "integer"]),
    (["generate", "--prompt-ids", "1", "--top-k", "-1"], ["--top-k", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--seed", "-1"], ["--seed", ">= 0"]),
    (["generate", "--prompt-ids", "1", "--seed", str(2 ** 32)], ["--seed", "< 4294967296"]),
    (["generate", "--prompt-ids", "1", "--tree", "chainx"], ["--tree", "chainN"]),
    (["generate", "--prompt-ids", "1", "--tree", "60,7"], ["--tree", "TOTAL,DEPTH,TOPK"]),
    (["generate", "--prompt-ids", "1", "--tree", "0,0,0"], ["--tree", "total_tokens >= 2"]),
    (["generate", "--prompt-ids", "1", "--tree", "500,2,3"], ["--tree", "exceeds"]),
    (["generate", "--prompt-ids", "1,a"], ["--prompt-ids", "'1,a'"]),
    (["generate", "--prompt-ids", "-3"], ["--prompt-ids", "non-negative"]),
    (["generate", "--prompt-ids", ""], ["--prompt-ids"]),
    (["generate", "--prompt-ids", "1", "--dtype", "fp8"], ["--dtype", "'fp8'"]),
    (["generate", "--prompt-ids", "1", "--attention", "flash"], ["--attention", "'flash'"]),
    (["generate", "--prompt-ids", "1", "--bogus"], ["--bogus"]),
    (["generate", "--prompt-ids", "1", "--mesh", "data=1", "--rules", "nope=none"], ["--rules", "'nope'"]),
    (["generate", "--prompt-ids", "1", "--mesh", "data=1", "--rules", "vocab=pipe"], ["--rules", "mesh axes"]),
    (["generate", "--prompt-ids", "1", "--mesh", "data=1", "--rules", "vocab=none", "--rules", "mlp=none,vocab=tensor"],
     ["--rules", "'vocab' given twice"]),
    (["generate", "--prompt-ids", "1", "--target", "{target}", "--rules", "vocab=none"], ["--rules needs --mesh"]),
    (["experiment", "--mesh", "data=2"], ["--mesh"]),
    (["experiment", "--repeats", "0"], ["--repeats", ">= 1"]),
    # generate: prompts and checkpoints
    (["generate"], ["give a prompt"]),
    (["generate", "hello", "--prompt-ids", "1,2"], ["PROMPT", "--prompt-ids"]),
    (["generate", "hello", "--prompt", "again"], ["PROMPT", "--prompt"]),
    (["generate", "--prompt-ids", "1", "--drafter", "{tmp}"], ["--drafter", "--target"]),
    (["generate", "--prompt-ids", "1", "--target", "{tmp}/nowhere"], ["nowhere", "config.json"]),
    (["generate", "--prompt-ids", "1,5000", "--target", "{target}"], ["--prompt-ids", "5000", "0..1023"]),
    (["generate", "hello", "--target", "{target}"], ["--target", "no tokenizer", "--prompt-ids"]),
    # generate: prompts with nothing to answer, or not text, refused by name before anything loads
    (["generate", ""], ["PROMPT is empty"]),
    (["generate", "   "], ["PROMPT is only whitespace"]),
    (["generate", "", "--raw"], ["PROMPT is empty"]),
    (["generate", "--prompt", "\n\t "], ["--prompt is only whitespace"]),
    (["generate", "caf\udce9"], ["PROMPT", "encoding error", "U+DCE9", "0xE9"]),
    # numbers after a space that argparse's own pattern reads as options
    (["generate", "--prompt-ids", "1", "--temperature", "-1e-3"], ["--temperature", ">= 0", "-1e-3"]),
    (["generate", "--prompt-ids", "1", "--temperature", "-inf"], ["--temperature", "finite"]),
    (["generate", "--prompt-ids", "1", "--top-p", "-1E2"], ["--top-p", "> 0"]),
    (["generate", "--prompt-ids", "-1,2"], ["--prompt-ids", "non-negative", "'-1,2'"]),
    (["generate", "--prompt", "-x"], ["--prompt", "--prompt=VALUE"]),
    # the compilation cache
    (["generate", "--prompt-ids", "1", "--compile-cache", "{tmp}/afile"], ["--compile-cache", "afile", "off"]),
    (["serve", "--max-body-bytes", "0"], ["--max-body-bytes", ">= 1"]),
    # bench: counts, outputs (checked before anything loads), prompts
    (["bench", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    (["bench", "--repeats", "0"], ["--repeats"]),
    (["bench", "--num-prompts", "0"], ["--num-prompts"]),
    (["bench", "--temperature", "0", "-0.5"], ["--temperature", ">= 0"]),
    (["bench", "--tree", "60,7,10", "chain0"], ["--tree", "'chain0'"]),
    (["bench", "--tree", "chainx"], ["--tree", "'chainx'", "chainN"]),
    (["bench", "--tree", "chain4.0"], ["--tree", "'chain4.0'", "chainN"]),
    (["bench", "--tree", "chain4", "16,4,4", "chain4", "--adaptive"], ["--tree", "chain4 given twice"]),
    (["experiment", "--tree", "16,4,4", "16,4,4"], ["--tree", "16,4,4 given twice"]),
    (["replay", "--tree", "chain6", "chain6"], ["--tree", "chain6 given twice"]),
    (["bench", "--json", "{tmp}"], ["--json", "is a directory"]),
    (["bench", "--json", "{tmp}/afile/out.json"], ["--json", "afile", "not a directory"]),
    (["bench", "--json", "{tmp}/r.json", "--figure", "{tmp}/afile/f.png"], ["--figure", "afile"]),
    (["bench", "--json", "{tmp}/r.json", "--figure", "{tmp}/f.xyz"], ["--figure", "'.xyz'", ".png"]),
    (["bench", "--json", "{tmp}/same.png", "--figure", "{tmp}/same.png"], ["--json", "--figure", "same.png"]),
    (["bench", "--json", "{tmp}/r.json", "--figure", "{tmp}/f.png", "--target", "{target}"], ["--drafter"]),
    (["bench", "--json", "{tmp}/r.json", "--figure", "{tmp}/f.png", "--prompts", "{tmp}/p.json"],
     ["--prompts", "p.json"]),
    # info
    (["info", "{tmp}/nowhere"], ["nowhere", "config.json"]),
    (["info", "{tmp}/bad_json"], ["bad_json/config.json", "not valid JSON"]),
    (["info", "{tmp}/list_json"], ["list_json/config.json", "JSON object"]),
    (["info", "{tmp}/afile"], ["afile"]),
    # train
    (["train", "fit", "--config", "{tmp}/nope.yaml"], ["--config", "nope.yaml"]),
    (["train", "fit", "--config", "{tiny}", "fit.lrr=1e-4"], ["'fit.lrr'", "'fit.lr'"]),
    (["train", "fit", "--config", "{tiny}", "fit.lr=fast"], ["fit.lr", "'fast'"]),
    (["train", "prepare", "--config", "{tiny}", "--no-resume"], ["--no-resume"]),
    (["train", "fit"], ["--config"]),
    (["train", "fitt", "--config", "{tiny}"], ["'fitt'"]),
    ([], ["command"]),
]


@pytest.mark.parametrize("argv, named", CASES, ids=[" ".join(a) or "none" for a, _ in CASES])
def test_bad_input_is_one_line(tmp_path, capsys, argv, named):
    paths = _files(tmp_path)
    _one_line_error(capsys, [a.format(**paths) for a in argv], *[n.format(**paths) for n in named])


@pytest.mark.parametrize("exc, named, code", [
    (PermissionError(13, "Permission denied", "/data/weights.bin"), ["/data/weights.bin: Permission denied"], 2),
    (IsADirectoryError(21, "Is a directory", "/data/x"), ["/data/x"], 2),
    (ZeroDivisionError("division by zero"), ["ZeroDivisionError"], 2),
    (TypeError("hidden_size must be an int"), ["TypeError", "hidden_size"], 2),
    (pickle.UnpicklingError("w.bin: refusing to load global os.system"), ["w.bin", "os.system"], 2),
    (KeyError("config.json: key 'vocab_size' is missing"), ["config.json: key 'vocab_size'"], 2),
    (ValueError("first line\n  second line"), ["first line second line"], 2),
    (json.JSONDecodeError("Expecting value", "x", 0), ["Expecting value"], 2),
    (AttributeError("'list' object has no attribute 'get'"), ["internal error", "--debug"], 1),
])
def test_top_level_errors_are_one_line(monkeypatch, capsys, exc, named, code):
    def boom(path):
        raise exc

    monkeypatch.setattr(checkpoint, "describe_checkpoint", boom)
    _one_line_error(capsys, ["info", "somewhere"], *named, code=code)


def test_safetensors_error_is_one_line(tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    def boom(path):
        raise SafetensorError("model.safetensors: header too large")

    monkeypatch.setattr(checkpoint, "describe_checkpoint", boom)
    _one_line_error(capsys, ["info", "x"], "model.safetensors")


def test_interrupt_exits_130(monkeypatch, capsys):
    def boom(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "describe_checkpoint", boom)
    assert main(["info", "x"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        main(["info", str(tmp_path / "nowhere"), "--debug"])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "eagle3_jax.cli", "info", str(tmp_path / "nowhere"), "--debug"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode != 0 and "Traceback" in res.stderr and "FileNotFoundError" in res.stderr


def test_bench_refuses_an_unwritable_directory(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: make access() answer as the mode bits say
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: not (Path(p) == locked and mode & os.W_OK) and real(p, mode))
    try:
        _one_line_error(capsys, ["bench", "--json", locked / "r.json"], "--json", "not writable")
    finally:
        locked.chmod(0o755)


# ------------------------------------------------------------------ a finished benchmark is kept
REPORT = {"settings": {"temperature": 0.0}, "vanilla": {},
          "eagle3": [{"tree": {"name": "chain3"}, "speedup": 1.5, "tau": 2.5, "acceptance_rate": [0.8, 0.6, 0.4]}]}


@pytest.fixture
def fake_bench(monkeypatch):
    """bench with its models and measurement stubbed out (the output handling is real)."""
    from eagle3_jax import bench

    target = SimpleNamespace(config=SimpleNamespace(vocab_size=16))
    monkeypatch.setattr(common, "load_pair", lambda args: (target, object(), None, False))
    calls = []

    def run_bench(*args, **kw):
        calls.append(kw)
        return REPORT

    monkeypatch.setattr(bench, "run_bench", run_bench)
    return calls


def test_bench_creates_missing_output_directories(tmp_path, capsys, fake_bench):
    out, fig = tmp_path / "a" / "b" / "r.json", tmp_path / "c" / "f.png"
    assert main(["bench", "--target", "t", "--drafter", "d", "--num-prompts", "1", "--json", str(out),
                 "--figure", str(fig)]) == 0
    assert json.loads(out.read_text())["reports"] == [REPORT] and fig.stat().st_size > 0
    assert not list(out.parent.glob(".*tmp"))


def test_paths_after_an_equals_sign_expand_the_home_directory(tmp_path, monkeypatch, capsys, fake_bench):
    """``--flag=~/x`` (which no shell expands) names the same file as ``--flag ~/x`` would."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # where an unexpanded ~/out/ would land
    assert main(["bench", "--target=~/t", "--drafter=~/d", "--num-prompts", "1", "--json=~/out/r.json",
                 "--figure=~/out/f.png"]) == 0
    assert json.loads((tmp_path / "out" / "r.json").read_text())["reports"] == [REPORT]
    assert (tmp_path / "out" / "f.png").stat().st_size > 0 and not (tmp_path / "~").exists()
    home = tmp_path / "home"
    home.mkdir()
    (home / "ckpt").symlink_to(TARGET)
    monkeypatch.setenv("HOME", str(home))
    capsys.readouterr()
    assert main(["info", "--json", "~/ckpt"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "target"


def test_bench_report_survives_an_unwritable_json(tmp_path, capsys, monkeypatch, fake_bench):
    """The directory is fine when checked but gone (a file in its place) once the benchmark
    is done: the report goes to stdout and the one-line error says so."""
    from eagle3_jax import bench

    out = tmp_path / "out" / "r.json"

    def run_bench(*args, **kw):
        (tmp_path / "out").write_text("in the way")
        return REPORT

    monkeypatch.setattr(bench, "run_bench", run_bench)
    rc = main(["bench", "--target", "t", "--drafter", "d", "--num-prompts", "1", "--json", str(out),
               "--figure", str(tmp_path / "f.png")])
    captured = capsys.readouterr()
    assert rc == 2 and "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "--json" in captured.err and "report is on stdout" in captured.err
    assert json.loads(captured.out)["reports"] == [REPORT]


def _failing_savefig(monkeypatch):
    """``Figure.savefig`` that writes part of a figure into its target and then fails (a full disk)."""
    from matplotlib.figure import Figure

    def savefig(self, fname, **kw):
        if hasattr(fname, "write"):
            fname.write(b"PART")
        else:
            Path(fname).write_bytes(b"PART")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", savefig)


def test_bench_figure_is_written_atomically(tmp_path, capsys, monkeypatch, fake_bench):
    """A figure whose write fails leaves the old one whole; the error names --figure and the
    report (written first) is kept."""
    out, fig = tmp_path / "r.json", tmp_path / "f.png"
    fig.write_bytes(b"OLD FIGURE")
    _failing_savefig(monkeypatch)
    err = _one_line_error(capsys, ["bench", "--target", "t", "--drafter", "d", "--num-prompts", "1", "--json", out,
                                   "--figure", fig], "--figure", "No space left", str(out))
    assert fig.read_bytes() == b"OLD FIGURE", err
    assert json.loads(out.read_text())["reports"] == [REPORT]
    assert not list(tmp_path.glob(".*tmp*"))


def test_bench_cost_report_survives_an_unwritable_json(tmp_path, capsys, monkeypatch, fake_bench):
    """bench --cost: a report that cannot be written goes to stdout, the error names --json."""
    out = tmp_path / "out" / "r.json"

    def cost_report(*args, **kw):
        (tmp_path / "out").write_text("in the way")
        return {"rows": [1, 2]}

    monkeypatch.setattr(cost, "report", cost_report)
    monkeypatch.setattr(common, "mesh", lambda args, *rest: None)
    rc = main(["bench", "--target", "t", "--drafter", "d", "--num-prompts", "1", "--cost", "--json", str(out),
               "--figure", str(tmp_path / "f.png")])
    captured = capsys.readouterr()
    assert rc == 2 and "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "--json" in captured.err and "report is on stdout" in captured.err
    assert json.loads(captured.out)["cost"] == {"rows": [1, 2]}


REPLAY_REPORT = {"rates": [1.0], "ttft_slo_s": 1.0, "tpot_slo_s": 0.05, "crossover_rate": None,
                 "modes": {"vanilla": [{"rate": 1.0, "goodput": 0.5, "tokens_per_second": 10.0,
                                        "tpot_s": {"p50": 0.01}}]}}


@pytest.fixture
def fake_replay(monkeypatch):
    """replay with its models and load stubbed out (the output handling is real); ``in_the_way``
    set to a path makes the run put a file there (an output directory gone when it ends)."""
    from eagle3_jax.serve import replay

    target = SimpleNamespace(config=SimpleNamespace(vocab_size=16, max_position_embeddings=64))
    monkeypatch.setattr(common, "load_pair", lambda args: (target, object(), object(), True))
    state = SimpleNamespace(in_the_way=None, runs=0)

    def run(*args, **kw):
        state.runs += 1
        if state.in_the_way is not None:
            state.in_the_way.write_text("in the way")
        return json.loads(json.dumps(REPLAY_REPORT))

    monkeypatch.setattr(replay, "replay", run)
    return state


def test_replay_checks_its_outputs_before_running(tmp_path, capsys, fake_replay):
    (tmp_path / "afile").write_text("x")
    for argv, named in ((["--json", tmp_path], ["--json", "is a directory"]),
                        (["--json", tmp_path / "afile" / "r.json"], ["--json", "afile", "not a directory"]),
                        (["--json", tmp_path / "r.json", "--figure", tmp_path / "afile" / "f.png"],
                         ["--figure", "afile"]),
                        (["--json", tmp_path / "r.json", "--figure", tmp_path / "f.xyz"], ["--figure", "'.xyz'"])):
        _one_line_error(capsys, ["replay", "--rate", "1", *argv], *named)
    assert fake_replay.runs == 0


def test_replay_report_survives_an_unwritable_json(tmp_path, capsys, fake_replay):
    """The output directory is fine when checked but a file once the load has run: the report
    goes to stdout (its table too) and the one-line error says so."""
    out = tmp_path / "out" / "r.json"
    fake_replay.in_the_way = tmp_path / "out"
    rc = main(["replay", "--rate", "1", "--json", str(out), "--figure", str(tmp_path / "f.png")])
    captured = capsys.readouterr()
    assert rc == 2 and fake_replay.runs == 1, captured.err
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "--json" in captured.err and "report is on stdout" in captured.err
    printed = captured.out[captured.out.index("{"):]
    assert json.loads(printed)["modes"] == REPLAY_REPORT["modes"]
    assert "| vanilla |" in captured.out


def test_replay_writes_its_outputs_atomically(tmp_path, capsys, monkeypatch, fake_replay):
    out, fig = tmp_path / "r.json", tmp_path / "f.png"
    assert main(["replay", "--rate", "1", "--json", str(out), "--figure", str(fig)]) == 0
    assert json.loads(out.read_text())["modes"] == REPLAY_REPORT["modes"] and fig.read_bytes()[:4] == b"\x89PNG"
    fig.write_bytes(b"OLD FIGURE")
    _failing_savefig(monkeypatch)
    _one_line_error(capsys, ["replay", "--rate", "1", "--json", out, "--figure", fig], "--figure", "No space left",
                    str(out))
    assert fig.read_bytes() == b"OLD FIGURE" and not list(tmp_path.glob(".*tmp*"))


def test_the_compiling_commands_take_compile_cache():
    """serve, replay, generate, bench and experiment take --compile-cache (off: no cache)."""
    parser = cli.build_parser()
    for argv in (["serve"], ["replay", "--rate", "1"], ["generate", "x"], ["bench"], ["experiment"]):
        assert parser.parse_args([*argv, "--compile-cache", "off"]).compile_cache == "off"


def test_mesh_flag_reads_auto_none_and_axes():
    parser = cli.build_parser()

    def mesh(text):
        return parser.parse_args(["bench", "--mesh", text]).mesh

    assert mesh("auto") == "auto" and mesh(" None ") == "none"
    assert mesh("data=2") == {"data": 2, "fsdp": 1, "tensor": 1}
    with pytest.raises(cli.UsageError, match="--mesh"):
        mesh("data=two")
    assert parser.parse_args(["bench"]).cores  # bench splits by default ...
    assert not getattr(parser.parse_args(["generate", "x"]), "cores", False)  # ... generate does not
