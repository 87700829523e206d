"""Draft vocabularies (EAGLE-3's reduced drafter head, ``train/vocab.py``): the drafter proposes only Vd of
the target's tokens and its unary logits read only those columns of the head.

* The restricted decode equals the full-vocabulary decode with every other token masked out: the same
  candidates in the same order (DSpine, DFlash2), the same draft distribution q (DFlash at T = 1).
* Greedy speculative output still equals AR output; every proposal lies in the vocabulary.
* Checkpoints carry it in EAGLE-3's spelling (``draft_vocab_size``, ``d2t`` offsets, ``t2d`` mask) and
  malformed ones are refused by name.
* Training: the CE is over the restricted head, labels outside the vocabulary end their block's
  supervision; a tiny run learns and never moves the frozen ids / head columns.
* ``frequent_tokens``: counts, ties, fill.
Lossless sampling with a draft vocabulary is one of test_speculative_sampling.py's χ² cases."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import append, tapped_features, with_random_injection
from safetensors.numpy import load_file, save_file

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters import drafter as D
from dspine_jax.drafters import params as params_mod
from dspine_jax.drafters.io import init_drafter, load_drafter, save_drafter, with_draft_vocab
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import load_target
from dspine_jax.models.weights import CheckpointError
from dspine_jax.train.data import target_features
from dspine_jax.train.loop import Dataset, TrainConfig, eval_loss, split_params, train
from dspine_jax.train.losses import slot_weights
from dspine_jax.train.model import block_ids, train_forward
from dspine_jax.train.vocab import coverage, frequent_tokens

BLOCK = 4
PROMPTS = [np.random.default_rng(i).integers(3, 128, n).tolist() for i, n in enumerate([5, 9, 4])]


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_target(tiny_models["llama"][0])


def vocab_ids(seed: int = 0, size: int = 64) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(np.arange(128), size, replace=False))


def make_drafter(target, kind: str, ids: np.ndarray | None = None) -> params_mod.Drafter:
    drafter = init_drafter(target, kind, num_layers=1, block_size=BLOCK, top_k=8, seed=3, initializer_range=0.2)
    if kind == "dspine":
        drafter = with_random_injection(drafter, seed=7, scale=2.0)
    return drafter if ids is None else with_draft_vocab(drafter, target, ids)


def context(target, drafter, prompt):
    tapped = tapped_features(target, [prompt], drafter.config.target_layer_ids)
    cache = append(drafter, init_draft_cache(drafter, 1, 32), tapped, jnp.array([len(prompt)]))
    return cache, jnp.array([prompt[-1]], jnp.int32)


@pytest.mark.parametrize("kind", ["dspine", "dflash2"])
def test_restricted_candidates_are_the_masked_full_vocabulary_top_k(target, kind):
    ids = vocab_ids()
    full = make_drafter(target, kind)
    restricted = with_draft_vocab(full, target, ids)
    cache, anchor = context(target, full, PROMPTS[1])
    fwd = D.forward(full, target, cache, D.block_tokens(full, anchor))
    logits = D.unary_logits(full, target, fwd.hidden[:, 1:])  # [1, P, V]
    masked = jnp.where(jnp.isin(jnp.arange(128), jnp.asarray(ids)), logits, -jnp.inf)
    _, expected = jax.lax.top_k(masked, 8)
    got = restricted.kind.candidates(restricted, target, fwd, anchor).cand_ids
    assert np.array_equal(np.asarray(got), np.asarray(expected))
    # The restriction really changes the candidates (some of the full top-8 lie outside the vocabulary).
    assert not np.array_equal(np.asarray(got), np.asarray(jax.lax.top_k(logits, 8)[1]))
    out = D.draft(restricted, target, cache, anchor, jax.random.split(jax.random.key(0), 1), Sampling.rows(1))
    assert np.isin(np.asarray(out.tokens), ids).all()


def test_dflash_draft_distribution_is_the_softmax_over_the_vocabulary(target):
    ids = vocab_ids(1)
    full = make_drafter(target, "dflash")
    restricted = with_draft_vocab(full, target, ids)
    cache, anchor = context(target, full, PROMPTS[0])
    fwd = D.forward(full, target, cache, D.block_tokens(full, anchor))
    logits = D.unary_logits(full, target, fwd.hidden[:, 1:])
    expected = jax.nn.softmax(jnp.where(jnp.isin(jnp.arange(128), jnp.asarray(ids)), logits, -jnp.inf), axis=-1)
    sampling = Sampling.rows(1, temperature=1.0)
    out = D.draft(restricted, target, cache, anchor, jax.random.split(jax.random.key(1), 1), sampling)
    np.testing.assert_allclose(np.asarray(D.q_full(out, 128)), np.asarray(expected), rtol=1e-5, atol=1e-7)
    assert out.q.shape[-1] == len(ids) and np.isin(np.asarray(out.tokens), ids).all()


@pytest.mark.parametrize("kind", ["dspine", "dflash", "dflash2"])
def test_greedy_speculative_with_a_draft_vocab_matches_generate(target, kind):
    reference = generate(target, PROMPTS, 20, stop_ids=[]).token_ids
    # The vocabulary holds half of what the target emits, so some proposals can be right and some tokens
    # can never be proposed.
    emitted = np.unique(np.concatenate(reference))
    ids = np.union1d(emitted[::2], vocab_ids(2, 40))
    drafter = make_drafter(target, kind, ids)
    result = speculative_generate(target, drafter, PROMPTS, 20, stop_ids=[], verify=BLOCK)
    assert result.token_ids == reference


def test_checkpoint_round_trip_in_eagle3_layout(target, tmp_path):
    ids = vocab_ids(3)
    drafter = make_drafter(target, "dspine", ids)
    save_drafter(drafter, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert cfg["draft_vocab_size"] == len(ids)
    assert np.array_equal(np.arange(len(ids)) + tensors["d2t"], ids)  # EAGLE-3: target id = i + d2t[i]
    assert np.array_equal(np.flatnonzero(tensors["t2d"]), ids)
    loaded = load_drafter(tmp_path / "d", target)
    assert np.array_equal(np.asarray(loaded.params.draft_ids), ids) and loaded.config.draft_vocab_size == len(ids)
    np.testing.assert_array_equal(np.asarray(loaded.params.draft_head), np.asarray(target.params.lm_head)[:, ids])
    # Removing the vocabulary again: a plain checkpoint without the tensors or the key.
    save_drafter(with_draft_vocab(loaded, target, None), tmp_path / "plain")
    assert "draft_vocab_size" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "d2t" not in load_file(str(tmp_path / "plain" / "model.safetensors"))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.update(d2t=t["d2t"][::-1].copy()), "distinct, ascending"),  # ids out of order / out of range
        (lambda t: t.update(t2d=np.roll(t["t2d"], 1)), "different draft vocabularies"),
        (lambda t: t.pop("d2t"), "missing tensor 'd2t'"),
    ],
)
def test_malformed_draft_vocab_is_refused(target, tmp_path, edit, message):
    save_drafter(make_drafter(target, "dflash", vocab_ids(4)), tmp_path / "d")
    path = tmp_path / "d" / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=message):
        load_drafter(tmp_path / "d", target)


def test_a_vocabulary_smaller_than_the_candidates_is_refused(target):
    with pytest.raises(ValueError, match="smaller than the drafter's 8 candidates"):
        make_drafter(target, "dspine", np.arange(5))


def test_training_ce_is_over_the_restricted_head(target):
    ids = vocab_ids(5)
    drafter = make_drafter(target, "dflash", ids)
    rng = np.random.default_rng(6)
    tokens = rng.integers(3, 128, (2, 16)).astype(np.int32)
    feats = target_features(target, tokens, drafter.config.target_layer_ids)
    batch = {
        "tokens": jnp.asarray(tokens), "loss_mask": jnp.ones((2, 16), bool),
        "tapped": jnp.moveaxis(jnp.asarray(feats[:, :, :-1]), 2, 0), "teacher_hidden": jnp.asarray(feats[:, :, -1]),
    }  # fmt: skip
    cfg = TrainConfig(anchors=3)
    loss, metrics = eval_loss(drafter.config, cfg, *split_params(drafter), target.params.embed, target.params.lm_head, batch)
    # By hand: the anchors eval_loss draws, the restricted head, the cumulative mask cut at the first label
    # outside the vocabulary.
    from dspine_jax.train.loop import sample_anchors

    anchors, keep = sample_anchors(jax.random.split(jax.random.fold_in(jax.random.PRNGKey(0), 0))[0], batch["loss_mask"], 3)
    fwd = train_forward(drafter, target.params.embed, batch["tapped"], batch["tokens"], anchors)
    labels, positions = block_ids(batch["tokens"], anchors, BLOCK)
    lab, pos = np.asarray(labels[..., 1:]), np.asarray(positions[..., 1:])
    inside = np.isin(lab, ids)
    assert 0 < inside.mean() < 1
    weights = np.asarray(slot_weights(jnp.asarray((pos < 16) & np.asarray(keep)[..., None] & inside), None))
    logits = np.asarray(fwd.hidden[:, :, 1:], np.float64) @ np.asarray(target.params.lm_head, np.float64)[:, ids]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    index = np.searchsorted(ids, lab)
    ce = -np.take_along_axis(logp, np.minimum(index, len(ids) - 1)[..., None], -1)[..., 0]
    assert float(loss) == pytest.approx(float((ce * weights).sum() / weights.sum()), rel=1e-4)


@pytest.mark.parametrize("restricted", [True, False])
def test_teacher_is_the_target_renormalised_over_the_draft_vocabulary(target, restricted):
    """The L1 / refinement teacher of a draft-vocabulary drafter is the target's distribution restricted to the
    vocabulary and renormalised (EAGLE-3's reduced-vocabulary target), indexed like the unary logits; without
    a vocabulary it is the full softmax. Checked against the full-vocabulary softmax in float64."""
    from types import SimpleNamespace

    from dspine_jax.train.loop import teacher_probs

    ids = vocab_ids(8)
    drafter = make_drafter(target, "dspine", ids if restricted else None)
    rng = np.random.default_rng(9)
    hidden = rng.standard_normal((1, 12, target.config.hidden_size)).astype(np.float32)
    source = jnp.asarray(rng.integers(1, 12, (1, 2, 3)), jnp.int32)  # [B, A, P] slot positions
    terms = SimpleNamespace(drafter=drafter, source=source, teacher_hidden=jnp.asarray(hidden), lm_head=target.params.lm_head)
    got = np.asarray(teacher_probs(terms), np.float64)
    logits = hidden[0].astype(np.float64) @ np.asarray(target.params.lm_head, np.float64)  # [S, V]
    full = np.exp(logits - logits.max(-1, keepdims=True))
    full /= full.sum(-1, keepdims=True)
    want = full[np.asarray(source)[0] - 1]  # the token at p is predicted at p - 1
    if restricted:
        want = want[..., ids] / want[..., ids].sum(-1, keepdims=True)
    assert got.shape == (1, 2, 3, len(ids) if restricted else target.config.vocab_size)
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspine"])  # the objective with the most vocabulary mapping (refinement over ids)
def test_tiny_training_with_a_draft_vocab(target, tmp_path, kind):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, 6).tolist() for _ in range(8)]
    responses = generate(target, prompts, max_new_tokens=18, stop_ids=[]).token_ids
    ids = frequent_tokens(responses, 24, 128)
    assert coverage(responses, ids) > 0.6
    drafter = init_drafter(target, kind, num_layers=2, intermediate_size=48, transfer_rank=8 if kind == "dspine" else None,
                           message_size=6 if kind == "dspine" else None, top_k=4, block_size=BLOCK, seed=0)  # fmt: skip
    drafter = with_draft_vocab(drafter, target, ids)
    seqs = np.asarray([p + r for p, r in zip(prompts, responses)], np.int32)
    mask = np.zeros_like(seqs, bool)
    mask[:, 6:] = True
    data = Dataset(seqs, mask, target_features(target, seqs, drafter.config.target_layer_ids).astype(np.float16))
    cfg = TrainConfig(steps=50, batch_size=4, anchors=4, lr=3e-3, checkpoint_every=40, alignment_warmup_steps=10)
    full = data.batch(0, 8, 0)
    before, _ = eval_loss(drafter.config, cfg, *split_params(drafter), target.params.embed, target.params.lm_head, full)
    trained, history = train(drafter, target.params.embed, target.params.lm_head, data, cfg, tmp_path, progress=False)
    after, m = eval_loss(trained.config, cfg, *split_params(trained), target.params.embed, target.params.lm_head, full)
    assert all(math.isfinite(h["loss"]) for h in history)
    assert float(after) < 0.7 * float(before) and float(m["acc"]) > 0.3, (float(before), float(after))
    assert np.array_equal(np.asarray(trained.params.draft_ids), ids)
    np.testing.assert_array_equal(np.asarray(trained.params.draft_head), np.asarray(drafter.params.draft_head))


def test_frequent_tokens_counts_ties_and_fill():
    responses = [[5, 5, 7, 9], [9, 5, 2], [7]]  # 5 ×3, 7 ×2, 9 ×2, 2 ×1
    assert frequent_tokens(responses, 2, 16).tolist() == [5, 7]  # 7 and 9 tie: the lower id wins
    assert frequent_tokens(responses, 4, 16).tolist() == [2, 5, 7, 9]
    assert frequent_tokens(responses, 6, 16).tolist() == [0, 1, 2, 5, 7, 9]  # filled with unused low ids
    assert coverage(responses, np.array([5, 7])) == pytest.approx(5 / 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        frequent_tokens([[3, 16]], 2, 16)
    with pytest.raises(ValueError, match="must be in"):
        frequent_tokens(responses, 0, 16)
