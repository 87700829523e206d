"""One engine over several processes: process 0 serves HTTP and schedules, the others follow.

JAX's multi-controller runtime runs a program only when every process launches it, in the same order, with
the same arguments. So every process holds the same ``EngineCore`` (same weights, mesh, slots and
programs) and runs the same sequence of its calls: process 0's scheduler decides (admissions, prefill
calls, steps, releases), and ``LeaderCore`` sends each call to the followers before running it; each
follower's ``follow`` loop receives the calls and runs them on its own ``EngineCore``. Everything else a
call depends on is equal by construction (the slots' host mirrors change only through these calls) or is
agreed inside the engine: the step's time that refines the verify costs is process 0's, and the step's
emitted tokens are checked across processes (``distributed.check_step``: a mismatch is an error on every
process, not silent divergence). Only process 0 detokenises and streams.

A call travels as a pickle through ``broadcast_one_to_all`` (JAX's own collective over the processes'
devices; ~1.5 ms on this CPU's gloo): a fixed 1 KiB header holding the call when it fits, then the rest
(long prompts) in one more broadcast.

Faults, bounded in time: a process that dies breaks the next collective on the others (gloo reports the
closed connection at once); one that hangs is caught by a ``Watchdog`` after ``peer_timeout`` seconds in a
collective. Process 0 then fails every request with a 503 and exits non-zero; a follower exits non-zero.
While process 0 is idle it sends a heartbeat every ``HEARTBEAT_S`` seconds, so an idle follower can tell a
quiet leader from a lost one. Stopping process 0 (Ctrl-C) sends ``stop``: every follower exits 0.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from dspine_jax.parallel import distributed
from dspine_jax.serve.engine import EngineCore, PendingStep, SlotParams

HEADER_BYTES = 1024  # a call up to this size travels in one broadcast (every call but long prompts)
HEARTBEAT_S = 2.0  # an idle leader's heartbeat
DEFAULT_PEER_TIMEOUT_S = 300  # the longest a process waits in a collective for its peers (compiles included)
FAILURE_EXIT_CODE = 3  # a process that lost its peers


def heartbeat_timeout(peer_timeout: int) -> int:
    """The runtime's heartbeat timeout for a server whose watchdog waits ``peer_timeout`` seconds. A peer the
    runtime stops hearing from aborts the process outright (no 503, no clean exit), so it must outlast the
    watchdog, which ends the requests in flight first (a peer that dies while gloo first connects a group of
    devices breaks no collective: only one of these two timers sees it). The runtime can call a peer dead as
    early as half its timeout after the death (seen: a killed follower declared dead ~80 s after the kill with
    the timeout at 150 s, its last heartbeat having come well before the kill), so half of it outlasts the
    watchdog by a minute."""
    return max(distributed.DEFAULT_HEARTBEAT_SECONDS, 2 * (peer_timeout + 60))


class PeerFailure(RuntimeError):
    """A collective with the other processes failed or timed out: the run cannot go on."""


def exchange(message: bytes | None) -> bytes:
    """Process 0's ``message`` on every process (the others pass None). Every process must call this at the
    same point: it is two collectives at most (the header, then the rest of a long message)."""
    head = np.zeros(HEADER_BYTES, np.uint8)
    room = HEADER_BYTES - 4
    if message is not None:
        head[:4] = np.frombuffer(len(message).to_bytes(4, "little"), np.uint8)
        first = np.frombuffer(message[:room], np.uint8)
        head[4 : 4 + first.size] = first
    head = np.asarray(multihost_utils.broadcast_one_to_all(head))
    size = int.from_bytes(head[:4].tobytes(), "little")
    if size <= room:
        return head[4 : 4 + size].tobytes()
    rest = np.zeros(1 << (size - room - 1).bit_length(), np.uint8)  # a power of two: few shapes, few programs
    if message is not None:
        rest[: size - room] = np.frombuffer(message[room:], np.uint8)
    rest = np.asarray(multihost_utils.broadcast_one_to_all(rest))
    return head[4:].tobytes() + rest[: size - room].tobytes()


class Watchdog:
    """Calls ``on_timeout(what, seconds)`` (on its own thread) when the code inside ``guard(what)`` has run for
    more than ``timeout`` seconds: a collective whose peer hangs never returns by itself."""

    def __init__(self, timeout: float, on_timeout: Callable[[str, float], None]):
        self.timeout, self.on_timeout = timeout, on_timeout
        self._since: float | None = None
        self._what = ""
        self._thread = threading.Thread(target=self._watch, name="dspine-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                self.on_timeout(self._what, time.monotonic() - since)
                return


class LeaderCore:
    """Process 0's ``EngineCore``: each call that runs programs is first sent to the followers. Reads (slots,
    lengths, reports) are the local core's. A collective that fails raises ``PeerFailure``."""

    def __init__(self, core: EngineCore, watchdog: Watchdog):
        self.core, self.watchdog = core, watchdog
        self._last_sent = time.monotonic()

    def __getattr__(self, name: str) -> Any:  # reads: free_slot, running, warmup_progress, …
        return getattr(self.core, name)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._send((name, args, kwargs))
        with self.watchdog.guard(name), _peer_errors(name):
            return getattr(self.core, name)(*args, **kwargs)

    def _send(self, call: tuple[str, tuple, dict]) -> None:
        with self.watchdog.guard(f"sending {call[0]}"), _peer_errors(f"sending {call[0]}"):
            exchange(pickle.dumps(call))
        self._last_sent = time.monotonic()

    def admit(self, slot: int, prompt: Sequence[int], max_new_tokens: int, params: SlotParams) -> None:
        return self._call("admit", slot, list(prompt), max_new_tokens, params)

    def prefill(self, slots: Sequence[int] | None = None) -> dict[int, tuple[int, str | None]]:
        return self._call("prefill", slots)

    def launch(self, rounds: int | None = None) -> PendingStep | None:  # (the followers collect at once)
        return self._call("launch", rounds)

    def collect(self, pending: PendingStep) -> Any:
        with self.watchdog.guard("step"), _peer_errors("step"):
            return self.core.collect(pending)

    def release(self, slot: int) -> None:
        return self._call("release", slot)

    def reset(self) -> None:
        return self._call("reset")

    def heartbeat(self) -> None:
        """Tell idle followers the leader is alive (at most every ``HEARTBEAT_S`` seconds)."""
        if time.monotonic() - self._last_sent >= HEARTBEAT_S:
            self._send(("heartbeat", (), {}))

    def close(self) -> None:
        """Stop the followers (they exit 0), then the local core."""
        try:
            self._send(("stop", (), {}))
        finally:
            self.core.close()


