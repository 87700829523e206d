"""The scheduler: one worker thread owns the ``EngineCore`` and runs admit → prefill → step → stream out.

Every JAX call happens on that thread. A request is queued (bounded: ``QueueFull`` when full), admitted
into a free slot between engine steps, prefilled in chunks (one batched prefill call per iteration, shared
with the other prompts being prefilled, between decode steps), and fed text deltas through an ``asyncio.Queue``
(``loop.call_soon_threadsafe``). Detokenization and stop strings (``TextStream``) run per request on the
worker **while the device runs the next step** (``EngineCore.launch`` / ``collect``): a step's tokens are
streamed out after the following step is dispatched. Slots freed meanwhile (a stop string, a finished or
failed request) are released once that step is collected, and its tokens for them are dropped; a
cancelled request's slot is freed before the next step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from dspine_jax.serve.engine import EngineCore, SlotParams
from dspine_jax.serve.metrics import Metrics
from dspine_jax.serve.programs import ProgramError

# Builds the engine core and its tokenizer; runs on the engine thread while the server says "starting".
Loader = Callable[[], tuple[EngineCore, Any]]


class StartupError(Exception):
    """A loader failure whose message is meant for the user as is (no traceback)."""


class TextStream:
    """Incremental detokenization with stop strings: never returns text past a stop string, and holds
    back a tail that could still become one (or an incomplete UTF-8 sequence)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""

    def feed(self, new_ids: list[int]) -> tuple[str, bool]:
        self.ids += new_ids
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = self.text
        best = -1
        for s in self.stops:
            idx = text.find(s, max(0, self.sent - len(s) + 1))
            if idx >= 0 and (best < 0 or idx < best):
                best = idx
        if best >= 0:
            out = text[self.sent:best] if best > self.sent else ""
            self.sent = max(self.sent, best)
            return out, True
        safe = len(text)
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        out = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out, False

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


