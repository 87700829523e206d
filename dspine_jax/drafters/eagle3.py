"""EAGLE-3 (vLLM's ``speculators`` ``eagle3`` checkpoints): an autoregressive draft head behind the ``Proposer``
seam, drafting one token per step for as many steps as the round asks.

The model (``speculators==0.9.0`` ``Eagle3DraftModel``), per position ``p``:

* **Fused target features**: the target's residual stream at a few layers (speculators' ids are HF
  ``hidden_states`` indices, so id ``i`` is the output of layer ``i - 1``, our tap ``i - 1``) concatenated, then
  optionally one RMSNorm over the concatenation (``norm_before_fc``) or one per chunk (``fc_norm``), then
  ``fc`` (``n·H → H``, no bias): ``f_p``.
* **Decoder layers** (Llama or Qwen3 layers, usually one). Layer 0 reads ``[input_layernorm(embed(x_p)) ;
  hidden_norm(h)]`` (``2H`` wide q/k/v projections) with ``h`` on the residual path (``hidden_norm(h)`` with
  ``norm_before_residual``); later layers are plain decoder layers. Logits over the draft vocabulary:
  ``lm_head(norm(out))``. The draft vocabulary is ``Vd`` target tokens (``d2t [Vd]``: draft index ``i`` is
  target token ``i + d2t[i]``; ``t2d [V]`` its membership mask).
* **Pairing** (``speculators.models.eagle3.data.shift_batch``): the entry at position ``p`` reads token
  ``x_p`` with ``h = f_{p-1}``, the previous position's features, and predicts ``x_{p+1}``. Position 0 has no
  entry. A draft step at position ``n + s`` reads the token drafted by the step before (the anchor for
  ``s = 0``) with ``h`` = that step's layer output (``norm(out)`` with ``norm_output``).
* **Attention**: causal over the committed entries (their K/V, computed from true target features) and over
  the round's own draft steps (speculators' training mask: the step-0 causal mask plus one diagonal per
  test-time-training step); a sliding window counts from the anchor.

State (``Eagle3State``, batch-major, position-indexed like the target's KV cache): every layer's K/V of the
committed entries and the fused features ``f_p`` of every committed position; ``lengths`` committed
positions. The entry of position ``p`` needs the token ``x_p``, so ``prefill`` and ``commit`` take the tokens
the target just ran (``tokens``); the last committed position's features wait in ``features`` for the next
entry (the anchor's, drafted in ``propose`` and dropped with the other draft steps). Nothing drafted stays
visible: ``commit`` writes only committed positions, recomputed from the target's features.

The state's life cycle (``SequentialHead``), the entries' ingest (``ingest``) and the step loop
(``draft_steps``) are shared with the MTP head (``mtp.py``): they run a head's layers through its hooks
(``rope``, ``embed_with``, ``layer_input``, ``qkv``, ``finish_layer``, ``logits_with``,
``entry_features``); its training forward (``sequential_ttt_logits``) too.

Letters as in layers.py: B batch, T tokens, S positions, H width, N/K heads, D head dim, F MLP width,
V target vocabulary, Vd draft vocabulary, P draft steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array
from safetensors.numpy import save_file

from dspine_jax.drafters.drafter import DraftOutput, choose
from dspine_jax.drafters.params import pack_drafter, quantize_drafter
from dspine_jax.drafters.speculators_format import (  # the format we write (and test against)
    SPECULATORS_VERSION,
    proposal_config,
    spec_model_type,
    speculative_tokens,
    speculators_model_type,
)
from dspine_jax.models import hub, quant
from dspine_jax.models.cache import sharded_zeros
from dspine_jax.models.layers import MASK_VALUE, apply_rope, cached_attention, rms_norm, rope_cos_sin, swiglu
from dspine_jax.models.sampling import Sampling, process_rows, split_rows
from dspine_jax.models.target import Target, resolve_dtype
from dspine_jax.models.weights import (
    DECODER_LAYER_TENSORS,
    CheckpointError,
    check_consumed,
    load_safetensors_dir,
    strip_prefix,
    take,
)

KIND = "eagle3"
LAYER_TYPES = ("llama", "qwen3")  # speculators' eagle3 decoder layers (qwen3 adds per-head q/k norms)
# (Eagle3Layer field, torch suffix under ``layers.{i}.``, transpose?): a decoder layer's tensors, the qwen3 q/k
# norms apart (a llama layer has none).
_QK_NORMS = tuple((field, suffix) for field, suffix, _ in DECODER_LAYER_TENSORS if field in ("q_norm", "k_norm"))
_LAYER_SPEC = tuple(entry for entry in DECODER_LAYER_TENSORS if entry[0] not in ("q_norm", "k_norm"))
# speculators keeps a frozen copy of the verifier's final norm / head for its training loss; not part of drafting.
_TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")


# ----------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """What drafting depends on, parsed from a speculators ``config.json`` (``config_from_dict``)."""

    layer_type: str  # "llama" | "qwen3" (transformer_layer_config.model_type)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's (transformer_layer_config.vocab_size)
    draft_vocab_size: int
    layer_ids: tuple[int, ...]  # HF hidden_states indices of the fused target layers (speculators' ids)
    layer_windows: tuple[int, ...]  # per decoder layer: sliding window (0 = full attention)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    speculative_tokens: int = 3  # draft steps the checkpoint was trained for (proposal_methods[0])
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.layer_type not in LAYER_TYPES:
            raise CheckpointError(f"eagle3 decoder layers of type {self.layer_type!r} are not supported "
                                  f"({', '.join(LAYER_TYPES)} are)")  # fmt: skip
        if self.norm_before_fc and self.fc_norm:
            raise CheckpointError("eagle3 config sets both norm_before_fc and fc_norm (mutually exclusive)")
        if not self.layer_ids or min(self.layer_ids) < 1 or len(set(self.layer_ids)) != len(self.layer_ids):
            raise CheckpointError(f"eagle3 eagle_aux_hidden_state_layer_ids {list(self.layer_ids)} must be distinct "
                                  "ids ≥ 1 (id 0, the embedding output, is not a layer we can tap)")  # fmt: skip
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise CheckpointError(f"eagle3 draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}]")
        if len(self.layer_windows) != self.num_layers or self.num_layers < 1:
            raise CheckpointError(f"eagle3 has {self.num_layers} layers but {len(self.layer_windows)} layer types")
        if self.num_heads % self.num_kv_heads or self.speculative_tokens < 1:
            raise CheckpointError("eagle3 num_attention_heads must be a multiple of num_key_value_heads, and "
                                  "speculative_tokens ≥ 1")  # fmt: skip

    @property
    def kind(self) -> str:
        """``"eagle3"``: named like a block drafter config's kind (training dispatches on it)."""
        return KIND

    @property
    def num_taps(self) -> int:
        return len(self.layer_ids)

    @property
    def taps(self) -> tuple[int, ...]:
        """Our tap numbering (the output of layer ``i``) of speculators' ids (``hidden_states[i]``)."""
        return tuple(i - 1 for i in self.layer_ids)

    @property
    def has_draft_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """speculators' default fused layers when a config names none (``resolve_target_layer_ids``)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def init_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """A fresh head's fused layers: speculators' default, or the last three layers of a target too shallow
    for it (fewer than 6 layers)."""
    ids = default_layer_ids(num_target_layers)
    if min(ids) >= 1 and len(set(ids)) == 3:
        return ids
    return tuple(range(max(1, num_target_layers - 2), num_target_layers + 1))


def _rope_theta(tl: Any) -> float:
    params = getattr(tl, "rope_parameters", None) or {}
    scaling = getattr(tl, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise CheckpointError(f"eagle3 rope type {rope_type!r} is not supported (only 'default' RoPE is)")
    return float(params.get("rope_theta", getattr(tl, "rope_theta", 10000.0)))


def config_from_dict(cfg: dict[str, Any], num_target_layers: int | None = None) -> Eagle3Config:
    """A speculators eagle3 ``config.json`` dict → ``Eagle3Config``. ``transformer_layer_config`` is stored as a
    diff against its class defaults, so it is completed through transformers' own config class.
    ``num_target_layers`` resolves the default fused layers of a config that names none."""
    from transformers import AutoConfig  # (only here: importing transformers is slow)

    if cfg.get("speculators_model_type") != KIND:
        raise CheckpointError(f"not a speculators eagle3 config (speculators_model_type = "
                              f"{cfg.get('speculators_model_type')!r})")  # fmt: skip
    layer = dict(cfg.get("transformer_layer_config") or {})
    layer_type = layer.pop("model_type", "qwen3")
    if layer_type not in LAYER_TYPES:
        raise CheckpointError(f"eagle3 decoder layers of type {layer_type!r} are not supported")
    tl = AutoConfig.for_model(layer_type, **{k: v for k, v in layer.items() if k != "transformers_version"})
    if getattr(tl, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"eagle3 hidden_act {tl.hidden_act!r} is not supported (silu is)")
    if getattr(tl, "attention_bias", False) or getattr(tl, "mlp_bias", False):
        raise CheckpointError("eagle3 decoder layers with biases are not supported")
    n = tl.num_hidden_layers
    types = list(getattr(tl, "layer_types", None) or ["full_attention"] * n)
    window = int(getattr(tl, "sliding_window", None) or 0)
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    if any(kind not in ("full_attention", "sliding_attention") for kind in types) or (window == 0 and any(windows)):
        raise CheckpointError(f"eagle3 layer_types {types} (sliding_window {window}) are not supported")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise CheckpointError("eagle3 config names no eagle_aux_hidden_state_layer_ids and no target is known")
        ids = default_layer_ids(num_target_layers)
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden not in (None, tl.hidden_size):
        raise CheckpointError(f"eagle3 target_hidden_size {target_hidden} != its hidden_size {tl.hidden_size}")
    head_dim = getattr(tl, "head_dim", None) or tl.hidden_size // tl.num_attention_heads
    return Eagle3Config(
        layer_type=layer_type, hidden_size=tl.hidden_size, num_layers=n, num_heads=tl.num_attention_heads,
        num_kv_heads=tl.num_key_value_heads or tl.num_attention_heads, head_dim=head_dim,
        intermediate_size=tl.intermediate_size, rms_norm_eps=float(tl.rms_norm_eps), rope_theta=_rope_theta(tl),
        vocab_size=tl.vocab_size, draft_vocab_size=int(cfg.get("draft_vocab_size", tl.vocab_size)),
        layer_ids=tuple(int(i) for i in ids), layer_windows=windows,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)), fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)),
        speculative_tokens=speculative_tokens(cfg, 3),
        max_position_embeddings=int(getattr(tl, "max_position_embeddings", 2048)),
    )  # fmt: skip


def config_to_dict(config: Eagle3Config, verifier: str | None = None, architectures: list[str] | None = None) -> dict:
    """``Eagle3Config`` → a speculators eagle3 ``config.json`` dict (``Eagle3SpeculatorConfig`` reads it).
    ``verifier``: the target's path or hub id, which speculators' loader reads the embedding / head from when
    the checkpoint lacks them."""
    c = config
    sliding = any(c.layer_windows)
    layer = {
        "model_type": c.layer_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in c.layer_windows],
        "sliding_window": max(c.layer_windows) if sliding else None,
    }  # fmt: skip
    if c.layer_type == "qwen3":
        layer["use_sliding_window"] = sliding
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": KIND,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(c.layer_ids),
        "embed_requires_grad": False,
        "speculators_config": proposal_config(KIND, c.speculative_tokens, verifier, architectures),
    }


def is_eagle3_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a speculators eagle3 ``config.json``."""
    return speculators_model_type(path) == KIND


