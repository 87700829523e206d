"""Continuous-batching engine: a fixed number of slots, one speculative round per engine step.

Device state (persistent, donated to every jitted call): the target cache and the drafter's context
cache, ``R ≤ S`` rows each (one row per slot, see ``step``), up to ``context_length + T_max`` positions per
row (the ``T_max`` slack keeps a verify block inside the buffer, as in ``speculative_generate``).

The rows' decode state lives on the device beside the caches, one ``round.DecodeState`` (anchor, running,
remaining budget, tokens emitted, PRNG key, sampling parameters and acceptance statistics per row), set
when a request's prompt is in (``write_rows``) and updated by every step; the host reads back what a step
emitted and which rows still run, and keeps only slots, buckets, prompts and streams.

Programs (``programs.py``: compiled once per shape, on demand or ahead from abstract shapes by
``EngineCore.warmup``; at most ``max_programs`` held, least recently used dropped):

* ``prefill_rows`` — one prefill chunk for each of ``P`` prompts at once (``P`` a power of two, no padding
  rows; chunks padded to one power-of-two width ``W``, 32 … ``max_prompt_bucket``; ``P × W`` at most
  ``prefill_chunk`` tokens) on a ``P``-row copy of their slots (``read_rows``, fresh rows empty), written
  back in place (``write_rows``); returns each row's next token, sampled with its request's parameters.
  A request's slot is its own from admission (``admit``): its prompt goes in chunk by chunk, one
  ``prefill`` call per engine iteration between decode steps of the running slots (a long prompt does
  not stall them), and several waiting prompts share a call (``plan_batch``, shortest rest first).
  ``replay`` keeps each row's real tokens only, so K/V lengths, a hybrid's GDN conv window and recurrent
  state, and the drafter's ring carry from one chunk to the next. No prompt length compiles a new shape.
* ``step`` — ``decoder.segment`` for all slots: the rounds ``speculative_generate`` runs, through the same
  device loop and the same host driver (``Decoder``; per-row sampling parameters, keys and budgets; the
  engine's stop ids).
  The device caches hold only the first ``R`` slots, ``R`` a power-of-two bucket covering every
  occupied slot (requests take the lowest free slot), and ``C`` positions per row, ``C`` a bucket (128,
  256, …, the context) above every occupied slot's next verify block. So idle slots cost no compute,
  attention spans what the requests need rather than the whole context, and a step never slices or
  copies the caches: ``refit`` resizes them only when the slots or positions cross a bucket. Idle
  slots inside the bucket run too (static shapes) but commit nothing. With ``verify_len == 1`` and no drafter (``NoProposer``) it is
  a plain autoregressive step (``--no-speculative``). With ``verify="auto"`` (the default) each step runs
  at the length the adaptive policy (``decoding/adaptive.py``) chose at the end of the previous one, from
  the slots' acceptance statistics (when every running slot is greedy, a probe is a peek); one program
  per length. A length whose program is not compiled yet, while the background warmup compiles it, runs
  as plain rounds (every length is exact). The cost per length is calibrated on the first steps of each
  row bucket (``Decoder``, online: pinned lengths, exact like any other) and cached on disk.
* ``choose`` — the policy's choice for a run's first step (``decoder.choose``: when the slots start running
  again, nothing chose it at the end of a step), one program per row bucket.

Warmup (``warmup_plan``): every program above at every bucket, in the order traffic needs them — one
request before several, short contexts before long, plain rounds before drafted ones. ``lazy`` compiles
what plain decoding at the smallest buckets needs and serves; the rest compiles in the background.

This module keeps only slot bookkeeping: admitting a request, prefilling, stepping, releasing a slot.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array
from jax.sharding import Mesh

from dspine_jax.decoding import adaptive
from dspine_jax.decoding.accept import accept_sampling
from dspine_jax.decoding.adaptive import VerifyPolicy
from dspine_jax.decoding.decoder import Choice, Decoder, Plan, Transcript, choose, segment
from dspine_jax.decoding.proposers import NoProposer, Proposer, as_proposer
from dspine_jax.decoding.round import DecodeState, idle
from dspine_jax.drafters.params import Drafter
from dspine_jax.models import target as tgt
from dspine_jax.models.cache import ROW_LOOP_MAX_BATCH
from dspine_jax.models.sampling import Sampling
from dspine_jax.parallel import distributed
from dspine_jax.parallel.mesh import DATA, use_mesh
from dspine_jax.parallel.sharding import shard_drafter, shard_target
from dspine_jax.serve.prefix_cache import PrefixCache, PrefixStats
from dspine_jax.serve.programs import (
    DEFAULT_MAX_PROGRAMS,
    ProgramError,
    Programs,
    default_max_maps,
    process_report,
    program,
)
from dspine_jax.serve.warmup import WARMUP_MODES, Planned, Warmer

MIN_PROMPT_BUCKET = 32
MIN_CAPACITY_BUCKET = 128  # cache capacities the engine moves between: 128, 256, … and the whole context
DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per prefill call (``--prefill-chunk``)


def prompt_widths(context_length: int, max_prompt_bucket: int) -> list[int]:
    """Prefill chunk widths: powers of two from 32 up to ``max_prompt_bucket`` and the context (at least 32)."""
    top = max(MIN_PROMPT_BUCKET, min(max_prompt_bucket, context_length))
    return [MIN_PROMPT_BUCKET << i for i in range((top // MIN_PROMPT_BUCKET).bit_length())]


def cache_capacity(context_length: int, max_verify: int) -> int:
    """Positions per slot: room for a verify block past the context, and for a prompt's last chunk padded
    to 32 (chunks start at multiples of 32, so a 32-wide tail always fits; see ``plan_prefill``)."""
    padded = -(-context_length // MIN_PROMPT_BUCKET) * MIN_PROMPT_BUCKET
    return max(context_length + max_verify, padded)


def capacity_buckets(capacity: int) -> list[int]:
    """The cache capacities a step may compile: powers of two from 128 up to half of ``capacity``, then
    ``capacity`` itself (a context of 1024 + verify slack does not get a bucket of 1024 as well)."""
    sizes = [MIN_CAPACITY_BUCKET << i for i in range(capacity.bit_length()) if 2 * (MIN_CAPACITY_BUCKET << i) <= capacity]
    return sizes + [capacity]


def plan_prefill(n: int, widths: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """``(offset, width)`` chunks covering an ``n``-token prompt, each of one of the compiled ``widths``
    (ascending): the smallest width that holds the rest inside the cache, else the largest the rest fills."""
    plan, offset = [], 0
    while offset < n:
        rest = n - offset
        fits = [w for w in widths if w >= rest and offset + w <= capacity]
        width = fits[0] if fits else max(w for w in widths if w <= rest)
        plan.append((offset, width))
        offset += width
    return plan


def plan_batch(
    pending: Sequence[tuple[int, int]], widths: Sequence[int], budget: int, capacity: int, sizes: Sequence[int]
) -> tuple[int, list[int]]:
    """One prefill call for the prompts being prefilled: ``pending`` ``(committed, rest)`` per prompt, first
    the one to serve first → ``(width, indices into pending)`` of the rows that run.

    The width is the first chunk ``plan_prefill`` gives the first prompt; the others join while a batch size
    (``sizes``, ascending from 1: no padding rows) times the width stays within ``budget`` tokens, if that
    width fits behind their committed tokens (a later call takes them otherwise)."""
    done, rest = pending[0]
    width = plan_prefill(rest, [w for w in widths if w <= budget], capacity - done)[0][1]
    fits = [i for i, (done, _) in enumerate(pending) if done + width <= capacity]
    size = max(s for s in sizes if s <= len(fits) and s * width <= budget)
    return width, fits[:size]


# ----------------------------------------------------------------------------------------------
# Jitted engine functions


def _own_buffers(tree):
    """Inside ``jit``: every leaf in a buffer of its own (donation needs it; a leaf passed through or
    shared by two fields would alias)."""
    return jax.tree.map(lambda x: x + jnp.zeros((), x.dtype), tree)


@program()
def read_rows(target: tgt.Target, proposer: Proposer, cache, pstate, slots: Array, fresh: Array):
    """Rows ``slots [P]`` of the slots' caches as a ``P``-row batch (a copy); rows marked ``fresh [P]`` come
    out empty instead (their slot still holds the state of the request it served before)."""
    rows, prows = jax.tree.map(lambda x: jnp.take(x, slots, axis=0), (cache, pstate))
    p = slots.shape[0]
    # The drafter's ring is sized from the target's capacity (``ring_slots``), as ``refit`` sizes it.
    empty = (tgt.init_cache(target, p, cache.capacity), proposer.init(target, p, cache.capacity))
    pick = lambda x, e: jnp.where(fresh.reshape((p,) + (1,) * (x.ndim - 1)), e.astype(x.dtype), x)  # noqa: E731
    return jax.tree.map(pick, (rows, prows), empty)


@program()
def take_row(rows, prows, i: Array):
    """Row ``i`` of a ``P``-row batch as a batch-1 copy (a prefix-cache snapshot)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0), (rows, prows))


