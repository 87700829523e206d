"""Gated DeltaNet (GDN): the linear-attention layer of Qwen3.5 / Qwen3-Next hybrid targets.

Reference jnp math, written to follow HF transformers' torch fallback paths
(``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn`` in
``transformers/models/qwen3_5/modeling_qwen3_5.py``) operation for operation.

Per value head, with q, k L2-normalised and q scaled by ``Dk^-1/2``::

    S ← e^g S;   u = β (v − Sᵀk);   S ← S + k uᵀ;   o = Sᵀq          (S: [Dk, Dv], fp32)

Three ways to run it, all with static shapes:

* ``gated_delta_recurrent`` — token by token (``lax.scan`` over T); used for single-token steps.
* ``gated_delta_chunked`` — the chunked (WY / UT-transform) form: intra-chunk work is batched
  matmuls plus one unit-lower-triangular inverse per chunk (by recursive block doubling: matmuls
  only), and only a ``lax.scan`` over chunks is sequential. Used for prefill and multi-token blocks
  on top of an existing state.
* ``replay_layer`` — the state after only the first ``n[b]`` tokens of a block, from the pre-block
  state and the per-token inputs saved by the block forward. Tokens ≥ n get ``g = 0, β = 0``, which
  makes their update the identity (``e^0 S + k·0``), so it is the chunked form on a fixed-length,
  masked block: one compilation for every n.

Einsum letters used here (GDN-local, complementing the package vocabulary in layers.py):
``b`` batch, ``t`` tokens, ``c`` chunk index, ``i``/``j`` positions inside a chunk, ``h`` GDN value
heads (``Nv``), ``d`` key head dim (``Dk``), ``e`` value head dim (``Dv``). Key heads (``Nk``) are
repeated to the ``Nv`` value heads (``Nv/Nk`` consecutive value heads share a key head).

The recurrence and its matmuls run in float32 with ``Precision.HIGHEST`` (on TPU/GPU the default
f32 matmul precision would drop to bf16/TF32 passes, and the state accumulates over the context).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from dspine_jax.models.config import HybridConfig
from dspine_jax.parallel.mesh import weight

HIGHEST = jax.lax.Precision.HIGHEST
DEFAULT_CHUNK = 64  # HF's chunk size


def _einsum(spec: str, *xs: Array) -> Array:
    return jnp.einsum(spec, *xs, precision=HIGHEST, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Parameters and replay record


@struct.dataclass
class GdnParams:
    """One GDN layer (leaves may carry a leading stacked-layer axis). Linear weights are ``[in, out]``.

    ``C = 2·Nk·Dk + Nv·Dv`` conv channels (q | k | v), ``Kc`` conv kernel width.
    """

    qkv: Array = weight(None, "heads", group="gdn")  # [H, C]      in_proj_qkv (for qwen3_next: unfused from in_proj_qkvz)
    z: Array = weight(None, "heads", group="gdn")  # [H, Nv*Dv]    output-gate projection
    b: Array = weight(None, "heads", group="gdn")  # [H, Nv]       β logits
    a: Array = weight(None, "heads", group="gdn")  # [H, Nv]       decay logits
    conv: Array = weight("heads", None, group="gdn")  # [C, Kc]    depthwise causal conv taps (oldest input first)
    dt_bias: Array = weight("heads", group="gdn")  # [Nv]
    a_log: Array = weight("heads", group="gdn")  # [Nv]
    norm: Array = weight()  # [Dv]       gated RMSNorm weight (plain ``w·x``, not zero-centred)
    out: Array = weight("heads", None, group="gdn")  # [Nv*Dv, H]
    # Tensor parallelism: conv channels stored as ``groups`` × [q | k | v] of Nk/G key heads and Nv/G value
    # heads, so one model shard holds whole heads (``regroup``). 1 = HF's [q | k | v].
    groups: int = struct.field(pytree_node=False, default=1)

    def for_mesh(self, config: HybridConfig, model_shards: int) -> tuple[GdnParams, dict[str, bool]]:
        """Split over ``model_shards`` when key and value heads both divide, conv channels regrouped so
        each shard holds its own q, k and v heads."""
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        split = model_shards > 1 and nk % model_shards == 0 and nv % model_shards == 0
        return (regroup(self, nk, model_shards) if split else self), {"gdn": split}


@struct.dataclass
class GdnReplay:
    """What ``replay_layer`` needs to rebuild a GDN layer's cache entry after a block.

    Saved by a block forward (``return_replay=True``), one per GDN layer. ``W = Kc − 1``.
    """

    conv: Array  # [B, C, W]  float32, conv window before the block
    state: Array  # [B, Nv, Dk, Dv] float32, recurrent state before the block
    conv_in: Array  # [B, T, C]  conv inputs (q|k|v projections), model dtype
    k: Array  # [B, T, Nk, Dk] keys after conv+SiLU (before L2 norm), model dtype
    v: Array  # [B, T, Nv, Dv] values after conv+SiLU, model dtype
    g: Array  # [B, T, Nv] float32 log-decay
    beta: Array  # [B, T, Nv] β = σ(b), model dtype


# ----------------------------------------------------------------------------------------------
# Depthwise causal conv


def conv_inputs(window: Array, x: Array) -> Array:
    """``[window ; x]``: window ``[B, C, W]``, x ``[B, T, C]`` → float32 ``[B, W+T, C]``."""
    return jnp.concatenate([jnp.swapaxes(window, 1, 2).astype(jnp.float32), x.astype(jnp.float32)], axis=1)


def causal_conv(window: Array, x: Array, weight: Array) -> tuple[Array, Array]:
    """Depthwise causal conv over ``[window ; x]``.

    window ``[B, C, W]`` (the last W inputs before the block), x ``[B, T, C]``, weight ``[C, W+1]``.
    Returns the pre-activation output ``[B, T, C]`` (float32) and the full input sequence
    ``[B, W+T, C]`` (float32) from which new windows are cut.
    """
    w = weight.shape[-1] - 1
    t = x.shape[1]
    full = conv_inputs(window, x)
    taps = weight.astype(jnp.float32)
    # out[t] = Σ_j taps[:, j] · full[t + j]  (cross-correlation, as torch's conv1d); W+1 static taps.
    out = sum(full[:, j : j + t, :] * taps[:, j] for j in range(w + 1))
    return out, full


def window_after(full: Array, num_tokens: Array, width: int) -> Array:
    """Conv window after the first ``num_tokens [B]`` block tokens: ``full [B, W+T, C]`` → ``[B, C, W]``."""
    idx = num_tokens.astype(jnp.int32)[:, None] + jnp.arange(width)  # [B, W]: entries n … n+W-1
    win = jnp.take_along_axis(full, idx[:, :, None], axis=1)  # [B, W, C]
    return jnp.swapaxes(win, 1, 2)


# ----------------------------------------------------------------------------------------------
# The gated delta rule


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """``x / sqrt(Σx² + eps)`` over the last axis (FLA / HF ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q: Array | None, k: Array, num_v_heads: int) -> tuple[Array | None, Array]:
    """fp32, L2-normalise, scale q by Dk^-1/2, repeat key heads to value heads: → ``[B, T, Nv, Dk]``."""
    rep = num_v_heads // k.shape[2]
    k = jnp.repeat(l2_normalize(k.astype(jnp.float32)), rep, axis=2)
    if q is not None:
        q = jnp.repeat(l2_normalize(q.astype(jnp.float32)), rep, axis=2) * (q.shape[-1] ** -0.5)
    return q, k


