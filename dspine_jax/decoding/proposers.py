"""The proposer seam: what the speculative round asks of whatever drafts its blocks.

A proposer is a pytree (``flax.struct``) riding into ``jax.jit`` as an argument, its static fields part of
the compiled program's key. Its ``state`` is its own per-row cache, **batch-major** (every leaf's first axis
is the row; ``None`` for a stateless proposer), so the serving engine can move rows between slots and
buckets without knowing what the state is. Invariant, as for a drafter: the anchor sits at position
``target_cache.lengths``; ``commit`` receives the target features of exactly the tokens committed to the
target cache this round.

Implementations: ``drafters.proposer.DrafterProposer`` (a trained drafter), ``NoProposer`` (no drafting:
rounds of ``T = 1`` are plain decode steps), ``OracleProposer`` (the target's own continuation, wrong on
purpose at chosen slots: tests and ceilings).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.drafters.drafter import DraftOutput
from dspine_jax.drafters.params import Drafter
from dspine_jax.drafters.proposer import DrafterProposer
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling


class Proposer(Protocol):
    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose residual stream the proposer reads (``target.forward(..., taps)``)."""
        ...

    @property
    def block_limit(self) -> int | None:
        """The longest verify block (anchor + proposals) it supports; None: no limit; 1: it drafts nothing."""
        ...

    @property
    def tag(self) -> str:
        """What a round's cost depends on (its shapes, not its weights' values): part of the cost cache's key."""
        ...

    def check_compatible(self, target: tgt.Target) -> None:
        """Raise if it cannot draft for ``target`` (widths, vocabulary, tapped layers)."""
        ...

    def init(self, target: tgt.Target, batch: int, capacity: int) -> Any:
        """Empty state for ``batch`` rows of up to ``capacity`` positions."""
        ...

    def prefill(
        self, target: tgt.Target, state: Any, hidden: Array, tapped: Array, lengths: Array, tokens: Array | None = None
    ) -> Any:
        """After the prompt ``tokens [B, Tp]``: final hidden ``[B, Tp, H]``, ``tapped [n, B, Tp, H]``, ``lengths [B]``
        prompt tokens."""
        ...

    def flush(self, target: tgt.Target, state: Any) -> Any:
        """The state a draft reads: work ``commit`` deferred (a drafter's context ingest) done. The round calls
        it before ``propose``; a proposer that defers nothing returns ``state``."""
        ...

    def propose(
        self, target: tgt.Target, state: Any, anchor: Array, counts: Array, keys: Array, sampling: Sampling, num: int
    ) -> DraftOutput:
        """``anchor [B]``, ``counts [B]`` tokens generated so far (the anchor is the last of them), one key per
        row ``keys [B]`` → ``num`` proposals per row with their draft distribution (ignored for greedy rows).
        ``sampling``: the rows' own parameters (greedy rows come without filters)."""
        ...

    def commit(
        self, target: tgt.Target, state: Any, hidden: Array, tapped: Array, num_new: Array, tokens: Array | None = None
    ) -> Any:
        """The first ``num_new [B]`` of the block ``tokens [B, T]`` (anchor first) were committed; ``hidden [B, T, H]``,
        ``tapped [n, B, T, H]`` are the verify pass's. (An EAGLE-3 / MTP head pairs a token with the previous
        position's features: it needs the tokens, a drafter reading features only ignores them.)"""
        ...

    def with_capacity(self, state: Any, capacity: int) -> Any:
        """The state for rows of up to ``capacity`` positions (the engine's capacity buckets)."""
        ...

    def rewind(self, state: Any, lengths: Array) -> Any:
        """Rows keep their first ``lengths [B]`` committed positions (0: a fresh request; a prefix-cache hit
        keeps its shared prefix)."""
        ...