@struct.dataclass
class RowStart:
    """What a prefill call tells the rows it wrote: ``finishes [P]`` whether this chunk ends the row's prompt
    (it then decodes from ``first [P]``, the token after its prompt, with budget ``remaining [P]``, key data
    ``[P, 2]`` and its sampling parameters), unless ``first`` is a stop id or the budget is spent."""

    finishes: Array
    first: Array
    remaining: Array
    key_data: Array
    sampling: Sampling

    @staticmethod
    def none(p: int) -> RowStart:
        """No row starts (a prefix-cache row written before its prompt's rest is prefilled)."""
        zeros = jnp.zeros((p,), jnp.int32)
        return RowStart(jnp.zeros((p,), bool), zeros, zeros, jnp.zeros((p, 2), jnp.uint32), Sampling.rows(p))


@program(donate=("state",))
def write_rows(state: DecodeState, rows, prows, slots: Array, start: RowStart, stop_ids: Array) -> DecodeState:
    """The ``P``-row batch ``rows`` / ``prows`` written into rows ``slots [P]`` (distinct) of the slots' caches,
    in place (every leaf is batch-major); rows whose prompt is in start decoding (``RowStart``: fresh
    acceptance statistics, one token emitted), the others wait, idle."""
    cache, pstate = state.cache, state.proposer_state
    p = slots.shape[0]
    put = lambda big, small: big.at[slots].set(small.astype(big.dtype), unique_indices=True)  # noqa: E731
    if p > ROW_LOOP_MAX_BATCH:  # (an unrolled row loop would bloat the program)
        cache, pstate = jax.tree.map(put, (cache, pstate), (rows, prows))
    else:
        def put_row(big: Array, small: Array, i: int) -> Array:  # a dynamic_update_slice per row: in place on XLA:CPU
            return jax.lax.dynamic_update_slice_in_dim(big, small[i : i + 1].astype(big.dtype), slots[i], axis=0)

        for i in range(p):
            cache, pstate = jax.tree.map(functools.partial(put_row, i=i), (cache, pstate), (rows, prows))
    running = start.finishes & ~jnp.isin(start.first, stop_ids) & (start.remaining > 0)
    return state.replace(
        cache=cache, proposer_state=pstate, anchor=put(state.anchor, start.first), running=put(state.running, running),
        remaining=put(state.remaining, start.remaining), counts=put(state.counts, jnp.ones_like(start.first)),
        keys=state.keys.at[slots].set(jax.random.wrap_key_data(start.key_data), unique_indices=True),
        sampling=jax.tree.map(put, state.sampling, start.sampling),
        # New rows start from what the slots measured so far (their pooled statistics: ``adaptive.carried``).
        stats=jax.tree.map(put, state.stats, adaptive.init_state(p, state.stats.hits.shape[1] + 1,
                                                                 adaptive.carried(state.stats, jnp.ones_like(state.running)))),
    )


