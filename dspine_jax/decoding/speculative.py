"""Speculative decoding: one round (draft → verify → accept → commit → stop) inside one jitted while_loop.

Flow of a round (docs/ARCHITECTURE.md §4), for every row of the batch at once, static shapes throughout:

1. **Draft**: the proposer turns the anchor (last generated token, not yet in the target cache) into
   ``P = T - 1`` proposals (``DraftOutput``: tokens ``[B, P]``, plus the draft distribution over
   candidates for lossless sampling).
2. **Verify**: one target forward over ``[anchor, proposals…]`` (``[B, T]``) at positions
   ``lengths … lengths+T-1``, writing K/V and capturing the proposer's tapped layers.
3. **Accept**: greedy — the longest prefix where proposal == target argmax, plus the target's token at
   the first mismatch (the bonus). T > 0 — lossless speculative sampling: proposal i is kept with
   probability ``min(1, p/q)``; at the first rejection the token is drawn from ``normalise(max(0, p-q))``,
   after a full accept the bonus is drawn from ``p``. ``p`` is ``process_rows`` (temperature, top-k,
   top-p exactly as plain sampling, with every row's own parameters).
4. **Commit**: the row keeps ``n_keep`` block tokens (anchor + accepted proposals, cut at a stop id,
   ``max_new_tokens`` or the capacity): ``target.replay`` (``cache.commit`` for dense targets, GDN
   recurrent-state replay for hybrids) and the proposer appends those tokens' target features.
   The last emitted token becomes the next anchor.
5. **Stop**: rows that hit a stop id, their budget or the capacity stop (mid-block if need be) and keep
   their output while the others continue.

Proposer seam: the round calls ``proposer.propose`` / ``proposer.commit`` (see ``Proposer``), so tests
and benchmarks plug in an ``OracleProposer`` (the target's own continuation with mismatches at chosen
slots) instead of a drafter.

Capacity: the target cache gets ``T`` slack slots past the planned capacity (which is the AR
baseline's), so a verify block never writes past the buffer while row budgets stay exactly those of
``generate`` (at most ``capacity - prompt + 1`` tokens per row; a ``max_new_tokens`` no row can reach
is rejected by ``plan_request``, and the padded prompt is never wider than the planned capacity).
Greedy speculative output therefore equals greedy ``generate`` output token for token, model position
limit included.

Letters as in layers.py: B batch, T verify block (anchor + P proposals), V vocab, C candidates, H width.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.decoding import adaptive
from dspine_jax.decoding.adaptive import VerifyPolicy
from dspine_jax.decoding.planning import CompileTimer, GenerationResult, finish_reasons, plan_request, round_up
from dspine_jax.models.sampling import Sampling, categorical_rows, process_rows, sample, split_rows
from dspine_jax.drafters.drafter import Drafter, DraftOutput, append_context, draft, init_draft_cache, resize_ring
from dspine_jax.drafters.io import check_compatible
from dspine_jax.models import target as tgt

_log = logging.getLogger("dspine_jax")

TOKEN_BUCKET = 32  # the output buffer width is max_new_tokens rounded up (max_new_tokens itself is traced)
STOP_BUCKET = 8  # stop ids are padded with -1 to a multiple of this, so their count does not recompile
DECIDE_EVERY = 4  # verify="auto": rounds per host call between two choices of the verify length


# ----------------------------------------------------------------------------------------------
# Proposers


class Proposer(Protocol):
    """What the round needs from a drafting step. Implementations are pytrees (``flax.struct``) so they
    ride into ``jax.jit`` as arguments; their static fields are part of the compiled program's key.

    ``state`` is the proposer's own per-row cache (a pytree, donated to the loop). Invariant, as for
    the drafter: the anchor sits at position ``target_cache.lengths``; ``commit`` receives the target
    features of exactly the tokens committed to the target cache this round.

    Optional: ``with_capacity(state, capacity)`` (the state for rows of up to ``capacity`` positions) lets
    the serving engine move the state between its capacity buckets.
    """

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose residual stream the proposer wants (``forward(..., taps)``)."""
        ...

    def init(self, target: tgt.Target, batch: int, capacity: int) -> Any: ...

    def prefill(self, target: tgt.Target, state: Any, tapped: Array, lengths: Array) -> Any:
        """After the prompt: ``tapped [n, B, Tp, H]``, ``lengths [B]`` prompt tokens per row."""
        ...

    def propose(
        self, target: tgt.Target, state: Any, anchor: Array, counts: Array, keys: Array, sampling: Sampling, num: int
    ) -> DraftOutput:
        """``anchor [B]``, ``counts [B]`` tokens generated so far (the anchor is the last of them), one key
        per row ``keys [B]`` → ``num`` proposals per row with their draft distribution (ignored for greedy
        rows). ``sampling``: the rows' own parameters, filters included, for proposers that draw from the
        target's transform (greedy rows come without filters)."""
        ...

    def commit(self, target: tgt.Target, state: Any, tapped: Array, num_new: Array) -> Any:
        """The first ``num_new [B]`` block tokens (anchor first) were committed; ``tapped [n, B, T, H]``."""
        ...


