"""The OpenAI-compatible server: continuous batching over ``eagle3_jax.decode.Slots``.

* :mod:`eagle3_jax.serve.engine` — the host-side scheduler (bounded queue, admission into
  free slots between dispatches, one engine thread, hand-off to the asyncio loop);
* :mod:`eagle3_jax.serve.output` — thinking / answer split, incremental detokenization,
  stop strings, token counts;
* :mod:`eagle3_jax.serve.schemas` — the request models, OpenAI-shaped errors and the checks of
  a request before it costs anything;
* :mod:`eagle3_jax.serve.app` — FastAPI endpoints (``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``), the body guard, prompt
  tokenizing off the event loop, the warm-up's start;
* :mod:`eagle3_jax.serve.responses` — response bodies, SSE streams, usage;
* :mod:`eagle3_jax.serve.server` — the app over a new engine (``build``), uvicorn in the
  foreground (``run``: ``eagle3-jax serve``) or in a thread, the checks before a start;
* :mod:`eagle3_jax.serve.metrics` — Prometheus metrics;
* :mod:`eagle3_jax.serve.text` — checks of prompt text shared with the command line (blank,
  not valid Unicode);
* :mod:`eagle3_jax.serve.replay` — Poisson arrival-rate replay (``eagle3-jax replay``).

Nothing is imported here: FastAPI, uvicorn and prometheus_client (the ``serve`` extra) load
with the submodules.
"""