@struct.dataclass
class NoProposer:
    """No drafting: rounds of ``T = 1`` are plain autoregressive decode steps (``generate``, the engine's
    ``--no-speculative``)."""

    taps: tuple[int, ...] = struct.field(pytree_node=False, default=())
    block_limit: int = struct.field(pytree_node=False, default=1)
    tag: str = struct.field(pytree_node=False, default="NoProposer")

    def check_compatible(self, target: tgt.Target) -> None:
        return None

    def init(self, target: tgt.Target, batch: int, capacity: int) -> None:
        return None

    def prefill(
        self, target: tgt.Target, state: None, hidden: Array, tapped: Array, lengths: Array, tokens: Array | None = None
    ) -> None:
        return state

    def flush(self, target: tgt.Target, state: None) -> None:
        return state

    def propose(self, *args: Any) -> DraftOutput:
        raise ValueError("NoProposer drafts nothing: run it with verify_len 1")

    def commit(
        self, target: tgt.Target, state: None, hidden: Array, tapped: Array, num_new: Array, tokens: Array | None = None
    ) -> None:
        return state

    def with_capacity(self, state: None, capacity: int) -> None:
        return state

    def rewind(self, state: None, lengths: Array) -> None:
        return state


@struct.dataclass
class OracleProposer:
    """Proposes the target's own continuation, wrong on purpose at chosen slots (tests, ceilings).

    ``reference [B, N]``: row b's expected generated tokens (``reference[b, 0]`` is the prefill's token; at
    least as many rows as the batch it drafts for, the first ones used).
    ``accept [B, R]``: in its r-th round row b proposes ``accept[b, r % R]`` correct tokens, then a wrong one
    (values ≥ P mean all P correct). So with greedy decoding a round commits ``accept + 1`` tokens (capped
    at P + 1) for as long as the output follows the reference. State: each row's round index ``[B]``.
    """

    reference: Array  # [B, N] int32
    accept: Array  # [B, R] int32
    vocab_size: int = struct.field(pytree_node=False)
    taps: tuple[int, ...] = struct.field(pytree_node=False, default=())
    block_limit: None = struct.field(pytree_node=False, default=None)
    tag: str = struct.field(pytree_node=False, default="OracleProposer")

    def check_compatible(self, target: tgt.Target) -> None:
        if self.vocab_size != target.config.vocab_size:
            raise ValueError(f"oracle vocab {self.vocab_size} != the target's {target.config.vocab_size}")

    def init(self, target: tgt.Target, batch: int, capacity: int) -> Array:
        return jnp.zeros((batch,), jnp.int32)

    def prefill(
        self, target: tgt.Target, state: Array, hidden: Array, tapped: Array, lengths: Array,
        tokens: Array | None = None,
    ) -> Array:
        return state

    def flush(self, target: tgt.Target, state: Array) -> Array:
        return state

    def propose(
        self, target: tgt.Target, state: Array, anchor: Array, counts: Array, keys: Array, sampling: Sampling, num: int
    ) -> DraftOutput:
        b = anchor.shape[0]  # (the engine's row bucket may hold fewer rows than the reference)
        reference, accept = self.reference[:b], self.accept[:b]
        slots = jnp.arange(num)[None, :]  # [1, P]
        index = jnp.clip(counts[:, None] + slots, 0, reference.shape[1] - 1)  # [B, P]
        tokens = jnp.take_along_axis(reference, index, axis=1)
        good = jnp.take_along_axis(accept, (state % accept.shape[1])[:, None], axis=1)[:, 0]  # [B]
        tokens = jnp.where(slots == good[:, None], (tokens + 1) % self.vocab_size, tokens).astype(jnp.int32)
        ones = jnp.ones((*tokens.shape, 1), jnp.float32)
        return DraftOutput(tokens=tokens, cand_ids=tokens[..., None], q=ones)  # q: one-hot on the proposal

    def commit(
        self, target: tgt.Target, state: Array, hidden: Array, tapped: Array, num_new: Array,
        tokens: Array | None = None,
    ) -> Array:
        return state + 1

    def with_capacity(self, state: Array, capacity: int) -> Array:
        return state

    def rewind(self, state: Array, lengths: Array) -> Array:
        return jnp.where(lengths == 0, 0, state)


def as_proposer(drafter: Drafter | Proposer) -> Proposer:
    """A ``Drafter`` wrapped as a proposer; a proposer as is."""
    if isinstance(drafter, Drafter):
        return DrafterProposer(drafter)
    missing = [name for name in ("taps", "block_limit", "tag", "check_compatible", "init", "prefill", "flush",
                                 "propose", "commit", "with_capacity", "rewind") if not hasattr(drafter, name)]  # fmt: skip
    if missing:
        raise TypeError(f"expected a Drafter or a Proposer, got {type(drafter).__name__} (lacks {', '.join(missing)})")
    return drafter