@struct.dataclass
class DrafterProposer:
    """A DFlash / DSpine drafter as a proposer (state: its ``DraftCache``)."""

    drafter: Drafter

    @property
    def taps(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids

    def init(self, target: tgt.Target, batch: int, capacity: int):
        # The ring stores its K/V like the target's cache (``--kv-cache-dtype`` sets both).
        return init_draft_cache(self.drafter, batch, capacity, target.kv_cache_dtype)

    def prefill(self, target: tgt.Target, state, tapped: Array, lengths: Array):
        return append_context(self.drafter, state, tapped, lengths)

    def propose(
        self, target: tgt.Target, state, anchor: Array, counts: Array, keys: Array, sampling: Sampling, num: int
    ) -> DraftOutput:
        drafter = self.drafter
        # A causal drafter's first `num` slots do not depend on later ones: draft a shorter block
        # (cheaper). A bidirectional one was trained on its full block: draft it all, verify a prefix.
        if num + 1 < drafter.config.block_size and all(drafter.config.layer_causal):
            drafter = drafter.replace(config=dataclasses.replace(drafter.config, block_size=num + 1))
        out = draft(drafter, target, state, anchor, keys, sampling)
        return DraftOutput(tokens=out.tokens[:, :num], cand_ids=out.cand_ids[:, :num], q=out.q[:, :num])

    def commit(self, target: tgt.Target, state, tapped: Array, num_new: Array):
        return append_context(self.drafter, state, tapped, num_new)

    def with_capacity(self, state, capacity: int):
        """The state for rows of up to ``capacity`` positions (the serving engine resizes; optional)."""
        return resize_ring(self.drafter, state, capacity)


@struct.dataclass
class OracleProposer:
    """Proposes the target's own continuation, wrong on purpose at chosen slots (tests, ceilings).

    ``reference [B, N]``: row b's expected generated tokens (``reference[b, 0]`` is the prefill's token).
    ``accept [B, R]``: in round r row b proposes ``accept[b, r % R]`` correct tokens, then a wrong one
    (values ≥ P mean all P correct). So with greedy decoding a round commits ``accept + 1`` tokens
    (capped at P + 1) for as long as the output follows the reference. State: the round index.
    """

    reference: Array  # [B, N] int32
    accept: Array  # [B, R] int32
    vocab_size: int = struct.field(pytree_node=False)

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    def init(self, target: tgt.Target, batch: int, capacity: int) -> Array:
        return jnp.zeros((), jnp.int32)

    def prefill(self, target: tgt.Target, state: Array, tapped: Array, lengths: Array) -> Array:
        return state

    def propose(
        self, target: tgt.Target, state: Array, anchor: Array, counts: Array, keys: Array, sampling: Sampling, num: int
    ) -> DraftOutput:
        slots = jnp.arange(num)[None, :]  # [1, P]
        index = jnp.clip(counts[:, None] + slots, 0, self.reference.shape[1] - 1)  # [B, P]
        tokens = jnp.take_along_axis(self.reference, index, axis=1)
        good = self.accept[:, state % self.accept.shape[1]]  # [B]
        tokens = jnp.where(slots == good[:, None], (tokens + 1) % self.vocab_size, tokens).astype(jnp.int32)
        ones = jnp.ones((*tokens.shape, 1), jnp.float32)
        return DraftOutput(tokens=tokens, cand_ids=tokens[..., None], q=ones)  # q: one-hot on the proposal

    def commit(self, target: tgt.Target, state: Array, tapped: Array, num_new: Array) -> Array:
        return state + 1


@struct.dataclass
class NoProposer:
    """No drafting: rounds of ``T = 1`` are plain autoregressive decode steps (the engine's
    ``--no-speculative``)."""

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    def init(self, target: tgt.Target, batch: int, capacity: int) -> None:
        return None

    def prefill(self, target: tgt.Target, state: None, tapped: Array, lengths: Array) -> None:
        return state

    def propose(self, *args: Any) -> DraftOutput:
        raise ValueError("NoProposer drafts nothing: run it with verify_len 1")

    def commit(self, target: tgt.Target, state: None, tapped: Array, num_new: Array) -> None:
        return state

    def with_capacity(self, state: None, capacity: int) -> None:
        return state


def as_proposer(drafter: Drafter | Proposer) -> Proposer:
    if isinstance(drafter, Drafter):
        return DrafterProposer(drafter)
    if all(hasattr(drafter, name) for name in ("taps", "init", "prefill", "propose", "commit")):
        return drafter
    raise TypeError(f"expected a Drafter or a Proposer, got {type(drafter).__name__}")


# ----------------------------------------------------------------------------------------------
# Acceptance


def accept_greedy(logits: Array, proposals: Array) -> tuple[Array, Array]:
    """logits ``[B, T, V]`` of the verify block, proposals ``[B, P]`` → emitted ``[B, T]``, accepted ``[B]``.

    Row b's round output is ``emitted[b, :accepted+1]``: the accepted proposals equal the target's argmax
    at their slots, and slot ``accepted`` holds the target's own token (the bonus), so the target's argmax
    over the block is the output.
    """
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
    match = proposals == choice[:, :-1]
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)  # [B] in 0…P
    return choice, accepted


