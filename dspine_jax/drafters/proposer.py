"""A drafter as a proposer: what the speculative round (``decoding/round.py``) calls to draft a block.

The round knows proposers only through their protocol (``decoding/proposers.py``): the features they tap,
their state's life cycle (``init`` → ``prefill`` → ``propose`` / ``commit`` per round), the longest
verify they support, what their cost depends on, a compatibility check with the target, and how to
resize or rewind their per-row state. ``DrafterProposer`` answers each from the drafter's config.
"""

from __future__ import annotations

import dataclasses

from flax import struct
from jax import Array

from dspine_jax.drafters.drafter import DraftOutput, draft
from dspine_jax.drafters.io import check_compatible
from dspine_jax.drafters.params import Drafter
from dspine_jax.drafters.ring import DraftCache, append_context, init_draft_cache, resize_ring
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling


@struct.dataclass
class DrafterProposer:
    """A DFlash / DSpine / DFlash2 drafter as a proposer (state: its ``DraftCache``, batch-major)."""

    drafter: Drafter

    @property
    def taps(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids

    @property
    def block_limit(self) -> int:
        """The longest verify block (anchor + proposals) the drafter was built for."""
        return self.drafter.config.block_size

    @property
    def tag(self) -> str:
        """What a round's cost depends on: the drafter's shapes and dtype, not its weights' values."""
        return f"{self.drafter.config!r}|{self.drafter.params.fc.dtype}"

    def check_compatible(self, target: tgt.Target) -> None:
        check_compatible(self.drafter.config, target)

    def init(self, target: tgt.Target, batch: int, capacity: int) -> DraftCache:
        # The ring stores its K/V like the target's cache (``--kv-cache-dtype`` sets both).
        return init_draft_cache(self.drafter, batch, capacity, target.kv_cache_dtype)

    def prefill(self, target: tgt.Target, state: DraftCache, hidden: Array, tapped: Array, lengths: Array) -> DraftCache:
        return append_context(self.drafter, state, tapped, lengths)

    def propose(
        self, target: tgt.Target, state: DraftCache, anchor: Array, counts: Array, keys: Array, sampling: Sampling,
        num: int,
    ) -> DraftOutput:
        drafter = self.drafter
        # A causal drafter's first `num` slots do not depend on later ones: draft a shorter block
        # (cheaper). A bidirectional one was trained on its full block: draft it all, verify a prefix.
        if num + 1 < drafter.config.block_size and all(drafter.config.layer_causal):
            drafter = drafter.replace(config=dataclasses.replace(drafter.config, block_size=num + 1))
        out = draft(drafter, target, state, anchor, keys, sampling)
        return DraftOutput(tokens=out.tokens[:, :num], cand_ids=out.cand_ids[:, :num], q=out.q[:, :num])

    def commit(self, target: tgt.Target, state: DraftCache, hidden: Array, tapped: Array, num_new: Array) -> DraftCache:
        return append_context(self.drafter, state, tapped, num_new)

    def with_capacity(self, state: DraftCache, capacity: int) -> DraftCache:
        return resize_ring(self.drafter, state, capacity)

    def rewind(self, state: DraftCache, lengths: Array) -> DraftCache:
        """Rows keep their first ``lengths [B]`` committed positions (0: empty): slot positions derive from
        ``lengths``, so a ring that never wrapped truncates like K/V."""
        return state.replace(lengths=lengths.astype(state.lengths.dtype))
