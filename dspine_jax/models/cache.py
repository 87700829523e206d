"""Target KV cache: static capacity, one committed length per batch row.

Slot ``s`` of a row holds the K/V of the token at absolute position ``s``. A block forward writes its
tokens at ``lengths … lengths+T-1`` but does not move ``lengths``: the caller commits how many of them
are kept (all of them in autoregressive decoding, the accepted prefix in a speculative round).
Uncommitted slots are overwritten later and are never visible, because a query at position ``p``
only sees slots ``≤ p``, all of which were written before the query ran.

``HybridCache`` (Qwen3.5 / Qwen3-Next targets) adds, per Gated-DeltaNet layer, the conv window and
the recurrent state. Unlike K/V these are *not* position-indexed: a block forward advances them past
every token of the block. ``commit(n)`` therefore only keeps the state consistent when ``n`` equals
the block length (autoregressive decoding); a speculative round that keeps a shorter prefix must
rewind them with ``hybrid.replay`` (which also commits), see dspine_jax/models/hybrid.py.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.models.config import HybridConfig, TargetConfig
from dspine_jax.parallel.mesh import constrain

# Logical layouts (dspine_jax/parallel/mesh.py): rows over ``data``, KV / value heads over ``model``.
KV_AXES = ("batch", "kv_heads", None, None)  # [B, K, S, D]
LENGTHS_AXES = ("batch",)


def resize_slots(x: Array, slots: int) -> Array:
    """``x [B, K, S, D]`` with ``slots`` slots along S: zeros appended, or the tail dropped."""
    have = x.shape[2]
    if slots <= have:
        return x[:, :, :slots]
    return jnp.concatenate([x, jnp.zeros((*x.shape[:2], slots - have, x.shape[3]), x.dtype)], axis=2)


def sharded_zeros(shape: tuple[int, ...], dtype: jnp.dtype, axes: tuple[str | None, ...]) -> Array:
    return constrain(jnp.zeros(shape, dtype), axes)


class _Rows:
    """What every target cache has: ``lengths [B]`` committed tokens per row, K/V buffers of ``capacity``
    slots (``v``), and a commit of the block just written."""

    @property
    def capacity(self) -> int:
        return self.v[0].shape[2]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    # Setting ``lengths = m`` keeps a valid cache of the first ``m`` tokens (the serving prefix cache
    # reuses prefixes of finished rows). True for K/V; not for recurrent state, which exists only at the end.
    prefix_truncatable = True

    def commit(self, num_tokens: Array):
        """Keep ``num_tokens [B]`` more tokens of the block just written."""
        return self.replace(lengths=self.lengths + num_tokens.astype(jnp.int32))

    def with_capacity(self, capacity: int):
        """The cache with ``capacity`` K/V slots (empty ones appended, or the tail dropped). The serving
        engine grows and shrinks its caches this way, so attention spans what the requests need, not the
        whole context; the caller keeps every row's positions below ``capacity``. Non-positional state
        (a hybrid's GDN windows and recurrent states) is unchanged."""
        fit = lambda x: resize_slots(x, capacity)  # noqa: E731
        return self.replace(k=tuple(map(fit, self.k)), v=tuple(map(fit, self.v)))


@struct.dataclass
class KVCache(_Rows):
    # One buffer per layer, heads-major: exactly the operands attention consumes, so a decode step
    # neither slices a stacked cache nor transposes it (on XLA:CPU both are full copies).
    k: tuple[Array, ...]  # L × [B, K, S, D]
    v: tuple[Array, ...]  # L × [B, K, S, D]
    lengths: Array  # [B] int32, committed tokens per row


def init_kv_cache(config: TargetConfig, batch: int, capacity: int, dtype: jnp.dtype) -> KVCache:
    shape = (batch, config.num_kv_heads, capacity, config.head_dim)
    return KVCache(
        k=tuple(sharded_zeros(shape, dtype, KV_AXES) for _ in range(config.num_layers)),
        v=tuple(sharded_zeros(shape, dtype, KV_AXES) for _ in range(config.num_layers)),
        lengths=sharded_zeros((batch,), jnp.int32, LENGTHS_AXES),
    )


@struct.dataclass
class HybridCache(_Rows):
    """Cache of a hybrid target: K/V for the full-attention layers only, GDN state for the others.

    Per-layer buffers, like ``KVCache``: ``La`` full-attention layers and ``Lg`` GDN layers (each in
    layer order). ``C`` = GDN conv channels (q, k, v concatenated), ``W`` = conv kernel − 1,
    ``Nv`` value heads, ``Dk``/``Dv`` key/value head dims.
    """

    k: tuple[Array, ...]  # La × [B, K, S, D]
    v: tuple[Array, ...]  # La × [B, K, S, D]
    conv: tuple[Array, ...]  # Lg × [B, C, W] float32: the last W conv inputs (pre-conv q|k|v projections)
    state: tuple[Array, ...]  # Lg × [B, Nv, Dk, Dv] float32: recurrent state
    lengths: Array  # [B] int32, committed tokens per row
    # ``commit`` keeps the GDN state right only when it keeps the whole block; a shorter prefix needs
    # ``hybrid.replay`` (it rewinds the GDN state and commits in one step).
    prefix_truncatable = False  # the GDN state is that of the last committed token only


def init_hybrid_cache(config: HybridConfig, batch: int, capacity: int, dtype: jnp.dtype) -> HybridCache:
    if not config.attention_layers:
        raise ValueError("a hybrid target needs at least one full-attention layer (its K/V cache sets the capacity)")
    kv_shape = (batch, config.num_kv_heads, capacity, config.head_dim)
    conv_shape = (batch, config.gdn_conv_dim, config.linear_conv_kernel - 1)
    state_shape = (batch, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    la, lg = len(config.attention_layers), len(config.gdn_layers)
    return HybridCache(
        k=tuple(sharded_zeros(kv_shape, dtype, KV_AXES) for _ in range(la)),
        v=tuple(sharded_zeros(kv_shape, dtype, KV_AXES) for _ in range(la)),
        conv=tuple(sharded_zeros(conv_shape, jnp.float32, ("batch", "heads", None)) for _ in range(lg)),
        state=tuple(sharded_zeros(state_shape, jnp.float32, ("batch", "heads", None, None)) for _ in range(lg)),
        lengths=sharded_zeros((batch,), jnp.int32, LENGTHS_AXES),
    )