def is_peer_error(e: BaseException) -> bool:
    """A failed collective (a peer's closed connection, a timeout in the runtime) or a divergence between
    processes: the run cannot go on."""
    return isinstance(e, (distributed.DivergenceError, jax.errors.JaxRuntimeError))


@contextmanager
def _peer_errors(what: str) -> Iterator[None]:
    """Errors of a call that spans processes become ``PeerFailure``; the engine's own (a bad request, a
    compile failure) pass unchanged."""
    try:
        yield
    except Exception as e:
        if is_peer_error(e):
            raise PeerFailure(f"lost the other processes ({what}: {distributed.first_line(e)})") from e
        raise


def follow(core: EngineCore, *, peer_timeout: float = DEFAULT_PEER_TIMEOUT_S,
           log: Callable[[str], None] = print) -> int:
    """A follower's loop: run process 0's calls on ``core`` until it sends ``stop`` (returns 0). Returns
    ``FAILURE_EXIT_CODE`` when the leader is gone: a failed collective, or no word for ``peer_timeout``
    seconds (the leader's heartbeats stopped) — the caller exits with it."""
    def give_up(what: str, seconds: float) -> None:
        log(f"no word from process 0 for {seconds:.0f}s ({what}): stopping")
        os._exit(FAILURE_EXIT_CODE)  # the main thread is stuck in a collective that never returns

    watchdog = Watchdog(peer_timeout, give_up)
    while True:
        try:
            with watchdog.guard("waiting for process 0"):
                name, args, kwargs = pickle.loads(exchange(None))
            if name == "stop":
                log("process 0 stopped the run")
                return 0
            if name == "heartbeat":
                continue
            with watchdog.guard(name):
                try:
                    result = getattr(core, name)(*args, **kwargs)
                    if name == "launch" and result is not None:
                        core.collect(result)
                except Exception as e:
                    if is_peer_error(e):
                        raise
                    # process 0 met the same error on the same call (a refused request, a program that did not
                    # compile) and goes on, or resets (a ``reset`` call follows)
                    log(f"{name}: {type(e).__name__}: {e}")
        except Exception as e:
            log(f"lost process 0 ({type(e).__name__}: {distributed.first_line(e)}): stopping")
            sys.stderr.flush()
            return FAILURE_EXIT_CODE