# ----------------------------------------------------------------------------------------------
# Weights


@struct.dataclass
class Eagle3Layer:
    """One decoder layer, ``[in, out]`` weights (layer 0's q/k/v read ``2H``: ``[embedding ; features]``)."""

    input_norm: Array  # [H]
    q: Array  # [H or 2H, N·D]
    k: Array  # [H or 2H, K·D]
    v: Array  # [H or 2H, K·D]
    o: Array  # [N·D, H]
    post_norm: Array  # [H]
    gate: Array  # [H, F]
    up: Array  # [H, F]
    down: Array  # [F, H]
    hidden_norm: Array | None = None  # [H] layer 0 only: the norm of the fused features
    q_norm: Array | None = None  # [D] qwen3 layers
    k_norm: Array | None = None  # [D]


@struct.dataclass
class Eagle3Params:
    fc: Array  # [n·H, H]
    layers: tuple[Eagle3Layer, ...]
    norm: Array  # [H]
    lm_head: Array  # [H, Vd] the draft head (named like the target's: quantize / pack treat it as a head)
    embed: Array | None = None  # [V, H] its own embedding; None: the target's (speculators copies it, frozen)
    draft_ids: Array | None = None  # [Vd] int32 target ids of the draft vocabulary (None: the whole vocabulary)
    input_norm: Array | None = None  # [n·H] norm_before_fc
    fc_norms: tuple[Array, ...] | None = None  # n × [H] fc_norm


