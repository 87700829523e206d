"""Several drafters in one server, chosen per request (``--draft code=DIR --draft prose=DIR2``; a request's
``"drafter": "prose"`` field): one ``EngineCore`` per drafter, all over the same target weights (the
``Target`` pytree is shared, not copied), each with its own slots and caches.

``DrafterEngines`` is the one engine the scheduler sees (``scheduler.AsyncEngine``): global slot ids, engine
``i`` owning ``[offset_i, offset_i + slots_i)``. A request waits for a slot of its own drafter's engine; each
scheduler iteration prefills and steps **one** engine, in turn among those with work — the engines never
share a device call, so two drafters' requests are never batched together (each engine batches its own),
and a program that fails to compile fails only its own engine's requests. The memory a process may map
for compiled programs and the prefix cache's bytes are split between the engines.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from dspine_jax.serve.engine import EngineCore, PendingStep, SlotParams, StepResult
from dspine_jax.serve.prefix_cache import PrefixStats
from dspine_jax.serve.programs import ProgramError

NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")  # a drafter's name in --draft NAME=SPEC and in requests


def parse_draft_flags(values: Sequence[str] | None) -> dict[str, str] | None:
    """``--draft`` values → ``{name: spec}`` (None: no flag). One unnamed value is the only drafter
    (named ``"default"``); several must all be named ``NAME=SPEC``, with distinct names. ``ValueError`` else."""
    if not values:
        return None
    named: dict[str, str] = {}
    for value in values:
        name, sep, spec = value.partition("=")
        if not sep or not NAME.fullmatch(name) or not spec:
            if len(values) == 1:
                return {"default": value}
            raise ValueError(f"with several --draft flags each must be NAME=DIR (a name a request chooses it "
                             f"by), got {value!r}")  # fmt: skip
        if name in named:
            raise ValueError(f"--draft: the name {name!r} is given twice")
        named[name] = spec
    return named


class DrafterEngines:
    """Named ``EngineCore``s as one engine (module doc). The first is the default drafter."""

    def __init__(self, cores: dict[str, EngineCore]):
        if len(cores) < 2:
            raise ValueError("DrafterEngines holds two engines or more")
        self.names = tuple(cores)
        self.cores = list(cores.values())
        sizes = [core.num_slots for core in self.cores]
        self.offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        self.num_slots = sum(sizes)
        self.context_length = min(core.context_length for core in self.cores)
        self.max_verify = max(core.max_verify for core in self.cores)
        self.target = self.cores[0].target
        self._turn = 0  # the engine whose turn it is to step (round-robin among those with work)

    # -- slots
    def _local(self, slot: int) -> tuple[EngineCore, int]:
        i = int(np.searchsorted(self.offsets, slot, side="right")) - 1
        return self.cores[i], slot - self.offsets[i]

    def _global(self, i: int, slots: Sequence[int]) -> list[int]:
        return [self.offsets[i] + s for s in slots]

    def free_slot(self, drafter: str | None = None) -> int | None:
        """A free slot of ``drafter``'s engine (None: of any engine)."""
        indices = range(len(self.cores)) if drafter is None else [self.names.index(drafter)]
        for i in indices:
            slot = self.cores[i].free_slot()
            if slot is not None:
                return self.offsets[i] + slot
        return None

    @property
    def running(self) -> np.ndarray:
        return np.concatenate([core.running for core in self.cores])

    def num_running(self) -> int:
        return sum(core.num_running() for core in self.cores)

    def num_prefilling(self) -> int:
        return sum(core.num_prefilling() for core in self.cores)

    def admit(self, slot: int, prompt: Sequence[int], max_new_tokens: int, params: SlotParams) -> None:
        core, local = self._local(slot)
        core.admit(local, prompt, max_new_tokens, params)

    def release(self, slot: int) -> None:
        core, local = self._local(slot)
        core.release(local)

    def reset(self) -> None:
        for core in self.cores:
            core.reset()

    # -- device calls: one engine per call, in turn
    def _next(self, has_work) -> int | None:
        n = len(self.cores)
        for k in range(n):
            i = (self._turn + k) % n
            if has_work(self.cores[i]):
                self._turn = (i + 1) % n
                return i
        return None

    def prefill(self, slots: Sequence[int] | None = None) -> dict[int, tuple[int, str | None]]:
        """One prefill call of one engine with prompts to prefill (``slots``: global ids, or None)."""
        i = self._next(lambda core: core.num_prefilling() > 0)
        if i is None:
            return {}
        local = None if slots is None else [s - self.offsets[i] for s in slots
                                            if self.offsets[i] <= s < self.offsets[i] + self.cores[i].num_slots]
        try:
            done = self.cores[i].prefill(local)
        except ProgramError as e:
            e.slots = self._global(i, getattr(e, "slots", []))
            raise
        return {self.offsets[i] + s: first for s, first in done.items()}

    def launch(self, rounds: int | None = None) -> tuple[int, PendingStep] | None:
        i = self._next(lambda core: core.num_running() > 0)
        if i is None:
            return None
        pending = self.cores[i].launch(rounds)
        return None if pending is None else (i, pending)

    def collect(self, pending: tuple[int, PendingStep]) -> StepResult:
        i, inner = pending
        result = self.cores[i].collect(inner)
        offset = self.offsets[i]
        return dataclasses.replace(result, tokens={offset + s: t for s, t in result.tokens.items()},
                                   finished={offset + s: r for s, r in result.finished.items()})

    def step(self, rounds: int | None = None) -> StepResult:
        pending = self.launch(rounds)
        return self.collect(pending) if pending is not None else StepResult({}, {}, [], 0)

    # -- reports and life cycle
    def prefix_stats(self) -> PrefixStats | None:
        stats = [s for s in (core.prefix_stats() for core in self.cores) if s is not None]
        if not stats:
            return None
        return PrefixStats(**{f: sum(getattr(s, f) for s in stats) for f in PrefixStats.__dataclass_fields__})

    def warmup(self, mode: str = "full", progress: Any = None) -> None:
        for name, core in zip(self.names, self.cores):
            core.warmup(mode, progress=None if progress is None else (lambda msg, n=name: progress(f"[{n}] {msg}")))

    def warmup_progress(self) -> dict[str, Any]:
        every = [core.warmup_progress() for core in self.cores]
        return {k: sum(p[k] for p in every) for k in every[0]}

    def program_report(self) -> dict[str, Any]:
        every = [core.program_report() for core in self.cores]
        report: dict[str, Any] = {}
        for key, value in every[0].items():
            if key.startswith("process_"):  # the process's own, not per engine
                report[key] = value
            elif isinstance(value, dict):
                report[key] = {k: sum(r[key].get(k, 0) for r in every) for k in set().union(*(r[key] for r in every))}
            else:
                report[key] = sum(r[key] for r in every)
        return report

    def close(self) -> None:
        for core in self.cores:
            core.close()