def accept_sampling(keys: Array, logits: Array, proposal: DraftOutput | None, sampling: Sampling) -> tuple[Array, Array]:
    """Lossless speculative sampling with every row's own key (``keys [B]``) and parameters. logits
    ``[B, T, V]``, proposal tokens/cand_ids/q ``[B, P(, C)]`` (None when T = 1: plain sampling) → emitted
    ``[B, T]`` (valid up to ``accepted``), accepted ``[B]``.

    Each kept token (and the final one) is distributed exactly as plain sampling from ``process_rows``
    (the rows must be sampled ones: temperature > 0)."""
    b, t, _ = logits.shape
    p_num = t - 1
    both = split_rows(keys, 2)
    key_accept, key_final = both[:, 0], both[:, 1]
    p = jax.nn.softmax(process_rows(logits, sampling), axis=-1)  # [B, T, V]
    if p_num == 0:
        return categorical_rows(key_final, jnp.log(p[:, 0]))[:, None], jnp.zeros((b,), jnp.int32)
    tokens, cand_ids, q = proposal.tokens, proposal.cand_ids, proposal.q
    p_x = jnp.take_along_axis(p[:, :-1], tokens[..., None], axis=-1)[..., 0]  # [B, P]
    q_x = jnp.sum(jnp.where(cand_ids == tokens[..., None], q, 0.0), axis=-1)  # [B, P]
    # Keep with probability min(1, p/q): u·q < p with u ~ U[0, 1) (never keeps a token with p = 0).
    u = jax.vmap(lambda k: jax.random.uniform(k, (p_num,), jnp.float32))(key_accept)
    ok = u * q_x < p_x
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]

    rows = jnp.arange(b)
    p_stop = p[rows, accepted]  # [B, V]: the target distribution at the first rejected slot (or the bonus)
    slot = jnp.minimum(accepted, p_num - 1)
    q_stop = jnp.zeros_like(p_stop).at[rows[:, None], cand_ids[rows, slot]].add(q[rows, slot])  # [B, V]
    residual = jnp.maximum(p_stop - q_stop, 0.0)
    # After a full accept: the bonus from p. A rejection implies the residual has mass; the guard only
    # catches rounding to an all-zero residual.
    use_p = (accepted == p_num) | (jnp.sum(residual, axis=-1) <= 0.0)
    final = categorical_rows(key_final, jnp.log(jnp.where(use_p[:, None], p_stop, residual)))  # [B]
    emitted = jnp.concatenate([tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(t)[None, :] == accepted[:, None], final[:, None], emitted)
    return emitted, accepted


# ----------------------------------------------------------------------------------------------
# One round: what the batch loop below and the serving engine both run


@struct.dataclass
class RoundState:
    """Everything a round reads and updates, per row: the caches, the anchor (last emitted token, not yet
    in the target cache), whether the row runs, how many tokens it may still emit, its PRNG key."""

    cache: Any  # the target's cache [B, …]
    proposer_state: Any  # the proposer's own per-row state (a drafter's context ring)
    anchor: Array  # [B] int32
    running: Array  # [B] bool
    remaining: Array  # [B] int32, ≥ 1 for running rows
    keys: Array  # [B] typed PRNG keys


@struct.dataclass
class RoundOutput:
    emitted: Array  # [B, T] the round's tokens; row b's first n_keep[b] are its output
    n_keep: Array  # [B] tokens added to the output (0 for rows that do not run)
    accepted: Array  # [B] proposals verification accepted, before stop / budget cuts
    hit_stop: Array  # [B] the kept tokens end on a stop id


def speculative_round(
    target: tgt.Target, proposer: Proposer, state: RoundState, sampling: Sampling, stop_ids: Array, counts: Array,
    *, verify_len: int, all_greedy: bool,
) -> tuple[RoundState, RoundOutput]:
    """One round (module doc) for every row: draft ``T - 1`` proposals (none at ``T = 1``, a plain decode
    step), verify ``[B, T]``, accept (greedy rows: longest argmax prefix + bonus; sampled rows: lossless
    speculative sampling with their own parameters), cut at the first stop id (``stop_ids [K]``, -1 =
    padding) and at each row's remaining budget, commit the kept tokens to both caches.

    ``counts [B]``: tokens each row has emitted (for proposers that index a reference). ``all_greedy``
    (static) compiles out the sampling path; otherwise it runs only when some running row samples."""
    t = verify_len
    b = state.anchor.shape[0]
    split = split_rows(state.keys, 3)
    key_next, key_draft, key_accept = split[:, 0], split[:, 1], split[:, 2]
    greedy = jnp.ones((b,), bool) if all_greedy else sampling.greedy
    # Greedy rows draft greedily and without filters (a filter never removes the argmax).
    draft_sampling = Sampling.rows(b) if all_greedy else Sampling(
        temperature=jnp.where(greedy, 0.0, sampling.temperature), top_p=jnp.where(greedy, 1.0, sampling.top_p),
        top_k=jnp.where(greedy, 0, sampling.top_k),
    )
    slots = jnp.arange(t)[None, :]  # [1, T]

    # 1. draft
    proposal = None
    block = state.anchor[:, None]
    if t > 1:
        proposal = proposer.propose(target, state.proposer_state, state.anchor, counts, key_draft, draft_sampling, t - 1)
        block = jnp.concatenate([block, proposal.tokens.astype(jnp.int32)], axis=1)  # [B, T]
    # 2. verify
    hidden, tapped, cache, saved = tgt.forward(target, state.cache, block, proposer.taps)
    logits = tgt.lm_logits(target, hidden)  # [B, T, V] f32
    # 3. accept
    if t > 1:
        emitted, accepted = accept_greedy(logits, proposal.tokens)
    else:
        emitted, accepted = jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros((b,), jnp.int32)
    if not all_greedy:
        sampled = state.running & ~greedy

        def sample_path(_):
            e, a = accept_sampling(key_accept, logits, proposal, sampling)
            return jnp.where(sampled[:, None], e, emitted), jnp.where(sampled, a, accepted)

        emitted, accepted = jax.lax.cond(jnp.any(sampled), sample_path, lambda _: (emitted, accepted), None)
    # 5. stop (decided before committing, since it shortens the commit): first stop id, budget
    is_stop = jnp.isin(emitted, stop_ids) & (slots <= accepted[:, None])  # [B, T]
    until_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, t)
    n_keep = jnp.minimum(jnp.minimum(accepted + 1, until_stop), state.remaining)
    n_keep = jnp.where(state.running, jnp.maximum(n_keep, 0), 0)  # [B] 0…T
    hit_stop = jnp.any(is_stop & (slots < n_keep[:, None]), axis=1)
    # 4. commit: the anchor and the kept proposals (the last kept token is the next anchor)
    cache = tgt.replay(target, cache, saved, n_keep)
    proposer_state = proposer.commit(target, state.proposer_state, tapped, n_keep)
    last = jnp.take_along_axis(emitted, jnp.maximum(n_keep - 1, 0)[:, None], axis=1)[:, 0]
    remaining = state.remaining - n_keep
    state = RoundState(
        cache=cache, proposer_state=proposer_state, anchor=jnp.where(n_keep > 0, last, state.anchor),
        running=state.running & ~hit_stop & (remaining > 0), remaining=remaining, keys=key_next,
    )
    return state, RoundOutput(emitted=emitted, n_keep=n_keep, accepted=accepted, hit_stop=hit_stop)


