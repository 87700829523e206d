"""A decoding request laid out for the jitted programs, and what comes back: shared by autoregressive
(``autoregressive.py``) and speculative (``speculative.py``) decoding, the server and the corpus builder.

``plan_request`` validates prompts and sampling parameters and buckets the shapes (prompt width, cache
capacity) so similar requests reuse compiled programs; ``CompileTimer`` times compilation apart from
running; ``GenerationResult`` / ``finish_reasons`` report per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from dspine_jax.models import hub
from dspine_jax.models.sampling import validate_sampling
from dspine_jax.models.target import Target

PROMPT_BUCKET = 32
CAPACITY_BUCKET = 128
# A compile running longer than this says "compiling …". Loading a program from the persistent cache
# (tracing + retrieval) takes ~1–4 s per program on a 2-core CPU, a real compile of the loop 10–60 s.
COMPILE_NOTICE_SECONDS = 5.0

_log = logging.getLogger("dspine_jax")


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per row (a hit stop token is included)
    finish_reasons: list[str]  # per row: "stop", "length" (max_new_tokens) or "capacity"
    prefill_seconds: float  # running the prefill program, compilation excluded
    decode_seconds: float  # running the decode loop, compilation excluded
    compile_seconds: float  # compiling both programs (≈0 when this process compiled these shapes before)

    @property
    def seconds(self) -> float:
        """Prefill + decode, compilation excluded (``tokens_per_second`` is ``num_tokens / seconds``)."""
        return self.prefill_seconds + self.decode_seconds

    @property
    def num_tokens(self) -> int:
        return sum(len(row) for row in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which prefill produces) per second of the decode loop."""
        decoded = self.num_tokens - len(self.token_ids)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def validate_prompts(prompt_ids: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence) or not prompt_ids:
        raise ValueError("prompt_ids must be a non-empty list of token-id lists (one per batch row)")
    rows = []
    for i, row in enumerate(prompt_ids):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or not row:
            raise ValueError(f"prompt_ids[{i}] must be a non-empty list of token ids")
        row = [int(t) for t in row]
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_ids[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
        rows.append(row)
    return rows


def max_new_tokens_cap(prompt_lengths: Sequence[int], max_positions: int) -> int:
    """The most tokens any row can produce: the shortest prompt's free positions + 1 (the last token is
    returned, never fed back). Rows with longer prompts may stop earlier, with finish reason "capacity"."""
    return max_positions - min(prompt_lengths) + 1


def plan_capacity(prompt_lengths: list[int], max_new_tokens: int, max_positions: int) -> int:
    """Cache slots for ``prompt + max_new_tokens``, bucketed, never above the model's positions.

    A ``max_new_tokens`` no row could reach is rejected: it would only buy a long run and a big buffer."""
    longest = max(prompt_lengths)
    if longest >= max_positions:
        raise ValueError(
            f"prompt of {longest} tokens does not fit: the model's capacity is {max_positions} positions "
            "(at least one must remain for generation)"
        )
    cap = max_new_tokens_cap(prompt_lengths, max_positions)
    if max_new_tokens > cap:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} is more than the context can hold: {max_positions} positions "
            f"minus a {min(prompt_lengths)}-token prompt leave room for at most {cap} new tokens"
        )
    return min(round_up(longest + max_new_tokens, CAPACITY_BUCKET), max_positions)


