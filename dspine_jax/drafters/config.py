"""Drafter ``config.json`` (z-lab DFlash / SpecForge DSpine layout) ↔ a frozen, hashable ``DrafterConfig``.

Both layouts are a Qwen3 ``config.json`` (``hidden_size``, ``num_attention_heads``, ``head_dim``, …) plus:

* DFlash (z-lab ``dflash``): top-level ``block_size``, ``num_target_layers`` and
  ``dflash_config {mask_token_id, target_layer_ids}``;
* DSpine (SpecForge): the same plus ``is_causal: true`` and ``dspine_config {transfer_rank,
  message_size, top_k, …training knobs…}``;
* DFlash2 (z-lab ``DFlash2DraftModel``): DFlash plus ``conv_kernel_size``, ``conv_group_size``,
  ``selector_rank`` and ``selector_top_k``, each read like z-lab's ``_draft_value``: from
  ``dflash_config`` first, else the top level.

In-block causality follows the reference implementations (z-lab ``Qwen3DFlashAttention`` and
SpecForge ``resolve_dflash_is_causal``): an explicit ``is_causal`` applies to every layer; when unset,
``full_attention`` layers are bidirectional and ``sliding_attention`` layers are causal. A DSpine
drafter is causal in every layer whatever the file says (its injection assumes slot t never sees t+1).

Sliding windows follow HF's ``Qwen3Config``: ``sliding_window`` only counts when ``use_sliding_window``
is true. A ``sliding_attention`` layer without an effective window is rejected (SpecForge rejects it too;
z-lab would silently run it unwindowed).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

# Drafter kinds by name (``DrafterConfig.kind``): the classes in drafter.py (DFlash), dspine.py (DSpine) and
# dflash2.py (DFlash2), and any registered from outside. Kept here, below every module that runs drafters, so parsing a
# config.json can ask the kind for its own fields.
_KINDS: dict[str, Any] = {}


def register_drafter_kind(kind_class: type) -> type:
    """Class decorator: make ``kind_class`` (a ``drafter.DFlash`` subclass) the kind named ``kind_class.name``. A
    name already taken by another class raises (``unregister_drafter_kind`` first to replace a kind on purpose):
    two kinds under one name would load each other's checkpoints."""
    known = _KINDS.get(kind_class.name)
    if known is not None and type(known) is not kind_class:
        raise ValueError(f"drafter kind {kind_class.name!r} is already registered by {type(known).__qualname__}; "
                         "unregister_drafter_kind it first to replace it")
    _KINDS[kind_class.name] = kind_class()
    return kind_class


def unregister_drafter_kind(name: str) -> None:
    _KINDS.pop(name, None)


def drafter_kinds() -> tuple[str, ...]:
    return tuple(_KINDS)


def drafter_kind(name: str) -> Any:
    """The registered kind instance called ``name``."""
    if name not in _KINDS:
        raise ValueError(f"drafter kind {name!r} is not registered; known kinds: {', '.join(_KINDS)}")
    return _KINDS[name]


def _kind_of(cfg: dict[str, Any]) -> Any:
    """The kind a config.json describes: the last registered kind whose architecture it names or whose
    config section it carries (subclasses register after their base), else DFlash."""
    archs = cfg.get("architectures") or []
    for kind in reversed(_KINDS.values()):
        if kind.architecture in archs or (kind.config_section and cfg.get(kind.config_section) is not None):
            return kind
    return _KINDS["dflash"]

# SpecForge's DSpineConfig defaults; the training-only fields are kept so a saved config round-trips.
DSPINE_DEFAULTS: dict[str, Any] = {
    "transfer_rank": 1024,
    "message_size": 512,
    "top_k": 16,
    "ce_weight": 0.1,
    "alignment_weight": 0.5,
    "alignment_warmup_steps": 146,
    "replacement_layers": 3,
    "replacement_probability": 0.5,
    "replacement_hold_ratio": 1 / 6,
    "replacement_end_ratio": 1 / 3,
    "candidate_mass_threshold": 1e-4,
}