def _torch_shapes(c: Eagle3Config, layer: int) -> dict[str, tuple[int, ...]]:
    h, n, k, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    width = 2 * h if layer == 0 else h
    return {"input_norm": (h,), "q": (n * d, width), "k": (k * d, width), "v": (k * d, width), "o": (h, n * d),
            "post_norm": (h,), "gate": (f, h), "up": (f, h), "down": (h, f)}  # fmt: skip


def draft_ids_from_tensors(tensors: dict[str, np.ndarray], config: Eagle3Config) -> np.ndarray | None:
    """``d2t [Vd]`` offsets (and ``t2d [V]`` when present, which must agree) → ascending target ids, or None
    without a draft vocabulary (speculators stores no mapping then; identity mappings are dropped)."""
    vd, v = config.draft_vocab_size, config.vocab_size
    if not config.has_draft_vocab:
        for name, shape in (("d2t", (vd,)), ("t2d", (v,))):
            if name in tensors:
                take(tensors, name, shape)
        return None
    ids = np.arange(vd, dtype=np.int64) + take(tensors, "d2t", (vd,)).astype(np.int64)
    if ids.min() < 0 or ids.max() >= v or (np.diff(ids) <= 0).any():
        raise CheckpointError(f"eagle3 d2t must map the draft vocabulary to distinct, ascending ids in [0, {v})")
    if "t2d" in tensors:
        member = take(tensors, "t2d", (v,)).astype(bool)
        if member.sum() != vd or not member[ids].all():
            raise CheckpointError("eagle3 tensors 't2d' and 'd2t' name different draft vocabularies")
    return ids


def params_from_tensors(
    tensors: dict[str, np.ndarray], config: Eagle3Config, target: Target, dtype: jnp.dtype
) -> Eagle3Params:
    """speculators-named, torch-layout tensors → ``Eagle3Params``. Consumes every tensor or raises. An
    ``embed_tokens`` equal to the target's embedding is shared with it rather than kept twice."""
    tensors = strip_prefix(tensors, ["model."])
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq") and k not in _TRAINING_ONLY}
    c = config
    h, n = c.hidden_size, c.num_taps

    def cast(x: np.ndarray, transpose: bool = False) -> Array:
        x = np.asarray(x, dtype=np.float32)
        return jnp.asarray(x.T if transpose else x, dtype=dtype)

    layers = []
    for i in range(c.num_layers):
        shapes = _torch_shapes(c, i)
        weights = {field: cast(take(tensors, f"layers.{i}.{suffix}", shapes[field]), transpose)
                   for field, suffix, transpose in _LAYER_SPEC}  # fmt: skip
        if i == 0:
            weights["hidden_norm"] = cast(take(tensors, "layers.0.hidden_norm.weight", (h,)))
        if c.layer_type == "qwen3":
            for field, suffix in _QK_NORMS:
                weights[field] = cast(take(tensors, f"layers.{i}.{suffix}", (c.head_dim,)))
        layers.append(Eagle3Layer(**weights))
    embed = None
    if "embed_tokens.weight" in tensors:
        own = take(tensors, "embed_tokens.weight", (c.vocab_size, h))
        theirs = np.asarray(jax.device_get(quant.dequantize(target.params.embed)), np.float32)
        if np.isnan(own).any():
            raise CheckpointError("eagle3 embed_tokens.weight holds NaN (speculators' marker of a never-loaded copy)")
        if not (theirs.shape == own.shape and np.array_equal(own.astype(np.float32), theirs)):
            embed = cast(own)
    ids = draft_ids_from_tensors(tensors, c)
    params = Eagle3Params(
        fc=cast(take(tensors, "fc.weight", (h, n * h)), True),
        layers=tuple(layers),
        norm=cast(take(tensors, "norm.weight", (h,))),
        lm_head=cast(take(tensors, "lm_head.weight", (c.draft_vocab_size, h)), True),
        embed=embed,
        draft_ids=None if ids is None else jnp.asarray(ids, jnp.int32),
        input_norm=cast(take(tensors, "input_norm.weight", (n * h,))) if c.norm_before_fc else None,
        fc_norms=tuple(cast(take(tensors, f"fc_norm.{j}.weight", (h,))) for j in range(n)) if c.fc_norm else None,
    )
    check_consumed(tensors, "eagle3")
    return params


