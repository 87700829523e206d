"""MTP (multi-token prediction): a target's own next-next-token head (Qwen3-Next, Qwen3.5), or vLLM's
``speculators`` ``mtp`` checkpoint of one, behind the ``Proposer`` seam, drafting one token per step.

The model (``speculators==0.9.0`` ``MTPDraftModel``; vLLM's ``Qwen3NextMTP`` / ``Qwen3_5MTP``), per entry:

* **Input**: the target's hidden state ``h`` and the embedding of the next token ``e = embed(x)`` (the
  target's embedding), each through its own RMSNorm, concatenated **embedding first** and projected back to
  ``H`` by ``fc`` (no bias): ``u = fc([token_norm(e) ; hidden_norm(h)])``.
* **One decoder layer** of the target's own kind on ``u``: a Qwen3 layer (q/k norms, full RoPE) for
  ``qwen3``; for ``qwen3_next`` / ``qwen3_5_text`` the hybrids' full-attention layer (q_proj emits q and a
  per-head gate, output × σ(gate), partial RoPE, every norm zero-centred ``(1 + w)``) with a dense SwiGLU MLP.
* **Output**: ``out = norm(layer(u))`` (the head's final norm); logits ``= out @ lm_head``, the **target's**
  head (shared, like the embedding). ``out`` is also the hidden the next draft step reads.
* **Which target hidden**: the target's *final-normed* hidden state, the one its own LM head reads — what
  vLLM passes its MTP drafters (the tensor ``Qwen3NextModel.forward`` returns, after ``norm``) and what the
  round hands every proposer as ``hidden``. (speculators' MTP *training* reads ``verifier_last_hidden_states``
  from vLLM's hidden-state extractor, the last layer's output before the final norm; its EAGLE-3 applies
  ``verifier_norm`` to the same tensor. So a head fine-tuned by speculators has seen pre-norm states.)
* **Pairing and positions** (vLLM's MTP proposer): the entry of position ``p`` reads ``h_p`` with the next
  token ``x_{p+1}``, sits at RoPE position ``p`` and predicts ``x_{p+2}``. We index entries by their token:
  the entry that reads token ``x_p`` (``p ≥ 1``) with ``h_{p-1}`` is stored at index ``p`` and rotated at
  ``p - 1`` — EAGLE-3's pairing (``eagle3.py``), one RoPE position earlier. Draft step ``s`` from the anchor
  ``x_n`` runs at position ``n - 1 + s``: step 0 reads ``h_{n-1}`` and the anchor, step ``s ≥ 1`` the previous
  step's ``out`` and its token. It attends causally to the committed entries (their K/V from true target
  hidden states) and to the round's own steps, as vLLM's drafter KV cache does; none of them is stored.
  (speculators' teacher-forced ``forward`` runs step ``s`` of every position as one causal pass over that
  step's own entries at the unshifted positions: step 0 is the same computation, later steps are a
  training approximation of this.)

State, life cycle and the step loop are EAGLE-3's (``eagle3.SequentialHead``, ``ingest``, ``draft_steps``,
state ``Eagle3State`` with ``features`` = the target's final hidden per committed position); this module gives
the layer hooks, the checkpoints and the ``--draft`` spellings:

* a speculators ``mtp`` checkpoint directory or hub repo id (``config.json`` with ``speculators_model_type:
  "mtp"``; tensors ``mtp_layers.0.*``; the verifier's ``embed_tokens`` / ``lm_head`` are the target's);
* ``self:mtp[:BLOCK]``: the target checkpoint's own head (its ``mtp.*`` tensors, ``hybrid.mtp_tensors``);
* ``init:mtp[:BLOCK]``: an untrained head for the target (tests, overhead measurements).

``save_mtp`` writes speculators' layout (``MTPDraftModel.from_pretrained`` reads it). One MTP layer, dense MLP
(speculators supports one layer; mixture-of-experts layers, like the targets, are not implemented).

Letters as in layers.py: B batch, T tokens, S positions, H width, N/K heads, D head dim, F MLP width,
V vocabulary, P draft steps.
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

from dspine_jax.drafters import eagle3
from dspine_jax.drafters.eagle3 import SequentialHead
from dspine_jax.drafters.params import pack_drafter, quantize_drafter
from dspine_jax.drafters.speculators_format import (
    SPECULATORS_VERSION,
    VERIFIER_TENSORS,
    proposal_config,
    spec_model_type,
    speculative_tokens,
)
from dspine_jax.models import quant
from dspine_jax.models.config import (
    HybridConfig,
    TargetConfig,
    UnsupportedModelError,
    dense_config_from_dict,
    hybrid_config_from_dict,
    read_config_json,
)
from dspine_jax.models.hybrid import mtp_tensors
from dspine_jax.models.layers import apply_rope, rms_norm, rope_cos_sin, swiglu
from dspine_jax.models.target import Target, resolve_dtype
from dspine_jax.models.weights import (
    DECODER_LAYER_TENSORS,
    CheckpointError,
    check_consumed,
    load_safetensors_dir,
    take,
)

KIND = "mtp"
# speculators' MTP layer types (transformer_layer_config.model_type) we run; the hybrids' layers are gated.
LAYER_TYPES = ("qwen3", "qwen3_next", "qwen3_5_text")
GATED_TYPES = ("qwen3_next", "qwen3_5_text")
SELF = "self"  # ``self:mtp``: the target checkpoint's own head
DEFAULT_STEPS = 3  # speculators' default speculative_tokens (a block of 4)
# (MTPParams field, speculators' name under ``mtp_layers.0.``, the target checkpoint's under ``mtp.``, transpose?)
# beside the decoder layer's tensors (``DECODER_LAYER_TENSORS``: ``mtp_layers.0.*`` / ``mtp.layers.0.*``).
_HEAD_TENSORS = (
    ("fc", "input_proj.weight", "fc.weight", True),
    ("token_norm", "token_layernorm.weight", "pre_fc_norm_embedding.weight", False),
    ("hidden_norm", "hidden_layernorm.weight", "pre_fc_norm_hidden.weight", False),
    ("norm", "final_layernorm.weight", "norm.weight", False),
)
LAYER_PREFIX = "mtp_layers.0."  # speculators' names
NATIVE_LAYER_PREFIX = "layers.0."  # a Qwen3-Next / Qwen3.5 checkpoint's, under ``mtp.``


# ----------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """What drafting depends on: the MTP layer's shape (the target's attention and MLP shapes)."""

    layer_type: str  # "qwen3" | "qwen3_next" | "qwen3_5_text" (speculators' transformer_layer_config.model_type)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # the first ``rotary_dim`` dims of a head rotate (partial RoPE in the hybrids)
    vocab_size: int
    speculative_tokens: int = DEFAULT_STEPS  # draft steps the checkpoint was trained for (proposal_methods[0])
    # speculators' transformer_layer_config, written back by ``save_mtp`` (JSON; no part of the computation)
    layer_config: str = dataclasses.field(default="{}", repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layer_type not in LAYER_TYPES:
            raise CheckpointError(f"mtp layers of type {self.layer_type!r} are not supported "
                                  f"({', '.join(LAYER_TYPES)} are)")  # fmt: skip
        if self.num_heads % self.num_kv_heads or self.speculative_tokens < 1:
            raise CheckpointError("mtp num_attention_heads must be a multiple of num_key_value_heads, and "
                                  "speculative_tokens ≥ 1")  # fmt: skip
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise CheckpointError(f"mtp rotary dims {self.rotary_dim} must be even and in [2, head_dim "
                                  f"{self.head_dim}]")  # fmt: skip

    @property
    def kind(self) -> str:
        return KIND

    @property
    def gated(self) -> bool:
        """The hybrids' layer: gated attention and zero-centred norms."""
        return self.layer_type in GATED_TYPES

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return (0,)  # full attention


