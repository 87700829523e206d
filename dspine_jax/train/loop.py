"""The training loop: objective, jitted step, AdamW + cosine schedule, orbax checkpoints, exact resume.

Exact resume: everything random is a pure function of ``(seed, step)`` — the batch order is a
per-epoch permutation seeded by ``(seed, epoch)``, anchors / replacement flags use
``fold_in(key(seed), step)`` — and the checkpoint holds the trainable params, the optimiser state and
the step. So a run restored at step ``k`` computes bit-for-bit the same step ``k+1`` as an
uninterrupted run.

The frozen parts (target embedding, LM head, DSpine transfer codes, a draft vocabulary's ids and head
columns: ``FROZEN``) are not trained and not checkpointed: they come from the target (codes are rebuilt
deterministically by ``init_drafter``, the draft vocabulary by the run's ``--draft-vocab``).
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

from dspine_jax.drafters.config import DrafterConfig, drafter_kind
from dspine_jax.drafters.dflash2 import DFlash2
from dspine_jax.drafters.drafter import DFlash, vocab_ids
from dspine_jax.drafters.dspine import DSPINE_DEFAULTS, DSpine, head_rows, with_dspine_settings
from dspine_jax.drafters.params import Drafter
from dspine_jax.models import quant
from dspine_jax.train.losses import (
    alignment_terms,
    ce_terms,
    dspine_schedule,
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
    """What a drafter kind trains with beyond the block cross-entropy every kind shares.

    ``reference_gamma``: the position decay γ of the reference recipe (SpecForge: OnlineDSpineModel sets 7
    when unset; the DFlash objective's ``loss_decay_gamma`` defaults to None, no decay). ``schedule(step,
    total, settings) → (β, replacement probability)`` and ``loss(terms) → (numerator, metrics)`` are the
    kind's extra objective (None: the CE alone)."""

    reference_gamma: float | None = None
    schedule: Callable[[Array, int, dict], tuple[Array, Array]] | None = None
    loss: Callable[[ObjectiveTerms], tuple[Array, dict[str, Array]]] | None = None


class ObjectiveTerms(NamedTuple):
    """What a kind's extra loss reads: the forward, the block CE terms and the batch."""

    drafter: Drafter
    fwd: TrainForward
    labels: Array  # [B, A, T] real tokens of each block
    source: Array  # [B, A, P] positions (clamped) of the supervised slots 1..T-1
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


def draft_index(drafter: Drafter, tokens: Array) -> Array:
    """Token ids → their index in the drafter's vocabulary (``unary_logits``' last axis), -1 outside it."""
    ids = drafter.params.draft_ids
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


def teacher_probs(terms: ObjectiveTerms) -> Array:
    """The target's next-token distribution over the **drafter's vocabulary** ``[B, A, P, Vd]`` (``V`` without a
    draft vocabulary) for every supervised slot (no gradient): the distribution of the token at position p is
    read at position p-1. With a draft vocabulary the target's logits are restricted to it and renormalised
    (EAGLE-3's reduced-vocabulary target): the drafter can only ever propose those tokens, and the teacher
    costs ``Vd/V`` of the full head (the teacher was about a third of a training step's work)."""
    b, a, p = terms.source.shape
    idx = jnp.maximum(terms.source - 1, 0).reshape(b, a * p)
    teacher_h = jnp.take_along_axis(terms.teacher_hidden, idx[..., None], axis=1).reshape(b, a, p, -1)
    head = terms.drafter.params.draft_head
    logits = jnp.matmul(teacher_h, quant.dequantize(terms.lm_head) if head is None else head,
                        preferred_element_type=jnp.float32)  # fmt: skip
    return jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1))


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
    return numerator, metrics


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
    return terms.ce + selector, metrics


# Per kind class; a kind without an entry trains as its nearest registered base (a DFlash variant as DFlash).
KIND_TRAINING: dict[type, KindTraining] = {
    DFlash: KindTraining(reference_gamma=None),
    DSpine: KindTraining(reference_gamma=7.0, schedule=dspine_schedule, loss=dspine_loss),
    DFlash2: KindTraining(reference_gamma=None, loss=dflash2_loss),
}


