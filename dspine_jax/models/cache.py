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

``kv_cache_dtype="int8"`` stores each attention layer's K and V as an ``Int8KV``: int8 values and one
float32 scale per row, head and slot (symmetric absmax over the head dim), quantised when a block is
written (``write_block``) and read by attention through its scales (``layers.cached_attention``). One
scale per *token* makes a slot's content independent of which block wrote it, so a verify block and a
decode step store the same bytes for the same K/V, and rejected slots beyond ``lengths`` are simply
overwritten, as in float caches. The GDN conv windows and recurrent states stay float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.models.config import HybridConfig, TargetConfig
from dspine_jax.parallel.mesh import constrain, per_device

# Logical layouts (dspine_jax/parallel/mesh.py): rows over ``data``, KV / value heads over ``model``.
KV_AXES = ("batch", "kv_heads", None, None)  # [B, K, S, D]
LENGTHS_AXES = ("batch",)


# ``kv_cache_dtype`` values: "auto" (the model's dtype, also spelled "none" or None) or "int8".
KV_CACHE_DTYPES = ("auto", "int8")
KV_QMAX = 127  # symmetric: -128 is never used


def resolve_kv_cache_dtype(kv_cache_dtype: str | None) -> str:
    """``None`` / "none" / "auto" → "auto"; "int8" stays; anything else is a ValueError."""
    value = "auto" if kv_cache_dtype in (None, "none") else kv_cache_dtype
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, none, int8; got {kv_cache_dtype!r}")
    return value


@struct.dataclass
class Int8KV:
    """One layer's int8 K or V buffer: ``x ≈ q · scale`` per row, head and slot, within ``scale / 2``.

    Stands in for the float ``[B, K, S, D]`` buffer in a cache's ``k``/``v`` tuples (``shape`` is the
    buffer's); attention consumes ``q`` and ``scale`` without materialising the float buffer."""

    q: Array  # [B, K, S, D] int8
    scale: Array  # [B, K, S, 1] float32 (0 in slots never written)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