class DrafterConfigError(ValueError):
    """A drafter config.json that is malformed or describes something this package does not run."""


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Everything static about a drafter. Hashable, so it can ride as a static jit argument."""

    kind: str  # a registered drafter kind: "dflash", "dspine", …
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # anchor + block_size-1 proposals
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # HF numbering: layer i's output = hidden_states[i+1]
    num_target_layers: int
    layer_windows: tuple[int, ...]  # per drafter layer: 0 = unwindowed, w > 0 = query-key distance < w
    layer_causal: tuple[bool, ...]  # per drafter layer: causal inside the block?
    # Decode head: C candidates per slot. DSpine: dspine_config.top_k. DFlash2: selector_top_k. DFlash: the whole vocabulary
    # (the draft distribution is then the plain softmax over V, as in z-lab's sampler).
    top_k: int
    transfer_rank: int = 0  # R (DSpine only)
    message_size: int = 0  # M (DSpine only)
    conv_kernel_size: int = 0  # K of the grouped dynamic causal convolutions (DFlash2 only)
    conv_group_size: int = 0  # channels per dynamic-kernel group: H / conv_group_size groups (DFlash2 only)
    selector_rank: int = 0  # R of the candidate selector's codebooks (DFlash2 only; C = top_k)
    # Draft vocabulary (EAGLE-3's reduced head; any kind): the drafter proposes only these Vd target tokens
    # (the ``d2t`` tensor names them), so its unary logits cost Vd/V of the target head. 0: the whole vocabulary.
    draft_vocab_size: int = 0
    # z-lab options (default no-ops): block embedding scale, logit multiplier and tanh soft-cap.
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    # The parsed config.json (sorted-keys JSON) so save_drafter writes back every key we do not model.
    raw_json: str = dataclasses.field(default="{}", compare=False, repr=False)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def dspine_settings(self) -> dict[str, Any]:
        """The full ``dspine_config`` dict (training knobs included) as it will be saved."""
        raw = json.loads(self.raw_json).get("dspine_config") or {}
        out = {**DSPINE_DEFAULTS, **raw}
        out.update(transfer_rank=self.transfer_rank, message_size=self.message_size, top_k=self.top_k)
        return out


def with_dspine_settings(config: DrafterConfig, **updates: Any) -> DrafterConfig:
    """``config`` with training-only ``dspine_config`` knobs replaced (e.g. the ``alignment_warmup_steps``
    a run really used), so a saved checkpoint records them. The modelled fields (rank, width, top-k)
    cannot change this way: they fix tensor shapes."""
    unknown = set(updates) - set(DSPINE_DEFAULTS)
    fixed = set(updates) & {"transfer_rank", "message_size", "top_k"}
    if config.kind != "dspine" or unknown or fixed:
        bad = sorted(unknown | fixed) or sorted(updates)
        raise DrafterConfigError(f"cannot set dspine_config {bad} on this drafter")
    raw = json.loads(config.raw_json)
    raw["dspine_config"] = {**(raw.get("dspine_config") or {}), **updates}
    return dataclasses.replace(config, raw_json=json.dumps(raw, sort_keys=True))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference default tap layers: evenly spaced from 1 to N-3 (36 layers, 5 taps → 1,9,17,25,33).

    Uses Python's ``round`` (banker's rounding) exactly like z-lab / SpecForge so the ids agree.
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise DrafterConfigError(f"drafter rope type {rope_type!r} is not supported (only 'default' RoPE)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def config_int(cfg: dict[str, Any], key: str, where: str = "config.json") -> int:
    if key not in cfg or cfg[key] is None:
        raise DrafterConfigError(f"drafter {where} is missing {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise DrafterConfigError(f"drafter {where} {key!r} must be an integer, got {value!r}")
    return int(value)


def drafter_config_from_dict(cfg: dict[str, Any]) -> DrafterConfig:
    """Parse a z-lab DFlash or SpecForge DSpine ``config.json`` dict."""
    dflash_cfg = cfg.get("dflash_config") or {}
    kind = _kind_of(cfg)

    hidden = config_int(cfg, "hidden_size")
    heads = config_int(cfg, "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise DrafterConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    num_layers = config_int(cfg, "num_hidden_layers")
    if cfg.get("attention_bias"):
        raise DrafterConfigError("drafters with attention_bias=true are not supported (DFlash/DSpine have no biases)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise DrafterConfigError(f"drafter hidden_act {act!r} is not supported (only 'silu')")
    modes = dflash_cfg.get("attention_modes") or [dflash_cfg.get("attention_mode", "gqa")]
    if any(str(m).lower() not in ("gqa", "mha") for m in modes):
        raise DrafterConfigError(f"drafter attention mode(s) {modes} not supported (only gqa/mha)")

    block_size = int(dflash_cfg.get("block_size", cfg.get("block_size", 16)))
    if block_size < 2:
        raise DrafterConfigError(f"drafter block_size={block_size}: a block needs an anchor and at least one proposal")
    mask_token_id = dflash_cfg.get("mask_token_id", cfg.get("mask_token_id"))
    if mask_token_id is None:
        raise DrafterConfigError("drafter config.json has no dflash_config.mask_token_id")
    num_target_layers = int(cfg.get("num_target_layers") or 0)
    ids = dflash_cfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        if not num_target_layers:
            raise DrafterConfigError(
                "drafter config.json has neither dflash_config.target_layer_ids nor num_target_layers"
            )
        ids = build_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = tuple(int(i) for i in ids)
    if not target_layer_ids:
        raise DrafterConfigError("drafter target_layer_ids is empty")

    layer_types = list(cfg.get("layer_types") or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        raise DrafterConfigError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    is_causal = cfg.get("is_causal")
    windows, causal = [], []
    for i, kind_i in enumerate(layer_types):
        if kind_i == "full_attention":
            windows.append(0)
        elif kind_i == "sliding_attention":
            if not sliding or int(sliding) <= 0:
                raise DrafterConfigError(
                    f"drafter layer {i} is sliding_attention but there is no effective window "
                    f"(use_sliding_window={cfg.get('use_sliding_window')}, sliding_window={cfg.get('sliding_window')})"
                )
            windows.append(int(sliding))
        else:
            raise DrafterConfigError(f"drafter layer type {kind_i!r} is not supported")
        causal.append(bool(is_causal) if is_causal is not None else kind_i == "sliding_attention")

    vocab = config_int(cfg, "vocab_size")
    softcap = dflash_cfg.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
    fields = dict(
        kind=kind.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=config_int(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        block_size=block_size,
        mask_token_id=int(mask_token_id),
        target_layer_ids=target_layer_ids,
        num_target_layers=num_target_layers,
        layer_windows=tuple(windows),
        layer_causal=tuple(causal),
        input_embedding_scale=float(dflash_cfg.get("input_embedding_scale", cfg.get("input_embedding_scale", 1.0))),
        output_multiplier=float(dflash_cfg.get("output_multiplier", cfg.get("output_multiplier", 1.0))),
        final_logit_softcapping=float(softcap or 0.0),
        raw_json=json.dumps(cfg, sort_keys=True),
    )
    fields = kind.configure(cfg, fields)
    draft_vocab = int(cfg.get("draft_vocab_size") or 0)
    if draft_vocab == vocab:
        draft_vocab = 0  # EAGLE-3 configs name the full size when nothing is left out
    if not 0 <= draft_vocab <= vocab or (draft_vocab and fields["top_k"] < vocab and fields["top_k"] > draft_vocab):
        raise DrafterConfigError(
            f"draft_vocab_size={draft_vocab} must be in [top_k={fields['top_k']}, vocab_size={vocab}] (0: the whole vocabulary)"
        )
    return DrafterConfig(**fields, draft_vocab_size=draft_vocab)


def drafter_config_to_dict(config: DrafterConfig) -> dict[str, Any]:
    """The config.json dict for ``config``: the original keys, with every modelled field written back."""
    cfg: dict[str, Any] = json.loads(config.raw_json)
    any_window = max(config.layer_windows, default=0)
    cfg.update(
        architectures=[drafter_kind(config.kind).architecture],
        model_type=cfg.get("model_type", "qwen3"),
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        attention_bias=False,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_theta": config.rope_theta, "rope_type": "default"},
        layer_types=["sliding_attention" if w else "full_attention" for w in config.layer_windows],
        use_sliding_window=bool(any_window),
        sliding_window=any_window or None,
        block_size=config.block_size,
        num_target_layers=config.num_target_layers,
    )
    if config.draft_vocab_size:
        cfg["draft_vocab_size"] = config.draft_vocab_size
    else:
        cfg.pop("draft_vocab_size", None)
    cfg.pop("rope_theta", None)  # rope_parameters is the transformers>=5 spelling; keep one source of truth
    dflash_cfg = dict(cfg.get("dflash_config") or {})
    dflash_cfg.update(mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids))
    cfg["dflash_config"] = dflash_cfg
    try:
        drafter_kind(config.kind).write_config(config, cfg)
    except ValueError as e:
        raise DrafterConfigError(str(e)) from e
    return cfg


def load_drafter_config(model_dir: str | os.PathLike) -> DrafterConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a drafter checkpoint directory")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DrafterConfigError(f"{path} is not valid JSON: {e}") from e
    return drafter_config_from_dict(cfg)