@program(donate=("rows", "prows"))
def prefill_rows(
    target: tgt.Target, proposer: Proposer, rows, prows, tokens: Array, counts: Array, key_data: Array,
    temperature: Array, top_p: Array, top_k: Array,
):
    """One prefill chunk for each of ``P`` prompts: ``tokens [P, W]`` (row ``p``'s first ``counts[p]`` real)
    appended to the ``P``-row caches ``rows`` / ``prows`` (from ``read_rows``) → those caches and the token
    after each row's chunk ``[P]`` (used for the rows whose prompt this chunk ends).

    Compiled once per ``(P, W)`` and capacity bucket, whatever the slots' row bucket. ``replay`` keeps each
    row's ``counts`` tokens: pad tokens stay out of the K/V lengths and of a hybrid's GDN state, so the next
    chunk continues from the right state. Per-row sampling parameters ``[P]`` (temperature 0 = greedy) and
    key data ``[P, 2]``."""
    counts = counts.astype(jnp.int32)
    hidden, tapped, rows, saved = tgt.forward(target, rows, tokens, proposer.taps)
    rows = tgt.replay(target, rows, saved, counts)
    prows = proposer.prefill(target, prows, hidden, tapped, counts, tokens)
    last = jnp.take_along_axis(hidden, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)  # [P, 1, H]
    logits = tgt.lm_logits(target, last)  # [P, 1, V]
    sampled, _ = accept_sampling(jax.random.wrap_key_data(key_data), logits, None, Sampling(temperature, top_p, top_k))
    first = jnp.where(temperature > 0, sampled[:, 0], jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))
    return rows, prows, first


@program()
def start_row(proposer: Proposer, row, prow, keep: Array, *, capacity: int):
    """A new request's batch-1 caches from a prefix-cache entry: its first ``keep`` tokens, in the slots'
    capacity bucket, in buffers of their own (the entry stays intact for later requests)."""
    lengths = jnp.full((1,), keep, jnp.int32)
    row = _own_buffers(row.with_capacity(capacity)).replace(lengths=lengths)
    return row, proposer.rewind(_own_buffers(proposer.with_capacity(prow, capacity)), lengths)


@program()
def refit(target: tgt.Target, proposer: Proposer, state: DecodeState, *, rows: int, capacity: int) -> DecodeState:
    """The slots' state with ``rows`` rows of ``capacity`` positions: the first rows kept, idle rows appended
    (every leaf is batch-major), position slots appended or dropped (``with_capacity``). Runs when the
    occupied slots or their positions cross a bucket, not per step."""
    state = state.replace(cache=state.cache.with_capacity(capacity),
                          proposer_state=proposer.with_capacity(state.proposer_state, capacity))  # fmt: skip
    have = state.anchor.shape[0]
    if rows <= have:
        return jax.tree.map(lambda x: x[:rows], state)
    extra = idle(target, proposer, rows - have, capacity, state.stats.hits.shape[1] + 1)
    return jax.tree.map(lambda x, e: jnp.concatenate([x, e.astype(x.dtype)], axis=0), state, extra)


@program(donate=("state",))
def step(
    target: tgt.Target, proposer: Proposer, state: DecodeState, stop_ids: Array, num_rounds: Array,
    policy: VerifyPolicy, *, verify_len: int, max_rounds: int, peek: bool = False,
) -> tuple[DecodeState, Transcript, Choice]:
    """One engine step: up to ``num_rounds`` (≤ ``max_rounds``, traced) rounds at ``verify_len`` over the
    slots' ``R`` rows (the current row bucket) — ``decoder.segment``, the rounds ``speculative_generate``
    runs — ending early once no row runs, then ``policy``'s choice of the next step's length. Several rounds
    per dispatch keep the host's per-step work (dispatch, read-back, streaming) off the critical path; the
    host asks for one round when requests are waiting to be admitted. The state is donated and updated in
    place. Returns it, the step's transcript (each row's new tokens, ``[R, max_rounds · T]``) and the choice.
    ``peek`` (every running slot greedy): a probe that costs a one-token draft, not a wider verify."""
    rows = state.anchor.shape[0]
    transcript = Transcript.empty(rows, max_rounds * verify_len, max_rounds)
    return segment(target, proposer, state, transcript, stop_ids, num_rounds, policy, verify_len=verify_len,
                   greedy=peek, peek=peek)  # fmt: skip


@program(donate=("state",))
def reset_slot(proposer: Proposer, state: DecodeState, slot: Array) -> DecodeState:
    """A freed slot: empty (its buffers are overwritten by the next prefill) and idle."""
    lengths = state.cache.lengths.at[slot].set(0)
    return state.replace(cache=state.cache.replace(lengths=lengths), running=state.running.at[slot].set(False),
                         proposer_state=proposer.rewind(state.proposer_state, lengths))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Host-side engine core (single-threaded; the server drives it from one worker thread)


@dataclasses.dataclass
class SlotParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclasses.dataclass
class Prefill:
    """A request whose prompt is being prefilled into its slot (host side; its committed tokens so far are
    the slot's ``lengths``)."""

    prompt: list[int]
    max_new_tokens: int
    params: SlotParams
    key: np.ndarray  # [2] uint32, key data for sampling the first token
    loop_key: np.ndarray  # [2] uint32, key data for the decode rounds
    need: int  # positions its chunks and its first verify block need
    order: int  # admission order
    fresh: bool  # the slot still holds its previous request's state: the first chunk starts from empty rows


@dataclasses.dataclass
class StepResult:
    tokens: dict[int, list[int]]  # slot → tokens appended this step
    finished: dict[int, str]  # slot → "stop" (stop id) or "length" (budget)
    accepted: list[int]  # per running slot: tokens committed this step (the acceptance length, bonus incl.)
    num_running: int
    verify_lengths: list[int] = dataclasses.field(default_factory=list)  # per round of the step (1: no drafting)


@dataclasses.dataclass
class PendingStep:
    """A dispatched engine step (``EngineCore.launch``): its device outputs and what ``collect`` needs."""

    transcript: Transcript  # the step's tokens, device arrays not yet read
    choice: Choice  # the policy's choice for the next step
    active: np.ndarray  # [S] the slots that ran
    n: int  # how many
    rows: int  # the row bucket
    plan: Plan  # the length, rounds and policy the step ran with
    start: float  # perf_counter at dispatch


