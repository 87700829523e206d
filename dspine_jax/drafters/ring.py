"""The draft context ring: the ``DraftCache`` pytree and the functions that create, resize, address, append
to and attend over it.

Draft context cache
===================

``DraftCache.k/v`` (L × ``[B, K, S, D]``, heads-major) hold, per drafter layer, the context keys (after
``k_norm`` and RoPE at their absolute positions) and values computed from ``ctx = hidden_norm(fc(concat(taps)))``.
It is a **ring buffer**: position ``p`` lives in slot ``p mod S``; slot positions are derived from
``lengths`` (no stored positions), and a slot whose position is negative is empty. ``S`` is the capacity; when every
layer has a sliding window ``W`` the ring only needs ``W - 1`` slots (the anchor at ``start`` sees
``start-W+1 …``), which is what ``init_draft_cache`` allocates, so an 8192-window drafter costs 8191 slots
however long the sequence. With unwindowed layers the capacity must cover the whole sequence; if it
does not, the ring silently acts as a window of ``S`` (keys older than ``S`` are overwritten).
With ``kv_cache_dtype="int8"`` (the target's, passed by ``DrafterProposer.init``) each layer's ring is a
``cache.Int8KV`` (int8 + a float32 scale per row, head and slot), quantised in ``append_context`` and
dequantised per layer just before draft attention (``cache_attention``; the Pallas kernels read float rings).

The ring's invariant (the anchor at ``cache.lengths``) and its place in a round are in drafter.py's module
doc. ``fuse_context`` and ``context_kv`` are also training's context path (``train/model.py``), which attends
over the whole sequence instead of a ring. It takes a ``Drafter`` (``params.py``); drafter.py imports from here, never the other way round. Letters as in drafter.py.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.drafters.params import Attend, Drafter
from dspine_jax.models.cache import (
    LENGTHS_AXES,
    Int8KV,
    dequantize_kv,
    kv_zeros,
    quantize_kv,
    resize_slots,
    sharded_zeros,
)
from dspine_jax.models.layers import apply_rope, rms_norm, rope_cos_sin
from dspine_jax.pallas import draft_attention as _attention_kernel
from dspine_jax.parallel.mesh import per_device


@struct.dataclass
class DraftCache:
    """Per drafter layer, the committed context's K/V in a ring of ``S`` slots (see module doc).

    Heads-major ``[B, K, S, D]`` per layer (a tuple, one buffer per layer) because that is the layout
    both attention products consume: any other layout makes XLA transpose (copy) the whole context at
    every draft, and a stacked ``[L, …]`` array would be sliced (copied) per layer.
    """

    k: tuple[Array | Int8KV, ...]  # L × [B, K, S, D] after k_norm + RoPE
    v: tuple[Array | Int8KV, ...]  # L × [B, K, S, D]
    lengths: Array  # [B] int32: context tokens committed so far = position of the next anchor

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


def ring_slots(drafter: Drafter, capacity: int) -> int:
    """Ring slots for rows of up to ``capacity`` positions: ``capacity``, capped at ``max(window) - 1``
    when every layer is windowed."""
    windows = drafter.config.layer_windows
    return min(capacity, max(max(windows) - 1, 1)) if all(w > 0 for w in windows) else capacity


def init_draft_cache(drafter: Drafter, batch: int, capacity: int, kv_cache_dtype: str = "auto") -> DraftCache:
    """An empty ring for ``batch`` rows. ``capacity`` = the longest sequence (prompt + generated) a row
    will reach; with every layer windowed the ring is capped at ``max(window) - 1`` slots.
    ``kv_cache_dtype``: "auto" (the drafter's dtype) or "int8" (``Int8KV`` per layer)."""
    config = drafter.config
    slots = ring_slots(drafter, capacity)
    shape = (batch, config.num_kv_heads, slots, config.head_dim)
    zeros = tuple(kv_zeros(shape, drafter.dtype, kv_cache_dtype) for _ in range(config.num_layers))
    return DraftCache(k=zeros, v=zeros, lengths=sharded_zeros((batch,), jnp.int32, LENGTHS_AXES))


def resize_ring(drafter: Drafter, cache: DraftCache, capacity: int) -> DraftCache:
    """The ring for rows of up to ``capacity`` positions. Valid while every row's positions are below
    both slot counts: a ring that never wrapped holds position ``p`` in slot ``p``."""
    slots = ring_slots(drafter, capacity)
    if slots == cache.capacity:
        return cache
    fit = lambda x: resize_slots(x, slots)  # noqa: E731
    return cache.replace(k=tuple(map(fit, cache.k)), v=tuple(map(fit, cache.v)))


def context_slot_positions(cache: DraftCache) -> Array:
    """Absolute position held by each ring slot ``[B, S]`` (negative = empty): the latest p < lengths
    with p ≡ slot (mod S)."""
    return _attention_kernel.ring_positions(cache.lengths, cache.capacity)


def concat_taps(drafter: Drafter, tapped: Array) -> Array:
    """``tapped [n, B, T, H]`` (tap order) → ``[B, T, n·H]`` in the drafter's dtype: what ``fc`` reads.

    Concatenation order is tap order along H, like z-lab's ``extract_context_feature``."""
    n, b, t, h = tapped.shape
    if n != drafter.config.num_taps or h != drafter.config.hidden_size:
        raise ValueError(
            f"tapped features have shape {tapped.shape}; the drafter expects "
            f"[{drafter.config.num_taps}, B, T, {drafter.config.hidden_size}]"
        )
    return jnp.transpose(tapped, (1, 2, 0, 3)).reshape(b, t, n * h).astype(drafter.dtype)


def fuse_features(drafter: Drafter, features: Array) -> Array:
    """Concatenated taps ``[B, T, n·H]`` → ``ctx = hidden_norm(fc(features)) [B, T, H]``."""
    return rms_norm(features @ drafter.params.fc, drafter.params.hidden_norm, drafter.config.rms_norm_eps)


def fuse_context(drafter: Drafter, tapped: Array) -> Array:
    """``tapped [n, B, T, H]`` (tap order) → ``ctx = hidden_norm(fc(concat)) [B, T, H]``."""
    return fuse_features(drafter, concat_taps(drafter, tapped))


def context_kv(drafter: Drafter, layer: int, ctx: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
    """One layer's context keys (k_norm, RoPE) and values from ``ctx [B, S, H]`` → ``[B, S, K, D]`` each.
    ``ctx`` does not pass through ``input_layernorm``."""
    config, lp = drafter.config, drafter.params.layers[layer]
    b, s, _ = ctx.shape
    kh, d = config.num_kv_heads, config.head_dim
    k = apply_rope(rms_norm((ctx @ lp.k).reshape(b, s, kh, d), lp.k_norm, config.rms_norm_eps), cos, sin)
    return k, (ctx @ lp.v).reshape(b, s, kh, d)


def append_context(drafter: Drafter, cache: DraftCache, tapped: Array, num_new: Array) -> DraftCache:
    """Commit ``num_new [B]`` (≤ T) tokens' target features ``tapped [n, B, T, H]`` at positions
    ``lengths … lengths+num_new-1``: every layer's context K/V into the ring, then ``lengths += num_new``."""
    return append_features(drafter, cache, concat_taps(drafter, tapped), num_new)


def append_features(drafter: Drafter, cache: DraftCache, features: Array, num_new: Array) -> DraftCache:
    """``append_context`` from the concatenated taps ``features [B, T, n·H]`` (``concat_taps``).

    Context K/V depend only on ``ctx`` and each layer's own k/v projections, so every layer's are
    computed here, once, rather than inside the draft forward. Only the last ``S`` of a row's new tokens
    are written (a long prompt into a short window ring), so no two writes of one call hit the same slot.
    """
    b, _, s, d = cache.k[0].shape
    t = features.shape[1]
    ctx = fuse_features(drafter, features)  # [B, T, H]
    positions = cache.lengths[:, None] + jnp.arange(t)  # [B, T]
    cos, sin = rope_cos_sin(positions, d, drafter.config.rope_theta, ctx.dtype)  # [B, T, D]
    num_new = num_new.astype(jnp.int32)
    offset = jnp.arange(t)[None, :]
    keep = (offset < num_new[:, None]) & (offset >= num_new[:, None] - s)  # [B, T]
    slots = jnp.where(keep, jnp.mod(positions, s), s)  # slot s is out of range → dropped
    rows = jnp.arange(b)[:, None]

    def put(ring: Array | Int8KV, x: Array) -> Array | Int8KV:  # x [B, T, K, D] into slots [B, T] of every head
        # A scatter along S of the heads-major buffer: in place (no cache-sized copy) for f32 on
        # XLA:CPU and on accelerators. (XLA:CPU converts a bf16 buffer to f32 around a scatter.)
        if isinstance(ring, Int8KV):
            q, scale = quantize_kv(x)  # per row, token and head: [B, T, K, D], [B, T, K, 1]
            return Int8KV(q=put(ring.q, q), scale=put(ring.scale, scale))
        return ring.at[rows, :, slots].set(x, mode="drop")

    new_k, new_v = [], []
    for layer, (cache_k, cache_v) in enumerate(zip(cache.k, cache.v)):
        k, v = context_kv(drafter, layer, ctx, cos, sin)  # [B, T, K, D]
        new_k.append(put(cache_k, k))
        new_v.append(put(cache_v, v))
    return cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new)


def cache_attention(drafter: Drafter, cache: DraftCache) -> Attend:
    """Inference attention: the block against the ring cache's context and causally/bidirectionally
    inside itself (one block per row)."""
    config = drafter.config
    # Kernel dispatch (kernels/pallas/dispatch.py, at trace time): the jnp reference, or the Pallas kernel with
    # the same semantics (tiles skipped, not masked). Under a mesh each device attends its own rows and heads
    # (query heads split together with their KV heads).
    heads, kv_heads, ctx = ("batch", None, "heads", None), ("batch", None, "kv_heads", None), ("batch", "kv_heads", None, None)

    def attend(layer: int, q: Array, k: Array, v: Array) -> Array:
        attention = per_device(
            functools.partial(_attention_kernel.draft_attention, window=config.layer_windows[layer], causal=config.layer_causal[layer]),
            [heads, ctx, ctx, kv_heads, kv_heads, ("batch",)], heads,
        )  # fmt: skip
        # An int8 ring is dequantised here, one layer at a time: both attention paths read float rings.
        ctx_k, ctx_v = dequantize_kv(cache.k[layer], drafter.dtype), dequantize_kv(cache.v[layer], drafter.dtype)
        return attention(q, ctx_k, ctx_v, k, v, cache.lengths)

    return attend
