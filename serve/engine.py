"""The host-side scheduler over the device-side slot engine (``eagle3_jax.decode.Slots``).

One engine thread owns the slots and loops: cancelled requests release their slots, waiting
requests are admitted into free slots (their prefill is dispatched), ``slots.run(k)``
dispatches ``k`` rounds for every active slot, ``slots.poll(lag=1)`` syncs once on the
dispatch before (so the device runs this one meanwhile: it never waits for the host between
dispatches), and each request's new tokens are turned into text
(:class:`~eagle3_jax.serve.output.OutputParser`) and handed to the asyncio loop that serves its
HTTP response (``loop.call_soon_threadsafe`` into the request's ``asyncio.Queue``).  That host
work on a poll's tokens runs after the next dispatch is issued, so it overlaps the device's
work too.  A slot whose request finished on device is free for the next admission when that
is seen (a dispatch after it finished); one ended by a stop string is released when its text
is parsed, up to two dispatches later (its surplus tokens are dropped); views read from before
a request's admission are told apart by their ticket.  An admission's rounds are dispatched
right after its prefill, and the poll after them reads the prefill's first token (a lagged
read of the admission), so its first token is seen as soon as the prefill is done and the
device goes from prefill to rounds without waiting for the host.  ``k`` is 1 while requests
wait in the queue (a slot that frees is seen a round or two later, not ``k`` rounds later) and
after an admission beside running requests (its text, and the next arrivals, are not held up
behind long dispatches); otherwise it doubles per dispatch up to a cap (a long answer costs
few host syncs; a lone request starts at once on long dispatches, since short ones leave the
device idle while the host polls): ``rounds_per_dispatch``, or, with ``dispatch_ms``, the
rounds that fit in that time at the engine's dearest round (measured at :meth:`Engine.warmup`,
every slot busy), at most ``rounds_per_dispatch``; so cheap rounds (few slots) can get long
dispatches and few syncs while dear ones (a full batch) do not hold an arrival for long.
Nothing here blocks the event loop: :meth:`Engine.submit` and :meth:`Request.cancel` only
take a lock.

Each request's queue receives ``("delta", ({field: text}, token_ids))`` events, then one
``("done", Result)`` or ``("error", (http_status, message))``.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import itertools
import threading
import time

from eagle3_jax.serve.output import OutputParser


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests (HTTP 429)."""


class EngineDown(Exception):
    """The engine stopped (shut down, or a device error); it takes no requests (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Params:
    """One request's generation parameters (already validated by the HTTP layer).

    ``max_new_tokens`` counts every generated token (thinking included); ``stop``: strings
    that end the request (the text is cut before them); ``stop_token_ids``: extra stop ids
    besides the target's EOS; ``thinking_budget``: thinking tokens allowed (None: unlimited).
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    thinking_budget: int | None = None


@dataclasses.dataclass
class Result:
    """A finished request: its text per field, why it ended, exact token counts and the
    speculative figures of its rounds (the slot's stats: rounds, tau, proposed, accepted, ...).

    ``finish_reason``: ``stop`` (a stop token or string), ``length`` (``max_new_tokens``) or
    ``cancelled`` (the client went away)."""

    texts: dict
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    tokens: list
    stats: dict
    thinking_status: str
    ttft: float | None  # seconds from arrival to the first token
    latency: float  # seconds from arrival to the end


_ids = itertools.count()