def gated_delta_recurrent(
    q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array
) -> tuple[Array, Array]:
    """Token-by-token gated delta rule.

    q, k ``[B, T, Nk, Dk]`` (raw: normalised here), v ``[B, T, Nv, Dv]``, g ``[B, T, Nv]`` (log decay,
    ≤ 0), beta ``[B, T, Nv]``, state ``[B, Nv, Dk, Dv]`` → o ``[B, T, Nv, Dv]`` float32, new state.
    """
    q, k = _prepare(q, k, v.shape[2])
    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta))  # T leading

    def step(s, x):  # s [B, Nv, Dk, Dv]
        q_t, k_t, v_t, g_t, b_t = x  # [B, Nv, Dk] ×2, [B, Nv, Dv], [B, Nv] ×2
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = _einsum("bhde,bhd->bhe", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, _einsum("bhde,bhd->bhe", s, q_t)

    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), state


def unit_lower_inverse(a: Array) -> Array:
    """``(I + strictly_lower(a))⁻¹`` for ``a [..., c, c]`` (diagonal and upper part of ``a`` ignored).

    Recursive doubling on diagonal blocks: with the inverses ``A⁻¹``, ``D⁻¹`` of two neighbouring
    diagonal blocks known, the merged block's inverse is ``[[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]]``. That is
    log2(c) levels of batched matmuls. It replaces ``lax.linalg.triangular_solve``, whose batched
    LAPACK kernel on XLA:CPU (jaxlib 0.10) can deadlock the intra-op thread pool when two
    executions are in flight, and which is slow on accelerators anyway.
    """
    c = a.shape[-1]
    n = 1 << max(c - 1, 0).bit_length()  # next power of two ≥ c
    lower = jnp.tril(a.astype(jnp.float32), -1)
    lower = jnp.pad(lower, [(0, 0)] * (a.ndim - 2) + [(0, n - c), (0, n - c)])
    batch = lower.shape[:-2]
    blocks = jnp.ones((*batch, n, 1, 1), jnp.float32)  # inverses of the 1×1 diagonal blocks
    s = 1
    while s < n:
        m = n // (2 * s)
        # Diagonal 2s×2s blocks of the strictly lower matrix → their lower-left s×s corners C.
        diag = jnp.diagonal(lower.reshape(*batch, m, 2 * s, m, 2 * s), axis1=-4, axis2=-2)  # [..., 2s, 2s, m]
        corner = jnp.moveaxis(diag, -1, -3)[..., s:, :s]  # [..., m, s, s]
        inv_a, inv_d = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        off = -_einsum("...ij,...jk->...ik", inv_d, _einsum("...ij,...jk->...ik", corner, inv_a))
        top = jnp.concatenate([inv_a, jnp.zeros_like(inv_a)], axis=-1)
        bottom = jnp.concatenate([off, inv_d], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)  # [..., m, 2s, 2s]
        s *= 2
    return blocks[..., 0, :c, :c]


