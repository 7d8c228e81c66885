"""Every figure of the two-budget experiment and of the bench per prompt category (task
family) as well as overall: the categories' rows pool to the overall one, a batch never mixes
categories, and the CLI passes the built-in tasks' families (and runs a generated tool call)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import FIXTURES

import eagle3_jax
from eagle3_jax import bench, builtin, experiment
from eagle3_jax.builtin import running
from eagle3_jax.cli import common, main
from eagle3_jax.tree import TreeConfig, parse_tree

CATS = ["a", "b", "a", "a", "b", "a"]  # interleaved: batches of 2 in prompt order would mix them
N = {"a": 4, "b": 2}


def _prompts():
    rng = np.random.default_rng(0)  # a's prompts start with 10, b's with 20 (to see what a batch mixed)
    return [[10 if c == "a" else 20, *rng.integers(30, 1000, 7).tolist()] for c in CATS]


def _pooled(rows: dict, key: str) -> float:
    """The prompt-weighted mean of the categories' values."""
    return sum(N[c] * r[key] for c, r in rows.items()) / sum(N.values())


def _grade(i, tokens) -> bool:
    return sum(tokens) % 3 == 0


@pytest.fixture(scope="module")
def tiny_pair():
    target = eagle3_jax.load_target(FIXTURES / "target_tiny")
    return target, eagle3_jax.load_drafter(FIXTURES / "drafter_tiny_trained", target=target)


@pytest.fixture
def batches(monkeypatch):
    """The first token of each prompt of each generate call of the experiment and the bench."""
    seen = []

    def recording_generate(target, drafter, prompts, **kw):
        seen.append([p[0] for p in prompts])
        return eagle3_jax.generate(target, drafter, prompts, **kw)

    monkeypatch.setattr(experiment, "generate", recording_generate)
    monkeypatch.setattr(bench, "generate", recording_generate)
    return seen


# ---------------------------------------------------------------- the experiment
def test_experiment_reports_each_category_and_the_pooled_whole(tmp_path, tiny_pair, batches):
    details = {1: {"valid": True, "score": 2, "note": "text is skipped"}, 4: {"valid": False, "score": 5}}
    report = experiment.run_experiment(
        *tiny_pair, None, _prompts(), grade=_grade, categories=CATS, details=lambda i, t: details.get(i, {}),
        budgets=(None,), chosen=(None,), tiers=(TreeConfig.chain(2),), batch_size=2, max_new_tokens=8,
        sampled_temperature=None, repeats=1, out_dir=tmp_path, progress=False)
    assert batches and all(len(b) == 2 and len(set(b)) == 1 for b in batches)  # a batch never mixes categories
    assert report["settings"]["categories"] == N

    s1 = report["step1"]["unlimited"]
    cats1 = s1["by_category"]
    assert [r["prompts"] for r in cats1.values()] == [4, 2]
    for key in ("accuracy", "thinking_tokens", "answer_tokens", "ttft_ms", "e2e_ms", "budget_exhausted_rate",
                "incomplete_rate"):
        assert s1[key] == pytest.approx(_pooled(cats1, key)), key
    for key in ("tokens", "seconds"):
        assert s1[key] == pytest.approx(sum(r[key] for r in cats1.values())), key
    assert cats1["a"]["details"] == {} and cats1["b"]["details"] == {"valid": 0.5, "score": 3.5} == s1["details"]

    rows = report["step2"]["unlimited"]
    assert set(rows) == {"vanilla", "chain2", "adaptive"}
    assert rows["chain2"]["tau"] > 1  # some drafts accepted: the pooling below is not 0 == 0
    for name, r in rows.items():
        cats2 = r["by_category"]
        assert r["accuracy"] == pytest.approx(_pooled(cats2, "accuracy"))
        assert r["tokens"] == sum(c["tokens"] for c in cats2.values())
        assert r["identical_to_vanilla"] and all(c["identical_to_vanilla"] for c in cats2.values())
        for c, row in cats2.items():  # speedup against vanilla on the same category
            assert row["speedup"] == pytest.approx(row["tokens_per_second"] / rows["vanilla"]["by_category"][c]
                                                   ["tokens_per_second"])
        if name != "vanilla":  # τ pooled over the rounds: τ - 1 = accepted / rounds
            assert r["rounds"] == sum(c["rounds"] for c in cats2.values()) > 0
            assert (r["tau"] - 1) * r["rounds"] == pytest.approx(sum((c["tau"] - 1) * c["rounds"] for c in cats2.values()))
            assert r["accepted"] == sum(c["accepted"] for c in cats2.values())
    md = (tmp_path / "report.md").read_text()
    assert "### Step 1 per category" in md and "### Step 2 per category" in md
    assert f"| a (4) | {cats1['a']['accuracy']:.3f} |" in md and "| b | unlimited | chain2 |" in md
    assert "| b | unlimited | 0.500 | 3.500 |" in md and "| all | unlimited | 0.500 | 3.500 |" in md
    assert json.loads((tmp_path / "report.json").read_text())["step2"]["unlimited"]["chain2"]["by_category"]["b"]