class Request:
    """A submitted request: its event queue (read on the asyncio loop) and its state."""

    def __init__(self, engine: "Engine", prompt_ids, params: Params, split: bool, loop: asyncio.AbstractEventLoop):
        self.id = next(_ids)
        self.engine = engine
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.events: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.slot: int | None = None
        self.ticket: int | None = None  # the slot engine's ticket of this request once admitted
        self.done = False
        self.parser = OutputParser(engine.tokenizer, split=split, thinking=engine.slots.thinking,
                                   prompt_ids=self.prompt_ids, stop=params.stop,
                                   stop_ids=(*engine.slots.stop_ids, *params.stop_token_ids))
        self.sent_tokens = 0  # tokens of the slot's list already fed to the parser
        self.tokens: list[int] = []  # the tokens counted so far (up to a stop string's)
        self.stats: dict = {}
        self.thinking_status = "none"
        self.result: Result | None = None

    def cancel(self):
        """Ends the request (the client went away): frees its slot at the next dispatch, or
        takes it out of the queue.  Safe to call from any thread, and more than once."""
        self.engine._cancel(self)

    def _post(self, kind: str, payload):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class Engine:
    """Continuous batching over ``slots`` (an ``eagle3_jax.decode.Slots``) in one thread.

    Args:
      slots: the device-side slot engine (not thread-safe: only the engine thread touches it).
      tokenizer: decodes the output (a private copy is used, off the event loop's thread).
      max_queue: the most requests waiting beyond the free slots (0: none wait);
        :meth:`submit` raises ``QueueFull`` beyond it.
      rounds_per_dispatch: the most decode rounds per host sync (while no request waits).
      dispatch_ms: after :meth:`warmup`, also at most the rounds that take this long (the
        engine's dearest round, measured on ``slots``); None: ``rounds_per_dispatch`` only.
      metrics: an ``eagle3_jax.serve.metrics.Metrics`` (or None).
    """

    def __init__(self, slots, tokenizer, *, max_queue: int = 64, rounds_per_dispatch: int = 16,
                 dispatch_ms: float | None = None, metrics=None):
        if max_queue < 0 or rounds_per_dispatch < 1 or (dispatch_ms is not None and not dispatch_ms > 0):
            raise ValueError(f"need max_queue >= 0, rounds_per_dispatch >= 1 and dispatch_ms > 0 (or None), got "
                             f"{max_queue}, {rounds_per_dispatch}, {dispatch_ms}")
        self.slots = slots
        self.tokenizer = copy.deepcopy(tokenizer)
        self.max_queue = max_queue
        self.rounds_per_dispatch = rounds_per_dispatch
        self.dispatch_ms = dispatch_ms
        self.max_rounds = rounds_per_dispatch  # the cap; bounded by dispatch_ms at warmup()
        self._ramp = 1  # rounds of the next dispatch: doubles up to max_rounds, 1 while requests wait or join
        self.metrics = metrics
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._cancelled: list[Request] = []
        self._by_slot: list[Request | None] = [None] * slots.num_slots
        self._pending: list[tuple[Request, object]] = []  # (request, its slot's view) of the last poll
        self._stop = False
        self.error: str | None = None
        self.dispatches = 0
        self._deferred: list[tuple[str, int]] = []  # warm-up programs the engine thread compiles while idle
        self._warmed, self._warm_args = 0, ([], None, 0)  # programs warmed; (prompt, progress, total) of warmup()
        self._thread = threading.Thread(target=self._main, name="eagle3-engine", daemon=True)

    # -- the event loop's side -------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self._by_slot)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop

    def start(self):
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0):
        """Stops the engine thread; requests still waiting or running get an error event."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def warmup_steps(self) -> list[tuple[str, int]]:
        """The programs :meth:`warmup` compiles, in its order: ``("dispatch", rows)`` for every
        row bucket (``Slots.row_buckets``), then ``("prefill", prompt_len)`` for every prompt
        bucket (``Slots.warm_buckets``)."""
        s = self.slots
        return [("dispatch", rows) for rows in s.row_buckets()] + [("prefill", n) for n in s.warm_buckets()]

    def deferred_steps(self) -> list[tuple[str, int]]:
        """The steps ``warmup(defer=True)`` leaves to the engine thread, in the order it compiles
        them: every step but the one-row dispatch and the smallest prefill, a prefill and a
        dispatch in turn, smallest first (a longer prompt and a larger batch alike wait for
        none but the programs before theirs)."""
        steps = self.warmup_steps()
        dispatches = [st for st in steps if st[0] == "dispatch"][1:]
        prefills = [st for st in steps if st[0] == "prefill"][1:]
        return [st for pair in itertools.zip_longest(prefills, dispatches) for st in pair if st is not None]

    @property
    def deferred(self) -> int:
        """Warm-up programs left to the engine thread (``warmup(defer=True)``), not yet compiled."""
        return len(self._deferred)

    def warmup(self, prompt_ids, cycles: int = 3, progress=None, defer: bool = False):
        """Compiles the engine's programs (prefill, dispatches, release, poll) on a short greedy
        request: ``cycles`` times over in slot 0 (a program whose input state came from another
        program may compile again), then once in the last slot of every larger row bucket
        (``Slots.row_buckets``: a dispatch compiles per row count); then the prefill of every
        prompt bucket (so that no request waits for a compilation, and no running stream stalls
        for one); then bounds the rounds per dispatch by ``dispatch_ms`` (``max_rounds``).
        ``progress(done, total, what)`` is called after each of :meth:`warmup_steps`.

        ``defer``: only the dispatch of one row and the prefill of the smallest prompt bucket
        are compiled here; the rest (:meth:`deferred_steps`) is left to the engine thread, which
        compiles them one at a time, smallest first, while it has no request (:attr:`deferred`):
        the engine starts serving sooner, and a request that arrives during one, or needs one
        not compiled yet, waits for it (after a first start it comes from the persistent
        compilation cache: a second or less).  Call before :meth:`start`."""
        if self._thread.is_alive():
            raise RuntimeError("warmup() runs before start(): the engine thread owns the slots")
        steps = self.warmup_steps()
        later = self.deferred_steps() if defer else []
        self._warm_args = (list(prompt_ids), progress, len(steps))
        for i, step in enumerate(st for st in steps if st not in later):
            self._warm(step, cycles if i == 0 else 1)  # the states' kinds are settled after the first
        self._deferred = later
        s = self.slots
        if self.dispatch_ms is not None:
            dearest = max(s.round_ms or s.measure_round_ms(repeats=1))
            self.max_rounds = max(1, min(self.rounds_per_dispatch, int(self.dispatch_ms / dearest)))
        s.reset_policy()  # the warm-up requests taught the adaptive policy nothing about real ones

    def _warm(self, step: tuple[str, int], cycles: int = 1):
        """Runs one of :meth:`warmup_steps` (its program compiles) and reports it.  A deferred
        one leaves the adaptive policy as it was taught by real requests (its few warm-up
        rounds count among them)."""
        prompt_ids, progress, total = self._warm_args
        s = self.slots
        kind, n = step
        if kind == "dispatch":
            for _ in range(cycles):
                s.insert(n - 1, prompt_ids, max_new_tokens=max(1, min(8, s.max_new_tokens_for(len(prompt_ids)))))
                s.run(1)
                s.run(self.rounds_per_dispatch)
                s.poll()
                s.release(n - 1)
                s.poll()
        else:
            s.insert(0, (prompt_ids * n)[:n], max_new_tokens=1)
            s.poll()
            s.release(0)
            s.poll()
        self._warmed += 1
        if progress is not None:
            progress(self._warmed, total, f"dispatch of {n} rows" if kind == "dispatch" else
                     f"prefill of {s.prompt_bucket(n)}-token prompts")

    def submit(self, prompt_ids, params: Params, *, split: bool) -> Request:
        """Queues a request (call on the asyncio loop that reads its events); raises
        ``QueueFull`` when every slot is busy or spoken for and ``max_queue`` requests already
        wait beyond the slots (``max_queue=0``: no waiting line, a request is taken only into a
        free slot), ``EngineDown`` when stopped."""
        req = Request(self, prompt_ids, params, split, asyncio.get_running_loop())
        with self._cv:
            if not self.alive:
                raise EngineDown(self.error or "the engine is not running")
            free = sum(r is None for r in self._by_slot)
            if len(self._waiting) - free >= self.max_queue:
                raise QueueFull(f"the queue is full: all {self.slots.num_slots} slots are busy and "
                                f"{self.max_queue} requests wait beyond them (--max-queue {self.max_queue})")
            self._waiting.append(req)
            self._cv.notify()
        if self.metrics is not None:
            self.metrics.request_queued(len(prompt_ids))
        return req

    def _cancel(self, req: Request):
        with self._cv:
            if req.done:
                return
            if req.slot is None and req in self._waiting:
                self._waiting.remove(req)
                self._finish(req, "cancelled")
                return
            self._cancelled.append(req)
            self._cv.notify()

    # -- the engine thread -----------------------------------------------------------------

    def _main(self):
        try:
            while self._step():
                pass
            status, message = 503, "the server is shutting down"
        except Exception as e:  # a device or engine fault: fail every request, refuse new ones
            status, message = 500, f"engine error: {type(e).__name__}: {e}"
            self.error = message
        with self._cv:
            pending = [*self._waiting, *(r for r in self._by_slot if r is not None), *(r for r, _ in self._pending)]
            self._waiting.clear()
            self._by_slot = [None] * len(self._by_slot)
            self._pending = []
        for req in pending:
            if not req.done:
                req.done = True
                req._post("error", (status, message))
                if self.metrics is not None:
                    self.metrics.request_finished(req, "error")

    def _step(self) -> bool:
        """One iteration: cancellations, admissions, a dispatch, the host work of the previous
        poll (while the dispatch runs), then the poll of the program before this dispatch (the
        previous dispatch, or this step's last admission); False to stop."""
        with self._cv:
            while not (self._stop or self._waiting or self._cancelled or self.running or self._pending
                       or self._deferred):
                self._cv.wait()
            if self._stop:
                return False
            idle = not (self._waiting or self._cancelled or self.running or self._pending)
            cancelled, self._cancelled = self._cancelled, []
        if idle:  # nothing to serve: a deferred warm-up program
            self._warm(self._deferred.pop(0))
            return True
        for req in cancelled:
            if not req.done:
                if req.slot is not None:
                    self.slots.release(req.slot)
                    self._free(req)
                self._finish(req, "cancelled")
        with self._cv:
            admit = []
            for slot, r in enumerate(self._by_slot):
                if r is None and self._waiting:
                    req = self._waiting.popleft()
                    req.slot = slot
                    self._by_slot[slot] = req
                    admit.append(req)
            queued = bool(self._waiting)
        for req in admit:
            p = req.params
            try:
                req.ticket = self.slots.insert(req.slot, req.prompt_ids, max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                                  top_p=p.top_p, top_k=p.top_k, seed=p.seed, stop_token_ids=p.stop_token_ids,
                                  thinking_budget=p.thinking_budget)
            except (TypeError, ValueError) as e:  # the HTTP layer validates first; this is the last guard
                self._free(req)
                req.done = True
                req._post("error", (400, str(e)))
                if self.metrics is not None:
                    self.metrics.request_finished(req, "error")
        active = [r for r in self._by_slot if r is not None]
        if active:
            fresh = sum(r.slot is not None for r in admit)  # admitted (an insert may have refused one)
            joined = fresh and len(active) > fresh  # newcomers beside running requests
            self._ramp = 1 if queued or joined else min(2 * self._ramp, self.max_rounds)
            self.slots.run(self._ramp)
        pending, self._pending = self._pending, []
        for req, view in pending:  # the previous poll's tokens, while the device runs this dispatch
            if not req.done:
                self._deliver(req, view)
        if active:
            # After a dispatch, read the program before it (a dispatch, or the last admission's
            # prefill: its first token): the device runs this dispatch meanwhile.
            views = self.slots.poll(lag=1)
            self.dispatches += 1
            now = time.perf_counter()
            for req in active:
                if req.done or req.slot is None:  # a stop string ended it while this dispatch ran
                    continue
                view = views[req.slot]
                if view.ticket != req.ticket:  # read from before its admission
                    continue
                if req.first_token is None and view.tokens:
                    req.first_token = now
                self._pending.append((req, view))
                if view.done:  # finished on device: its slot takes the next admission
                    self._free(req)
        if self.metrics is not None:
            self.metrics.engine_state(self.waiting, self.running)
        return True

    def _deliver(self, req: Request, view):
        """Feeds a request the tokens of its slot's view; finishes it when the view is done or a
        stop string matched (then its slot, still running, is released)."""
        new = view.tokens[req.sent_tokens:]
        req.sent_tokens = len(view.tokens)
        before = req.parser.completion_tokens
        delta = req.parser.feed(new)
        counted = new[: req.parser.completion_tokens - before]
        req.tokens += counted
        if self.metrics is not None:
            self.metrics.tokens(req, len(counted), view.stats)
        req.stats = view.stats
        req.thinking_status = view.thinking_status
        if req.parser.stopped or view.done:
            if req.slot is not None:  # a stop string ended it: the slot stops now
                self.slots.release(req.slot)
                self._free(req)
            delta = _merge(delta, req.parser.finish())
            if delta or counted:
                req._post("delta", (delta, counted))
            self._finish(req, "stop" if req.parser.stopped else (view.finish_reason or "length"))
        elif delta or counted:
            req._post("delta", (delta, counted))

    def _free(self, req: Request):
        with self._cv:
            if req.slot is not None and self._by_slot[req.slot] is req:
                self._by_slot[req.slot] = None
            req.slot = None

    def _finish(self, req: Request, reason: str):
        req.done = True
        end = time.perf_counter()
        p = req.parser
        res = Result(texts=p.texts, finish_reason=reason, prompt_tokens=len(req.prompt_ids),
                     completion_tokens=p.completion_tokens, reasoning_tokens=p.reasoning_tokens,
                     tokens=list(req.tokens), stats=_public_stats(req.stats), thinking_status=req.thinking_status,
                     ttft=None if req.first_token is None else req.first_token - req.arrival, latency=end - req.arrival)
        req.result = res
        req._post("done", res)
        if self.metrics is not None:
            self.metrics.request_finished(req, reason)


def _merge(a: dict, b: dict) -> dict:
    return {k: a.get(k, "") + b.get(k, "") for k in (*a, *(k for k in b if k not in a))}


def count(v) -> int:
    """A stats count: ``Slots`` reports per-row lists (one row), ``generate`` plain numbers."""
    return int(sum(v)) if isinstance(v, (list, tuple)) else int(v or 0)


_PUBLIC = ("rounds", "tau", "proposed", "accepted", "acceptance_rate", "accepted_per_position", "offered_per_position",
           "forced_rounds", "tier_rounds", "committed")


def _public_stats(stats: dict) -> dict:
    """The speculative figures a response reports (JSON-able; counts as numbers)."""
    def pick(s):
        out = {k: s[k] for k in _PUBLIC if k in s}
        if "rounds" in out:
            out["rounds"] = count(out["rounds"])
        return out

    out = pick(stats)
    if "phases" in stats:
        out["phases"] = {ph: pick(s) for ph, s in stats["phases"].items()}
    return out