class EngineCore:
    """Slots + persistent caches + the jitted functions. Not thread-safe: call from one thread."""

    def __init__(
        self, target: tgt.Target, drafter: Drafter | None, *, num_slots: int, context_length: int,
        verify_len: int | None = None, sps_table: dict[int, int] | None = None, stop_ids: Sequence[int] | None = None,
        bucket_rows: bool = True, mesh: Mesh | None = None, max_prompt_bucket: int | None = None,
        proposer: Proposer | None = None, max_rounds: int = 4, prefix_cache_bytes: int = 0,
        verify: int | str = "auto", verify_costs: dict[int, dict[int, float]] | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_programs: int | None = DEFAULT_MAX_PROGRAMS,
        max_maps: int | None | str = "auto",
    ):
        """``mesh``: decode tensor/data parallel on a ``data`` × ``model`` mesh (dspine_jax/parallel/mesh.py); the
        target and drafter are laid out on it here, and slots are split over ``data``.
        ``prefill_chunk``: the most prompt tokens one prefill call runs (rows × padded width): a longer
        prompt is prefilled in chunks, one per engine iteration, between decode steps of the running slots;
        shorter prompts waiting together share a call up to it. ``max_prompt_bucket``: the widest chunk
        (default: ``prefill_chunk``).
        ``proposer``: drafts in place of ``drafter`` (tests and ceilings plug in an oracle; the verify
        lengths still come from ``drafter``'s block). ``max_rounds``: rounds per engine step (see ``step``).
        ``prefix_cache_bytes``: memory for finished rows that later prompts may start from (0: off;
        ``prefix_cache.py``). ``verify``: ``"auto"`` (default; ``decoding/adaptive.py``: each round's length
        chosen from the slots' acceptance and the cost per length, measured online on the first steps of
        each row bucket and cached on disk) or a fixed length; ``verify_len`` (a fixed length) and
        ``sps_table`` (lengths by batch size) take precedence. ``verify_costs {rows: {T: seconds}}``
        replaces the measurement (tests). ``max_programs`` / ``max_maps``: the compiled programs held at once
        and the process's memory maps beyond which the least recently used program is dropped (``programs.py``;
        ``"auto"``: half of ``vm.max_map_count``; None: no bound)."""
        config = target.config
        dp = mesh.shape[DATA] if mesh is not None else 1
        if num_slots % dp:
            raise ValueError(f"{num_slots} slots do not split over {dp} data-parallel groups; use a multiple of {dp}")
        if mesh is not None:
            target = shard_target(target, mesh)
            drafter = shard_drafter(drafter, mesh) if drafter is not None else None
        self.mesh = mesh
        if context_length < 2 or context_length > config.max_position_embeddings:
            raise ValueError(
                f"context length {context_length} must be in [2, {config.max_position_embeddings}] (the model's positions)"
            )
        self.target, self.drafter = target, drafter
        if proposer is None:
            proposer = NoProposer() if drafter is None else as_proposer(drafter)
        self.proposer = proposer
        self.programs = Programs(fixed=(target, proposer), max_programs=max_programs,
                                 max_maps=default_max_maps() if max_maps == "auto" else max_maps,
                                 shardings=mesh is not None)
        self._warmer: Warmer | None = None  # the background warmup (``warmup("lazy")``)
        self._full_warmup = (0, 0)  # (compiled, planned) by a ``full`` warmup
        self._cache_specs: dict[tuple[int, int], DecodeState] = {}  # (rows, capacity) → abstract state
        self.num_slots, self.context_length = num_slots, context_length
        # Verify lengths (fixed, by batch size, or adaptive) and the adaptive driver: the ``Decoder``
        # ``speculative_generate`` runs, calibrating each row bucket's costs online on its first steps.
        self.decoder = Decoder(target, proposer, verify=verify if verify_len is None else verify_len,
                               sps_table=sps_table or None, verify_costs=verify_costs, calibrate="online",
                               scope="engine|", run_choice=self._first_choice)  # fmt: skip
        self.max_verify = self.decoder.max_verify
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        self.max_rounds = max_rounds
        if prefill_chunk < MIN_PROMPT_BUCKET:
            raise ValueError(f"prefill chunk {prefill_chunk} must be >= {MIN_PROMPT_BUCKET} tokens")
        self.prefill_budget = prefill_chunk
        self.prompt_widths = prompt_widths(context_length, min(max_prompt_bucket or prefill_chunk, prefill_chunk))
        # Rows per prefill call: powers of two up to the slots (no padding rows: on a compute-bound device
        # a padding row costs as much as a real one).
        self.prefill_sizes = [1 << i for i in range(num_slots.bit_length())]
        self.capacity = cache_capacity(context_length, self.max_verify)
        stops = list(config.eos_token_ids if stop_ids is None else stop_ids)
        stops += [-1] * (-(-max(len(stops), 1) // 8) * 8 - len(stops))
        self.stop_ids = jnp.asarray(stops, jnp.int32)
        self.stop_set = {int(x) for x in stops if x >= 0}
        s = num_slots
        self.running = np.zeros(s, bool)  # read back from the device after each step
        self.temperature = np.zeros(s, np.float32)  # (a step of greedy slots only may peek)
        self.occupied = np.zeros(s, bool)
        self.lengths = np.zeros(s, np.int64)  # committed cache length per slot (host mirror)
        self.history: dict[int, list[int]] = {}  # slot → prompt + emitted tokens
        self.prefilling: dict[int, Prefill] = {}  # slot → its prompt being prefilled (occupied, not running)
        self._admitted = 0  # admission counter (prefill order among equally long rests)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._seed_counter = 0
        # Step variants by rows covered: 1, 2, 4, … and S (``bucket_rows=False``: always S); under data
        # parallelism only multiples of the data groups, so every device keeps its own rows.
        buckets = [1 << i for i in range(s.bit_length()) if (1 << i) < s and (1 << i) % dp == 0] if bucket_rows else []
        self.row_buckets = buckets + [s]
        # Caches that can change capacity (every built-in family, drafters, NoProposer) hold a bucket above
        # what the occupied slots need, so attention never spans the whole context for short requests.
        resizable = hasattr(tgt.init_cache(target, 1, 1), "with_capacity")
        self.capacity_buckets = capacity_buckets(self.capacity) if resizable else [self.capacity]
        self._init_caches()

    def _init_caches(self) -> None:
        rows, capacity = self.row_buckets[0], self.capacity_buckets[0]
        with use_mesh(self.mesh):
            state = idle(self.target, self.proposer, rows, capacity, self.max_verify)
            # Distinct buffers per leaf (init_draft_cache shares one zeros array between k and v): donation
            # needs every leaf to own its buffer.
            self.state = jax.tree.map(lambda x: jnp.array(x, copy=True), state)
        self._base_spec = jax.tree.map(_abstract, self.state)

    @property
    def cache(self) -> Any:
        """The target's cache of the slots (``R`` rows of the current capacity bucket)."""
        return self.state.cache

    @property
    def pstate(self) -> Any:
        """The proposer's state of the slots."""
        return self.state.proposer_state

    def reset(self) -> None:
        """Drop every slot and rebuild the caches (after a failed step, whose donated buffers are gone)."""
        self._init_caches()
        self.running[:] = False
        self.occupied[:] = False
        self.lengths[:] = 0
        self.history.clear()
        self.prefilling.clear()

    # -- slots
    def free_slot(self) -> int | None:
        free = np.flatnonzero(~self.occupied)
        return int(free[0]) if free.size else None

    def num_running(self) -> int:
        return int(self.running.sum())

    def rows_for(self, highest: int) -> int:
        """The smallest row bucket (power of two, or all slots) covering slots ``[0, highest)``."""
        return next(b for b in self.row_buckets if b >= highest)

    @property
    def rows(self) -> int:
        """Rows the device caches hold now (a row bucket)."""
        return int(self.cache.lengths.shape[0])

    @property
    def cache_capacity(self) -> int:
        """Positions per row the device caches hold now (a capacity bucket)."""
        return int(self.cache.capacity)

    def _fit(self, highest: int, positions: int) -> None:
        """Resize the caches to the row bucket covering slots ``[0, highest)`` and the capacity bucket
        covering ``positions`` (once per bucket change; a no-op otherwise)."""
        rows = self.rows_for(max(highest, 1))
        capacity = next(c for c in self.capacity_buckets if c >= min(positions, self.capacity))
        if (rows, capacity) != (self.rows, self.cache_capacity):
            self.state = self._run(refit, self.target, self.proposer, self.state, rows=rows, capacity=capacity)

    def _needed_positions(self) -> int:
        """Positions the occupied slots need for the verify blocks of their next step, and the prompts being
        prefilled for their chunks and first verify block (a resize between two chunks never cuts one)."""
        occupied = self.lengths[self.occupied]
        if not occupied.size:
            return 1
        decoding = int(occupied.max()) + self.max_rounds * self.max_verify
        return max([decoding] + [p.need for p in self.prefilling.values()])

    def _highest_occupied(self) -> int:
        occupied = np.flatnonzero(self.occupied)
        return int(occupied[-1]) + 1 if occupied.size else 0

    @property
    def candidates(self) -> tuple[int, ...]:
        """Adaptive verification's lengths (empty: fixed lengths)."""
        return self.decoder.candidates

    @property
    def verify_lengths(self) -> dict[int, int]:
        """Fixed verify lengths by batch size (adaptive: the longest candidate)."""
        return self.decoder.table or {1: self.max_verify}

    def verify_len_for(self, batch: int) -> int:
        return self.decoder.length_for(batch)

    def _key(self, seed: int | None) -> np.ndarray:
        if seed is None:
            self._seed_counter += 1
            seed = (0x5EED << 20) + self._seed_counter
        return np.asarray(jax.random.key_data(jax.random.key(int(seed) & 0xFFFFFFFF)), np.uint32)

    def admit(self, slot: int, prompt: Sequence[int], max_new_tokens: int, params: SlotParams) -> None:
        """Give ``slot`` to a request; its prompt is prefilled by later ``prefill`` calls (the slot is occupied,
        not running, until the last chunk). A prefix-cache hit starts the slot from the cached row here."""
        prompt = list(prompt)
        n = len(prompt)
        if n < 1 or n + max_new_tokens > self.context_length + 1 or max_new_tokens < 1:
            raise ValueError(f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds the context")
        if self.occupied[slot]:
            raise ValueError(f"slot {slot} is occupied")
        key = self._key(params.seed)
        k_prefill, k_loop = jax.random.split(jax.random.wrap_key_data(key))
        entry, keep = self._prefix_lookup(prompt)
        # The row must hold every chunk (a 32-wide tail included, see ``cache_capacity``) and the first verify block.
        need = max(n + self.max_verify, keep + -(-(n - keep) // MIN_PROMPT_BUCKET) * MIN_PROMPT_BUCKET)
        self._admitted += 1
        self.prefilling[slot] = Prefill(
            prompt=prompt, max_new_tokens=max_new_tokens, params=params,
            key=np.asarray(jax.random.key_data(k_prefill), np.uint32),
            loop_key=np.asarray(jax.random.key_data(k_loop), np.uint32), need=need, order=self._admitted,
            fresh=entry is None,
        )
        self.occupied[slot], self.running[slot] = True, False
        self.lengths[slot] = keep
        self.history[slot] = prompt
        self._fit(max(slot + 1, self._highest_occupied()), self._needed_positions())
        if entry is not None:
            row, prow = self._run(start_row, self.proposer, entry.row, entry.prow, jnp.int32(keep),
                                  capacity=self.cache_capacity)
            self.state = self._run(write_rows, self.state, row, prow, jnp.asarray([slot], jnp.int32), RowStart.none(1),
                                   self.stop_ids)  # fmt: skip

    def num_prefilling(self) -> int:
        return len(self.prefilling)

    def prefill(self, slots: Sequence[int] | None = None) -> dict[int, tuple[int, str | None]]:
        """One prefill call (at most ``prefill_chunk`` tokens) for the prompts being prefilled (or those of
        ``slots``): a chunk for each of the rows ``plan_batch`` picks, shortest rest first (its first token
        soonest). Returns slot → (first token, finish reason if it already ended) for the prompts it finished;
        those slots run from the next ``step`` (or are to be released, given a reason)."""
        pending = sorted((s for s in self.prefilling if slots is None or s in slots),
                         key=lambda s: (len(self.prefilling[s].prompt) - self.lengths[s], self.prefilling[s].order))
        if not pending:
            return {}
        self._fit(self._highest_occupied(), self._needed_positions())
        done = {s: int(self.lengths[s]) for s in pending}
        width, picked = plan_batch([(done[s], len(self.prefilling[s].prompt) - done[s]) for s in pending],
                                   self.prompt_widths, self.prefill_budget, self.cache_capacity, self.prefill_sizes)
        rows = [pending[i] for i in picked]
        jobs = [self.prefilling[s] for s in rows]
        tokens = np.full((len(rows), width), self.target.config.pad_token_id or 0, np.int32)
        counts = np.zeros(len(rows), np.int32)
        for i, (s, job) in enumerate(zip(rows, jobs)):
            chunk = job.prompt[done[s] : done[s] + width]
            tokens[i, : len(chunk)], counts[i] = chunk, len(chunk)
        slot_ids = jnp.asarray(rows, jnp.int32)
        try:
            batch, pbatch = self._run(read_rows, self.target, self.proposer, self.cache, self.pstate, slot_ids,
                                      jnp.asarray([job.fresh for job in jobs]))
            batch, pbatch, first = self._run(
                prefill_rows, self.target, self.proposer, batch, pbatch, jnp.asarray(tokens), jnp.asarray(counts),
                jnp.asarray(np.stack([job.key for job in jobs])),
                jnp.asarray([job.params.temperature for job in jobs], jnp.float32),
                jnp.asarray([job.params.top_p for job in jobs], jnp.float32),
                jnp.asarray([job.params.top_k for job in jobs], jnp.int32),
            )
            start = RowStart(
                finishes=jnp.asarray([done[s] + n == len(job.prompt) for s, job, n in zip(rows, jobs, counts)]),
                first=first, remaining=jnp.asarray([job.max_new_tokens - 1 for job in jobs], jnp.int32),
                key_data=jnp.asarray(np.stack([job.loop_key for job in jobs])),
                sampling=Sampling(*(jnp.asarray([getattr(job.params, name) for job in jobs], dtype) for name, dtype
                                    in (("temperature", jnp.float32), ("top_p", jnp.float32), ("top_k", jnp.int32)))),
            )  # the rows whose prompt this chunk ends decode from the next step
            self.state = self._run(write_rows, self.state, batch, pbatch, slot_ids, start, self.stop_ids)
        except ProgramError as e:  # raised before the program ran: the slots' caches are intact
            e.slots = rows
            raise
        first_host = np.asarray(distributed.to_host(first))  # (rows on other processes' devices: gathered)
        finished = {}
        for i, (s, job) in enumerate(zip(rows, jobs)):
            job.fresh = False
            self.lengths[s] += int(counts[i])
            if self.lengths[s] == len(job.prompt):
                finished[s] = self._start_decoding(s, self.prefilling.pop(s), int(first_host[i]))
            elif self._chunk_snapshots:
                self._prefix_snapshot(job.prompt[: self.lengths[s]], batch, pbatch, i)
        return finished

    @property
    def _chunk_snapshots(self) -> bool:
        """A hybrid target's rows are usable only whole (its GDN state exists at the row's end only), so a
        finished request's row serves only prompts extending all of it. With the prefix cache on, the row of
        a prompt is also kept after each of its prefill chunks (the seed's "extra buffer" snapshots at chunk
        boundaries): prompts sharing a long head (a system prompt, a replayed transcript) start from the
        last chunk boundary they share. Dense rows truncate to any prefix: their finished rows serve already."""
        return self.prefix_cache is not None and not getattr(self.cache, "prefix_truncatable", False)

    def _prefix_snapshot(self, tokens: list[int], batch, pbatch, i: int) -> None:
        """Keep row ``i`` of a prefilled batch, holding ``tokens``."""
        row, prow = self._run(take_row, batch, pbatch, jnp.int32(i))
        self.prefix_cache.insert(tokens, row, prow, truncatable=False)

    def _start_decoding(self, slot: int, job: Prefill, first: int) -> tuple[int, str | None]:
        """The slot's prompt is in its caches and ``first`` sampled: it runs from the next step."""
        self.history[slot] = job.prompt + [first]
        self.temperature[slot] = job.params.temperature
        reason = "stop" if first in self.stop_set else "length" if job.max_new_tokens <= 1 else None
        self.running[slot] = reason is None
        return first, reason

    def add(self, slot: int, prompt: Sequence[int], max_new_tokens: int, params: SlotParams) -> tuple[int, str | None]:
        """Prefill ``prompt`` into ``slot`` now (chunk after chunk; other prompts being prefilled wait);
        returns the first token and a finish reason if it already ended."""
        self.admit(slot, prompt, max_new_tokens, params)
        while True:
            finished = self.prefill([slot])
            if slot in finished:
                return finished[slot]

    def _prefix_lookup(self, prompt: list[int]) -> tuple[Any, int]:
        """The prefix-cache entry to start ``prompt`` from and how many of its tokens to keep."""
        if self.prefix_cache is None:
            return None, 0

        def usable(entry, shared: int) -> int:
            keep = shared if entry.truncatable else (len(entry.tokens) if shared == len(entry.tokens) else 0)
            rest = -(-(len(prompt) - keep) // MIN_PROMPT_BUCKET) * MIN_PROMPT_BUCKET
            return keep if keep + rest <= self.capacity else 0  # the rest's chunks must fit behind it

        return self.prefix_cache.lookup(prompt, usable)

    def _prefix_insert(self, slot: int) -> None:
        """Keep a finished slot's row (its committed tokens) for later prompts that start the same way."""
        committed = int(self.lengths[slot])
        if self.prefix_cache is None or not self.occupied[slot] or committed < 2:
            return
        if slot in self.prefilling:
            return  # a prompt cancelled while being prefilled is not kept
        row, prow = self._run(read_rows, self.target, self.proposer, self.cache, self.pstate,
                              jnp.asarray([slot], jnp.int32), jnp.asarray([False]))
        ring_ok = committed <= getattr(prow, "capacity", committed)  # a ring that never wrapped truncates like K/V
        truncatable = bool(getattr(row, "prefix_truncatable", False)) and ring_ok
        self.prefix_cache.insert(self.history[slot][:committed], row, prow, truncatable)

    def prefix_stats(self) -> PrefixStats | None:
        return None if self.prefix_cache is None else self.prefix_cache.stats

    def release(self, slot: int) -> None:
        """Free ``slot`` at once (finished, cancelled or failed); its row goes to the prefix cache."""
        self._prefix_insert(slot)
        self.history.pop(slot, None)
        self.prefilling.pop(slot, None)
        self.running[slot] = False
        self.occupied[slot] = False
        self.lengths[slot] = 0
        self.temperature[slot] = 0.0
        self.state = self._run(reset_slot, self.proposer, self.state, jnp.int32(slot))

    def step(self, rounds: int | None = None) -> StepResult:
        """Up to ``rounds`` rounds (default ``max_rounds``) for every running slot in one device call."""
        pending = self.launch(rounds)
        return self.collect(pending) if pending is not None else StepResult({}, {}, [], 0)

    def launch(self, rounds: int | None = None) -> PendingStep | None:
        """Dispatch a step (``step``'s first half) without waiting for it: the host can stream the previous
        step's tokens while the device runs this one. Until ``collect``, the slots' state is the step's
        (future) output and no slot may be admitted or released. None: no slot runs."""
        active = self.running.copy()
        n = int(active.sum())
        if n == 0:
            return None
        self._fit(self._highest_occupied(), self._needed_positions())  # grows as rows advance, shrinks after releases
        r = self.rows
        greedy = not np.any(active & (self.temperature > 0))  # (greedy slots probe by a peek)
        state = self.state
        plan = self.decoder.plan(n, r, state.stats, state.running, state.remaining, greedy=greedy,
                                 max_rounds=self.max_rounds if rounds is None else max(1, min(rounds, self.max_rounds)))
        args = (self.target, self.proposer, state, self.stop_ids, jnp.int32(plan.rounds), plan.policy)
        static = dict(verify_len=plan.length, max_rounds=self.max_rounds, peek=plan.peek)
        program = self.programs.compiled(step, args, static)  # (one key per step: the state is flattened once)
        drafted = (plan.length, plan.peek) != (1, False)
        if (program is None and drafted and self.decoder.forced_length is None and self._warmer is not None
                and not distributed.multiprocess()):  # (several processes must run the same program: they wait)
            # compiled in the background, first in line; plain rounds meanwhile (exact all the same)
            self._warmer.want(self._planned_step(r, self.cache_capacity, plan.length, plan.peek))
            plan = dataclasses.replace(plan, length=1, peek=False, chosen=False, calibrating=False)
            static = dict(static, verify_len=1, peek=False)
            program = self.programs.compiled(step, args, static)
        with use_mesh(self.mesh):
            if program is None:  # compiled now, before the clock starts
                program = self.programs.get(step, args, static)
            start = time.perf_counter()
            self.state, transcript, choice = program(*args)
        return PendingStep(transcript, choice, active, n, r, plan, start)

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step: its tokens per slot, the slots it finished (read back from the device)."""
        transcript, choice, running = distributed.to_host((pending.transcript, pending.choice, self.state.running))
        seconds = time.perf_counter() - pending.start
        done = int(transcript.iterations)
        tokens, finished, accepted = {}, {}, []
        for i in np.flatnonzero(pending.active):
            i = int(i)
            new = transcript.tokens[i, : transcript.written[i]].tolist()
            tokens[i] = new
            self.history[i] += new
            self.lengths[i] += len(new)
            accepted += transcript.kept[i, : transcript.rounds[i]].tolist()
            if not running[i]:
                finished[i] = "stop" if transcript.stopped[i] else "length"
        self.running[: pending.rows] = running
        if distributed.multiprocess():
            # Every process's view alike: the step's tokens (each process's own copy where they are replicated
            # over processes, else gathered) and its host mirror of the slots. Process 0's clock refines the costs.
            digest = zlib.crc32(np.concatenate([transcript.tokens.ravel(), transcript.written.ravel(), running.ravel(),
                                                self.lengths, self.occupied]).astype(np.int32).tobytes())  # fmt: skip
            seconds = distributed.check_step(seconds, digest)
        self.decoder.observe(pending.rows, pending.plan, seconds, done, choice if pending.plan.chosen else None)
        return StepResult(tokens, finished, accepted, pending.n, [pending.plan.length] * done)

    # -- programs: compiled on demand, or ahead (warmup) from abstract shapes
    def _run(self, fn: Callable, *args: Any, **static: Any) -> Any:
        """``fn(*args, **static)`` through its compiled program (compiled now if no thread has yet)."""
        with use_mesh(self.mesh):
            return self.programs.run(fn, *args, **static)

    def _first_choice(self, *args: Any) -> Choice:
        """A run's first choice (``decoder.choose``), through the engine's programs: compiled by the warmup, not
        by the first request of each row bucket."""
        return self._run(choose, *args)

    def _abstract_state(self, rows: int, capacity: int) -> DecodeState:
        """The slots' state at ``rows`` × ``capacity`` as ``ShapeDtypeStruct``s, as ``refit`` makes it."""
        key = (rows, capacity)
        if key not in self._cache_specs:
            with use_mesh(self.mesh):
                spec = jax.eval_shape(functools.partial(refit, rows=rows, capacity=capacity), self.target,
                                      self.proposer, self._base_spec)
            if self.mesh is not None:  # a leaf's layout does not depend on the bucket (rows split over data)
                spec = jax.tree.map(lambda a, b: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=b.sharding),
                                    spec, self._base_spec)
            self._cache_specs[key] = spec
        return self._cache_specs[key]

    def _planned_step(self, rows: int, capacity: int, t: int, peek: bool) -> Planned:
        args = (self.target, self.proposer, self._abstract_state(rows, capacity), self.stop_ids,
                _spec((), jnp.int32), self.decoder.policy(t))
        what = "peek" if peek else f"verify {t}"
        return Planned(f"step ({what}, {rows} rows, capacity {capacity})", step, args,
                       dict(verify_len=t, max_rounds=self.max_rounds, peek=peek))

    def _planned_choice(self, rows: int, capacity: int) -> list[Planned]:
        """The program of a run's first choice at ``rows`` (``_first_choice``), where the lengths are adaptive."""
        if not self.decoder.candidates:
            return []
        state = self._abstract_state(rows, capacity)
        args = (self.decoder.policy(), state.stats, state.running, state.remaining, _spec((), jnp.int32))
        return [Planned(f"first choice ({rows} rows)", choose, args)]

    def _planned_prefill(self, rows: int, capacity: int, size: int, width: int) -> list[Planned]:
        """The programs of one prefill call: ``size`` prompts' chunks of ``width`` into ``rows`` × ``capacity``."""
        state = self._abstract_state(rows, capacity)
        cache, pstate = state.cache, state.proposer_state
        slots = _spec((size,), jnp.int32)
        start = jax.eval_shape(functools.partial(RowStart.none, size))
        read = (self.target, self.proposer, cache, pstate, slots, _spec((size,), bool))
        with use_mesh(self.mesh):
            batch = jax.eval_shape(read_rows, *read)
        fill = (self.target, self.proposer, *batch, _spec((size, width), jnp.int32), _spec((size,), jnp.int32),
                _spec((size, 2), jnp.uint32), _spec((size,), jnp.float32), _spec((size,), jnp.float32),
                _spec((size,), jnp.int32))
        where = f"{size} × {width} tokens, {rows} rows, capacity {capacity}"
        planned = [Planned(f"prefill ({where})", read_rows, read), Planned(f"prefill ({where})", prefill_rows, fill),
                   Planned(f"prefill ({where})", write_rows, (state, *batch, slots, start, self.stop_ids))]
        if self._chunk_snapshots:
            planned.append(Planned(f"prefix snapshot ({where})", take_row, (*batch, _spec((), jnp.int32))))
        return planned

    def warmup_plan(self) -> tuple[list[Planned], int]:
        """Every program serving may run, in the order traffic needs them, and how many of the first ones
        plain decoding at the smallest buckets needs (what ``lazy`` warmup compiles before serving): one
        request at a time before several, short contexts before long, plain rounds before drafted ones
        (a verify length whose program is not compiled yet runs as plain rounds meanwhile)."""
        programs = self.decoder.programs(greedy=True)
        drafted = [(t, peek) for t, peek in programs if (t, peek) != (1, False)]
        drafted.sort(key=lambda p: (not p[1], p[0] == adaptive.PROBE_LENGTH, p[0]))  # peek, then 4, 8, …, 2
        plain = [] if (1, False) not in programs else [(1, False)]
        plan: list[Planned] = []
        first = True
        for rows in self.row_buckets:
            for capacity in self.capacity_buckets:
                widths = [w for w in self.prompt_widths if w <= capacity]
                plan.append(Planned(f"release ({rows} rows, capacity {capacity})", reset_slot,
                                    (self.proposer, self._abstract_state(rows, capacity), _spec((), jnp.int32))))
                plan += self._planned_prefill(rows, capacity, 1, widths[0])
                plan += [self._planned_step(rows, capacity, t, peek) for t, peek in plain or drafted[:1]]
                plan += self._planned_choice(rows, capacity)
                if first:
                    minimal, first = len(plan), False
                plan += [p for w in widths[1:] for p in self._planned_prefill(rows, capacity, 1, w)]
                plan += [self._planned_step(rows, capacity, t, peek) for t, peek in drafted[0 if plain else 1:]]
                plan += [p for size in self.prefill_sizes[1:] if size <= rows for w in widths
                         if size * w <= self.prefill_budget for p in self._planned_prefill(rows, capacity, size, w)]
        unique: dict[Any, Planned] = {}
        for p in plan:
            unique.setdefault(self.programs.key(p.fn, p.args, p.static), p)
        firsts = {self.programs.key(p.fn, p.args, p.static) for p in plan[:minimal]}
        return list(unique.values()), len(firsts)

    def warmup(self, mode: str = "full", progress: Callable[[str], None] | None = None) -> None:
        """Compile ahead, from abstract shapes (no request runs): ``full`` every program of ``warmup_plan``
        (up to the program budget) before returning; ``lazy`` those plain decoding at the smallest buckets
        needs, then the rest on a background thread, in order, while the engine serves (a program the engine
        needs first moves to the front); ``none`` nothing (every program compiles when first needed)."""
        if mode not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {', '.join(WARMUP_MODES)}, got {mode!r}")
        if mode == "none":
            return
        plan, minimal = self.warmup_plan()
        warmer = Warmer(self, plan, progress)
        warmer.ahead(len(plan) if mode == "full" else minimal)
        if mode == "lazy":
            self._warmer = warmer
            warmer.start()
        else:
            self._full_warmup = (warmer.compiled, warmer.planned)

    def warmup_progress(self) -> dict[str, Any]:
        """What the warmup has compiled and what it still plans (``/health``, ``/metrics``)."""
        warmer = self._warmer
        if warmer is None:
            compiled, planned = self._full_warmup
            return {"planned": planned, "compiled": compiled, "pending": 0}
        return {"planned": warmer.planned, "compiled": warmer.compiled,
                "pending": len(warmer.plan) + len(warmer.wanted) + warmer.busy}

    def program_report(self) -> dict[str, Any]:
        """Compiled programs, warmup progress and the process's memory maps and resident bytes (``/metrics``)."""
        stats, warmup, process = self.programs.stats, self.warmup_progress(), process_report()
        return {"programs": len(self.programs), "program_compiles_total": stats.compiles,
                "program_evictions_total": stats.evictions, "program_failures_total": stats.failures,
                "program_compile_seconds_total": stats.seconds, "warmup_planned": warmup["planned"],
                "warmup_compiled": warmup["compiled"], "warmup_pending": warmup["pending"],
                "process_memory_maps": process["maps"], "process_resident_bytes": process["rss_bytes"],
                "program_compiles_by_function": dict(stats.by_name)}

    def close(self) -> None:
        """Stop the background warmup and keep the costs decoding measured (the server's shutdown)."""
        self.decoder.store()
        if self._warmer is not None:
            self._warmer.stop(join=True)
            atexit.unregister(self._warmer.stop)  # (it held the engine, and so its weights, until exit)


RESIZES = ("refit", "start_row")  # compiled when first needed, also after a full warmup (a pair of buckets each)


def serving_programs(core: EngineCore) -> dict[str, int]:
    """Compilations per program, less the resizes: what a full warmup leaves nothing to add to."""
    return {k: v for k, v in core.programs.stats.by_name.items() if k not in RESIZES}
def _spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _abstract(x: Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
