"""Running the server: the app built over a new slot engine on a model pair (:func:`build`),
served by uvicorn in the foreground (:func:`run`, ``eagle3-jax serve``) or in a background
thread (:class:`ServerThread`), and the checks made before anything is loaded or allocated
(:func:`check_port`, :func:`check_cache_fits`).  The round costs an adaptive policy measured
are kept beside JAX's compilation cache for the next start on the same settings.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import socket
import threading
import time
from pathlib import Path

import jax
import uvicorn
from fastapi import FastAPI

from eagle3_jax.atomic import write_atomic
from eagle3_jax.decode import Slots
from eagle3_jax.serve.app import Startup, create_app
from eagle3_jax.serve.engine import Engine
from eagle3_jax.serve.metrics import Metrics
from eagle3_jax.serve.schemas import MAX_STOP_IDS, ServerConfig, body_byte_limit, prompt_char_limit
from eagle3_jax.speculation import Speculation, tier_name

WARMUP_GC_THRESHOLD = 100_000  # the collector's first threshold while serve warms up (Python's default: 700)


class ServerThread:
    """uvicorn serving ``app`` in a background thread on ``host:port`` (port 0: a free one);
    a context manager.  ``url`` is the base URL once started."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="eagle3-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0):
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def sampling_defaults(target_dir) -> float:
    """The default temperature from a target directory's ``generation_config.json``
    (``do_sample: false`` → 0, else its ``temperature``, else 1.0, OpenAI's default)."""
    path = Path(target_dir) / "generation_config.json"
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError):
        return 1.0
    if not isinstance(gen, dict):
        return 1.0
    if gen.get("do_sample") is False:
        return 0.0
    t = gen.get("temperature", 1.0)
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 else 1.0


class _RoundCosts:
    """The round costs an adaptive policy measured on a server's slots (``Slots.round_ms``),
    kept beside JAX's persistent compilation cache (when it is on) for the next start on the
    same shapes, speculation, JAX version and machine: a round's cost depends on those, not on
    the weights."""

    FILE = "eagle3-jax-round-ms.json"

    def __init__(self, target, drafter, speculation, slots: int, max_len: int):
        folder = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
        self.path = None if folder is None or drafter is None else os.path.join(folder, self.FILE)
        what = [repr(target.config), repr(drafter and drafter.config), getattr(target, "attention_impl", None),
                str(target.dtype), repr(speculation), slots, max_len, jax.__version__, jax.devices()[0].device_kind,
                os.cpu_count()]
        self.key = hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return {}
        return saved if isinstance(saved, dict) else {}

    def load(self) -> list[float] | None:
        """The costs saved for these settings, or None (then ``Slots`` measures them)."""
        costs = self._read().get(self.key) if self.path else None
        ok = isinstance(costs, list) and costs and all(isinstance(c, (int, float)) and c > 0 for c in costs)
        return costs if ok else None

    def save(self, costs):
        """Keeps ``costs`` (nothing when None, or when the cache is off); a failed write is ignored
        (the next start measures again)."""
        if self.path is None or costs is None:
            return
        try:
            write_atomic(self.path, json.dumps({**self._read(), self.key: list(costs)}))
        except OSError:
            pass


def memory_bytes() -> int | None:
    """The memory of the first JAX device (its allocator's limit), or this machine's physical
    memory for the CPU; None where neither is known."""
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        return stats.get("bytes_limit")
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_fits(target, drafter, max_batch: int, max_len: int, memory: int | None = None):
    """``ValueError`` naming ``--max-batch`` and ``--max-len`` when the slots' KV caches (the
    target's and the drafter's, as allocated) alone exceed the device's memory
    (:func:`memory_bytes`): refused before anything is allocated, not an allocation failure
    (or the machine swapping) in the middle of the warm-up."""
    def cache_bytes(model):
        if model is None or not hasattr(model, "init_cache"):
            return 0
        shapes = jax.eval_shape(lambda: model.init_cache(max_batch, max_len))
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    memory = memory_bytes() if memory is None else memory
    need = cache_bytes(target) + cache_bytes(drafter)
    if memory is not None and need > memory:
        raise ValueError(f"--max-batch {max_batch} x --max-len {max_len}: the slots' KV caches take "
                         f"{need / 2 ** 30:,.2f} GiB, more than the device's {memory / 2 ** 30:,.2f} GiB; "
                         f"lower --max-batch or --max-len")


