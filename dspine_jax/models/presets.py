"""Shape presets: the ``config.json`` of published models, so that their programs can be lowered (and
their costs analysed) on a machine that has neither their weights nor a route to the hub
(``python -m dspine_jax.lower --target qwen3-8b``).

The values are those of the models' own ``config.json`` files on the Hugging Face hub (text model only:
a Qwen3.5 checkpoint's vision tower and MTP head are not run by this package). Only what
``dspine_jax/models/config.py`` parses affects the lowered programs; the rest is kept so a reader can
check each preset against its source.
"""

from __future__ import annotations

import copy
from typing import Any

# Qwen/Qwen3-8B (config.json of the hub repo): 36 dense layers, GQA 32/8 heads of 128, untied head.
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen/Qwen3.5-27B, its ``text_config`` (the dense Gated-DeltaNet hybrid): 64 layers, every 4th full
# (gated) attention with 24 query / 4 KV heads of 256, the other 48 Gated DeltaNet with 16 key / 48 value
# heads of 128, partial rotary 0.25, untied 248,320-token head.
QWEN3_5_27B: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": None,
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 17408,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1,
    "num_attention_heads": 24,
    "num_hidden_layers": 64,
    "num_key_value_heads": 4,
    "pad_token_id": None,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "vocab_size": 248320,
}

PRESETS: dict[str, dict[str, Any]] = {"qwen3-8b": QWEN3_8B, "qwen3.5-27b": QWEN3_5_27B}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def preset_config(name: str) -> dict[str, Any] | None:
    """The preset's ``config.json`` dict (a copy), or None if ``name`` is no preset."""
    cfg = PRESETS.get(name.strip().lower())
    return None if cfg is None else copy.deepcopy(cfg)