# ----------------------------------------------------------------------------------------------
# Prefill and the loop (pure functions; jitted below)


def prefill_impl(
    target: tgt.Target, proposer: Proposer, tokens: Array, lengths: Array, key: Array, temperature: Array,
    top_p: Array, *, capacity: int, top_k: int, greedy: bool,
):
    """Prompts ``tokens [B, Tp]`` (right-padded to ``lengths``) → target cache, proposer state, first token ``[B]``."""
    batch = tokens.shape[0]
    cache = tgt.init_cache(target, batch, capacity)
    state = proposer.init(target, batch, capacity)
    hidden, tapped, cache, saved = tgt.forward(target, cache, tokens, proposer.taps)
    # replay = commit for dense targets; for hybrids it keeps pad tokens out of the GDN state.
    cache = tgt.replay(target, cache, saved, lengths)
    state = proposer.prefill(target, state, tapped, lengths)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
    first = sample(key, tgt.lm_logits(target, last), temperature, top_p, top_k, greedy)
    return cache, state, first


def policy_round(
    target: tgt.Target, proposer: Proposer, state: RoundState, stats: adaptive.PolicyState, sampling: Sampling,
    stop_ids: Array, counts: Array, *, verify_len: int, all_greedy: bool, peek: bool = False,
) -> tuple[RoundState, adaptive.PolicyState, RoundOutput]:
    """``speculative_round`` plus the acceptance statistics the adaptive policy chooses the next length from.

    ``peek`` (static; a plain round, all rows greedy): a probe that costs a draft, not a wider verify — the
    drafter proposes one token, the plain step runs as always, and the statistics count a round of length 2
    whose proposal was accepted iff it equals the token the step emitted (what a T = 2 round would have
    recorded). The emitted tokens are the plain step's, so the output is unchanged."""
    running = state.running
    guess = None
    if peek:
        if verify_len != 1 or not all_greedy:
            raise ValueError("a peek is a plain round (verify_len 1) of greedy rows")
        guess = proposer.propose(target, state.proposer_state, state.anchor, counts, state.keys,
                                 Sampling.rows(state.anchor.shape[0]), 1).tokens[:, 0]  # fmt: skip
    state, out = speculative_round(
        target, proposer, state, sampling, stop_ids, counts, verify_len=verify_len, all_greedy=all_greedy
    )
    if peek:
        peeked = (guess.astype(jnp.int32) == out.emitted[:, 0]).astype(jnp.int32)
        return state, adaptive.update(stats, jnp.int32(adaptive.PROBE_LENGTH), peeked, running), out
    return state, adaptive.update(stats, jnp.int32(verify_len), out.accepted, running), out


