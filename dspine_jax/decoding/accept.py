"""Acceptance: which proposals of a verify block the target keeps, and the token after them.

Greedy rows keep the longest prefix where proposal == target argmax, plus the target's token at the first
mismatch (the bonus). Sampled rows use lossless speculative sampling (Leviathan et al.; docs/ARCHITECTURE.md
§4): proposal i is kept with probability ``min(1, p/q)``; at the first rejection the token is drawn from
``normalise(max(0, p - q))``, after a full accept the bonus is drawn from ``p``. ``p`` is ``process_rows``
(temperature, top-k, top-p exactly as plain sampling, each row with its own parameters).

Letters as in layers.py: B batch, T verify block (anchor + P proposals), V vocab, C candidates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from dspine_jax.drafters.drafter import DraftOutput
from dspine_jax.models.sampling import Sampling, categorical_rows, process_rows, split_rows


def accept_greedy(logits: Array, proposals: Array | None) -> tuple[Array, Array]:
    """logits ``[B, T, V]`` of the verify block, proposals ``[B, P]`` (None at T = 1) → emitted ``[B, T]``,
    accepted ``[B]``.

    Row b's round output is ``emitted[b, :accepted+1]``: the accepted proposals equal the target's argmax
    at their slots, and slot ``accepted`` holds the target's own token (the bonus), so the target's argmax
    over the block is the output.
    """
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
    if proposals is None:
        return choice, jnp.zeros(choice.shape[:1], jnp.int32)
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
