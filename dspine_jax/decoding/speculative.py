"""Speculative decoding for a batch of prompts: prefill, then segments of rounds through the ``Decoder``.

``speculative_generate`` plans the request (``planning.plan_request``: buckets, capacity, budgets), runs
the prefill, and drives ``decoder.run_segment`` from the host: one segment for a fixed verify length (the
whole loop on the device), or for ``verify="auto"`` segments at the length the policy chose at the end of the
previous one (``Decoder.plan`` / ``observe``): plain rounds until a probe is due, drafted ones for as long as
the policy, deciding on the device after every round, would choose them again. Every program
is compiled (``CompileTimer``) before anything is timed, so results report compilation apart from prefill and
decode.
The round itself is ``round.speculative_round``; docs/ARCHITECTURE.md §4 walks through it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dspine_jax.decoding import adaptive
from dspine_jax.decoding import round as rnd
from dspine_jax.decoding.decoder import (
    CALIBRATION_ROUNDS,
    Decoder,
    Transcript,
    decode_rounds,
    first_choice,
    run_segment,
)
from dspine_jax.decoding.planning import CompileTimer, GenerationResult, finish_reasons, plan_request, round_up
from dspine_jax.decoding.proposers import Proposer, as_proposer
from dspine_jax.drafters.params import Drafter
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling
from dspine_jax.parallel.distributed import agree, to_host

TOKEN_BUCKET = 32  # the output buffer width is max_new_tokens rounded up (max_new_tokens itself is traced)
STOP_BUCKET = 8  # stop ids are padded with -1 to a multiple of this, so their count does not recompile



def begin_impl(
    cache: Any, proposer_state: Any, first: jax.Array, key: jax.Array, sampling: Sampling, stop_ids: jax.Array,
    max_new_tokens: jax.Array, prior: adaptive.Prior | None = None, *, max_verify: int, out_width: int,
) -> tuple[rnd.DecodeState, Transcript]:
    """The rows' state after prefill and a transcript holding their first token; ``prior``: where their
    acceptance statistics start (``adaptive.Prior``; None: nothing observed)."""
    state = rnd.start(cache, proposer_state, first, key, sampling, stop_ids, max_new_tokens, prior,
                      max_verify=max_verify)  # fmt: skip
    return state, Transcript.empty(first.shape[0], out_width + max_verify, out_width, first, stop_ids)


prefill = jax.jit(rnd.prefill, static_argnames=("capacity", "top_k", "greedy"))
begin = jax.jit(begin_impl, static_argnames=("max_verify", "out_width"), donate_argnames=("cache", "proposer_state"))


@dataclasses.dataclass
class SpeculativeResult(GenerationResult):
    # Per row, one entry per verify step: tokens it added to the output, the bonus included (the last
    # step's count is cut at a stop id / max_new_tokens). The first token comes from prefill, so
    # sum(acceptance_lengths[b]) == len(token_ids[b]) - 1.
    acceptance_lengths: list[list[int]]
    # Per row, per verify step: proposals accepted by verification, before stop / budget cuts (tune.py).
    accepted_proposals: list[list[int]]
    verify_length: int  # the longest verify (anchor + proposals) a step could use: the fixed T, or auto's largest
    num_iterations: int  # rounds of the device loop (= verify steps of the longest-running row)
    # Per row, per verify step: the verify length it ran at (1 = a plain decode step, nothing drafted).
    verify_lengths: list[list[int]] = dataclasses.field(default_factory=list)
    # Measuring the verify cost model (``verify="auto"``, once per device/model/drafter/batch bucket, then
    # cached on disk); like compilation, not part of ``seconds``.
    calibration_seconds: float = 0.0

    @property
    def mean_acceptance(self) -> float:
        """τ: output tokens per verify step over all rows and steps (bonus included)."""
        steps = sum(len(row) for row in self.acceptance_lengths)
        return sum(map(sum, self.acceptance_lengths)) / steps if steps else float("nan")


def generate_impl(
    target: tgt.Target, proposer: Proposer, tokens: jax.Array, lengths: jax.Array, key: jax.Array,
    temperature: jax.Array, top_p: jax.Array, stop_ids: jax.Array, max_new_tokens: jax.Array, *, capacity: int,
    out_width: int, verify_len: int, top_k: int, greedy: bool, cut: adaptive.VerifyPolicy | None = None,
) -> Transcript:
    """Prefill + rounds of a fixed verify length to the end, as one pure function (``jax.vmap``-able: the
    statistical tests draw many samples with it). ``capacity`` is the physical cache size (planned +
    ``verify_len``). ``cut``: an adaptive policy whose lengths a confident drafter's rounds may be cut to."""
    key_prefill, key_loop = jax.random.split(key)
    prefilled = rnd.prefill(target, proposer, tokens, lengths, key_prefill, temperature, top_p, capacity=capacity,
                            top_k=top_k, greedy=greedy)  # fmt: skip
    sampling = Sampling.rows(tokens.shape[0], temperature, top_p, top_k)
    state, transcript = begin_impl(*prefilled, key_loop, sampling, stop_ids, max_new_tokens, max_verify=verify_len,
                                   out_width=out_width)  # fmt: skip
    return decode_rounds(target, proposer, state, transcript, stop_ids, verify_len=verify_len, greedy=greedy,
                         track=cut is not None, cut=cut)[1]  # fmt: skip