@struct.dataclass
class LoopCarry:
    """The decode loop's state between rounds (and between the host's calls of ``run_segment``). Per row:
    tokens ``[B, out_width + T_max]`` (the first ``counts`` are valid), then one entry per verify step
    ``[B, out_width]``: tokens kept (``kept``), proposals accepted before stop/budget cuts (``accepted``), the
    step's verify length (``lengths``); ``rounds`` verify steps per row, ``iterations`` rounds of the loop."""

    round: RoundState
    stats: adaptive.PolicyState
    sampling: Sampling
    tokens: Array
    counts: Array
    stopped: Array
    kept: Array
    accepted: Array
    lengths: Array
    rounds: Array
    iterations: Array


def start_impl(
    cache, state, first: Array, key: Array, temperature: Array, top_p: Array, top_k: Array | int, stop_ids: Array,
    max_new_tokens: Array, *, out_width: int, max_verify: int,
) -> LoopCarry:
    """The loop's first carry after prefill. ``cache`` must have ``max_verify`` slack slots past the planned
    capacity (``speculative_generate`` allocates them). Same budget as ``generate``: one token per free
    planned slot + the last one, never fed back."""
    batch = first.shape[0]
    capacity = cache.capacity - max_verify  # planned capacity; the slots beyond it are verify slack
    stopped = jnp.isin(first, stop_ids)
    budget = jnp.minimum(max_new_tokens, capacity - cache.lengths + 1)  # [B]
    history = jnp.zeros((batch, out_width), jnp.int32)
    return LoopCarry(
        round=RoundState(
            cache=cache, proposer_state=state, anchor=first, running=~stopped & (budget > 1), remaining=budget - 1,
            keys=jax.random.split(key, batch),
        ),
        stats=adaptive.init_state(batch, max_verify), sampling=Sampling.rows(batch, temperature, top_p, top_k),
        tokens=jnp.zeros((batch, out_width + max_verify), jnp.int32).at[:, 0].set(first),
        counts=jnp.ones((batch,), jnp.int32), stopped=stopped, kept=history, accepted=history, lengths=history,
        rounds=jnp.zeros((batch,), jnp.int32), iterations=jnp.zeros((), jnp.int32),
    )


def run_segment(
    target: tgt.Target, proposer: Proposer, carry: LoopCarry, stop_ids: Array, max_rounds: Array | None = None,
    *, verify_len: int, greedy: bool, peek: bool = False,
) -> LoopCarry:
    """Rounds of ``verify_len`` tokens until every row stops, or ``max_rounds`` rounds (``None``: no limit);
    ``peek``: every round a peek (``policy_round``)."""
    t = verify_len
    batch = carry.counts.shape[0]
    out_width = carry.kept.shape[1]
    rows = jnp.arange(batch)
    slots = jnp.arange(t)[None, :]  # [1, T]
    end = None if max_rounds is None else carry.iterations + max_rounds

    def cond(c: LoopCarry) -> Array:
        alive = jnp.any(c.round.running)
        return alive if end is None else alive & (c.iterations < end)

    def body(c: LoopCarry) -> LoopCarry:
        running, counts = c.round.running, c.counts
        round_state, stats, result = policy_round(
            target, proposer, c.round, c.stats, c.sampling, stop_ids, counts, verify_len=t, all_greedy=greedy,
            peek=peek,
        )
        n_keep = result.n_keep
        columns = jnp.where(slots < n_keep[:, None], counts[:, None] + slots, c.tokens.shape[1])  # out of range → dropped
        record = jnp.where(running, c.rounds, out_width)  # out of range → dropped
        return c.replace(
            round=round_state, stats=stats, tokens=c.tokens.at[rows[:, None], columns].set(result.emitted, mode="drop"),
            counts=counts + n_keep, stopped=c.stopped | result.hit_stop,
            kept=c.kept.at[rows, record].set(n_keep, mode="drop"),
            accepted=c.accepted.at[rows, record].set(result.accepted, mode="drop"),
            lengths=c.lengths.at[rows, record].set(t, mode="drop"), rounds=c.rounds + running,
            iterations=c.iterations + 1,
        )

    return jax.lax.while_loop(cond, body, carry)