def quantize_kv(x: Array) -> tuple[Array, Array]:
    """``x [..., D]`` → int8 ``q [..., D]`` and float32 ``scale [..., 1]`` (symmetric absmax over D; an
    all-zero vector gets scale 1)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / KV_QMAX, 1.0)
    return jnp.clip(jnp.round(x32 / scale), -KV_QMAX, KV_QMAX).astype(jnp.int8), scale


def dequantize_kv(buf: Int8KV | Array, dtype: jnp.dtype) -> Array:
    """The float buffer ``q · scale`` in ``dtype`` (a float buffer passes through)."""
    if isinstance(buf, Int8KV):
        return (buf.q.astype(jnp.float32) * buf.scale).astype(dtype)
    return buf


def attention_operands(buf: Int8KV | Array) -> tuple[Array, Array | None]:
    """What ``layers.cached_attention`` takes for one of K / V: values ``[B, K, S, D]`` and their per-slot
    scales ``[B, K, S, 1]`` (None for a float buffer)."""
    return (buf.q, buf.scale) if isinstance(buf, Int8KV) else (buf, None)


def resize_slots(x: Int8KV | Array, slots: int) -> Int8KV | Array:
    """``x [B, K, S, D]`` with ``slots`` slots along S: zeros appended, or the tail dropped."""
    if isinstance(x, Int8KV):
        return Int8KV(q=resize_slots(x.q, slots), scale=resize_slots(x.scale, slots))
    have = x.shape[2]
    if slots <= have:
        return x[:, :, :slots]
    return jnp.concatenate([x, jnp.zeros((*x.shape[:2], slots - have, x.shape[3]), x.dtype)], axis=2)


def sharded_zeros(shape: tuple[int, ...], dtype: jnp.dtype, axes: tuple[str | None, ...]) -> Array:
    return constrain(jnp.zeros(shape, dtype), axes)


def kv_zeros(shape: tuple[int, ...], dtype: jnp.dtype, kv_cache_dtype: str = "auto") -> Int8KV | Array:
    """An empty ``[B, K, S, D]`` K or V buffer: ``dtype`` zeros, or (``"int8"``) an ``Int8KV`` whose scales
    are laid out like the values (rows on ``data``, KV heads on ``model``)."""
    if resolve_kv_cache_dtype(kv_cache_dtype) == "int8":
        scale_shape = (*shape[:3], 1)
        return Int8KV(q=sharded_zeros(shape, jnp.int8, KV_AXES), scale=sharded_zeros(scale_shape, jnp.float32, KV_AXES))
    return sharded_zeros(shape, dtype, KV_AXES)


# Up to this many rows, blocks are written row by row with dynamic_update_slice, which XLA does in
# place; a scatter along the position axis makes XLA:CPU transpose the whole layer cache. Past it,
# the unrolled row loop would bloat the program, so large batches use one scatter.
ROW_LOOP_MAX_BATCH = 16


def _write_heads_major(cache: Array, block: Array, lengths: Array, scatter_above: int) -> Array:
    """``block [B, K, T, D]`` into ``cache [B, K, S, D]`` at slots ``lengths[b] + t``."""
    b, _, t, _ = block.shape
    block = block.astype(cache.dtype)
    if b <= scatter_above:
        for row in range(b):
            cache = jax.lax.dynamic_update_slice(cache, block[row : row + 1], (row, 0, lengths[row], 0))
        return cache
    positions = lengths[:, None] + jnp.arange(t)  # [B, T]
    rows, heads = jnp.arange(b)[:, None, None], jnp.arange(cache.shape[1])[None, :, None]
    return cache.at[rows, heads, positions[:, None, :]].set(block, mode="drop")


def write_block(
    cache: Int8KV | Array, block: Array, lengths: Array, *, scatter_above: int = ROW_LOOP_MAX_BATCH
) -> Int8KV | Array:
    """Write ``block [B, T, K, D]`` into ``cache [B, K, S, D]`` at positions ``lengths[b] + t`` (an
    ``Int8KV`` gets the block quantised per row, head and token).

    Callers keep ``lengths + T <= S`` for every row whose output matters (dynamic_update_slice clamps
    the start so the block fits; the scatter path, used above ``scatter_above`` rows, drops
    out-of-range positions).
    """
    heads = block.transpose(0, 2, 1, 3)  # [B, K, T, D]
    # Per device on a mesh: each device writes its own rows and heads. GSPMD does not see that a row-indexed
    # write stays on the row's data shard and would move every row's block to the first shard and back (two
    # collective-permutes per layer and round; the ones that cross hosts when ``data`` does).
    write = per_device(lambda c, x, n: _write_heads_major(c, x, n, scatter_above), [KV_AXES, KV_AXES, ("batch",)],
                       KV_AXES)  # fmt: skip
    if isinstance(cache, Int8KV):
        q, scale = quantize_kv(heads)
        return Int8KV(q=write(cache.q, q, lengths), scale=write(cache.scale, scale, lengths))
    return write(cache, heads, lengths)


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
    k: tuple[Array | Int8KV, ...]  # L × [B, K, S, D]
    v: tuple[Array | Int8KV, ...]  # L × [B, K, S, D]
    lengths: Array  # [B] int32, committed tokens per row


def init_kv_cache(
    config: TargetConfig, batch: int, capacity: int, dtype: jnp.dtype, kv_cache_dtype: str = "auto"
) -> KVCache:
    shape = (batch, config.num_kv_heads, capacity, config.head_dim)
    return KVCache(
        k=tuple(kv_zeros(shape, dtype, kv_cache_dtype) for _ in range(config.num_layers)),
        v=tuple(kv_zeros(shape, dtype, kv_cache_dtype) for _ in range(config.num_layers)),
        lengths=sharded_zeros((batch,), jnp.int32, LENGTHS_AXES),
    )


@struct.dataclass
class HybridCache(_Rows):
    """Cache of a hybrid target: K/V for the full-attention layers only, GDN state for the others.

    Per-layer buffers, like ``KVCache``: ``La`` full-attention layers and ``Lg`` GDN layers (each in
    layer order). ``C`` = GDN conv channels (q, k, v concatenated), ``W`` = conv kernel − 1,
    ``Nv`` value heads, ``Dk``/``Dv`` key/value head dims.
    """

    k: tuple[Array | Int8KV, ...]  # La × [B, K, S, D]
    v: tuple[Array | Int8KV, ...]  # La × [B, K, S, D]
    conv: tuple[Array, ...]  # Lg × [B, C, W] float32: the last W conv inputs (pre-conv q|k|v projections)
    state: tuple[Array, ...]  # Lg × [B, Nv, Dk, Dv] float32: recurrent state
    lengths: Array  # [B] int32, committed tokens per row
    # ``commit`` keeps the GDN state right only when it keeps the whole block; a shorter prefix needs
    # ``hybrid.replay`` (it rewinds the GDN state and commits in one step).
    prefix_truncatable = False  # the GDN state is that of the last committed token only


def init_hybrid_cache(
    config: HybridConfig, batch: int, capacity: int, dtype: jnp.dtype, kv_cache_dtype: str = "auto"
) -> HybridCache:
    if not config.attention_layers:
        raise ValueError("a hybrid target needs at least one full-attention layer (its K/V cache sets the capacity)")
    kv_shape = (batch, config.num_kv_heads, capacity, config.head_dim)
    conv_shape = (batch, config.gdn_conv_dim, config.linear_conv_kernel - 1)
    state_shape = (batch, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    la, lg = len(config.attention_layers), len(config.gdn_layers)
    return HybridCache(
        k=tuple(kv_zeros(kv_shape, dtype, kv_cache_dtype) for _ in range(la)),
        v=tuple(kv_zeros(kv_shape, dtype, kv_cache_dtype) for _ in range(la)),
        conv=tuple(sharded_zeros(conv_shape, jnp.float32, ("batch", "heads", None)) for _ in range(lg)),
        state=tuple(sharded_zeros(state_shape, jnp.float32, ("batch", "heads", None, None)) for _ in range(lg)),
        lengths=sharded_zeros((batch,), jnp.int32, LENGTHS_AXES),
    )
