"""Target families: one record per architecture, looked up by the ``model_type`` of its ``config.json``.

A family is everything the rest of the package needs to run one kind of target:

    parse_config(config_json_dict)                  → a frozen config (a ``TargetConfig`` or a subclass)
    params_from_hf(tensors, config, dtype)          → the params pytree (HF names, torch layout in)
    init_cache(config, batch, capacity, dtype)      → an empty cache pytree: ``lengths [B]`` (committed
                                                      tokens per row), ``capacity`` and ``commit(n)``;
                                                      ``kv_cache_dtype=`` too when the family lists more
                                                      than "auto" in ``kv_cache_dtypes``
    forward(params, config, cache, tokens, taps)    → ``TargetForward`` (one return shape for all families)
    replay(cache, record, num_tokens)               → the cache keeping only a prefix of the block

``target.py`` dispatches through this registry, so the speculative loop, the server and training never
ask which family they hold. The built-in entries are ``dense`` (Llama, Qwen3: ``dense.py``) and
``hybrid`` (Qwen3.5, dense Qwen3-Next: ``hybrid.py``); a new architecture registers one more record
(``register_family``) from its own module — inside the package or outside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
from jax import Array

from dspine_jax.models.config import TargetConfig, UnsupportedModelError, as_id_tuple, read_config_json


class TargetForward(NamedTuple):
    """What every family's forward returns for a block of ``T`` tokens per row."""

    hidden: Array  # [B, T, H] after the final norm
    tapped: Array  # [len(taps), B, T, H] residual stream after each tapped layer (HF hidden_states[i+1])
    cache: Any  # the cache with the block written (lengths unchanged)
    replay: Any  # what ``replay`` needs to keep a prefix of the block (None when commit suffices)


@dataclasses.dataclass(frozen=True)
class TargetFamily:
    name: str
    model_types: tuple[str, ...]  # config.json ``model_type`` values this family reads
    parse_config: Callable[[dict[str, Any]], TargetConfig]
    params_from_hf: Callable[..., Any]  # (tensors, config, dtype) → params
    init_cache: Callable[..., Any]  # (config, batch, capacity, dtype) → cache
    forward: Callable[..., TargetForward]  # (params, config, cache, tokens [B, T], taps) → TargetForward
    replay: Callable[..., Any]  # (cache, record, num_tokens [B]) → cache, lengths advanced
    # ``kv_cache_dtype`` values its ``init_cache`` accepts (as a keyword); "auto" (the model's dtype) always.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)


def check_taps(taps: tuple[int, ...], num_layers: int) -> None:
    for layer in taps:
        if not 0 <= layer < num_layers:
            raise ValueError(f"tap layer {layer} out of range for a {num_layers}-layer target")


def stack_taps(residuals: list[Array], taps: tuple[int, ...]) -> Array:
    """The residual streams of the tapped layers ``[len(taps), B, T, H]`` (``[0, B, T, H]`` for no taps)."""
    last = residuals[-1]
    return jnp.stack([residuals[i] for i in taps]) if taps else jnp.zeros((0, *last.shape), last.dtype)


_FAMILIES: dict[str, TargetFamily] = {}


def register_family(family: TargetFamily) -> TargetFamily:
    """Make ``family`` the one that loads and runs its ``model_types``. A type another family already runs
    raises (``unregister_family`` it first to swap in an implementation of one's own)."""
    taken = [t for t in family.model_types if _FAMILIES.get(t, family) is not family]
    if taken:
        raise ValueError(f"model type(s) {', '.join(taken)} already registered by another family; "
                         "unregister_family it first to replace it")
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def unregister_family(family: TargetFamily) -> None:
    for model_type in family.model_types:
        if _FAMILIES.get(model_type) is family:
            del _FAMILIES[model_type]


def supported_model_types() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def family_for(model_type: str | None) -> TargetFamily:
    """The family registered for ``model_type``; ``UnsupportedModelError`` naming the supported ones."""
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported target types: {', '.join(_FAMILIES)}"
        )
    return _FAMILIES[model_type]


def target_config_from_dict(cfg: dict[str, Any]) -> TargetConfig:
    """A ``config.json`` dict → its family's frozen config."""
    return family_for(cfg.get("model_type")).parse_config(cfg)


def load_target_config(model_dir: str | os.PathLike) -> TargetConfig:
    cfg = read_config_json(model_dir)
    # generation_config.json may list extra stop ids (chat models end turns with a special token).
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        extra = as_id_tuple(gen.get("eos_token_id"))
        cfg = {**cfg, "eos_token_id": list(dict.fromkeys(as_id_tuple(cfg.get("eos_token_id")) + extra))}
    return target_config_from_dict(cfg)
