"""Drafter ``config.json`` (z-lab DFlash / SpecForge DSpine layout) ↔ a frozen, hashable ``DrafterConfig``.

``DrafterConfig`` holds what every drafter kind has (the Qwen3 backbone, the block, the taps, the decode head's
candidate count); a kind with fields of its own subclasses it (``dspine.DSpineConfig``, ``dflash2.DFlash2Config``)
and names that class as its ``config_class``. Every config checks itself on construction (``validate``, also
through ``dataclasses.replace``), so no inconsistent config reaches a jitted program. This module parses and
writes the shared keys and keeps the kind registry; each kind reads and writes its own (``read_config`` /
``write_config`` on ``drafter.DFlash`` and subclasses).

Both layouts are a Qwen3 ``config.json`` (``hidden_size``, ``num_attention_heads``, ``head_dim``, …) plus:

* DFlash (z-lab ``dflash``): top-level ``block_size``, ``num_target_layers`` and
  ``dflash_config {mask_token_id, target_layer_ids}``;
* DSpine (SpecForge): the same plus ``is_causal: true`` and ``dspine_config {transfer_rank,
  message_size, top_k, …training knobs…}``;
* DFlash2 (z-lab ``DFlash2DraftModel``): DFlash plus ``conv_kernel_size``, ``conv_group_size``,
  ``selector_rank`` and ``selector_top_k``, each read like z-lab's ``_draft_value``: from
  ``dflash_config`` first, else the top level;
* DSpark (``dspark.py``): DFlash plus ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov`` and ``sample_from_anchor`` at the top level.

vLLM ``speculators`` checkpoints (``dflash``, ``dflash2``, ``dspark``) nest the layer config and name the
model by ``speculators_model_type``; they are read through ``flatten_speculators_config`` (written back by
``speculators_format.nest``).

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
import math
import numbers
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


class DrafterConfigError(ValueError):
    """A drafter config.json that is malformed or describes something this package does not run."""


def config_check(condition: bool, message: str) -> None:
    """Raise ``DrafterConfigError(message)`` unless ``condition`` (the ``validate`` methods' one check)."""
    if not condition:
        raise DrafterConfigError(message)


def config_check_numbers(config: Any, ints: tuple[str, ...] = (), floats: tuple[str, ...] = (), where: str = "drafter") -> None:
    """``config``'s fields ``ints`` must be integers (not bools: they size arrays) and ``floats`` finite numbers."""
    # ``type(...) is`` first: the common case skips the (slow) abstract-class checks and the message.
    for name in ints:
        value = getattr(config, name)
        if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise DrafterConfigError(f"{where} {name} must be an integer, got {value!r}")
    for name in floats:
        value = getattr(config, name)
        if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)) or not math.isfinite(value):
            raise DrafterConfigError(f"{where} {name} must be a finite number, got {value!r}")


