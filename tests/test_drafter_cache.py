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
