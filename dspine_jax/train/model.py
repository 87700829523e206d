"""Training-mode drafter forward: many anchored blocks per sequence in one pass.

Runs the drafter kind's own ``forward_blocks`` (the code inference runs with ``A = 1``), shaped for
training like SpecForge's ``OnlineDFlashModel`` / ``OnlineDSpineModel``:

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

from dspine_jax.drafters.drafter import embed_block
from dspine_jax.drafters.params import Attend, Drafter
from dspine_jax.drafters.ring import context_kv, fuse_context
from dspine_jax.models.layers import MASK_VALUE, rope_cos_sin


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


def sequence_attention(drafter: Drafter, ctx: Array, anchors: Array, positions: Array) -> Attend:
    """Training attention: ``A`` blocks per row, each against the context keys of the whole sequence
    ``ctx [B, S, H]`` before its anchor and against its own keys only (module doc)."""
    config = drafter.config
    b, s, _ = ctx.shape
    a, t = positions.shape[1], positions.shape[2]
    c_cos, c_sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(s), (b, s)), config.head_dim, config.rope_theta, ctx.dtype)
    key_pos = jnp.arange(s)
    before_anchor = jnp.broadcast_to(key_pos < anchors[:, :, None, None], (b, a, t, s))  # [B, A, T, S]
    qo, ko = jnp.arange(t)[:, None], jnp.arange(t)[None, :]

    def attend(layer: int, q: Array, k: Array, v: Array) -> Array:
        window, causal = config.layer_windows[layer], config.layer_causal[layer]
        ck, cv = context_kv(drafter, layer, ctx, c_cos, c_sin)  # [B, S, K, D]
        ctx_visible, blk_visible = before_anchor, jnp.ones((t, t), bool)
        if window:
            ctx_visible = ctx_visible & (positions[..., None] - key_pos < window)
        if causal or window:  # SpecForge's sliding mask makes in-block keys causal for windowed layers
            blk_visible = blk_visible & (ko <= qo)
        if window:
            blk_visible = blk_visible & (qo - ko < window)
        n, kh, d = q.shape[2], k.shape[2], q.shape[3]
        out = _attention(
            q.reshape(b, a, t, n, d), ck, cv, k.reshape(b, a, t, kh, d), v.reshape(b, a, t, kh, d), ctx_visible, blk_visible
        )
        return out.reshape(b, a * t, n, d)

    return attend


def train_forward(
    drafter: Drafter,
    embed: Array,
    tapped: Array,
    tokens: Array,
    anchors: Array,
    replace: Array | None = None,
    inject: bool = True,
) -> TrainForward:
    """Training forward through the kind's own ``forward_blocks`` (the one inference runs). ``embed [V, H]``
    is the target's (frozen) input embedding, ``tapped [n, B, S, H]`` the target features of the whole
    sequence, ``tokens [B, S]``, ``anchors [B, A]`` (positions ≤ S-2), ``replace [B, A]`` bool or None
    (predecessor replacement in the kind's ``replacement_layers``; kinds without injection ignore it)."""
    config = drafter.config
    b = tokens.shape[0]
    labels, positions = block_ids(tokens, anchors, config.block_size)  # [B, A, T]
    a, t = anchors.shape[1], config.block_size
    ctx = fuse_context(drafter, tapped)  # [B, S, H]
    cos, sin = rope_cos_sin(positions.reshape(b, a * t), config.head_dim, config.rope_theta, ctx.dtype)
    block = jnp.full((b, a, t), config.mask_token_id, jnp.int32).at[:, :, 0].set(labels[:, :, 0])
    x = embed_block(drafter, embed, block)  # [B, A, T, H]
    replacement = None if replace is None else drafter.kind.replacement(drafter, replace, labels)
    fwd = drafter.kind.forward_blocks(
        drafter, x, cos, sin, sequence_attention(drafter, ctx, anchors, positions), labels[:, :, 0],
        inject=inject, replacement=replacement, collect_features=inject,
    )  # fmt: skip
    return TrainForward(fwd.hidden, fwd.pre_injection, fwd.features)
