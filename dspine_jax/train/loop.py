"""The training loop: objective, jitted step, AdamW + cosine schedule, orbax checkpoints, exact resume.

One objective serves every kind: a kind's training forward (``KindTraining.predict``) lays its predictions
out as ``A`` chains per row of ``P`` predicted tokens — a block drafter's anchored blocks (``block_predict``:
slots 1…T−1, or 0…T−1 for DSpark's ``sample_from_anchor``), a sequential head's (EAGLE-3, MTP)
test-time-training steps from an entry (``sequential_predict``) — and the shared supervision mask, position
decay, cross-entropy and accuracy apply; the kind's ``loss`` then gives its objective (DFlash: the CE alone).

Exact resume: everything random is a pure function of ``(seed, step)`` — the batch order is a
per-epoch permutation seeded by ``(seed, epoch)``, anchors / replacement flags use
``fold_in(key(seed), step)`` — and the checkpoint holds the trainable params, the optimiser state and
the step. So a run restored at step ``k`` computes bit-for-bit the same step ``k+1`` as an
uninterrupted run.

The frozen parts (target embedding, LM head, DSpine transfer codes, a draft vocabulary's ids and head
columns, EAGLE-3's head and embedding: ``FROZEN``) are not trained and not checkpointed: they come from the
target (codes are rebuilt deterministically by ``init_drafter``, the draft vocabulary by the run's
``--draft-vocab``; speculators freezes EAGLE-3's ``lm_head`` and ``embed_tokens`` too). An MTP head's
embedding and LM head are the target's (passed to the step, never in its params): it trains its layer, its
norms and ``fc``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax import Array
from tqdm import tqdm

from dspine_jax.drafters import dspark, eagle3, mtp
from dspine_jax.drafters.config import DrafterConfig, drafter_kind
from dspine_jax.drafters.dflash2 import DFlash2
from dspine_jax.drafters.drafter import DFlash, vocab_ids
from dspine_jax.drafters.dspark import DSpark
from dspine_jax.drafters.dspine import DSPINE_DEFAULTS, DSpine, head_rows, with_dspine_settings
from dspine_jax.drafters.eagle3 import Eagle3Proposer, SequentialHead
from dspine_jax.drafters.mtp import MTPProposer
from dspine_jax.drafters.params import Drafter
from dspine_jax.models import quant
from dspine_jax.train.losses import (
    acceptance,
    alignment_terms,
    ce_terms,
    dspine_schedule,
    kl_divergence,
    l1_terms,
    refinement_terms,
    slot_weights,
)
from dspine_jax.train.model import TrainForward, block_ids, train_forward


@dataclasses.dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 4
    anchors: int = 8  # blocks per sequence
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # Position decay γ of the slot weights exp(-(k-1)/γ). None: the reference default for the drafter kind
    # (REFERENCE_GAMMA); 0: no decay.
    gamma: float | None = None
    seed: int = 0
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_every: int = 0  # 0: no periodic τ
    alignment_warmup_steps: int | None = None  # None: the drafter config's


@dataclasses.dataclass(frozen=True)
class KindTraining:
    """What a drafter kind trains with beyond the cross-entropy every kind shares.

    ``reference_gamma``: the position decay γ of the reference recipe (SpecForge: OnlineDSpineModel sets 7
    when unset; the DFlash objective's ``loss_decay_gamma`` defaults to None, no decay; speculators' DSpark
    4; EAGLE-3 weighs its TTT steps by ``ttt_step_loss_decay`` = 1, no decay; MTP by ``compute_step_weights``'
    β^k with β = 0.6, γ = −1/ln β ≈ 1.96, normalised by ``mtp_loss``). ``schedule(step, total,
    settings) → (β, replacement probability)`` and ``loss(terms) → (loss, metrics)`` are the kind's extra
    objective (None: the CE alone). ``predict``: the kind's training forward (None: ``block_predict``);
    ``heads(drafter, hidden [B, A, T, H], labels, logits) → (logits, aux)``: what a block drafter's heads add
    to the unary logits, teacher-forced on the true tokens (DSpark's Markov bias and confidence logits)."""

    reference_gamma: float | None = None
    schedule: Callable[[Array, int, dict], tuple[Array, Array]] | None = None
    loss: Callable[[ObjectiveTerms], tuple[Array, dict[str, Array]]] | None = None
    predict: Callable[..., Prediction] | None = None
    heads: Callable[[Drafter, Array, Array, Array], tuple[Array, Any]] | None = None


class Prediction(NamedTuple):
    """A kind's training forward, laid out as ``A`` chains per row of ``P`` predicted tokens each."""

    model: Any  # the Drafter / sequential head (Eagle3Proposer, MTPProposer) the parameters make
    fwd: Any  # the kind's forward output its loss reads (TrainForward for block drafters)
    logits: Array  # [B, A, P, V'] over the drafter's vocabulary
    labels: Array  # [B, A, P+1] true tokens: the one the chain starts from (anchor / entry), then the P predicted
    positions: Array  # [B, A, P+1] their positions (unclamped)
    keep: Array  # [B, A] real chains
    aux: Any = None  # the kind's extra outputs (DSpark: confidence logits [B, A, P])


class ObjectiveTerms(NamedTuple):
    """What a kind's extra loss reads: the forward, the CE terms and the batch."""

    drafter: Any  # the model: a Drafter (a sequential head for EAGLE-3 / MTP)
    fwd: TrainForward | None
    labels: Array  # [B, A, P+1] real tokens of each chain (a block's anchor and its P predicted tokens)
    source: Array  # [B, A, P] positions (clamped) of the predicted tokens
    logits: Array  # [B, A, P, V]
    logp: Array  # [B, A, P, V]
    ce: Array  # weighted CE sum
    weights: Array  # [B, A, P]
    supervised: Array  # [B, A, P] bool
    count: Array
    denominator: Array
    beta: Array
    teacher_hidden: Array  # [B, S, H]
    lm_head: Array  # [H, V]
    aux: Any = None  # Prediction.aux
    decay: Array | None = None  # [P] the position decay exp(-k/γ) alone (ones without decay)


def draft_index(drafter: Drafter, tokens: Array) -> Array:
    """Token ids → their index in the drafter's vocabulary (``unary_logits``' last axis), -1 outside it."""
    ids = getattr(drafter.params, "draft_ids", None)  # (an MTP head has no draft vocabulary)
    if ids is None:
        return tokens
    table = jnp.full((drafter.config.vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    return table[tokens]


def unary_candidates(terms: ObjectiveTerms) -> tuple[Array, Array]:
    """The **detached** top-``config.top_k`` of the unary logits: their indices into the logits' last axis and
    their token ids ``[B, A, P, C]`` (they differ with a draft vocabulary)."""
    drafter = terms.drafter
    _, index = jax.lax.top_k(jax.lax.stop_gradient(terms.logits), drafter.config.top_k)
    return index, vocab_ids(drafter, index)


def vocab_head(model: Any, lm_head: Array) -> Array:
    """The target head's columns over a drafter's vocabulary ``[H, V']`` (what its unary logits and the teacher
    read): a block drafter's ``draft_head`` (derived at load), else the columns of ``draft_ids`` (EAGLE-3), else
    the whole head."""
    params = model.params
    head = getattr(params, "draft_head", None)
    if head is not None:
        return head
    lm_head, ids = quant.dequantize(lm_head), getattr(params, "draft_ids", None)
    return lm_head if ids is None else jnp.take(lm_head, ids, axis=1)


def teacher_logits(terms: ObjectiveTerms) -> Array:
    """The target's next-token logits over the **drafter's vocabulary** ``[B, A, P, Vd]`` (``V`` without a
    draft vocabulary) for every predicted token (no gradient): the distribution of the token at position p is
    read at position p-1. With a draft vocabulary the target's logits are restricted to it (softmax then
    renormalises, EAGLE-3's reduced-vocabulary target): the drafter can only ever propose those tokens, and
    the teacher costs ``Vd/V`` of the full head (the teacher was about a third of a training step's work)."""
    b, a, p = terms.source.shape
    idx = jnp.maximum(terms.source - 1, 0).reshape(b, a * p)
    teacher_h = jnp.take_along_axis(terms.teacher_hidden, idx[..., None], axis=1).reshape(b, a, p, -1)
    logits = jnp.matmul(teacher_h, vocab_head(terms.drafter, terms.lm_head), preferred_element_type=jnp.float32)
    return jax.lax.stop_gradient(logits)


def teacher_probs(terms: ObjectiveTerms) -> Array:
    """``softmax(teacher_logits)``: the target's distribution ``[B, A, P, Vd]``."""
    return jax.nn.softmax(teacher_logits(terms), axis=-1)


def dspine_loss(terms: ObjectiveTerms) -> tuple[Array, dict[str, Array]]:
    """The DSpine objective: ``ce_weight·CE + (1-ce_weight)·L1`` to the target distribution, the
    last-write refinement loss over the detached top-K, and β-weighted cosine alignment (losses.py)."""
    drafter, fwd, lab, weights = terms.drafter, terms.fwd, terms.labels[..., 1:], terms.weights
    config, kind = drafter.config, drafter.kind
    teacher = teacher_probs(terms)  # [B, A, P, Vd]: indexed like the unary logits
    l1 = l1_terms(terms.logp, teacher, weights)
    index, cand = unary_candidates(terms)  # [B, A, P, K]
    refined = kind.refine(drafter, fwd.pre_injection[:, :, 1:], terms.labels[..., :-1])  # true predecessors
    scores = jnp.einsum(
        "baph,bapkh->bapk", refined, head_rows(terms.lm_head, cand), preferred_element_type=jnp.float32
    )
    ce_weight = config.ce_weight
    refinement, covered = refinement_terms(
        scores, index, draft_index(drafter, lab), teacher, weights, ce_weight, config.candidate_mass_threshold
    )
    codes_lab = jax.lax.stop_gradient(kind.code(drafter, lab))
    alignment = alignment_terms(fwd.layer_features[:, :, :, 1:], codes_lab, weights)
    alignment_scale = terms.beta * jax.lax.stop_gradient(terms.ce / terms.denominator)
    numerator = ce_weight * terms.ce + (1 - ce_weight) * l1 + refinement + alignment_scale * alignment
    metrics = dict(
        l1=l1 / terms.denominator,
        refinement=refinement / terms.denominator,
        alignment=alignment / terms.denominator,
        coverage=jnp.sum(covered & terms.supervised) / terms.count,
        beta=jnp.asarray(terms.beta, jnp.float32),
    )
    return numerator / terms.denominator, metrics


# DSpine's refinement defaults, for DFlash2's selector (which has no dspine_config of its own).
SELECTOR_CE_WEIGHT, SELECTOR_MASS_THRESHOLD = DSPINE_DEFAULTS["ce_weight"], DSPINE_DEFAULTS["candidate_mass_threshold"]


def dflash2_loss(terms: ObjectiveTerms) -> tuple[Array, dict[str, Array]]:
    """DFlash2: DFlash's block CE plus its selector trained like DSpine's last-write refinement (dflash==0.1.0
    ships no training code): over the **detached** unary top-C candidates of every slot, the selector's
    score given the **true** predecessor (teacher forcing; slot 1's is the anchor) gets ``0.1·CE`` on the
    labels the candidates cover ``+ 0.9·L1`` to the target's distribution renormalised on them
    (``refinement_terms`` with DSpine's default weights). Gradients reach the codebooks, the hidden
    projection and, through the unary scores and ``h``, the backbone."""
    drafter, fwd, lab, weights = terms.drafter, terms.fwd, terms.labels[..., 1:], terms.weights
    index, cand = unary_candidates(terms)  # [B, A, P, C]
    unary = jnp.take_along_axis(terms.logits, index, axis=-1)
    scores = drafter.kind.selector_scores(drafter, fwd.hidden[:, :, 1:], unary, cand, terms.labels[..., :-1, None])
    selector, covered = refinement_terms(
        scores[..., 0, :], index, draft_index(drafter, lab), teacher_probs(terms), weights, SELECTOR_CE_WEIGHT,
        SELECTOR_MASS_THRESHOLD,
    )
    metrics = dict(selector=selector / terms.denominator, coverage=jnp.sum(covered & terms.supervised) / terms.count)
    return (terms.ce + selector) / terms.denominator, metrics


CONFIDENCE_ALPHA = 1.0  # speculators' confidence_head_alpha: the weight of DSpark's confidence BCE


def dspark_heads(drafter: Drafter, hidden: Array, labels: Array, logits: Array) -> tuple[Array, Array | None]:
    """DSpark's heads in training (speculators ``DSparkDraftModel.forward``): every block position's Markov bias
    given the **true** previous token (teacher forcing; the walk feeds the token it drew), added to the unary
    logits, and the confidence head's logits. ``hidden [B, A, T, H]`` every block position's final-normed
    state, ``labels [B, A, P+1]``, ``logits [B, A, P, V']`` of the predicting positions → (biased logits,
    confidence logits ``[B, A, P]`` or None). Position k's previous token is the one at k with
    ``sample_from_anchor`` (position k predicts token k+1), else the one at k−1 (position 0's: the anchor)."""
    config, params = drafter.config, drafter.params
    first = first_slot(config)
    # [B, A, T]: the true token before each block position's prediction
    prev = labels[..., :-1] if first == 0 else jnp.concatenate([labels[..., :1], labels[..., :-1]], axis=-1)
    prev_emb = None
    if params.markov is not None:
        bias, prev_emb = dspark.teacher_forced_bias(drafter, hidden, prev)  # [B, A, T, V'], [B, A, T, R]
        logits = logits + bias[:, :, first:]
        prev_emb = prev_emb[:, :, first:]
    if params.confidence is None:
        return logits, None
    return logits, dspark.confidence_logit(drafter, hidden[:, :, first:], prev_emb)


def dspark_loss(terms: ObjectiveTerms) -> tuple[Array, dict[str, Array]]:
    """vLLM speculators' DSpark objective (``dspark/metrics.py``, its default ``kl_div``): ``KL(target ‖ draft)``
    of the Markov-biased logits (``dspark_heads``) + ``CONFIDENCE_ALPHA ·`` the confidence head's binary
    cross-entropy against each slot's analytical acceptance rate ``1 − TV(q, p)`` (detached), both
    position-decayed and averaged over the supervised slots, as speculators does."""
    teacher_logp = jax.nn.log_softmax(teacher_logits(terms), axis=-1)
    kl = jnp.sum(kl_divergence(terms.logp, teacher_logp) * terms.weights)
    accept = jax.lax.stop_gradient(acceptance(terms.logp, jnp.exp(teacher_logp)))  # [B, A, P]
    metrics = dict(kl=kl / terms.count, accept=jnp.sum(accept * terms.supervised) / terms.count)
    loss = kl
    if terms.aux is not None:
        bce = jnp.sum(optax.sigmoid_binary_cross_entropy(terms.aux, accept) * terms.weights)
        loss = loss + CONFIDENCE_ALPHA * bce
        error = jnp.abs(jax.nn.sigmoid(terms.aux) - accept) * terms.supervised
        metrics.update(confidence=bce / terms.count, confidence_error=jnp.sum(error) / terms.count)
    return loss / terms.count, metrics


# A sequential head kind's proposer class (its training forward is ``sequential_predict``).
SEQUENTIAL_HEADS: dict[str, type[SequentialHead]] = {eagle3.KIND: Eagle3Proposer, mtp.KIND: MTPProposer}
MTP_STEP_BETA = 0.6  # speculators' ``step_weight_beta``: MTP step k weighs β^k / Σ_j β^j (FastMTP, Eq. 2)


def sequential_predict(trainable, frozen, config, embed, lm_head, batch, anchors, keep, replace) -> Prediction:
    """A sequential head's training forward (EAGLE-3, MTP): a chain of ``config.speculative_tokens``
    test-time-training steps from every anchor (``eagle3.sequential_ttt_logits`` over the head's
    ``entry_features`` of the batch: EAGLE-3's fused taps, MTP's target final hidden; an anchor is an entry
    ≥ 1). Step s of the chain from p predicts token p+s+1, so the chains line up with blocks anchored at p."""
    proposer = SEQUENTIAL_HEADS[config.kind](params=join_params(trainable, frozen), config=config)
    steps = config.speculative_tokens
    features = proposer.entry_features(batch["teacher_hidden"], batch["tapped"])  # [B, S, H]
    logits = eagle3.sequential_ttt_logits(proposer, embed, lm_head, features, batch["tokens"], anchors, steps)
    labels, positions = block_ids(batch["tokens"], anchors, steps + 1)
    return Prediction(proposer, None, logits, labels, positions, keep & (anchors >= 1))


def step_means(values: Array, terms: ObjectiveTerms, weights: Array | None = None) -> Array:
    """``values [B, A, P]`` times ``weights`` (default the slot weights), averaged over each step's supervised
    chains → ``[P]`` (speculators' per-step reduction of its sequential heads' losses)."""
    weights = terms.weights if weights is None else weights
    return jnp.sum(values * weights, axis=(0, 1)) / jnp.maximum(jnp.sum(terms.supervised, axis=(0, 1)), 1)


def step_accuracy(terms: ObjectiveTerms) -> dict[str, Array]:
    """The top-1 accuracy of every step, ``acc_{s}``."""
    hits = jnp.argmax(terms.logits, axis=-1) == draft_index(terms.drafter, terms.labels[..., 1:])
    return {f"acc_{s}": x for s, x in enumerate(step_means(hits, terms, terms.supervised))}


def eagle3_loss(terms: ObjectiveTerms) -> tuple[Array, dict[str, Array]]:
    """vLLM speculators' EAGLE-3 objective (``eagle3/metrics.py``, its default ``kl_div``): per TTT step,
    ``KL(target ‖ draft)`` averaged over the step's supervised positions, summed over the steps with weight
    ``exp(−s/γ)`` (the slot weights: speculators' ``ttt_step_loss_decay`` d is γ = −1/ln d; d = 1, no decay, by
    default). Metrics: the KL and the top-1 accuracy of every step."""
    teacher_logp = jax.nn.log_softmax(teacher_logits(terms), axis=-1)
    kl = kl_divergence(terms.logp, teacher_logp)  # [B, A, P]
    loss = jnp.sum(step_means(kl, terms))
    return loss, dict(kl=jnp.sum(kl * terms.weights) / terms.denominator, **step_accuracy(terms))


def mtp_loss(terms: ObjectiveTerms) -> tuple[Array, dict[str, Array]]:
    """vLLM speculators' MTP objective (``MTPDraftModel.forward`` with its trainer's step weights): per step,
    the cross-entropy of the true next token averaged over the step's supervised positions, summed over the
    steps with the normalised weights ``exp(−s/γ) / Σ_j exp(−j/γ)`` — speculators' default is
    ``compute_step_weights(β = 0.6)``, β^s / Σ β^j, i.e. γ = −1/ln β (the kind's reference γ); uniform 1/P with
    γ = 0. Metrics: every step's CE and top-1 accuracy."""
    index = jnp.maximum(draft_index(terms.drafter, terms.labels[..., 1:]), 0)
    ce = -jnp.take_along_axis(terms.logp, index[..., None], axis=-1)[..., 0]  # [B, A, P]
    per_step = step_means(ce, terms)  # [P], decay-weighted
    loss = jnp.sum(per_step) / jnp.sum(terms.decay)
    metrics = {f"ce_{s}": x for s, x in enumerate(step_means(ce, terms, terms.supervised))}
    return loss, dict(**metrics, **step_accuracy(terms))


# Per kind class; a kind without an entry trains as its nearest registered base (a DFlash variant as DFlash).
KIND_TRAINING: dict[type, KindTraining] = {
    DFlash: KindTraining(reference_gamma=None),
    DSpine: KindTraining(reference_gamma=7.0, schedule=dspine_schedule, loss=dspine_loss),
    DFlash2: KindTraining(reference_gamma=None, loss=dflash2_loss),
    DSpark: KindTraining(reference_gamma=4.0, loss=dspark_loss, heads=dspark_heads),
}
# Proposers that are not block drafter kinds, by name.
PROPOSER_TRAINING: dict[str, KindTraining] = {
    eagle3.KIND: KindTraining(reference_gamma=None, loss=eagle3_loss, predict=sequential_predict),
    mtp.KIND: KindTraining(reference_gamma=-1.0 / math.log(MTP_STEP_BETA), loss=mtp_loss, predict=sequential_predict),
}


def kind_training(kind: str) -> KindTraining:
    """The training recipe of ``kind``: a proposer's (EAGLE-3) or the registered drafter kind's (walks its class
    hierarchy)."""
    if kind in PROPOSER_TRAINING:
        return PROPOSER_TRAINING[kind]
    for cls in type(drafter_kind(kind)).__mro__:
        if cls in KIND_TRAINING:
            return KIND_TRAINING[cls]
    raise ValueError(f"drafter kind {kind!r} has no training recipe; register one in KIND_TRAINING")


def loss_decay_gamma(kind: str, gamma: float | None) -> float | None:
    """The γ the objective applies for a ``kind`` drafter given ``TrainConfig.gamma`` (None = no decay)."""
    if gamma is None:
        return kind_training(kind).reference_gamma
    return float(gamma) if gamma > 0 else None


def training_drafter_config(config: DrafterConfig, cfg: TrainConfig) -> DrafterConfig:
    """The drafter config with the training knobs ``cfg`` overrides, so the export records what was used."""
    if kind_training(config.kind).schedule is not None and cfg.alignment_warmup_steps is not None:
        return with_dspine_settings(config, alignment_warmup_steps=int(cfg.alignment_warmup_steps))
    return config


@dataclasses.dataclass
class Batch:
    """One training batch (host arrays).

    tokens [B, S] int32; loss_mask [B, S] bool (response tokens); tapped [n, B, S, H] target features;
    teacher_hidden [B, S, H] the target's final-normed hidden (teacher logits = ``teacher_hidden @ head``)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    tapped: np.ndarray
    teacher_hidden: np.ndarray


def sample_anchors(key: Array, loss_mask: Array, num_anchors: int) -> tuple[Array, Array]:
    """SpecForge ``_sample_anchor_positions``: up to ``num_anchors`` distinct positions per row whose
    token and next token are both supervised, sorted; ``keep`` flags the real ones (rest are 0)."""
    b, s = loss_mask.shape
    valid = loss_mask[:, :-1] & loss_mask[:, 1:]  # [B, S-1]
    width = min(num_anchors, s - 1)
    r = jnp.where(valid, jax.random.uniform(key, valid.shape), 2.0)
    cand = jnp.argsort(r, axis=1)[:, :width]
    counts = valid.sum(axis=1)
    keep = jnp.arange(width)[None, :] < jnp.minimum(counts, width)[:, None]
    sentinel = s - 1
    anchors = jnp.sort(jnp.where(keep, cand, sentinel), axis=1)
    keep = anchors < sentinel
    return jnp.where(keep, anchors, 0).astype(jnp.int32), keep


def first_slot(config: Any) -> int:
    """The block position of a block drafter's first prediction: 0 when the anchor's own position predicts
    (DSpark's ``sample_from_anchor``: position k predicts token k+1, T predictions per block), else 1
    (position k ≥ 1 predicts token k, T−1 predictions)."""
    return 0 if getattr(config, "sample_from_anchor", False) else 1


def block_predict(trainable, frozen, config, embed, lm_head, batch, anchors, keep, replace) -> Prediction:
    """A block drafter's training forward (``train_forward``, the kind's own ``forward_blocks``): the unary
    logits of every predicting block position through the (draft) head, plus what the kind's ``heads`` add."""
    drafter = Drafter(params=join_params(trainable, frozen), config=config)
    first = first_slot(config)
    fwd = train_forward(drafter, embed, batch["tapped"], batch["tokens"], anchors, replace)
    labels, positions = block_ids(batch["tokens"], anchors, config.block_size + 1 - first)  # [B, A, P+1]
    logits = jnp.matmul(fwd.hidden[:, :, first:], vocab_head(drafter, lm_head), preferred_element_type=jnp.float32)
    heads, aux = kind_training(config.kind).heads, None
    if heads is not None:
        logits, aux = heads(drafter, fwd.hidden, labels, logits)
    return Prediction(drafter, fwd, logits, labels, positions, keep, aux)


def predict(trainable, frozen, config, embed, lm_head, batch, anchors, keep, replace=None) -> Prediction:
    """The kind's training forward (``KindTraining.predict``, default ``block_predict``); ``lm_head`` as a matrix."""
    fn = kind_training(config.kind).predict or block_predict
    return fn(trainable, frozen, config, embed, quant.dequantize(lm_head), batch, anchors, keep, replace)


def objective(
    trainable,
    frozen: dict[str, Any],
    config,
    embed: Array,
    lm_head: Array,
    batch: dict[str, Array],
    anchors: Array,
    keep: Array,
    replace: Array | None,
    beta: Array,
    gamma: float | None,
) -> tuple[Array, dict[str, Array]]:
    """Loss and metrics for one batch (the kind's objective over its ``predict``ions); ``gamma`` is the
    resolved position decay (``loss_decay_gamma``; None = none)."""
    lm_head = quant.dequantize(lm_head)  # a packed (or int8) head as its matrix
    pred = predict(trainable, frozen, config, embed, lm_head, batch, anchors, keep, replace)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    s = tokens.shape[1]
    lab = pred.labels[..., 1:]
    pos = pred.positions[..., 1:]
    safe = jnp.minimum(pos, s - 1)
    in_mask = jnp.take_along_axis(mask[:, None, :], safe, axis=2)
    index = draft_index(pred.model, lab)  # [B, A, P]; a label the drafter cannot propose ends its chain's supervision
    supervised = (pos < s) & pred.keep[..., None] & in_mask & (index >= 0)  # [B, A, P]
    weights = slot_weights(supervised, gamma)
    supervised = slot_weights(supervised, None) > 0  # metrics count the slots the loss weighs (cumulative mask)
    decay = slot_weights(jnp.ones(supervised.shape[-1:], bool), gamma)  # [P]
    denominator = jnp.maximum(weights.sum(), 1e-6)
    count = jnp.maximum(supervised.sum(), 1)
    logits = pred.logits  # [B, A, P, V] (or Vd)
    index = jnp.maximum(index, 0)
    ce, logp = ce_terms(logits, index, weights)
    correct = jnp.sum((jnp.argmax(logits, -1) == index) & supervised)
    metrics = {"ce": ce / denominator, "acc": correct / count}
    extra_loss = kind_training(config.kind).loss
    if extra_loss is None:
        metrics["loss"] = ce / denominator
        return ce / denominator, metrics
    terms = ObjectiveTerms(
        pred.model, pred.fwd, pred.labels, safe, logits, logp, ce, weights, supervised, count, denominator, beta,
        batch["teacher_hidden"], lm_head, pred.aux, decay,
    )  # fmt: skip
    loss, extra = extra_loss(terms)
    metrics.update(loss=loss, **extra)
    return loss, metrics


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    warmup = max(1, int(round(cfg.warmup_ratio * cfg.steps)))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay),
    )


# Derived from the target at load, never trained: DSpine's codes, a draft vocabulary, EAGLE-3's head and embedding.
FROZEN = ("transfer_codes", "draft_ids", "draft_head", "lm_head", "embed")


def split_params(drafter: Drafter | SequentialHead) -> tuple[Any, dict[str, Any]]:
    """(trainable params without the frozen parts, the frozen parts ``{name: array or None}``): those of
    ``FROZEN`` the kind's params class has (``transfer_codes`` only DSpine's, ``lm_head`` only EAGLE-3's)."""
    params = drafter.params
    frozen = {name: getattr(params, name) for name in FROZEN if name in params.__dataclass_fields__}
    return params.replace(**dict.fromkeys(frozen)), frozen


def join_params(trainable: Any, frozen: dict[str, Any]) -> Any:
    """``split_params``' inverse."""
    return trainable.replace(**frozen)


def _global_norm(tree) -> Array:
    tree_norm = getattr(getattr(optax, "tree", None), "norm", None)
    return tree_norm(tree) if tree_norm is not None else optax.global_norm(tree)


def make_step(config, cfg: TrainConfig, optimizer: optax.GradientTransformation):
    """The jitted train step ``(trainable, opt_state, frozen, embed, lm_head, batch, step) →
    (trainable, opt_state, metrics)``; randomness from ``fold_in(key(seed), step)``. The DSpine schedule
    reads ``training_drafter_config(config, cfg)``: the settings the exported config records."""
    config = training_drafter_config(config, cfg)
    schedule = kind_training(config.kind).schedule
    settings = config.dspine_settings if schedule is not None else {}
    gamma = loss_decay_gamma(config.kind, cfg.gamma)

    def step_fn(trainable, opt_state, frozen, embed, lm_head, batch, step):
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step)
        k_anchor, k_replace = jax.random.split(key)
        anchors, keep = sample_anchors(k_anchor, batch["loss_mask"], cfg.anchors)
        replace, beta = None, jnp.float32(0.0)
        if schedule is not None:
            beta, probability = schedule(step, cfg.steps, settings)
            replace = (jax.random.uniform(k_replace, anchors.shape) < probability) & keep
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(
            trainable, frozen, config, embed, lm_head, batch, anchors, keep, replace, beta, gamma
        )
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        metrics["grad_norm"] = _global_norm(grads)
        return trainable, opt_state, metrics

    return jax.jit(step_fn, donate_argnums=(0, 1))


