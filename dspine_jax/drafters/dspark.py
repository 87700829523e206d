"""The DSpark kind (vLLM ``speculators`` 0.9.0, ``DSparkDraftModel``): DFlash's backbone, plus a low-rank
Markov logit bias over the previous token of the block and a per-position confidence head.

Markov head (``markov_rank`` R > 0). ``w1 [V, R]`` embeds the previous token (a target id), ``w2 [R, Vd]``
maps back onto the draft logits (Vd: the draft vocabulary, else V). With ``e = w1[prev]`` and ``h`` the
final-normed backbone hidden of the position, the bias added to that position's unary logits is

* ``vanilla``: ``e @ w2``;
* ``gated``: ``(σ([h, e] @ Wg + bg) ⊙ e) @ w2``;
* ``rnn``: a state ``s`` over the block's positions, zero at position 0: ``[g, c, o] = [s, e, h] @ Wj + bj``
  (three R-wide chunks), bias ``tanh(o) @ w2``, then ``s ← σ(g) ⊙ s + (1 − σ(g)) ⊙ tanh(c)``.

Which token is "previous" (speculators trains it teacher-forced; at inference it is the token drafted
just before, so the walk is sequential):

* ``sample_from_anchor`` (DSpark's default, DeepSpec's convention): block position k predicts the token
  after it, so position 0 (the anchor's) proposes too. Position k's previous token is the token at
  position k: the anchor for k = 0, the proposal drawn at position k − 1 after that. A block of T
  positions gives T proposals: the longest verify block is T + 1 (``DSpark.verify_block``), as speculators
  drafts it.
* otherwise (DFlash's convention): position k ≥ 1 predicts the token at position k; its previous token
  is the anchor for k = 1 and the proposal of position k − 1 after that. Position 0 proposes nothing, but
  the ``rnn`` state still steps over it (with the anchor as its previous token), as in training.

Confidence head (``enable_confidence_head``): ``σ([h, e] @ wc + bc)`` per position (``[h]`` alone when
``confidence_head_with_markov`` is false), the predicted probability that the position's proposal is
accepted (speculators trains it on 1 − TV(p, q)). ``walk`` returns it for every proposal; the speculative
round does not use it yet (every proposal of the verify length is verified).

Drafting (``decode``): a ``lax.scan`` over proposal slots; each step adds the bias for the token actually
chosen before to the slot's unary logits, then greedy rows take the argmax and sampled rows draw from the
target's sampling transform of those logits (temperature, top-k, top-p: ``process_rows``, as DFlash does).
``q`` is that very distribution over the whole (draft) vocabulary (``cand_ids`` = every id), so lossless
verification sees what each proposal was drawn from.

Checkpoints (speculators' names; torch ``[out, in]``): ``markov_head.markov_w1.weight [V, R]``,
``markov_head.markov_w2.weight [Vd, R]``, ``markov_head.gate_proj.{weight [R, H+R], bias [R]}`` (gated),
``markov_head.joint_proj.{weight [3R, 2R+H], bias [3R]}`` (rnn), ``confidence_head.proj.{weight [1, I],
bias [1]}`` (I = H + R with the Markov input, else H). Config keys (top level): ``markov_rank``,
``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``.
``save_drafter`` writes DSpark in speculators' layout by default (``checkpoint_format``). Letters as in
drafter.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.drafters.config import DrafterConfig, config_check, config_check_numbers, register_drafter_kind
from dspine_jax.drafters.drafter import (
    BlockForward,
    DFlash,
    DraftOutput,
    block_tokens,
    choose,
    forward,
    slot_keys,
    unary_logits,
    vocab_ids,
)
from dspine_jax.drafters.params import Drafter, DrafterParams, with_kind_weights
from dspine_jax.drafters.ring import DraftCache
from dspine_jax.models.sampling import Sampling, process_rows
from dspine_jax.models.target import Target
from dspine_jax.models.weights import CheckpointError, take

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# speculators' defaults (``DSparkSpeculatorConfig``), used where a config.json leaves a key out.
DSPARK_DEFAULTS: dict[str, Any] = {
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "sample_from_anchor": True,
}
DSPARK_KEYS = tuple(DSPARK_DEFAULTS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSparkConfig(DrafterConfig):
    """A DSpark drafter's config: the shared fields plus its two heads and the anchor convention."""

    markov_rank: int  # R of the Markov bias; 0: no Markov head (plain DFlash logits)
    markov_head_type: str  # "vanilla" | "gated" | "rnn"
    enable_confidence_head: bool
    confidence_head_with_markov: bool  # the confidence head also reads the previous token's w1 embedding
    sample_from_anchor: bool  # block position k proposes token k+1 (position 0 proposes too)

    def validate(self) -> None:
        super().validate()
        config_check_numbers(self, ("markov_rank",), where="DSpark")
        config_check(self.markov_rank >= 0, f"DSpark markov_rank={self.markov_rank} must be >= 0 (0: no Markov head)")
        config_check(
            self.markov_head_type in MARKOV_HEAD_TYPES,
            f"DSpark markov_head_type={self.markov_head_type!r} must be one of {', '.join(MARKOV_HEAD_TYPES)}",
        )
        for name in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
            value = getattr(self, name)
            config_check(isinstance(value, bool), f"DSpark {name} must be true or false, got {value!r}")
        config_check(
            not (self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0),
            "DSpark confidence_head_with_markov=true needs a Markov head (markov_rank > 0)",
        )

    @property
    def confidence_inputs(self) -> int:
        """I: the confidence head's input width."""
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)


