"""Hybrid targets (Qwen3.5 text model, dense Qwen3-Next): params, block forward, recurrent-state replay.

Layer stack (HF ``Qwen3_5DecoderLayer``): zero-centred RMSNorm → mixer → residual, zero-centred
RMSNorm → SwiGLU → residual; the mixer is a Gated DeltaNet (``gdn.py``) or gated full attention
(q_proj emits q and a per-head gate, q/k zero-centred RMSNorm, partial RoPE, output × σ(gate)).

Params are a tuple of per-layer pytrees and the layer loop is unrolled, like the dense target
(``target.py``): a ``lax.scan`` over stacked weights makes XLA:CPU copy each layer's weight slice,
doubling a decode step's memory traffic. The sequential parts that matter — the GDN recurrence over
chunks or tokens — are ``lax.scan``s (``gdn.py``).

Public API (the ``hybrid`` family record at the bottom; ``target.py`` reaches it through the registry):

* ``forward(params, config, cache, tokens, taps)`` — same contract as the dense forward: K/V of the
  block written into the attention layers' cache, GDN conv windows and states advanced past all ``T``
  tokens, ``lengths`` not moved; the replay record is one ``GdnReplay`` per GDN layer (a tuple; under
  ``jit`` it costs nothing when the caller drops it).
* ``replay(cache, saved, num_tokens)`` — the cache as if only the first ``num_tokens [B]`` block
  tokens had been fed and committed: GDN windows/states rebuilt from the saved pre-block state and
  per-token inputs (one fixed-length masked pass, no recompilation per length), ``lengths`` advanced.
  The block's K/V stay where the forward wrote them; slots beyond the new lengths are invisible.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array
from safetensors import SafetensorError, safe_open

from dspine_jax.models import gdn
from dspine_jax.models.cache import (
    KV_CACHE_DTYPES,
    HybridCache,
    Int8KV,
    attention_operands,
    init_hybrid_cache,
    write_block,
)
from dspine_jax.models.config import HYBRID_TARGET_TYPES, MOE_HYBRID_TYPES, HybridConfig, hybrid_config_from_dict
from dspine_jax.models.family import TargetFamily, TargetForward, check_taps, register_family, stack_taps
from dspine_jax.models.layers import apply_rope, cached_attention, rms_norm, rope_cos_sin, swiglu
from dspine_jax.models.weights import (
    CheckpointError,
    cast_params,
    check_consumed,
    hf_causal_lm_tensors,
    take,
    take_embedding_and_head,
)
from dspine_jax.parallel.mesh import weight

FULL = "full_attention"
LINEAR = "linear_attention"
# The multi-token-prediction head Qwen3.5 / Qwen3-Next checkpoints ship (``mtp.fc.weight``, ``mtp.layers.0.*``, …):
# not part of the target; ``mtp_tensors`` reads it for the MTP drafter (drafters/mtp.py).
MTP_PREFIX = "mtp."


@struct.dataclass
class GatedAttentionParams:
    q: Array = weight(None, "heads", group="attention")  # [H, N*2D]: per head [q (D) | gate (D)], HF q_proj layout
    k: Array = weight(None, "kv_heads", group="attention")  # [H, K*D]
    v: Array = weight(None, "kv_heads", group="attention")  # [H, K*D]
    o: Array = weight("heads", None, group="attention")  # [N*D, H]
    q_norm: Array = weight()  # [D] zero-centred
    k_norm: Array = weight()  # [D] zero-centred

    def for_mesh(self, config: HybridConfig, model_shards: int) -> tuple[GatedAttentionParams, dict[str, bool]]:
        """Heads split over ``model_shards`` only when query and KV heads both divide."""
        split = config.num_heads % model_shards == 0 and config.num_kv_heads % model_shards == 0
        return self, {"attention": split}


@struct.dataclass
class HybridLayer:
    input_norm: Array  # [H] zero-centred
    post_norm: Array  # [H] zero-centred
    gate: Array = weight(None, "mlp")  # [H, F]
    up: Array = weight(None, "mlp")  # [H, F]
    down: Array = weight("mlp", None)  # [F, H]
    mixer: GatedAttentionParams | gdn.GdnParams = weight()


@struct.dataclass
class HybridParams:
    embed: Array  # [V, H]
    layers: tuple[HybridLayer, ...]  # one per layer, in order
    final_norm: Array  # [H] zero-centred
    lm_head: Array = weight(None, "vocab")  # [H, V]


# ----------------------------------------------------------------------------------------------
# Loading


def _layer_tensors(tensors: dict[str, np.ndarray], config: HybridConfig, i: int) -> HybridLayer:
    """Take layer ``i``'s HF tensors (torch layout) → a HybridLayer of ``[in, out]`` numpy arrays."""
    h, f = config.hidden_size, config.intermediate_size
    pre = f"model.layers.{i}."
    mlp = dict(
        input_norm=take(tensors, pre + "input_layernorm.weight", (h,)),
        post_norm=take(tensors, pre + "post_attention_layernorm.weight", (h,)),
        gate=take(tensors, pre + "mlp.gate_proj.weight", (f, h)).T,
        up=take(tensors, pre + "mlp.up_proj.weight", (f, h)).T,
        down=take(tensors, pre + "mlp.down_proj.weight", (h, f)).T,
    )
    if config.layer_kinds[i] == FULL:
        n, kh, d = config.num_heads, config.num_kv_heads, config.head_dim
        at = pre + "self_attn."
        mixer = GatedAttentionParams(
            q=take(tensors, at + "q_proj.weight", (n * 2 * d, h)).T,
            k=take(tensors, at + "k_proj.weight", (kh * d, h)).T,
            v=take(tensors, at + "v_proj.weight", (kh * d, h)).T,
            o=take(tensors, at + "o_proj.weight", (h, n * d)).T,
            q_norm=take(tensors, at + "q_norm.weight", (d,)),
            k_norm=take(tensors, at + "k_norm.weight", (d,)),
        )
        return HybridLayer(**mlp, mixer=mixer)

    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim, kc = config.gdn_conv_dim, config.linear_conv_kernel
    la = pre + "linear_attn."
    if config.gdn_projection_layout == "fused":
        # qwen3_next: rows grouped per key head as [q (Dk) | k (Dk) | v (r·Dv) | z (r·Dv)], and
        # in_proj_ba as [b (r) | a (r)] per key head (HF fix_query_key_value_ordering).
        r = nv // nk
        qkvz = take(tensors, la + "in_proj_qkvz.weight", (2 * nk * dk + 2 * nv * dv, h))
        qkvz = qkvz.reshape(nk, 2 * dk + 2 * r * dv, h)
        wq, wk = qkvz[:, :dk], qkvz[:, dk : 2 * dk]
        wv, wz = qkvz[:, 2 * dk : 2 * dk + r * dv], qkvz[:, 2 * dk + r * dv :]
        w_qkv = np.concatenate([wq.reshape(-1, h), wk.reshape(-1, h), wv.reshape(-1, h)], axis=0)
        w_z = wz.reshape(nv * dv, h)
        ba = take(tensors, la + "in_proj_ba.weight", (2 * nv, h)).reshape(nk, 2 * r, h)
        w_b, w_a = ba[:, :r].reshape(nv, h), ba[:, r:].reshape(nv, h)
    else:
        w_qkv = take(tensors, la + "in_proj_qkv.weight", (conv_dim, h))
        w_z = take(tensors, la + "in_proj_z.weight", (nv * dv, h))
        w_b = take(tensors, la + "in_proj_b.weight", (nv, h))
        w_a = take(tensors, la + "in_proj_a.weight", (nv, h))
    mixer = gdn.GdnParams(
        qkv=w_qkv.T,
        z=w_z.T,
        b=w_b.T,
        a=w_a.T,
        conv=take(tensors, la + "conv1d.weight", (conv_dim, 1, kc))[:, 0, :],
        dt_bias=take(tensors, la + "dt_bias", (nv,)),
        a_log=take(tensors, la + "A_log", (nv,)),
        norm=take(tensors, la + "norm.weight", (dv,)),
        out=take(tensors, la + "out_proj.weight", (h, nv * dv)).T,
    )
    return HybridLayer(**mlp, mixer=mixer)


