"""The DSpine kind: DFlash's backbone with adjacent causal injection, last-write refinement (LWR) and a
cached transition walk as its decode head.

``DSpine`` subclasses ``drafter.DFlash`` and overrides its hooks. Its pieces are public methods so the
inference forward, the transition table, the sequential reference walk and training
(``train/model.py``, ``train/loop.py``) run literally the same math:

* ``feature(h, readout)``  ``√R · normalize(readout(h))``
* ``code(drafter, ids)``   a known token's predecessor message ``√R · C[token]``
* ``write(inj, l, h, receiver_logit, predecessor)``  one gated write
* ``inject(drafter, l, h, anchor, replacement)``  one layer's injection on every slot at once
* ``refine(drafter, pre, predecessor_ids)``  LWR: the last write redone for a chosen predecessor
* ``transition_table`` / ``walk`` / ``walk_sequential``  the decode head and its reference

Checkpoints follow SpecForge's layout (``injection.*`` tensors, ``transfer_codes`` buffer,
``dspine_config``): ``DSpineConfig`` models ``dspine_config`` and validates it as SpecForge's ``DSpineConfig``
does, ``DSpineParams`` holds the injection and the codes. Letters as in drafter.py; R transfer rank, M message
width.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from dspine_jax.drafters.config import (
    DrafterConfig,
    DrafterConfigError,
    config_check,
    config_check_numbers,
    config_float,
    config_int,
    drafter_kind,
    register_drafter_kind,
)
from dspine_jax.drafters.drafter import (
    BlockForward,
    Candidates,
    Choose,
    DFlash,
    DraftOutput,
    Replacement,
    choose,
    slot_keys,
    top_candidates,
    unary_logits,
    vocab_ids,
)
from dspine_jax.drafters.params import Drafter, DrafterParams, with_kind_weights
from dspine_jax.models import quant
from dspine_jax.models.layers import rms_norm
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import Target
from dspine_jax.models.weights import CheckpointError, take
from dspine_jax.pallas import transition_cache as _transition_kernel
from dspine_jax.parallel.mesh import per_device

# F.normalize's epsilon: a zero readout stays zero instead of dividing by zero.
NORMALIZE_EPS = 1e-12


@struct.dataclass
class Injection:
    """DSpine adjacent causal injection: per-layer readouts/writes, shared message/gates/bias."""

    readouts: tuple[Array, ...]  # L × [H, R]
    writes: tuple[Array, ...]  # L × [M, H]
    message: Array  # [R, M]
    receiver_gate: Array  # [R, M]
    predecessor_gate: Array  # [R, M]
    bias: Array  # [M]


@struct.dataclass(kw_only=True)
class DSpineParams(DrafterParams):
    """A DSpine drafter's weights: the shared backbone plus its injection and transfer codes."""

    injection: Injection
    # [V, R], fixed: derived from the target's LM head (training holds it apart, None: ``train.loop.split_params``).
    transfer_codes: Array | None