def params_to_tensors(proposer: Eagle3Proposer, target: Target | None = None) -> dict[str, np.ndarray]:
    """``Eagle3Params`` → speculators-named torch-layout numpy tensors (the embedding: its own, else the
    target's when given; speculators' loader can also take it from the verifier)."""
    p, c = proposer.params, proposer.config

    def host(x: Any, transpose: bool = False) -> np.ndarray:
        a = np.asarray(jax.device_get(quant.dequantize(x)))
        return np.ascontiguousarray(a.T if transpose else a)

    out = {"fc.weight": host(p.fc, True), "norm.weight": host(p.norm), "lm_head.weight": host(p.lm_head, True)}
    for i, layer in enumerate(p.layers):
        for field, suffix, transpose in _LAYER_SPEC:
            out[f"layers.{i}.{suffix}"] = host(getattr(layer, field), transpose)
        if layer.hidden_norm is not None:
            out[f"layers.{i}.hidden_norm.weight"] = host(layer.hidden_norm)
        for field, suffix in _QK_NORMS:
            if getattr(layer, field) is not None:
                out[f"layers.{i}.{suffix}"] = host(getattr(layer, field))
    if p.input_norm is not None:
        out["input_norm.weight"] = host(p.input_norm)
    for j, weight in enumerate(p.fc_norms or ()):
        out[f"fc_norm.{j}.weight"] = host(weight)
    embed = p.embed if p.embed is not None else (target.params.embed if target is not None else None)
    if embed is not None:
        out["embed_tokens.weight"] = host(embed).astype(out["fc.weight"].dtype)
    if p.draft_ids is not None:  # speculators' spelling: offsets d2t (int64) and the membership mask t2d
        ids = host(p.draft_ids).astype(np.int64)
        out["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
        out["t2d"] = np.isin(np.arange(c.vocab_size), ids)
    return out


# ----------------------------------------------------------------------------------------------
# The per-row state


@struct.dataclass
class Eagle3State:
    """Committed positions of each row, position-indexed (the entry of position p at index p).

    Entry p (1 ≤ p < lengths) pairs token x_p with the features of position p - 1; ``features[b, p]`` holds the
    fused target features of every committed position (an MTP head: the target's final hidden), the last one
    waiting for the next entry."""

    k: tuple[Array, ...]  # per layer [B, K, S, D] after k_norm and RoPE
    v: tuple[Array, ...]  # per layer [B, K, S, D]
    features: Array  # [B, S, H] fc(target features) per committed position
    lengths: Array  # [B] int32 committed positions

    @property
    def capacity(self) -> int:
        return self.features.shape[1]


# ----------------------------------------------------------------------------------------------
# The proposer


class SequentialHead:
    """The state life cycle of a head that drafts one token per step from its own K/V of the committed entries
    (``Eagle3Proposer``, ``mtp.MTPProposer``); state ``Eagle3State``. A head is a ``flax.struct`` dataclass with
    ``params``, a ``config`` (``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``layer_windows``, ``vocab_size``), ``dtype`` and the hooks ``ingest`` / ``draft_steps`` run:

    * ``entry_features(hidden [B, T, H], tapped [n, B, T, H])`` → the features ``[B, T, H]`` an entry reads;
    * ``rope(positions [B, T])`` → cos, sin of the entries at those (token) positions;
    * ``embed_with(table [V, H], tokens [B, T])`` → ``[B, T, H]`` given the target's embedding (``embed(target,
      tokens)`` passes the target's; training passes its frozen copy);
    * ``layer_input(layer, x, embeds)`` → the layer's normed attention input and its residual;
    * ``qkv(layer, normed, cos, sin)`` → q ``[B, T, N, D]``, k / v ``[B, T, K, D]`` and what ``finish_layer``
      needs besides the attention (None, or a gate);
    * ``finish_layer(layer, attn [B, T, N·D], residual, extra)`` → the layer's output;
    * ``logits_with(lm_head [H, V], out [B, H])`` → float32 logits ``[B, Vd]`` and the hidden the next step
      reads, given the target's LM head (a head with its own ignores it; ``logits(target, out)`` passes the
      target's).
    """

    # --- the protocol's static answers (a head has ``max_block``: its longest verify block, 0 = trained steps + 1) ---

    @property
    def block_limit(self) -> int:
        return self.max_block or self.config.speculative_tokens + 1

    @property
    def tag(self) -> str:
        return f"{type(self).__name__}|{self.config!r}|{self.block_limit}|{self.dtype}"

    @property
    def dtype(self) -> jnp.dtype:
        return self.params.norm.dtype


    def embed(self, target: Target, tokens: Array) -> Array:
        return self.embed_with(target.params.embed, tokens)

    def logits(self, target: Target, out: Array) -> tuple[Array, Array]:
        return self.logits_with(target.params.lm_head, out)

    def init(self, target: Target, batch: int, capacity: int) -> Eagle3State:
        c = self.config
        kv = (batch, c.num_kv_heads, capacity, c.head_dim)
        axes = ("batch", None, None, None)
        return Eagle3State(
            k=tuple(sharded_zeros(kv, self.dtype, axes) for _ in range(c.num_layers)),
            v=tuple(sharded_zeros(kv, self.dtype, axes) for _ in range(c.num_layers)),
            features=sharded_zeros((batch, capacity, c.hidden_size), self.dtype, ("batch", None, None)),
            lengths=sharded_zeros((batch,), jnp.int32, ("batch",)),
        )

    def prefill(
        self, target: Target, state: Eagle3State, hidden: Array, tapped: Array, lengths: Array,
        tokens: Array | None = None,
    ) -> Eagle3State:
        """A prompt (chunk) ``tokens [B, T]`` ran through the target: ``tapped [n, B, T, H]``, ``lengths [B]`` real."""
        return self.commit(target, state, hidden, tapped, lengths, tokens)

    def flush(self, target: Target, state: Eagle3State) -> Eagle3State:
        return state  # nothing deferred: commit writes the entries at once

    def commit(
        self, target: Target, state: Eagle3State, hidden: Array, tapped: Array, num_new: Array,
        tokens: Array | None = None,
    ) -> Eagle3State:
        """The first ``num_new [B]`` of ``tokens [B, T]`` (anchor first) were committed; ``hidden [B, T, H]``,
        ``tapped [n, B, T, H]`` the verify pass's. Writes their features (``entry_features``) and the entries of
        positions ``lengths …``."""
        if tokens is None:
            raise ValueError("a sequential head (EAGLE-3, MTP) needs the committed tokens (an entry pairs a token "
                             "with the previous position's features): pass tokens= to prefill / commit")  # fmt: skip
        features = self.entry_features(hidden, tapped)  # [B, T, H]
        return ingest(self, target, state, tokens.astype(jnp.int32), features, num_new.astype(jnp.int32))

    def propose(
        self, target: Target, state: Eagle3State, anchor: Array, counts: Array, keys: Array, sampling: Sampling,
        num: int,
    ) -> DraftOutput:
        """``num`` draft steps from ``anchor [B]`` at position ``state.lengths`` (module doc)."""
        return draft_steps(self, target, state, anchor, keys, sampling, num)[0]

    def with_capacity(self, state: Eagle3State, capacity: int) -> Eagle3State:
        def fit(x: Array, axis: int) -> Array:
            have = x.shape[axis]
            if capacity <= have:
                return jax.lax.slice_in_dim(x, 0, capacity, axis=axis)
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, capacity - have)
            return jnp.pad(x, pad)

        return state.replace(k=tuple(fit(x, 2) for x in state.k), v=tuple(fit(x, 2) for x in state.v),
                             features=fit(state.features, 1))  # fmt: skip

    def rewind(self, state: Eagle3State, lengths: Array) -> Eagle3State:
        """Rows keep their first ``lengths [B]`` committed positions: entries and features are position-indexed,
        so this is a length update (the features of position ``lengths - 1`` are still stored)."""
        return state.replace(lengths=jnp.minimum(lengths.astype(jnp.int32), state.lengths))