@struct.dataclass
class MarkovHead:
    """The low-rank Markov bias ``w1[prev] → … → @ w2`` ([in, out] layout)."""

    w1: Array  # [V, R] previous-token embedding (target ids)
    w2: Array  # [R, Vd] (or [R, V]: columns picked at draft time when a draft vocabulary is attached later)
    # Not named like the backbone matrices (``io.DRAFTER_MATRICES``): packing / int8 leave the heads in float.
    gate_proj: Array | None = None  # [H + R, R] (gated)
    gate_bias: Array | None = None  # [R]
    joint_proj: Array | None = None  # [2R + H, 3R] (rnn): [state, prev_emb, hidden] → [gate, candidate, output]
    joint_bias: Array | None = None  # [3R]


@struct.dataclass
class ConfidenceHead:
    weight: Array  # [I]
    bias: Array  # [] scalar


@struct.dataclass
class DSparkParams(DrafterParams):
    """A DSpark drafter's weights: the shared backbone plus its Markov and confidence heads."""

    markov: MarkovHead | None = None
    confidence: ConfidenceHead | None = None


class DSparkWalk(NamedTuple):
    """One block's walk, per proposal slot 1..P (``P = block_size − 1``)."""

    tokens: Array  # [B, P] int32 proposals
    cand_ids: Array  # [B, P, V'] int32: every (draft) vocabulary id
    q: Array  # [B, P, V'] float32: the distribution each proposal was drawn from (one-hot for greedy rows)
    logits: Array  # [B, P, V'] float32: unary + Markov bias given the token walked before (no sampling transform)
    confidence: Array | None  # [B, P] float32 in (0, 1): predicted acceptance of each proposal (None: no head)


# ----------------------------------------------------------------------------------------------
# The heads (pure functions over one position of every row)


def markov_step(head: MarkovHead, kind: str, prev_emb: Array, hidden: Array, state: Array) -> tuple[Array, Array]:
    """One position's bias input and the next ``rnn`` state: ``prev_emb [B, R]`` (``w1[prev]``), ``hidden
    [B, H]`` (final-normed), ``state [B, R]`` → (``[B, R]`` to multiply by ``w2``, new state ``[B, R]``)."""
    if kind == "vanilla":
        return prev_emb, state
    hidden = hidden.astype(prev_emb.dtype)
    if kind == "gated":
        gate = jax.nn.sigmoid(jnp.concatenate([hidden, prev_emb], axis=-1) @ head.gate_proj + head.gate_bias)
        return gate * prev_emb, state
    z = jnp.concatenate([state, prev_emb, hidden], axis=-1) @ head.joint_proj + head.joint_bias
    gate_raw, candidate_raw, out_raw = jnp.split(z, 3, axis=-1)
    gate = jax.nn.sigmoid(gate_raw)
    return jnp.tanh(out_raw), gate * state + (1.0 - gate) * jnp.tanh(candidate_raw)