def segment_impl(
    target: tgt.Target, proposer: Proposer, carry: LoopCarry, stop_ids: Array, max_rounds: Array,
    policy: VerifyPolicy, *, verify_len: int, greedy: bool, peek: bool = False,
) -> tuple[LoopCarry, Array, Array, Array, Array]:
    """``max_rounds`` rounds at ``verify_len``, then the policy's next choice (a candidate index), whether it
    is a probe, the plain rounds until a probe is due (``T = 1`` changes no estimate, so the choice holds
    until then) and whether any row still runs: the adaptive loop's unit, driven from the host
    (``speculative_generate``).
    One compiled program per length; choosing on the device inside one loop (``lax.switch`` over rounds)
    measured ~10 % slower on CPU, the caches being copied in and out of the switch."""
    carry = run_segment(target, proposer, carry, stop_ids, max_rounds, verify_len=verify_len, greedy=greedy, peek=peek)
    running, stats = carry.round.running, carry.stats
    choice, probe = adaptive.choose(policy, stats, running, carry.round.remaining, carry.iterations)
    until_probe = jnp.min(jnp.where(running, stats.wait - stats.idle, adaptive.MAX_WAIT))
    return carry, choice, probe, jnp.maximum(until_probe, 1), jnp.any(running)


def loop_impl(
    target: tgt.Target, proposer: Proposer, cache, state, first: Array, key: Array, temperature: Array,
    top_p: Array, stop_ids: Array, max_new_tokens: Array, *, out_width: int, verify_len: int, top_k: Array | int,
    greedy: bool,
) -> LoopCarry:
    """Rounds of a fixed ``verify_len`` until every row stops, as one device loop (``jax.vmap``-able)."""
    carry = start_impl(cache, state, first, key, temperature, top_p, top_k, stop_ids, max_new_tokens,
                       out_width=out_width, max_verify=verify_len)  # fmt: skip
    return run_segment(target, proposer, carry, stop_ids, verify_len=verify_len, greedy=greedy)


def generate_impl(
    target: tgt.Target, proposer: Proposer, tokens: Array, lengths: Array, key: Array, temperature: Array,
    top_p: Array, stop_ids: Array, max_new_tokens: Array, *, capacity: int, out_width: int, verify_len: int,
    top_k: int, greedy: bool,
) -> LoopCarry:
    """Prefill + loop at a fixed verify length as one pure function (``jax.vmap``-able: the statistical tests
    draw many samples with it). ``capacity`` is the physical cache size (planned + ``verify_len``)."""
    key_prefill, key_loop = jax.random.split(key)
    cache, state, first = prefill_impl(
        target, proposer, tokens, lengths, key_prefill, temperature, top_p, capacity=capacity, top_k=top_k,
        greedy=greedy,
    )
    return loop_impl(
        target, proposer, cache, state, first, key_loop, temperature, top_p, stop_ids, max_new_tokens,
        out_width=out_width, verify_len=verify_len, top_k=top_k, greedy=greedy,
    )


prefill = jax.jit(prefill_impl, static_argnames=("capacity", "top_k", "greedy"))
speculative_loop = jax.jit(
    loop_impl, static_argnames=("out_width", "verify_len", "greedy"), donate_argnames=("cache", "state")
)
start_loop = jax.jit(start_impl, static_argnames=("out_width", "max_verify"), donate_argnames=("cache", "state"))
loop_segment = jax.jit(segment_impl, static_argnames=("verify_len", "greedy", "peek"), donate_argnames=("carry",))


# ----------------------------------------------------------------------------------------------
# Verify-length table (dynamic verification; written by ``python -m dspine_jax.tune``)


