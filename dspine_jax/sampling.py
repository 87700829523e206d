"""Logits processing and token sampling, shared by plain and speculative decoding.

Processing order follows HF transformers' ``generate``: temperature, then top-k, then top-p. Greedy
decoding (temperature 0) is the argmax of the raw logits. ``top_k`` is static (it fixes a shape);
``temperature`` and ``top_p`` are traced scalars, so changing them does not recompile.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import Array


def validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise ``ValueError`` with a clear message for parameters ``generate`` cannot honour."""
    if not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {top_k!r}")


def process_logits(logits: Array, temperature: Array | float, top_p: Array | float, top_k: int) -> Array:
    """``logits [..., V]`` → float32 logits with temperature applied and filtered tokens at ``-inf``."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    # top_p is traced: skip the full-vocabulary sort at run time when it is disabled.
    return jax.lax.cond(jnp.asarray(top_p) < 1.0, _top_p_filter, lambda x, _: x, logits, top_p)


def _top_p_filter(logits: Array, top_p: Array | float) -> Array:
    """Keep the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (the token that
    crosses the threshold is kept, and always at least one token)."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    # The smallest kept logit is the threshold; everything below it is dropped.
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sampling_probs(logits: Array, temperature: Array | float, top_p: Array | float, top_k: int) -> Array:
    """The distribution plain sampling draws from, ``[..., V]`` float32 (used by verification)."""
    return jax.nn.softmax(process_logits(logits, temperature, top_p, top_k), axis=-1)


def sample(key: Array, logits: Array, temperature: Array | float, top_p: Array | float, top_k: int, greedy: bool) -> Array:
    """One token id per row from ``logits [B, V]`` → ``[B]`` int32."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits, temperature, top_p, top_k), axis=-1).astype(jnp.int32)
