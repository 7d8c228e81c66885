"""``eagle3_jax.serve.replay``'s statistics: Poisson arrivals, a run's summary (throughput,
goodput, percentiles), the crossover and the table."""

from __future__ import annotations

import pytest

from eagle3_jax.serve.replay import arrivals, crossover, summarize, table


def test_replay_statistics():
    times = arrivals(50.0, 2000, seed=1)
    assert times == sorted(times) and abs(len(times) / times[-1] - 50.0) < 5  # a Poisson process of rate 50
    assert arrivals(50.0, 10, seed=1) == times[:10]
    ok = lambda ttft, lat, n: {"status": 200, "ttft": ttft, "latency": lat, "tokens": n}  # noqa: E731
    records = [ok(0.1, 1.1, 101), ok(2.0, 2.5, 51), ok(0.2, 5.2, 101), {"status": 429, "ttft": None, "latency": None,
                                                                      "tokens": 0}, {"status": "timeout"}]
    s = summarize(records, wall=10.0, ttft_slo=1.0, tpot_slo=0.02)
    # TPOTs: 10 ms, 10 ms, 50 ms: only the first meets both objectives
    assert (s["completed"], s["rejected_429"], s["failed"]) == (3, 1, 1)
    assert s["goodput"] == pytest.approx(0.1) and s["tokens_per_second"] == pytest.approx(25.3)
    assert s["tpot_s"]["p50"] == pytest.approx(0.01) and s["ttft_s"]["p50"] == pytest.approx(0.2)
    row = lambda g: {"goodput": g, "tokens_per_second": 1.0, "tpot_s": {"p50": 0.001}}  # noqa: E731
    modes = {"vanilla": [row(1), row(2), row(3)], "chain4": [row(2), row(2.5), row(2)], "adaptive": [row(1), row(3), row(3)]}
    assert crossover(modes, [1, 2, 4]) == 4  # at rate 4 neither beats vanilla
    modes["adaptive"][2] = row(3.5)
    assert crossover(modes, [1, 2, 4]) is None
    text = table({"rates": [1, 2, 4], "modes": modes, "ttft_slo_s": 1.0, "tpot_slo_s": 0.02, "crossover_rate": None})
    assert "| chain4 | 2.00" in text and "no measured rate" in text
