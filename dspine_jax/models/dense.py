"""The dense target family (Llama, Qwen3): params as pytrees, the block forward, registration.

Each layer is pre-norm RMSNorm → attention (optional q/k RMSNorm, RoPE, optional sliding window) →
residual, RMSNorm → SwiGLU → residual. Projections are fused (q|k|v, gate|up) and the layer loop is
unrolled (see ``DenseLayer``). Replay is a plain commit: every dense layer's state is its K/V, which
is position-indexed, so keeping a prefix of a block only moves ``lengths``.

Reached through ``target.py`` (``family_for(config.model_type)``); the record at the bottom registers
``llama`` and ``qwen3``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from dspine_jax.models.cache import KV_CACHE_DTYPES, Int8KV, KVCache, attention_operands, init_kv_cache, write_block
from dspine_jax.models.config import DENSE_TARGET_TYPES, TargetConfig, dense_config_from_dict
from dspine_jax.models.family import TargetFamily, TargetForward, check_taps, register_family, stack_taps
from dspine_jax.models.layers import apply_rope, cached_attention, rms_norm, rope_cos_sin
from dspine_jax.models.weights import cast_params, check_consumed, hf_causal_lm_tensors, take, take_embedding_and_head
from dspine_jax.parallel.mesh import weight


@struct.dataclass
class DenseLayer:
    """One decoder layer. Projections are fused (q|k|v and gate|up) so decoding runs fewer, larger
    GEMVs: on CPU a one-token step is bound by streaming the weights, and each extra op costs time."""

    input_norm: Array  # [H]
    qkv: Array = weight(None, "heads", group="attention")  # [H, (N+2K)*D]
    o: Array = weight("heads", None, group="attention")  # [N*D, H]
    post_norm: Array = weight()  # [H]
    gate_up: Array = weight(None, "mlp", group="mlp")  # [H, 2F]
    down: Array = weight("mlp", None, group="mlp")  # [F, H]
    q_norm: Array | None = weight(default=None)  # [D] (qwen3)
    k_norm: Array | None = weight(default=None)  # [D]
    qkv_bias: Array | None = weight("heads", group="attention", default=None)  # [(N+2K)*D] (llama attention_bias)
    o_bias: Array | None = weight(default=None)  # [H]
    gate_up_bias: Array | None = weight("mlp", group="mlp", default=None)  # [2F] (llama mlp_bias)
    down_bias: Array | None = weight(default=None)  # [H]
    window: int = struct.field(pytree_node=False, default=0)  # 0 = full attention, else sliding window
    # Tensor parallelism splits the fused columns into ``groups`` equal slices, one per device, so the
    # columns are stored group-major: qkv as G × [q | k | v] of N/G, K/G, K/G heads, gate_up as
    # G × [gate | up] of F/G. G = 1 is the plain HF concatenation (see ``regroup``).
    qkv_groups: int = struct.field(pytree_node=False, default=1)
    mlp_groups: int = struct.field(pytree_node=False, default=1)

    def for_mesh(self, config: TargetConfig, model_shards: int) -> tuple[DenseLayer, dict[str, bool]]:
        """Which weight groups split over ``model_shards`` devices, with the fused columns regrouped one
        device group per shard: heads only when query and KV heads both divide, the MLP when F does."""
        attention = model_shards > 1 and config.num_heads % model_shards == 0 and config.num_kv_heads % model_shards == 0
        mlp = model_shards > 1 and config.intermediate_size % model_shards == 0
        layer = regroup(self, config, model_shards if attention else 1, model_shards if mlp else 1)
        return layer, {"attention": attention, "mlp": mlp}


@struct.dataclass
class DenseParams:
    embed: Array  # [V, H]
    layers: tuple[DenseLayer, ...]  # unrolled, not stacked: per-layer buffers avoid slicing copies
    final_norm: Array  # [H]
    lm_head: Array = weight(None, "vocab")  # [H, V] (the embedding's transpose when tied)


# ----------------------------------------------------------------------------------------------
# Loading


def _layer_from_hf(tensors: dict[str, np.ndarray], config: TargetConfig, i: int) -> dict[str, np.ndarray]:
    h, n, k, d, f = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    prefix = f"model.layers.{i}."

    def get(suffix: str, shape: tuple[int, ...]) -> np.ndarray:
        return take(tensors, prefix + suffix, shape)

    def linear(suffix: str, out_dim: int, in_dim: int) -> np.ndarray:  # torch [out, in] → ours [in, out]
        return get(f"{suffix}.weight", (out_dim, in_dim)).T

    layer = {
        "input_norm": get("input_layernorm.weight", (h,)),
        "qkv": np.concatenate(
            [linear("self_attn.q_proj", n * d, h), linear("self_attn.k_proj", k * d, h), linear("self_attn.v_proj", k * d, h)],
            axis=1,
        ),
        "o": linear("self_attn.o_proj", h, n * d),
        "post_norm": get("post_attention_layernorm.weight", (h,)),
        "gate_up": np.concatenate([linear("mlp.gate_proj", f, h), linear("mlp.up_proj", f, h)], axis=1),
        "down": linear("mlp.down_proj", h, f),
    }
    if config.qk_norm:
        layer["q_norm"] = get("self_attn.q_norm.weight", (d,))
        layer["k_norm"] = get("self_attn.k_norm.weight", (d,))
    if config.attention_bias:
        layer["qkv_bias"] = np.concatenate(
            [get("self_attn.q_proj.bias", (n * d,)), get("self_attn.k_proj.bias", (k * d,)), get("self_attn.v_proj.bias", (k * d,))]
        )
        layer["o_bias"] = get("self_attn.o_proj.bias", (h,))
    if config.mlp_bias:
        layer["gate_up_bias"] = np.concatenate([get("mlp.gate_proj.bias", (f,)), get("mlp.up_proj.bias", (f,))])
        layer["down_bias"] = get("mlp.down_proj.bias", (h,))
    return layer


def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: TargetConfig, dtype: jnp.dtype) -> DenseParams:
    """HF-named torch-layout tensors → ``DenseParams``. Every tensor must be used exactly once."""
    tensors = hf_causal_lm_tensors(tensors)
    embed, lm_head = take_embedding_and_head(tensors, config.vocab_size, config.hidden_size, config.tie_word_embeddings)
    layers = [_layer_from_hf(tensors, config, i) for i in range(config.num_layers)]
    final_norm = take(tensors, "model.norm.weight", (config.hidden_size,))
    check_consumed(tensors, config.model_type)
    windows = config.layer_windows or (0,) * config.num_layers
    params = DenseParams(
        embed=embed,
        layers=tuple(DenseLayer(**layer, window=window) for layer, window in zip(layers, windows)),
        final_norm=final_norm,
        lm_head=lm_head,
    )
    return cast_params(params, dtype)


# ----------------------------------------------------------------------------------------------
# Forward


def _attention_layer(
    lp: DenseLayer, x: Array, cache_k: Array | Int8KV, cache_v: Array | Int8KV, lengths: Array, cos: Array, sin: Array,
    config: TargetConfig,
) -> tuple[Array, Array | Int8KV, Array | Int8KV]:
    """One layer's attention: x ``[B, T, H]`` (normed), cache_k/v ``[B, K, S, D]`` (float or ``Int8KV``)
    → out ``[B, T, H]`` and the caches with this block's K/V written (in place inside a loop)."""
    b, t, _ = x.shape
    n, kh, d = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = x @ lp.qkv
    if lp.qkv_bias is not None:
        qkv = qkv + lp.qkv_bias
    g = lp.qkv_groups
    qkv = qkv.reshape(b, t, g, (n + 2 * kh) // g, d)  # per group: [q heads | k heads | v heads]
    q = qkv[:, :, :, : n // g].reshape(b, t, n, d)
    k = qkv[:, :, :, n // g : (n + kh) // g].reshape(b, t, kh, d)
    v = qkv[:, :, :, (n + kh) // g :].reshape(b, t, kh, d)
    if lp.q_norm is not None:
        q = rms_norm(q, lp.q_norm, config.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, config.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    positions = lengths[:, None] + jnp.arange(t)  # [B, T]
    cache_k = write_block(cache_k, k, lengths)
    cache_v = write_block(cache_v, v, lengths)

    slots = jnp.arange(cache_v.shape[2])[None, None, :]  # [1, 1, S]
    visible = slots <= positions[:, :, None]  # causal over absolute positions
    if lp.window:
        visible &= slots > positions[:, :, None] - lp.window
    (k_values, k_scale), (v_values, v_scale) = attention_operands(cache_k), attention_operands(cache_v)
    out = cached_attention(q, k_values, v_values, visible, k_scale, v_scale).reshape(b, t, n * d) @ lp.o
    if lp.o_bias is not None:
        out = out + lp.o_bias
    return out, cache_k, cache_v


def regroup(lp: DenseLayer, config: TargetConfig, qkv_groups: int, mlp_groups: int) -> DenseLayer:
    """Re-store a layer's fused columns in ``qkv_groups`` / ``mlp_groups`` device groups (see ``DenseLayer``);
    the forward reads either layout, so this only changes which columns sit together."""
    n, kh, d = config.num_heads, config.num_kv_heads, config.head_dim

    def qkv_cols(w: Array, g_old: int, g_new: int) -> Array:  # [..., (N+2K)·D] between group layouts
        lead = w.shape[:-1]
        q, k, v = jnp.split(w.reshape(*lead, g_old, (n + 2 * kh) // g_old * d), [n // g_old * d, (n + kh) // g_old * d], -1)
        q, k, v = (part.reshape(*lead, g_new, -1) for part in (q, k, v))  # heads stay in order across groups
        return jnp.concatenate([q, k, v], axis=-1).reshape(*lead, -1)

    def mlp_cols(w: Array, g_old: int, g_new: int) -> Array:  # [..., 2F]
        lead = w.shape[:-1]
        halves = w.reshape(*lead, g_old, 2, -1)
        gate, up = (halves[..., i, :].reshape(*lead, g_new, -1) for i in (0, 1))
        return jnp.stack([gate, up], axis=-2).reshape(*lead, -1)

    if n % qkv_groups or kh % qkv_groups:
        raise ValueError(f"{n} query / {kh} KV heads do not split into {qkv_groups} groups")
    if config.intermediate_size % mlp_groups:
        raise ValueError(f"MLP width {config.intermediate_size} does not split into {mlp_groups} groups")
    gq, gm = lp.qkv_groups, lp.mlp_groups
    return lp.replace(
        qkv=qkv_cols(lp.qkv, gq, qkv_groups),
        qkv_bias=None if lp.qkv_bias is None else qkv_cols(lp.qkv_bias, gq, qkv_groups),
        gate_up=mlp_cols(lp.gate_up, gm, mlp_groups),
        gate_up_bias=None if lp.gate_up_bias is None else mlp_cols(lp.gate_up_bias, gm, mlp_groups),
        qkv_groups=qkv_groups,
        mlp_groups=mlp_groups,
    )


def _mlp(lp: DenseLayer, x: Array) -> Array:
    gate_up = x @ lp.gate_up
    if lp.gate_up_bias is not None:
        gate_up = gate_up + lp.gate_up_bias
    lead, g = gate_up.shape[:-1], lp.mlp_groups
    gate_up = gate_up.reshape(*lead, g, 2, -1)  # per group: [gate | up]
    gate, up = gate_up[..., 0, :].reshape(*lead, -1), gate_up[..., 1, :].reshape(*lead, -1)
    out = (jax.nn.silu(gate) * up) @ lp.down
    return out if lp.down_bias is None else out + lp.down_bias


def forward(
    params: DenseParams, config: TargetConfig, cache: KVCache, tokens: Array, taps: tuple[int, ...] = ()
) -> TargetForward:
    """Run ``tokens [B, T]`` at positions ``cache.lengths[:, None] + arange(T)``.

    Returns ``hidden [B, T, H]`` (after the final norm), ``tapped [len(taps), B, T, H]`` (residual stream
    after each tapped layer; equal to HF's ``hidden_states[i+1]`` except for the last layer, which HF
    reports after the final norm), the cache with the block's K/V written (lengths unchanged; see
    ``KVCache.commit``) and no replay record (a commit keeps any prefix).
    """
    check_taps(taps, config.num_layers)
    x = params.embed[tokens]  # [B, T, H]
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta, x.dtype)
    cache_k, cache_v = list(cache.k), list(cache.v)
    residuals = []
    # Unrolled over layers: each layer reads its own weight buffers (a scan would slice stacked
    # weights, which XLA:CPU copies, doubling the memory traffic of a decode step).
    for i, lp in enumerate(params.layers):
        normed = rms_norm(x, lp.input_norm, config.rms_norm_eps)
        attn_out, cache_k[i], cache_v[i] = _attention_layer(lp, normed, cache_k[i], cache_v[i], cache.lengths, cos, sin, config)
        x = x + attn_out
        x = x + _mlp(lp, rms_norm(x, lp.post_norm, config.rms_norm_eps))
        residuals.append(x)
    hidden = rms_norm(x, params.final_norm, config.rms_norm_eps)
    return TargetForward(hidden, stack_taps(residuals, taps), cache.replace(k=tuple(cache_k), v=tuple(cache_v)), None)


def replay(cache: KVCache, record: None, num_tokens: Array) -> KVCache:
    """Keep the first ``num_tokens [B]`` tokens of the block: K/V are position-indexed, so a commit."""
    return cache.commit(num_tokens)


FAMILY = register_family(
    TargetFamily(
        name="dense",
        model_types=DENSE_TARGET_TYPES,
        parse_config=dense_config_from_dict,
        params_from_hf=params_from_hf_tensors,
        init_cache=init_kv_cache,
        forward=forward,
        replay=replay,
        kv_cache_dtypes=KV_CACHE_DTYPES,
    )
)