def layer_type_for(tc: TargetConfig) -> str:
    """The MTP layer type of a target's family: its own for the hybrids, a Qwen3 layer for dense targets."""
    if isinstance(tc, HybridConfig):
        return "qwen3_next" if tc.model_type == "qwen3_next" else "qwen3_5_text"
    return "qwen3"


def config_from_target(
    tc: TargetConfig, layer_type: str, speculative_tokens: int = DEFAULT_STEPS, layer_config: dict | None = None
) -> MTPConfig:
    """An MTP layer of ``layer_type`` with the shapes of target config ``tc`` (the layer config speculators keeps
    is ``layer_config``, default one built from ``tc``)."""
    return MTPConfig(
        layer_type=layer_type, hidden_size=tc.hidden_size, num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim, intermediate_size=tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta, rotary_dim=getattr(tc, "rotary_dim", 0) or tc.head_dim, vocab_size=tc.vocab_size,
        speculative_tokens=speculative_tokens,
        layer_config=json.dumps(layer_config if layer_config is not None else layer_config_from(tc, layer_type),
                                sort_keys=True),
    )  # fmt: skip


def layer_config_from(tc: TargetConfig, layer_type: str) -> dict[str, Any]:
    """A ``transformer_layer_config`` for a head of ``layer_type`` on target ``tc`` (speculators builds its MTP
    layer from the verifier's config; the hybrids' layer takes the last ``full_attention`` layer's place)."""
    layer = {
        "model_type": layer_type, "vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size, "num_hidden_layers": tc.num_layers,
        "num_attention_heads": tc.num_heads, "num_key_value_heads": tc.num_kv_heads, "head_dim": tc.head_dim,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": tc.rms_norm_eps,
        "max_position_embeddings": tc.max_position_embeddings, "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": tc.rope_theta, "rope_type": "default"},
    }  # fmt: skip
    if layer_type not in GATED_TYPES:
        return {**layer, "layer_types": ["full_attention"] * tc.num_layers, "use_sliding_window": False,
                "sliding_window": None}  # fmt: skip
    kinds = list(getattr(tc, "layer_kinds", ()) or ["full_attention"] * tc.num_layers)
    layer["rope_parameters"]["partial_rotary_factor"] = getattr(tc, "rotary_dim", tc.head_dim) / tc.head_dim
    layer.update(layer_types=kinds, linear_num_key_heads=getattr(tc, "linear_num_key_heads", 1),
                 linear_num_value_heads=getattr(tc, "linear_num_value_heads", 1),
                 linear_key_head_dim=getattr(tc, "linear_key_head_dim", tc.head_dim),
                 linear_value_head_dim=getattr(tc, "linear_value_head_dim", tc.head_dim),
                 linear_conv_kernel_dim=getattr(tc, "linear_conv_kernel", 4))  # fmt: skip
    if layer_type == "qwen3_next":
        layer["num_experts"] = 0  # (transformers' default is a mixture of experts)
    return layer