# SpecForge's DSpineConfig defaults: the modelled sizes, then the training-only knobs (loss weights and schedule).
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
# The training knobs by type: ``with_dspine_settings`` may change these (they fix no tensor shape).
TRAINING_INTS = ("alignment_warmup_steps", "replacement_layers")
TRAINING_FLOATS = (
    "ce_weight", "alignment_weight", "replacement_probability", "replacement_hold_ratio", "replacement_end_ratio",
    "candidate_mass_threshold",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSpineConfig(DrafterConfig):
    """A DSpine drafter's config: the shared fields plus SpecForge's ``dspine_config`` (its ``top_k`` is the shared
    ``top_k``). ``validate`` checks what SpecForge's ``DSpineConfig.validate`` checks, and causality."""

    transfer_rank: int  # R
    message_size: int  # M
    # Training only (SpecForge's loss weights and schedule, read by train/loop.py); kept so a config round-trips.
    ce_weight: float = DSPINE_DEFAULTS["ce_weight"]
    alignment_weight: float = DSPINE_DEFAULTS["alignment_weight"]
    alignment_warmup_steps: int = DSPINE_DEFAULTS["alignment_warmup_steps"]
    replacement_layers: int = DSPINE_DEFAULTS["replacement_layers"]
    replacement_probability: float = DSPINE_DEFAULTS["replacement_probability"]
    replacement_hold_ratio: float = DSPINE_DEFAULTS["replacement_hold_ratio"]
    replacement_end_ratio: float = DSPINE_DEFAULTS["replacement_end_ratio"]
    candidate_mass_threshold: float = DSPINE_DEFAULTS["candidate_mass_threshold"]

    def validate(self) -> None:
        super().validate()
        config_check_numbers(self, ("transfer_rank", "message_size", *TRAINING_INTS), TRAINING_FLOATS, "dspine_config")
        config_check(all(self.layer_causal), "a DSpine drafter is causal in every layer (its injection assumes slot t never sees t+1)")
        config_check(
            0 < self.transfer_rank <= min(self.hidden_size, self.vocab_size - 1),
            f"dspine_config.transfer_rank={self.transfer_rank} must be in [1, min(hidden_size, vocab_size-1)] "
            f"= [1, {min(self.hidden_size, self.vocab_size - 1)}]",
        )
        config_check(self.message_size >= 1, f"dspine_config.message_size={self.message_size} must be >= 1")
        config_check(0 <= self.ce_weight <= 1, f"dspine_config.ce_weight={self.ce_weight} must be in [0, 1]")
        config_check(self.alignment_weight >= 0, f"dspine_config.alignment_weight={self.alignment_weight} must be >= 0")
        config_check(
            self.alignment_warmup_steps >= 0 and self.replacement_layers >= 0,
            f"dspine_config.alignment_warmup_steps={self.alignment_warmup_steps} and "
            f"replacement_layers={self.replacement_layers} must be >= 0",
        )
        config_check(0 <= self.replacement_probability <= 1,
                     f"dspine_config.replacement_probability={self.replacement_probability} must be in [0, 1]")  # fmt: skip
        # The schedule divides by end - hold.
        config_check(
            0 <= self.replacement_hold_ratio < self.replacement_end_ratio <= 1,
            f"dspine_config needs 0 <= replacement_hold_ratio < replacement_end_ratio <= 1 "
            f"(got {self.replacement_hold_ratio}, {self.replacement_end_ratio})",
        )
        config_check(0 <= self.candidate_mass_threshold < 1,
                     f"dspine_config.candidate_mass_threshold={self.candidate_mass_threshold} must be in [0, 1)")  # fmt: skip

    @property
    def dspine_settings(self) -> dict[str, Any]:
        """The full ``dspine_config`` dict (training knobs included) as it will be saved: the file's own keys,
        then every modelled value."""
        raw = json.loads(self.raw_json).get("dspine_config") or {}
        return {**DSPINE_DEFAULTS, **raw, **{name: getattr(self, name) for name in DSPINE_DEFAULTS}}


def with_dspine_settings(config: DrafterConfig, **updates: Any) -> DSpineConfig:
    """``config`` with training-only ``dspine_config`` knobs replaced (e.g. the ``alignment_warmup_steps``
    a run really used), so a saved checkpoint records them. The modelled sizes (rank, width, top-k)
    cannot change this way: they fix tensor shapes."""
    bad = sorted(set(updates) - {*TRAINING_INTS, *TRAINING_FLOATS})
    if not isinstance(config, DSpineConfig) or bad:
        raise DrafterConfigError(f"cannot set dspine_config {bad or sorted(updates)} on this drafter")
    return dataclasses.replace(config, **updates)


def head_rows(lm_head: Array, ids: Array) -> Array:
    """Rows of the LM head ``[H, V]`` for token ids: ``[...]`` → ``[..., H]`` (a column gather, so the
    full head is never transposed)."""
    return jnp.moveaxis(quant.take_columns(lm_head, ids), 0, -1)


@register_drafter_kind
class DSpine(DFlash):
    """DSpine (SpecForge ``DSpineDraftModel(DFlashDraftModel)``): causal blocks, injection after every
    layer, C = ``top_k`` candidates per slot, LWR transition table and a left-to-right walk."""

    name = "dspine"
    architecture = "DSpineDraftModel"
    config_section = "dspine_config"
    config_class = DSpineConfig
    injects = True

    # --- config.json ---

    def read_config(self, cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """Causal in every layer whatever the file says (the injection assumes slot t never sees t+1); every
        ``dspine_config`` value (SpecForge's defaults for those it lacks), its ``top_k`` as the shared one."""
        settings = {**DSPINE_DEFAULTS, **(cfg.get("dspine_config") or {})}
        ints = ("transfer_rank", "message_size", "top_k", *TRAINING_INTS)
        return {
            **fields, "layer_causal": (True,) * fields["num_layers"],
            **{key: config_int(settings, key, "dspine_config") for key in ints},
            **{key: config_float(settings, key, "dspine_config") for key in TRAINING_FLOATS},
        }  # fmt: skip

    def write_config(self, config: DSpineConfig, cfg: dict[str, Any]) -> None:
        cfg["is_causal"] = True
        cfg["dspine_config"] = config.dspine_settings

    def init_config(self, cfg: dict[str, Any], hidden: int, vocab: int, options: dict[str, Any]) -> None:
        rank = options.get("transfer_rank") or min(1024, hidden, vocab - 1)
        cfg["is_causal"] = True
        cfg["dspine_config"] = {
            **DSPINE_DEFAULTS,
            "transfer_rank": rank,
            "message_size": options.get("message_size") or max(1, min(512, rank // 2)),
            "top_k": options["top_k"],
        }

    # --- weights ---

    def load_params(self, tensors: dict, config: DSpineConfig, target: Target, cast: Callable, backbone: DrafterParams) -> DSpineParams:
        """``injection.*`` (torch ``[out, in]``) and the ``transfer_codes`` buffer: used as stored unless
        absent or flagged not ready (SpecForge's never-initialised zeros), then recomputed from the head."""
        r, m, h, n = config.transfer_rank, config.message_size, config.hidden_size, config.num_layers
        injection = Injection(
            readouts=tuple(cast(take(tensors, f"injection.readouts.{i}.weight", (r, h)).T) for i in range(n)),
            writes=tuple(cast(take(tensors, f"injection.writes.{i}.weight", (h, m)).T) for i in range(n)),
            message=cast(take(tensors, "injection.message.weight", (m, r)).T),
            receiver_gate=cast(take(tensors, "injection.receiver_gate.weight", (m, r)).T),
            predecessor_gate=cast(take(tensors, "injection.predecessor_gate.weight", (m, r)).T),
            bias=cast(take(tensors, "injection.bias", (m,))),
        )
        ready, codes = True, None
        if "transfer_ready" in tensors:
            # torch saves the flag as a 0-d bool; accept a 1-element vector too (np.ascontiguousarray
            # turns 0-d arrays into 1-d ones, so some writers produce that).
            flag = tensors.pop("transfer_ready")
            if flag.size != 1:
                raise CheckpointError(f"tensor 'transfer_ready' has shape {tuple(flag.shape)}, expected ()")
            ready = bool(flag.reshape(()))
        if "transfer_codes" in tensors:
            stored = take(tensors, "transfer_codes", (config.vocab_size, r))
            codes = cast(stored) if ready else None
        if codes is None:  # absent, or SpecForge's never-initialised zeros
            codes = transfer_codes_from_head(quant.dequantize(target.params.lm_head), r)[0].astype(backbone.fc.dtype)
        return with_kind_weights(DSpineParams, backbone, injection=injection, transfer_codes=codes)

    def params_tensors(self, params: DrafterParams, config: DSpineConfig, host: Callable) -> dict[str, Any]:
        if not isinstance(params, DSpineParams) or params.transfer_codes is None:
            raise CheckpointError("a dspine drafter's params must be DSpineParams with its transfer codes")
        inj, out = params.injection, {}
        for i in range(config.num_layers):
            out[f"injection.readouts.{i}.weight"] = host(inj.readouts[i], True)
            out[f"injection.writes.{i}.weight"] = host(inj.writes[i], True)
        out["injection.message.weight"] = host(inj.message, True)
        out["injection.receiver_gate.weight"] = host(inj.receiver_gate, True)
        out["injection.predecessor_gate.weight"] = host(inj.predecessor_gate, True)
        out["injection.bias"] = host(inj.bias)
        out["transfer_codes"] = host(params.transfer_codes)
        out["transfer_ready"] = np.array(True)
        return out

    def init_params(self, config: DSpineConfig, target: Target, keys: Any, dtype: jnp.dtype, backbone: DrafterParams) -> DSpineParams:
        """SpecForge's init: ``message``/``receiver_gate`` keep torch's default Linear init U(±1/√R) (they are
        created after ``post_init``); ``writes``, ``predecessor_gate`` and ``bias`` are zero, so a fresh DSpine
        computes exactly a causal DFlash; readouts = the PCA directions of the transfer space."""
        r, m, h, n = config.transfer_rank, config.message_size, config.hidden_size, config.num_layers
        codes, directions = transfer_codes_from_head(quant.dequantize(target.params.lm_head), r)

        def torch_default(shape: tuple[int, ...]) -> Array:  # kaiming_uniform(a=√5) = U(±1/√fan_in)
            bound = 1.0 / np.sqrt(shape[0])
            return jax.random.uniform(next(keys), shape, jnp.float32, -bound, bound).astype(dtype)

        injection = Injection(
            readouts=tuple(directions.astype(dtype) for _ in range(n)),
            writes=tuple(jnp.zeros((m, h), dtype) for _ in range(n)),
            message=torch_default((r, m)),
            receiver_gate=torch_default((r, m)),
            predecessor_gate=jnp.zeros((r, m), dtype),
            bias=jnp.zeros((m,), dtype),
        )
        return with_kind_weights(DSpineParams, backbone, injection=injection, transfer_codes=codes.astype(dtype))

    # --- injection pieces ---

    @staticmethod
    def feature(h: Array, readout: Array, rank: int) -> Array:
        """``√R · normalize(readout(h))`` — h ``[..., H]``, readout ``[H, R]`` → ``[..., R]``; norm in f32."""
        projected = (h @ readout).astype(jnp.float32)
        norm = jnp.maximum(jnp.linalg.norm(projected, axis=-1, keepdims=True), NORMALIZE_EPS)
        return (math.sqrt(rank) * (projected / norm)).astype(h.dtype)

    @staticmethod
    def code(drafter: Drafter, token_ids: Array) -> Array:
        """Predecessor message of a known token: ``√R · C[token]`` — ``[...]`` → ``[..., R]``."""
        codes = drafter.params.transfer_codes
        return codes[token_ids] * jnp.asarray(math.sqrt(drafter.config.transfer_rank), codes.dtype)

    @staticmethod
    def write(inj: Injection, layer: int, h: Array, receiver_logit: Array, predecessor: Array) -> Array:
        """``h + (‖h‖/√H) · write_l(σ(receiver_gate(f) + predecessor_gate(pred) + bias) ⊙ message(pred))``.

        h ``[..., H]``; receiver_logit = ``receiver_gate(f)`` ``[..., M]`` (precomputed: it depends on the
        receiving slot only, so LWR computes it once per slot instead of once per candidate); predecessor
        ``[..., R]``. Leading axes broadcast. (``transition_table``'s reference path,
        ``kernels/pallas/transition_cache.py``, runs the same ops for every candidate predecessor.)
        """
        gate = jax.nn.sigmoid(receiver_logit + predecessor @ inj.predecessor_gate + inj.bias)
        delta = (gate * (predecessor @ inj.message)) @ inj.writes[layer]  # [..., H]
        scale = (jnp.linalg.norm(h.astype(jnp.float32), axis=-1, keepdims=True) / math.sqrt(h.shape[-1])).astype(h.dtype)
        return h + scale * delta

    def inject(self, drafter: Drafter, layer: int, h: Array, anchor: Array, replacement: Replacement | None = None) -> Array:
        """One layer's adjacent injection on ``h [..., T, H]`` (``anchor [...]``). Slot 0 is untouched; slot
        1's predecessor is the anchor's code, slot t ≥ 2's is slot t-1's readout feature — or, for blocks
        ``replacement`` selects in its first layers, the true predecessor's code. All features are read
        before any write, so every slot updates in parallel."""
        inj, rank = drafter.params.injection, drafter.config.transfer_rank
        features = self.feature(h, inj.readouts[layer], rank)  # [..., T, R]
        predecessors = jnp.concatenate([self.code(drafter, anchor)[..., None, :], features[..., 1:-1, :]], axis=-2)
        if replacement is not None and layer < replacement.layers:
            predecessors = jnp.where(replacement.mask[..., None, None], replacement.codes, predecessors)
        successors = self.write(inj, layer, h[..., 1:, :], features[..., 1:, :] @ inj.receiver_gate, predecessors)
        return jnp.concatenate([h[..., :1, :], successors], axis=-2)

    def after_layer(self, drafter: Drafter, layer: int, h: Array, anchor: Array, replacement: Replacement | None) -> Array:
        return self.inject(drafter, layer, h, anchor, replacement)

    def layer_feature(self, drafter: Drafter, layer: int, h: Array) -> Array:
        return self.feature(h, drafter.params.injection.readouts[layer], drafter.config.transfer_rank)

    def replacement(self, drafter: Drafter, mask: Array, labels: Array) -> Replacement:
        return Replacement(mask=mask, codes=self.code(drafter, labels[..., :-1]), layers=drafter.config.replacement_layers)

    def refine(self, drafter: Drafter, pre: Array, predecessor_ids: Array) -> Array:
        """Last-write refinement: redo the last layer's write from its pre-injection state with a known
        predecessor token's code, then the final norm. pre ``[..., H]``, predecessor_ids ``[...]`` → ``[..., H]``."""
        inj, last = drafter.params.injection, drafter.config.num_layers - 1
        receiver_logit = self.feature(pre, inj.readouts[last], drafter.config.transfer_rank) @ inj.receiver_gate
        written = self.write(inj, last, pre, receiver_logit, self.code(drafter, predecessor_ids))
        return rms_norm(written, drafter.params.norm, drafter.config.rms_norm_eps)

    # --- decode head ---

    def transition_table(self, drafter: Drafter, target: Target, pre: Array, cand_ids: Array, anchor: Array) -> Array:
        """``T[b, i, k, j] = ⟨LWR(pre_i, C[pred_{i,k}]), head[cand_{i,j}]⟩`` for every adjacent candidate pair.

        pre ``[B, P, H]`` (pre-injection states of slots 1..P), cand_ids ``[B, P, C]``, anchor ``[B]`` →
        float32 ``[B, P, C, C]``. Slot 1's predecessors are all the anchor (its C rows are identical); slot
        i ≥ 2's are the C candidates of slot i-1.
        """
        inj, last = drafter.params.injection, drafter.config.num_layers - 1
        b, _, c = cand_ids.shape
        predecessors = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], (b, 1, c)), cand_ids[:, :-1]], axis=1)
        receiver_logit = self.feature(pre, inj.readouts[last], drafter.config.transfer_rank) @ inj.receiver_gate  # [B, P, M]
        weights = _transition_kernel.LWRWeights(inj.predecessor_gate, inj.message, inj.bias, inj.writes[last], drafter.params.norm)
        # Kernel dispatch (kernels/pallas/dispatch.py, at trace time): the jnp reference (the same ops as
        # ``refine`` + scoring), or the fused Pallas kernel that keeps the [B, P, C, H] refined states on chip.
        # Under a mesh each device scores its own rows.
        rows = ("batch", None, None)
        scores = per_device(
            functools.partial(_transition_kernel.transition_scores, eps=drafter.config.rms_norm_eps),
            [rows, rows, rows + (None,), rows + (None,), None], rows + (None,),
        )  # fmt: skip
        rows_of_candidates = head_rows(target.params.lm_head, cand_ids)  # [B, P, C, H]
        return scores(pre, receiver_logit, self.code(drafter, predecessors), rows_of_candidates, weights)

    def candidates(self, drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array) -> Candidates:
        """The unary top-``config.top_k`` per slot and their transition table ``[B, P, C, C]``."""
        logits = unary_logits(drafter, target, fwd.hidden[:, 1:])  # [B, P, V] (or [B, P, Vd])
        _, index = top_candidates(logits, drafter.config.top_k)  # [B, P, C], best first
        cand_ids = vocab_ids(drafter, index)
        table = self.transition_table(drafter, target, fwd.pre_injection[:, 1:], cand_ids, anchor)
        return Candidates(cand_ids=cand_ids, scores=table)

    def select(self, cands: Candidates, slot_keys: Array, pick: Choose) -> tuple[Array, Array]:
        """Left-to-right walk over the transition table: ``lax.scan`` over slots, each step a row look-up
        ``T[i, k_prev, :]`` and a ``pick`` — no matmul inside the loop → tokens ``[B, P]``, q ``[B, P, C]``."""
        table, cand_ids = cands.scores, cands.cand_ids
        b = cand_ids.shape[0]

        def step(prev: Array, xs: tuple[Array, Array, Array]) -> tuple[Array, tuple[Array, Array]]:
            table_i, cand_i, key_i = xs  # [B, C, C], [B, C], key(s)
            row = jnp.take_along_axis(table_i, prev[:, None, None], axis=1)[:, 0]  # [B, C]
            index, q = pick(row, key_i)
            token = jnp.take_along_axis(cand_i, index[:, None], axis=1)[:, 0]
            return index, (token, q)

        xs = (jnp.moveaxis(table, 1, 0), jnp.moveaxis(cand_ids, 1, 0), slot_keys)
        # Slot 1's rows are all conditioned on the anchor, so any start index reads the same row.
        _, (tokens, q) = jax.lax.scan(step, jnp.zeros((b,), jnp.int32), xs)
        return jnp.moveaxis(tokens, 0, 1), jnp.moveaxis(q, 0, 1)

    def decode(self, drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array, keys: Array, sampling: Sampling) -> DraftOutput:
        """A sampled row's slot i draws from ``softmax(T[i, k_prev, :] / temperature)``; the sampling filters
        do not apply (the walk is already restricted to the C candidates)."""
        cands = self.candidates(drafter, target, fwd, anchor)
        keys = slot_keys(keys, cands.cand_ids.shape[1])
        tokens, q = self.select(cands, keys, lambda s, k: choose(s, k, sampling.temperature))
        return DraftOutput(tokens=tokens, cand_ids=cands.cand_ids, q=q)

    def walk_sequential(
        self, drafter: Drafter, target: Target, pre: Array, cand_ids: Array, anchor: Array, keys: Array, temperature: Array
    ) -> tuple[Array, Array]:
        """Reference for the walk: at each slot, re-run the last write for the predecessor actually chosen
        and score the candidates (P sequential refinements). Same keys (``[B]``, per row) and choice rule
        (``temperature [B]``) as ``decode``."""
        _, p, _ = cand_ids.shape
        keys = slot_keys(keys, p)
        previous = anchor.astype(jnp.int32)
        tokens, qs = [], []
        for i in range(p):
            refined = self.refine(drafter, pre[:, i], previous)  # [B, H]
            rows = head_rows(target.params.lm_head, cand_ids[:, i])  # [B, C, H]
            scores = jnp.einsum("bh,bjh->bj", refined, rows, preferred_element_type=jnp.float32)
            index, q = choose(scores, keys[i], temperature)
            previous = jnp.take_along_axis(cand_ids[:, i], index[:, None], axis=1)[:, 0]
            tokens.append(previous)
            qs.append(q)
        return jnp.stack(tokens, axis=1), jnp.stack(qs, axis=1)


