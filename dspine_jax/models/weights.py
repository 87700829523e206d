"""safetensors ↔ flat ``{name: array}`` dicts, with clear errors for broken checkpoints."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

# A Llama / Qwen3 decoder layer's HF tensors (drafters store their layers in this form): (our field, suffix under
# ``layers.{i}.``, transpose torch's [out, in] to [in, out]?). ``q_norm`` / ``k_norm``: Qwen3's per-head norms.
DECODER_LAYER_TENSORS: tuple[tuple[str, str, bool], ...] = (
    ("input_norm", "input_layernorm.weight", False),
    ("q", "self_attn.q_proj.weight", True),
    ("k", "self_attn.k_proj.weight", True),
    ("v", "self_attn.v_proj.weight", True),
    ("o", "self_attn.o_proj.weight", True),
    ("q_norm", "self_attn.q_norm.weight", False),
    ("k_norm", "self_attn.k_norm.weight", False),
    ("post_norm", "post_attention_layernorm.weight", False),
    ("gate", "mlp.gate_proj.weight", True),
    ("up", "mlp.up_proj.weight", True),
    ("down", "mlp.down_proj.weight", True),
)


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not fit the model it is loaded into."""


def _load_one(path: Path) -> dict[str, np.ndarray]:
    try:
        # bf16 tensors load as ml_dtypes.bfloat16 numpy arrays, which jax accepts as-is.
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e


def load_safetensors_dir(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of ``model.safetensors`` or of a sharded ``model.safetensors.index.json``."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return _load_one(single)
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = model_dir / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{index} names shard {shard} which does not exist")
            tensors.update(_load_one(shard_path))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"tensors listed in {index} but absent from their shard: {missing[:5]}")
        return tensors
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def strip_prefix(tensors: Mapping[str, np.ndarray], prefixes: Iterable[str]) -> dict[str, np.ndarray]:
    """Drop the first matching prefix from every name (e.g. ``model.language_model.``)."""
    out = {}
    for name, value in tensors.items():
        for prefix in prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        out[name] = value
    return out


def take(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Pop ``name`` from ``tensors`` and check its shape; errors name the tensor."""
    if name not in tensors:
        raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
    value = tensors.pop(name)
    if tuple(value.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value


def check_consumed(tensors: Mapping[str, np.ndarray], what: str) -> None:
    """After every expected tensor was ``take``n, anything left is an error, not silently dropped."""
    if tensors:
        names = sorted(tensors)
        raise CheckpointError(f"unexpected tensors in {what} checkpoint: {names[:8]}{' …' if len(names) > 8 else ''}")


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    save_file({k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in tensors.items()}, str(path), metadata=metadata or {"format": "pt"})


def hf_causal_lm_tensors(tensors: Mapping[str, np.ndarray], drop: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """A HF causal-LM's tensors under one naming: wrapper prefixes (``model.language_model.``, …) removed,
    top-level ``layers.``/``embed_tokens.``/``norm.`` put under ``model.``, rotary buffers and names
    starting with ``drop`` (heads and towers a family does not run) left out."""
    tensors = {n: t for n, t in tensors.items() if not (drop and n.startswith(drop)) and not n.endswith("rotary_emb.inv_freq")}
    tensors = strip_prefix(tensors, ["model.language_model.", "language_model."])
    top_level = ("layers.", "embed_tokens.", "norm.")
    return {("model." + k if k.startswith(top_level) else k): v for k, v in tensors.items()}


def take_embedding_and_head(tensors: dict[str, np.ndarray], vocab: int, hidden: int, tied: bool) -> tuple[np.ndarray, np.ndarray]:
    """Pop the input embedding ``[V, H]`` and the LM head as ``[H, V]`` (the embedding's transpose when
    ``tied``; some exports keep the tied copy, which is dropped)."""
    embed = take(tensors, "model.embed_tokens.weight", (vocab, hidden))
    if tied:
        tensors.pop("lm_head.weight", None)
        return embed, embed.T
    return embed, take(tensors, "lm_head.weight", (vocab, hidden)).T


def cast_params(tree: Any, dtype: Any) -> Any:
    """Every numpy leaf of ``tree`` → a jax array of ``dtype`` (through float32, so bf16 files load too)."""
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x, dtype=np.float32), dtype=dtype), tree)