def layer_target_config(layer: dict[str, Any]) -> TargetConfig:
    """speculators' ``transformer_layer_config`` (stored as a diff against its class's defaults, so completed
    through transformers' config class) → our config of that model type: the MTP layer's shapes."""
    from transformers import AutoConfig  # (only here: importing transformers is slow)

    layer_type = layer.get("model_type")
    if layer_type not in LAYER_TYPES:
        raise CheckpointError(f"mtp layers of type {layer_type!r} are not supported ({', '.join(LAYER_TYPES)} are; "
                              "mixture-of-experts layers are not implemented)")  # fmt: skip
    given = {k: v for k, v in layer.items() if k not in ("model_type", "transformers_version")}
    full = AutoConfig.for_model(layer_type, **given).to_dict()
    full["model_type"] = layer_type
    try:
        tc = hybrid_config_from_dict(full) if layer_type in GATED_TYPES else dense_config_from_dict(full)
    except (UnsupportedModelError, KeyError, ValueError) as e:
        raise CheckpointError(f"mtp transformer_layer_config: {e}") from e
    if tc.attention_bias or tc.mlp_bias or (tc.layer_windows and tc.layer_windows[0]):
        raise CheckpointError("mtp layers with biases or a sliding window are not supported")
    return tc


def config_from_dict(cfg: dict[str, Any]) -> MTPConfig:
    """A speculators mtp ``config.json`` dict → ``MTPConfig``."""
    if cfg.get("speculators_model_type") != KIND:
        raise CheckpointError(f"not a speculators mtp config (speculators_model_type = "
                              f"{cfg.get('speculators_model_type')!r})")  # fmt: skip
    if int(cfg.get("num_nextn_predict_layers", 1)) != 1:
        raise CheckpointError(f"mtp num_nextn_predict_layers {cfg['num_nextn_predict_layers']}: one layer is supported")
    layer = dict(cfg.get("transformer_layer_config") or {})
    return config_from_target(layer_target_config(layer), layer["model_type"], speculative_tokens(cfg, DEFAULT_STEPS),
                              layer)


