"""Target model (Llama / Qwen3 dense, Qwen3.5 / Qwen3-Next hybrid): params as pytrees and a pure block forward.

The dense families live here; hybrid (Gated DeltaNet) targets live in ``hybrid.py`` and are reached
through the same functions, which dispatch on the config type (``HybridConfig``).

``forward`` runs a block of ``T`` tokens per row at positions ``lengths[b] … lengths[b]+T-1`` on top of
the cache, writes their K/V, and returns the final-normed hidden states plus the residual stream after
any requested layers ("taps", HF numbering: tap ``i`` = ``hidden_states[i+1]``). Logits are a separate
step (``lm_logits``) so callers only project the positions they need onto the vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from dspine_jax import hybrid
from dspine_jax.cache import HybridCache, KVCache, init_hybrid_cache, init_kv_cache
from dspine_jax.config import HybridConfig, TargetConfig, load_target_config
from dspine_jax.layers import apply_rope, cached_attention, rms_norm, rope_cos_sin
from dspine_jax.weights import check_consumed, load_safetensors_dir, strip_prefix, take

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "bf16": jnp.bfloat16}


@struct.dataclass
class DenseLayer:
    """One decoder layer. Projections are fused (q|k|v and gate|up) so decoding runs fewer, larger
    GEMVs: on CPU a one-token step is bound by streaming the weights, and each extra op costs time."""

    input_norm: Array  # [H]
    qkv: Array  # [H, (N+2K)*D]
    o: Array  # [N*D, H]
    post_norm: Array  # [H]
    gate_up: Array  # [H, 2F]
    down: Array  # [F, H]
    q_norm: Array | None = None  # [D] (qwen3)
    k_norm: Array | None = None  # [D]
    qkv_bias: Array | None = None  # [(N+2K)*D] (llama attention_bias)
    o_bias: Array | None = None  # [H]
    gate_up_bias: Array | None = None  # [2F] (llama mlp_bias)
    down_bias: Array | None = None  # [H]
    window: int = struct.field(pytree_node=False, default=0)  # 0 = full attention, else sliding window
    # Tensor parallelism splits the fused columns into ``groups`` equal slices, one per device, so the
    # columns are stored group-major: qkv as G × [q | k | v] of N/G, K/G, K/G heads, gate_up as
    # G × [gate | up] of F/G. G = 1 is the plain HF concatenation (see ``regroup``).
    qkv_groups: int = struct.field(pytree_node=False, default=1)
    mlp_groups: int = struct.field(pytree_node=False, default=1)


@struct.dataclass
class TargetParams:
    embed: Array  # [V, H]
    layers: tuple[DenseLayer, ...]  # unrolled, not stacked: per-layer buffers avoid slicing copies
    final_norm: Array  # [H]
    lm_head: Array  # [H, V] (the embedding's transpose when tied)


@struct.dataclass
class Target:
    """A loaded target model: params (pytree) + static config. Pass it straight into ``jax.jit``."""

    params: TargetParams | hybrid.HybridParams
    config: TargetConfig = struct.field(pytree_node=False)  # HybridConfig for hybrid targets
    model_dir: str = struct.field(pytree_node=False, default="")

    @property
    def dtype(self) -> jnp.dtype:
        return self.params.embed.dtype


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


def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: TargetConfig, dtype: jnp.dtype) -> TargetParams:
    """HF-named torch-layout tensors → ``TargetParams``. Every tensor must be used exactly once."""
    tensors = strip_prefix(tensors, ["model.language_model.", "language_model."])
    tensors = {("model." + k if k.startswith(("layers.", "embed_tokens.", "norm.")) else k): v for k, v in tensors.items()}
    v, h = config.vocab_size, config.hidden_size
    embed = take(tensors, "model.embed_tokens.weight", (v, h))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exports keep the tied copy
        lm_head = embed.T
    else:
        lm_head = take(tensors, "lm_head.weight", (v, h)).T
    layers = [_layer_from_hf(tensors, config, i) for i in range(config.num_layers)]
    final_norm = take(tensors, "model.norm.weight", (h,))
    tensors = {name: t for name, t in tensors.items() if not name.endswith("rotary_emb.inv_freq")}
    check_consumed(tensors, config.model_type)

    def cast(x: np.ndarray) -> Array:
        return jnp.asarray(np.asarray(x, dtype=np.float32), dtype=dtype)

    windows = config.layer_windows or (0,) * config.num_layers
    return TargetParams(
        embed=cast(embed),
        layers=tuple(
            DenseLayer(**{name: cast(w) for name, w in layer.items()}, window=window) for layer, window in zip(layers, windows)
        ),
        final_norm=cast(final_norm),
        lm_head=cast(lm_head),
    )


def load_target(path_or_alias: str | os.PathLike, dtype: str | jnp.dtype = "float32") -> Target:
    """Load a HF-format Llama / Qwen3 / Qwen3.5 / dense Qwen3-Next checkpoint (directory or alias) as a ``Target``."""
    from dspine_jax.hub import resolve_model_dir

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(set(DTYPES))}")
        dtype = DTYPES[dtype]
    model_dir = Path(resolve_model_dir(path_or_alias))
    config = load_target_config(model_dir)
    if isinstance(config, HybridConfig):
        params = hybrid.params_from_hf_tensors(load_safetensors_dir(model_dir), config, dtype)
    else:
        params = params_from_hf_tensors(load_safetensors_dir(model_dir), config, dtype)
    return Target(params=params, config=config, model_dir=str(model_dir))


# ----------------------------------------------------------------------------------------------
# Forward


def init_cache(target: Target, batch: int, capacity: int) -> KVCache | HybridCache:
    """An empty cache for ``batch`` rows of up to ``capacity`` tokens each."""
    if isinstance(target.config, HybridConfig):
        return init_hybrid_cache(target.config, batch, capacity, target.dtype)
    return init_kv_cache(target.config, batch, capacity, target.dtype)


# Up to this many rows, blocks are written row by row with dynamic_update_slice, which XLA does in
# place; a scatter along the position axis makes XLA:CPU transpose the whole layer cache. Past it,
# the unrolled row loop would bloat the program, so large batches use one scatter.
ROW_LOOP_MAX_BATCH = 16


def write_block(cache: Array, block: Array, lengths: Array) -> Array:
    """Write ``block [B, T, K, D]`` into ``cache [B, K, S, D]`` at positions ``lengths[b] + t``.

    Callers keep ``lengths + T <= S`` for every row whose output matters (dynamic_update_slice clamps
    the start so the block fits; the scatter path drops out-of-range positions).
    """
    b, t = block.shape[:2]
    block = block.transpose(0, 2, 1, 3).astype(cache.dtype)  # [B, K, T, D]
    if b <= ROW_LOOP_MAX_BATCH:
        for row in range(b):
            cache = jax.lax.dynamic_update_slice(cache, block[row : row + 1], (row, 0, lengths[row], 0))
        return cache
    positions = lengths[:, None] + jnp.arange(t)  # [B, T]
    rows, heads = jnp.arange(b)[:, None, None], jnp.arange(cache.shape[1])[None, :, None]
    return cache.at[rows, heads, positions[:, None, :]].set(block, mode="drop")


def _attention_layer(
    lp: DenseLayer, x: Array, cache_k: Array, cache_v: Array, lengths: Array, cos: Array, sin: Array,
    config: TargetConfig,
) -> tuple[Array, Array, Array]:
    """One layer's attention: x ``[B, T, H]`` (normed), cache_k/v ``[B, K, S, D]``
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
    out = cached_attention(q, cache_k, cache_v, visible).reshape(b, t, n * d) @ lp.o
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
    target: Target, cache: KVCache, tokens: Array, taps: tuple[int, ...] = (), *, return_replay: bool = False
) -> tuple[Array, Array, KVCache]:
    """Run ``tokens [B, T]`` at positions ``cache.lengths[:, None] + arange(T)``.

    Returns ``hidden [B, T, H]`` (after the final norm), ``tapped [len(taps), B, T, H]`` (residual stream
    after each tapped layer; equal to HF's ``hidden_states[i+1]`` except for the last layer, which HF
    reports after the final norm) and the cache with the block's K/V written (lengths unchanged; see
    ``KVCache.commit``).

    Hybrid targets: the cache is a ``HybridCache`` whose GDN windows/states move past all T tokens.
    ``return_replay=True`` returns a 4-tuple ``(hidden, tapped, cache, saved)``; keep a prefix of the
    block with ``replay(cache, saved, num_tokens)`` (for dense targets ``saved`` is None and replay is
    ``cache.commit``), so speculative code is family-agnostic.
    """
    params, config = target.params, target.config
    if isinstance(config, HybridConfig):
        hidden, tapped, cache, saved = hybrid.forward(params, config, cache, tokens, taps, return_replay)
        return (hidden, tapped, cache, saved) if return_replay else (hidden, tapped, cache)
    for layer in taps:
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"tap layer {layer} out of range for a {config.num_layers}-layer target")
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
    tapped = jnp.stack([residuals[i] for i in taps]) if taps else jnp.zeros((0, *x.shape), x.dtype)
    if return_replay:
        return hidden, tapped, cache.replace(k=tuple(cache_k), v=tuple(cache_v)), None
    return hidden, tapped, cache.replace(k=tuple(cache_k), v=tuple(cache_v))


def replay(cache: KVCache | HybridCache, saved, num_tokens: Array) -> KVCache | HybridCache:
    """Keep the first ``num_tokens [B]`` tokens of the block just run by ``forward(..., return_replay=True)``.

    Family-agnostic commit for speculative rounds: for dense targets (``saved is None``) it is
    ``cache.commit(num_tokens)``; for hybrid targets it also rewinds every GDN layer's conv window and
    recurrent state to just after those tokens (``hybrid.replay``). Lengths are advanced either way.
    """
    if saved is None:
        return cache.commit(num_tokens)
    return hybrid.replay(cache, saved, num_tokens)


def lm_logits(target: Target, hidden: Array) -> Array:
    """``hidden [..., H]`` → float32 logits ``[..., V]``."""
    return jnp.matmul(hidden, target.params.lm_head, preferred_element_type=jnp.float32)
