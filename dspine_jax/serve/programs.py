"""The serving engine's compiled programs: compiled once per shape, on demand or ahead, and bounded.

A long-lived server meets many shapes (row buckets × capacity buckets × verify lengths × prefill widths).
``jax.jit`` keeps every executable it ever compiled for the life of the process, and on XLA:CPU each
executable maps its kernels into memory separately (~700 memory maps for a speculative round of a
30-layer model): a process that keeps ~90 of them reaches Linux's default ``vm.max_map_count`` (65,530)
and the next compile dies in LLVM with a segfault. So the engine does not call ``jax.jit`` functions
directly. ``Programs`` compiles each (function, static arguments, argument shapes) ahead of time into an
executable it owns and keeps at most ``max_programs`` of them, and no more than ``max_maps`` memory maps
in the process, evicting the least recently used first. Each program is jitted from a fresh wrapper, so
JAX's own caches (keyed weakly on the function) let an evicted executable go; a program needed again is
compiled again (from the persistent compilation cache when it is on: a load, not a compile).

Compiles are single-flight: a program asked for by the engine thread while the background warmup
compiles it is compiled once, the second caller waits for it. A failed compile raises ``ProgramError``
before any donated argument is consumed, so the caller's buffers are intact.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from dspine_jax.decoding.planning import collection_paused, leaf_key

DEFAULT_MAX_PROGRAMS = 64


def program(*, donate: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Marks a function the engine runs through ``Programs`` (the counterpart of ``jax.jit``'s decorator):
    ``donate`` names the positional arguments whose buffers the program may reuse for its outputs."""

    def mark(fn: Callable) -> Callable:
        fn.donate = tuple(donate)
        return fn

    return mark


class ProgramError(RuntimeError):
    """A program could not be compiled (raised before anything ran: donated inputs are untouched)."""


def memory_maps() -> int | None:
    """Memory maps of this process (``/proc/self/maps`` lines), None where the system does not say."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return None


def max_map_count() -> int | None:
    """The kernel's per-process limit on memory maps (Linux ``vm.max_map_count``)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def default_max_maps() -> int | None:
    """Half the kernel's limit: the rest stays for the allocator, threads and the model's own buffers."""
    limit = max_map_count()
    return None if limit is None else limit // 2


@dataclasses.dataclass
class _Entry:
    ready: threading.Event
    compiled: Any = None  # jax.stages.Compiled once ready
    error: BaseException | None = None
    seconds: float = 0.0


@dataclasses.dataclass
class ProgramStats:
    compiles: int = 0  # compilations finished (a program compiled again after eviction counts again)
    failures: int = 0
    evictions: int = 0
    hits: int = 0  # calls that found their program compiled
    waits: int = 0  # calls that waited for a compile another thread had started
    seconds: float = 0.0  # spent compiling (including loads from the persistent cache)
    by_name: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # compiles per function