@struct.dataclass
class Eagle3Proposer(SequentialHead):
    """An EAGLE-3 head as a proposer (``decoding/proposers.py``): sequential drafting, ``num`` steps per round."""

    params: Eagle3Params
    config: Eagle3Config = struct.field(pytree_node=False)
    max_block: int = struct.field(pytree_node=False, default=0)  # longest verify block; 0: trained steps + 1

    # --- the protocol's static answers ---

    @property
    def taps(self) -> tuple[int, ...]:
        return self.config.taps

    def check_compatible(self, target: Target) -> None:
        tc, c = target.config, self.config
        if c.hidden_size != tc.hidden_size:
            raise CheckpointError(f"eagle3 hidden_size {c.hidden_size} != the target's {tc.hidden_size}")
        if c.vocab_size != tc.vocab_size:
            raise CheckpointError(f"eagle3 vocab_size {c.vocab_size} != the target's {tc.vocab_size}")
        bad = [i for i in c.layer_ids if not 1 <= i <= tc.num_layers]
        if bad:
            raise CheckpointError(f"eagle3 fuses target layers {list(c.layer_ids)}: {bad} are not in "
                                  f"[1, {tc.num_layers}] for this {tc.num_layers}-layer target")  # fmt: skip

    # --- the layer hooks ``ingest`` / ``draft_steps`` run (``SequentialHead``) ---

    def entry_features(self, hidden: Array, tapped: Array) -> Array:
        return fuse_features(self, tapped)

    def rope(self, positions: Array) -> tuple[Array, Array]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.dtype)

    def embed_with(self, table: Array, tokens: Array) -> Array:
        return _embed_with(self, table, tokens)

    def layer_input(self, layer: int, x: Array, embeds: Array) -> tuple[Array, Array]:
        return _layer_input(self, layer, x, embeds)

    def qkv(self, layer: int, normed: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array, None]:
        return (*_qkv(self, layer, normed, cos, sin), None)

    def finish_layer(self, layer: int, attn: Array, residual: Array, extra: None) -> Array:
        return _finish_layer(self, layer, attn, residual)

    def logits_with(self, lm_head: Array | None, out: Array) -> tuple[Array, Array]:
        return draft_logits(self, None, out)  # its own (draft-vocabulary) head


# ----------------------------------------------------------------------------------------------
# Forward pieces


def fuse_features(proposer: Eagle3Proposer, tapped: Array) -> Array:
    """``tapped [n, B, T, H]`` (tap order = layer id order) → ``fc(norms(concat)) [B, T, H]``."""
    p, c = proposer.params, proposer.config
    n, b, t, h = tapped.shape
    if (n, h) != (c.num_taps, c.hidden_size):
        raise ValueError(f"tapped features have shape {tapped.shape}; eagle3 expects "
                         f"[{c.num_taps}, B, T, {c.hidden_size}]")  # fmt: skip
    chunks = [tapped[i].astype(proposer.dtype) for i in range(n)]
    if p.fc_norms is not None:
        chunks = [rms_norm(x, w, c.rms_norm_eps) for x, w in zip(chunks, p.fc_norms, strict=True)]
    concat = jnp.concatenate(chunks, axis=-1)  # [B, T, n·H]
    if p.input_norm is not None:
        concat = rms_norm(concat, p.input_norm, c.rms_norm_eps)
    return concat @ p.fc


def _embed_with(proposer: Eagle3Proposer, embed: Array, tokens: Array) -> Array:
    """``tokens`` through the head's own embedding, else ``embed`` (the target's ``[V, H]``)."""
    table = proposer.params.embed if proposer.params.embed is not None else embed
    return table[tokens].astype(proposer.dtype)


def _layer_input(proposer: Eagle3Proposer, layer: int, x: Array, embeds: Array | None) -> tuple[Array, Array]:
    """Layer ``layer``'s attention input and residual: layer 0 reads ``[norm(embeds) ; hidden_norm(x)]``."""
    lp, c = proposer.params.layers[layer], proposer.config
    if layer > 0:
        return rms_norm(x, lp.input_norm, c.rms_norm_eps), x
    hidden = rms_norm(x, lp.hidden_norm, c.rms_norm_eps)
    residual = hidden if c.norm_before_residual else x
    return jnp.concatenate([rms_norm(embeds, lp.input_norm, c.rms_norm_eps), hidden], axis=-1), residual