@dataclasses.dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SlotParams
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    endpoint: str
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: bool = False
    slot: int | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_generated: int = 0
    stream: TextStream | None = None
    finished: bool = False
    drafter: str | None = None  # the drafter a server holding several decodes it with (``drafter_choice.py``)

    def emit(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class QueueFull(Exception):
    pass


class AsyncEngine:
    """Owns the EngineCore in a worker thread; a bounded waiting queue in front of it.

    The worker first runs ``load``: meanwhile ``state`` is "starting"; then "ready" (``ready`` is set), or
    "failed" with ``error`` set and ``on_failure(error)`` called (the CLI stops listening)."""

    def __init__(self, load: Loader, metrics: Metrics, max_queue: int):
        self.load, self.metrics, self.max_queue = load, metrics, max_queue
        self.core: EngineCore | None = None
        self.tokenizer: Any = None
        self.state = "starting"
        self.error: str | None = None
        self.ready = threading.Event()
        self.on_failure: Callable[[str], None] | None = None
        # several processes (replica.py): called every second while idle (the leader's heartbeat); an error that
        # ``fatal`` accepts ends the engine (every request fails with a 503, ``on_failure``) instead of a reset
        self.on_idle: Callable[[], None] | None = None
        self.fatal: Callable[[BaseException], bool] = lambda error: False
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.active: dict[int, GenRequest] = {}
        self.cond = threading.Condition()
        self.stopping = False
        self.in_flight = False  # a step is dispatched and not collected: releases wait for it
        self.release_after_step: list[int] = []
        # the last step's tokens (request, tokens, finish reason), streamed out while the next step runs
        self.undelivered: list[tuple[GenRequest, list[int], str | None]] = []
        self.thread = threading.Thread(target=self._run, name="dspine-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.ready.is_set():  # a loader cannot be interrupted: leave it to die with the (daemon) thread
            self.thread.join(timeout=30)
            self.core.close()

    def submit(self, req: GenRequest) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull()
            req.stream = TextStream(self.tokenizer, req.stops)
            self.waiting.append(req)
            self.metrics.queued = len(self.waiting)
            self.cond.notify_all()

    def cancel(self, req: GenRequest) -> None:
        with self.cond:
            req.cancelled = True
            self.cond.notify_all()

    # -- worker thread
    def _finish(self, req: GenRequest, reason: str, status: str = "ok") -> None:
        if req.finished:
            return
        req.finished = True
        if req.slot is not None:
            self.active.pop(req.slot, None)
            if self.in_flight:  # the slot's caches belong to the step in flight: release it once collected
                self.release_after_step.append(req.slot)
                req.slot = None
            else:
                try:
                    self.core.release(req.slot)
                finally:
                    req.slot = None
        if status == "ok":
            req.emit(("done", reason, req.num_generated))
        self.metrics.request(req.endpoint, status)
        self.metrics.latency.observe(time.monotonic() - req.arrival)

    def _fail(self, req: GenRequest, exc: BaseException) -> None:
        traceback.print_exception(exc)
        req.emit(("error", f"internal error while generating: {type(exc).__name__}: {exc}"))
        try:
            self._finish(req, "error", status="error")
        except Exception as e:  # a failed release must not take the worker down
            traceback.print_exception(e)

    def _deliver(self, req: GenRequest, tokens: list[int], reason: str | None) -> None:
        """New tokens for ``req``: text delta, stop strings, completion."""
        if req.finished:  # cancelled or failed meanwhile
            return
        if req.first_token_time is None and tokens:
            req.first_token_time = time.monotonic()
            self.metrics.ttft.observe(req.first_token_time - req.arrival)
        req.num_generated += len(tokens)
        with self.metrics.lock:
            self.metrics.generation_tokens += len(tokens)
        delta, hit = req.stream.feed(tokens)
        if hit:
            if delta:
                req.emit(("text", delta))
            self._finish(req, "stop")
            return
        if reason is not None:
            delta += req.stream.flush()
        if delta:
            req.emit(("text", delta))
        if reason is not None:
            self._finish(req, reason)

    def _start(self) -> bool:
        """Run the loader; True once the engine can serve."""
        try:
            self.core, self.tokenizer = self.load()
            self.metrics.set_max_acceptance(self.core.max_verify)
            self.metrics.prefix_stats = self.core.prefix_stats
            self.metrics.program_stats = self.core.program_report
        except Exception as e:
            if not isinstance(e, StartupError):
                traceback.print_exception(e)
            self.error, self.state = str(e) or type(e).__name__, "failed"
            if self.on_failure is not None:
                self.on_failure(self.error)
            return False
        self.state = "ready"
        self.ready.set()
        return True

    def _run(self) -> None:
        if not self._start():
            return
        core = self.core
        while True:
            with self.cond:
                while not self.stopping and not self.waiting and not self.active and not self.undelivered:
                    self.cond.wait(timeout=1.0)
                    if self.on_idle is not None:
                        break
                if self.stopping:
                    return
                idle = not self.waiting and not self.active and not self.undelivered
            try:
                if idle:
                    self.on_idle()
                else:
                    self._iteration(core)
            except Exception as e:  # never let the worker die: fail what is in flight, start clean
                if self.fatal(e):
                    self.die(e)
                    return
                traceback.print_exception(e)
                self._fail_all([*self.active.values(), *(u[0] for u in self.undelivered)],
                               ("error", f"internal error while generating: {type(e).__name__}: {e}"))
                self.in_flight, self.release_after_step, self.undelivered = False, [], []
                try:
                    core.reset()
                except Exception as e2:
                    traceback.print_exception(e2)

    def die(self, error: BaseException) -> None:
        """The engine cannot go on (a peer process failed): every request fails with a 503, new ones too."""
        message = f"the engine stopped: {error}"
        with self.cond:
            self.error, self.state = message, "failed"
            requests = [*self.active.values(), *(u[0] for u in self.undelivered), *self.waiting]
            self.waiting.clear()
        self._fail_all(requests, ("error", message, 503))
        if self.on_failure is not None:
            self.on_failure(message)

    def _fail_all(self, requests: list[GenRequest], event: tuple) -> None:
        """End every one of ``requests`` not yet finished with the error ``event``; no slot is held after (the
        caller resets the engine or stops it)."""
        for req in {id(r): r for r in requests}.values():
            req.slot = None
            if not req.finished:
                req.finished = True
                req.emit(event)
                self.metrics.request(req.endpoint, "error")
        self.active.clear()

    def _iteration(self, core: EngineCore) -> None:
        for req in list(self.active.values()):
            if req.cancelled:
                self._finish(req, "cancelled", status="cancelled")
        # Admit waiting requests into free slots (their prompts are prefilled by the calls below).
        while True:
            with self.cond:
                if not self.waiting:
                    break
                drafter = self.waiting[0].drafter  # (first come, first served: it waits for its drafter's slot)
                slot = core.free_slot(drafter) if drafter is not None else core.free_slot()
                if slot is None:
                    break
                req = self.waiting.popleft()
                self.metrics.queued = len(self.waiting)
            if req.cancelled:
                self._finish(req, "cancelled", status="cancelled")
                continue
            req.slot = slot
            self.active[slot] = req
            try:
                core.admit(slot, req.prompt_ids, req.max_tokens, req.params)
            except Exception as e:
                if self.fatal(e):
                    raise
                self._fail(req, e)  # (releases the slot)
                continue
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(req.prompt_ids)
        # One prefill call (at most ``prefill_chunk`` tokens, several prompts together), then one step: a long
        # prompt goes in chunk by chunk while the running requests keep decoding.
        if core.num_prefilling():
            self._deliver_step()  # (a prefill call is not overlapped: stream the last step first)
            try:
                firsts = core.prefill()
            except ProgramError as e:  # nothing ran: fail the prompts of that call, the others go on
                self._fail_slots(e.slots, e)
                firsts = {}
            for slot, (first, reason) in firsts.items():
                self._deliver_to(slot, [first], reason)
        self.metrics.running = len(self.active)
        if core.num_running() == 0:
            self._deliver_step()
            return
        start = time.perf_counter()
        # While prompts are being prefilled or wait for a free slot, one round per step, so their chunks
        # (first tokens) come soon; else up to ``max_rounds`` (a request arriving meanwhile waits that long).
        with self.cond:
            admitting = bool(self.waiting) and core.free_slot() is not None
        try:
            pending = core.launch(rounds=1 if core.num_prefilling() or admitting else None)
        except ProgramError as e:  # the step could not be compiled (nothing ran): fail the running requests
            self._deliver_step()
            self._fail_slots([int(s) for s in np.flatnonzero(core.running)], e)
            return
        self.in_flight = True
        try:
            self._deliver_step()  # detokenise and stream the last step while this one runs
            result = core.collect(pending)
        finally:
            self.in_flight = False
            released, self.release_after_step = self.release_after_step, []
            for slot in released:
                core.release(slot)
        self.metrics.record_step(result.accepted, time.perf_counter() - start, result.verify_lengths)
        # Streamed during the next step, by request: a slot the device finished is free for admission now.
        self.undelivered = [(self.active[slot], tokens, result.finished.get(slot))
                            for slot, tokens in result.tokens.items() if slot in self.active]  # fmt: skip
        for slot in result.finished:
            req = self.active.pop(slot, None)
            if req is not None:
                req.slot = None
                core.release(slot)
        self.metrics.running = len(self.active)

    def _deliver_step(self) -> None:
        """Stream out the last collected step's tokens (text deltas, stop strings, completions)."""
        pending, self.undelivered = self.undelivered, []
        for req, tokens, reason in pending:
            try:
                self._deliver(req, tokens, reason)
            except Exception as e:
                self._fail(req, e)

    def _fail_slots(self, slots: list[int], exc: BaseException) -> None:
        """Fail the requests in ``slots`` (their slots are released; the engine goes on serving)."""
        for slot in slots:
            req = self.active.get(slot)
            if req is not None:
                self._fail(req, exc)
            else:
                self.core.release(slot)

    def _deliver_to(self, slot: int, tokens: list[int], reason: str | None) -> None:
        """``_deliver`` to the request in ``slot``; a failure fails only that request."""
        req = self.active.get(slot)
        if req is None:
            return
        try:
            self._deliver(req, tokens, reason)
        except Exception as e:
            self._fail(req, e)