class Programs:
    """Compiled executables by ``(function, static arguments, argument shapes)``, LRU-bounded.

    ``fixed``: arguments passed to every program as the same objects (the model's weights): keyed by
    identity instead of by walking their leaves on every call. ``shardings``: include each argument's
    sharding in the key (multi-device meshes). Thread-safe."""

    def __init__(self, *, fixed: Sequence[Any] = (), max_programs: int | None = DEFAULT_MAX_PROGRAMS,
                 max_maps: int | None = None, shardings: bool = False,
                 log: Callable[[str], None] | None = None):
        if max_programs is not None and max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self._fixed = {id(x): i for i, x in enumerate(fixed) if x is not None}
        self._keep_fixed = list(fixed)  # (ids stay valid while the objects live)
        self.max_programs, self.max_maps, self.shardings = max_programs, max_maps, shardings
        self.log = log
        self.stats = ProgramStats()
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()  # LRU first
        self.fail_next: Callable[[str], bool] | None = None  # tests: name → inject a compile failure

    # -- keys
    def key(self, fn: Callable, args: Sequence[Any], static: dict[str, Hashable]) -> Hashable:
        parts = []
        for a in args:
            if id(a) in self._fixed:
                parts.append(("fixed", self._fixed[id(a)]))
            else:
                leaves, tree = jax.tree.flatten(a)
                parts.append((tree, tuple(leaf_key(x, self.shardings) for x in leaves)))
        return (fn.__module__, fn.__qualname__, tuple(sorted(static.items())), tuple(parts))

    # -- compiled programs
    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.compiled is not None)

    def compiled(self, fn: Callable, args: Sequence[Any], static: dict[str, Hashable] | None = None) -> Any:
        """The executable if it is compiled and held (calling it costs no compilation), else None; never waits."""
        key = self.key(fn, args, static or {})
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.compiled is None:
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry.compiled

    def ready(self, fn: Callable, args: Sequence[Any], static: dict[str, Hashable] | None = None) -> bool:
        """Compiled and held (calling it now costs no compilation)."""
        with self._lock:
            entry = self._entries.get(self.key(fn, args, static or {}))
        return entry is not None and entry.compiled is not None

    def names(self) -> collections.Counter:
        """Held programs per function name."""
        with self._lock:
            return collections.Counter(k[1] for k, e in self._entries.items() if e.compiled is not None)

    def get(self, fn: Callable, args: Sequence[Any], static: dict[str, Hashable] | None = None) -> Any:
        """The executable of ``fn(*args, **static)``; compiled now if no thread has (``args`` may be
        ``jax.ShapeDtypeStruct`` pytrees: compiling ahead needs no data)."""
        static = static or {}
        key = self.key(fn, args, static)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(threading.Event())
                mine = True
            else:
                self._entries.move_to_end(key)
                mine = False
        if not mine:
            waits = entry.compiled is None
            with self._lock:
                self.stats.waits += waits
                self.stats.hits += not waits
            entry.ready.wait()
            if entry.error is not None:
                raise ProgramError(str(entry.error)) from entry.error
            return entry.compiled
        start = time.perf_counter()
        try:
            if self.fail_next is not None and self.fail_next(fn.__name__):
                raise RuntimeError(f"injected compile failure of {fn.__name__}")
            with collection_paused():
                compiled = _jit(fn, static, getattr(fn, "donate", ())).lower(*args).compile()
        except Exception as e:  # noqa: BLE001 — any compiler error is the caller's ProgramError
            entry.error = ProgramError(f"compiling {fn.__name__}({_describe(static)}) failed: "
                                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            with self._lock:
                self._entries.pop(key, None)
                self.stats.failures += 1
            entry.ready.set()
            raise entry.error from e
        entry.seconds = time.perf_counter() - start
        entry.compiled = compiled
        with self._lock:
            self.stats.compiles += 1
            self.stats.seconds += entry.seconds
            self.stats.by_name[fn.__name__] += 1
        entry.ready.set()
        self._evict(keep=key)
        return compiled

    def run(self, fn: Callable, *args: Any, **static: Hashable) -> Any:
        """``fn(*args, **static)`` through its compiled program."""
        return self.get(fn, args, static)(*args)

    def _evict(self, keep: Hashable) -> None:
        """Drop least recently used programs while over a budget (never ``keep``, nor one being compiled)."""
        while True:
            with self._lock:
                held = [k for k, e in self._entries.items() if e.compiled is not None and k != keep]
                over_count = self.max_programs is not None and len(held) + 1 > self.max_programs
            over_maps = False
            if not over_count and self.max_maps is not None and held:
                maps = memory_maps()
                over_maps = maps is not None and maps > self.max_maps
            if not (over_count or over_maps) or not held:
                if over_maps and not held and self.log:
                    self.log(f"memory maps above the budget of {self.max_maps} with one program held")
                return
            with self._lock:
                victim = self._entries.pop(held[0], None)
                self.stats.evictions += 1
            del victim  # the executable (and its memory maps) go with the last reference
            _return_free_memory()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _return_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc ``malloc_trim``): a compile leaves ~50–80 MB of
    freed but still resident heap behind on XLA:CPU, which an evicted program would otherwise keep in RSS."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _describe(static: dict[str, Hashable]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(static.items()))


def _jit(fn: Callable, static: dict[str, Hashable], donate: Sequence[str]) -> Any:
    """``fn`` with ``static`` bound, jitted from a wrapper of its own (see the module docstring), positional
    arguments donated by name."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def program(*args):
        return fn(*args, **static)

    program.__name__ = program.__qualname__ = fn.__name__  # the HLO module's name (persistent cache key)
    program.__module__ = fn.__module__
    return jax.jit(program, donate_argnums=tuple(names.index(n) for n in donate))


def process_report() -> dict[str, int | None]:
    """Memory maps, their limit and resident memory of this process (for logs and ``/metrics``)."""
    return {"maps": memory_maps(), "max_map_count": max_map_count(), "rss_bytes": resident_bytes()}


__all__ = ["DEFAULT_MAX_PROGRAMS", "ProgramError", "Programs", "default_max_maps", "memory_maps",
           "process_report", "program", "resident_bytes"]