def load_sps_table(table: Mapping[str, Any] | str | os.PathLike) -> dict[int, int]:
    """An sps table (dict or JSON path) → ``{batch_size: verify_length}``.

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
# Public API


@dataclasses.dataclass
class SpeculativeResult(GenerationResult):
    # Per row, one entry per verify step: tokens it added to the output, the bonus included (the last
    # step's count is cut at a stop id / max_new_tokens). The first token comes from prefill, so
    # sum(acceptance_lengths[b]) == len(token_ids[b]) - 1.
    acceptance_lengths: list[list[int]]
    # Per row, per verify step: proposals accepted by verification, before stop / budget cuts (tune.py).
    accepted_proposals: list[list[int]]
    verify_length: int  # the longest verify (anchor + proposals) a step could use: the fixed T, or auto's largest
    num_iterations: int  # while_loop iterations (= verify steps of the longest-running row)
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


def check_block_size(block_size: int, limit: int | None) -> None:
    """A fixed verify length is the anchor plus at least one proposal, and at most the drafter's block
    (``limit``)."""
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


def proposer_block(proposer: Proposer) -> int | None:
    """The longest verify the proposer supports (a drafter's block; None: no limit)."""
    return proposer.drafter.config.block_size if isinstance(proposer, DrafterProposer) else None


def resolve_verify(proposer: Proposer, batch: int, verify: int | str, block_size: int | None, sps_table) -> int | None:
    """A fixed verify length, or None for the adaptive policy. In order: ``block_size`` (the older name of
    a fixed ``verify``), the sps table's entry for ``batch`` (capped at the drafter's block), ``verify``."""
    limit = proposer_block(proposer)
    verify = parse_verify(verify)
    if block_size is not None:
        if verify != "auto" and verify != block_size:
            raise ValueError(f"verify={verify!r} and block_size={block_size} disagree: give one")
        verify = block_size
    if sps_table is not None:
        length = verify_length_for_batch(load_sps_table(sps_table), batch)
        return min(length, limit) if limit is not None else length
    if verify == "auto":
        return None
    check_block_size(verify, limit)
    return verify


def proposer_tag(proposer: Proposer) -> str:
    """What a proposer's round cost depends on (its shapes, not its weights' values)."""
    if isinstance(proposer, DrafterProposer):
        return f"{proposer.drafter.config!r}|{proposer.drafter.params.fc.dtype}"
    return type(proposer).__name__


def measure_verify_costs(start, run, lengths: tuple[int, ...], rounds: int = 8, repeats: int = 3) -> dict[int, float]:
    """Seconds per round at each verify length: ``rounds`` rounds of the real loop at that length, the fastest
    of ``repeats`` after one warm-up, the lengths interleaved (``adaptive.fastest_seconds_per_round``: a busy
    moment must not make a length look dear for good).
    ``start()`` returns a fresh carry; ``run(carry, length, rounds)`` runs the rounds and returns the carry."""
    seconds: dict[int, list[float]] = {t: [] for t in lengths}
    iterations: dict[int, list[int]] = {t: [] for t in lengths}
    for attempt in range(repeats + 1):
        for length in lengths:
            carry = jax.block_until_ready(start())
            begin = time.perf_counter()
            carry = jax.block_until_ready(run(carry, length, rounds))
            if attempt:  # the first pass warms caches up
                seconds[length].append(time.perf_counter() - begin)
                iterations[length].append(int(carry.iterations))
    return {t: adaptive.fastest_seconds_per_round(seconds[t], iterations[t]) for t in lengths}


def adaptive_decode(
    target: tgt.Target, proposer: Proposer, clock: CompileTimer, candidates: tuple[int, ...], prefilled,
    fresh_prefill, sampling_args, stop_array: Array, max_new_tokens: int, out_width: int, greedy: bool,
    verify_costs: Mapping[int, float] | None, verify_schedule: Sequence[int] | None,
) -> tuple[LoopCarry, float, float]:
    """``verify="auto"``: segments of ``DECIDE_EVERY`` rounds (a probe: one; plain rounds: until a probe is
    due; a pinned schedule: one) at the length the policy chose at the end of the previous segment, from
    the prefilled caches to the end. Measured or cached costs are refined by the segments' host timings
    (``adaptive.CostEstimate``) and written back to the cache; while few segments have timed a neighbour of
    the chosen drafted length, it runs instead (``CostEstimate.explore``). Under greedy decoding a probe is a
    peek (``policy_round``): a plain round plus a one-token draft, not a round at ``PROBE_LENGTH``.
    ``sampling_args``: key, temperature, top-p, top-k. Returns the final carry, the decode seconds and the
    seconds spent measuring the cost model (0 when given or cached). Every program is compiled (on
    ``clock``) before anything is timed."""
    t_max = max(candidates)
    start_kwargs = dict(out_width=out_width, max_verify=t_max)
    start_args = (*sampling_args, stop_array, jnp.int32(max_new_tokens))
    carry, start_seconds = clock.run(start_loop, *prefilled, *start_args, **start_kwargs)
    every = 1 if verify_schedule is not None else DECIDE_EVERY
    unit = adaptive.make_policy(candidates, dict.fromkeys(candidates, 1.0))
    greedy_probes = greedy and verify_schedule is None
    for t, peek in adaptive.programs(candidates, greedy_probes):  # one program per length (and the peek)
        clock.compile(loop_segment, target, proposer, carry, stop_array, jnp.int32(every), unit, verify_len=t,
                      greedy=greedy, peek=peek)  # fmt: skip
    costs, segments, calibration, key = verify_costs, None, 0.0, None
    if costs is None:
        key = adaptive.costs_key(target, proposer_tag(proposer), carry.counts.shape[0], candidates)
        costs, segments = adaptive.load_cost_entry(key) or (None, None)
        if costs is None:
            _log.info("measuring verify costs for lengths %s (once per device, model, drafter and batch size; "
                      "cached in %s)", list(candidates), adaptive.COSTS_FILE)
            begin = time.perf_counter()
            no_stops = jnp.full_like(stop_array, -1)  # every row runs the measured rounds
            costs = measure_verify_costs(
                lambda: start_loop(*fresh_prefill(), *start_args, **start_kwargs),
                lambda c, t, n: loop_segment(target, proposer, c, no_stops, jnp.int32(n), unit, verify_len=t,
                                             greedy=greedy)[0],
                candidates,
            )  # fmt: skip
            calibration = time.perf_counter() - begin
            adaptive.store_costs(key, costs)
    estimate = adaptive.CostEstimate(costs, segments)
    policy = adaptive.make_policy(candidates, costs, verify_schedule)
    begin = time.perf_counter()
    choice, probe = adaptive.choose(policy, carry.stats, carry.round.running, carry.round.remaining, carry.iterations)
    alive, until_probe = bool(jnp.any(carry.round.running)), every
    while alive:  # host-driven: a few rounds (a probe: one) at the chosen length, then the next choice
        t = candidates[int(choice)]
        if key is not None and verify_schedule is None and not bool(probe):  # measured costs are corrected
            # only by running a length (a pinned schedule is run as pinned)
            t = estimate.explore(t)
        rounds = 1 if bool(probe) else until_probe if t == 1 and verify_schedule is None else every
        peek = adaptive.peeks(t, bool(probe), greedy_probes)
        t = 1 if peek else t
        segment_begin = time.perf_counter()
        carry, choice, probe, until_probe, alive = loop_segment(
            target, proposer, carry, stop_array, jnp.int32(rounds), policy, verify_len=t, greedy=greedy, peek=peek
        )
        alive, until_probe = bool(alive), int(until_probe)
        if alive and key is not None and not peek:  # measured costs (not given ones, in any unit) are refined by
            # the rounds decoding runs; all `rounds` ran (only the last segment may stop early); a peek's time
            # is neither length's
            estimate.observe(t, time.perf_counter() - segment_begin, rounds)
            refined = estimate.current()
            policy = policy.replace(costs=jnp.asarray([refined[c] for c in candidates], jnp.float32))
    carry = jax.block_until_ready(carry)
    if key is not None:  # the cache keeps what decoding measured, for the next run
        adaptive.store_costs(key, *estimate.measured())
    return carry, start_seconds + time.perf_counter() - begin, calibration


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
    proposals, ≤ the drafter's block), or ``"auto"`` (default): every ``DECIDE_EVERY`` rounds the policy
    picks the length among ``adaptive.candidate_lengths`` (1 = a plain decode step) from the rows'
    acceptance so far and the device's cost per length (``verify_costs {T: seconds}``, else measured once
    and cached on disk, see ``adaptive``); ``verify_schedule`` pins the lengths round by round (cyclic,
    tests). ``block_size`` is the older name of a fixed ``verify``; ``sps_table`` (dict or JSON path from
    ``python -m dspine_jax.tune``) fixes it by batch size. ``stop_ids=None`` uses the model's EOS ids,
    ``[]`` none. Greedy (temperature 0) output equals ``generate``'s whatever the lengths.
    """
    rows, capacity, tokens, lengths, stops = plan_request(
        target, prompt_ids, max_new_tokens, temperature, top_p, top_k, stop_ids
    )
    proposer = as_proposer(drafter)
    if isinstance(proposer, DrafterProposer):
        check_compatible(proposer.drafter.config, target)
    fixed = resolve_verify(proposer, len(rows), verify, block_size, sps_table)
    if verify_schedule is not None and fixed is not None:
        raise ValueError("verify_schedule pins the lengths of verify='auto'; a fixed verify has one length")
    candidates = (fixed,) if fixed is not None else adaptive.candidate_lengths(proposer_block(proposer))
    t_max = max(candidates)
    stops += [-1] * (round_up(max(len(stops), 1), STOP_BUCKET) - len(stops))
    greedy = temperature == 0
    key_prefill, key_loop = jax.random.split(jax.random.key(seed))
    temp, top_p_arr = jnp.float32(temperature if not greedy else 1.0), jnp.float32(top_p)
    out_width = round_up(max_new_tokens, TOKEN_BUCKET)
    stop_array = jnp.asarray(stops, jnp.int32)
    prefill_args = (target, proposer, tokens, lengths, key_prefill, temp, top_p_arr)
    prefill_kwargs = dict(capacity=capacity + t_max, top_k=top_k, greedy=greedy)

    clock = CompileTimer()  # compilation timed apart from prefill and decode (see generate)
    (cache, state, first), prefill_seconds = clock.run(prefill, *prefill_args, **prefill_kwargs)
    if fixed is not None:
        calibration = 0.0
        carry, decode_seconds = clock.run(
            speculative_loop, target, proposer, cache, state, first, key_loop, temp, top_p_arr, stop_array,
            jnp.int32(max_new_tokens), out_width=out_width, verify_len=fixed, top_k=jnp.int32(top_k), greedy=greedy,
        )
    else:
        carry, decode_seconds, calibration = adaptive_decode(
            target, proposer, clock, candidates, (cache, state, first),
            lambda: prefill(*prefill_args, **prefill_kwargs), (key_loop, temp, top_p_arr, jnp.int32(top_k)),
            stop_array, max_new_tokens, out_width, greedy, verify_costs, verify_schedule,
        )  # fmt: skip
    got = jax.device_get(carry.replace(round=None, stats=None, sampling=None))

    n = len(rows)
    return SpeculativeResult(
        token_ids=[got.tokens[i, : got.counts[i]].tolist() for i in range(n)],
        finish_reasons=finish_reasons(got.counts, got.stopped, max_new_tokens),
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
