"""Adaptive verification: the verify length ``T`` of every round chosen online, so that drafting is
never paid for when it does not bring tokens.

Two parts, both small:

* **Cost model**: seconds per round at each candidate ``T`` on this device, ``T = 1``
  being a plain decode step without drafting. ``decoder.Calibration`` measures it once per
  (device, target, proposer, batch bucket) by running the real loop pinned to each ``T``;
  ``load_costs`` / ``store_costs`` keep it in ``<cache>/verify_costs.json`` (re-measured after
  ``COSTS_MAX_AGE``). While decoding,
  ``CostEstimate`` refines it with the rounds actually run (a short calibration is noisy on a shared
  machine, and the load changes while decoding). A cost can only be corrected by running its length,
  so while drafting pays the neighbours of the chosen length that few segments have timed (this run
  and earlier ones, counted in the cache) get a segment each (``CostEstimate.explore``): a prior that
  makes one length look cheap cannot hold the choice there for ever.
* **Policy** (``choose`` / ``update``, run on the device inside the decode loop): per row, decayed
  counts of how often proposal slot ``i`` was accepted when verification reached it give
  ``a_i = (hits_i + w·a_{i-1}) / (tries_i + w)`` (``a_0 = p0``: an untested slot looks like the one before
  it); the expected tokens of a round of length ``T`` are
  ``E(T) = 1 + Σ_{k<T} Π_{i≤k} a_i`` (capped by the row's remaining budget). The batch shares one ``T``:
  ``argmax_T Σ_running E_b(T) / cost(T)``; a held drafted length gives way only to a drafted one ``SWITCH_MARGIN``
  better (``choose``'s ``current``), so estimates at the boundary of two lengths do not switch program every few
  rounds. ``T = 1`` stops drafting; after ``wait`` such rounds a
  **probe** (one round at ``PROBE_LENGTH``) refreshes the estimates, and every probe that brings no
  accepted token doubles the row's wait, so a useless drafter costs almost nothing. The wait is capped by
  what a probe costs (``wait_cap``: its round and the launch of the segment it makes): probes stay within
  ``PROBE_BUDGET`` of the plain rounds between them, so a cheap drafter that is right half the time is probed every
  ~25 rounds, not once a request after two unlucky misses (seen: a drafter at τ 1.9 on a text never drafted on
  it, its two probes having missed). A drafter whose first slot was accepted in fewer than ``NEVER_PAID_RATE`` of
  its tries over its requests in the process (``never_paid``: an untrained or mismatched drafter; no drafted round
  pays below ~10 %) is probed as rarely as ``NEVER_PAID_WAIT`` rounds instead, spaced over requests: its peeks and
  the context ingest each brings cost such a drafter under 1 % of decoding instead of ~2 %. Not misses in a row: a
  trained drafter misses 12–28 in a row on stretches of a text it drafts well elsewhere (the shipped one on
  HumanEval/28, Troilus, Merry Wives).
  Under greedy decoding ``speculative_generate`` probes by a **peek** instead (``round.speculative_round(peek=True)``):
  a plain round plus a one-token draft, recorded as the round at ``PROBE_LENGTH`` it stands for, so a
  probe costs a draft rather than a wider verify; the plain rounds up to the next probe run in the peek's
  segment (``decoder.segment``).
* **Carried prior** (``Prior``): a request does not start from the coin flip when earlier requests of the
  process ran the same target and drafter: its rows start from what those requests' rows measured (``carried``:
  their pooled counts over each whole request, scaled to ``CARRY_WEIGHT`` observations, and their shortest probe
  wait, which ``wait_cap`` bounds where probes are cheap). A drafter that brought nothing on the last requests starts the next one with plain
  rounds and a long wait instead of drafting on a guess; one that paid starts drafting at once. The prior
  decays by itself: each request's own rounds outweigh it within a few drafted rounds, and what it passes on
  is its own statistics. ``speculative_generate`` keeps one per (device, target, drafter) in the process
  (``Decoder.prior`` / ``remember``); the serving engine pools the slots' statistics when it starts a row.

Whatever ``T`` a round runs at, the round is exact (greedy == AR, sampling lossless): the policy only
changes speed. ``VerifyPolicy.schedule`` can pin the choice per round (tests, cost measurement).

Letters: B batch, P = T_max - 1 proposal slots, L candidate lengths.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from dspine_jax.models import hub, panels, quant

CANDIDATE_LENGTHS = (1, 2, 4, 8, 16)  # verify lengths the policy chooses among (capped by the drafter's block)
SCHEDULE_WIDTH = 16  # the pinned schedule is cyclic over this many rounds (a fixed shape: no recompiles)
DECAY = 0.8  # per drafted round: the estimates follow the last ~5 rounds
PRIOR_ACCEPT, PRIOR_WEIGHT = 0.5, 1.0  # the first slot starts as a coin flip; a prior is worth one observation
PROBE_LENGTH = 2  # a probe verifies this many tokens: the cheapest drafted round
FIRST_WAIT, MAX_WAIT = 4, 64  # plain rounds before the first probe; the wait doubles up to MAX_WAIT
PROBE_BUDGET = 0.015  # a probe's extra cost over a plain round, spread over the plain rounds before it (wait_cap)
NEVER_PAID_TRIES, NEVER_PAID_RATE = 12, 0.05  # a drafter never paid: its first slot tried this often over its
# requests and accepted in fewer than this share of the tries (``never_paid``) ...
NEVER_PAID_WAIT = 256  # ... is probed as rarely as this
LIFETIME_TRIES = 64.0  # those counts over requests are scaled down to this many tries (older evidence fades)
PROBE_LAUNCHES = 0.1  # plain rounds a probe's launch adds: the plain rounds after it run in its segment, so each probe
# makes one segment more (a launch and its read-back measured ~0.09 of a plain round on a 2-core CPU)
SWITCH_MARGIN = 0.1  # a held drafted length gives way only to a drafted one expected this much faster (``choose``'s
# ``current``): estimates at the boundary of two lengths switched program every few rounds, a launch each (replayed
# in the bench's order at three days' costs of a 2-core CPU: +0 to +1 point over all prompts)
CARRY_WEIGHT = 2.0  # a prior carried from earlier requests counts as this many observations of the first slot
PRIOR_SAMPLES, RECENT = 3, 32  # a measured (or cached) cost counts as 3 timed segments; the last 32 count
EXPLORE_SAMPLES = PRIOR_SAMPLES + 1  # timed segments (over runs) a drafted length needs before only the policy
# picks it: more than its prior counts, so that what exploring measured outvotes the prior in the median
REFRESH_AGE = 3600  # seconds: a length's segments older than this no longer count, so it is explored again
COSTS_FILE = "verify_costs.json"
COSTS_ENV = "DSPINE_JAX_VERIFY_COSTS"  # a path for the cost cache instead of <cache root>/COSTS_FILE (tests)
COSTS_MAX_AGE = 24 * 3600  # seconds: a calibration older than this is measured again (a machine's day changes its costs)


def candidate_lengths(limit: int | None) -> tuple[int, ...]:
    """The candidate verify lengths up to ``limit`` (the drafter's block; None: all), ``limit`` itself
    included when it is not a power of two."""
    top = CANDIDATE_LENGTHS[-1] if limit is None else limit
    return tuple(sorted({t for t in CANDIDATE_LENGTHS if t <= top} | {top}))


@struct.dataclass
class VerifyPolicy:
    """What the loop needs to choose ``T``: the candidates (static: each is a compiled round), their costs
    and an optional pinned schedule (``schedule[r % SCHEDULE_WIDTH]`` = candidate index for round ``r``,
    -1 = the policy decides)."""

    lengths: tuple[int, ...] = struct.field(pytree_node=False)
    costs: Array  # [L] seconds (any common scale) per round at each length
    schedule: Array  # [SCHEDULE_WIDTH] int32


def fixed_policy(length: int) -> VerifyPolicy:
    """Every round verifies ``length`` tokens (the engine's fixed ``--verify N`` and sps table)."""
    return VerifyPolicy(lengths=(length,), costs=jnp.ones((1,), jnp.float32), schedule=pinned_schedule([0]))


def make_policy(lengths: Sequence[int], costs: Mapping[int, float], schedule: Sequence[int] | None = None) -> VerifyPolicy:
    """An adaptive policy over ``lengths`` with ``costs {T: seconds}``; ``schedule``: verify lengths to pin,
    cyclically, one per round (None: the policy decides every round)."""
    lengths = tuple(sorted(set(lengths)))
    missing = [t for t in lengths if t not in costs]
    if missing:
        raise ValueError(f"verify costs are missing for lengths {missing} (have {sorted(costs)})")
    if any(not (costs[t] > 0 and math.isfinite(costs[t])) for t in lengths):
        raise ValueError(f"verify costs must be positive and finite, got {dict(costs)}")
    pinned = [-1] if schedule is None else [lengths.index(t) if t in lengths else _bad_pin(t, lengths) for t in schedule]
    return VerifyPolicy(
        lengths=lengths, costs=jnp.asarray([costs[t] for t in lengths], jnp.float32), schedule=pinned_schedule(pinned)
    )


def _bad_pin(length: int, lengths: tuple[int, ...]) -> int:
    raise ValueError(f"pinned verify length {length} is not a candidate {lengths}")


def pinned_schedule(indices: Sequence[int]) -> Array:
    """Candidate indices, one per round, repeated to ``SCHEDULE_WIDTH`` (-1: the policy decides)."""
    if not 1 <= len(indices) <= SCHEDULE_WIDTH or SCHEDULE_WIDTH % len(indices):
        raise ValueError(f"a pinned schedule has 1…{SCHEDULE_WIDTH} entries dividing {SCHEDULE_WIDTH}, got {len(indices)}")
    return jnp.asarray(list(indices) * (SCHEDULE_WIDTH // len(indices)), jnp.int32)


@struct.dataclass
class PolicyState:
    """Per-row acceptance statistics (``[B, P]``: slot i = proposal i+1) and the probe bookkeeping."""

    hits: Array  # [B, P] f32 decayed count of rounds that accepted slot i, among those that tested it
    tries: Array  # [B, P] f32 decayed count of rounds that tested slot i (all earlier slots accepted)
    idle: Array  # [B] int32 rounds since the row last drafted
    wait: Array  # [B] int32 plain rounds before the next probe
    total_hits: Array  # [B, P] f32 hits since the row's request began, not decayed (what it passes on: ``carried``)
    total_tries: Array  # [B, P] f32 tries since the row's request began, not decayed
    lifetime_hits: Array  # [B] f32 first-slot hits over the drafter's requests in this process (carried; scaled so
    lifetime_tries: Array  # [B] f32 ... first-slot tries ... that the tries are at most LIFETIME_TRIES)


@struct.dataclass
class Prior:
    """Where a new row's statistics start: per-slot counts ``[P]`` and the plain rounds before its first probe."""

    hits: Array  # [P] f32
    tries: Array  # [P] f32 (tries[0] ≤ CARRY_WEIGHT)
    wait: Array  # int32 scalar
    lifetime_hits: Array  # f32 scalar (``PolicyState.lifetime_hits``)
    lifetime_tries: Array  # f32 scalar
    idle: Array  # int32 scalar: plain rounds since the last probe, for a drafter that never paid (else 0)


def init_state(batch: int, max_length: int, prior: Prior | None = None) -> PolicyState:
    """Fresh statistics for ``batch`` rows: nothing observed (the coin flip), or ``prior``'s."""
    p = max(max_length - 1, 1)
    if prior is None:
        none = jnp.float32(0.0)
        prior = Prior(jnp.zeros((p,), jnp.float32), jnp.zeros((p,), jnp.float32), jnp.int32(FIRST_WAIT), none, none,
                      jnp.int32(0))
    return PolicyState(
        hits=jnp.broadcast_to(prior.hits, (batch, p)), tries=jnp.broadcast_to(prior.tries, (batch, p)),
        idle=jnp.full((batch,), prior.idle, jnp.int32), wait=jnp.full((batch,), prior.wait, jnp.int32),
        total_hits=jnp.zeros((batch, p), jnp.float32), total_tries=jnp.zeros((batch, p), jnp.float32),
        lifetime_hits=jnp.full((batch,), prior.lifetime_hits, jnp.float32),
        lifetime_tries=jnp.full((batch,), prior.lifetime_tries, jnp.float32),
    )


def carried(state: PolicyState, rows: Array) -> Prior:
    """What ``rows [B]`` (bool) of ``state`` pass on to the next request: their per-slot counts since their
    requests began (undecayed), pooled and scaled so the first slot counts at most ``CARRY_WEIGHT`` observations
    (the estimates keep their ratios, the next request's own rounds soon outweigh them), and their shortest wait (a
    drafter whose probes cost little is probed again within ``wait_cap`` rounds whatever it carried: one that
    failed on the last text gets a probe soon on this one). A row that never drafted in its request learned
    nothing: it passes on the prior it started from (its counts are still that prior's); rows that started from
    nothing and never drafted add nothing, and with none, the coin flip (``init_state``'s default).

    The first slot's counts over the drafter's requests (``lifetime_*``) go on from the row that has the most; a
    drafter that never paid (``never_paid``) also passes on its rounds since the last probe, so its rare probes are
    spaced over the process's requests, not restarted by each one.

    Not the final, decayed counts: a drafted stretch ends when the recent rounds turned bad, so a request's final
    estimates are biased low, and a request that ended on a stretch the drafter misses passed "do not draft" on
    (seen: a code prompt repeated in a bench, every repeat starting with 42 plain rounds, where another run drafted
    it from the first round at τ 1.56; replayed in the bench's order under dear drafted rounds, ``policy_sim.py
    --chain``: code 1.20× → 1.24× our AR, all 1.19× → 1.24×; under cheap ones unchanged)."""
    drafted = state.total_tries[:, :1] > 0  # [B, 1]
    row_hits = jnp.where(drafted, state.total_hits, state.hits)  # (no drafted round: nothing decayed the prior)
    row_tries = jnp.where(drafted, state.total_tries, state.tries)
    seen = rows & (row_tries[:, 0] > 0)
    hits = jnp.sum(jnp.where(seen[:, None], row_hits, 0.0), axis=0)
    tries = jnp.sum(jnp.where(seen[:, None], row_tries, 0.0), axis=0)
    scale = jnp.where(tries[0] > 0, jnp.minimum(1.0, CARRY_WEIGHT / jnp.maximum(tries[0], 1e-9)), 0.0)
    any_seen = jnp.any(seen)
    wait = jnp.where(any_seen, jnp.min(jnp.where(seen, state.wait, NEVER_PAID_WAIT)), FIRST_WAIT)
    informed = rows & (state.lifetime_tries > 0)
    most = jnp.argmax(jnp.where(informed, state.lifetime_tries, -1.0))
    lifetime_hits = jnp.where(jnp.any(informed), state.lifetime_hits[most], 0.0)
    lifetime_tries = jnp.where(jnp.any(informed), state.lifetime_tries[most], 0.0)
    never = _never_paid(lifetime_hits, lifetime_tries)
    idle = jnp.where(never, jnp.min(jnp.where(informed, state.idle, NEVER_PAID_WAIT)), 0)
    return Prior(hits * scale, tries * scale, jnp.clip(wait, FIRST_WAIT, NEVER_PAID_WAIT).astype(jnp.int32),
                 lifetime_hits, lifetime_tries, idle.astype(jnp.int32))


def acceptance(state: PolicyState) -> Array:
    """``[B, P]`` estimated probability that slot i is accepted once verification reaches it. Each slot's
    prior is the estimate of the slot before it (the first slot's is ``PRIOR_ACCEPT``), so a slot never
    tested looks like the deepest tested one: long blocks get tried when short ones are always accepted."""
    prior = jnp.full(state.hits.shape[:1], PRIOR_ACCEPT, jnp.float32)
    columns = []
    for i in range(state.hits.shape[1]):  # P ≤ 15: unrolled
        prior = (state.hits[:, i] + PRIOR_WEIGHT * prior) / (state.tries[:, i] + PRIOR_WEIGHT)
        columns.append(prior)
    return jnp.stack(columns, axis=1)


def expected_tokens(state: PolicyState, lengths: tuple[int, ...], remaining: Array) -> Array:
    """``[B, L]``: tokens a round of each length is expected to commit per row (bonus included, at most the
    row's ``remaining`` budget)."""
    return tokens_of_lengths(jnp.cumprod(acceptance(state), axis=1), lengths, remaining)


def tokens_of_lengths(survive: Array, lengths: tuple[int, ...], remaining: Array) -> Array:
    """``[B, L]`` expected tokens of a round of each length, given ``survive [B, P]`` = P(slots 1…k all accepted):
    the bonus plus the surviving proposals, at most the row's ``remaining`` budget."""
    cum = jnp.concatenate([jnp.zeros_like(survive[:, :1]), jnp.cumsum(survive, axis=1)], axis=1)  # [B, P+1]
    t = jnp.asarray(lengths, jnp.int32)[None, :]  # [1, L]
    usable = jnp.clip(jnp.minimum(t, remaining[:, None]), 1, cum.shape[1])  # tokens the row can still take
    return 1.0 + jnp.take_along_axis(cum, usable - 1, axis=1)


def choose(
    policy: VerifyPolicy, state: PolicyState, running: Array, remaining: Array, round_index: Array,
    current: Array | int | None = None,
) -> tuple[Array, Array]:
    """The candidate index (int32 scalar) for the next rounds of the batch, and whether it is a probe (the
    caller then runs one round only before choosing again). ``current``: the index of a drafted length the policy
    chose and holds (-1 or None: none), which gives way only to a drafted length expected to bring
    ``SWITCH_MARGIN`` more tokens per second."""
    gain = jnp.sum(jnp.where(running[:, None], expected_tokens(state, policy.lengths, remaining), 0.0), axis=0)  # [L]
    value = gain / policy.costs  # [L] expected tokens per second
    best = jnp.argmax(value).astype(jnp.int32)
    if current is not None:
        # Stopping drafting is not held back: with the margin on it too, a drafter that turned useless drafted on
        # (its decayed estimate of the first slot never falls below ~0.08; policy_sim.py: 0.88× our AR).
        plain = (best == 0) if policy.lengths[0] == 1 else jnp.bool_(False)
        held = jnp.maximum(current, 0)
        keep = (current >= 0) & ~plain & (value[best] <= (1.0 + SWITCH_MARGIN) * value[held])
        best = jnp.where(keep, held, best).astype(jnp.int32)
    lengths = jnp.asarray(policy.lengths, jnp.int32)
    probe_index = max(i for i, t in enumerate(policy.lengths) if t <= max(PROBE_LENGTH, policy.lengths[0]))
    due = (lengths[best] == 1) & jnp.any(running & (state.idle >= waits(policy, state)))
    # Drafting on the prior alone (nothing observed yet) is a probe too: one round, then decide on data.
    # (Starting such a request with a peek instead lost 6 points on code in policy_sim.py: a good drafter
    # reaches its long blocks a decision later.)
    unseen = (lengths[best] > 1) & jnp.all(jnp.where(running, state.tries[:, 0] == 0, True))
    best = jnp.where(due, probe_index, best)
    pinned = policy.schedule[round_index % SCHEDULE_WIDTH]
    return jnp.where(pinned >= 0, pinned, best), (due | unseen) & (pinned < 0)


def wait_cap(policy: VerifyPolicy) -> Array:
    """The longest wait between two probes (int32 scalar): a probe costs at most a round at ``PROBE_LENGTH``
    more than a plain round (a peek costs about as much: the same draft, no wider verify) and a launch
    (``PROBE_LAUNCHES``), and that extra, spread over the plain rounds before the probe, stays within
    ``PROBE_BUDGET`` of their cost — a cheap drafter is probed every few tens of rounds, a dear one as rarely as
    ``MAX_WAIT``."""
    if 1 not in policy.lengths or PROBE_LENGTH not in policy.lengths:
        return jnp.int32(MAX_WAIT)
    costs = policy.costs
    extra = costs[policy.lengths.index(PROBE_LENGTH)] / costs[policy.lengths.index(1)] - 1.0 + PROBE_LAUNCHES
    return jnp.clip(jnp.ceil(extra / PROBE_BUDGET), FIRST_WAIT, MAX_WAIT).astype(jnp.int32)


def never_paid(state: PolicyState) -> Array:
    """``[B]`` rows whose drafter's first slot, tried at least ``NEVER_PAID_TRIES`` times over its requests in this
    process, was accepted in fewer than ``NEVER_PAID_RATE`` of them: its probes are budgeted as rarely as
    ``NEVER_PAID_WAIT`` rounds, not by ``wait_cap``."""
    return _never_paid(state.lifetime_hits, state.lifetime_tries)


def _never_paid(hits: Array, tries: Array) -> Array:
    return (tries >= NEVER_PAID_TRIES) & (hits < NEVER_PAID_RATE * tries)


def waits(policy: VerifyPolicy, state: PolicyState) -> Array:
    """``[B]`` plain rounds each row waits before its next probe: its doubled wait, at most ``wait_cap`` (a drafter
    that never paid: at most ``NEVER_PAID_WAIT``)."""
    return jnp.where(never_paid(state), state.wait, jnp.minimum(state.wait, wait_cap(policy)))


def cut_lengths(policy: VerifyPolicy, verify_len: int) -> tuple[int, ...]:
    """The drafted lengths a round of ``verify_len`` may be cut to after drafting (``confidence_cut``): the
    policy's candidates from ``PROBE_LENGTH`` up to ``verify_len``; empty when there is nothing to choose."""
    lengths = tuple(t for t in policy.lengths if PROBE_LENGTH <= t <= verify_len)
    return lengths if len(lengths) > 1 and verify_len in lengths else ()


def confidence_cut(policy: VerifyPolicy, lengths: tuple[int, ...], confidence: Array, running: Array,
                   remaining: Array) -> Array:  # fmt: skip
    """After drafting, the index into ``lengths`` of the prefix of the draft to verify, from the drafter's own
    predicted acceptance of each proposal (``confidence [B, P]``, DSpark's confidence head: dynamic verification).

    Going from ``lengths[j]`` to ``lengths[j+1]`` adds proposals ``lengths[j] … lengths[j+1]-1``; it is worth it
    when the tokens the batch expects per unit of cost rise. The rule looks only at the confidences of slots
    ``≤ lengths[j]``, which depend on proposals already kept, and stops at the first step that does not pay:
    whether a proposal is verified never depends on that proposal, so sampled rows stay lossless. The unknown
    slots past ``lengths[j]`` are extrapolated with the last known confidence."""
    c = jnp.clip(confidence.astype(jnp.float32), 0.0, 1.0)
    survive = jnp.cumprod(c, axis=1)  # [B, P] the drafter's P(slots 1…k all accepted)
    known = tokens_of_lengths(survive, lengths, remaining)  # [B, L] (each column reads slots below its length)
    cost = lambda t: policy.costs[policy.lengths.index(t)]  # noqa: E731
    index, going = jnp.int32(0), jnp.bool_(True)
    for j, (short, long) in enumerate(zip(lengths, lengths[1:])):
        here = known[:, j]
        last, base = c[:, short - 1], survive[:, short - 1]  # slot `short`: its proposal's predecessor is kept
        steps = jnp.arange(long - short)[None, :]  # slots short … long-1, those within the row's budget
        usable = steps < (remaining - short)[:, None]
        extra = jnp.sum(jnp.where(usable, base[:, None] * last[:, None] ** steps, 0.0), axis=1)
        gain = jnp.sum(jnp.where(running, here + extra, 0.0)) / cost(long)
        now = jnp.sum(jnp.where(running, here, 0.0)) / cost(short)
        going = going & (gain > now)
        index = jnp.where(going, j + 1, index)
    return jnp.where(jnp.any(policy.schedule >= 0), len(lengths) - 1, index)  # a pinned length is not cut


def peeks(length: int, probe: bool, greedy: bool) -> bool:
    """Whether a round the policy chose runs as a peek (a plain round plus a one-token draft): a probe at
    ``PROBE_LENGTH`` of greedy rows, whose statistic (the draft's token against the emitted one) needs no wider
    verify. A sampled row's needs the real round."""
    return greedy and probe and length == PROBE_LENGTH


def programs(lengths: Sequence[int], greedy_probes: bool) -> list[tuple[int, bool]]:
    """``(verify length, peek)`` of every round program a decoder compiles: one per candidate length, plus the
    peek when its probes may be greedy."""
    return [(t, False) for t in lengths] + ([(1, True)] if greedy_probes and PROBE_LENGTH in lengths else [])


def update(state: PolicyState, length: Array, accepted: Array, running: Array) -> PolicyState:
    """After a round of ``length`` tokens in which row b's verification accepted ``accepted[b]`` proposals."""
    slot = jnp.arange(state.hits.shape[1])[None, :]  # [1, P]
    drafted = running & (length > 1)
    tested = drafted[:, None] & (slot < length - 1) & (slot <= accepted[:, None])
    hit = (slot < accepted[:, None]).astype(jnp.float32)
    # A probe (a drafted round after plain ones) that brings nothing doubles the wait; any accepted token
    # resets it.
    failed_probe = (state.idle > 0) & (accepted == 0)
    lifetime_hits = state.lifetime_hits + (drafted & (accepted > 0)).astype(jnp.float32)
    lifetime_tries = state.lifetime_tries + drafted.astype(jnp.float32)  # (a drafted round tests the first slot)
    shrink = jnp.minimum(1.0, LIFETIME_TRIES / jnp.maximum(lifetime_tries, 1.0))
    lifetime_hits, lifetime_tries = lifetime_hits * shrink, lifetime_tries * shrink
    longest = jnp.where(_never_paid(lifetime_hits, lifetime_tries), NEVER_PAID_WAIT, MAX_WAIT)
    wait = jnp.where(accepted > 0, FIRST_WAIT, jnp.where(failed_probe, jnp.minimum(2 * state.wait, longest), state.wait))
    # Every slot of a drafting row decays, tested or not: what deep slots did before acceptance changed
    # fades, and their estimates fall back on the (chained) prior.
    fade = jnp.where(drafted[:, None], DECAY, 1.0)
    hits, tries = jnp.where(tested, hit, 0.0), tested.astype(jnp.float32)
    return PolicyState(
        hits=fade * state.hits + hits, tries=fade * state.tries + tries,
        idle=jnp.where(drafted, 0, state.idle + running.astype(jnp.int32)),
        wait=jnp.where(drafted, wait, state.wait),
        total_hits=state.total_hits + hits, total_tries=state.total_tries + tries,
        lifetime_hits=lifetime_hits, lifetime_tries=lifetime_tries,
    )


# ----------------------------------------------------------------------------------------------
# Cost model on disk


def batch_bucket(batch: int) -> int:
    """Costs are measured per power-of-two batch size."""
    return 1 << max(batch - 1, 0).bit_length()


def costs_key(target, proposer_tag: str, batch: int, lengths: Sequence[int]) -> str:
    """What a measurement depends on: the device and how many the target spans, the target's shape and dtypes
    (weights, KV cache), the proposer's shape, the batch bucket and the candidate lengths (not the weights'
    values)."""
    device = jax.devices()[0]
    first = jax.tree.leaves(target.params)[0]
    spread = len(getattr(getattr(first, "sharding", None), "device_set", ())) or 1  # devices the target spans
    weights = "int8" if quant.is_quantized(target.params) else str(target.dtype)
    if target.kv_cache_dtype != "auto":  # (absent for the default, so keys measured before stay valid)
        weights += f"|kv:{target.kv_cache_dtype}"
    if panels.is_packed(target.params):  # the CPU panel kernel: other costs per length
        weights += "|panels"
    identity = json.dumps([str(target.config), str(target.dtype), weights, spread, proposer_tag], sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return f"{device.platform}:{device.device_kind}|{digest}|b{batch_bucket(batch)}|T{','.join(map(str, lengths))}"


def costs_path() -> str:
    """``$DSPINE_JAX_VERIFY_COSTS`` if set (a file), else ``<cache root>/verify_costs.json``."""
    return os.environ.get(COSTS_ENV) or os.path.join(hub.default_cache_dir(), COSTS_FILE)


def load_costs(key: str) -> dict[int, float] | None:
    """The cached ``{T: seconds}`` for ``key``, or None."""
    entry = load_cost_entry(key)
    return entry[0] if entry else None


def load_cost_entry(key: str, now: float | None = None) -> tuple[dict[int, float], dict[int, int]] | None:
    """The cached ``({T: seconds}, {T: timed segments behind it})`` for ``key``, or None — also when its
    calibration is older than ``COSTS_MAX_AGE`` or undated: a length priced too dear is never run, so nothing
    else would ever correct it (seen: a day-old entry pricing every drafted round at 2.2× a plain step kept a
    drafter that pays from drafting at all). A length last timed more than ``REFRESH_AGE`` ago counts no
    segments, so ``CostEstimate.explore`` times it again when it neighbours the choice (seen: T = 8 priced at
    2.3–2.5× a plain step by a calibration 13 hours old and never run since, T = 4 being chosen instead)."""
    try:
        with open(costs_path()) as f:
            entry = json.load(f).get(key)
    except (OSError, ValueError):
        return None
    if not entry:
        return None
    now = time.time() if now is None else now
    if now - entry.get("measured_at", -math.inf) > COSTS_MAX_AGE:  # undated: infinitely old
        return None
    counts, timed_at = entry.get("segments", {}), entry.get("timed_at", {})
    costs = {int(t): float(s) for t, s in entry.items() if t.isdigit()}
    fresh = {t: now - timed_at.get(str(t), entry["measured_at"]) <= REFRESH_AGE for t in costs}
    return costs, {t: int(counts.get(str(t), 0)) if fresh[t] else 0 for t in costs}


def store_costs(
    key: str, costs: Mapping[int, float], segments: Mapping[int, int] | None = None, *, measured_at: float | None = None,
    timed: Sequence[int] | None = None,
) -> None:
    """Add ``costs`` (and how many timed segments each rests on) under ``key`` (written atomically:
    concurrent runs never leave a torn file). ``measured_at``: when they were calibrated (None: a refinement,
    which keeps the entry's calibration time, or now for a new entry). ``timed``: the lengths timed just now
    (None: all); the others keep the time they were last timed."""
    path = costs_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    now, old = time.time(), table.get(key, {})
    if measured_at is None:
        measured_at = old.get("measured_at", now)
    entry: dict = {str(t): float(s) for t, s in sorted(costs.items())}
    if segments:
        entry["segments"] = {str(t): int(n) for t, n in sorted(segments.items())}
    entry["measured_at"] = float(measured_at)
    timed_at = {**old.get("timed_at", {}), **{str(t): now for t in (costs if timed is None else timed)}}
    entry["timed_at"] = {str(t): float(timed_at.get(str(t), measured_at)) for t in sorted(costs)}
    table[key] = entry
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)


class CostEstimate:
    """Seconds per round at each length while decoding: the measured (or cached) costs refined by the
    segments decoding actually runs (timed on the host between two of its syncs: what a round really
    costs, dispatch and the policy's choice included). Each length's estimate is the median of its last
    ``RECENT`` per-round samples and ``PRIOR_SAMPLES`` copies of its prior — a median, because one slow
    segment (the machine busy for a moment) must not flip the choice. The first segment of each length is
    not counted: the first run of a compiled program pays one-time costs (measured: ~0.1 s on a 2-core CPU,
    on the device, after compiling ahead). ``ran``: the lengths whose first segment already ran, shared by the
    estimates of one process (``speculative_generate`` makes one per request, and with segments that last
    while the policy's choice holds, a request may run a length once). A length not run yet keeps its prior
    scaled by the median ratio seen on the lengths that ran: a machine that got busier slows every length
    alike, so the ratios the policy compares stay the measured ones. That scaling also carries a wrong prior
    along (a length measured too cheap stays the cheapest), hence ``explore``. ``segments {T: n}``: timed
    segments behind each prior (the cache's)."""

    def __init__(self, prior: Mapping[int, float], segments: Mapping[int, int] | None = None,
                 ran: set[int] | None = None):  # fmt: skip
        self.prior = {int(t): float(s) for t, s in prior.items()}
        self.earlier = {t: int((segments or {}).get(t, 0)) for t in self.prior}
        self.samples: dict[int, collections.deque[float]] = {t: collections.deque(maxlen=RECENT) for t in self.prior}
        self.first_ran = set() if ran is None else ran

    def observe(self, length: int, seconds: float, rounds: int) -> None:
        if rounds <= 0 or length not in self.prior:
            return
        if length not in self.first_ran:
            self.first_ran.add(length)
            return
        self.samples[length].append(seconds / rounds)

    def timed(self, length: int) -> int:
        """Segments (this run's counted ones and earlier runs') that timed ``length``."""
        return self.earlier[length] + len(self.samples[length])

    def explore(self, chosen: int) -> int:
        """The length to run instead of the policy's ``chosen``: while drafting pays (``chosen`` > 1), the
        next shorter and the next longer drafted candidate, in that order, until each has been timed over
        ``EXPLORE_SAMPLES`` segments; else ``chosen``. Expected tokens per second are near unimodal in ``T``,
        so timing the neighbours of the choice is enough to walk off a wrong prior. (Not the plain step: timed
        in short segments between drafted ones it measured 1.1–1.7× its cost — each switch of program costs time
        — and priced that dear it made every drafted length look cheap.)"""
        if chosen <= 1 or chosen not in self.prior:
            return chosen
        drafted = sorted(t for t in self.prior if t > 1)
        i = drafted.index(chosen)
        for t in drafted[max(i - 1, 0) : i] + drafted[i + 1 : i + 2]:
            if self.timed(t) < EXPLORE_SAMPLES:
                return t
        return chosen

    def current(self) -> dict[int, float]:
        refined = {t: float(np.median([p] * PRIOR_SAMPLES + list(self.samples[t]))) for t, p in self.prior.items()}
        ratios = [refined[t] / self.prior[t] for t in self.prior if self.samples[t]]
        scale = float(np.median(ratios)) if ratios else 1.0
        return {t: refined[t] if self.samples[t] else p * scale for t, p in self.prior.items()}

    def ran(self) -> list[int]:
        """The lengths this run timed (their cache entries are fresh again)."""
        return [t for t in self.prior if self.samples[t]]

    def measured(self) -> tuple[dict[int, float], dict[int, int]]:
        """What the cache keeps for the next run: each length's refined cost where this run timed it, else
        its prior unscaled (a guess is not written back as a measurement), and the segments behind each."""
        refined = self.current()
        costs = {t: refined[t] if self.samples[t] else p for t, p in self.prior.items()}
        return costs, {t: self.timed(t) for t in self.prior}