def test_experiment_without_categories_runs_the_prompts_in_order(tmp_path, tiny_pair, batches):
    with pytest.raises(ValueError, match="categories: 2 values for 6 prompts"):
        experiment.run_experiment(*tiny_pair, None, _prompts(), categories=["a", "b"], out_dir=tmp_path)
    assert not batches
    report = experiment.run_experiment(*tiny_pair, None, _prompts(), budgets=(None,), chosen=(None,),
                                       tiers=(TreeConfig.chain(2),), batch_size=2, max_new_tokens=8,
                                       sampled_temperature=None, repeats=1, out_dir=tmp_path, progress=False)
    # one call per batch (its TTFT timed on the same program), the prompts in order: step 1's
    # row, then step 2's vanilla, chain2 and adaptive taking turns batch by batch
    assert batches == [[10, 20], [10, 10], [20, 10]] + [[10, 20]] * 3 + [[10, 10]] * 3 + [[20, 10]] * 3
    assert "categories" not in report["settings"]
    assert "by_category" not in report["step1"]["unlimited"] and "by_category" not in report["step2"]["unlimited"]["chain2"]
    assert "per category" not in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------- the bench
def test_bench_reports_each_category_and_the_pooled_whole(tiny_pair, batches):
    report = bench.run_bench(*tiny_pair, _prompts(), trees=[TreeConfig.chain(2)], max_new_tokens=8, batch_size=2,
                             repeats=1, grade=_grade, categories=CATS, log=lambda line: None)
    assert batches and all(len(b) == 2 and len(set(b)) == 1 for b in batches)
    assert report["settings"]["categories"] == N
    van, (e,) = report["vanilla"], report["eagle3"]
    for row in (van, e):
        cats = row["by_category"]
        assert row["accuracy"] == pytest.approx(_pooled(cats, "accuracy"))
        for key in ("tokens", "seconds"):
            assert row[key] == pytest.approx(sum(r[key] for r in cats.values())), key
    cats = e["by_category"]
    assert e["tau"] > 1 and e["rounds"] == sum(r["rounds"] for r in cats.values())
    assert (e["tau"] - 1) * e["rounds"] == pytest.approx(sum((r["tau"] - 1) * r["rounds"] for r in cats.values()))
    assert e["identical_to_vanilla"] and all(r["identical_to_vanilla"] for r in cats.values())
    for c, r in cats.items():
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / van["by_category"][c]["tokens_per_second"])
        assert len(r["acceptance_rate"]) == len(e["acceptance_rate"])


def test_bench_batch_larger_than_a_category_takes_the_prompts_in_order(tiny_pair, batches):
    """``batch_size`` is the batch that runs: one larger than a category (b has 2 prompts) takes
    the prompts in order; each category keeps its own τ, accuracy and identity, and has no
    tokens/s of its own (its prompts were not timed apart from the others')."""
    report = bench.run_bench(*tiny_pair, _prompts(), trees=[TreeConfig.chain(2)], max_new_tokens=8, batch_size=3,
                             repeats=1, grade=_grade, categories=CATS, log=lambda line: None)
    assert batches == [[10, 20, 10], [10, 20, 10]] * 2  # vanilla and chain2, batch by batch
    van, (e,) = report["vanilla"], report["eagle3"]
    assert van["tokens_per_second"] > 0 and e["speedup"] == pytest.approx(e["tokens_per_second"] / van["tokens_per_second"])
    for row in (van, e):
        cats = row["by_category"]
        assert all(r["tokens_per_second"] is None for r in cats.values())
        assert row["accuracy"] == pytest.approx(_pooled(cats, "accuracy"))
        assert row["tokens"] == sum(r["tokens"] for r in cats.values())
    cats = e["by_category"]
    assert e["rounds"] == sum(r["rounds"] for r in cats.values()) and e["tau"] > 1
    assert (e["tau"] - 1) * e["rounds"] == pytest.approx(sum((r["tau"] - 1) * r["rounds"] for r in cats.values()))
    assert all(r["speedup"] is None and r["acceptance_rate"] is None and r["identical_to_vanilla"] for r in cats.values())


