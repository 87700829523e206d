"""Compiling the serving engine's programs ahead of traffic: ``Planned`` programs (abstract arguments, from
``EngineCore.warmup_plan``) and the ``Warmer`` that compiles them — the first ones before serving, the rest on
a background thread while the engine serves, a program traffic needs now first in line.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from dspine_jax.parallel.mesh import use_mesh
from dspine_jax.serve.programs import ProgramError, memory_maps, process_report

WARMUP_MODES = ("full", "lazy", "none")
BACKGROUND_SHARE = 0.75  # the background warmup stops at this share of the program and memory-map budgets


@dataclasses.dataclass
class Planned:
    """A program to compile ahead: ``fn(*args, **static)`` with abstract ``args``."""

    label: str
    fn: Callable
    args: tuple
    static: dict = dataclasses.field(default_factory=dict)


class Warmer(threading.Thread):
    """Compiles an engine's planned programs in order: the first ones in the calling thread (``ahead``), the
    rest in the background (``start``) while the engine serves. ``want`` puts a program traffic needs now
    in front of the plan. The plan stops at ``BACKGROUND_SHARE`` of the budgets, so it never evicts what
    traffic compiled; wanted programs compile whatever the budget (the least recently used one goes)."""

    def __init__(self, core: Any, plan: list[Planned], progress: Callable[[str], None] | None):
        super().__init__(name="dspine-warmup", daemon=True)
        self.core, self.progress = core, progress
        self.plan = collections.deque(plan)
        self.wanted: collections.deque[Planned] = collections.deque()
        self.planned, self.compiled = len(plan), 0
        self.cond = threading.Condition()
        self.stopping = False
        self.busy = False  # compiling an item taken off the queues

    def want(self, item: Planned) -> None:
        with self.cond:
            if all(self.core.programs.key(w.fn, w.args, w.static) != self.core.programs.key(item.fn, item.args, item.static)
                   for w in self.wanted):
                self.wanted.append(item)
            self.cond.notify_all()

    def start(self) -> None:
        atexit.register(self.stop, join=True)  # an interpreter must not exit under a running XLA compile
        super().start()

    def stop(self, join: bool = False) -> None:
        """Stop after the program being compiled (``join``: wait for it)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if join and self.is_alive() and threading.current_thread() is not self:
            self.join()

    def _full(self, share: float) -> bool:
        programs = self.core.programs
        if programs.max_programs is not None and len(programs) >= share * programs.max_programs:
            return True
        maps = memory_maps() if programs.max_maps is not None else None
        return maps is not None and maps >= share * programs.max_maps

    def _compile(self, item: Planned, planned: bool) -> None:
        programs = self.core.programs
        if programs.ready(item.fn, item.args, item.static):
            return
        start = time.perf_counter()
        try:
            with use_mesh(self.core.mesh):
                programs.get(item.fn, item.args, item.static)
        except ProgramError as e:  # serving compiles it again when needed, and fails that request
            if self.progress:
                self.progress(f"warmup: {e}")
            return
        self.compiled += planned
        if self.progress:
            count = f" [{self.compiled}/{self.planned}]" if planned else " (needed now)"
            self.progress(f"compiled {item.label}: {item.fn.__name__} in {time.perf_counter() - start:.1f}s{count}")

    def ahead(self, count: int) -> None:
        """Compile the next ``count`` planned programs in this thread, within the whole budget."""
        for _ in range(count):
            if not self.plan or self._full(1.0):
                break
            self._compile(self.plan.popleft(), planned=True)

    def run(self) -> None:
        """The background: wanted programs first, then the plan while under ``BACKGROUND_SHARE`` of the budget."""
        while True:
            with self.cond:
                while not self.stopping and not self.wanted and not self.plan:
                    self.cond.wait()
                if self.stopping:
                    return
                wanted = bool(self.wanted)
                item = self.wanted.popleft() if wanted else self.plan.popleft()
                self.busy = True
            if not wanted and self._full(BACKGROUND_SHARE):
                with self.cond:
                    self.plan.clear()
                if self.progress:
                    programs = self.core.programs
                    self.progress(f"warmup stops at {len(programs)} programs (budget {programs.max_programs} "
                                  f"programs, {programs.max_maps} memory maps); the rest compile when first needed")
                self.busy = False
                continue
            self._compile(item, planned=not wanted)
            if not wanted and not self.plan and self.progress:
                report = process_report()
                self.progress(f"warmup done: {len(self.core.programs)} programs held, {report['maps']} memory "
                              f"maps, {(report['rss_bytes'] or 0) / 2**30:.1f} GiB resident")
            self.busy = False