def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: HybridConfig, dtype: jnp.dtype) -> HybridParams:
    """HF-named tensors of a Qwen3.5 (text or multimodal wrapper) / Qwen3-Next checkpoint → HybridParams.

    The multi-token-prediction head (``mtp.*``: ``mtp_tensors`` reads it as a drafter) and the vision tower
    (``model.visual.*``) are dropped; every other tensor must be used exactly once.
    """
    tensors = hf_causal_lm_tensors(tensors, drop=(MTP_PREFIX, "model.visual.", "visual."))
    embed, lm_head = take_embedding_and_head(tensors, config.vocab_size, config.hidden_size, config.tie_word_embeddings)
    layers = tuple(_layer_tensors(tensors, config, i) for i in range(config.num_layers))
    final_norm = take(tensors, "model.norm.weight", (config.hidden_size,))
    check_consumed(tensors, config.model_type)
    return cast_params(HybridParams(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head), dtype)


def mtp_tensors(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """A checkpoint's multi-token-prediction head: its ``mtp.*`` tensors with the prefix removed (``fc.weight``,
    ``pre_fc_norm_hidden.weight``, ``layers.0.self_attn.q_proj.weight`` …; torch layout), read from the
    safetensors files without loading the rest of the model. Empty when the checkpoint has none."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if (model_dir / "model.safetensors").is_file():
        files: dict[str, list[str] | None] = {"model.safetensors": None}  # None: every mtp.* name in the file
    elif index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = {}
        for name, shard in weight_map.items():
            if name.startswith(MTP_PREFIX):
                files.setdefault(shard, []).append(name)
    else:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    out = {}
    for file, names in files.items():
        try:
            with safe_open(str(model_dir / file), framework="np") as f:
                every = f.keys()
                for name in names if names is not None else [k for k in every if k.startswith(MTP_PREFIX)]:
                    out[name[len(MTP_PREFIX) :]] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read the MTP tensors of {model_dir / file}: {e}") from e
    return out


# ----------------------------------------------------------------------------------------------
# Forward


def _gated_attention(
    ap: GatedAttentionParams,
    x: Array,
    cache_k: Array | Int8KV,
    cache_v: Array | Int8KV,
    lengths: Array,
    cos: Array,
    sin: Array,
    config: HybridConfig,
) -> tuple[Array, Array | Int8KV, Array | Int8KV]:
    """x ``[B, T, H]`` (normed), cache_k/v ``[B, K, S, D]`` (float or ``Int8KV``) → out ``[B, T, H]`` and
    the caches with this block's K/V written (same write scheme as the dense target's attention)."""
    b, t, _ = x.shape
    n, kh, d, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    qg = (x @ ap.q).reshape(b, t, n, 2 * d)  # per head: [q | gate]
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, n * d)
    q = rms_norm(q, ap.q_norm, eps, zero_centered=True)
    k = rms_norm((x @ ap.k).reshape(b, t, kh, d), ap.k_norm, eps, zero_centered=True)
    v = (x @ ap.v).reshape(b, t, kh, d)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    positions = lengths[:, None] + jnp.arange(t)  # [B, T]
    # Row by row with dynamic_update_slice at any batch (in place; a scatter makes XLA:CPU transpose the cache).
    cache_k = write_block(cache_k, k, lengths, scatter_above=b)
    cache_v = write_block(cache_v, v, lengths, scatter_above=b)
    visible = jnp.arange(cache_v.shape[2])[None, None, :] <= positions[:, :, None]  # [B, T, S]
    (k_values, k_scale), (v_values, v_scale) = attention_operands(cache_k), attention_operands(cache_v)
    out = cached_attention(q, k_values, v_values, visible, k_scale, v_scale).reshape(b, t, n * d) * jax.nn.sigmoid(gate)
    return out @ ap.o, cache_k, cache_v


def forward(
    params: HybridParams, config: HybridConfig, cache: HybridCache, tokens: Array, taps: tuple[int, ...] = ()
) -> TargetForward:
    """Run ``tokens [B, T]`` at positions ``cache.lengths[:, None] + arange(T)``.

    Returns ``hidden [B, T, H]`` (final-normed), ``tapped [len(taps), B, T, H]`` (residual stream after
    each tapped layer), the cache (K/V of the block written, GDN windows/states after all T tokens,
    lengths unchanged) and the replay record: a tuple with one ``GdnReplay`` per GDN layer.
    """
    check_taps(taps, config.num_layers)
    eps = config.rms_norm_eps
    x = params.embed[tokens]  # [B, T, H]
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    cos, sin = rope_cos_sin(positions, config.rotary_dim, config.rope_theta, x.dtype)
    cache_k, cache_v, conv, state = list(cache.k), list(cache.v), list(cache.conv), list(cache.state)
    attn_index = {layer: a for a, layer in enumerate(config.attention_layers)}
    gdn_index = {layer: g for g, layer in enumerate(config.gdn_layers)}
    residuals, saved = [], []
    for i, lp in enumerate(params.layers):
        h = rms_norm(x, lp.input_norm, eps, zero_centered=True)
        if config.layer_kinds[i] == FULL:
            a = attn_index[i]
            out, cache_k[a], cache_v[a] = _gated_attention(
                lp.mixer, h, cache_k[a], cache_v[a], cache.lengths, cos, sin, config
            )
        else:
            g = gdn_index[i]
            out, conv[g], state[g], record = gdn.gdn_layer(
                lp.mixer, h, conv[g], state[g],
                num_k_heads=config.linear_num_key_heads, eps=eps, return_replay=True,
            )
            saved.append(record)
        x = x + out
        x = x + swiglu(rms_norm(x, lp.post_norm, eps, zero_centered=True), lp.gate, lp.up, lp.down)
        residuals.append(x)
    hidden = rms_norm(x, params.final_norm, eps, zero_centered=True)
    new_cache = cache.replace(k=tuple(cache_k), v=tuple(cache_v), conv=tuple(conv), state=tuple(state))
    return TargetForward(hidden, stack_taps(residuals, taps), new_cache, tuple(saved))


def replay(cache: HybridCache, saved: tuple[gdn.GdnReplay, ...] | None, num_tokens: Array) -> HybridCache:
    """Keep only the first ``num_tokens [B]`` tokens of the block the forward just ran.

    ``cache`` is the forward's output (the block's K/V are in it), ``saved`` its replay record.
    Returns the cache with every GDN window/state equal to feeding just those tokens, and ``lengths``
    advanced by ``num_tokens`` (this replaces ``cache.commit``). Rows may keep different lengths
    (0 … T); one fixed-shape computation serves all of them.
    """
    num_tokens = num_tokens.astype(jnp.int32)
    if saved is None:
        return cache.commit(num_tokens)
    rebuilt = [gdn.replay_layer(record, num_tokens) for record in saved]
    conv, state = tuple(w for w, _ in rebuilt), tuple(s for _, s in rebuilt)
    return cache.replace(conv=conv, state=state).commit(num_tokens)


FAMILY = register_family(
    TargetFamily(
        name="hybrid",
        # The MoE types are registered so their config parser can say what is missing.
        model_types=HYBRID_TARGET_TYPES + MOE_HYBRID_TYPES,
        parse_config=hybrid_config_from_dict,
        params_from_hf=params_from_hf_tensors,
        init_cache=init_hybrid_cache,
        forward=forward,
        replay=replay,
        kv_cache_dtypes=KV_CACHE_DTYPES,
    )
)