def markov_columns(params: DSparkParams, config: DSparkConfig) -> Array:
    """``w2`` over the drafter's logit axis ``[R, V']``: a full-vocabulary ``w2`` restricted to the draft
    vocabulary when one is attached (``io.with_draft_vocab`` keeps the weights as they are)."""
    w2, ids = params.markov.w2, params.draft_ids
    if ids is not None and w2.shape[1] == config.vocab_size:
        return jnp.take(w2, ids, axis=1)
    return w2


def confidence_logit(drafter: Drafter, hidden: Array, prev_emb: Array | None) -> Array:
    """``[h, e] @ wc + bc`` → ``[...]`` float32 (``hidden [..., H]``, ``prev_emb [..., R]`` or None): the
    confidence head before its sigmoid (training's binary cross-entropy reads it)."""
    head, config = drafter.params.confidence, drafter.config
    features = hidden.astype(jnp.float32)
    if config.confidence_head_with_markov:
        features = jnp.concatenate([features, prev_emb.astype(jnp.float32)], axis=-1)
    return features @ head.weight.astype(jnp.float32) + head.bias.astype(jnp.float32)


def confidence_of(drafter: Drafter, hidden: Array, prev_emb: Array | None) -> Array:
    """``σ([h, e] @ wc + bc)`` → ``[B]`` float32 (``hidden [B, H]``, ``prev_emb [B, R]`` or None)."""
    return jax.nn.sigmoid(confidence_logit(drafter, hidden, prev_emb))


def teacher_forced_bias(drafter: Drafter, hidden: Array, prev: Array) -> tuple[Array, Array]:
    """The Markov bias of every block position given **known** previous tokens (training's teacher forcing,
    speculators' ``MarkovHead.block_bias``): ``hidden [..., T, H]`` (final-normed), ``prev [..., T]`` target ids
    → bias ``[..., T, V']`` float32 and the previous tokens' embeddings ``w1[prev] [..., T, R]``. The same
    ``markov_step`` as the walk, which feeds it the tokens it drew instead; ``rnn`` scans the positions."""
    params, config = drafter.params, drafter.config
    head = params.markov
    prev_emb = head.w1[prev]  # [..., T, R]
    if config.markov_head_type == "rnn":

        def step(state: Array, xs: tuple[Array, Array]) -> tuple[Array, Array]:
            mixed, state = markov_step(head, "rnn", xs[0], xs[1], state)
            return state, mixed

        state = jnp.zeros((*prev_emb.shape[:-2], config.markov_rank), prev_emb.dtype)
        _, mixed = jax.lax.scan(step, state, (jnp.moveaxis(prev_emb, -2, 0), jnp.moveaxis(hidden, -2, 0)))
        mixed = jnp.moveaxis(mixed, 0, -2)
    else:
        mixed, _ = markov_step(head, config.markov_head_type, prev_emb, hidden, prev_emb)  # (no state)
    return jnp.matmul(mixed, markov_columns(params, config), preferred_element_type=jnp.float32), prev_emb


# ----------------------------------------------------------------------------------------------
# The kind