def _qkv(proposer: Eagle3Proposer, layer: int, normed: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
    """``normed [B, T, H']`` → q ``[B, T, N, D]``, k / v ``[B, T, K, D]`` (q/k norms, then RoPE)."""
    lp, c = proposer.params.layers[layer], proposer.config
    b, t, _ = normed.shape
    q = (normed @ lp.q).reshape(b, t, c.num_heads, c.head_dim)
    k = (normed @ lp.k).reshape(b, t, c.num_kv_heads, c.head_dim)
    v = (normed @ lp.v).reshape(b, t, c.num_kv_heads, c.head_dim)
    if lp.q_norm is not None:
        q, k = rms_norm(q, lp.q_norm, c.rms_norm_eps), rms_norm(k, lp.k_norm, c.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _finish_layer(proposer: Eagle3Proposer, layer: int, attn: Array, residual: Array) -> Array:
    """``o_proj``, the residual, then the MLP block (``attn [B, T, N·D]``)."""
    lp, c = proposer.params.layers[layer], proposer.config
    x = residual + attn @ lp.o
    return x + swiglu(rms_norm(x, lp.post_norm, c.rms_norm_eps), lp.gate, lp.up, lp.down)


def _write(buffer: Array, rows: Array, slots: Array, values: Array) -> Array:
    """``buffer [B, K, S, D]``, ``values [B, T, K, D]`` at ``slots [B, T]`` (== S: dropped)."""
    return buffer.at[rows, :, slots].set(values.astype(buffer.dtype), mode="drop")


def ingest(
    proposer: SequentialHead, target: Target, state: Eagle3State, tokens: Array, features: Array, num_new: Array
) -> Eagle3State:
    """Append ``num_new [B]`` committed positions: ``tokens [B, T]`` and their fused features ``[B, T, H]``.

    The entry of position ``n + j`` (``n = lengths``) pairs ``tokens[:, j]`` with the features of position
    ``n + j - 1`` (``state.features`` for ``j = 0``). Every layer's K/V of the new entries are written; the
    layers before the last run their attention (causal over the committed entries) to feed the next one."""
    c = proposer.config
    b, t = tokens.shape
    s = state.capacity
    n = state.lengths
    last = jnp.take_along_axis(state.features, jnp.maximum(n - 1, 0)[:, None, None], axis=1)  # [B, 1, H]
    previous = jnp.concatenate([last, features[:, :-1].astype(proposer.dtype)], axis=1)  # [B, T, H]
    positions = n[:, None] + jnp.arange(t)  # [B, T]
    kept = jnp.arange(t)[None, :] < num_new[:, None]
    rows = jnp.arange(b)[:, None]
    feature_slots = jnp.where(kept, positions, s)
    entry_slots = jnp.where(kept & (positions >= 1), positions, s)  # position 0 has no entry
    cos, sin = proposer.rope(positions)
    x, embeds = previous, proposer.embed(target, tokens)
    ks, vs = list(state.k), list(state.v)
    slot_pos = jnp.arange(s)[None, None, :]  # [1, 1, S]
    for layer in range(c.num_layers):
        normed, residual = proposer.layer_input(layer, x, embeds)
        q, k, v, extra = proposer.qkv(layer, normed, cos, sin)
        ks[layer] = _write(ks[layer], rows, entry_slots, k)
        vs[layer] = _write(vs[layer], rows, entry_slots, v)
        if layer == c.num_layers - 1:
            break  # the last layer's output is only read by draft steps, which compute their own
        visible = (slot_pos >= 1) & (slot_pos <= positions[:, :, None])
        if c.layer_windows[layer]:
            visible &= slot_pos > positions[:, :, None] - c.layer_windows[layer]
        attn = cached_attention(q, ks[layer], vs[layer], visible).reshape(b, t, c.num_heads * c.head_dim)
        x = proposer.finish_layer(layer, attn, residual, extra)
    return state.replace(
        k=tuple(ks), v=tuple(vs), lengths=n + num_new,
        features=state.features.at[rows, feature_slots].set(features.astype(state.features.dtype), mode="drop"),
    )


def _attend_with_steps(
    q: Array, ctx_k: Array, ctx_v: Array, ctx_visible: Array, step_k: Array, step_v: Array, step_visible: Array
) -> Array:
    """One query per row over two key sets under one softmax: the committed entries ``[B, K, S, D]`` and the
    draft steps ``[B, K, P, D]`` (``*_visible [B, S]`` / ``[B, P]``). ``q [B, N, D]`` → ``[B, N, D]``."""
    b, n, d = q.shape
    kh = ctx_k.shape[1]
    qg = q.reshape(b, kh, n // kh, d).astype(jnp.float32) * d**-0.5
    s_ctx = jnp.einsum("bkgd,bksd->bkgs", qg, ctx_k.astype(jnp.float32))
    s_step = jnp.einsum("bkgd,bksd->bkgs", qg, step_k.astype(jnp.float32))
    s_ctx = jnp.where(ctx_visible[:, None, None, :], s_ctx, MASK_VALUE)
    s_step = jnp.where(step_visible[:, None, None, :], s_step, MASK_VALUE)
    top = jnp.maximum(s_ctx.max(-1, keepdims=True), s_step.max(-1, keepdims=True))
    p_ctx = jnp.where(ctx_visible[:, None, None, :], jnp.exp(s_ctx - top), 0.0)
    p_step = jnp.where(step_visible[:, None, None, :], jnp.exp(s_step - top), 0.0)
    total = p_ctx.sum(-1, keepdims=True) + p_step.sum(-1, keepdims=True)
    out = jnp.einsum("bkgs,bksd->bkgd", p_ctx, ctx_v.astype(jnp.float32))
    out = out + jnp.einsum("bkgs,bksd->bkgd", p_step, step_v.astype(jnp.float32))
    return (out / total).reshape(b, n, d).astype(q.dtype)


def draft_logits(proposer: Eagle3Proposer, target: Target, hidden: Array) -> tuple[Array, Array]:
    """A step's output ``[B, H]`` → float32 logits over the draft vocabulary ``[B, Vd]`` and the hidden the next
    step reads (``norm(out)`` with ``norm_output``, else ``out``)."""
    c = proposer.config
    normed = rms_norm(hidden, proposer.params.norm, c.rms_norm_eps)
    return quant.matmul_f32(normed, proposer.params.lm_head), (normed if c.norm_output else hidden)


def vocab_ids(proposer: SequentialHead) -> Array:
    """Draft-vocabulary index → target token id ``[Vd]``."""
    ids = getattr(proposer.params, "draft_ids", None)  # (an MTP head has none)
    return jnp.arange(proposer.config.vocab_size, dtype=jnp.int32) if ids is None else ids


def draft_steps(
    proposer: SequentialHead, target: Target, state: Eagle3State, anchor: Array, keys: Array, sampling: Sampling,
    num: int,
) -> tuple[DraftOutput, Array]:
    """``num`` sequential draft steps (a ``lax.scan``, static shapes) → ``DraftOutput`` (tokens ``[B, P]``,
    candidates = the draft vocabulary ``[B, P, Vd]``, q ``[B, P, Vd]``: the distribution each token was drawn
    from, the target's sampling transform of the draft logits per row; one-hot for greedy rows) and the raw
    draft logits ``[B, P, Vd]`` (tests compare them with speculators')."""
    c = proposer.config
    b = anchor.shape[0]
    n = state.lengths
    ids = vocab_ids(proposer)
    hidden0 = jnp.take_along_axis(state.features, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, H]
    slot_pos = jnp.arange(state.capacity)[None, :]
    ctx_visible = []
    for window in c.layer_windows:  # committed entries 1 … n-1; a window counts from the anchor (speculators)
        visible = (slot_pos >= 1) & (slot_pos < n[:, None])
        ctx_visible.append(visible & (slot_pos > n[:, None] - window) if window else visible)
    step_shape = (b, c.num_kv_heads, num, c.head_dim)
    steps0 = tuple(jnp.zeros(step_shape, proposer.dtype) for _ in range(c.num_layers))
    unit = jnp.where(sampling.greedy, 0.0, 1.0)  # process_rows applies the temperature

    def step(carry, xs):
        token, hidden, step_k, step_v = carry
        index, key = xs
        positions = (n + index)[:, None]  # [B, 1]
        cos, sin = proposer.rope(positions)
        x, embeds = hidden[:, None], proposer.embed(target, token[:, None])
        new_k, new_v = list(step_k), list(step_v)
        step_visible = jnp.broadcast_to(jnp.arange(num)[None, :] <= index, (b, num))
        for layer in range(c.num_layers):
            normed, residual = proposer.layer_input(layer, x, embeds)
            q, k, v, extra = proposer.qkv(layer, normed, cos, sin)
            for buffers, value in ((new_k, k), (new_v, v)):  # this step's K/V into slot `index` [B, K, P, D]
                value = value.transpose(0, 2, 1, 3).astype(proposer.dtype)
                buffers[layer] = jax.lax.dynamic_update_slice_in_dim(buffers[layer], value, index, axis=2)
            attn = _attend_with_steps(q[:, 0], state.k[layer], state.v[layer], ctx_visible[layer], new_k[layer],
                                      new_v[layer], step_visible)  # fmt: skip
            x = proposer.finish_layer(layer, attn.reshape(b, 1, -1), residual, extra)
        logits, next_hidden = proposer.logits(target, x[:, 0])
        scores = process_rows(logits, sampling)
        index_drawn, q_step = choose(scores, key, unit)
        drawn = jnp.take(ids, index_drawn)
        return (drawn, next_hidden, tuple(new_k), tuple(new_v)), (drawn, q_step, logits)

    step_keys = jnp.moveaxis(split_rows(keys, num), 1, 0)  # [P, B]
    carry = (anchor.astype(jnp.int32), hidden0.astype(proposer.dtype), steps0, steps0)
    _, (tokens, q, logits) = jax.lax.scan(step, carry, (jnp.arange(num), step_keys))
    tokens, q, logits = (jnp.moveaxis(x, 0, 1) for x in (tokens, q, logits))
    cand_ids = jnp.broadcast_to(ids, (b, num, ids.shape[0]))
    return DraftOutput(tokens=tokens.astype(jnp.int32), cand_ids=cand_ids, q=q), logits


# ----------------------------------------------------------------------------------------------
# Training: test-time training (TTT) over whole sequences


def ttt_logits(
    proposer: Eagle3Proposer, embed: Array, tapped: Array, tokens: Array, entries: Array, steps: int
) -> Array:
    """EAGLE-3's ``sequential_ttt_logits`` from the target features of every position ``tapped [n, B, S, H]``
    (fused by the head's ``fc``) → logits ``[B, A, steps, Vd]`` float32."""
    return sequential_ttt_logits(proposer, embed, None, fuse_features(proposer, tapped), tokens, entries, steps)


def sequential_ttt_logits(
    proposer: SequentialHead, embed: Array, lm_head: Array | None, features: Array, tokens: Array, entries: Array,
    steps: int,
) -> Array:
    """The teacher-forced test-time-training forward of a sequential head (speculators'
    ``Eagle3DraftModel.forward``; an MTP head's chain of steps as it drafts) for the chains that start at
    ``entries [B, A]`` (positions ≥ 1) of ``tokens [B, S]``, with the head's entry features of every position
    ``features [B, S, H]`` (``entry_features``), the target's embedding ``embed [V, H]`` and LM head ``lm_head
    [H, V]`` (None for a head with its own) → logits ``[B, A, steps, Vd]`` float32.

    Step 0 runs every entry at once, as ``ingest`` does (their K/V are what every chain attends to). The chain
    from entry p then runs like ``draft_steps`` from an anchor at p: step s at position p + s reads the **true**
    token x_{p+s} (teacher forcing; clamped past the sequence, whose steps are never supervised) and the
    previous step's output hidden (the features of p - 1 for s = 0), attends to the entries 1…p (a window counts
    from p) and to its own steps, and predicts x_{p+s+1}. Fed the drafted tokens instead of the true ones it
    computes ``draft_steps``' logits: training trains the head that drafts."""
    c = proposer.config
    b, s = tokens.shape
    a = entries.shape[1]
    features = features.astype(proposer.dtype)  # [B, S, H]
    previous = jnp.concatenate([jnp.zeros_like(features[:, :1]), features[:, :-1]], axis=1)  # entry p: f_{p-1}
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    cos, sin = proposer.rope(positions)
    keys = jnp.arange(s)
    x, embeds = previous, proposer.embed_with(embed, tokens)
    ctx_k, ctx_v, ctx_visible = [], [], []  # per layer: [B, K, S, D] ×2, chains' visible entries [B, A, S]
    for layer in range(c.num_layers):  # step 0, every entry: causal over the entries 1…p
        normed, residual = proposer.layer_input(layer, x, embeds)
        q, k, v, extra = proposer.qkv(layer, normed, cos, sin)
        ctx_k.append(k.transpose(0, 2, 1, 3))
        ctx_v.append(v.transpose(0, 2, 1, 3))
        window = c.layer_windows[layer]
        visible = (keys[None, :] >= 1) & (keys[None, :] <= keys[:, None])  # [S, S]
        chains = (keys >= 1) & (keys <= entries[..., None])  # [B, A, S]
        if window:
            visible &= keys[None, :] > keys[:, None] - window
            chains &= keys > entries[..., None] - window
        ctx_visible.append(chains)
        attn = cached_attention(q, ctx_k[-1], ctx_v[-1], jnp.broadcast_to(visible, (b, s, s)))
        x = proposer.finish_layer(layer, attn.reshape(b, s, c.num_heads * c.head_dim), residual, extra)
    logits, hidden = proposer.logits_with(lm_head, jnp.take_along_axis(x, entries[..., None], axis=1))
    out = [logits]  # [B, A, Vd] per step
    attend = jax.vmap(_attend_with_steps, in_axes=(1, None, None, 1, 1, 1, None), out_axes=1)  # over the chains
    step_k: list[list[Array]] = [[] for _ in range(c.num_layers)]  # per layer, per step ≥ 1: [B, A, K, D]
    step_v: list[list[Array]] = [[] for _ in range(c.num_layers)]
    for step in range(1, steps):
        where = entries + step  # [B, A]
        cos, sin = proposer.rope(where)
        token = jnp.take_along_axis(tokens, jnp.minimum(where, s - 1), axis=1)
        x, embeds = hidden, proposer.embed_with(embed, token)
        for layer in range(c.num_layers):
            normed, residual = proposer.layer_input(layer, x, embeds)
            q, k, v, extra = proposer.qkv(layer, normed, cos, sin)  # [B, A, N | K, D]
            step_k[layer].append(k.astype(proposer.dtype))
            step_v[layer].append(v.astype(proposer.dtype))
            own_k, own_v = (jnp.stack(kv[layer], axis=3) for kv in (step_k, step_v))  # [B, A, K, s, D]
            attn = attend(q, ctx_k[layer], ctx_v[layer], ctx_visible[layer], own_k, own_v, jnp.ones((b, step), bool))
            x = proposer.finish_layer(layer, attn.reshape(b, a, -1), residual, extra)
        logits, hidden = proposer.logits_with(lm_head, x)
        out.append(logits)
    return jnp.stack(out, axis=2)


# ----------------------------------------------------------------------------------------------
# Load / save / init / --draft


def read_head_config(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """A sequential head's checkpoint directory (a directory or hub repo id) and its ``config.json``."""
    model_dir = hub.resolve_drafter_dir(path)
    try:
        return model_dir, json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{model_dir}: cannot read config.json ({e})") from e


def load_eagle3(path: str | os.PathLike, target: Target, dtype: str | jnp.dtype | None = None) -> Eagle3Proposer:
    """A speculators eagle3 checkpoint (a directory or a hub repo id ``ORG/NAME[@REVISION]``) for ``target``.
    ``dtype`` defaults to the target's."""
    model_dir, cfg = read_head_config(path)
    config = config_from_dict(cfg, target.config.num_layers)
    dtype = target.dtype if dtype is None else resolve_dtype(dtype)
    shell = Eagle3Proposer(params=None, config=config)  # (check_compatible reads the config only)
    shell.check_compatible(target)
    params = params_from_tensors(load_safetensors_dir(model_dir), config, target, dtype)
    return Eagle3Proposer(params=params, config=config)


def save_eagle3(
    proposer: Eagle3Proposer, path: str | os.PathLike, target: Target | None = None, verifier: str | None = None
) -> None:
    """Write ``config.json`` + ``model.safetensors`` in speculators' eagle3 layout (``Eagle3DraftModel`` loads it).
    A proposer sharing the target's embedding writes the target's (pass ``target``), or none: speculators'
    loader then reads it from ``verifier``."""
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = config_to_dict(proposer.config, verifier)
    cfg["torch_dtype"] = "bfloat16" if proposer.dtype == jnp.bfloat16 else "float32"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(params_to_tensors(proposer, target), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def init_eagle3(
    target: Target,
    num_layers: int = 1,
    block_size: int = 4,
    layer_ids: tuple[int, ...] | None = None,
    draft_ids: np.ndarray | list[int] | None = None,
    layer_type: str = "qwen3",
    initializer_range: float = 0.02,
    seed: int = 0,
    dtype: str | jnp.dtype | None = None,
    intermediate_size: int | None = None,
    **flags: bool,
) -> Eagle3Proposer:
    """A fresh EAGLE-3 head for ``target``, initialised as speculators does: Linear weights ~ N(0,
    initializer_range), norms one, the target's embedding (shared) and the target head's rows for the draft
    vocabulary ``draft_ids`` (None: every token) as its head. ``layer_ids``: speculators' ids (default
    ``init_layer_ids``). ``intermediate_size``: the MLP width (default the target's, as speculators' layer
    config copies it). ``flags``: ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``."""
    tc = target.config
    h = tc.hidden_size
    ids = None if draft_ids is None else np.unique(np.asarray(draft_ids, np.int64))
    if ids is not None and len(ids) == tc.vocab_size:
        ids = None
    config = Eagle3Config(
        layer_type=layer_type, hidden_size=h, num_layers=num_layers, num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
        intermediate_size=intermediate_size or tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, vocab_size=tc.vocab_size,
        draft_vocab_size=tc.vocab_size if ids is None else len(ids),
        layer_ids=tuple(layer_ids) if layer_ids is not None else init_layer_ids(tc.num_layers),
        layer_windows=(0,) * num_layers, speculative_tokens=max(block_size - 1, 1),
        max_position_embeddings=tc.max_position_embeddings, **flags,
    )  # fmt: skip
    Eagle3Proposer(params=None, config=config).check_compatible(target)
    dtype = target.dtype if dtype is None else resolve_dtype(dtype)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8 * num_layers + 2))
    c = config
    nd, kd, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size

    def normal(shape: tuple[int, ...]) -> Array:  # [in, out] directly
        return (initializer_range * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def ones(size: int) -> Array:
        return jnp.ones((size,), dtype)

    layers = []
    for i in range(num_layers):
        width = 2 * h if i == 0 else h
        layers.append(Eagle3Layer(
            input_norm=ones(h), q=normal((width, nd)), k=normal((width, kd)), v=normal((width, kd)),
            o=normal((nd, h)), post_norm=ones(h), gate=normal((h, f)), up=normal((h, f)), down=normal((f, h)),
            hidden_norm=ones(h) if i == 0 else None,
            q_norm=ones(c.head_dim) if layer_type == "qwen3" else None,
            k_norm=ones(c.head_dim) if layer_type == "qwen3" else None,
        ))  # fmt: skip
    head = quant.dequantize(target.params.lm_head)
    head = head if ids is None else jnp.take(head, jnp.asarray(ids, jnp.int32), axis=1)
    params = Eagle3Params(
        fc=normal((c.num_taps * h, h)), layers=tuple(layers), norm=ones(h), lm_head=head.astype(dtype),
        draft_ids=None if ids is None else jnp.asarray(ids, jnp.int32),
        input_norm=ones(c.num_taps * h) if c.norm_before_fc else None,
        fc_norms=tuple(ones(h) for _ in range(c.num_taps)) if c.fc_norm else None,
    )  # fmt: skip
    return Eagle3Proposer(params=params, config=config, max_block=block_size)


def parse_init_spec(text: str) -> int | None:
    """``init:eagle3[:BLOCK]`` → the block size (default 4); None for anything else."""
    parts = text.split(":")
    if parts[:2] != ["init", KIND]:
        return None
    block = parts[2] if len(parts) == 3 else "4"
    if len(parts) not in (2, 3) or not block.isdigit() or int(block) < 2:
        raise ValueError(f"{text!r}: expected init:eagle3 or init:eagle3:BLOCK (BLOCK >= 2)")
    return int(block)


def is_eagle3_spec(text: str) -> bool:
    """Whether a ``--draft`` value names an EAGLE-3 head: ``init:eagle3[:BLOCK]``, or a directory / hub repo
    id whose ``config.json`` says ``speculators_model_type: eagle3``."""
    return parse_init_spec(text) is not None or spec_model_type(text) == KIND


def eagle3_block_size(text: str) -> int:
    """The longest verify block an EAGLE-3 ``--draft`` value drafts for (without loading weights)."""
    block = parse_init_spec(text)
    if block is not None:
        return block
    return speculative_tokens(read_head_config(text)[1], 3) + 1


def load_eagle3_draft(
    text: str, target: Target, dtype: str | jnp.dtype | None = None, quantize: str = "none"
) -> Eagle3Proposer:
    """``load_draft`` for an EAGLE-3 ``--draft`` value (``is_eagle3_spec``): a checkpoint, or ``init:eagle3[:BLOCK]``
    (an untrained head, seed 0); quantised / packed for the target like a block drafter."""
    block = parse_init_spec(text)
    proposer = init_eagle3(target, block_size=block, dtype=dtype) if block else load_eagle3(text, target, dtype)
    return pack_drafter(quantize_drafter(proposer, quantize), target)
