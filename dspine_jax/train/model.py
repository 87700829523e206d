"""Training-mode drafter forward: many anchored blocks per sequence in one pass.

Built on ``dspine_jax.drafter``'s building blocks (the same feature / code / write math the inference
path runs), but shaped for training like SpecForge's ``OnlineDFlashModel`` / ``OnlineDSpineModel``:

* Context: the target's tapped hidden states of the **whole** sequence ``[n, B, S, H]`` are fused once
  (``ctx = hidden_norm(fc(concat))``); every layer projects them to context K/V at positions ``0…S-1``.
* Blocks: ``A`` anchors per row; block ``a`` is ``[tokens[anchor_a], MASK × (T-1)]`` at positions
  ``anchor_a … anchor_a+T-1``.
* Block-isolated attention: a block's queries see context keys at positions ``< anchor`` (the anchor's
  own features are not committed yet at inference either) and the keys of **their own block only**
  (causal inside the block for DSpine / causal DFlash, bidirectional otherwise). Dropped blocks
  (``keep = False``) produce garbage that the loss masks out.
* DSpine injection after every layer, with **predecessor replacement**: for blocks whose ``replace`` flag
  is set, in the first ``replacement_layers`` layers every slot's predecessor message is the true
  predecessor token's code ``√R·C[label_{t-1}]`` instead of the predecessor's predicted feature.
* Outputs: final-normed hidden ``[B, A, T, H]``, the last layer's pre-injection state (for last-write
  refinement) and every layer's post-injection readout feature ``[L, B, A, T, R]`` (for alignment).

Sliding windows are honoured for context keys (``query_pos - key_pos < W``) and, as in SpecForge's
sliding mask, in-block keys become causal for windowed layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from dspine_jax.drafter import Drafter, _code, _feature, _write, fuse_context
from dspine_jax.layers import MASK_VALUE, apply_rope, rms_norm, rope_cos_sin, swiglu


class TrainForward(NamedTuple):
    hidden: Array  # [B, A, T, H] after the final norm
    pre_injection: Array  # [B, A, T, H] last layer's output before its injection
    layer_features: Array | None  # [L, B, A, T, R] post-injection readout features (DSpine only)


def block_ids(tokens: Array, anchors: Array, block_size: int) -> tuple[Array, Array]:
    """Real tokens of each block ``[B, A, T]`` (``tokens[anchor + t]``, clamped at the end) and their
    positions ``[B, A, T]`` (unclamped)."""
    s = tokens.shape[1]
    positions = anchors[..., None] + jnp.arange(block_size)
    safe = jnp.minimum(positions, s - 1)
    labels = jnp.take_along_axis(tokens[:, None, :], safe, axis=2)
    return labels, positions


def _attention(q: Array, ck: Array, cv: Array, bk: Array, bv: Array, ctx_visible: Array, blk_visible: Array) -> Array:
    """q ``[B, A, T, N, D]`` over context keys ``ck/cv [B, S, K, D]`` and the block's own ``bk/bv
    [B, A, T, K, D]``; ``ctx_visible [B, A, T, S]``, ``blk_visible [T, T]`` → ``[B, A, T, N, D]``."""
    b, a, t, n, d = q.shape
    kh = ck.shape[2]
    qg = q.reshape(b, a, t, kh, n // kh, d)
    s_ctx = jnp.einsum("batkgd,bskd->bakgts", qg, ck, preferred_element_type=jnp.float32)
    s_blk = jnp.einsum("batkgd,baukd->bakgtu", qg, bk, preferred_element_type=jnp.float32)
    s_ctx = jnp.where(ctx_visible[:, :, None, None], s_ctx, MASK_VALUE)
    s_blk = jnp.where(blk_visible, s_blk, MASK_VALUE)
    scores = jnp.concatenate([s_ctx, s_blk], axis=-1) * (d**-0.5)
    probs = jax.nn.softmax(scores, axis=-1).astype(cv.dtype)
    sc = ck.shape[1]
    out = jnp.einsum("bakgts,bskd->batkgd", probs[..., :sc], cv) + jnp.einsum(
        "bakgtu,baukd->batkgd", probs[..., sc:], bv
    )
    return out.reshape(b, a, t, n, d)


def train_forward(
    drafter: Drafter,
    embed: Array,
    tapped: Array,
    tokens: Array,
    anchors: Array,
    replace: Array | None = None,
    inject: bool = True,
) -> TrainForward:
    """Training forward. ``embed [V, H]`` is the target's (frozen) input embedding, ``tapped [n, B, S, H]``
    the target features of the whole sequence, ``tokens [B, S]``, ``anchors [B, A]`` (positions ≤ S-2),
    ``replace [B, A]`` bool or None (predecessor replacement, DSpine only)."""
    config, params = drafter.config, drafter.params
    t = config.block_size
    b, s = tokens.shape
    eps, n, kh, d = config.rms_norm_eps, config.num_heads, config.num_kv_heads, config.head_dim
    labels, positions = block_ids(tokens, anchors, t)  # [B, A, T]
    a = anchors.shape[1]

    ctx = fuse_context(drafter, tapped)  # [B, S, H]
    ctx_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    c_cos, c_sin = rope_cos_sin(ctx_pos, d, config.rope_theta, ctx.dtype)
    b_cos, b_sin = rope_cos_sin(positions.reshape(b, a * t), d, config.rope_theta, ctx.dtype)

    block = jnp.full((b, a, t), config.mask_token_id, jnp.int32).at[:, :, 0].set(labels[:, :, 0])
    x = embed[block].astype(drafter.dtype)  # [B, A, T, H]
    if config.input_embedding_scale != 1.0:
        x = x * config.input_embedding_scale

    key_pos = jnp.arange(s)
    use_injection = inject and config.is_dspine
    inj, rank = params.injection, config.transfer_rank
    replacement_layers = int(config.dspine_settings.get("replacement_layers", 0)) if config.is_dspine else 0
    if use_injection:
        anchor_codes = _code(drafter, labels[:, :, 0])[:, :, None, :]  # [B, A, 1, R]
        true_codes = _code(drafter, labels[:, :, :-1])  # [B, A, P, R]
    features_all = []
    pre = x
    for layer in range(config.num_layers):
        lp = params.layers[layer]
        window, causal = config.layer_windows[layer], config.layer_causal[layer]
        # context K/V at positions 0..S-1 (ctx does not pass through input_layernorm)
        ck = apply_rope(rms_norm((ctx @ lp.k).reshape(b, s, kh, d), lp.k_norm, eps), c_cos, c_sin)
        cv = (ctx @ lp.v).reshape(b, s, kh, d)
        normed = rms_norm(x, lp.input_norm, eps).reshape(b, a * t, -1)
        q = apply_rope(rms_norm((normed @ lp.q).reshape(b, a * t, n, d), lp.q_norm, eps), b_cos, b_sin)
        k = apply_rope(rms_norm((normed @ lp.k).reshape(b, a * t, kh, d), lp.k_norm, eps), b_cos, b_sin)
        v = (normed @ lp.v).reshape(b, a * t, kh, d)
        ctx_vis = key_pos[None, None, None, :] < anchors[:, :, None, None]  # [B, A, 1, S]
        ctx_vis = jnp.broadcast_to(ctx_vis, (b, a, t, s))
        if window:
            ctx_vis = ctx_vis & (positions[..., None] - key_pos < window)
        qo, ko = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
        blk_vis = jnp.ones((t, t), bool)
        if causal or window:
            blk_vis = blk_vis & (ko <= qo)
        if window:
            blk_vis = blk_vis & (qo - ko < window)
        attn = _attention(
            q.reshape(b, a, t, n, d), ck, cv, k.reshape(b, a, t, kh, d), v.reshape(b, a, t, kh, d), ctx_vis, blk_vis
        )
        x = x + attn.reshape(b, a, t, n * d) @ lp.o
        x = x + swiglu(rms_norm(x, lp.post_norm, eps), lp.gate, lp.up, lp.down)
        pre = x
        if use_injection:
            feats = _feature(x, inj.readouts[layer], rank)  # [B, A, T, R]
            predecessors = jnp.concatenate([anchor_codes, feats[:, :, 1:-1]], axis=2)  # [B, A, P, R]
            if replace is not None and layer < replacement_layers:
                predecessors = jnp.where(replace[:, :, None, None], true_codes, predecessors)
            successors = _write(inj, layer, x[:, :, 1:], feats[:, :, 1:] @ inj.receiver_gate, predecessors)
            x = jnp.concatenate([x[:, :, :1], successors], axis=2)
            features_all.append(_feature(x, inj.readouts[layer], rank))
    hidden = rms_norm(x, params.norm, eps)
    return TrainForward(hidden, pre, jnp.stack(features_all) if features_all else None)