def gated_delta_chunked(
    q: Array | None, k: Array, v: Array, g: Array, beta: Array, state: Array, chunk_size: int = DEFAULT_CHUNK
) -> tuple[Array | None, Array]:
    """Chunked gated delta rule (same arguments as ``gated_delta_recurrent``).

    ``q=None`` computes only the final state (used by replay). Blocks shorter than ``chunk_size`` form
    a single chunk of their own length; longer ones are zero-padded to a multiple of ``chunk_size``
    (padding has g = β = 0: an identity update).
    """
    b, t, _, dk = k.shape
    nv, dv = v.shape[2], v.shape[3]
    q, k = _prepare(q, k, nv)
    v, g, beta = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
    c = chunk_size if t >= chunk_size else t
    pad = (-t) % c
    nc = (t + pad) // c

    def chunks(x: Array) -> Array:  # [B, T, Nv, ...] → [B, nc, Nv, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, nc, c, *x.shape[2:]), 2, 3)

    kc, vc, gc, bc = chunks(k), chunks(v), chunks(g), chunks(beta)  # k [b,c,h,i,d], g [b,c,h,i]
    cum = jnp.cumsum(gc, axis=-1)  # log of the decay from the chunk start through position i
    causal = jnp.tril(jnp.ones((c, c), bool))  # i ≥ j
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [b,c,h,i,j]
    k_beta = kc * bc[..., None]
    v_beta = vc * bc[..., None]
    # UT transform: W = (I + strictly_lower(A))⁻¹ rhs, A_ij = β_i k_i·k_j e^{cum_i − cum_j}.
    a_mat = _einsum("bchid,bchjd->bchij", k_beta, kc) * decay
    inv = unit_lower_inverse(a_mat)  # [b,c,h,i,j]
    new_values = _einsum("bchij,bchje->bchie", inv, v_beta)
    k_cumdecay = _einsum("bchij,bchjd->bchid", inv, k_beta * jnp.exp(cum)[..., None])
    k_dec = kc * jnp.exp(cum[..., -1:] - cum)[..., None]  # keys decayed to the chunk end
    chunk_decay = jnp.exp(cum[..., -1])  # [b,c,h]
    if q is not None:
        qc = chunks(q)
        intra = _einsum("bchid,bchjd->bchij", qc, kc) * decay  # within-chunk attention (incl. diagonal)
        q_dec = qc * jnp.exp(cum)[..., None]
    else:
        intra = q_dec = jnp.zeros((b, nc, nv, 0), jnp.float32)  # unused placeholders

    def step(s, x):  # s [B, Nv, Dk, Dv]
        newv_i, kcd_i, kdec_i, cd_i, qdec_i, intra_i = x
        v_new = newv_i - _einsum("bhid,bhde->bhie", kcd_i, s)  # [b,h,i,e]
        if q is not None:
            o = _einsum("bhid,bhde->bhie", qdec_i, s) + _einsum("bhij,bhje->bhie", intra_i, v_new)
        else:
            o = None
        s = s * cd_i[..., None, None] + _einsum("bhid,bhie->bhde", kdec_i, v_new)
        return s, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (new_values, k_cumdecay, k_dec, chunk_decay, q_dec, intra))
    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
    if q is None:
        return None, state
    o = jnp.moveaxis(o, 0, 1)  # [b, c, h, i, e]
    o = jnp.moveaxis(o, 3, 2).reshape(b, nc * c, nv, dv)[:, :t]
    return o, state


# ----------------------------------------------------------------------------------------------
# The layer


