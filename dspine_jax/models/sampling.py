"""Logits processing and token sampling, shared by plain and speculative decoding.

Processing order follows HF transformers' ``generate``: temperature, then top-k, then top-p. Greedy
decoding (temperature 0) is the argmax of the raw logits. ``top_k`` is static (it fixes a shape);
``temperature`` and ``top_p`` are traced scalars, so changing them does not recompile. The speculative
round and the serving engine take ``Sampling``: the same parameters per row (``process_rows``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
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


# ----------------------------------------------------------------------------------------------
# Per-row parameters (the speculative round and the serving engine: every row its own request)


@struct.dataclass
class Sampling:
    """Sampling parameters per row ``[B]``: temperature (0 = greedy row), top-p (1 = off), top-k (0 = off)."""

    temperature: Array  # [B] float32
    top_p: Array  # [B] float32
    top_k: Array  # [B] int32

    @staticmethod
    def rows(batch: int, temperature: Array | float = 0.0, top_p: Array | float = 1.0, top_k: Array | int = 0) -> Sampling:
        """The same parameters (scalars, traced or not) for ``batch`` rows; ``[B]`` arrays pass through."""
        full = lambda x, dtype: jnp.broadcast_to(jnp.asarray(x, dtype), (batch,))  # noqa: E731
        return Sampling(full(temperature, jnp.float32), full(top_p, jnp.float32), full(top_k, jnp.int32))

    @property
    def greedy(self) -> Array:
        return self.temperature <= 0


def process_rows(logits: Array, sampling: Sampling) -> Array:
    """``logits [B, ..., V]`` with row ``b``'s own parameters → float32 logits, filtered tokens at ``-inf``.

    Same order and tie rules as ``process_logits`` (temperature, then top-k, then top-p over the top-k
    survivors; top-p keeps the token crossing the threshold). Greedy rows are left at temperature 1.
    ``lax.top_k`` needs a static k, so the k-th largest logit is read from a descending sort at a per-row
    index; the sort runs only when some row asks for top-k or top-p (``lax.cond``)."""
    v = logits.shape[-1]
    expand = lambda x: x.reshape(x.shape + (1,) * (logits.ndim - 1))  # noqa: E731  [B] → [B, 1, …, 1]
    temperature = jnp.where(sampling.greedy, 1.0, sampling.temperature)
    x = logits.astype(jnp.float32) / expand(temperature)
    top_k = jnp.where((sampling.top_k > 0) & (sampling.top_k < v), sampling.top_k, v)
    top_p = sampling.top_p

    def cut(x: Array) -> Array:
        desc = jnp.sort(x, axis=-1)[..., ::-1]
        k = expand(top_k)
        kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)), axis=-1)
        x = jnp.where(x < kth, -jnp.inf, x)
        desc = jnp.where(jnp.arange(v) < k, desc, -jnp.inf)
        probs = jax.nn.softmax(desc, axis=-1)
        keep = jnp.cumsum(probs, axis=-1) - probs < expand(top_p)
        threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        threshold = jnp.where(expand(top_p < 1.0), threshold, -jnp.inf)
        return jnp.where(x < threshold, -jnp.inf, x)

    return jax.lax.cond(jnp.any((top_k < v) | (top_p < 1.0)), cut, lambda x: x, x)


def split_rows(keys: Array, num: int) -> Array:
    """Typed keys ``[B]`` → ``[B, num]``: every row draws from its own stream."""
    return jax.vmap(lambda k: jax.random.split(k, num))(keys)


def categorical_rows(keys: Array, logits: Array) -> Array:
    """One draw per row: keys ``[B]``, logits ``[B, V]`` → ``[B]`` int32."""
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