def test_bench_passes_interleave_the_modes_and_keep_each_batchs_fastest(monkeypatch):
    """Each pass runs every mode on a batch before the next batch, in an order that rotates
    per pass, and a mode's seconds are the sum over batches of its fastest pass; every call
    asks for its program's first run untimed."""
    calls = []

    def fake_generate(target, drafter, prompts, *, speculation=None, **kw):
        mode = "vanilla" if drafter is None else "chain2"
        assert kw["warm_up"] is True and kw["time_first_token"] is True  # first run untimed; the prefill timed too
        calls.append((mode, prompts[0][0]))
        seconds = {0: 5.0, 1: 2.0, 2: 3.0}[(len(calls) - 1) // 4]  # pass 0 slow, pass 1 fastest, pass 2 between
        first = {0: 1.0, 1: 0.5, 2: 0.25}[(len(calls) - 1) // 4]  # the first token: fastest in pass 2
        return SimpleNamespace(tokens=[[7, 8]] * len(prompts),
                               stats={"seconds": seconds + (0.5 if mode == "chain2" else 0.0),
                                      "first_token_seconds": first + (0.1 if mode == "chain2" else 0.0),
                                      "accept_lengths": [[1, 2]] * len(prompts),
                                      "accepted_per_position": [2, 1], "offered_per_position": [2, 2]})

    monkeypatch.setattr(bench, "generate", fake_generate)
    monkeypatch.setattr(bench, "round_parts", lambda *a, **kw: dict.fromkeys(
        ("round_ms", "draft_ms", "verify_ms", "catch_up_ms", "commit_ms", "emit_ms", "loop_ms"), 1.0))
    prompts = [[10, 1], [11, 1], [20, 1], [21, 1]]
    report = bench.run_bench(object(), object(), prompts, trees=[TreeConfig.chain(2)], max_new_tokens=2,
                             batch_size=2, repeats=3, log=lambda line: None)
    v, c = "vanilla", "chain2"
    assert calls == [(v, 10), (c, 10), (v, 20), (c, 20),   # pass 0: vanilla first
                     (c, 10), (v, 10), (c, 20), (v, 20),   # pass 1: rotated
                     (v, 10), (c, 10), (v, 20), (c, 20)]   # pass 2
    assert report["vanilla"]["seconds"] == pytest.approx(2 * 2.0)
    assert report["eagle3"][0]["seconds"] == pytest.approx(2 * 2.5)
    assert report["eagle3"][0]["identical_to_vanilla"]
    assert report["eagle3"][0]["acceptance_rate"] == [1.0, 0.5]
    # the first token: each batch's fastest of the passes; past it, 4 prompts' second tokens
    assert report["vanilla"]["first_token_seconds"] == pytest.approx(2 * 0.25)
    assert report["eagle3"][0]["first_token_seconds"] == pytest.approx(2 * 0.35)
    assert report["vanilla"]["first_token_share"] == pytest.approx(0.5 / 4.0)
    assert report["vanilla"]["decode_tokens_per_second"] == pytest.approx(4 / (4.0 - 0.5))
    assert report["eagle3"][0]["decode_tokens_per_second"] == pytest.approx(4 / (5.0 - 0.7))
    assert report["eagle3"][0]["decode_speedup"] == pytest.approx((4.0 - 0.5) / (5.0 - 0.7))


def test_bench_logs_a_round_too_short_to_time_without_dividing_by_zero(monkeypatch):
    """A few tiny rounds can time at 0 ms (their difference below the timer's noise, as on a busy
    machine): the log says so instead of dividing by the parts' zero sum."""
    # the first-token call as slow as the whole call: no time left past the first token either
    monkeypatch.setattr(bench, "generate", lambda target, drafter, prompts, **kw: SimpleNamespace(
        tokens=[[7, 8]] * len(prompts), stats={"seconds": 1.0, "first_token_seconds": 1.0,
                                               "accept_lengths": [[1]] * len(prompts),
                                               "accepted_per_position": [1], "offered_per_position": [1]}))
    monkeypatch.setattr(bench, "round_parts", lambda *a, **kw: dict.fromkeys(
        ("round_ms", "draft_ms", "verify_ms", "catch_up_ms", "commit_ms", "emit_ms", "loop_ms"), 0.0))
    lines = []
    report = bench.run_bench(object(), object(), [[10, 1]], trees=[TreeConfig.chain(2)], max_new_tokens=2,
                             batch_size=1, repeats=1, log=lines.append)
    assert report["eagle3"][0]["round_ms"] == 0.0
    assert any("eagle3 chain2" in line and "below the timer's noise" in line for line in lines)
    assert report["eagle3"][0]["decode_speedup"] is None and report["vanilla"]["decode_tokens_per_second"] is None
    assert not any("past the first token" in line for line in lines)


# ---------------------------------------------------------------- the CLI with the built-in pair
TASKS = [dataclasses.asdict(t) for t in builtin.make_tasks(4, seed=1, exclude=set())]  # qa, math, code, tool


class FakeTokenizer:
    """Token ids ``[i, right]`` decode to task i's right first turn (or a wrong answer)."""

    chat_template = "fake"

    def decode(self, tokens, skip_special_tokens=True):
        i, right = tokens
        return builtin.task_from_dict(TASKS[i]).response() if right else "<think>\n</think>\nThe answer is nope."


@pytest.fixture
def fake_builtin(monkeypatch):
    """The built-in pair's commands with the models stubbed out: what reaches run_bench and
    run_experiment is recorded; the tool's final turn says the right answer."""
    tok = FakeTokenizer()
    monkeypatch.setattr(common, "load_pair", lambda args: (SimpleNamespace(config=SimpleNamespace(vocab_size=16)),
                                                         object(), tok, True))
    monkeypatch.setattr(common, "encode", lambda tok, text, raw=False: [len(text)])
    monkeypatch.setattr(builtin, "eval_tasks", lambda: TASKS)
    finals = []

    def transcript(target, tok, task, first, **kw):
        finals.append(first)
        return first + "\n" + builtin.task_from_dict(task).final_line() if builtin.parse_call(first) else first

    monkeypatch.setattr(running, "transcript", transcript)  # what the Scorer calls
    calls = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: calls.append(kw) or {
        "settings": {"temperature": kw["temperature"]}, "vanilla": {},
        "eagle3": [{"tree": {"name": "chain3"}, "speedup": 1.5, "tau": 2.5, "acceptance_rate": [0.8, 0.6, 0.4]}]})
    monkeypatch.setattr(experiment, "run_experiment", lambda *a, **kw: calls.append(kw) or {"summary": ["done"]})
    return calls, finals


def test_cli_bench_and_experiment_pass_the_families(tmp_path, capsys, fake_builtin):
    calls, finals = fake_builtin
    assert [t["family"] for t in TASKS] == list(builtin.FAMILIES)
    assert main(["bench", "--json", str(tmp_path / "b.json"), "--figure", str(tmp_path / "b.png")]) == 0
    assert main(["experiment", "--out", str(tmp_path / "exp"), "--replay-rates"]) == 0
    assert len(calls) == 3  # bench at T = 0 and 0.7, then the experiment
    for kw in calls:
        assert kw["categories"] == list(builtin.FAMILIES)
        grade = kw["grade"]
        assert [grade(i, [i, True]) for i in range(4)] == [True] * 4
        assert [grade(i, [i, False]) for i in range(4)] == [False] * 4
    details = calls[-1]["details"]
    assert details(0, [0, True]) == {} and details(1, [1, True]) == {}
    assert details(3, [3, True]) == dict(valid_json=True, right_tool=True, right_arguments=True, right_answer=True,
                                         success=True)
    assert details(3, [3, False])["valid_json"] is False and not details(3, [3, False])["success"]
    right_first = builtin.task_from_dict(TASKS[3]).response()
    # the final turn is generated once by the bench's grader (both temperatures) and once for the
    # experiment's grade and details together
    assert finals.count(right_first) == 2


def test_generate_runs_the_tool_call_and_prints_the_final_answer(capsys, fake_builtin, monkeypatch):
    _, finals = fake_builtin
    tool = builtin.task_from_dict(TASKS[3])
    res = SimpleNamespace(tokens=[[3, True]], thinking_status=["closed"], thinking_tokens=[5], answer_tokens=[9],
                          finish_reason=["stop"], stats={"seconds": 1.0, "new_tokens": 14, "tau": 2.0, "rounds": [7],
                                                         "tokens_per_second": 14.0})
    monkeypatch.setattr(eagle3_jax, "generate", lambda *a, **kw: res)
    seen = {}
    real_tool_turn = builtin.tool_turn
    monkeypatch.setattr(builtin, "tool_turn", lambda target, tok, prompt, first, **kw: seen.update(prompt=prompt, kw=kw)
                        or (builtin.parse_call(first), builtin.call_tool(builtin.parse_call(first)), "The answer is 1234.")
                        if builtin.parse_call(first) else real_tool_turn(target, tok, prompt, first, **kw))
    assert main(["generate", tool.prompt]) == 0
    out = capsys.readouterr().out
    assert out.index("identical to vanilla: True") < out.index("Tool call: ") < out.index("\nFinal answer:\nThe answer is 1234.")
    assert f"Tool call: {tool.call}\nTool result: {tool.result}\n" in out
    assert seen["prompt"] == tool.prompt
    assert seen["kw"]["tree"] == parse_tree(builtin.DEFAULT_TREE)  # the first turn's drafter and tree
    assert seen["kw"]["drafter"] is not None

    res.tokens = [[1, True]]  # a math task's first turn: no tool call, no tool turn
    assert main(["generate", builtin.task_from_dict(TASKS[1]).prompt]) == 0
    out = capsys.readouterr().out
    assert "The answer is" in out and "Tool call" not in out and "Final answer" not in out