def speculative_generate(
    target: tgt.Target,
    drafter: Drafter | Proposer,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
    verify: int | str = "auto",
    block_size: int | None = None,
    sps_table: Mapping[str, Any] | str | os.PathLike | None = None,
    verify_costs: Mapping[int, float] | None = None,
    verify_schedule: Sequence[int] | None = None,
) -> SpeculativeResult:
    """Decode up to ``max_new_tokens`` per row speculatively; same conventions as ``generate``.

    ``drafter``: a ``Drafter`` or any ``Proposer``. ``verify``: tokens per verify step (anchor +
    proposals, ≤ the drafter's block), or ``"auto"`` (default): the policy picks each segment's length among
    ``adaptive.candidate_lengths`` (1 = a plain decode step) from the rows' acceptance so far and the device's
    cost per length (``verify_costs {T: seconds}``, else measured once and cached on disk, see ``adaptive``);
    ``verify_schedule`` pins the lengths round by round (cyclic, tests). ``block_size`` is the older name of a
    fixed ``verify``; ``sps_table`` (dict or JSON path from ``python -m dspine_jax.tune``) fixes it by batch
    size. ``stop_ids=None`` uses the model's EOS ids, ``[]`` none. Greedy (temperature 0) output equals
    ``generate``'s whatever the lengths.
    """
    rows, capacity, tokens, lengths, stops = plan_request(
        target, prompt_ids, max_new_tokens, temperature, top_p, top_k, stop_ids
    )
    proposer = as_proposer(drafter)
    decoder = Decoder(target, proposer, verify=verify, block_size=block_size, sps_table=sps_table,
                      verify_costs=verify_costs, verify_schedule=verify_schedule, batch=len(rows))  # fmt: skip
    batch, t_max = len(rows), decoder.max_verify
    stops += [-1] * (round_up(max(len(stops), 1), STOP_BUCKET) - len(stops))
    greedy = temperature == 0
    key_prefill, key_loop = jax.random.split(jax.random.key(seed))
    temp, top_p_arr = jnp.float32(temperature if not greedy else 1.0), jnp.float32(top_p)
    out_width = round_up(max_new_tokens, TOKEN_BUCKET)
    stop_array = jnp.asarray(stops, jnp.int32)
    sampling = Sampling.rows(batch, temp, top_p_arr, jnp.int32(top_k))
    prefill_args = (target, proposer, tokens, lengths, key_prefill, temp, top_p_arr)
    prefill_kwargs = dict(capacity=capacity + t_max, top_k=top_k, greedy=greedy)

    begin_args = (key_loop, sampling, stop_array, jnp.int32(max_new_tokens))
    begin_kwargs = dict(max_verify=t_max, out_width=out_width)

    clock = CompileTimer()  # compilation timed apart from prefill and decode (see generate)
    (cache, pstate, first), prefill_seconds = clock.run(prefill, *prefill_args, **prefill_kwargs)
    (state, transcript), start_seconds = clock.run(begin, cache, pstate, first, *begin_args, decoder.prior(),
                                                   **begin_kwargs)  # fmt: skip
    for t, peek in decoder.programs(greedy):  # one program per length (and the peek), before the clock runs
        clock.compile(run_segment, target, proposer, state, transcript, stop_array, jnp.int32(1), decoder.policy(t),
                      jnp.int32(1), jnp.bool_(False), verify_len=t, greedy=greedy, peek=peek)  # fmt: skip
    if decoder.candidates:  # the program of a run's first choice (``Decoder.plan``)
        choice_args = (decoder.policy(), state.stats, state.running, state.remaining, jnp.int32(0))
        clock.compile(first_choice, *choice_args)
    calibration = 0.0
    if decoder.needs_calibration(batch):
        no_stops = jnp.full_like(stop_array, -1)  # every row runs the measured rounds

        def measure(t: int) -> tuple[float, int]:
            fresh = begin(*prefill(*prefill_args, **prefill_kwargs), *begin_args, **begin_kwargs)
            fresh = jax.block_until_ready(fresh)
            clock_start = time.perf_counter()
            rounds = jnp.int32(CALIBRATION_ROUNDS)  # (all of them: decide_after = rounds)
            _, tr, _ = jax.block_until_ready(run_segment(target, proposer, *fresh, no_stops, rounds, decoder.policy(t),
                                                         rounds, jnp.bool_(False), verify_len=t,
                                                         greedy=greedy))  # fmt: skip
            return time.perf_counter() - clock_start, int(tr.iterations)

        calibration = decoder.calibrate(batch, lambda t: agree(measure(t)))  # process 0's clock for all

    decode_start = time.perf_counter()
    alive, done = bool(jnp.any(state.running)), 0
    while alive:  # host-driven: a segment at the chosen length, then the next choice (one read-back each)
        plan = decoder.plan(batch, batch, state.stats, state.running, state.remaining, greedy=greedy, hold=True)
        segment_begin = time.perf_counter()
        rounds = min(plan.rounds, out_width)
        state, transcript, choice = run_segment(target, proposer, state, transcript, stop_array, jnp.int32(rounds),
                                                plan.policy, jnp.int32(plan.decide_after or rounds),
                                                jnp.bool_(plan.decide_after is not None), verify_len=plan.length,
                                                greedy=greedy, peek=plan.peek)  # fmt: skip
        choice, iterations = jax.device_get((choice, transcript.iterations))
        alive = bool(choice.alive)
        seconds = time.perf_counter() - segment_begin
        if decoder.candidates:  # timings choose lengths: with several processes, all use process 0's
            seconds = agree(seconds)
        decoder.observe(batch, plan, seconds, int(iterations) - done, choice)
        done = int(iterations)
    transcript = jax.block_until_ready(transcript)
    decode_seconds = start_seconds + time.perf_counter() - decode_start
    decoder.store()
    decoder.remember(state.stats)
    got = to_host(transcript)  # rows split over processes are gathered

    n = len(rows)
    return SpeculativeResult(
        token_ids=[got.tokens[i, : got.written[i]].tolist() for i in range(n)],
        finish_reasons=finish_reasons(got.written, got.stopped, max_new_tokens),
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        compile_seconds=clock.seconds,
        acceptance_lengths=[got.kept[i, : got.rounds[i]].tolist() for i in range(n)],
        accepted_proposals=[got.accepted[i, : got.rounds[i]].tolist() for i in range(n)],
        verify_length=t_max,
        num_iterations=int(got.iterations),
        verify_lengths=[got.lengths[i, : got.rounds[i]].tolist() for i in range(n)],
        calibration_seconds=calibration,
    )
