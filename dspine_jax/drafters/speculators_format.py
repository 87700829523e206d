"""vLLM ``speculators`` (0.9.0) checkpoints for the DFlash family: ``dflash``, ``dflash2`` and ``dspark``.

Its ``config.json`` nests the drafter's Qwen3 layer config under ``transformer_layer_config`` and names the
model by ``speculators_model_type``; the block, mask token and taps sit at the top level::

    {"speculators_model_type": "dspark", "architectures": ["DSparkDraftModel"],
     "transformer_layer_config": {"model_type": "qwen3", "hidden_size": …, "num_hidden_layers": L, …},
     "block_size": 8, "mask_token_id": …, "aux_hidden_state_layer_ids": [2, 14, 26],
     "draft_vocab_size": V, "sample_from_anchor": true, "sliding_window_non_causal": false,
     "markov_rank": 256, …, "speculators_config": {"algorithm": "dspark", "verifier": {…}, …}}

``config.flatten_speculators_config`` turns it into the z-lab layout ``drafter_config_from_dict`` parses
(layer config at the top level, ``dflash_config {mask_token_id, target_layer_ids}``, the kind's keys at the
top level) and keeps speculators' own keys under ``"speculators"``; ``nest`` is the way back
(``save_drafter(..., format="speculators")``). Differences the translation handles:

* **Tap numbering**: speculators' layer id is the index into HF's ``hidden_states`` (0 = the embedding
  output), ours the layer whose output is tapped: ours = theirs − 1 (its z-lab converter adds 1). Id 0
  (the embeddings) cannot be tapped here and is refused.
* **Attention**: full-attention draft layers are always bidirectional in speculators (it has no
  ``is_causal``), so a causal drafter cannot be written in its format. Its sliding-window layers window
  the context from the block's anchor (every block query sees the same W context positions) rather than
  per query as z-lab's and ours do, so configs with sliding layers are refused.
* **Verifier-owned tensors**: ``embed_tokens``, ``lm_head`` (the verifier's head, or its draft-vocabulary
  rows, frozen), ``verifier_norm`` and ``verifier_lm_head`` are the target's; speculators leaves most out
  of its files, and any that are present are ignored (``VERIFIER_TENSORS``). A draft-vocabulary export
  writes ``lm_head.weight`` (speculators keeps the reduced head in the file) with ``d2t`` / ``t2d``.
* ``sample_from_anchor`` (block position k proposes token k + 1) is read by DSpark only; a DFlash or
  DFlash2 checkpoint with it set is refused.

Other tensor names are the z-lab ones (``fc``, ``hidden_norm``, ``norm``, ``layers.*``, DFlash2's convolutions
and ``candidate_selector.*`` codebooks without ``.weight``), so the kinds' checkpoint hooks serve both layouts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dspine_jax.drafters.config import DrafterConfig, drafter_config_to_dict, drafter_kind
from dspine_jax.models import hub

SPECULATORS_VERSION = "0.9.0"
# Per speculators model type (= our kind name): its top-level keys beyond DFlash's, with speculators'
# defaults (what its pydantic config fills in for a key the file leaves out).
KIND_KEYS: dict[str, dict[str, Any]] = {
    "dflash": {},
    "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    "dspark": {
        "markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "sample_from_anchor": True,
    },
}  # fmt: skip
# Flat (z-lab layout) keys that are not part of speculators' ``transformer_layer_config``.
_NOT_LAYER_KEYS = {
    "architectures", "auto_map", "block_size", "num_target_layers", "dflash_config", "draft_vocab_size", "is_causal",
    "mask_token_id", "target_layer_ids", "speculators", "dtype", "torch_dtype", "transformers_version",
    "input_embedding_scale", "output_multiplier", "final_logit_softcapping", "dspine_config", "transfer_ready",
    "sample_from_anchor",
}  # fmt: skip
# Tensors a speculators checkpoint may hold that belong to the verifier (the target supplies them here).
VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def speculators_model_type(path: str | os.PathLike) -> str | None:
    """The ``speculators_model_type`` of the ``config.json`` in directory ``path`` (``"eagle3"``, ``"mtp"``, …); None
    without such a file or key."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("speculators_model_type")
    except (ValueError, OSError, AttributeError):
        return None


def spec_model_type(text: str) -> str | None:
    """The ``speculators_model_type`` a ``--draft`` value names: a directory or hub repo id (fetched, or read from
    the cache) whose ``config.json`` has one; None for anything else (``init:`` / ``self:`` values, other paths)."""
    if text.startswith(("init:", "self:")) or not (os.path.isdir(text) or hub.parse_repo_id(text) is not None):
        return None
    return speculators_model_type(hub.resolve_drafter_dir(text))


def speculative_tokens(cfg: dict[str, Any], default: int) -> int:
    """The tokens a speculators checkpoint drafts per round (its first proposal method's)."""
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens", default))


def proposal_config(algorithm: str, tokens: int, verifier: str | None = None,
                    architectures: list[str] | None = None) -> dict[str, Any]:
    """``speculators_config``: greedy proposals of ``tokens`` per round; ``verifier`` the target's path or hub id
    (where speculators' loader reads the embedding and LM head)."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "accept_tolerance": 0.0,
                              "verifier_accept_k": 1}],
        "verifier": {"name_or_path": verifier, "architectures": architectures or []},
    }


def from_speculators(config: DrafterConfig) -> bool:
    """Whether ``config`` was read from a speculators checkpoint (its verifier-owned tensors are skipped)."""
    return "speculators" in json.loads(config.raw_json)


def nest(config: DrafterConfig) -> dict[str, Any]:
    """``config`` as a speculators config.json dict (what its ``SpeculatorModel.from_pretrained`` reads). Keys
    speculators kept when the drafter was read from its format (``speculators_config``, …) are written back."""
    stype = config.kind
    if stype not in KIND_KEYS:
        raise ValueError(f"a {stype!r} drafter has no speculators format (it has {', '.join(KIND_KEYS)})")
    if any(config.layer_windows) or any(config.layer_causal):
        raise ValueError(
            "speculators runs every draft layer with full, bidirectional attention in the block; this drafter has "
            "sliding-window or causal layers"
        )
    unsupported = {
        name: getattr(config, name)
        for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", 0.0))
        if getattr(config, name) != neutral
    }
    if unsupported:
        raise ValueError(f"speculators' {stype} has no {', '.join(unsupported)} (this drafter sets {unsupported})")
    flat = drafter_config_to_dict(config)
    section = flat.get("dflash_config") or {}
    layer = {key: value for key, value in flat.items() if key not in _NOT_LAYER_KEYS and key not in KIND_KEYS[stype]}
    layer["model_type"] = layer.get("model_type") or "qwen3"
    own = dict(flat.get("speculators") or {})
    own.setdefault("speculators_config", proposal_config(stype, drafter_kind(stype).verify_block(config) - 1))
    own.pop("auto_map", None)  # points at a config.py speculators writes beside it; we write none
    own.setdefault("speculators_version", SPECULATORS_VERSION)
    own.setdefault("sliding_window_non_causal", stype == "dflash2")
    kind_keys = {key: section.get(key, flat.get(key, default)) for key, default in KIND_KEYS[stype].items()}
    return {
        **own,
        **kind_keys,
        "speculators_model_type": stype,
        "architectures": [drafter_kind(stype).architecture],
        "transformer_layer_config": layer,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "sample_from_anchor": bool(getattr(config, "sample_from_anchor", False)),
    }