def config_to_dict(config: MTPConfig, verifier: str | None = None, architectures: list[str] | None = None) -> dict:
    """``MTPConfig`` → a speculators mtp ``config.json`` dict (``MTPSpeculatorConfig`` reads it). ``verifier``:
    the target's path or hub id, where speculators' loader reads the embedding and LM head."""
    return {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": KIND,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": json.loads(config.layer_config),
        "num_nextn_predict_layers": 1,
        "speculators_config": proposal_config(KIND, config.speculative_tokens, verifier, architectures),
    }


# ----------------------------------------------------------------------------------------------
# Weights


@struct.dataclass
class MTPParams:
    """The head's weights, ``[in, out]``. The embedding and the LM head are the target's."""

    fc: Array  # [2H, H] over [token_norm(embed) ; hidden_norm(h)]
    token_norm: Array  # [H]
    hidden_norm: Array  # [H]
    input_norm: Array  # [H]
    q: Array  # [H, N·D]; gated: [H, N·2D], per head [q (D) | gate (D)] (HF q_proj layout)
    k: Array  # [H, K·D]
    v: Array  # [H, K·D]
    o: Array  # [N·D, H]
    q_norm: Array  # [D]
    k_norm: Array  # [D]
    post_norm: Array  # [H]
    gate: Array  # [H, F]
    up: Array  # [H, F]
    down: Array  # [F, H]
    norm: Array  # [H] the final norm (before the shared LM head)


def _torch_shapes(c: MTPConfig) -> dict[str, tuple[int, ...]]:
    h, n, k, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    q_rows = n * d * (2 if c.gated else 1)
    return {"fc": (h, 2 * h), "token_norm": (h,), "hidden_norm": (h,), "norm": (h,), "input_norm": (h,),
            "q": (q_rows, h), "k": (k * d, h), "v": (k * d, h), "o": (h, n * d), "q_norm": (d,), "k_norm": (d,),
            "post_norm": (h,), "gate": (f, h), "up": (f, h), "down": (h, f)}  # fmt: skip


def _names() -> list[tuple[str, str, str, bool]]:
    """(field, speculators name, the target checkpoint's name under ``mtp.``, transpose?) of every tensor."""
    layer = [(field, LAYER_PREFIX + suffix, NATIVE_LAYER_PREFIX + suffix, transpose)
             for field, suffix, transpose in DECODER_LAYER_TENSORS]  # fmt: skip
    return [(field, LAYER_PREFIX + ours, native, transpose) for field, ours, native, transpose in _HEAD_TENSORS] + layer


