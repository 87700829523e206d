"""The decoder: the one device loop over speculative rounds, and the host driver that picks each segment's
verify length. ``speculative_generate``, ``generate`` (a ``NoProposer`` at ``T = 1``), the serving engine and
the training corpus' feature capture all decode through it.

* ``decode_rounds`` — rounds of one verify length in a ``lax.while_loop`` until every row stops or
  ``max_rounds`` ran, each round's tokens written into a ``Transcript``. The only decode loop in the package.
* ``segment`` — ``decode_rounds`` then the adaptive policy's next choice (``adaptive.choose``): the unit the
  host drives. One compiled program per verify length (and the peek); choosing on the device inside one
  loop (``lax.switch`` over rounds) measured ~10 % slower on CPU, the caches being copied in and out. A
  segment of drafted rounds may go on while the policy's choice holds, and a peek's goes on with plain rounds
  (fewer launches: docs/ARCHITECTURE.md §5).
* ``Decoder`` — the host side (docs/ARCHITECTURE.md §5): which verify lengths a run may use (a fixed length,
  an sps table by batch size, or ``"auto"``), and for ``"auto"`` the driver: choose → explore → run →
  observe, with the cost per length calibrated once per (device, model, proposer, batch bucket) by one
  rule (``Calibration``) and cached on disk. ``speculative_generate`` calibrates ahead on fresh prefills;
  the engine calibrates online on its first steps (every length is exact, so live steps can be timed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from dspine_jax.decoding import adaptive
from dspine_jax.decoding.adaptive import VerifyPolicy
from dspine_jax.decoding.proposers import Proposer
from dspine_jax.decoding.round import DecodeState, speculative_round
from dspine_jax.models import target as tgt
from dspine_jax.parallel import distributed

_log = logging.getLogger("dspine_jax")

DECIDE_EVERY = 4  # verify="auto": rounds of a segment that is not held (explored, calibrating; the fewest timed)
DECIDE_AFTER = 1  # held drafted rounds: the policy, on the device, may end their segment after this many (a choice
# that turned bad costs one round, not DECIDE_EVERY: replayed in the bench's order, +2 points over its 16 prompts
# at one day's costs of a 2-core CPU, equal at two others; experiments/adaptive/RESULTS.md, thirteenth run)
COST_SAMPLES = 3  # timed segments per verify length (after one dropped: it may pay one-time costs)
CALIBRATION_ROUNDS = 8  # rounds per timed segment when calibrating ahead


# ----------------------------------------------------------------------------------------------
# The device loop


@struct.dataclass
class Transcript:
    """What the loop emitted, per row: tokens ``[B, W]`` (the first ``written`` valid), whether the row ended
    on a stop id, and one entry per round it ran ``[B, H]``: tokens kept (``kept``), proposals accepted
    before stop / budget cuts (``accepted``), the round's verify length (``lengths``); ``rounds [B]`` rounds
    per row, ``iterations`` rounds of the loop. Entries past ``W`` / ``H`` are dropped (callers size them)."""

    tokens: Array
    written: Array
    stopped: Array
    kept: Array
    accepted: Array
    lengths: Array
    rounds: Array
    iterations: Array

    @classmethod
    def empty(cls, batch: int, width: int, history: int, first: Array | None = None,
              stop_ids: Array | None = None) -> Transcript:
        """An empty transcript; ``first [B]``: a token every row already emitted (the prefill's; a row whose
        first token is one of ``stop_ids`` has stopped)."""
        tokens = jnp.zeros((batch, width), jnp.int32)
        written, stopped = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool)
        if first is not None:
            tokens, written, stopped = tokens.at[:, 0].set(first), written + 1, jnp.isin(first, stop_ids)
        per_round = jnp.zeros((batch, history), jnp.int32)
        return cls(tokens=tokens, written=written, stopped=stopped, kept=per_round,
                   accepted=per_round, lengths=per_round, rounds=jnp.zeros((batch,), jnp.int32),
                   iterations=jnp.zeros((), jnp.int32))  # fmt: skip


def decode_rounds(
    target: tgt.Target, proposer: Proposer, state: DecodeState, transcript: Transcript, stop_ids: Array,
    max_rounds: Array | None = None, *, verify_len: int, greedy: bool, peek: bool = False, track: bool = True,
    cut: VerifyPolicy | None = None, until: Callable[[DecodeState, Array], Array] | None = None,
) -> tuple[DecodeState, Transcript]:
    """Rounds of ``verify_len`` tokens (``round.speculative_round``) until every row stops, or ``max_rounds``
    rounds (None: no limit), each written into ``transcript``. ``greedy``: every row is greedy (compiles out
    the sampling path); ``peek``: every round a peek; ``track``: keep the policy's statistics; ``cut``: the
    adaptive policy, for drafters whose confidence may shorten a round; ``until(state, iterations)``: also stop
    after the first round at which it is true."""
    t = verify_len
    rows = jnp.arange(state.anchor.shape[0])
    slots = jnp.arange(t)[None, :]  # [1, T]
    end = None if max_rounds is None else transcript.iterations + max_rounds

    def cond(carry: tuple[DecodeState, Transcript, Array]) -> Array:
        state, out, done = carry
        alive = jnp.any(state.running) & ~done
        return alive if end is None else alive & (out.iterations < end)

    def body(carry: tuple[DecodeState, Transcript, Array]) -> tuple[DecodeState, Transcript, Array]:
        state, out, _ = carry
        running = state.running
        state, result = speculative_round(target, proposer, state, stop_ids, verify_len=t, all_greedy=greedy,
                                          peek=peek, track=track, cut=cut)  # fmt: skip
        n_keep = result.n_keep
        width, history = out.tokens.shape[1], out.kept.shape[1]
        columns = jnp.where(slots < n_keep[:, None], out.written[:, None] + slots, width)  # out of range → dropped
        record = jnp.where(running, out.rounds, history)  # out of range → dropped
        out = out.replace(
            tokens=out.tokens.at[rows[:, None], columns].set(result.emitted, mode="drop"),
            written=out.written + n_keep, stopped=out.stopped | result.hit_stop,
            kept=out.kept.at[rows, record].set(n_keep, mode="drop"),
            accepted=out.accepted.at[rows, record].set(result.accepted, mode="drop"),
            lengths=out.lengths.at[rows, record].set(result.length, mode="drop"), rounds=out.rounds + running,
            iterations=out.iterations + 1,
        )
        return state, out, jnp.bool_(False) if until is None else until(state, out.iterations)

    state, transcript, _ = jax.lax.while_loop(cond, body, (state, transcript, jnp.bool_(False)))
    return state, transcript


@struct.dataclass
class Choice:
    """The policy's choice for the next segment, made on the device at the end of one."""

    index: Array  # int32: candidate index into the policy's lengths
    probe: Array  # bool: the next segment is a probe (one round, then choose again)
    until_probe: Array  # int32 ≥ 1: plain rounds before a probe is due (T = 1 changes no estimate)
    alive: Array  # bool: some row still runs