def pad_prompts(rows: list[list[int]], pad_id: int, max_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to a bucketed length, at most ``max_width`` (the cache: a bucket may overshoot a position
    limit that is not a multiple of it) → tokens ``[B, P]`` int32, lengths ``[B]`` int32."""
    width = min(round_up(max(len(r) for r in rows), PROMPT_BUCKET), max_width)
    tokens = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, np.asarray([len(r) for r in rows], np.int32)


def plan_request(
    target: Target, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
    top_p: float, top_k: int, stop_ids: Sequence[int] | None,
) -> tuple[list[list[int]], int, np.ndarray, np.ndarray, list[int]]:
    """Validate a request and lay it out: rows, cache capacity, padded tokens ``[B, P]``, lengths ``[B]``
    and stop ids (``None`` → the model's EOS ids). Shared by plain and speculative decoding."""
    validate_sampling(temperature, top_p, top_k)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    config = target.config
    rows = validate_prompts(prompt_ids, config.vocab_size)
    capacity = plan_capacity([len(r) for r in rows], max_new_tokens, config.max_position_embeddings)
    tokens, lengths = pad_prompts(rows, config.pad_token_id or 0, capacity)
    stops = list(config.eos_token_ids if stop_ids is None else stop_ids)
    return rows, capacity, tokens, lengths, stops


_paused = 0  # compiles under way in this process with the cyclic collector paused (``collection_paused``)
_paused_lock = threading.Lock()
_resume = True  # whether the collector was on when the first of them began


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a program is traced, lowered and compiled. Tracing allocates
    objects by the hundred thousand, and each full collection that triggers walks the whole heap (a process that
    imported transformers holds ~400k objects): ~0.5 s of a first plain call's compile, ~1.2 s of a first
    speculative one's on a 2-core CPU (``experiments/adaptive/compile_gc.py``). Re-enabled when the last
    concurrent compile ends (the server compiles on a background thread); what the compiles left behind is
    collected then, in one pass. A collector the caller had switched off stays off."""
    global _paused, _resume
    with _paused_lock:
        _paused += 1
        if _paused == 1:
            _resume = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _paused_lock:
            _paused -= 1
            if _paused == 0 and _resume:
                gc.enable()


class CompileTimer:
    """Runs jitted programs timed apart from their compilation: ``run`` compiles ahead of the call
    (adding that time to ``seconds``), then times the call, which reuses the executable.

    Shapes this process compiled before cost ~0 to compile; a load from the persistent compilation
    cache (the CLI's) a moment. A compile that outlasts ``COMPILE_NOTICE_SECONDS`` logs "compiling …"
    once (logger ``dspine_jax``; the CLI prints it), so a first run says why it is slow.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._noticed = threading.Event()

    def _notice(self) -> None:
        if not self._noticed.is_set():
            self._noticed.set()
            _log.info("compiling … (first run of these shapes; later runs reuse the compiled programs)")

    def compile(self, fn, *args, **kwargs) -> None:
        signature = _signature(fn, args, kwargs)
        if signature is not None and signature in _COMPILED:  # lowering again only to find it compiled: 4–5 ms
            return
        timer = threading.Timer(COMPILE_NOTICE_SECONDS, self._notice)
        timer.start()
        start = time.perf_counter()
        try:
            with collection_paused():
                fn.lower(*args, **kwargs).compile()
        finally:
            timer.cancel()
            self.seconds += time.perf_counter() - start
        if signature is not None:
            _COMPILED.add(signature)

    def run(self, fn, *args, **kwargs) -> tuple[Any, float]:
        """``fn(*args, **kwargs)`` (compiled first, before any donated argument is consumed) and the
        seconds the call took until its outputs were ready."""
        self.compile(fn, *args, **kwargs)
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        return out, time.perf_counter() - start


_COMPILED: set[Hashable] = set()  # signatures ``CompileTimer`` compiled in this process (jit keeps the programs)


def leaf_key(x: Any, shardings: bool = True) -> Hashable:
    """What of an argument leaf selects a compiled program: shape, dtype, weak type and, with ``shardings``, its
    layout over a mesh (one device's arrays: None). The serving engine's ``Programs`` and ``CompileTimer`` key by it."""
    if x is None:
        return None
    aval = (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
    if not shardings:
        return aval
    sharding = getattr(x, "sharding", None)  # a layout over a mesh; one device's arrays are uncommitted inputs
    return aval + ((sharding.mesh.shape_tuple, sharding.spec) if isinstance(sharding, NamedSharding) else None,)


def _signature(fn: Any, args: tuple, kwargs: dict) -> Hashable | None:
    """``fn``, the arguments' tree and ``leaf_key`` of each leaf, and the keyword (static) arguments' values. None
    (``compile`` lowers, as always) when a leaf is neither a JAX nor a NumPy array (a Python scalar's type is weak)
    or a keyword value cannot be hashed. A speculative call compiles ~9 programs ahead; lowering each again only to
    find it compiled cost ~40 ms a call on a 2-core CPU, outside the clock. NumPy leaves (a prompt's tokens, the
    carried prior read back to the host) key by shape and dtype as they are: jit may canonicalise a dtype (int64 →
    int32), so two keys can share one program, which costs one lowering more, never a compile missed."""
    leaves, tree = jax.tree.flatten(args)
    if not all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves):
        return None
    static = tuple(sorted(kwargs.items()))
    try:
        hash(static)
    except TypeError:
        return None
    return fn, tree, tuple(leaf_key(x) for x in leaves), static


def finish_reasons(counts: np.ndarray, stopped: np.ndarray, max_new_tokens: int) -> list[str]:
    """Why each row ended: a stop id (``stop``), the token budget (``length``), or the cache (``capacity``)."""
    return ["stop" if hit else "length" if n >= max_new_tokens else "capacity" for n, hit in zip(counts, stopped)]


# ----------------------------------------------------------------------------------------------
# CLI: python -m dspine_jax.generate --model M --prompt TEXT [...]


def enable_compilation_cache() -> None:
    """Persist compiled programs across CLI runs (the first run of a shape compiles; later runs reuse), under
    the cache root unless ``JAX_COMPILATION_CACHE_DIR`` names another folder."""
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(hub.default_cache_dir() / "jax_compilation_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