def speculators_names(native: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Qwen3-Next / Qwen3.5 checkpoint's MTP tensors (``mtp.*`` with the prefix removed) under speculators' names
    (what its ``MTPConverter`` writes). Refuses several MTP layers and mixture-of-experts layers."""
    rename = {theirs: ours for _, ours, theirs, _ in _names()}
    extra_layers = sorted({name.split(".")[1] for name in native if name.startswith("layers.")} - {"0"})
    if extra_layers:
        raise CheckpointError(f"the checkpoint has MTP layers {['0', *extra_layers]}: one is supported")
    if any(".experts." in name or ".shared_expert" in name for name in native):
        raise CheckpointError("the checkpoint's MTP layer has a mixture-of-experts MLP, which is not implemented")
    if "embed_tokens.weight" in native:
        raise CheckpointError("the checkpoint's MTP head has its own embedding (mtp_use_dedicated_embeddings), "
                              "which is not supported")  # fmt: skip
    return {rename.get(name, name): value for name, value in native.items()}


def params_from_tensors(tensors: dict[str, np.ndarray], config: MTPConfig, dtype: jnp.dtype) -> MTPParams:
    """speculators-named, torch-layout tensors → ``MTPParams``. Consumes every tensor or raises; the verifier's
    tensors (``embed_tokens``, ``lm_head``, ``verifier_lm_head``) are skipped (the target's are used)."""
    tensors = {k: v for k, v in tensors.items() if k not in VERIFIER_TENSORS and not k.endswith("rotary_emb.inv_freq")}
    shapes = _torch_shapes(config)

    def cast(x: np.ndarray, transpose: bool) -> Array:
        x = np.asarray(x, dtype=np.float32)
        return jnp.asarray(x.T if transpose else x, dtype=dtype)

    params = MTPParams(**{field: cast(take(tensors, name, shapes[field]), transpose)
                          for field, name, _, transpose in _names()})  # fmt: skip
    check_consumed(tensors, "mtp")
    return params


def params_to_tensors(params: MTPParams) -> dict[str, np.ndarray]:
    """``MTPParams`` → speculators-named torch-layout numpy tensors (``MTPDraftModel``'s state dict less the
    verifier's embedding and head, which it does not save)."""

    def host(x: Any, transpose: bool) -> np.ndarray:
        a = np.asarray(jax.device_get(quant.dequantize(x)))
        return np.ascontiguousarray(a.T if transpose else a)

    return {name: host(getattr(params, field), transpose) for field, name, _, transpose in _names()}


# ----------------------------------------------------------------------------------------------
# The proposer


@struct.dataclass
class MTPProposer(SequentialHead):
    """An MTP head as a proposer (``decoding/proposers.py``): sequential drafting, ``num`` steps per round, from
    the target's final hidden states (no taps)."""

    params: MTPParams
    config: MTPConfig = struct.field(pytree_node=False)
    max_block: int = struct.field(pytree_node=False, default=0)  # longest verify block; 0: trained steps + 1

    # --- the protocol's static answers ---

    @property
    def taps(self) -> tuple[int, ...]:
        return ()  # it reads the final hidden state, which every target forward returns

    def check_compatible(self, target: Target) -> None:
        tc, c = target.config, self.config
        if c.hidden_size != tc.hidden_size:
            raise CheckpointError(f"mtp hidden_size {c.hidden_size} != the target's {tc.hidden_size}")
        if c.vocab_size != tc.vocab_size:
            raise CheckpointError(f"mtp vocab_size {c.vocab_size} != the target's {tc.vocab_size} (the head decodes "
                                  "with the target's embedding and LM head)")  # fmt: skip

    # --- the layer hooks ``eagle3.ingest`` / ``eagle3.draft_steps`` run (``SequentialHead``) ---

    def _norm(self, x: Array, weight: Array) -> Array:
        return rms_norm(x, weight, self.config.rms_norm_eps, zero_centered=self.config.gated)

    def entry_features(self, hidden: Array, tapped: Array) -> Array:
        return hidden.astype(self.dtype)  # the target's final-normed hidden [B, T, H]

    def rope(self, positions: Array) -> tuple[Array, Array]:
        """The entry of token position p runs at its hidden's position p - 1 (module doc)."""
        c = self.config
        return rope_cos_sin(positions - 1, c.rotary_dim, c.rope_theta, self.dtype)

    def embed_with(self, table: Array, tokens: Array) -> Array:
        return table[tokens].astype(self.dtype)  # the target's embedding

    def layer_input(self, layer: int, x: Array, embeds: Array) -> tuple[Array, Array]:
        """``x`` the hidden ``[B, T, H]``, ``embeds`` the tokens' ``[B, T, H]`` → the layer's normed input and its
        residual ``u = fc([token_norm(embeds) ; hidden_norm(x)])``."""
        p = self.params
        fused = jnp.concatenate([self._norm(embeds, p.token_norm), self._norm(x, p.hidden_norm)], axis=-1) @ p.fc
        return self._norm(fused, p.input_norm), fused

    def qkv(self, layer: int, normed: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array, Array | None]:
        """``normed [B, T, H]`` → q ``[B, T, N, D]``, k / v ``[B, T, K, D]`` (q/k norms, RoPE) and the output gate
        ``[B, T, N·D]`` of a gated layer (else None)."""
        p, c = self.params, self.config
        b, t, _ = normed.shape
        n, d = c.num_heads, c.head_dim
        gate = None
        if c.gated:
            qg = (normed @ p.q).reshape(b, t, n, 2 * d)  # per head [q | gate]
            q, gate = qg[..., :d], qg[..., d:].reshape(b, t, n * d)
        else:
            q = (normed @ p.q).reshape(b, t, n, d)
        k = self._norm((normed @ p.k).reshape(b, t, c.num_kv_heads, d), p.k_norm)
        v = (normed @ p.v).reshape(b, t, c.num_kv_heads, d)
        q = self._norm(q, p.q_norm)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def finish_layer(self, layer: int, attn: Array, residual: Array, gate: Array | None) -> Array:
        """``attn [B, T, N·D]`` (× σ(gate)), ``o_proj``, the residual, then the MLP block."""
        p = self.params
        if gate is not None:
            attn = attn * jax.nn.sigmoid(gate)
        x = residual + attn @ p.o
        return x + swiglu(self._norm(x, p.post_norm), p.gate, p.up, p.down)

    def logits_with(self, lm_head: Array, out: Array) -> tuple[Array, Array]:
        """The layer's output ``[B, H]`` → float32 logits ``[B, V]`` through the target's LM head ``lm_head``, and
        the hidden the next step reads: both from ``norm(out)``."""
        normed = self._norm(out, self.params.norm)
        return quant.matmul_f32(normed, lm_head), normed


# ----------------------------------------------------------------------------------------------
# Load / save / init / --draft


def _dtype(dtype: str | jnp.dtype | None, target: Target) -> jnp.dtype:
    return target.dtype if dtype is None else resolve_dtype(dtype)


def load_mtp(path: str | os.PathLike, target: Target, dtype: str | jnp.dtype | None = None) -> MTPProposer:
    """A speculators mtp checkpoint (a directory or a hub repo id ``ORG/NAME[@REVISION]``) for ``target``.
    ``dtype`` defaults to the target's."""
    model_dir, cfg = eagle3.read_head_config(path)
    config = config_from_dict(cfg)
    MTPProposer(params=None, config=config).check_compatible(target)  # (reads the config only)
    params = params_from_tensors(load_safetensors_dir(model_dir), config, _dtype(dtype, target))
    return MTPProposer(params=params, config=config)


def load_own_mtp(
    target: Target, dtype: str | jnp.dtype | None = None, block_size: int | None = None
) -> MTPProposer:
    """The head a hybrid target's checkpoint ships (``target.model_dir``'s ``mtp.*`` tensors; Qwen3-Next,
    Qwen3.5), shaped like the target's own full-attention layers."""
    tc = target.config
    if not isinstance(tc, HybridConfig):
        raise CheckpointError(f"a {tc.model_type!r} target has no MTP head of its own (Qwen3-Next / Qwen3.5 "
                              "checkpoints ship one)")  # fmt: skip
    if not target.model_dir:
        raise CheckpointError("the target was not loaded from a checkpoint directory: no MTP head to read")
    native = mtp_tensors(target.model_dir)
    if not native:
        raise CheckpointError(f"{target.model_dir} has no mtp.* tensors (no multi-token-prediction head)")
    cfg = read_config_json(target.model_dir)
    text = dict(cfg.get("text_config") or cfg)  # speculators' converter keeps the (text) config as the layer's
    layer_type = layer_type_for(tc)
    text["model_type"] = layer_type
    config = config_from_target(tc, layer_type, DEFAULT_STEPS, text)
    params = params_from_tensors(speculators_names(native), config, _dtype(dtype, target))
    return MTPProposer(params=params, config=config, max_block=block_size or 0)


def save_mtp(
    proposer: MTPProposer, path: str | os.PathLike, verifier: str | None = None, architectures: list[str] | None = None
) -> None:
    """Write ``config.json`` + ``model.safetensors`` in speculators' mtp layout (``MTPDraftModel`` loads it; its
    loader reads the embedding and LM head from ``verifier``)."""
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = config_to_dict(proposer.config, verifier, architectures)
    cfg["torch_dtype"] = "bfloat16" if proposer.dtype == jnp.bfloat16 else "float32"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(params_to_tensors(proposer.params), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def init_mtp(
    target: Target,
    block_size: int = DEFAULT_STEPS + 1,
    layer_type: str | None = None,
    initializer_range: float = 0.02,
    seed: int = 0,
    dtype: str | jnp.dtype | None = None,
) -> MTPProposer:
    """A fresh MTP head for ``target``, initialised as transformers does speculators' layer: Linear weights ~
    N(0, initializer_range), norms the identity (one; zero for the hybrids' zero-centred norms). ``layer_type``:
    default the target family's (``layer_type_for``)."""
    tc = target.config
    layer_type = layer_type or layer_type_for(tc)
    config = config_from_target(tc, layer_type, max(block_size - 1, 1))
    dtype = _dtype(dtype, target)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8))
    shapes = _torch_shapes(config)
    fields: dict[str, Array] = {}
    for field, shape in shapes.items():
        if len(shape) == 2:  # [in, out] directly
            fields[field] = (initializer_range * jax.random.normal(next(keys), shape[::-1], jnp.float32)).astype(dtype)
        else:
            fields[field] = (jnp.zeros if config.gated else jnp.ones)(shape, dtype)
    proposer = MTPProposer(params=MTPParams(**fields), config=config, max_block=block_size)
    proposer.check_compatible(target)
    return proposer


def parse_spec(text: str) -> tuple[str, int | None] | None:
    """``init:mtp[:BLOCK]`` → ("init", BLOCK or None), ``self:mtp[:BLOCK]`` → ("self", …); None for anything
    else."""
    parts = text.split(":")
    if parts[:2] not in (["init", KIND], [SELF, KIND]):
        return None
    if len(parts) not in (2, 3) or (len(parts) == 3 and (not parts[2].isdigit() or int(parts[2]) < 2)):
        raise ValueError(f"{text!r}: expected {parts[0]}:mtp or {parts[0]}:mtp:BLOCK (BLOCK >= 2)")
    return parts[0], int(parts[2]) if len(parts) == 3 else None


def is_mtp_spec(text: str) -> bool:
    """Whether a ``--draft`` value names an MTP head: ``self:mtp[:BLOCK]``, ``init:mtp[:BLOCK]``, or a directory /
    hub repo id whose ``config.json`` says ``speculators_model_type: mtp``."""
    return parse_spec(text) is not None or spec_model_type(text) == KIND


def mtp_block_size(text: str) -> int:
    """The longest verify block an MTP ``--draft`` value drafts for (without loading weights)."""
    spec = parse_spec(text)
    if spec is not None:
        return spec[1] or DEFAULT_STEPS + 1
    return speculative_tokens(eagle3.read_head_config(text)[1], DEFAULT_STEPS) + 1


def load_mtp_draft(
    text: str, target: Target, dtype: str | jnp.dtype | None = None, quantize: str = "none"
) -> MTPProposer:
    """``load_draft`` for an MTP ``--draft`` value (``is_mtp_spec``): the target's own head (``self:mtp``), an
    untrained one (``init:mtp``, seed 0) or a speculators checkpoint; quantised / packed like a block drafter."""
    spec = parse_spec(text)
    if spec is None:
        proposer = load_mtp(text, target, dtype)
    elif spec[0] == SELF:
        proposer = load_own_mtp(target, dtype, spec[1])
    else:
        proposer = init_mtp(target, block_size=spec[1] or DEFAULT_STEPS + 1, dtype=dtype)
    return pack_drafter(quantize_drafter(proposer, quantize), target)
