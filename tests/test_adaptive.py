"""Adaptive verification (``decoding/adaptive.py``): the policy's arithmetic by hand, its choices against
an oracle proposer with a chosen acceptance (T = 1 when nothing is accepted, the longest block when
everything is, following a change mid-request), and the cost model measured once and cached on disk.
Exactness whatever the lengths is tested in test_speculative.py (greedy, dense and hybrid) and
test_speculative_sampling.py (lossless sampling with the length changing every round)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax.decoding import adaptive
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.decoder import COST_SAMPLES, DECIDE_EVERY, Calibration, Decoder
from dspine_jax.decoding.proposers import OracleProposer
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import init_drafter
from dspine_jax.models.target import load_target

COSTS = {1: 1.0, 2: 1.15, 4: 1.3, 8: 1.6, 16: 2.2}  # a device where drafting and long verifies cost something
PROMPT = [5, 17, 33, 9, 60, 11]


def test_candidate_lengths_are_capped_by_the_block():
    assert adaptive.candidate_lengths(None) == (1, 2, 4, 8, 16)
    assert adaptive.candidate_lengths(8) == (1, 2, 4, 8)
    assert adaptive.candidate_lengths(6) == (1, 2, 4, 6)  # the block itself when it is not a power of two


def test_expected_tokens_by_hand():
    """Row 0: slot 1 accepted 3 of 4 tries, slot 2 1 of 2, slot 3 untested (prior = slot 2's estimate)."""
    state = adaptive.init_state(2, 4)
    state = state.replace(hits=state.hits.at[0].set(jnp.array([3.0, 1.0, 0.0])),
                          tries=state.tries.at[0].set(jnp.array([4.0, 2.0, 0.0])))  # fmt: skip
    a1 = (3 + 0.5) / (4 + 1)
    a2 = (1 + a1) / (2 + 1)
    a3 = a2  # (0 + a2) / (0 + 1)
    np.testing.assert_allclose(np.asarray(adaptive.acceptance(state))[0], [a1, a2, a3], rtol=1e-6)
    got = np.asarray(adaptive.expected_tokens(state, (1, 2, 4), jnp.array([100, 2])))
    np.testing.assert_allclose(got[0], [1, 1 + a1, 1 + a1 + a1 * a2 + a1 * a2 * a3], rtol=1e-6)
    # Row 1 has seen nothing (0.5 everywhere) and may emit only 2 more tokens: T = 4 counts as T = 2.
    np.testing.assert_allclose(got[1], [1, 1.5, 1.5], rtol=1e-6)


def test_the_prior_fingerprint_reads_the_leading_values_of_each_leaf():
    """``Decoder``'s fingerprint of a drafter's and a target's weights takes each leaf's first values in C order —
    from its leading rows only (raveling a whole embedding op by op copied it)."""
    from dspine_jax.decoding.decoder import _leading

    for shape in [(), (7,), (5000,), (300, 20), (3, 2, 700), (2, 3000, 4)]:
        x = jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape)
        np.testing.assert_array_equal(np.asarray(_leading(x, 4096)), np.asarray(jnp.ravel(x)[:4096]))