def segment(
    target: tgt.Target, proposer: Proposer, state: DecodeState, transcript: Transcript, stop_ids: Array,
    max_rounds: Array, policy: VerifyPolicy, decide_after: Array | None = None, held: Array | None = None, *,
    verify_len: int, greedy: bool, peek: bool = False,
) -> tuple[DecodeState, Transcript, Choice]:
    """``max_rounds`` rounds at ``verify_len`` (``decode_rounds``), then ``policy``'s next choice. A policy
    of one length is a fixed verify length: no statistics are kept. ``peek`` (a greedy probe): one peek, then
    the plain rounds until the next probe is due — none if the peek makes the policy draft — within
    ``max_rounds`` in all: a probe costs no launch of its own.

    ``decide_after`` (drafted rounds of an adaptive policy): after that many rounds the segment also ends as
    soon as the policy, deciding after every round, would choose another length or a probe — a choice that
    holds stays on the device instead of costing a launch and a read-back every few rounds
    (plain rounds need no such check: they change no estimate, and the host runs them until a probe is due).
    ``held`` (traced bool, with ``decide_after``): the policy chose this length and holds it (``Decoder.plan``'s
    ``decide_after`` is set), so it gives way only to a drafted length ``adaptive.SWITCH_MARGIN`` better — not a
    probe's or an explored length's segment."""
    track = len(policy.lengths) > 1
    if peek:  # a probe: the peek, then plain rounds until the next probe is due (none if the policy now drafts)
        state, transcript = decode_rounds(target, proposer, state, transcript, stop_ids, jnp.int32(1), verify_len=1,
                                          greedy=greedy, peek=True, track=track)  # fmt: skip
        after = choose(policy, state.stats, state.running, state.remaining, transcript.iterations)
        plain = jnp.where((after.index == policy.lengths.index(1)) & ~after.probe, after.until_probe, 0)
        max_rounds, peek = jnp.minimum(plain, max_rounds - 1), False
    until, current = None, None
    if decide_after is not None and track and verify_len > 1 and not peek:
        index, decide_at = policy.lengths.index(verify_len), transcript.iterations + decide_after
        current = None if held is None else jnp.where(held, index, -1)

        def until(s: DecodeState, iterations: Array) -> Array:
            chosen, probe = adaptive.choose(policy, s.stats, s.running, s.remaining, iterations, current)
            return (iterations >= decide_at) & ((chosen != index) | probe)

    state, transcript = decode_rounds(target, proposer, state, transcript, stop_ids, max_rounds, verify_len=verify_len,
                                      greedy=greedy, peek=peek, track=track, cut=policy if track else None,
                                      until=until)  # fmt: skip
    return state, transcript, choose(policy, state.stats, state.running, state.remaining, transcript.iterations,
                                     current)  # fmt: skip