@register_drafter_kind
class DSpark(DFlash):
    """DSpark (speculators ``DSparkDraftModel(DFlashDraftModel)``): DFlash's backbone and unary logits, a Markov
    bias on the previously drafted token walked left to right, and a confidence head."""

    name = "dspark"
    architecture = "DSparkDraftModel"
    config_class = DSparkConfig
    init_options = DSPARK_KEYS
    checkpoint_format = "speculators"  # save_drafter's default: the only layout DSpark checkpoints exist in

    # --- config.json ---

    def read_config(self, cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """DFlash's fields (C = V) plus the heads' keys (top level; speculators' defaults where absent)."""
        values = {key: cfg.get(key, default) for key, default in DSPARK_DEFAULTS.items()}
        values = {key: default if values[key] is None else values[key] for key, default in DSPARK_DEFAULTS.items()}
        return {**super().read_config(cfg, fields), **values}

    def write_config(self, config: DSparkConfig, cfg: dict[str, Any]) -> None:
        super().write_config(config, cfg)
        cfg.update({key: getattr(config, key) for key in DSPARK_KEYS})

    def init_config(self, cfg: dict[str, Any], hidden: int, vocab: int, options: dict[str, Any]) -> None:
        """``init_drafter``'s ``markov_rank`` (default min(256, H)), ``markov_head_type`` and the flags
        (speculators' defaults)."""
        for key, default in DSPARK_DEFAULTS.items():
            value = options.get(key)
            cfg[key] = (min(default, hidden) if key == "markov_rank" else default) if value is None else value

    # --- weights ---

    @staticmethod
    def _sizes(config: DSparkConfig) -> tuple[int, int, int, int]:
        """H, R, V, Vd (the w2 width: the draft vocabulary's size, else V)."""
        return config.hidden_size, config.markov_rank, config.vocab_size, config.draft_vocab_size or config.vocab_size

    def load_params(self, tensors: dict, config: DSparkConfig, target: Target, cast: Callable, backbone: DrafterParams) -> DSparkParams:
        h, r, v, vd = self._sizes(config)
        markov = None
        if r > 0:
            kind = config.markov_head_type
            markov = MarkovHead(
                w1=cast(take(tensors, "markov_head.markov_w1.weight", (v, r))),
                w2=cast(take(tensors, "markov_head.markov_w2.weight", (vd, r)).T),
            )
            if kind == "gated":
                markov = markov.replace(
                    gate_proj=cast(take(tensors, "markov_head.gate_proj.weight", (r, h + r)).T),
                    gate_bias=cast(take(tensors, "markov_head.gate_proj.bias", (r,))),
                )
            elif kind == "rnn":
                markov = markov.replace(
                    joint_proj=cast(take(tensors, "markov_head.joint_proj.weight", (3 * r, 2 * r + h)).T),
                    joint_bias=cast(take(tensors, "markov_head.joint_proj.bias", (3 * r,))),
                )
        confidence = None
        if config.enable_confidence_head:
            i = config.confidence_inputs
            confidence = ConfidenceHead(
                weight=cast(take(tensors, "confidence_head.proj.weight", (1, i))[0]),
                bias=cast(take(tensors, "confidence_head.proj.bias", (1,))[0]),
            )
        return with_kind_weights(DSparkParams, backbone, markov=markov, confidence=confidence)

    def params_tensors(self, params: DrafterParams, config: DSparkConfig, host: Callable) -> dict[str, Any]:
        if not isinstance(params, DSparkParams):
            raise CheckpointError("a dspark drafter's params must be DSparkParams")
        out: dict[str, Any] = {}
        if params.markov is not None:
            m = params.markov
            out["markov_head.markov_w1.weight"] = host(m.w1)
            out["markov_head.markov_w2.weight"] = host(markov_columns(params, config), True)  # [Vd, R] in the file
            if m.gate_proj is not None:
                out["markov_head.gate_proj.weight"] = host(m.gate_proj, True)
                out["markov_head.gate_proj.bias"] = host(m.gate_bias)
            if m.joint_proj is not None:
                out["markov_head.joint_proj.weight"] = host(m.joint_proj, True)
                out["markov_head.joint_proj.bias"] = host(m.joint_bias)
        if params.confidence is not None:
            out["confidence_head.proj.weight"] = host(params.confidence.weight)[None, :]
            out["confidence_head.proj.bias"] = host(params.confidence.bias).reshape(1)
        return out

    def init_params(self, config: DSparkConfig, target: Target, keys: Any, dtype: jnp.dtype, backbone: DrafterParams) -> DSparkParams:
        """speculators' init: ``w1`` ~ N(0, 0.01); ``w2``, the gate / joint projections and the confidence
        head at torch's default Linear init U(±1/√fan_in) (they are built after HF's ``post_init``)."""
        h, r, v, vd = self._sizes(config)

        def uniform(shape: tuple[int, ...], fan_in: int) -> Array:
            bound = 1.0 / math.sqrt(fan_in)
            return jax.random.uniform(next(keys), shape, jnp.float32, -bound, bound).astype(dtype)

        markov = None
        if r > 0:
            w1 = (0.01 * jax.random.normal(next(keys), (v, r), jnp.float32)).astype(dtype)
            markov = MarkovHead(w1=w1, w2=uniform((r, vd), r))
            if config.markov_head_type == "gated":
                markov = markov.replace(gate_proj=uniform((h + r, r), h + r), gate_bias=uniform((r,), h + r))
            elif config.markov_head_type == "rnn":
                fan_in = 2 * r + h
                markov = markov.replace(joint_proj=uniform((fan_in, 3 * r), fan_in), joint_bias=uniform((3 * r,), fan_in))
        confidence = None
        if config.enable_confidence_head:
            i = config.confidence_inputs
            confidence = ConfidenceHead(weight=uniform((i,), i), bias=uniform((), i))
        return with_kind_weights(DSparkParams, backbone, markov=markov, confidence=confidence)

    def verify_block(self, config: DSparkConfig) -> int:
        """With ``sample_from_anchor`` every block position proposes (the anchor's too): anchor + ``block_size``."""
        return config.block_size + 1 if config.sample_from_anchor else config.block_size

    # --- decode head ---

    def walk(self, drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array, keys: Array, sampling: Sampling) -> DSparkWalk:
        """The sequential draft over one block forward: ``fwd.hidden [B, T, H]``, ``anchor [B]``, ``keys [B]``
        (per row), ``sampling`` per row → ``DSparkWalk`` for slots 1..P (module doc)."""
        config, params = drafter.config, drafter.params
        offset = 0 if config.sample_from_anchor else 1  # block position that proposes slot 1
        t = fwd.hidden.shape[1]
        p = t - offset
        hidden = fwd.hidden[:, offset:]  # [B, P, H]
        unary = unary_logits(drafter, target, hidden)  # [B, P, V'] float32
        b, _, width = unary.shape
        cand_ids = jnp.broadcast_to(vocab_ids(drafter, jnp.arange(width, dtype=jnp.int32)), (b, p, width))
        anchor = anchor.astype(jnp.int32)
        head, rank = params.markov, config.markov_rank
        unit = jnp.where(sampling.greedy, 0.0, 1.0)  # process_rows applies the temperature
        w2 = markov_columns(params, config) if head is not None else None

        state = jnp.zeros((b, max(rank, 1)), jnp.float32)
        if head is not None:
            state = state.astype(head.w1.dtype)
            if offset and config.markov_head_type == "rnn":  # position 0 steps the state, proposing nothing
                _, state = markov_step(head, "rnn", head.w1[anchor], fwd.hidden[:, 0], state)

        def step(carry: tuple[Array, Array], xs: tuple[Array, Array, Array]) -> tuple[tuple[Array, Array], tuple]:
            prev, state = carry
            unary_i, hidden_i, key_i = xs  # [B, V'], [B, H], keys [B]
            prev_emb = None
            logits = unary_i
            if head is not None:
                prev_emb = head.w1[prev]  # [B, R]
                mixed, state = markov_step(head, config.markov_head_type, prev_emb, hidden_i, state)
                logits = logits + jnp.matmul(mixed, w2, preferred_element_type=jnp.float32)
            index, q = choose(process_rows(logits, sampling), key_i, unit)
            token = vocab_ids(drafter, index)
            confidence = confidence_of(drafter, hidden_i, prev_emb) if params.confidence is not None else None
            return (token, state), (token, q, logits, confidence)

        xs = (jnp.moveaxis(unary, 1, 0), jnp.moveaxis(hidden, 1, 0), slot_keys(keys, p))
        _, (tokens, q, logits, confidence) = jax.lax.scan(step, (anchor, state), xs)
        first = lambda x: None if x is None else jnp.moveaxis(x, 0, 1)  # noqa: E731  [P, B, …] → [B, P, …]
        return DSparkWalk(
            tokens=first(tokens), cand_ids=cand_ids, q=first(q), logits=first(logits), confidence=first(confidence)
        )

    def decode(self, drafter: Drafter, target: Target, fwd: BlockForward, anchor: Array, keys: Array, sampling: Sampling) -> DraftOutput:
        out = self.walk(drafter, target, fwd, anchor, keys, sampling)
        return DraftOutput(tokens=out.tokens, cand_ids=out.cand_ids, q=out.q, confidence=out.confidence)


def walk(drafter: Drafter, target: Target, cache: DraftCache, anchor: Array, keys: Array, sampling: Sampling) -> DSparkWalk:
    """``draft`` with everything the walk saw: ``anchor [B]`` at ``cache.lengths`` → ``DSparkWalk`` (the
    per-slot logits given the walked predecessors, and the confidence head's output)."""
    if drafter.config.kind != DSpark.name:
        raise ValueError(f"walk needs a dspark drafter, got a {drafter.config.kind!r} one")
    fwd = forward(drafter, target, cache, block_tokens(drafter, anchor))
    return drafter.kind.walk(drafter, target, fwd, anchor, keys, sampling)