# config.json's names for the fields whose names differ, so an error names the key a user would edit.
_JSON_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}
# DrafterConfig's sizes (each >= 1), its other integer fields and its float fields, checked by ``validate``.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
_SHARED_INTS = (*_SIZES, "block_size", "mask_token_id", "num_target_layers", "top_k", "draft_vocab_size")
_SHARED_FLOATS = ("rms_norm_eps", "rope_theta", "input_embedding_scale", "output_multiplier", "final_logit_softcapping")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Everything static about a drafter that every kind has. Hashable, so it can ride as a static jit argument.

    A kind with fields of its own subclasses this (keyword-only fields, ``kw_only=True``) and extends ``validate``.
    """

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
    num_target_layers: int  # 0: not recorded (the ids are then only checked against the target at load)
    layer_windows: tuple[int, ...]  # per drafter layer: 0 = unwindowed, w > 0 = query-key distance < w
    layer_causal: tuple[bool, ...]  # per drafter layer: causal inside the block?
    # Decode head: C candidates per slot. DSpine: dspine_config.top_k. DFlash2: selector_top_k. DFlash: the whole vocabulary
    # (the draft distribution is then the plain softmax over V, as in z-lab's sampler).
    top_k: int
    # Draft vocabulary (EAGLE-3's reduced head; any kind): the drafter proposes only these Vd target tokens
    # (the ``d2t`` tensor names them), so its unary logits cost Vd/V of the target head. 0: the whole vocabulary.
    draft_vocab_size: int = 0
    # z-lab options (default no-ops): block embedding scale, logit multiplier and tanh soft-cap.
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    # The parsed config.json (sorted-keys JSON) so save_drafter writes back every key we do not model.
    raw_json: str = dataclasses.field(default="{}", compare=False, repr=False)

    def __post_init__(self) -> None:
        # Checked on every construction, ``dataclasses.replace`` included: a config is only ever valid.
        self.validate()

    def validate(self) -> None:
        """Raise ``DrafterConfigError`` naming the first inconsistent value. Subclasses extend it (super first).

        The kind must be registered and its ``config_class`` must be this class or a base of it (a kind's
        fields are read from the config: a DFlash2 drafter cannot run on a config without its convolution).
        """
        kind = _KINDS.get(self.kind)
        config_check(kind is not None, f"drafter kind {self.kind!r} is not registered; known kinds: {', '.join(_KINDS)}")
        config_check(
            isinstance(self, kind.config_class),
            f"a {self.kind!r} drafter needs a {kind.config_class.__name__}, got a {type(self).__name__}",
        )
        config_check_numbers(self, _SHARED_INTS, _SHARED_FLOATS)
        for name in ("target_layer_ids", "layer_windows", "layer_causal"):
            # A list would only fail later, hashing the config as a static jit argument.
            config_check(isinstance(getattr(self, name), tuple), f"drafter {name} must be a tuple, got {getattr(self, name)!r}")
        for name in _SIZES:
            config_check(getattr(self, name) >= 1, f"drafter {_JSON_NAMES.get(name, name)}={getattr(self, name)} must be >= 1")
        config_check(
            self.num_heads % self.num_kv_heads == 0,
            f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}",
        )
        config_check(self.rms_norm_eps > 0 and self.rope_theta > 0,
                     f"drafter rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0")  # fmt: skip
        config_check(
            self.block_size >= 2, f"drafter block_size={self.block_size}: a block needs an anchor and at least one proposal"
        )
        config_check(
            0 <= self.mask_token_id < self.vocab_size,
            f"drafter mask_token_id={self.mask_token_id} is outside its vocabulary [0, {self.vocab_size})",
        )
        config_check(bool(self.target_layer_ids), "drafter target_layer_ids is empty")
        config_check(self.num_target_layers >= 0, f"drafter num_target_layers={self.num_target_layers} must be >= 0")
        limit = self.num_target_layers or None
        bad = [i for i in self.target_layer_ids if i < 0 or (limit is not None and i >= limit)]
        config_check(
            not bad,
            f"drafter target_layer_ids {list(self.target_layer_ids)} name layers {bad} "
            + (f"outside the {limit}-layer target (num_target_layers)" if limit else "below 0"),
        )
        config_check(
            len(self.layer_windows) == len(self.layer_causal) == self.num_layers,
            f"drafter has {len(self.layer_windows)} layer windows and {len(self.layer_causal)} causality flags "
            f"for num_hidden_layers={self.num_layers}",
        )
        config_check(min(self.layer_windows) >= 0, f"drafter layer windows {list(self.layer_windows)} must be >= 0")
        config_check(1 <= self.top_k <= self.vocab_size, f"drafter top_k={self.top_k} must be in [1, vocab_size={self.vocab_size}]")
        # A draft vocabulary must hold every candidate (a DFlash drafter's C = V means "all of it").
        dv = self.draft_vocab_size
        config_check(
            0 <= dv <= self.vocab_size and not (dv and self.top_k < self.vocab_size and self.top_k > dv),
            f"draft_vocab_size={dv} must be in [top_k={self.top_k}, vocab_size={self.vocab_size}] (0: the whole vocabulary)",
        )
        config_check(self.final_logit_softcapping >= 0,
                     f"drafter final_logit_softcapping={self.final_logit_softcapping} must be >= 0 (0: none)")  # fmt: skip

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def config_as_kind(config: DrafterConfig, kind: str, **changes: Any) -> DrafterConfig:
    """``config``'s shared fields as a ``kind`` drafter's config (that kind's own class), with ``changes`` (which
    must supply the fields ``kind`` adds): e.g. a DSpine drafter's backbone run as a DFlash one. The old kind's
    ``config_section`` is dropped from the raw keys, so a saved copy is not read back as the old kind."""
    raw = json.loads(config.raw_json)
    section = drafter_kind(config.kind).config_section
    if kind != config.kind and section:
        raw.pop(section, None)
    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(DrafterConfig)}
    fields = {**shared, "kind": kind, "raw_json": json.dumps(raw, sort_keys=True), **changes}
    return drafter_kind(kind).config_class(**fields)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference default tap layers: evenly spaced from 1 to N-3 (36 layers, 5 taps → 1,9,17,25,33).

    Uses Python's ``round`` (banker's rounding) exactly like z-lab / SpecForge so the ids agree. On a target of
    one or two layers that rule names layers it lacks (2 layers, 5 taps: 1, 0, 0, 0, -1); there the taps are spread
    evenly over the layers it has instead (0, 0, 0, 1, 1).
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    ids = tuple(round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers))
    if all(0 <= i < num_target_layers for i in ids):
        return ids
    return tuple(round(i * (num_target_layers - 1) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise DrafterConfigError(f"drafter rope type {rope_type!r} is not supported (only 'default' RoPE)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def config_int(cfg: dict[str, Any], key: str, where: str = "config.json") -> int:
    """``cfg[key]`` as an int: missing, null or not integral raises (the range is ``validate``'s business)."""
    if key not in cfg or cfg[key] is None:
        raise DrafterConfigError(f"drafter {where} is missing {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise DrafterConfigError(f"drafter {where} {key!r} must be an integer, got {value!r}")
    return int(value)


def config_float(cfg: dict[str, Any], key: str, where: str = "config.json") -> float:
    """``cfg[key]`` as a finite float: missing, null, not a number or not finite raises."""
    if key not in cfg or cfg[key] is None:
        raise DrafterConfigError(f"drafter {where} is missing {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DrafterConfigError(f"drafter {where} {key!r} must be a finite number, got {value!r}")
    return float(value)


# A speculators config.json's own keys (kept under "speculators" in the flat layout; ``speculators_format.nest``
# writes them back) and those the flat layout spells otherwise.
SPECULATORS_OWN_KEYS = (
    "speculators_config", "speculators_version", "target_hidden_size", "sliding_window_non_causal", "auto_map",
)  # fmt: skip
_SPECULATORS_MOVED_KEYS = (
    "speculators_model_type", "transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id", "architectures",
)  # fmt: skip


def flatten_speculators_config(spec: dict[str, Any]) -> dict[str, Any]:
    """A vLLM ``speculators`` config.json dict (``dflash``, ``dflash2``, ``dspark``) → this module's flat layout:
    its ``transformer_layer_config`` at the top level, ``dflash_config {mask_token_id, target_layer_ids}``, the
    kind's keys at the top level, speculators' own under ``"speculators"``. Its tap ids index HF's
    ``hidden_states`` (0 = embeddings): ours are one less. Refused: sliding-window layers (speculators windows
    the context from the block's anchor, we per query) and ``sample_from_anchor`` outside DSpark."""
    kind = spec.get("speculators_model_type")
    kinds = {k.name: k for k in _KINDS.values() if k.name in ("dflash", "dflash2", "dspark")}
    if kind not in kinds:
        supported = ", ".join(kinds)
        raise DrafterConfigError(f"speculators model type {kind!r} is not a drafter kind here (supported: {supported})")
    layer = spec.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DrafterConfigError("speculators config.json has no transformer_layer_config object")
    sliding = sorted({t for t in layer.get("layer_types") or [] if t != "full_attention"})
    if sliding:
        raise DrafterConfigError(f"speculators draft layers of type {sliding} are not supported: speculators windows the "
                                 "context from the block's anchor, this package per query (full_attention layers only)")  # fmt: skip
    if kind != "dspark" and spec.get("sample_from_anchor"):
        raise DrafterConfigError(f"a speculators {kind} drafter with sample_from_anchor=true is not supported")
    aux = spec.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        raise DrafterConfigError(f"speculators aux_hidden_state_layer_ids must be a non-empty list of ints, got {aux}")
    if min(aux) < 1:
        raise DrafterConfigError(f"speculators aux_hidden_state_layer_ids {aux} tap hidden state 0 (the embeddings); "
                                 "the drafter reads layer outputs only (ids >= 1)")  # fmt: skip
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "auto_map", "transformers_version")}
    flat.update({k: v for k, v in spec.items() if k not in (*SPECULATORS_OWN_KEYS, *_SPECULATORS_MOVED_KEYS)})
    flat.update(
        architectures=[kinds[kind].architecture],
        block_size=spec.get("block_size", 8),  # speculators' default
        dflash_config={"mask_token_id": spec.get("mask_token_id"), "target_layer_ids": [i - 1 for i in aux]},
        speculators={k: spec[k] for k in SPECULATORS_OWN_KEYS if k in spec},
    )
    return flat


def drafter_config_from_dict(cfg: dict[str, Any]) -> DrafterConfig:
    """Parse a z-lab DFlash or SpecForge DSpine ``config.json`` dict into its kind's ``config_class``.

    Here: the file's shape (missing keys, unsupported options, layer types); the values' consistency is
    checked by the config's own ``validate`` as it is built. A vLLM ``speculators`` config (nested layer
    config, ``speculators_model_type``) is read through its translation to this layout first."""
    if "speculators_model_type" in cfg:
        cfg = flatten_speculators_config(cfg)
    dflash_cfg = cfg.get("dflash_config") or {}
    kind = _kind_of(cfg)

    hidden = config_int(cfg, "hidden_size")
    heads = config_int(cfg, "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads > 0 else 0))  # validate rejects heads < 1
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
    draft_vocab = int(cfg.get("draft_vocab_size") or 0)
    fields["draft_vocab_size"] = 0 if draft_vocab == vocab else draft_vocab  # EAGLE-3 names the full size when nothing is left out
    return kind.config_class(**kind.read_config(cfg, fields))


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