def choose(policy: VerifyPolicy, stats: adaptive.PolicyState, running: Array, remaining: Array,
           round_index: Array, current: Array | int | None = None) -> Choice:  # fmt: skip
    """The policy's choice for the rows as they are (``adaptive.choose``; ``current``: the index of the length the
    policy holds, -1 or None: none), with the plain rounds left before a probe is due."""
    index, probe = adaptive.choose(policy, stats, running, remaining, round_index, current)
    until_probe = jnp.min(jnp.where(running, adaptive.waits(policy, stats) - stats.idle, adaptive.NEVER_PAID_WAIT))
    return Choice(index, probe, jnp.maximum(until_probe, 1), jnp.any(running))


run_segment = jax.jit(segment, static_argnames=("verify_len", "greedy", "peek"),
                      donate_argnames=("state", "transcript"))  # fmt: skip
first_choice = jax.jit(choose)  # a run's first choice, before any segment (one program, not op by op)
carried = jax.jit(adaptive.carried)  # what a run passes on (``Decoder.remember``; op by op it compiled ~19 programs)


# ----------------------------------------------------------------------------------------------
# Verify lengths: fixed, by batch size (sps table), or adaptive


def check_block_size(block_size: int, limit: int | None) -> None:
    """A fixed verify length is the anchor plus at least one proposal, and at most the proposer's block."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ValueError(f"a fixed verify length must be an integer >= 2 (anchor + proposals), got {block_size!r}")
    if limit is not None and block_size > limit:
        raise ValueError(f"verify length {block_size} exceeds the drafter's block size {limit}")


def parse_verify(verify: int | str) -> int | str:
    """``"auto"`` or a fixed verify length (an int, or its decimal text as the CLIs pass it)."""
    if isinstance(verify, str) and verify != "auto":
        if not verify.isdigit():
            raise ValueError(f"verify must be 'auto' or a verify length (an integer >= 2), got {verify!r}")
        verify = int(verify)
    return verify


def load_sps_table(table: Mapping[str, Any] | str | os.PathLike) -> dict[int, int]:
    """An sps table (dict or JSON path, written by ``python -m dspine_jax.tune``) → ``{batch_size: verify_length}``.

    Accepted forms: the tune CLI's output (``{"verify_length": {"1": 8, "4": 6}, ...}``) or a bare
    ``{"1": 8, "4": 6}`` mapping.
    """
    if isinstance(table, (str, os.PathLike)):
        with open(table) as f:
            table = json.load(f)
    entries = table.get("verify_length", table) if isinstance(table, Mapping) else None
    if not isinstance(entries, Mapping) or not entries:
        raise ValueError("sps table must map batch sizes to verify lengths, e.g. {'verify_length': {'1': 8}}")
    out = {}
    for batch, length in entries.items():
        batch, length = int(batch), int(length)
        if batch < 1 or length < 2:
            raise ValueError(f"sps table entry {batch}: {length} is invalid (batch >= 1, verify length >= 2)")
        out[batch] = length
    return out


def verify_length_for_batch(table: Mapping[int, int], batch: int) -> int:
    """The entry for the largest tabulated batch size ≤ ``batch`` (the smallest entry if none is)."""
    sizes = sorted(table)
    below = [s for s in sizes if s <= batch]
    return table[below[-1] if below else sizes[0]]


# ----------------------------------------------------------------------------------------------
# The host driver


class Calibration:
    """Seconds per round at each length from timed segments: each length's first segment is dropped (it may
    pay one-time costs), and once every length has ``COST_SAMPLES`` more, its cost is the **fastest** of
    them, per round. A busy machine only adds time, and the two errors are not alike: a length measured too
    cheap is run, timed and corrected (``CostEstimate``, ``explore``), while one measured too dear is never
    chosen, so nothing ever times it again (seen: a calibration during a busy moment priced drafted rounds at
    2.4–3.3× a plain step; 1.3–1.9× re-measured)."""

    def __init__(self, lengths: Sequence[int]):
        self.samples: dict[int, list[float]] = {t: [] for t in lengths}

    def next_length(self) -> int:
        """The length with the fewest segments (the lengths interleave, so a busy moment hits them alike)."""
        return min(self.samples, key=lambda t: len(self.samples[t]))

    def record(self, length: int, seconds: float, rounds: int) -> None:
        if rounds > 0:
            self.samples[length].append(seconds / rounds)

    def costs(self) -> tuple[dict[int, float], dict[int, int]] | None:
        """``({T: seconds per round}, {T: timed segments})`` once every length has its samples, else None."""
        if any(len(v) <= COST_SAMPLES for v in self.samples.values()):
            return None
        return ({t: float(min(v[1:])) for t, v in self.samples.items()},
                {t: len(v) - 1 for t, v in self.samples.items()})  # fmt: skip


@dataclasses.dataclass
class Plan:
    """The next segment, as the host decided it."""

    length: int  # verify length (1: plain rounds)
    rounds: int  # at most this many rounds
    peek: bool  # plain rounds that peek (a greedy probe)
    policy: VerifyPolicy  # the policy choosing the segment after this one
    chosen: bool  # the policy's choice (its time refines the costs) — else fixed, pinned or calibrating
    calibrating: bool  # timed for the calibration
    decide_after: int | None = None  # rounds after which the policy may end the segment by choosing otherwise
    # (``segment``; None: it runs ``rounds``)


@dataclasses.dataclass
class _Bucket:
    """Cost state of one batch bucket."""

    key: str | None  # the cost cache's key (None: costs were given, not measured)
    calibration: Calibration | None = None
    estimate: adaptive.CostEstimate | None = None
    next: tuple[int, bool, int] | None = None  # the device's last choice: (length, probe, until_probe)


PRIOR_FINGERPRINT = 4096  # values of each of the first leaves that tell two drafters (or targets) apart


def _leading(leaf: Array, count: int) -> Array:
    """``leaf.ravel()[:count]`` from the leading rows only: raveling a whole embedding op by op copied it (~80 ms a
    request on a 2-core CPU, before decoding started)."""
    if leaf.ndim > 1:
        row = math.prod(leaf.shape[1:])
        leaf = leaf[: -(-count // row)]
    return jnp.ravel(leaf)[:count]


_PRIORS: dict[str, adaptive.Prior] = {}  # the process's carried priors, per (device, target, drafter)
_RAN: dict[str, set[int]] = {}  # per cost key: the lengths whose first segment this process ran (CostEstimate)


def forget() -> None:
    """Drop what this process kept from earlier runs: every carried prior (the next run of each drafter starts
    from nothing observed) and which lengths' first segments ran (the next first segment is not timed)."""
    _PRIORS.clear()
    _RAN.clear()


