"""Loss terms for drafter training (SpecForge's DFlash / DSpine semantics, vLLM speculators' DSpark / EAGLE-3).

All terms work on flattened blocks: ``M`` blocks × ``P = T-1`` proposal slots. Each returns a
**numerator** (a weighted sum); the caller divides by ``sum(weights)``, like SpecForge, so that terms
from several chunks add up exactly.

* ``slot_weights``: the cumulative supervision mask (slot k counts only if slots 1..k are all
  supervised: a draft is worthless past its first unsupervisable slot) times the position decay
  ``exp(-(k-1)/γ)`` for slot k = 1…P (SpecForge's defaults: γ = 7 for DSpine, no decay for DFlash; see
  ``loop.loss_decay_gamma``).
* ``ce_terms``: cross-entropy of the unary logits against the labels (DFlash's whole loss).
* ``l1_terms``: L1 distance ``Σ_v |softmax(logits) - teacher|`` to the target's distribution.
* ``refinement_terms``: last-write-refined scores over the **detached** top-K unary candidates:
  ``ce_weight·CE`` on labels the candidates cover + ``(1-ce_weight)·L1`` to the teacher renormalised on
  the candidates, the L1 only where the teacher's candidate mass exceeds the threshold.
* ``alignment_terms``: ``Σ_layers (1 - cos(feature_l, C[label]))``.
* ``kl_divergence`` / ``acceptance``: per slot, ``KL(teacher ‖ draft)`` (vLLM speculators' default ``kl_div``
  loss, DSpark's and EAGLE-3's) and the overlap ``Σ_v min(q, p) = 1 − TV`` (the rejection-sampling acceptance
  rate, DSpark's confidence target).
* ``dspine_schedule``: β (alignment weight, linear warm-up 0→alignment_weight) and the predecessor
  replacement probability (held at p until ``hold`` of training, then linearly to 0 at ``end``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array


def slot_weights(supervised: Array, gamma: float | None = 7.0) -> Array:
    """``supervised [..., P]`` bool → float32 weights ``[..., P]`` (cumulative mask × exp decay)."""
    cum = jnp.cumprod(supervised.astype(jnp.int32), axis=-1).astype(jnp.float32)
    if gamma is not None and gamma > 0:
        cum = cum * jnp.exp(-jnp.arange(supervised.shape[-1], dtype=jnp.float32) / gamma)
    return cum


def ce_terms(logits: Array, labels: Array, weights: Array) -> tuple[Array, Array]:
    """Weighted CE numerator and the per-slot log-probabilities ``[..., V]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(ce * weights), logp


def l1_terms(logp: Array, teacher: Array, weights: Array) -> Array:
    """``Σ weights · Σ_v |exp(logp) - teacher|``."""
    l1 = jnp.sum(jnp.abs(jnp.exp(logp) - teacher), axis=-1)
    return jnp.sum(l1 * weights)


def refinement_terms(
    scores: Array,
    cand_ids: Array,
    labels: Array,
    teacher: Array,
    weights: Array,
    ce_weight: float = 0.1,
    mass_threshold: float = 1e-4,
) -> tuple[Array, Array]:
    """``scores [..., K]`` refined logits over ``cand_ids [..., K]``; ``teacher [..., V]`` probabilities, indexed
    like ``cand_ids`` and ``labels`` (token ids, or indices into a draft vocabulary; a label outside it is -1).
    Returns the weighted numerator and the per-slot coverage (label among candidates)."""
    logq = jax.nn.log_softmax(scores.astype(jnp.float32), axis=-1)
    target = jnp.take_along_axis(teacher, cand_ids, axis=-1)
    mass = jnp.sum(target, axis=-1)
    target = target / jnp.maximum(mass, 1e-30)[..., None]
    covered = cand_ids == labels[..., None]
    r_ce = -jnp.sum(jnp.where(covered, logq, 0.0), axis=-1)
    r_l1 = jnp.sum(jnp.abs(jnp.exp(logq) - target), axis=-1) * (mass > mass_threshold)
    return jnp.sum((ce_weight * r_ce + (1 - ce_weight) * r_l1) * weights), jnp.any(covered, axis=-1)


def kl_divergence(logp: Array, teacher_logp: Array) -> Array:
    """``KL(p ‖ q) = Σ_v p (log p − log q)`` per slot ``[...]`` from log-probabilities ``[..., V]`` (draft ``logp``,
    teacher ``teacher_logp``)."""
    return jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - logp), axis=-1)


def acceptance(logp: Array, teacher: Array) -> Array:
    """``Σ_v min(q, p) = 1 − TV(q, p)`` per slot ``[...]``: a draft drawn from ``q = exp(logp)`` is accepted with
    this probability by rejection sampling against ``teacher`` probabilities ``p``."""
    return jnp.sum(jnp.minimum(jnp.exp(logp), teacher), axis=-1)


def alignment_terms(features: Array, codes: Array, weights: Array) -> Array:
    """``features [L, ..., R]`` vs the labels' codes ``[..., R]``: ``Σ weights · Σ_l (1 - cos)``
    (cosine with torch's eps 1e-8 on each norm)."""
    f = features.astype(jnp.float32)
    c = codes.astype(jnp.float32)
    dot = jnp.sum(f * c[None], axis=-1)
    nf = jnp.maximum(jnp.linalg.norm(f, axis=-1), 1e-8)
    nc = jnp.maximum(jnp.linalg.norm(c, axis=-1), 1e-8)
    return jnp.sum((1.0 - dot / (nf * nc[None])) * weights[None])


def dspine_schedule(step, total_steps: int, settings: dict) -> tuple[Array, Array]:
    """SpecForge ``DSpineConfig.schedule``: (β, replacement probability) at ``step`` (traceable)."""
    step = jnp.maximum(jnp.asarray(step, jnp.float32), 0.0)
    warmup = settings["alignment_warmup_steps"]
    ramp = jnp.minimum(step / warmup, 1.0) if warmup else 1.0
    beta = settings["alignment_weight"] * ramp
    if not total_steps or total_steps <= 0:
        return beta, jnp.float32(0.0)
    progress = step / total_steps
    hold, end = settings["replacement_hold_ratio"], settings["replacement_end_ratio"]
    fraction = jnp.clip((end - progress) / (end - hold), 0.0, 1.0)
    return beta, settings["replacement_probability"] * fraction
