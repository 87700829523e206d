"""Reference math shared by the target and the drafter: norms, RoPE, attention, SwiGLU.

Einsum vocabulary (used in every module of the package):

    B batch rows          T query/block tokens     S key slots (cache capacity or context)
    H model width         N query heads            K key/value heads     G = N / K query heads per kv head
    D head dim            F MLP width              V vocabulary          L layers
    C top-K candidates    R transfer rank          M message width

Linear weights are stored ``[in, out]`` (torch checkpoints are ``[out, in]``; weights.py transposes).
Norm statistics, softmax and RoPE angles are computed in float32 whatever the parameter dtype, the
way HF transformers does, so bf16 results track HF's bf16 results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

# Finite "minus infinity": a fully masked row gives a uniform softmax instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def rms_norm(x: Array, weight: Array, eps: float, zero_centered: bool = False) -> Array:
    """RMSNorm over the last axis. ``zero_centered`` scales by ``1 + w`` (Qwen3.5/Next)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def rope_cos_sin(positions: Array, rotary_dim: int, theta: float, dtype: jnp.dtype) -> tuple[Array, Array]:
    """``positions [B, T]`` → cos, sin ``[B, T, rotary_dim]`` (HF "rotate_half" layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate ``x [B, T, heads, D]``; only the first ``cos.shape[-1]`` dims (partial RoPE)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


SMALL_BLOCK = 1


def attention(q: Array, k: Array, v: Array, visible: Array) -> Array:
    """Grouped-query attention over keys in ``[B, S, K, D]`` layout (small, freshly computed K/V)."""
    return cached_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), visible)


def cached_attention(
    q: Array, k: Array, v: Array, visible: Array, k_scale: Array | None = None, v_scale: Array | None = None
) -> Array:
    """Grouped-query attention over a cache laid out heads-major.

    q ``[B, T, N, D]``, k/v ``[B, K, S, D]``, visible ``[B, T, S]`` bool → ``[B, T, N, D]``.
    Heads-major K/V are what both products consume directly: any other layout makes XLA transpose
    (copy) the whole layer cache at every decode step. Scores and softmax in float32; probabilities
    are cast back to the value dtype before the PV product.

    int8 K/V (``cache.Int8KV``) come with per-slot scales ``k_scale`` / ``v_scale [B, K, S, 1]``: a slot's
    scale multiplies its score and its probability, which equals attending over ``k · k_scale`` and
    ``v · v_scale`` without materialising those float buffers; the PV product then runs in ``q``'s dtype.
    """
    b, t, n, d = q.shape
    kv_heads, groups = k.shape[1], n // k.shape[1]
    q_heads = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    # Few queries (a plain step): multiply-and-reduce fusions stream the cache once in its own layout (as dots
    # XLA:CPU would copy every layer cache, every step). A block: one product per KV head with the group's
    # queries flattened, [G·T, D] @ [D, S] and [G·T, S] @ [S, D]; spelled with ``btkgd`` queries or outputs,
    # XLA:CPU computed Vᵀ·Pᵀ and copied the whole layer cache transposed every round.
    if t <= SMALL_BLOCK:
        qf, kf = q_heads.astype(jnp.float32), k.astype(jnp.float32)
        scores = jnp.sum(qf[:, :, :, :, None, :] * kf[:, :, None, None, :, :], axis=-1)
    else:
        keys = k if k_scale is None else k.astype(q.dtype)  # int8 → q's dtype (a dot needs one dtype)
        flat = q_heads.reshape(b, kv_heads, groups * t, d)
        scores = jnp.einsum("bkqd,bksd->bkqs", flat, keys, preferred_element_type=jnp.float32)
        scores = scores.reshape(b, kv_heads, groups, t, -1)  # [B, K, G, T, S]
    if k_scale is not None:
        scores = scores * k_scale[:, :, None, None, :, 0].astype(jnp.float32)  # [B, K, 1, 1, S]
    scores = jnp.where(visible[:, None, None, :, :], scores * (d**-0.5), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    value_dtype = v.dtype
    if v_scale is not None:
        probs, value_dtype = probs * v_scale[:, :, None, None, :, 0].astype(jnp.float32), q.dtype
    probs = probs.astype(value_dtype)
    if t <= SMALL_BLOCK:
        pv = probs.astype(jnp.float32)[..., None] * v.astype(jnp.float32)[:, :, None, None, :, :]
        out = jnp.sum(pv, axis=-2).astype(value_dtype)
    else:
        values = v if v_scale is None else v.astype(value_dtype)
        out = jnp.einsum("bkqs,bksd->bkqd", probs.reshape(b, kv_heads, groups * t, -1), values)
        out = out.reshape(b, kv_heads, groups, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, d)  # [B, K, G, T, D] → [B, T, N, D]


def swiglu(x: Array, gate: Array, up: Array, down: Array) -> Array:
    """``down(silu(x @ gate) * (x @ up))``; x ``[B, T, H]``, gate/up ``[H, F]``, down ``[F, H]``."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down
