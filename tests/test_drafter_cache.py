"""The drafter's context cache, our own checks (no reference package): ragged rows committed unevenly
draft as they would alone, and a windowed drafter's W-1-slot ring equals an unbounded cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import append, block_logits, tapped_features

from dspine_jax.drafters.io import init_drafter
from dspine_jax.drafters.ring import DraftCache, init_draft_cache

BLOCK = 4
TAPS = [0, 1]


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_ragged_batch_equals_single_rows(qwen3_target, kind):
    """Rows with their own lengths, committed in two uneven appends, draft exactly as they would alone."""
    target, _ = qwen3_target
    drafter = init_drafter(
        target,
        kind=kind,
        num_layers=2,
        block_size=BLOCK,
        transfer_rank=16,
        message_size=8,
        top_k=4,
        target_layer_ids=TAPS,
        initializer_range=0.2,
    )
    rng = np.random.RandomState(2)
    seqs = rng.randint(3, 128, size=(2, 12))
    tapped = tapped_features(target, seqs, drafter.config.target_layer_ids)
    first, second = np.array([7, 4]), np.array([2, 3])
    cache = append(drafter, init_draft_cache(drafter, 2, 32), tapped[:, :, :8], jnp.asarray(first))
    # Second append: each row's new features start at its own length.
    block = np.stack([np.asarray(tapped[:, b, first[b] : first[b] + 4]) for b in range(2)], axis=1)
    cache = append(drafter, cache, jnp.asarray(block), jnp.asarray(second))
    anchors = seqs[np.arange(2), first + second]
    batched = block_logits(drafter, target, cache, anchors)
    for b in range(2):
        n = first[b] + second[b]
        alone = append(
            drafter, init_draft_cache(drafter, 1, 32), tapped[:, b : b + 1], jnp.array([n])
        )  # padding past n is ignored
        np.testing.assert_allclose(
            batched[b], block_logits(drafter, target, alone, anchors[b : b + 1])[0], atol=1e-5, rtol=1e-5
        )


def test_ring_buffer_window_equals_unbounded_cache(qwen3_target):
    """A windowed drafter's W-1-slot ring, wrapped several times by many small appends, drafts exactly
    like a cache that holds the whole history."""
    target, _ = qwen3_target
    window = 5
    drafter = init_drafter(
        target,
        kind="dspine",
        num_layers=2,
        block_size=BLOCK,
        transfer_rank=16,
        message_size=8,
        top_k=4,
        target_layer_ids=TAPS,
        sliding_window=window,
        initializer_range=0.2,
    )
    ring = init_draft_cache(drafter, 1, 64)
    assert ring.capacity == window - 1
    b, kh, _, d = ring.k[0].shape
    unbounded = tuple(jnp.zeros((b, kh, 64, d), ring.k[0].dtype) for _ in ring.k)
    full = DraftCache(k=unbounded, v=unbounded, lengths=ring.lengths)
    seq = np.random.RandomState(3).randint(3, 128, size=(1, 24))
    tapped = tapped_features(target, seq, drafter.config.target_layer_ids)
    pos = 0
    for n in [6, 3, 1, 4, 2]:  # the first append is longer than the ring
        chunk = tapped[:, :, pos : pos + 6]
        chunk = jnp.pad(chunk, ((0, 0), (0, 0), (0, 6 - chunk.shape[2]), (0, 0)))
        ring = append(drafter, ring, chunk, jnp.array([n]))
        full = append(drafter, full, chunk, jnp.array([n]))
        pos += n
        anchor = seq[:, pos]
        np.testing.assert_allclose(
            block_logits(drafter, target, ring, anchor),
            block_logits(drafter, target, full, anchor),
            atol=1e-5,
            rtol=1e-5,
        )


def test_deferred_ingest_drafts_like_immediate_appends(qwen3_target):
    """A drafter proposer parks committed tokens' taps (``commit``) and appends them when a draft is due
    (``flush``) or its buffer would overflow: the ring it drafts from equals one appended round by round,
    plain rounds leave the ring alone, and a rewind into the parked tokens keeps exactly their prefix."""
    import jax

    from dspine_jax.drafters.proposer import DrafterProposer

    target, _ = qwen3_target
    drafter = init_drafter(target, kind="dspine", num_layers=2, block_size=BLOCK, transfer_rank=16, message_size=8,
                           top_k=4, target_layer_ids=TAPS, initializer_range=0.2)  # fmt: skip
    proposer = DrafterProposer(drafter)
    commit, flush = jax.jit(proposer.commit), jax.jit(proposer.flush)
    rewind = jax.jit(proposer.rewind)
    seqs = np.random.RandomState(4).randint(3, 128, size=(2, 30))
    tapped = tapped_features(target, seqs, drafter.config.target_layer_ids)
    state = proposer.init(target, 2, 48)
    slots = state.pending.shape[1]
    direct = init_draft_cache(drafter, 2, 48)
    done = np.zeros(2, int)
    schedule = [(1, 1), (1, 0), (4, 2), (1, 1), (3, 4), (1, 1), (1, 1), (2, 3), (4, 4), (1, 1), (4, 1), (1, 1)]
    overflows = 0
    for step, counts in enumerate(schedule):
        counts = np.asarray(counts)
        block = np.stack([np.asarray(tapped[:, b, done[b] : done[b] + BLOCK]) for b in range(2)], axis=1)
        before = state
        state = commit(target, state, None, jnp.asarray(block), jnp.asarray(counts))
        direct = append(drafter, direct, jnp.asarray(block), jnp.asarray(counts))
        done += counts
        np.testing.assert_array_equal(state.lengths, done)
        overflow = np.any(np.asarray(before.num_pending) + counts > slots)
        overflows += overflow
        # The ring moves only when the parked tokens would overflow the buffer.
        np.testing.assert_array_equal(state.ring.lengths, before.lengths if overflow else before.ring.lengths)
        if step in (2, 10):  # a draft is due: the flushed ring is the directly appended one
            state = flush(target, state)
            np.testing.assert_array_equal(state.num_pending, 0)
            anchors = seqs[np.arange(2), done]
            np.testing.assert_allclose(block_logits(drafter, target, state.ring, anchors),
                                       block_logits(drafter, target, direct, anchors), atol=1e-5, rtol=1e-5)  # fmt: skip
    assert overflows == 1 and np.any(np.asarray(state.num_pending) > 0)
    # Rewind: row 0 into its parked tokens, row 1 below its ring; both then draft like a ring built to there.
    keep = np.array([int(state.ring.lengths[0]) + 1, int(state.ring.lengths[1]) - 2])
    state = flush(target, rewind(state, jnp.asarray(keep)))
    np.testing.assert_array_equal(state.ring.lengths, keep)
    anchors = seqs[np.arange(2), keep]
    for b in range(2):
        alone = append(drafter, init_draft_cache(drafter, 1, 48), tapped[:, b : b + 1], jnp.array([keep[b]]))
        np.testing.assert_allclose(block_logits(drafter, target, state.ring, anchors)[b],
                                   block_logits(drafter, target, alone, anchors[b : b + 1])[0], atol=1e-5, rtol=1e-5)  # fmt: skip