def kind_training(kind: str) -> KindTraining:
    """The training recipe of the registered drafter kind ``kind`` (walks its class hierarchy)."""
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
    """Loss and metrics for one batch (the DFlash CE or the full DSpine objective); ``gamma`` is the
    resolved position decay (``loss_decay_gamma``; None = none)."""
    drafter = Drafter(params=join_params(trainable, frozen), config=config)
    lm_head = quant.dequantize(lm_head)  # a packed (or int8) head as its matrix
    tokens, mask = batch["tokens"], batch["loss_mask"]
    s = tokens.shape[1]
    t = config.block_size
    fwd = train_forward(drafter, embed, batch["tapped"], tokens, anchors, replace)
    labels, positions = block_ids(tokens, anchors, t)  # [B, A, T]
    lab = labels[..., 1:]
    pos = positions[..., 1:]
    safe = jnp.minimum(pos, s - 1)
    in_mask = jnp.take_along_axis(mask[:, None, :], safe, axis=2)
    index = draft_index(drafter, lab)  # [B, A, P]; a label the drafter cannot propose ends its block's supervision
    supervised = (pos < s) & keep[..., None] & in_mask & (index >= 0)  # [B, A, P]
    weights = slot_weights(supervised, gamma)
    supervised = slot_weights(supervised, None) > 0  # metrics count the slots the loss weighs (cumulative mask)
    denominator = jnp.maximum(weights.sum(), 1e-6)
    count = jnp.maximum(supervised.sum(), 1)
    hidden = fwd.hidden[:, :, 1:]
    head = lm_head if drafter.params.draft_head is None else drafter.params.draft_head
    logits = jnp.matmul(hidden, head, preferred_element_type=jnp.float32)  # [B, A, P, V] (or Vd)
    index = jnp.maximum(index, 0)
    ce, logp = ce_terms(logits, index, weights)
    correct = jnp.sum((jnp.argmax(logits, -1) == index) & supervised)
    metrics = {"ce": ce / denominator, "acc": correct / count}
    extra_loss = kind_training(config.kind).loss
    if extra_loss is None:
        metrics["loss"] = ce / denominator
        return ce / denominator, metrics
    terms = ObjectiveTerms(
        drafter, fwd, labels, safe, logits, logp, ce, weights, supervised, count, denominator, beta,
        batch["teacher_hidden"], lm_head,
    )  # fmt: skip
    numerator, extra = extra_loss(terms)
    loss = numerator / denominator
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


FROZEN = ("transfer_codes", "draft_ids", "draft_head")  # derived from the target at load: never trained


def split_params(drafter: Drafter) -> tuple[Any, dict[str, Any]]:
    """(trainable params without the frozen parts, the frozen parts ``{name: array or None}``): those of
    ``FROZEN`` the kind's params class has (``transfer_codes`` only DSpine's)."""
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
    drafter: Drafter,
    embed: Array,
    lm_head: Array,
    dataset: Dataset,
    cfg: TrainConfig,
    out: str | Path,
    resume: bool = False,
    stop_at: int | None = None,
    eval_fn: Callable[[Drafter, int], dict[str, float]] | None = None,
    progress: bool = True,
) -> tuple[Drafter, list[dict[str, float]]]:
    """Train ``drafter`` for ``cfg.steps`` (or until ``stop_at``), checkpointing every
    ``cfg.checkpoint_every`` steps and at the end. Returns the trained drafter and per-step metrics
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
            metrics.update(eval_fn(Drafter(params=join_params(trainable, frozen), config=config), done))
            bar.write(f"step {done}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith("tau")))
        if done % cfg.log_every == 0 or done == end:
            with log_path.open("a") as f:
                f.write(json.dumps(metrics) + "\n")
    mngr.wait_until_finished()
    mngr.close()
    return Drafter(params=join_params(trainable, frozen), config=config), history
