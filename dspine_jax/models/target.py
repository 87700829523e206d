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

from dspine_jax.models import dense, hub, hybrid, panels, quant  # noqa: F401  (importing dense and hybrid registers the built-in families)
from dspine_jax.models.cache import resolve_kv_cache_dtype
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
    # How ``init_cache`` stores attention K/V — "auto" (the model's dtype) or "int8" (``cache.Int8KV``) — and,
    # through the proposer, the drafter's context ring. Static: each value compiles its own programs.
    kv_cache_dtype: str = struct.field(pytree_node=False, default="auto")

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
    path_or_alias: str | os.PathLike, dtype: str | jnp.dtype = "float32", quantize: str | None = None,
    kv_cache_dtype: str | None = "auto", products: str = "auto",
) -> Target:
    """Load a HF-format checkpoint (directory, alias or hub repo id ``ORG/NAME[@REVISION]``, see
    ``hub.resolve_model_dir``) of any registered family as a ``Target``. ``quantize="int8"``: weight-only
    int8 (``quant.py``) for every matrix, the embedding and the LM head; ``dtype`` is then the compute
    dtype (activations, scales, norms). ``kv_cache_dtype="int8"``: attention K/V caches (and a drafter's
    context ring) in int8 with a float32 scale per row, head and token (``cache.Int8KV``). ``products``:
    ``"auto"`` packs the weight matrices for the CPU panel kernel where it applies (``panels.py``: float32 on a
    CPU backend), ``"panels"`` insists, ``"xla"`` keeps XLA's matmuls."""
    dtype = resolve_dtype(dtype)
    if quantize not in (None, *quant.QUANTIZE_CHOICES):
        raise ValueError(f"quantize must be one of {', '.join(quant.QUANTIZE_CHOICES)}, got {quantize!r}")
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)  # a bad value fails before the weights load
    model_dir = Path(hub.resolve_model_dir(path_or_alias))
    config = load_target_config(model_dir)
    family = family_for(config.model_type)
    _check_kv_cache_dtype(family, kv_cache_dtype)
    params = family.params_from_hf(load_safetensors_dir(model_dir), config, dtype)
    if quantize == "int8":
        params = quant.quantize_params(params, QUANTIZED_MATRICES)
    else:
        params = panels.pack_params(params, QUANTIZED_MATRICES, products)
    return with_kv_cache_dtype(Target(params=params, config=config, model_dir=str(model_dir)), kv_cache_dtype)


def with_kv_cache_dtype(target: Target, kv_cache_dtype: str | None) -> Target:
    """``target`` whose caches store K/V as ``kv_cache_dtype`` ("auto"/"none"/None or "int8"); the weights
    are shared. A family that cannot store it is a ValueError here, not at the first cache."""
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
    _check_kv_cache_dtype(target.family, kv_cache_dtype)
    return target.replace(kv_cache_dtype=kv_cache_dtype)


def _check_kv_cache_dtype(family: TargetFamily, kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in family.kv_cache_dtypes:
        raise ValueError(f"the {family.name!r} target family has no {kv_cache_dtype} KV cache "
                         f"(it supports kv_cache_dtype {', '.join(family.kv_cache_dtypes)})")


def init_cache(target: Target, batch: int, capacity: int) -> Any:
    """An empty cache for ``batch`` rows of up to ``capacity`` tokens each (K/V as ``target.kv_cache_dtype``)."""
    if target.kv_cache_dtype == "auto":  # the plain call: families without KV options take no keyword
        return target.family.init_cache(target.config, batch, capacity, target.dtype)
    _check_kv_cache_dtype(target.family, target.kv_cache_dtype)  # (a ``target.replace`` skips with_kv_cache_dtype)
    return target.family.init_cache(target.config, batch, capacity, target.dtype, kv_cache_dtype=target.kv_cache_dtype)


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
