"""The target model, whatever its family: load it, make its cache, run a block, keep a prefix, logits.

Every call dispatches on ``target.config.model_type`` through the family registry (``family.py``); the
built-in families are ``dense.py`` (Llama, Qwen3) and ``hybrid.py`` (Qwen3.5, dense Qwen3-Next), both
registered by importing this module. Nothing here, nor in the speculative loop, the server or the
trainer, asks which family it holds.

``forward`` runs a block of ``T`` tokens per row at positions ``lengths[b] … lengths[b]+T-1`` on top of
the cache, writes it there, and returns a ``TargetForward``: the final-normed hidden states, the
residual stream after any requested layers ("taps", HF numbering: tap ``i`` = ``hidden_states[i+1]``),
the cache (lengths unchanged) and the family's replay record. ``replay(cache, record, n)`` keeps the
first ``n [B]`` tokens of that block and advances ``lengths`` (dense: a commit; hybrid: the GDN state is
rebuilt from the record). Logits are a separate step (``lm_logits``) so callers only project the
positions they need onto the vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.models import dense, hub, hybrid, quant  # noqa: F401  (importing dense and hybrid registers the built-in families)
from dspine_jax.models.config import TargetConfig
from dspine_jax.models.family import TargetFamily, TargetForward, family_for, load_target_config
from dspine_jax.models.weights import load_safetensors_dir

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "bf16": jnp.bfloat16}


@struct.dataclass
class Target:
    """A loaded target model: params (pytree) + static config. Pass it straight into ``jax.jit``."""

    params: Any  # the family's params pytree (``dense.DenseParams``, ``hybrid.HybridParams``, …)
    config: TargetConfig = struct.field(pytree_node=False)  # the family's config (a TargetConfig)
    model_dir: str = struct.field(pytree_node=False, default="")

    @property
    def family(self) -> TargetFamily:
        return family_for(self.config.model_type)

    @property
    def dtype(self) -> jnp.dtype:
        return self.params.embed.dtype


def resolve_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(set(DTYPES))}")
        return DTYPES[dtype]
    return dtype


# The families' linear weights ([in, out], applied as ``x @ w``) that ``quantize="int8"`` stores as int8,
# besides the embedding and the LM head: dense q|k|v, o, gate|up, down; hybrid attention and MLP; GDN.
QUANTIZED_MATRICES = ("qkv", "o", "gate_up", "down", "q", "k", "v", "gate", "up", "z", "a", "b", "out")


def load_target(
    path_or_alias: str | os.PathLike, dtype: str | jnp.dtype = "float32", quantize: str | None = None
) -> Target:
    """Load a HF-format checkpoint (directory, alias or hub repo id ``ORG/NAME[@REVISION]``, see
    ``hub.resolve_model_dir``) of any registered family as a ``Target``. ``quantize="int8"``: weight-only
    int8 (``quant.py``) for every matrix, the embedding and the LM head; ``dtype`` is then the compute
    dtype (activations, scales, norms)."""
    dtype = resolve_dtype(dtype)
    if quantize not in (None, *quant.QUANTIZE_CHOICES):
        raise ValueError(f"quantize must be one of {', '.join(quant.QUANTIZE_CHOICES)}, got {quantize!r}")
    model_dir = Path(hub.resolve_model_dir(path_or_alias))
    config = load_target_config(model_dir)
    params = family_for(config.model_type).params_from_hf(load_safetensors_dir(model_dir), config, dtype)
    if quantize == "int8":
        params = quant.quantize_params(params, QUANTIZED_MATRICES)
    return Target(params=params, config=config, model_dir=str(model_dir))


def init_cache(target: Target, batch: int, capacity: int) -> Any:
    """An empty cache for ``batch`` rows of up to ``capacity`` tokens each."""
    return target.family.init_cache(target.config, batch, capacity, target.dtype)


def forward(target: Target, cache: Any, tokens: Array, taps: tuple[int, ...] = ()) -> TargetForward:
    """Run ``tokens [B, T]`` at positions ``cache.lengths[:, None] + arange(T)`` → ``TargetForward``
    ``(hidden [B, T, H], tapped [len(taps), B, T, H], cache, replay record)`` (module doc)."""
    return target.family.forward(target.params, target.config, cache, tokens, tuple(taps))


def replay(target: Target, cache: Any, record: Any, num_tokens: Array) -> Any:
    """Keep the first ``num_tokens [B]`` tokens of the block ``forward`` just ran (``cache`` and ``record``
    are its outputs); ``lengths`` advance by ``num_tokens``. Rows may keep different counts, 0 … T."""
    return target.family.replay(cache, record, num_tokens)


def lm_logits(target: Target, hidden: Array) -> Array:
    """``hidden [..., H]`` → float32 logits ``[..., V]``."""
    return quant.matmul_f32(hidden, target.params.lm_head)
