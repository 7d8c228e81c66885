"""A small, fast run of the two-budget experiment on the built-in pair: both steps, the
report files, and the two attributions stated apart."""

from __future__ import annotations

import json

from eagle3_jax import builtin
from eagle3_jax.cli import main


def test_experiment_writes_the_report(tmp_path, capsys):
    out = tmp_path / "exp"
    rc = main(["experiment", "--num-prompts", "1", "--budgets", "0", "8", "unlimited", "--chosen", "8",
               "--tree", "chain4", "--max-new-tokens", "48", "--sampled-temperature", "0.7", "--out", str(out),
               "--replay-rates"])  # no rates: step 3 (a server per mode) is left to `eagle3-jax replay`'s tests
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["step1"]) == ["0", "8", "unlimited"]
    s1 = report["step1"]
    assert s1["0"]["thinking_tokens"] < s1["unlimited"]["thinking_tokens"]  # B bounds the work
    u = s1["unlimited"]  # the first token timed on the full call's own program, before it
    assert 0 < u["ttft_ms"] < u["e2e_ms"] and u["tpot_ms"] > 0
    assert s1["0"]["budget_exhausted_rate"] == 1.0 and s1["unlimited"]["budget_exhausted_rate"] == 0.0
    rows = report["step2"]["8"]
    assert set(rows) == {"vanilla", "chain4", "adaptive"}
    assert all(r["identical_to_vanilla"] for r in rows.values())  # K never changes the tokens
    assert rows["chain4"]["tau"] > 1 and "tier_rounds" in rows["adaptive"]
    assert "sampled_accuracy_z" in rows["chain4"]
    assert len(report["summary"]) == 1 and "Budget B=8 reduced target tokens by" in report["summary"][0]
    assert "EAGLE-3" in report["summary"][0]
    families = [t["family"] for t in builtin.eval_tasks()[:1]]  # every figure per family too (several: test_categories)
    assert list(report["settings"]["categories"]) == list(dict.fromkeys(families))
    assert set(s1["0"]["by_category"]) == set(rows["chain4"]["by_category"]) == set(families)
    md = (out / "report.md").read_text()
    assert "## Step 1" in md and "## Step 2" in md and "step3" not in report
    assert "### Step 1 per category" in md and "### Step 2 per category" in md
    for png in ("quality_tokens_latency.png", "budget_heatmap.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "Budget B=8" in capsys.readouterr().out