def test_update_counts_only_the_slots_verification_reached():
    state = adaptive.init_state(3, 5)
    # T = 5 (4 proposals): row 0 accepted 2 (slots 1-2 hit, slot 3 tried and missed, slot 4 not reached),
    # row 1 accepted all 4, row 2 is not running.
    new = adaptive.update(state, jnp.int32(5), jnp.array([2, 4, 4]), jnp.array([True, True, False]))
    np.testing.assert_array_equal(np.asarray(new.tries), [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(new.hits), [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    # A plain round (T = 1) tests nothing and counts as idle; a drafted round with nothing accepted doubles
    # the wait before the next probe, one with an accepted token resets it.
    idle = adaptive.update(new, jnp.int32(1), jnp.array([0, 0, 0]), jnp.array([True, True, False]))
    np.testing.assert_array_equal(np.asarray(idle.tries), np.asarray(new.tries))
    np.testing.assert_array_equal(np.asarray(idle.idle), [1, 1, 0])
    probe = adaptive.update(idle, jnp.int32(4), jnp.array([0, 1, 0]), jnp.array([True, True, False]))
    np.testing.assert_array_equal(np.asarray(probe.idle), [0, 0, 0])
    np.testing.assert_array_equal(np.asarray(probe.wait), [2 * adaptive.FIRST_WAIT, adaptive.FIRST_WAIT, adaptive.FIRST_WAIT])


def test_choose_probes_after_the_wait_and_pins_override():
    policy = adaptive.make_policy((1, 2, 4, 8), {1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0})  # drafting never pays here
    state = adaptive.init_state(1, 8)
    running, remaining = jnp.array([True]), jnp.array([50])
    index, probe = adaptive.choose(policy, state, running, remaining, jnp.int32(0))
    assert (int(index), bool(probe)) == (0, False)  # T = 1
    due = state.replace(idle=jnp.array([adaptive.FIRST_WAIT]))
    index, probe = adaptive.choose(policy, due, running, remaining, jnp.int32(0))
    assert (policy.lengths[int(index)], bool(probe)) == (adaptive.PROBE_LENGTH, True)
    pinned = adaptive.make_policy((1, 2, 4, 8), COSTS, schedule=[8, 2])
    chosen = [adaptive.choose(pinned, due, running, remaining, jnp.int32(r)) for r in range(4)]
    assert [(pinned.lengths[int(i)], bool(p)) for i, p in chosen] == [(8, False), (2, False)] * 2
    with pytest.raises(ValueError, match="not a candidate"):
        adaptive.make_policy((1, 2, 4), COSTS, schedule=[3])
    with pytest.raises(ValueError, match="missing"):
        adaptive.make_policy((1, 2, 32), COSTS)
    with pytest.raises(ValueError, match="positive"):
        adaptive.make_policy((1, 2), {1: 1.0, 2: 0.0})


def test_a_held_length_gives_way_only_to_a_clearly_better_one():
    """Holding a drafted length (``current``), the policy moves to another drafted length only when it expects
    ``SWITCH_MARGIN`` more tokens per second from it (a row at the boundary of two lengths does not switch program
    every round); it stops drafting as soon as a plain round pays best."""
    state = adaptive.init_state(1, 4)
    state = state.replace(hits=jnp.array([[6.0, 5.0, 4.0]]), tries=jnp.array([[8.0, 6.0, 5.0]]))
    running, remaining = jnp.array([True]), jnp.array([50])
    e = np.asarray(adaptive.expected_tokens(state, (1, 2, 4), remaining))[0]  # [1, E(2), E(4)]
    margin = adaptive.SWITCH_MARGIN
    assert margin > 0

    def chosen(four_faster_by: float, current: int | None, plain: float = 0.5) -> int:
        costs = {1: e[0] / plain, 2: 1.0, 4: e[2] / (e[1] * four_faster_by)}  # value(4) = value(2) × four_faster_by
        policy = adaptive.make_policy((1, 2, 4), costs)
        return policy.lengths[int(adaptive.choose(policy, state, running, remaining, jnp.int32(0), current)[0])]

    assert chosen(1 + margin / 2, None) == 4  # deciding afresh: the best length
    assert chosen(1 + margin / 2, 1) == 2  # holding 2: 4 is not enough better
    assert chosen(1 + 2 * margin, 1) == 4
    assert chosen(1 - margin / 2, 2) == 4  # holding 4 against a slightly better 2
    # A plain round that pays best ends drafting whatever the margin (value(1) = value(2) × 1.01 here).
    assert chosen(1.0, 1, plain=1.01 * e[1]) == 1


def test_carried_prior_pools_the_rows_that_drafted():
    state = adaptive.PolicyState(
        hits=jnp.zeros((3, 3)), tries=jnp.array([[0.5] * 3, [0.5] * 3, [0.0] * 3]),  # (decayed: not passed on)
        idle=jnp.zeros((3,), jnp.int32), wait=jnp.array([8, 32, 4], jnp.int32),
        total_hits=jnp.array([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        total_tries=jnp.array([[4.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        lifetime_hits=jnp.array([9.0, 3.0, 0.0]), lifetime_tries=jnp.array([12.0, 20.0, 0.0]),
    )
    prior = adaptive.carried(state, jnp.array([True, True, True]))  # row 2: from nothing, never drafted: adds nothing
    scale = adaptive.CARRY_WEIGHT / 6.0  # the first slot's pooled tries (4 + 2) scaled to CARRY_WEIGHT
    np.testing.assert_allclose(np.asarray(prior.hits), np.array([3.0, 1.0, 0.0]) * scale, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(prior.tries), np.array([6.0, 3.0, 0.0]) * scale, rtol=1e-6)
    assert int(prior.wait) == 8  # the shortest wait of the rows that drafted, not row 2's fresh 4
    # The first slot's counts over the drafter's requests: the most informed row's (20 tries); it paid, so no idle.
    assert (float(prior.lifetime_hits), float(prior.lifetime_tries), int(prior.idle)) == (3.0, 20.0, 0)
    only_row_1 = adaptive.carried(state, jnp.array([False, True, False]))
    assert int(only_row_1.wait) == 32  # (wait_cap bounds it where probes are cheap)
    np.testing.assert_allclose(np.asarray(only_row_1.tries), [2.0, 1.0, 0.0])  # already within the weight
    nothing = adaptive.carried(state, jnp.array([False, False, True]))
    assert float(jnp.sum(nothing.tries)) == 0.0 and int(nothing.wait) == adaptive.FIRST_WAIT
    # New rows start from the prior: their first slot's estimate is the pooled one, pulled to the coin flip.
    rows = adaptive.init_state(2, 4, prior)
    assert rows.hits.shape == (2, 3) and list(np.asarray(rows.wait)) == [8, 8]
    expected = (3.0 * scale + adaptive.PRIOR_WEIGHT * adaptive.PRIOR_ACCEPT) / (adaptive.CARRY_WEIGHT + adaptive.PRIOR_WEIGHT)
    np.testing.assert_allclose(np.asarray(adaptive.acceptance(rows))[:, 0], [expected] * 2, rtol=1e-6)


def test_a_request_passes_on_its_whole_acceptance_not_its_last_rounds():
    """A drafted stretch ends when the recent rounds miss: the final, decayed estimates of a request that was right
    on 10 of its 14 probed slots but missed the last 4 say "do not draft"; what it passes on is the 10 in 14."""
    running = jnp.array([True])
    state = adaptive.init_state(1, 2)
    for accepted in [1] * 10 + [0] * 4:
        state = adaptive.update(state, jnp.int32(2), jnp.array([accepted]), running)
    assert float(adaptive.acceptance(state)[0, 0]) < 0.45  # the last rounds dominate the decayed estimate
    prior = adaptive.carried(state, running)
    assert float(prior.tries[0]) == pytest.approx(adaptive.CARRY_WEIGHT)
    assert float(prior.hits[0] / prior.tries[0]) == pytest.approx(10 / 14)
    fresh = adaptive.init_state(1, 2, prior)  # the next request starts from it, its totals from nothing
    assert float(jnp.sum(fresh.total_tries)) == 0.0 and float(adaptive.acceptance(fresh)[0, 0]) > 0.6


def test_a_request_that_never_drafted_passes_on_the_prior_it_started_from():
    """A short request that ran only plain rounds (its probe not yet due) learned nothing about its drafter: the next
    request starts where it started, not from the coin flip (which would draft on a guess and reset the wait)."""
    running = jnp.array([True])
    state = adaptive.init_state(1, 4)
    for accepted in [0, 0, 1, 0, 0, 0]:
        state = adaptive.update(state, jnp.int32(4), jnp.array([accepted]), running)
    prior = jax.device_get(adaptive.carried(state, running))
    rows = adaptive.init_state(1, 4, prior)
    for _ in range(5):  # plain rounds only
        rows = adaptive.update(rows, jnp.int32(1), jnp.array([0]), running)
    again = jax.device_get(adaptive.carried(rows, running))
    for a, b in zip(jax.tree.leaves(prior), jax.tree.leaves(again)):
        np.testing.assert_allclose(a, b)
    assert float(again.tries[0]) > 0 and (float(again.lifetime_hits), float(again.lifetime_tries)) == (1.0, 6.0)


def test_a_drafter_that_never_paid_is_probed_rarely_across_requests():
    """The first slot's hits and tries are counted over a drafter's requests (carried). Once it was tried
    ``NEVER_PAID_TRIES`` times and accepted in fewer than ``NEVER_PAID_RATE`` of them, the probe wait may double past
    ``wait_cap`` and ``MAX_WAIT`` up to ``NEVER_PAID_WAIT``, and the rounds since the last probe carry into the next
    request, so that the rare probes are spaced over requests. Hits at a rate a drafted round could pay for end it:
    the wait is back at ``FIRST_WAIT`` and ``wait_cap`` bounds it again."""
    policy = adaptive.make_policy((1, 2, 4), {1: 1.0, 2: 1.15, 4: 1.3})
    cap = int(adaptive.wait_cap(policy))
    running = jnp.array([True])
    prior, gaps, since = None, [], None
    for _ in range(12):  # requests of 96 plain rounds, a probe (one-token draft, missed) whenever due
        state = adaptive.init_state(1, 4, prior)
        for _ in range(96):
            due = int(state.idle[0]) >= int(adaptive.waits(policy, state)[0])
            if due and since is not None:
                gaps.append(since)
            since = 0 if due else None if since is None else since + 1
            state = adaptive.update(state, jnp.int32(2 if due else 1), jnp.array([0]), running)
        prior = jax.device_get(adaptive.carried(state, running))
    probes = len(gaps) + 1
    assert bool(adaptive.never_paid(state)[0]) and float(prior.lifetime_tries) == probes
    assert int(prior.wait) == adaptive.NEVER_PAID_WAIT and int(prior.idle) > 0
    assert max(gaps) == adaptive.NEVER_PAID_WAIT and probes < 12 * 96 // cap  # at wait_cap: one every `cap` rounds
    # The gaps spanned requests: the last ones are NEVER_PAID_WAIT apart although each request is 96 rounds.
    assert gaps[-2:] == [adaptive.NEVER_PAID_WAIT] * 2
    # A drafter that now pays (every round accepted): a hit resets the wait, and hits at a paying rate end the rule.
    for _ in range(3):
        state = adaptive.update(state, jnp.int32(2), jnp.array([1]), running)
    assert int(state.wait[0]) == adaptive.FIRST_WAIT and not bool(adaptive.never_paid(state)[0])
    state = state.replace(wait=jnp.array([adaptive.NEVER_PAID_WAIT], jnp.int32))
    assert int(adaptive.waits(policy, state)[0]) == cap
    # Counts over requests fade: at most LIFETIME_TRIES tries are remembered.
    for _ in range(100):
        state = adaptive.update(state, jnp.int32(2), jnp.array([1]), running)
    assert float(state.lifetime_tries[0]) == pytest.approx(adaptive.LIFETIME_TRIES)


def test_cost_estimate_refines_the_prior_with_decoded_rounds():
    estimate = adaptive.CostEstimate({1: 1.0, 2: 1.5, 4: 2.0})
    assert estimate.current() == {1: 1.0, 2: 1.5, 4: 2.0}
    estimate.observe(1, seconds=40.0, rounds=4)  # a program's first run (one-time costs): not counted
    assert estimate.current() == {1: 1.0, 2: 1.5, 4: 2.0}
    for _ in range(adaptive.PRIOR_SAMPLES + 1):
        estimate.observe(1, seconds=8.0, rounds=4)  # plain rounds ran at 2 s: twice the measured cost
    got = estimate.current()
    assert got[1] == pytest.approx(2.0)  # the samples outnumber the prior's copies: their median
    # Lengths that did not run follow the ratio seen on those that did (2×), keeping their relative costs.
    assert got[2] == pytest.approx(3.0) and got[4] == pytest.approx(4.0)
    estimate.observe(1, seconds=400.0, rounds=4)  # one very slow segment does not move a median
    assert estimate.current()[1] == pytest.approx(2.0)
    estimate.observe(4, 1.0, 1)  # first run of T = 4: dropped
    estimate.observe(4, 1.0, 1)  # T = 4 turned out cheaper than measured: 1 s vs the prior's 2 s
    got = estimate.current()
    assert got[4] == pytest.approx(2.0)  # median of [2, 2, 2, 1]
    assert got[2] == pytest.approx(1.5 * float(np.median([2.0, 1.0])))
    estimate.observe(8, 1.0, 1)  # not a candidate: ignored
    assert set(estimate.current()) == {1, 2, 4}


def test_cost_estimate_explores_the_neighbours_of_the_choice():
    # T = 2 measured too cheap: the policy would stay at 2, so 4 (the next longer) gets segments until
    # EXPLORE_SAMPLES have timed it; T = 1 is never explored, and 8 only as a neighbour of 4.
    estimate = adaptive.CostEstimate({1: 1.0, 2: 1.0, 4: 1.5, 8: 2.0}, segments={2: 5})
    assert estimate.explore(1) == 1
    assert estimate.explore(2) == 4
    for _ in range(adaptive.EXPLORE_SAMPLES + 1):  # (the first segment of a length is not counted)
        estimate.observe(4, 1.2, 1)
    assert estimate.timed(4) == adaptive.EXPLORE_SAMPLES and estimate.explore(2) == 2
    assert estimate.explore(4) == 8  # 2 was timed enough; 8 has not been
    # What the cache keeps: refined costs where this run timed, unscaled priors elsewhere, the counts.
    costs, segments = estimate.measured()
    # (EXPLORE_SAMPLES > PRIOR_SAMPLES: the explored samples outvote the prior's copies in the median)
    assert costs[8] == 2.0 and costs[4] == pytest.approx(1.2) and costs[1] == 1.0
    assert segments == {1: 0, 2: 5, 4: adaptive.EXPLORE_SAMPLES, 8: 0}
    assert estimate.current()[8] == pytest.approx(2.0 * 1.2 / 1.5)  # (the policy's guess is scaled)


def test_calibration_keeps_the_fastest_repeat():
    """A busy moment during two of the three timed segments of one length (the first is not counted) must not
    price that length dear: the calibration keeps each length's fastest segment (a median would keep 10×); the
    lengths interleave, and the costs exist only once every length has its samples. One rule, whether the
    segments are run ahead (``speculative_generate``) or are the engine's first steps."""
    per_round = {1: 1.0, 2: 1.5, 4: 1.7}
    calibration = Calibration(per_round)
    order = []
    while calibration.costs() is None:
        t = calibration.next_length()
        order.append(t)
        busy = t == 2 and order.count(2) in (2, 3)  # the first two counted segments of T = 2
        calibration.record(t, 8 * per_round[t] * (10.0 if busy else 1.0), 8)
    costs, segments = calibration.costs()
    assert costs == pytest.approx(per_round) and segments == dict.fromkeys(per_round, COST_SAMPLES)
    assert order[:6] == [1, 2, 4, 1, 2, 4] and len(order) == 3 * (COST_SAMPLES + 1)


def test_cost_cache_round_trip_with_segments(costs_file):
    adaptive.store_costs("k", {1: 1.0, 2: 1.5}, {1: 4, 2: 7})
    assert adaptive.load_cost_entry("k") == ({1: 1.0, 2: 1.5}, {1: 4, 2: 7})
    assert adaptive.load_costs("k") == {1: 1.0, 2: 1.5}
    table = json.loads(costs_file.read_text())
    calibrated = table["k"]["measured_at"]
    adaptive.store_costs("k", {1: 1.1, 2: 1.4}, {1: 5, 2: 8})  # a refinement keeps the calibration's time
    assert json.loads(costs_file.read_text())["k"]["measured_at"] == calibrated
    # A day-old calibration, or one written before entries were dated, is measured again.
    assert adaptive.load_cost_entry("k", now=calibrated + adaptive.COSTS_MAX_AGE - 1) is not None
    assert adaptive.load_cost_entry("k", now=calibrated + adaptive.COSTS_MAX_AGE + 1) is None
    # A length last timed more than REFRESH_AGE ago counts no segments (it is explored again); one timed since
    # keeps its count.
    adaptive.store_costs("k", {1: 1.1, 2: 1.4}, {1: 6, 2: 8}, timed=[1])
    stamps = json.loads(costs_file.read_text())["k"]["timed_at"]
    later = stamps["2"] + adaptive.REFRESH_AGE + 1
    stamps["1"] = later - 1  # T = 1 timed a second before `later`
    table = json.loads(costs_file.read_text())
    table["k"]["timed_at"] = stamps
    costs_file.write_text(json.dumps(table))
    assert adaptive.load_cost_entry("k", now=later) == ({1: 1.1, 2: 1.4}, {1: 6, 2: 0})
    costs_file.write_text(json.dumps({"old": {"1": 1.0, "4": 2.0}}))  # undated
    assert adaptive.load_cost_entry("old") is None
    assert adaptive.load_cost_entry("missing") is None


@pytest.fixture(scope="module")
def llama(tiny_models):
    target = load_target(tiny_models["llama"][0])
    reference = generate(target, [PROMPT], 120, stop_ids=[]).token_ids[0]
    return target, reference


def oracle(target, reference: list[int], accept: list[int]) -> OracleProposer:
    """An oracle that proposes ``accept[r]`` tokens of ``reference`` in round r (cyclic), then a wrong one."""
    ref = np.zeros((1, 160), np.int32)
    ref[0, : len(reference)] = reference
    return OracleProposer(reference=jnp.asarray(ref), accept=jnp.asarray([accept], jnp.int32),
                          vocab_size=target.config.vocab_size)  # fmt: skip


def run_oracle(target, reference, accept: list[int], max_new: int = 120, costs=COSTS):
    """Greedy decoding with an oracle that proposes ``accept[r]`` correct tokens in round r, then a wrong one."""
    proposer = oracle(target, reference, accept)
    result = speculative_generate(target, proposer, [PROMPT], max_new, stop_ids=[], verify_costs=costs)
    assert result.token_ids[0] == reference[:max_new]  # whatever the lengths, greedy output is the target's
    return result.verify_lengths[0]


def test_policy_tracks_the_acceptance(llama):
    target, reference = llama
    # Nothing is ever accepted: after a few rounds only probes draft, and they thin out (waits double).
    lengths = run_oracle(target, reference, [0] * 64)
    tail = lengths[16:]
    assert sum(t > 1 for t in tail) <= 3 and sum(t == 1 for t in tail) >= len(tail) - 3
    # Everything is accepted: the longest block (16) from the second round on (the first drafts on the prior, a
    # probe), except where the budget ends.
    lengths = run_oracle(target, reference, [99] * 64)
    assert all(t == 16 for t in lengths[1:-1]), lengths
    # Acceptance collapses after 5 rounds: the policy steps down to plain decoding within ~12 rounds (the
    # estimates follow the last ~5 drafted rounds).
    lengths = run_oracle(target, reference, [99] * 5 + [0] * 59)
    assert lengths[1] == 16 and sum(t == 1 for t in lengths[5 + 12 : 5 + 28]) >= 12, lengths
    # Acceptance appears after 12 rounds: a probe finds it and the policy climbs back to 16.
    lengths = run_oracle(target, reference, [0] * 12 + [99] * 52)
    assert all(t == 1 for t in lengths[5:9]), lengths
    climbed = [r for r in range(12, len(lengths) - 3) if lengths[r : r + 3] == [16, 16, 16]]
    assert climbed and climbed[0] <= 12 + adaptive.FIRST_WAIT * 8, lengths


def segments_of(monkeypatch, run) -> list[tuple[int, bool, int]]:
    """``(verify length, peek, rounds)`` of every segment ``speculative_generate`` launches while ``run()`` runs."""
    from dspine_jax.decoding import speculative

    launched, segment = [], speculative.run_segment

    class Counting:  # run_segment, recording each launch (``lower`` for the compile ahead)
        lower = staticmethod(segment.lower)

        def __call__(self, *args, verify_len: int, greedy: bool, peek: bool = False):
            before = int(args[3].iterations)
            out = segment(*args, verify_len=verify_len, greedy=greedy, peek=peek)
            launched.append((verify_len, peek, int(out[1].iterations) - before))
            return out

    monkeypatch.setattr(speculative, "run_segment", Counting())
    run()
    return launched


def test_a_choice_that_holds_and_a_probe_cost_no_launch_of_their_own(llama, monkeypatch):
    """Drafted rounds the policy keeps choosing stay in one segment (it decides after every round, on the
    device); a peek's segment goes on with the plain rounds up to the next probe."""
    target, reference = llama
    always = segments_of(monkeypatch, lambda: run_oracle(target, reference, [99] * 64))
    # The first round drafts on the prior (a probe), the next decision picks 16 and holds for the 7 rounds that fit
    # the budget (119 tokens); the round after it verifies what is left.
    assert len(always) == 3 and always[1] == (16, False, 7) and always[2][2] == 1, always
    # Never right, probes dear enough to wait up to MAX_WAIT: the first segment waits FIRST_WAIT plain rounds, then
    # each probe is a peek followed, in its segment, by the doubled wait of plain rounds (the last cut by the budget).
    dear = {1: 1.0, 2: 1.9, 4: 2.2, 8: 2.6, 16: 3.5}
    never = segments_of(monkeypatch, lambda: run_oracle(target, reference, [0] * 80, max_new=80, costs=dear))
    waits = [adaptive.FIRST_WAIT * 2**k for k in range(1, 4)]  # 8, 16, 32; then 64, cut by the budget (79 rounds)
    last = 79 - adaptive.FIRST_WAIT - sum(1 + w for w in waits)
    assert never == [(1, False, adaptive.FIRST_WAIT)] + [(1, True, 1 + w) for w in waits] + [(1, True, last)], never


def test_a_held_choice_that_turns_bad_ends_after_one_round(llama, monkeypatch):
    """A drafted segment ends as soon as the policy, after any of its rounds, would choose otherwise
    (``DECIDE_AFTER``): a long block chosen on one full round that then accepts nothing costs one round, not
    ``DECIDE_EVERY`` of them."""
    target, reference = llama
    segments = segments_of(monkeypatch, lambda: run_oracle(target, reference, [99] + [0] * 63))
    # The first round drafts on the prior (a probe) and accepts all; the next choice is the longest block, which
    # accepts nothing: the policy steps down after that round, one segment per length, then decodes plainly.
    assert segments[0] == (4, False, 1) and segments[1] == (16, False, 1), segments
    lengths = [t for t, _, _ in segments]
    stepping = lengths[1 : lengths.index(1)]  # the drafted segments before the first plain one
    assert stepping == sorted(stepping, reverse=True) and len(stepping) >= 2, segments


def test_the_margin_reaches_the_device_loop(llama, monkeypatch):
    """``segment`` passes the held length to the policy, after each round and at the segment's end: with a margin no
    drafted length can beat, a long block that stops paying is held until plain rounds pay best — no stepping down
    through shorter blocks, as ``test_a_held_choice_that_turns_bad_ends_after_one_round`` does at the shipped margin."""
    target, reference = llama
    monkeypatch.setattr(adaptive, "SWITCH_MARGIN", 1e9)
    jax.clear_caches()  # (the margin is read when a program is traced)
    try:
        segments = segments_of(monkeypatch, lambda: run_oracle(target, reference, [99] + [0] * 63))
    finally:
        jax.clear_caches()
    assert segments[0] == (4, False, 1) and segments[1][0] == 16 and segments[1][2] > 1, segments
    assert segments[2][0] == 1, segments  # held at 16, then plain


def test_greedy_probes_peek_instead_of_verifying_two_tokens(llama):
    """Where drafting looks too dear on the prior alone (rounds start plain), the first probe is a peek: a plain
    round whose one-token draft is compared with the emitted token. An oracle that is always right is found
    by it, and the policy drafts long blocks from the next decision on; no probe verifies 2 tokens."""
    target, reference = llama
    dear = {1: 1.0, 2: 1.9, 4: 2.2, 8: 2.6, 16: 3.5}  # at the prior (a coin flip per slot) T = 1 pays best
    lengths = run_oracle(target, reference, [99] * 64, costs=dear)
    first = next(r for r, t in enumerate(lengths) if t > 1)
    assert lengths[:first] == [1] * first and first == adaptive.FIRST_WAIT + 1, lengths
    # (The last round may verify 2: two tokens were left, and the policy decides after every drafted round.)
    assert 2 not in lengths[:-1] and lengths[first] >= 8, lengths
    # Nothing accepted: the peeks find nothing and thin out; every round is plain.
    assert set(run_oracle(target, reference, [0] * 64, costs=dear)) == {1}


def test_costs_are_measured_once_and_cached(llama, costs_file):
    target, reference = llama
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=4, seed=3)
    first = speculative_generate(target, drafter, [PROMPT], 24, stop_ids=[])
    assert first.calibration_seconds > 0 and first.token_ids[0] == reference[:24]
    table = json.loads(costs_file.read_text())
    (key, costs), = table.items()
    seconds = {t: v for t, v in costs.items() if t.isdigit()}
    assert key.endswith("|b1|T1,2,4") and set(seconds) == {"1", "2", "4"} and all(v > 0 for v in seconds.values())
    # The segments behind each cost: the lengths this run timed (the calibration itself counts none).
    assert set(costs["segments"]) == {"1", "2", "4"} and sum(costs["segments"].values()) >= 1
    second = speculative_generate(target, drafter, [PROMPT, PROMPT[:3]], 24, stop_ids=[])
    assert second.calibration_seconds > 0  # batch 2: another bucket
    # What the third run refines must not hang on this machine's timing (it failed once in CI: a calibration under
    # load left the third run without one whole timed segment). Costs where drafting never pays make it a run of
    # plain segments, the first one whole.
    adaptive.store_costs(key, {1: 1.0, 2: 1.9, 4: 2.2}, {1: 4, 2: 3, 4: 3})
    costs = json.loads(costs_file.read_text())[key]
    third = speculative_generate(target, drafter, [PROMPT[::-1]], 110, stop_ids=[])
    assert third.calibration_seconds == 0.0  # batch 1 again: read from disk
    table = json.loads(costs_file.read_text())
    assert len(table) == 2
    # Decoding refined the cached costs with the rounds it timed: more segments behind T = 1, timed just now.
    assert table[key]["segments"]["1"] > costs["segments"]["1"], (table[key], costs)
    assert table[key]["timed_at"]["1"] > costs["timed_at"]["1"] and table[key]["segments"]["4"] == 3


def test_a_prior_that_makes_one_length_look_cheap_is_explored_away(llama, costs_file):
    # A cached prior says T = 2 costs a tenth of the rest: without exploration every round would verify 2
    # (nothing else would ever be timed). The next longer length gets its segments, and the cache records them;
    # then the policy returns to T = 2 (its prior scaled like the timed lengths: still the cheapest).
    target, reference = llama
    proposer = oracle(target, reference, [99] * 64)
    lengths = adaptive.candidate_lengths(None)
    key = adaptive.costs_key(target, "OracleProposer", 1, lengths)
    adaptive.store_costs(key, {1: 0.01, 2: 0.001, 4: 0.02, 8: 0.02, 16: 0.02})
    result = speculative_generate(target, proposer, [PROMPT], 100, stop_ids=[])
    assert result.token_ids[0] == reference[:100] and result.calibration_seconds == 0.0
    ran = result.verify_lengths[0]
    assert ran.count(4) >= (adaptive.EXPLORE_SAMPLES + 1) * DECIDE_EVERY, ran
    _, segments = adaptive.load_cost_entry(key)
    assert segments[4] >= adaptive.EXPLORE_SAMPLES and ran[-1] == 2, ran


def test_a_run_starts_from_what_the_last_run_of_its_drafter_measured(llama):
    """``speculative_generate`` carries the rows' acceptance to the next run of the same target and drafter: a
    drafter that was never right starts the next run with plain rounds (not a drafted round on the coin flip),
    one that was always right starts it at the longest block (not a probe at a middle length)."""
    target, reference = llama
    costs = {1: 1.0, 2: 1.3, 4: 1.5, 8: 1.9, 16: 2.6}  # on the coin flip a 4-token round pays, barely
    never = [run_oracle(target, reference, [0] * 64, costs=costs) for _ in range(2)]
    assert never[0][0] > 1, never[0]  # the first run drafts on the prior
    assert never[1][: adaptive.FIRST_WAIT] == [1] * adaptive.FIRST_WAIT, never[1]  # the next one does not
    assert sum(t > 1 for t in never[1]) < sum(t > 1 for t in never[0])
    always = [run_oracle(target, reference, [99] * 64, costs=costs) for _ in range(2)]
    assert always[0][0] < 16 and always[1][0] == 16, (always[0][:8], always[1][:8])
    # Another drafter (here: the same oracle class with other weights) does not inherit it.
    assert run_oracle(target, reference, [98] * 64, costs=costs)[0] == always[0][0]


def test_a_runs_first_segment_waits_as_long_as_its_prior_says(llama):
    """The host's first choice of a run is the device's rule (``decoder.choose``): rows that start from a prior
    whose wait is 16 run 16 plain rounds in their first segment before a probe, not a decision's 4."""
    target, _ = llama
    proposer = oracle(target, [], [0] * 64)
    dear = {1: 1.0, 2: 1.9, 4: 2.2, 8: 2.6, 16: 3.5}  # a probe this dear may wait up to MAX_WAIT
    decoder = Decoder(target, proposer, verify_costs=dear)
    never = adaptive.Prior(jnp.zeros((15,)), jnp.full((15,), 2.0), jnp.int32(16), jnp.float32(0.0), jnp.float32(2.0),
                           jnp.int32(0))  # two misses per slot
    stats = adaptive.init_state(1, 16, never)
    plan = decoder.plan(1, 1, stats, jnp.array([True]), jnp.array([100]), greedy=True)
    assert (plan.length, plan.rounds, plan.peek) == (1, 16, False), plan
    fresh = Decoder(target, proposer, verify_costs=dear)  # nothing observed: the coin flip, FIRST_WAIT rounds
    plan = fresh.plan(1, 1, adaptive.init_state(1, 16), jnp.array([True]), jnp.array([100]), greedy=True)
    assert (plan.length, plan.rounds) == (1, adaptive.FIRST_WAIT), plan


def test_the_probe_wait_is_capped_by_what_a_probe_costs():
    """Spread over the plain rounds before it, a probe's extra cost (at most a round of PROBE_LENGTH over a plain
    one, and the launch of the segment it makes: PROBE_LAUNCHES) stays within PROBE_BUDGET: cheap probes come
    every few tens of rounds whatever the doubled wait says, dear ones as rarely as MAX_WAIT."""
    cheap = adaptive.make_policy((1, 2, 4), {1: 1.0, 2: 1.15, 4: 1.3})
    cap = math.ceil((0.15 + adaptive.PROBE_LAUNCHES) / adaptive.PROBE_BUDGET - 1e-9)
    assert adaptive.FIRST_WAIT < cap < adaptive.MAX_WAIT and int(adaptive.wait_cap(cheap)) == cap  # 17
    assert int(adaptive.wait_cap(adaptive.make_policy((1, 2, 4), {1: 1.0, 2: 3.0, 4: 3.5}))) == adaptive.MAX_WAIT
    free = adaptive.make_policy((1, 2), {1: 1.0, 2: 1.0})  # a probe's round as cheap as a plain one: its launches
    assert int(adaptive.wait_cap(free)) == math.ceil(adaptive.PROBE_LAUNCHES / adaptive.PROBE_BUDGET - 1e-9)
    assert int(adaptive.wait_cap(adaptive.make_policy((1, 2), {1: 1.0, 2: 0.5}))) == adaptive.FIRST_WAIT
    state = adaptive.init_state(1, 4).replace(wait=jnp.array([adaptive.MAX_WAIT]), idle=jnp.array([cap]))
    running, remaining = jnp.array([True]), jnp.array([50])
    dear = adaptive.make_policy((1, 2, 4), {1: 1.0, 2: 1.9, 4: 2.2})
    never = state.replace(tries=jnp.full((1, 3), 8.0))  # eight misses per slot: T = 1 pays best
    assert bool(adaptive.choose(cheap, never, running, remaining, 0)[1])  # `cap` rounds waited: a probe is due
    assert not bool(adaptive.choose(cheap, never.replace(idle=jnp.array([cap - 1])), running, remaining, 0)[1])
    assert not bool(adaptive.choose(dear, never, running, remaining, 0)[1])  # a dear probe waits its 64


def test_a_drafter_that_starts_right_late_is_found_within_the_cap(llama):
    """Nothing accepted for 80 rounds (the waits double past the cap), then everything: with probes that cost
    15 % of a plain round the policy finds it within the cap (17 rounds) and a decision, where doubling alone
    would next look ~64 rounds after its previous probe (round ~69, then ~134)."""
    target, _ = llama
    reference = generate(target, [PROMPT], 150, stop_ids=[]).token_ids[0]
    cheap = {1: 1.0, 2: 1.15, 4: 1.3, 8: 1.6, 16: 2.4}
    cap = int(adaptive.wait_cap(adaptive.make_policy(tuple(cheap), cheap)))
    lengths = run_oracle(target, reference, [0] * 80 + [99] * 80, max_new=150, costs=cheap)
    drafted = [r for r in range(80, len(lengths)) if lengths[r] > 1]
    assert cap < adaptive.MAX_WAIT and drafted and drafted[0] <= 80 + cap + 2 * DECIDE_EVERY, (cap, lengths)