def build(target, drafter, tokenizer, *, max_batch: int = 8, max_len: int = 1024, speculation=None,
          max_queue: int = 64, rounds_per_dispatch: int = 16, dispatch_ms: float | None = None,
          model_name: str = "eagle3-jax", temperature: float = 1.0,
          effort_budgets: tuple = (256, 1024, None), max_body_bytes: int | None = None, warmup: bool = True,
          defer_warmup: bool = False, background: bool = False, progress=None, on_ready=None,
          on_error=None) -> FastAPI:
    """The app over a new engine: ``max_batch`` slots of ``max_len`` tokens on the pair
    (``drafter`` None: vanilla decoding; ``speculation`` as ``eagle3_jax.decode.Slots``);
    ``warmup`` compiles the engine's programs on a short request before serving (and bounds
    the rounds per dispatch by ``dispatch_ms``: ``eagle3_jax.serve.engine.Engine``).
    ``max_body_bytes``: the largest request body read (default :func:`body_byte_limit`);
    ``defer_warmup``: the dispatches of more than one row and the prefills of all but the
    smallest prompt bucket are compiled by the engine thread while it has no request
    (``Engine.warmup(defer=True)``).

    ``background``: the engine is built and warmed up once the app starts (a :class:`Startup`:
    ``/health`` says ``warming_up`` until then), not before this returns.  ``progress(done,
    total, what)`` hears each program compiled; with ``background``, ``on_ready(engine)`` hears
    that it serves and ``on_error(exception)`` a failure to start."""
    if tokenizer is None:
        raise ValueError("serving needs the target's tokenizer (tokenizer.json in the target directory)")
    check_cache_fits(target, drafter, max_batch, max_len)
    metrics = Metrics(model_name)
    chars = prompt_char_limit(tokenizer, max_len)  # max_len bounds the slots' longest prompt
    cfg = ServerConfig(model_name, target.config.vocab_size, temperature, tuple(effort_budgets), MAX_STOP_IDS, chars,
                       max_body_bytes or body_byte_limit(chars, max_len))

    def make(report) -> Engine:
        report(0, None, "the slot engine")
        costs = _RoundCosts(target, drafter, speculation, max_batch, max_len)
        slots = Slots(target, drafter, num_slots=max_batch, max_len=max_len, speculation=speculation,
                      tokenizer=tokenizer, max_stop_ids=cfg.max_stop_ids, round_ms=costs.load())
        costs.save(slots.round_ms)
        engine = Engine(slots, tokenizer, max_queue=max_queue, rounds_per_dispatch=rounds_per_dispatch,
                        dispatch_ms=dispatch_ms, metrics=metrics)
        if warmup:
            total = 1 + len(engine.warmup_steps())
            report(1, total, "the slot engine")
            engine.warmup(list(tokenizer.encode("Hello")) or [0], defer=defer_warmup,
                          progress=lambda done, _, what: report(1 + done, total, what))
        return engine.start()

    if background:
        return create_app(Startup(make, progress, on_error, on_ready), cfg, metrics, tokenizer)
    return create_app(make(progress or (lambda *_: None)), cfg, metrics, tokenizer)


def check_port(host: str, port: int):
    """``OSError`` naming ``--host/--port`` when the address cannot be bound (before any model loads)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None



def run(target, drafter, tokenizer, *, host: str, port: int, speculation=None, model_name: str = "eagle3-jax",
        max_batch: int = 8, max_len: int = 1024, log_level: str = "info", **settings) -> int:
    """Serves the pair on ``host:port`` until interrupted (``eagle3-jax serve``): listens at
    once, builds and warms up the engine meanwhile (printing the programs compiled of the
    total; ``/health`` says ``warming_up`` until ready), then serves.  A failure to start stops
    the server and is raised.  ``speculation`` None: vanilla decoding (the drafter is left
    out); ``settings``: :func:`build`'s other keyword arguments (``max_queue``,
    ``temperature``, ``effort_budgets``, ...)."""
    drafter = None if speculation is None else drafter
    started = time.monotonic()

    counts = [0, 0]  # programs compiled, of the total

    def progress(done: int, total: int | None, what: str):
        if total is None:
            print(f"warming up: compiling {what} ...", flush=True)
        else:
            counts[:] = done, total
            print(f"warming up: {done}/{total} programs compiled ({what}; {time.monotonic() - started:.1f} s)",
                  flush=True)

    def ready(_):
        gc.set_threshold(*thresholds)
        left = counts[1] - counts[0]
        print(f"ready in {time.monotonic() - started:.1f} s" + (
            f" ({left} more programs compile while no request runs)" if left else ""), flush=True)

    server: uvicorn.Server | None = None

    def failed(_):
        gc.set_threshold(*thresholds)
        if server is not None:
            server.should_exit = True

    # the models and libraries, loaded for good, leave the collector's scans; the warm-up's tracing
    # (millions of short-lived objects, no cycles worth a full scan) runs with a rarer collection
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(thresholds[0], WARMUP_GC_THRESHOLD), *thresholds[1:])
    app = build(target, drafter, tokenizer, speculation=speculation, model_name=model_name, max_batch=max_batch,
                max_len=max_len, defer_warmup=True, background=True, progress=progress, on_ready=ready,
                on_error=failed, **settings)
    adaptive = isinstance(speculation, Speculation) and speculation.policy == "adaptive"
    what = "vanilla decoding" if drafter is None else (
        "adaptive speculation" if adaptive else f"speculation {tier_name(speculation)}")
    print(f"serving {model_name} on http://{host}:{port} ({max_batch} slots of {max_len} tokens, {what}); "
          "/health says warming_up until the programs are compiled; Ctrl-C stops", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    server.run()
    startup = app.state.startup
    if startup.error is not None:
        raise startup.error
    return 0
