"""One speculative round (draft → verify → accept → stop → commit) for every row of a batch, and the
prefill that starts it. Static shapes throughout; ``decoder.decode_rounds`` runs rounds in a device loop.

Flow of a round (docs/ARCHITECTURE.md §4):

1. **Draft**: the proposer turns the anchor (last generated token, not yet in the target cache) into
   ``P = T - 1`` proposals (``DraftOutput``: tokens ``[B, P]``, plus the draft distribution over
   candidates for lossless sampling). At ``T = 1`` nothing is drafted: the round is a plain decode step.
2. **Verify**: one target forward over ``[anchor, proposals…]`` (``[B, T]``) at positions
   ``lengths … lengths+T-1``, writing K/V and capturing the proposer's tapped layers.
3. **Accept** (``accept.py``): greedy rows keep the longest argmax prefix plus the bonus; sampled rows use
   lossless speculative sampling with their own parameters.
4. **Stop**: the kept tokens are cut at the first stop id and at the row's remaining budget; rows that hit
   either stop (mid-block if need be) and keep their output while the others continue.
5. **Commit**: the row keeps ``n_keep`` block tokens (anchor + accepted proposals): ``target.replay``
   (``cache.commit`` for dense targets, GDN recurrent-state replay for hybrids) and the proposer takes
   those tokens and their target features (a drafter parks the features until its next draft:
   ``Proposer.flush``). The last emitted token becomes the next anchor.

Capacity: the target cache gets ``T`` slack slots past the planned capacity (the autoregressive one), so
a verify block never writes past the buffer while row budgets stay those of plain decoding (at most
``capacity - prompt + 1`` tokens per row). Greedy speculative output therefore equals greedy plain
decoding token for token, model position limit included.

Letters as in layers.py: B batch, T verify block (anchor + P proposals), V vocab, H width.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.decoding import adaptive
from dspine_jax.decoding.accept import accept_greedy, accept_sampling
from dspine_jax.decoding.proposers import Proposer
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling, sample, split_rows


@struct.dataclass
class DecodeState:
    """Everything a round reads and updates, per row: the caches, the anchor (last emitted token, not yet in
    the target cache), whether the row runs, how many tokens it may still emit and has emitted, its PRNG key,
    its sampling parameters and the acceptance statistics the adaptive policy chooses lengths from."""

    cache: Any  # the target's cache [B, …]
    proposer_state: Any  # the proposer's own per-row state (a drafter's context ring), batch-major
    anchor: Array  # [B] int32
    running: Array  # [B] bool
    remaining: Array  # [B] int32, ≥ 1 for running rows
    counts: Array  # [B] int32 tokens emitted so far (the anchor is the last; reference-reading proposers)
    keys: Array  # [B] typed PRNG keys
    sampling: Sampling  # [B] per-row temperature (0 = greedy), top-p, top-k
    stats: adaptive.PolicyState  # [B, …]


@struct.dataclass
class RoundOutput:
    emitted: Array  # [B, T] the round's tokens; row b's first n_keep[b] are its output
    n_keep: Array  # [B] tokens added to the output (0 for rows that do not run)
    accepted: Array  # [B] proposals verification accepted, before stop / budget cuts
    hit_stop: Array  # [B] the kept tokens end on a stop id
    length: Array  # int32: the tokens verified (T, or less where the drafter's confidence cut the draft)


def speculative_round(
    target: tgt.Target, proposer: Proposer, state: DecodeState, stop_ids: Array, *, verify_len: int,
    all_greedy: bool, peek: bool = False, track: bool = True, cut: adaptive.VerifyPolicy | None = None,
) -> tuple[DecodeState, RoundOutput]:
    """One round (module doc) for every row at ``verify_len`` (``stop_ids [K]``, -1 = padding).

    ``all_greedy`` (static) compiles out the sampling path; otherwise it runs only when some running row
    samples. ``track``: update the acceptance statistics (the adaptive policy's; a fixed length skips them).
    ``peek`` (a plain round of greedy rows): a probe that costs a draft, not a wider verify — the proposer
    drafts one token, the plain step runs as always, and the statistics count a round of length
    ``PROBE_LENGTH`` whose proposal was accepted iff it equals the token the step emitted (what that round
    would have recorded). The emitted tokens are the plain step's, so the output is unchanged.
    ``cut`` (the adaptive policy): a drafter that predicts its proposals' acceptance (DSpark's confidence head)
    may have only a prefix of its draft verified, one of the policy's shorter lengths (``adaptive.confidence_cut``);
    each such length is a branch of this round."""
    t = verify_len
    b = state.anchor.shape[0]
    if peek and (t != 1 or not all_greedy):
        raise ValueError("a peek is a plain round (verify_len 1) of greedy rows")
    if all_greedy:  # nothing is drawn: the keys stay as they are (a split per row per round is not free)
        key_next = key_draft = key_accept = state.keys
    else:
        split = split_rows(state.keys, 3)
        key_next, key_draft, key_accept = split[:, 0], split[:, 1], split[:, 2]
    sampling = state.sampling
    greedy = jnp.ones((b,), bool) if all_greedy else sampling.greedy
    # Greedy rows draft greedily and without filters (a filter never removes the argmax).
    draft_sampling = Sampling.rows(b) if all_greedy else Sampling(
        temperature=jnp.where(greedy, 0.0, sampling.temperature), top_p=jnp.where(greedy, 1.0, sampling.top_p),
        top_k=jnp.where(greedy, 0, sampling.top_k),
    )

    # 1. draft
    proposal = None
    proposer_state = state.proposer_state
    if t > 1 or peek:
        proposer_state = proposer.flush(target, proposer_state)  # (plain rounds leave the drafter's ingest pending)
        proposal = proposer.propose(target, proposer_state, state.anchor, state.counts, key_draft, draft_sampling,
                                    max(t - 1, 1))  # fmt: skip
    state = state.replace(proposer_state=proposer_state, keys=key_next)
    verify = functools.partial(_verify_and_commit, target, proposer, state, stop_ids, proposal, key_accept,
                               all_greedy=all_greedy, greedy=greedy, peek=peek, track=track, width=t)  # fmt: skip
    lengths = () if cut is None or peek or proposal is None or proposal.confidence is None else adaptive.cut_lengths(cut, t)
    if not lengths:
        return verify(t)
    index = adaptive.confidence_cut(cut, lengths, proposal.confidence, state.running, state.remaining)
    return jax.lax.switch(index, [functools.partial(verify, length) for length in lengths])


def _verify_and_commit(
    target: tgt.Target, proposer: Proposer, state: DecodeState, stop_ids: Array, proposal: Any, key_accept: Array,
    t: int, *, all_greedy: bool, greedy: Array, peek: bool, track: bool, width: int,
) -> tuple[DecodeState, RoundOutput]:
    """Steps 2–5 of a round for the anchor and the first ``t - 1`` proposals; ``emitted`` is padded to ``width``."""
    sampling = state.sampling
    slots = jnp.arange(t)[None, :]  # [1, T]
    block = state.anchor[:, None]
    if t > 1:
        proposal = proposal.first(t - 1)
        block = jnp.concatenate([block, proposal.tokens.astype(jnp.int32)], axis=1)  # [B, T]
    # 2. verify
    hidden, tapped, cache, saved = tgt.forward(target, state.cache, block, proposer.taps)
    logits = tgt.lm_logits(target, hidden)  # [B, T, V] f32
    # 3. accept
    emitted, accepted = accept_greedy(logits, proposal.tokens if t > 1 else None)
    if not all_greedy:
        sampled = state.running & ~greedy

        def sample_path(_):
            e, a = accept_sampling(key_accept, logits, proposal, sampling)
            return jnp.where(sampled[:, None], e, emitted), jnp.where(sampled, a, accepted)

        emitted, accepted = jax.lax.cond(jnp.any(sampled), sample_path, lambda _: (emitted, accepted), None)
    # 4. stop (decided before committing, since it shortens the commit): first stop id, budget
    is_stop = jnp.isin(emitted, stop_ids) & (slots <= accepted[:, None])  # [B, T]
    until_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, t)
    n_keep = jnp.minimum(jnp.minimum(accepted + 1, until_stop), state.remaining)
    n_keep = jnp.where(state.running, jnp.maximum(n_keep, 0), 0)  # [B] 0…T
    hit_stop = jnp.any(is_stop & (slots < n_keep[:, None]), axis=1)
    # 5. commit: the anchor and the kept proposals (the last kept token is the next anchor)
    cache = tgt.replay(target, cache, saved, n_keep)
    proposer_state = proposer.commit(target, state.proposer_state, hidden, tapped, n_keep, block)
    last = jnp.take_along_axis(emitted, jnp.maximum(n_keep - 1, 0)[:, None], axis=1)[:, 0]
    remaining = state.remaining - n_keep
    stats = state.stats
    if peek:
        peeked = (proposal.tokens[:, 0].astype(jnp.int32) == emitted[:, 0]).astype(jnp.int32)
        stats = adaptive.update(stats, jnp.int32(adaptive.PROBE_LENGTH), peeked, state.running)
    elif track:
        stats = adaptive.update(stats, jnp.int32(t), accepted, state.running)
    state = state.replace(
        cache=cache, proposer_state=proposer_state, anchor=jnp.where(n_keep > 0, last, state.anchor),
        running=state.running & ~hit_stop & (remaining > 0), remaining=remaining, counts=state.counts + n_keep,
        stats=stats,
    )
    emitted = jnp.pad(emitted, ((0, 0), (0, width - t)))
    return state, RoundOutput(emitted=emitted, n_keep=n_keep, accepted=accepted, hit_stop=hit_stop, length=jnp.int32(t))


def prefill(
    target: tgt.Target, proposer: Proposer, tokens: Array, lengths: Array, key: Array, temperature: Array,
    top_p: Array, *, capacity: int, top_k: int, greedy: bool,
) -> tuple[Any, Any, Array]:
    """Prompts ``tokens [B, Tp]`` (right-padded to ``lengths``) → target cache, proposer state, first token ``[B]``."""
    batch = tokens.shape[0]
    cache = tgt.init_cache(target, batch, capacity)
    state = proposer.init(target, batch, capacity)
    hidden, tapped, cache, saved = tgt.forward(target, cache, tokens, proposer.taps)
    # replay = commit for dense targets; for hybrids it keeps pad tokens out of the GDN state.
    cache = tgt.replay(target, cache, saved, lengths)
    state = proposer.prefill(target, state, hidden, tapped, lengths, tokens)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
    first = sample(key, tgt.lm_logits(target, last), temperature, top_p, top_k, greedy)
    return cache, state, first


def start(
    cache: Any, proposer_state: Any, first: Array, key: Array, sampling: Sampling, stop_ids: Array,
    max_new_tokens: Array, prior: adaptive.Prior | None = None, *, max_verify: int,
) -> DecodeState:
    """The rows' state after prefill. ``cache`` has ``max_verify`` slack slots past the planned capacity;
    the budget is plain decoding's: one token per free planned slot + the last one, never fed back.
    ``prior``: where the rows' acceptance statistics start (None: nothing observed)."""
    batch = first.shape[0]
    capacity = cache.capacity - max_verify  # planned capacity; the slots beyond it are verify slack
    stopped = jnp.isin(first, stop_ids)
    budget = jnp.minimum(max_new_tokens, capacity - cache.lengths + 1)  # [B]
    return DecodeState(
        cache=cache, proposer_state=proposer_state, anchor=first, running=~stopped & (budget > 1),
        remaining=budget - 1, counts=jnp.ones((batch,), jnp.int32), keys=jax.random.split(key, batch),
        sampling=sampling, stats=adaptive.init_state(batch, max_verify, prior),
    )


def idle(target: tgt.Target, proposer: Proposer, batch: int, capacity: int, max_verify: int) -> DecodeState:
    """``batch`` empty rows that do not run (the serving engine's free slots)."""
    zeros = jnp.zeros((batch,), jnp.int32)
    return DecodeState(
        cache=tgt.init_cache(target, batch, capacity), proposer_state=proposer.init(target, batch, capacity),
        anchor=zeros, running=jnp.zeros((batch,), bool), remaining=zeros, counts=zeros,
        keys=jax.random.split(jax.random.key(0), batch), sampling=Sampling.rows(batch),
        stats=adaptive.init_state(batch, max_verify),
    )
