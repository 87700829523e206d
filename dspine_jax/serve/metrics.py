"""Prometheus text exposition (format 0.0.4) for the server, without a client library."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any


class Histogram:
    def __init__(self, buckets):
        self.buckets = sorted(float(b) for b in buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1


def _fmt(x: float) -> str:
    return repr(float(x)) if x != int(x) or abs(x) > 1e15 else f"{int(x)}.0"


class Metrics:
    """Thread-safe counters, gauges and histograms; ``render()`` → Prometheus text."""

    WINDOW_S = 10.0

    def __init__(self, max_acceptance: int = 16):
        self.lock = threading.Lock()
        self.requests = collections.Counter()  # (endpoint, status) → count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.running = 0
        self.queued = 0
        self.set_max_acceptance(max_acceptance)
        self.latency = Histogram([0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300])
        self.ttft = Histogram([0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60])
        self._window = collections.deque()  # (time, tokens, step seconds)
        self.prefix_stats: Callable[[], Any] | None = None  # the engine's prefix-cache counters, once it exists
        self.program_stats: Callable[[], dict[str, Any]] | None = None  # compiled programs, warmup, process memory

    def set_max_acceptance(self, max_acceptance: int) -> None:
        """Acceptance-length buckets 1 … ``max_acceptance`` (the server learns it once the engine is built)."""
        with self.lock:
            self.acceptance = Histogram(range(1, max(max_acceptance, 1) + 1))
            self.verify_length = Histogram(range(1, max(max_acceptance, 1) + 1))

    def request(self, endpoint: str, status: str) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def record_step(self, accepted: list[int], seconds: float, verify_lengths: list[int] = ()) -> None:
        now = time.monotonic()
        with self.lock:
            self.steps += 1
            for a in accepted:
                self.acceptance.observe(a)
            for t in verify_lengths:
                self.verify_length.observe(t)
            self._window.append((now, sum(accepted), seconds))
            while self._window and self._window[0][0] < now - self.WINDOW_S:
                self._window.popleft()

    def decode_tokens_per_second(self) -> float:
        now = time.monotonic()
        with self.lock:
            while self._window and self._window[0][0] < now - self.WINDOW_S:
                self._window.popleft()
            tokens = sum(t for _, t, _ in self._window)
            busy = sum(s for _, _, s in self._window)
        return tokens / busy if busy > 0 else 0.0

    def render(self) -> str:
        rate = self.decode_tokens_per_second()
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        def hist(name, help_, h: Histogram):
            samples = [f'{name}_bucket{{le="{_fmt(b)}"}} {c}' for b, c in zip(h.buckets, h.counts)]
            samples += [f'{name}_bucket{{le="+Inf"}} {h.count}', f"{name}_sum {_fmt(h.sum)}", f"{name}_count {h.count}"]
            metric(name, "histogram", help_, samples)

        with self.lock:
            reqs = [
                f'dspine_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())
            ]
            metric("dspine_requests_total", "counter", "Requests by endpoint and outcome.", reqs)
            metric("dspine_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
                   [f"dspine_prompt_tokens_total {self.prompt_tokens}"])
            metric("dspine_generation_tokens_total", "counter", "Tokens generated.",
                   [f"dspine_generation_tokens_total {self.generation_tokens}"])
            metric("dspine_engine_steps_total", "counter", "Engine steps (one verify round for all running slots).",
                   [f"dspine_engine_steps_total {self.steps}"])
            hist("dspine_acceptance_length", "Tokens committed per request per verify step (bonus included).",
                 self.acceptance)
            hist("dspine_verify_length", "Tokens verified per round (1: a plain decode step; chosen per round with "
                 "--verify auto).", self.verify_length)
            hist("dspine_request_latency_seconds", "End-to-end request latency.", self.latency)
            hist("dspine_time_to_first_token_seconds", "Time from arrival to the first token.", self.ttft)
            metric("dspine_decode_tokens_per_second", "gauge",
                   f"Tokens committed per second of engine-step time over the last {self.WINDOW_S:.0f} s.",
                   [f"dspine_decode_tokens_per_second {_fmt(rate)}"])
            metric("dspine_running_requests", "gauge", "Requests holding a slot.",
                   [f"dspine_running_requests {self.running}"])
            metric("dspine_queued_requests", "gauge", "Requests waiting for a slot.",
                   [f"dspine_queued_requests {self.queued}"])
            prefix = self.prefix_stats() if self.prefix_stats is not None else None
            if prefix is not None:
                for name, kind, help_, value in (
                    ("lookups_total", "counter", "Prompts looked up in the prefix cache.", prefix.lookups),
                    ("hits_total", "counter", "Prompts that started from a cached row.", prefix.hits),
                    ("hit_tokens_total", "counter", "Prompt tokens taken from the cache instead of prefilled.",
                     prefix.hit_tokens),
                    ("hit_rate", "gauge", "Share of looked-up prompt tokens taken from the cache.",
                     prefix.hit_tokens / prefix.prompt_tokens if prefix.prompt_tokens else 0.0),
                    ("entries", "gauge", "Rows held.", prefix.entries),
                    ("bytes", "gauge", "Device memory the rows hold.", prefix.bytes),
                    ("evictions_total", "counter", "Rows evicted under the memory budget.", prefix.evictions),
                ):
                    metric(f"dspine_prefix_cache_{name}", kind, help_, [f"dspine_prefix_cache_{name} {_fmt(value)}"])
            programs = self.program_stats() if self.program_stats is not None else None
            if programs is not None:
                for name, kind, help_ in (
                    ("programs", "gauge", "Compiled programs held (bounded by --max-programs and the memory maps)."),
                    ("program_compiles_total", "counter", "Programs compiled (or loaded from the compilation cache)."),
                    ("program_evictions_total", "counter", "Programs dropped under the budget (compiled again if needed)."),
                    ("program_failures_total", "counter", "Compilations that failed (the requests needing them got a 5xx)."),
                    ("program_compile_seconds_total", "counter", "Seconds spent compiling."),
                    ("warmup_planned", "gauge", "Programs the warmup plans to compile ahead."),
                    ("warmup_compiled", "gauge", "Planned programs the warmup has compiled."),
                    ("warmup_pending", "gauge", "Programs still waiting for the background warmup."),
                    ("process_memory_maps", "gauge", "Memory maps of the server process (Linux vm.max_map_count bounds them)."),
                    ("process_resident_bytes", "gauge", "Resident memory of the server process."),
                ):
                    value = programs.get(name)
                    if value is not None:
                        metric(f"dspine_{name}", kind, help_, [f"dspine_{name} {_fmt(value)}"])
                by_function = programs.get("program_compiles_by_function") or {}
                metric("dspine_program_compiles_by_function_total", "counter", "Programs compiled, by engine function.",
                       [f'dspine_program_compiles_by_function_total{{function="{f}"}} {n}'
                        for f, n in sorted(by_function.items())])
        return "\n".join(out) + "\n"