def eval_loss(config, cfg: TrainConfig, trainable, frozen, embed, lm_head, batch, step: int = 0):
    """Objective without an update (no replacement), for tests and held-out loss."""
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), step)
    anchors, keep = sample_anchors(jax.random.split(key)[0], batch["loss_mask"], cfg.anchors)
    gamma = loss_decay_gamma(config.kind, cfg.gamma)
    return objective(trainable, frozen, config, embed, lm_head, batch, anchors, keep, None, jnp.float32(0.0), gamma)


class Dataset:
    """Fixed-length training rows plus their target features (any array-like supporting fancy
    indexing, e.g. a ``np.memmap``): ``features [N, S, n+1, H]`` — the n taps then the final hidden."""

    def __init__(self, tokens: np.ndarray, loss_mask: np.ndarray, features) -> None:
        self.tokens, self.loss_mask, self.features = tokens, loss_mask, features

    def __len__(self) -> int:
        return len(self.tokens)

    def indices(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        n = len(self)
        out = []
        pos = step * batch_size
        while len(out) < batch_size:
            epoch, offset = divmod(pos, n)
            perm = np.random.default_rng([seed, epoch]).permutation(n)
            take = min(batch_size - len(out), n - offset)
            out.extend(perm[offset : offset + take].tolist())
            pos += take
        return np.asarray(out)

    def batch(self, step: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        idx = self.indices(step, batch_size, seed)
        order = np.argsort(idx)  # memmaps read faster in order
        feats = np.asarray(self.features[np.sort(idx)], dtype=np.float32)[np.argsort(order)]
        return {
            "tokens": np.asarray(self.tokens[idx], np.int32),
            "loss_mask": np.asarray(self.loss_mask[idx], bool),
            "tapped": np.ascontiguousarray(np.moveaxis(feats[:, :, :-1], 2, 0)),
            "teacher_hidden": np.ascontiguousarray(feats[:, :, -1]),
        }


def _checkpoint_manager(out: Path, cfg: TrainConfig):

    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, create=True)
    return ocp.CheckpointManager((out / "checkpoints").absolute(), options=options)


def restore_state(out: Path, cfg: TrainConfig, state: dict, step: int | None = None) -> tuple[dict, int]:
    """Restore ``state`` (trainable, opt_state) from the latest (or given) orbax checkpoint."""

    mngr = _checkpoint_manager(out, cfg)
    step = mngr.latest_step() if step is None else step
    if step is None:
        mngr.close()
        return state, 0
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    mngr.close()
    return restored, int(step)


def train(
    drafter: Drafter | SequentialHead,
    embed: Array,
    lm_head: Array,
    dataset: Dataset,
    cfg: TrainConfig,
    out: str | Path,
    resume: bool = False,
    stop_at: int | None = None,
    eval_fn: Callable[[Drafter | SequentialHead, int], dict[str, float]] | None = None,
    progress: bool = True,
) -> tuple[Drafter | SequentialHead, list[dict[str, float]]]:
    """Train ``drafter`` (a block drafter or a sequential head: EAGLE-3, MTP) for ``cfg.steps`` (or until ``stop_at``),
    checkpointing every ``cfg.checkpoint_every`` steps and at the end. Returns the trained drafter and per-step metrics
    (also appended to ``out/metrics.jsonl``)."""

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = training_drafter_config(drafter.config, cfg)  # the returned (exported) drafter records cfg's knobs
    optimizer = make_optimizer(cfg)
    trainable, frozen = split_params(drafter)
    state = {"params": trainable, "opt_state": optimizer.init(trainable)}
    start = 0
    if resume:
        state, start = restore_state(out, cfg, state)
    step_fn = make_step(config, cfg, optimizer)
    mngr = _checkpoint_manager(out, cfg)
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    history: list[dict[str, float]] = []
    log_path = out / "metrics.jsonl"
    # Fresh buffers: init_drafter may share one array between layers (identical readouts), and the
    # jitted step donates its inputs.
    trainable, opt_state = jax.tree.map(jnp.copy, (state["params"], state["opt_state"]))
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, disable=not progress, dynamic_ncols=True)
    t_last = time.perf_counter()
    for step in bar:
        batch = dataset.batch(step, cfg.batch_size, cfg.seed)
        trainable, opt_state, metrics = step_fn(trainable, opt_state, frozen, embed, lm_head, batch, jnp.int32(step))
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        metrics.update(step=step + 1, step_time=now - t_last)
        t_last = now
        if not all(math.isfinite(v) for v in metrics.values()):
            raise FloatingPointError(f"non-finite metrics at step {step + 1}: {metrics}")
        history.append(metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc']:.3f}", s=f"{metrics['step_time']:.2f}")
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == end:
            mngr.save(done, args=ocp.args.StandardSave({"params": trainable, "opt_state": opt_state}))
        if eval_fn is not None and cfg.eval_every and done % cfg.eval_every == 0:
            metrics.update(eval_fn(drafter.replace(params=join_params(trainable, frozen), config=config), done))
            bar.write(f"step {done}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith("tau")))
        if done % cfg.log_every == 0 or done == end:
            with log_path.open("a") as f:
                f.write(json.dumps(metrics) + "\n")
    mngr.wait_until_finished()
    mngr.close()
    return drafter.replace(params=join_params(trainable, frozen), config=config), history