def _entry_template(lengths: Sequence[int]) -> tuple[dict[int, float], dict[int, int]]:
    """The shape of a cost-cache entry for ``lengths`` (``adaptive.load_cost_entry``'s)."""
    return {t: 0.0 for t in lengths}, {t: 0 for t in lengths}


class Decoder:
    """Which verify length each segment runs at, for one target and proposer.

    ``verify``: ``"auto"`` (adaptive: each segment's length chosen from the rows' acceptance and the cost per
    length), or a fixed verify length (≥ 2, ≤ the proposer's block); ``block_size`` is its older name;
    ``sps_table`` fixes the length by batch size (capped at the block). A proposer that drafts nothing
    (``block_limit`` 1) runs plain rounds. ``verify_costs``: ``{T: seconds}`` for every batch bucket, or
    ``{bucket: {T: seconds}}``, instead of calibrating; ``verify_schedule`` pins the lengths round by round
    (cyclic; tests). ``calibrate``: ``"ahead"`` (the caller runs ``calibrate``) or ``"online"`` (the first
    segments of a bucket run each length in turn, timed). ``scope`` distinguishes cost-cache entries of
    callers whose rounds cost differently (the engine's steps). ``batch``: the run's one batch size, if it has
    one (the sps table's entry for it is then the only length). ``run_choice``: how a run's first choice runs
    (``choose``'s arguments → ``Choice``; default ``first_choice``, jitted): the serving engine runs it through
    its own programs, compiled by its warmup."""

    def __init__(
        self, target: tgt.Target, proposer: Proposer, *, verify: int | str = "auto", block_size: int | None = None,
        sps_table: Mapping[str, Any] | str | os.PathLike | None = None,
        verify_costs: Mapping[int, Any] | None = None, verify_schedule: Sequence[int] | None = None,
        calibrate: str = "ahead", scope: str = "", batch: int | None = None,
        run_choice: Callable[..., Choice] | None = None,
    ):
        proposer.check_compatible(target)
        self.target, self.proposer, self.scope = target, proposer, scope
        self.run_choice = run_choice or first_choice
        self.calibrate_mode = calibrate
        limit = proposer.block_limit
        verify = parse_verify(verify)
        if block_size is not None:
            if verify != "auto" and verify != block_size:
                raise ValueError(f"verify={verify!r} and block_size={block_size} disagree: give one")
            verify = block_size
        self.table: dict[int, int] | None = None
        self.candidates: tuple[int, ...] = ()  # adaptive lengths (empty: fixed lengths)
        if limit == 1:
            self.table = {1: 1}
        elif sps_table is not None:
            self.table = {b: min(t, limit) if limit is not None else t for b, t in load_sps_table(sps_table).items()}
            if batch is not None:  # one batch size for the whole run: its entry only
                self.table = {1: verify_length_for_batch(self.table, batch)}
        elif verify != "auto":
            check_block_size(verify, limit)
            self.table = {1: verify}
        else:
            self.candidates = adaptive.candidate_lengths(limit)
        if verify_schedule is not None and not self.candidates:
            raise ValueError("verify_schedule pins the lengths of verify='auto'; a fixed verify has one length")
        self.schedule = verify_schedule
        self.lengths = self.candidates or tuple(sorted(set(self.table.values())))  # every length a round may run at
        self.max_verify = max(self.lengths)
        self.given = verify_costs
        self.every = 1 if verify_schedule is not None else DECIDE_EVERY
        self.forced_length: int | None = None  # tests pin every segment's length
        self._unit = adaptive.make_policy(self.candidates, dict.fromkeys(self.candidates, 1.0)) if self.candidates else None
        self._buckets: dict[int, _Bucket] = {}
        self._key: str | None = None  # the carried prior's key (computed on first use)

    def programs(self, greedy: bool) -> list[tuple[int, bool]]:
        """``(verify length, peek)`` of every segment program a run may use (peeks where probes may be greedy)."""
        if not self.candidates:
            return [(t, False) for t in self.lengths]
        return adaptive.programs(self.candidates, greedy and self.schedule is None)

    def policy(self, length: int | None = None) -> VerifyPolicy:
        """The policy a segment program is compiled with: unit costs (values are traced, so this is the
        program every adaptive segment runs), or a fixed length's."""
        return self._unit if self.candidates else adaptive.fixed_policy(length or self.lengths[0])

    def length_for(self, batch: int) -> int:
        """A fixed verify length for ``batch`` running rows (the sps table's entry)."""
        return verify_length_for_batch(self.table, batch)

    # -- costs per batch bucket
    def _bucket(self, bucket: int) -> _Bucket:
        if bucket in self._buckets:
            return self._buckets[bucket]
        given = self.given
        if given is not None and given and isinstance(next(iter(given.values())), Mapping):
            given = given.get(bucket)
        if given is not None:
            entry = _Bucket(key=None, estimate=adaptive.CostEstimate(given))
        else:
            key = adaptive.costs_key(self.target, f"{self.scope}{self.proposer.tag}", bucket, self.candidates)
            # Several processes must choose alike: process 0's cache decides for all.
            cached = distributed.agree_optional(adaptive.load_cost_entry(key), _entry_template(self.candidates))
            entry = _Bucket(key=key, estimate=adaptive.CostEstimate(*cached, ran=_RAN.setdefault(key, set()))
                            if cached else None)  # fmt: skip
            if entry.estimate is None:
                entry.calibration = Calibration(self.candidates)
        self._buckets[bucket] = entry
        return entry

    def needs_calibration(self, bucket: int) -> bool:
        return bool(self.candidates) and self._bucket(bucket).estimate is None

    def costs(self, bucket: int) -> dict[int, float] | None:
        """The current cost per length of ``bucket`` (None while it is being calibrated)."""
        estimate = self._bucket(bucket).estimate if self.candidates else None
        return None if estimate is None else estimate.current()

    def calibrate(self, bucket: int, measure: Callable[[int], tuple[float, int]]) -> float:
        """Calibrate ``bucket`` ahead: ``measure(T)`` runs ``CALIBRATION_ROUNDS`` rounds at ``T`` from a fresh
        start and returns ``(seconds, rounds run)``; the lengths interleave until ``Calibration`` has its
        samples. Stores the costs on disk; returns the seconds it took."""
        entry = self._bucket(bucket)
        _log.info("measuring verify costs for lengths %s (once per device, model, drafter and batch size; cached "
                  "in %s)", list(self.candidates), adaptive.costs_path())  # fmt: skip
        begin = time.perf_counter()
        while entry.estimate is None:
            t = entry.calibration.next_length()
            entry.calibration.record(t, *measure(t))
            self._calibrated(entry)
        return time.perf_counter() - begin

    def _calibrated(self, entry: _Bucket) -> None:
        done = entry.calibration.costs()
        if done is not None:
            ran = _RAN.setdefault(entry.key, set())
            ran.update(done[0])  # the calibration ran each length's program (and dropped its first segment)
            entry.estimate = adaptive.CostEstimate(*done, ran=ran)
            adaptive.store_costs(entry.key, *done, measured_at=time.time())

    # -- the driver
    def plan(
        self, batch: int, bucket: int, stats: adaptive.PolicyState, running: Any, remaining: Any, *, greedy: bool,
        max_rounds: int | None = None, hold: bool = False,
    ) -> Plan:
        """The next segment for ``batch`` running rows in cost bucket ``bucket``: its length, rounds and policy.
        ``stats`` / ``running`` / ``remaining``: the rows' (host or device arrays; read only for the very
        first choice, later ones come from the device with the previous segment). ``greedy``: every running
        row is greedy (a probe can then be a peek). ``max_rounds``: the caller's cap (None: none). ``hold``: the
        caller runs ``Plan.decide_after`` (``segment``), so drafted rounds the policy chose run, after
        ``DECIDE_AFTER`` of them, for as long as the policy would choose them again."""
        cap = max_rounds or (1 << 30)
        if not self.candidates:
            t = self.forced_length or self.length_for(batch)
            return Plan(t, cap, False, adaptive.fixed_policy(t), False, False)
        if self.forced_length is not None:
            return Plan(self.forced_length, cap, False, self._unit, False, False)
        entry = self._bucket(bucket)
        if entry.estimate is None:
            if self.calibrate_mode != "online":
                raise RuntimeError("costs of this batch bucket are not calibrated: call Decoder.calibrate first")
            return Plan(entry.calibration.next_length(), min(cap, self.every), False, self._unit, False, True)
        policy = adaptive.make_policy(self.candidates, entry.estimate.current(), self.schedule)
        if entry.next is None:  # the first choice of a run: made here, on the rows as they are
            first = jax.device_get(self.run_choice(policy, stats, running, remaining, jnp.int32(0)))
            entry.next = (policy.lengths[int(first.index)], bool(first.probe), int(first.until_probe))
        chosen, probe, until_probe = entry.next
        t = chosen
        if entry.key is not None and self.schedule is None and not probe:
            t = entry.estimate.explore(chosen)  # measured costs are corrected only by running a length
        # Plain rounds the policy chose run until a probe is due; with ``hold``, drafted ones while the choice holds
        # and a peek is followed by the plain rounds until the next probe (``segment``); explored ones a whole
        # segment (timed).
        peek = adaptive.peeks(t, probe, greedy and self.schedule is None)
        held = hold and chosen > 1 and t == chosen and not probe and self.schedule is None
        if probe:
            rounds = cap if hold and peek else 1
        else:
            rounds = until_probe if chosen == 1 and self.schedule is None else cap if held else self.every
        return Plan(1 if peek else t, min(cap, rounds), peek, policy, True, False,
                    decide_after=DECIDE_AFTER if held else None)  # fmt: skip

    def observe(self, bucket: int, plan: Plan, seconds: float, rounds: int, choice: Choice | None) -> None:
        """A segment ran ``rounds`` rounds in ``seconds`` and the device chose the next (``choice``, host values)."""
        if not self.candidates or self.forced_length is not None:
            return
        entry = self._bucket(bucket)
        if plan.calibrating:
            entry.calibration.record(plan.length, seconds, rounds)
            self._calibrated(entry)
            entry.next = None
            return
        alive = choice is not None and bool(choice.alive)
        # Only whole segments refine the costs: a shorter one (a probe, plain rounds until a probe is due) carries
        # a segment's dispatch and read-back over fewer rounds (seen: a cache refined mostly by one-round probes
        # pricing T = 2 at 1.6× a plain step); a peek's time is neither length's.
        if alive and entry.key is not None and not plan.peek and rounds >= self.every:
            entry.estimate.observe(plan.length, seconds, rounds)
        if choice is None or not alive:
            entry.next = None
        else:
            entry.next = (plan.policy.lengths[int(choice.index)], bool(choice.probe), int(choice.until_probe))

    # -- the prior carried between runs (``adaptive.Prior``)
    def _prior_key(self) -> str | None:
        if not self.candidates or self.schedule is not None:
            return None
        if self._key is None:  # per drafter: its shapes and a fingerprint of its and the target's weights
            leaves = [leaf for tree in (self.target, self.proposer) for leaf in jax.tree.leaves(tree)[:4]]
            values = distributed.to_host([_leading(leaf, PRIOR_FINGERPRINT) for leaf in leaves])
            digest = hashlib.sha256(b"".join(v.tobytes() for v in values)).hexdigest()[:16]
            self._key = f"{adaptive.costs_key(self.target, self.scope + self.proposer.tag, 1, self.candidates)}|{digest}"
        return self._key

    def prior(self) -> adaptive.Prior | None:
        """Where a run's acceptance statistics start: what this process's last run with the same target and
        drafter passed on (``remember``), else None (nothing observed)."""
        key = self._prior_key()
        return None if key is None else _PRIORS.get(key)

    def remember(self, stats: adaptive.PolicyState) -> None:
        """Pass the rows' final statistics on to the next run with this target and drafter (``adaptive.carried``)."""
        key = self._prior_key()
        if key is not None:
            _PRIORS[key] = distributed.to_host(carried(stats, np.ones(stats.wait.shape, bool)))

    def store(self) -> None:
        """Keep what decoding measured in the cost cache, for the next run."""
        for entry in self._buckets.values():
            if entry.key is not None and entry.estimate is not None:
                adaptive.store_costs(entry.key, *entry.estimate.measured(), timed=entry.estimate.ran())

