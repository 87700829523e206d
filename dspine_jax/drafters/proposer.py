"""A drafter as a proposer: what the speculative round (``decoding/round.py``) calls to draft a block.

The round knows proposers only through their protocol (``decoding/proposers.py``): the features they tap,
their state's life cycle (``init`` → ``prefill`` → ``propose`` / ``commit`` per round), the longest
verify they support, what their cost depends on, a compatibility check with the target, and how to
resize or rewind their per-row state. ``DrafterProposer`` answers each from the drafter's config.

Deferred context ingest: a committed token's context K/V (``fc`` over its concatenated taps, then each layer's
k/v projections) are needed only by the next draft, and most rounds of a cautious policy do not draft. So
``commit`` parks the concatenated taps in a per-row buffer of ``PENDING_SLOTS`` (``DrafterState.pending``) and
``flush`` (the round calls it before ``propose``) appends them to the ring in one call; a full buffer is
flushed by the commit that would overflow it. One append of W tokens costs about what one of a single token
does (the weights are read once either way), so a plain round no longer pays for the drafter's context.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.drafters.drafter import DraftOutput, draft
from dspine_jax.drafters.io import check_compatible
from dspine_jax.drafters.params import Drafter
from dspine_jax.drafters.ring import (
    DraftCache,
    append_context,
    append_features,
    concat_taps,
    init_draft_cache,
    resize_ring,
)
from dspine_jax.models import target as tgt
from dspine_jax.models.cache import sharded_zeros
from dspine_jax.models.sampling import Sampling

PENDING_SLOTS = 16  # committed tokens whose context ingest may wait for the next draft (≥ the longest block)


@struct.dataclass
class DrafterState:
    """A drafter proposer's per-row state, batch-major: the context ring and the committed tokens not yet in it.

    Row b has committed ``ring.lengths[b] + num_pending[b]`` positions; ``pending[b, :num_pending[b]]`` holds
    the concatenated taps of positions ``ring.lengths[b] …`` in order."""

    ring: DraftCache
    pending: Array  # [B, W, n·H] concatenated taps (the drafter's dtype)
    num_pending: Array  # [B] int32

    @property
    def lengths(self) -> Array:
        """[B] committed positions (in the ring or pending)."""
        return self.ring.lengths + self.num_pending


@struct.dataclass
class DrafterProposer:
    """A DFlash / DSpine / DFlash2 drafter as a proposer (state: ``DrafterState``, batch-major)."""

    drafter: Drafter

    @property
    def taps(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids

    @property
    def block_limit(self) -> int:
        """The longest verify block (anchor + proposals) the drafter was built for (its kind's ``verify_block``)."""
        return self.drafter.kind.verify_block(self.drafter.config)

    @property
    def tag(self) -> str:
        """What a round's cost depends on: the drafter's shapes and dtype, not its weights' values."""
        return f"{self.drafter.config!r}|{self.drafter.params.fc.dtype}"

    def check_compatible(self, target: tgt.Target) -> None:
        check_compatible(self.drafter.config, target)

    def init(self, target: tgt.Target, batch: int, capacity: int) -> DrafterState:
        # The ring stores its K/V like the target's cache (``--kv-cache-dtype`` sets both).
        config = self.drafter.config
        width = config.num_taps * config.hidden_size
        return DrafterState(
            ring=init_draft_cache(self.drafter, batch, capacity, target.kv_cache_dtype),
            pending=sharded_zeros((batch, max(PENDING_SLOTS, self.block_limit), width), self.drafter.dtype,
                                  ("batch", None, None)),  # fmt: skip
            num_pending=sharded_zeros((batch,), jnp.int32, ("batch",)),
        )

    def flush(self, target: tgt.Target, state: DrafterState) -> DrafterState:
        """The state with every pending token appended to the ring (what a draft reads)."""

        def append(state: DrafterState) -> DrafterState:
            ring = append_features(self.drafter, state.ring, state.pending, state.num_pending)
            return state.replace(ring=ring, num_pending=jnp.zeros_like(state.num_pending))

        return jax.lax.cond(jnp.any(state.num_pending > 0), append, lambda s: s, state)

    def prefill(
        self, target: tgt.Target, state: DrafterState, hidden: Array, tapped: Array, lengths: Array,
        tokens: Array | None = None,
    ) -> DrafterState:
        state = self.flush(target, state)  # (a chunked prompt continues after every committed position)
        return state.replace(ring=append_context(self.drafter, state.ring, tapped, lengths))

    def propose(
        self, target: tgt.Target, state: DrafterState, anchor: Array, counts: Array, keys: Array, sampling: Sampling,
        num: int,
    ) -> DraftOutput:
        """Drafts from ``state.ring``: the round flushes the state first (``flush``)."""
        drafter = self.drafter
        # A causal drafter's first `num` slots do not depend on later ones: draft a shorter block
        # (cheaper). A bidirectional one was trained on its full block: draft it all, verify a prefix.
        need = drafter.config.block_size - (self.block_limit - num - 1)  # block positions `num` proposals take
        if need < drafter.config.block_size and all(drafter.config.layer_causal):
            drafter = drafter.replace(config=dataclasses.replace(drafter.config, block_size=need))
        return draft(drafter, target, state.ring, anchor, keys, sampling).first(num)

    def commit(
        self, target: tgt.Target, state: DrafterState, hidden: Array, tapped: Array, num_new: Array,
        tokens: Array | None = None,
    ) -> DrafterState:
        """Park the ``num_new [B]`` committed tokens' taps in ``pending`` (flushing first if they would not fit)."""
        features = concat_taps(self.drafter, tapped)  # [B, T, n·H]
        b, t, _ = features.shape
        slots = state.pending.shape[1]
        num_new = num_new.astype(jnp.int32)
        if t > slots:  # (the round's blocks are at most block_limit ≤ slots)
            raise ValueError(f"a block of {t} tokens is longer than the drafter's {slots} pending slots")
        full = jnp.any(state.num_pending + num_new > slots)
        state = jax.lax.cond(full, lambda s: self.flush(target, s), lambda s: s, state)
        offset = jnp.arange(t)[None, :]  # [1, T]
        where = jnp.where(offset < num_new[:, None], state.num_pending[:, None] + offset, slots)  # slots: dropped
        pending = state.pending.at[jnp.arange(b)[:, None], where].set(features, mode="drop")
        return state.replace(pending=pending, num_pending=state.num_pending + num_new)

    def with_capacity(self, state: DrafterState, capacity: int) -> DrafterState:
        return state.replace(ring=resize_ring(self.drafter, state.ring, capacity))

    def rewind(self, state: DrafterState, lengths: Array) -> DrafterState:
        """Rows keep their first ``lengths [B]`` committed positions (0: empty): slot positions derive from
        ``lengths``, so a ring that never wrapped truncates like K/V; pending tokens past ``lengths`` are dropped."""
        lengths = lengths.astype(jnp.int32)
        ring_lengths = jnp.minimum(state.ring.lengths, lengths)
        return state.replace(ring=state.ring.replace(lengths=ring_lengths),
                             num_pending=jnp.clip(lengths - state.ring.lengths, 0, state.num_pending))  # fmt: skip