# ----------------------------------------------------------------------------------------------
# Transfer codes


def transfer_codes_from_head(lm_head: Array, rank: int, chunk: int = 4096) -> tuple[Array, Array]:
    """Fixed token codes from the target's LM head ``[H, V]`` → codes ``[V, R]``, directions ``[H, R]``.

    Rows (tokens) are L2-normalised, centred, projected on the top-``rank`` principal directions of their
    covariance, whitened by 1/√eigenvalue and L2-normalised again (SpecForge ``initialize_transfer_space``).
    Directions come out in ascending eigenvalue order like ``torch.linalg.eigh`` (so readouts initialised
    from them line up with SpecForge's). Eigenvector signs are arbitrary in any eigensolver; we fix each
    direction's sign so its largest-magnitude component is positive, which makes the result reproducible
    and independent of the head's row order. The covariance is accumulated in ``chunk``-row slices in
    float32 (highest matmul precision) so a 250k × 5k head never needs a second full-size copy.
    Load-time only (it checks the eigenvalues on the host), not for use under ``jit``.
    """
    lm_head = quant.dequantize(lm_head)  # a packed or int8 head as its matrix
    h, v = lm_head.shape
    if not 0 < rank <= min(h, v - 1):
        raise ValueError(f"transfer rank {rank} must be in [1, min(hidden={h}, vocab-1={v - 1})]")
    chunk = min(chunk, v)
    pad = (-v) % chunk
    rows = jnp.pad(lm_head.T, ((0, pad), (0, 0))).reshape(-1, chunk, h)  # zero rows add nothing below

    def normalized(x: Array) -> Array:
        x = x.astype(jnp.float32)
        return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), NORMALIZE_EPS)

    def accumulate(carry: tuple[Array, Array], x: Array) -> tuple[tuple[Array, Array], None]:
        total, cov = carry
        xn = normalized(x)
        return (total + xn.sum(0), cov + jnp.matmul(xn.T, xn, precision=jax.lax.Precision.HIGHEST)), None

    zeros = (jnp.zeros((h,), jnp.float32), jnp.zeros((h, h), jnp.float32))
    (total, cov), _ = jax.lax.scan(accumulate, zeros, rows)
    mean = total / v
    cov = cov - v * jnp.outer(mean, mean)
    cov = 0.5 * (cov + cov.T)  # exact symmetry for eigh
    values, directions = jnp.linalg.eigh(cov)
    values, directions = values[-rank:], directions[:, -rank:]  # ascending, like torch
    try:
        degenerate = not bool(jnp.all(jnp.isfinite(values)) & jnp.all(values > 0))
    except jax.errors.ConcretizationTypeError:  # abstract weights (jax.eval_shape, dspine_jax.lower): no values
        degenerate = False
    if degenerate:
        raise ValueError("the target head has fewer positive principal directions than the transfer rank")
    pivot = jnp.argmax(jnp.abs(directions), axis=0)
    directions = directions * jnp.sign(directions[pivot, jnp.arange(rank)])[None, :]

    def project(x: Array) -> Array:
        z = jnp.matmul(normalized(x) - mean, directions, precision=jax.lax.Precision.HIGHEST) / jnp.sqrt(values)
        return z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), NORMALIZE_EPS)

    codes = jax.lax.map(project, rows).reshape(-1, rank)[:v]
    return codes, directions


SPINE: DSpine = drafter_kind("dspine")  # the registered kind's methods, for callers that hold no drafter (tests, studies)
