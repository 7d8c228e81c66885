"""Prometheus metrics of the server (``GET /metrics``), in a registry of their own.

Names follow vLLM's (``vllm:`` → ``eagle3:``): requests, queue depth, running slots, prompt
and generated tokens, time to first token, time per output token, end-to-end latency, and
the speculative counters ``spec_decode_num_drafts`` (drafting rounds),
``spec_decode_num_draft_tokens`` (proposed), ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos`` (label ``position``, 0-based), each labelled by
``phase`` (``thinking`` / ``answer``; ``none`` when the model has no thinking markers).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

from eagle3_jax.serve.engine import count

PREFIX = "eagle3:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0)
_SPEC_KEYS = ("rounds", "proposed", "accepted")


class Metrics:
    """The server's metrics; the engine thread and the HTTP handlers report into it."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # no *_created series (process-wide, as vLLM does)
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}
        self._label = label
        self.requests = Counter(PREFIX + "requests", "HTTP generation requests received, by endpoint",
                                ["model_name", "endpoint"], registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused: 400 invalid, 404 unknown model, "
                                "413 body too large, 429 queue full, 503 warming up or engine down", ["model_name", "code"], registry=r)
        self.finished = Counter(PREFIX + "request_success", "Finished requests by finish reason (stop, length, "
                                "cancelled, error)", ["model_name", "finished_reason"], registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a slot", ["model_name"], registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Slots holding a request", ["model_name"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens admitted", ["model_name"], registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens delivered", ["model_name"],
                                         registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "(latency - TTFT) / (tokens - 1) per request",
                              ["model_name"], buckets=TPOT_BUCKETS, registry=r)
        self.latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token", ["model_name"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.drafts = Counter(PREFIX + "spec_decode_num_drafts", "Speculative rounds that drafted",
                              ["model_name", "phase"], registry=r)
        self.draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed",
                                    ["model_name", "phase"], registry=r)
        self.accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       ["model_name", "phase"], registry=r)
        self.accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based)",
                                        ["model_name", "phase", "position"], registry=r)
        self.waiting.labels(**label).set(0)
        self.running.labels(**label).set(0)
        self._seen: dict[int, dict] = {}  # request id -> the stats already counted
        self._lock = threading.Lock()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- reports ---------------------------------------------------------------------------

    def request_received(self, endpoint: str):
        self.requests.labels(endpoint=endpoint, **self._label).inc()

    def request_rejected(self, code: int):
        self.rejected.labels(code=str(code), **self._label).inc()

    def request_queued(self, prompt_tokens: int):
        self.prompt_tokens.labels(**self._label).inc(prompt_tokens)

    def engine_state(self, waiting: int, running: int):
        self.waiting.labels(**self._label).set(waiting)
        self.running.labels(**self._label).set(running)

    def tokens(self, req, n: int, stats: dict):
        """``n`` more tokens delivered for ``req``, whose slot's cumulative stats are ``stats``."""
        if n:
            self.generation_tokens.labels(**self._label).inc(n)
        phases = stats.get("phases") or {"none": stats}
        with self._lock:
            seen = self._seen.setdefault(req.id, {})
            for phase, s in phases.items():
                old = seen.get(phase, {})
                for key, metric in zip(_SPEC_KEYS, (self.drafts, self.draft_tokens, self.accepted_tokens)):
                    d = count(s.get(key)) - count(old.get(key))
                    if d > 0:
                        metric.labels(phase=phase, **self._label).inc(d)
                per_pos, old_pos = list(s.get("accepted_per_position") or []), list(old.get("accepted_per_position") or [])
                for i, v in enumerate(per_pos):
                    d = int(v) - int(old_pos[i] if i < len(old_pos) else 0)
                    if d > 0:
                        self.accepted_per_pos.labels(phase=phase, position=str(i), **self._label).inc(d)
                seen[phase] = {k: s.get(k) for k in (*_SPEC_KEYS, "accepted_per_position")}

    def request_finished(self, req, reason: str):
        self.finished.labels(finished_reason=reason, **self._label).inc()
        with self._lock:
            self._seen.pop(req.id, None)
        res = getattr(req, "result", None)
        if res is None or reason in ("error", "cancelled"):
            return
        if res.ttft is not None:
            self.ttft.labels(**self._label).observe(res.ttft)
            if res.completion_tokens > 1:
                self.tpot.labels(**self._label).observe((res.latency - res.ttft) / (res.completion_tokens - 1))
        self.latency.labels(**self._label).observe(res.latency)
