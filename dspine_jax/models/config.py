"""HF ``config.json`` → frozen, hashable configs (usable as static jit arguments)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

# model_type values per family (the registry in family.py maps them to code).
DENSE_TARGET_TYPES = ("llama", "qwen3")
# Hybrid Gated-DeltaNet / gated-attention families (dspine_jax/models/hybrid.py). ``qwen3_5`` is the
# multimodal wrapper config (text model under ``text_config``); ``qwen3_5_text`` is what
# ``Qwen3_5ForCausalLM.save_pretrained`` writes.
HYBRID_TARGET_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")
# Read by the hybrid family only to say clearly that mixture-of-experts MLPs are not implemented.
MOE_HYBRID_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture this package does not implement."""


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # llama option: biases on q/k/v/o
    mlp_bias: bool = False  # llama option: biases on gate/up/down
    qk_norm: bool = False  # qwen3: per-head RMSNorm on q and k before RoPE
    # Per layer: 0 = full causal attention, w > 0 = sliding window of w keys (qwen3 sliding layers).
    layer_windows: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported yet (only 'default' RoPE is implemented)"
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def as_id_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def _common_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ``TargetConfig`` fields every family reads the same way (widths, heads, norms, RoPE, ids)."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    return dict(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=as_id_tuple(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
    )


def dense_config_from_dict(cfg: dict[str, Any]) -> TargetConfig:
    """``config.json`` of a ``llama`` / ``qwen3`` model → TargetConfig (the dense family, dense.py)."""
    model_type = cfg.get("model_type")
    common = _common_fields(cfg, model_type)
    num_layers = common["num_layers"]
    layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
    window = cfg.get("sliding_window")
    windows = []
    for kind in layer_types:
        if kind == "full_attention":
            windows.append(0)
        elif kind == "sliding_attention":
            windows.append(int(window) if window else 0)
        else:
            raise UnsupportedModelError(f"layer type {kind!r} is not supported for {model_type}")
    return TargetConfig(
        **common,
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        layer_windows=tuple(windows),
    )


@dataclasses.dataclass(frozen=True)
class HybridConfig(TargetConfig):
    """Qwen3.5 / Qwen3-Next hybrid: Gated DeltaNet layers interleaved with gated full attention.

    The inherited attention fields (``num_heads``, ``num_kv_heads``, ``head_dim``) describe the
    full-attention layers, which always have q/k norms and a per-head sigmoid output gate; every
    RMSNorm of the stack except the GDN output norm is zero-centred (``1 + w``).
    """

    layer_kinds: tuple[str, ...] = ()  # per layer: "linear_attention" (GDN) or "full_attention"
    rotary_dim: int = 0  # partial RoPE: the first ``rotary_dim`` dims of each attention head rotate
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    # Checkpoint layout of the GDN input projections: "split" (qwen3_5: in_proj_qkv/z/b/a) or
    # "fused" (qwen3_next: in_proj_qkvz/ba, interleaved per key head).
    gdn_projection_layout: str = "split"

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "full_attention")

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v concatenated."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim


def _moe_layers(cfg: dict[str, Any], num_layers: int) -> list[int]:
    """Layers HF builds as sparse-MoE blocks (Qwen3NextDecoderLayer's rule)."""
    num_experts = int(cfg.get("num_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    if num_experts <= 0:
        return []
    return [i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0]


def hybrid_config_from_dict(cfg: dict[str, Any]) -> HybridConfig:
    """``config.json`` of a ``qwen3_5`` / ``qwen3_5_text`` / dense ``qwen3_next`` model → HybridConfig."""
    outer_type = cfg.get("model_type")
    if outer_type in MOE_HYBRID_TYPES:
        raise UnsupportedModelError(
            f"model_type {outer_type!r} (Qwen3.5 mixture-of-experts) is not supported yet; "
            "only dense-MLP hybrid targets (qwen3_5, dense qwen3_next) are implemented"
        )
    if outer_type == "qwen3_5" and isinstance(cfg.get("text_config"), dict):
        # Multimodal wrapper: the language model's config is nested. Top-level token ids and
        # tie_word_embeddings (what Qwen3_5ForConditionalGeneration ties on) take precedence.
        text = dict(cfg["text_config"])
        for key in ("tie_word_embeddings", "bos_token_id", "pad_token_id"):
            if cfg.get(key) is not None:
                text[key] = cfg[key]
        text["eos_token_id"] = list(
            dict.fromkeys(as_id_tuple(cfg.get("eos_token_id")) + as_id_tuple(text.get("eos_token_id")))
        )
        cfg = text
    family = "qwen3_next" if outer_type == "qwen3_next" else "qwen3_5"
    num_layers = int(cfg["num_hidden_layers"])
    if family == "qwen3_next":
        moe = _moe_layers(cfg, num_layers)
        if moe:
            raise UnsupportedModelError(
                f"qwen3_next with mixture-of-experts MLP layers is not supported yet (num_experts="
                f"{cfg.get('num_experts')}, decoder_sparse_step={cfg.get('decoder_sparse_step', 1)} make "
                f"layers {moe[:8]}{' …' if len(moe) > 8 else ''} sparse-MoE); only dense-MLP configs work "
                "(num_experts=0, or every layer listed in mlp_only_layers)"
            )
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{family} with attention_bias=true is not supported yet")
    kinds = cfg.get("layer_types")
    if not kinds:
        interval = int(cfg.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    kinds = tuple(kinds)
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for num_hidden_layers={num_layers}")
    for kind in kinds:
        if kind not in ("linear_attention", "full_attention"):
            raise UnsupportedModelError(f"layer type {kind!r} is not supported for {family}")
    common = _common_fields(cfg, family)
    rope = cfg.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if nv % nk:
        raise ValueError(f"linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk}")
    return HybridConfig(
        **common,
        qk_norm=True,
        layer_windows=(0,) * num_layers,
        layer_kinds=kinds,
        rotary_dim=int(common["head_dim"] * factor),
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=int(cfg["linear_key_head_dim"]),
        linear_value_head_dim=int(cfg["linear_value_head_dim"]),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        gdn_projection_layout="fused" if family == "qwen3_next" else "split",
    )


def read_config_json(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a HF-format model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