def gated_rms_norm(x: Array, gate: Array, weight: Array, eps: float) -> Array:
    """HF ``RMSNormGated``: ``w · rmsnorm(x) · silu(gate)``, statistics and gate in fp32."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)
    return ((weight * normed).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)


def gdn_layer(
    p: GdnParams,
    x: Array,
    window: Array,
    state: Array,
    *,
    num_k_heads: int,
    eps: float,
    chunk_size: int = DEFAULT_CHUNK,
    return_replay: bool = False,
) -> tuple[Array, Array, Array, GdnReplay | None]:
    """One GDN mixer on ``x [B, T, H]`` (already input-normed) over its cache entry.

    window ``[B, C, W]`` float32, state ``[B, Nv, Dk, Dv]`` float32. Returns the mixer output
    ``[B, T, H]``, the window and state after all T tokens, and (optionally) the replay record.
    T = 1 takes the recurrent step, longer blocks the chunked form (as HF does).
    """
    bsz, t, _ = x.shape
    dtype = x.dtype
    nv = p.dt_bias.shape[-1]
    dv = p.norm.shape[-1]
    key_dim = (p.qkv.shape[-1] - nv * dv) // 2
    dk = key_dim // num_k_heads

    conv_in = x @ p.qkv  # [B, T, C]
    z = (x @ p.z).reshape(bsz, t, nv, dv)
    beta = jax.nn.sigmoid(x @ p.b)  # [B, T, Nv]
    a = x @ p.a
    g = -jnp.exp(p.a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + p.dt_bias.astype(jnp.float32))

    pre, full = causal_conv(window, conv_in, p.conv)
    mixed = jax.nn.silu(pre.astype(dtype)).reshape(bsz, t, p.groups, -1)  # per group: [q | k | v]
    group_keys = key_dim // p.groups
    q = mixed[..., :group_keys].reshape(bsz, t, num_k_heads, dk)
    k = mixed[..., group_keys : 2 * group_keys].reshape(bsz, t, num_k_heads, dk)
    v = mixed[..., 2 * group_keys :].reshape(bsz, t, nv, dv)

    if t == 1:
        o, new_state = gated_delta_recurrent(q, k, v, g, beta, state)
    else:
        o, new_state = gated_delta_chunked(q, k, v, g, beta, state, chunk_size)
    o = gated_rms_norm(o.astype(dtype), z, p.norm, eps)
    out = o.reshape(bsz, t, nv * dv) @ p.out
    new_window = jnp.swapaxes(full[:, t:], 1, 2)  # the last W inputs: [B, C, W]
    saved = None
    if return_replay:
        saved = GdnReplay(conv=window, state=state, conv_in=conv_in, k=k, v=v, g=g, beta=beta)
    return out, new_window, new_state, saved


def channel_order(key_dim: int, value_dim: int, groups: int) -> np.ndarray:
    """Indices into HF's ``[q | k | v]`` conv channels (q and k ``key_dim`` wide, v ``value_dim``) that
    give the ``groups`` × [q | k | v] layout."""
    q, k, v = np.split(np.arange(2 * key_dim + value_dim), [key_dim, 2 * key_dim])
    return np.concatenate([part for g in range(groups) for part in (
        np.array_split(q, groups)[g], np.array_split(k, groups)[g], np.array_split(v, groups)[g]
    )])  # fmt: skip


def regroup(p: GdnParams, num_k_heads: int, groups: int) -> GdnParams:
    """``p`` with its conv channels (in_proj_qkv columns, conv taps) stored in ``groups`` head groups."""
    nv, dv = p.dt_bias.shape[-1], p.norm.shape[-1]
    key_dim = (p.qkv.shape[-1] - nv * dv) // 2
    if num_k_heads % groups or nv % groups:
        raise ValueError(f"{num_k_heads} key / {nv} value heads do not split into {groups} groups")
    to_plain = np.argsort(channel_order(key_dim, nv * dv, p.groups))
    order = to_plain[channel_order(key_dim, nv * dv, groups)]
    return p.replace(qkv=p.qkv[..., order], conv=p.conv[..., order, :], groups=groups)


def replay_layer(saved: GdnReplay, num_tokens: Array, chunk_size: int = DEFAULT_CHUNK) -> tuple[Array, Array]:
    """Window ``[B, C, W]`` and state ``[B, Nv, Dk, Dv]`` after only the first ``num_tokens [B]`` tokens.

    A fixed-length masked pass over the saved block: tokens ≥ n get g = 0 and β = 0 (identity).
    """
    t = saved.k.shape[1]
    num_tokens = jnp.clip(num_tokens.astype(jnp.int32), 0, t)
    keep = jnp.arange(t)[None, :] < num_tokens[:, None]  # [B, T]
    g = jnp.where(keep[..., None], saved.g, 0.0)
    beta = jnp.where(keep[..., None], saved.beta.astype(jnp.float32), 0.0)
    _, state = gated_delta_chunked(None, saved.k, saved.v, g, beta, saved.state, chunk_size)
    window = window_after(conv_inputs(saved.conv, saved.conv_in), num_tokens, saved.conv.shape[-1])
    return window, state
