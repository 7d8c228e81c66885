"""The two-budget experiment's report (``eagle3_jax.experiment_report``), on a stand-in for
``generate`` (no model): the summary claims only what its intervals show, budgets are named by
their value, and a row whose time its rounds do not explain is marked in ``report.md`` and named
in the summary."""

from __future__ import annotations

import pytest
from helpers import fake_experiment, run_fake_experiment

from eagle3_jax import experiment_report


@pytest.fixture
def fake(monkeypatch):
    """A stand-in for ``generate`` (``helpers.FakeGenerate``: calls of 1 s that reconcile exactly
    with their rounds), one batch per prompt."""
    yield from fake_experiment(monkeypatch)


def test_the_summary_claims_a_speedup_only_with_an_interval_that_shows_it(tmp_path, fake):
    fake.seconds = lambda b, name, r: 1.0 if name == "vanilla" else 0.5 if name == "chain2" else (0.45, 0.6, 0.7)[r]
    line = run_fake_experiment(tmp_path, budgets=(None,))["summary"][0]  # then rows whose time is off
    assert "EAGLE-3 (chain2) cut execution time by 50.0% [50.0–50.0%] (speedup 2.00× [2.00–2.00×]" in line
    assert "no measurable difference between chain2 and adaptive" in line  # 1.43-2.22x holds 2.00x

    fake.made.clear()
    fake.seconds = lambda b, name, r: 1.0 if name == "vanilla" else (0.9, 1.0, 1.1)[r]
    line = run_fake_experiment(tmp_path, budgets=(None,))["summary"][0]
    assert "no measurable difference in execution time between EAGLE-3" in line and "cut execution" not in line

    fake.made.clear()
    fake.seconds = lambda b, name, r: 1.0 if name == "vanilla" else (1.2, 1.3, 1.25)[r]
    line = run_fake_experiment(tmp_path, budgets=(None,))["summary"][0]
    assert "raised execution time by" in line


def test_budgets_are_named_by_their_value(tmp_path, fake):
    report = run_fake_experiment(tmp_path, budgets=(0, 16), chosen=(16, None))
    assert [line.split(":")[0] for line in report["summary"]] == ["Budget B=16", "Budget B=unlimited"]
    assert not any("Unlimited B" in line for line in report["summary"])


def test_a_row_whose_time_its_rounds_do_not_explain_is_marked(tmp_path, fake):
    """A row's time against its first-token time + rounds × round costs, in the repeat closest to
    1: within ``RECONCILE_FACTOR`` it reconciles, even with other repeats off by a busy spell;
    off in every repeat (here 1.8×: time the rounds do not explain, as when the counts left out
    rounds that ran or the costs were mis-measured) the report marks it and the summary names it.
    The stand-in's calls of 1 s are exactly what their rounds cost (``fake``)."""
    report = run_fake_experiment(tmp_path)
    rows = [*report["step1"].values(), *report["step2"]["unlimited"].values()]
    assert all(r["time_check"]["ratio"] == pytest.approx(1.0) and r["time_check"]["within"] for r in rows)
    assert len(report["summary"]) == 1

    fake.made.clear()
    fake.seconds = lambda b, name, r: 2.0 if name == "adaptive" or (name == "chain2" and r < 2) else 1.0
    report = run_fake_experiment(tmp_path)
    rows = report["step2"]["unlimited"]
    assert rows["chain2"]["time_check"] == {"ratio": pytest.approx(1.0), "repeat": 2, "factor": 1.5, "within": True}
    adaptive = rows["adaptive"]["time_check"]
    assert adaptive["ratio"] == pytest.approx(2.0 / 1.1) and not adaptive["within"]
    assert report["summary"][-1].startswith("The time of step 2 B=unlimited adaptive is not within 1.5×")
    md = (tmp_path / "exp" / "report.md").read_text()
    assert md == experiment_report.markdown(report) and report["summary"] == experiment_report.summary(report)
    assert "within a factor 1.5 of" in md and "| **no** (1.82, repeat 1) |" in md and "| yes (1.00, repeat 3) |" in md
