"""DSpine, our own checks: fresh-DSpine == causal DFlash, cached walk == sequential refinement (greedy and
sampled), the walk depends on the predecessor, transfer codes vs a float64 PCA. The SpecForge-semantics
parity on z-lab's backbone is in test_drafter_dspine_specforge.py (it needs ``dflash``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require
from drafter_helpers import append, forward, tapped_features, with_random_injection

from dspine_jax.drafters import drafter as D
from dspine_jax.drafters import params as params_mod
from dspine_jax.drafters.config import DrafterConfig, config_as_kind
from dspine_jax.drafters.dspine import SPINE, transfer_codes_from_head
from dspine_jax.drafters.io import init_drafter
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models import quant
from dspine_jax.models.sampling import Sampling

BLOCK = 5
TAPS = [0, 1]
RANK, MSG, TOPK = 12, 8, 4


def test_fresh_dspine_equals_causal_dflash_exactly(qwen3_target):
    target, _ = qwen3_target
    dspine = init_drafter(
        target,
        kind="dspine",
        num_layers=2,
        block_size=BLOCK,
        transfer_rank=RANK,
        message_size=MSG,
        top_k=TOPK,
        target_layer_ids=TAPS,
        initializer_range=0.2,
        seed=3,
    )
    # The same weights as a causal DFlash: drop the injection, keep everything else.
    dflash_config = config_as_kind(dspine.config, "dflash", top_k=dspine.config.vocab_size)
    assert type(dflash_config) is DrafterConfig and dflash_config.layer_causal == (True, True)
    dflash = params_mod.Drafter(params=params_mod.with_kind_weights(params_mod.DrafterParams, dspine.params), config=dflash_config)
    seq = np.random.RandomState(6).randint(3, 128, size=(2, 9))
    tapped = tapped_features(target, seq, TAPS)
    cache = append(dspine, init_draft_cache(dspine, 2, 32), tapped, jnp.array([9, 6]))
    tokens = D.block_tokens(dspine, jnp.array([4, 9]))

    @jax.jit
    def logits(drafter, cache, tokens):
        return D.unary_logits(drafter, target, D.forward(drafter, target, cache, tokens).hidden)

    np.testing.assert_array_equal(np.asarray(logits(dspine, cache, tokens)), np.asarray(logits(dflash, cache, tokens)))


@pytest.fixture(scope="module")
def trained_dspine(qwen3_target):
    """A DSpine drafter with every injection weight non-zero, plus a forward to decode from."""
    target, _ = qwen3_target
    drafter = init_drafter(
        target,
        kind="dspine",
        num_layers=2,
        block_size=8,
        transfer_rank=RANK,
        message_size=MSG,
        top_k=6,
        target_layer_ids=TAPS,
        initializer_range=0.2,
        seed=5,
    )
    drafter = with_random_injection(drafter, seed=11)
    seq = np.random.RandomState(8).randint(3, 128, size=(3, 10))
    tapped = tapped_features(target, seq, TAPS)
    cache = append(drafter, init_draft_cache(drafter, 3, 32), tapped, jnp.array([10, 7, 3]))
    anchor = jnp.array([4, 50, 99], jnp.int32)
    return target, drafter, cache, anchor


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cached_walk_equals_sequential_refinement(trained_dspine, temperature):
    target, drafter, cache, anchor = trained_dspine
    keys = jax.random.split(jax.random.key(42), 3)
    sampling = Sampling.rows(3, temperature)
    out = jax.jit(D.draft)(drafter, target, cache, anchor, keys, sampling)
    fwd = forward(drafter, target, cache, D.block_tokens(drafter, anchor))
    seq_tokens, seq_q = jax.jit(SPINE.walk_sequential)(
        drafter, target, fwd.pre_injection[:, 1:], out.cand_ids, anchor, keys, sampling.temperature
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(seq_tokens))
    np.testing.assert_allclose(np.asarray(out.q), np.asarray(seq_q), atol=1e-6, rtol=1e-6)
    # q is a distribution over the candidates, and the proposal is one of them.
    np.testing.assert_allclose(np.asarray(out.q.sum(-1)), 1.0, atol=1e-6)
    assert bool(jnp.all(jnp.any(out.cand_ids == out.tokens[..., None], axis=-1)))
    full = np.asarray(D.q_full(out, drafter.config.vocab_size))
    np.testing.assert_allclose(full.sum(-1), 1.0, atol=1e-6)
    picked = np.take_along_axis(full, np.asarray(out.tokens)[..., None], -1)[..., 0]
    assert (picked > 0).all()
    if temperature == 0.0:
        np.testing.assert_array_equal(picked, 1.0)


def test_walk_depends_on_predecessor_and_sampling_is_seeded(trained_dspine):
    """With trained injection weights LWR changes the table along k; a fixed key reproduces the sample."""
    target, drafter, cache, anchor = trained_dspine
    fwd = forward(drafter, target, cache, D.block_tokens(drafter, anchor))
    cand = jax.lax.top_k(D.unary_logits(drafter, target, fwd.hidden[:, 1:]), 6)[1].astype(jnp.int32)
    table = np.asarray(SPINE.transition_table(drafter, target, fwd.pre_injection[:, 1:], cand, anchor))
    np.testing.assert_allclose(
        table[:, 0], np.broadcast_to(table[:, 0, :1], table[:, 0].shape), atol=1e-6
    )  # slot 1: all rows = anchor
    assert np.abs(table[:, 1:] - table[:, 1:, :1]).max() > 1e-3
    step = jax.jit(D.draft)
    keys = jax.random.split(jax.random.key(1), 3)
    a = step(drafter, target, cache, anchor, keys, Sampling.rows(3, 1.0))
    b = step(drafter, target, cache, anchor, keys, Sampling.rows(3, 1.0))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


# ----------------------------------------------------------------------------------------------
# Transfer codes


def test_transfer_codes_properties(qwen3_target):
    target, hf_target = qwen3_target
    head = quant.dequantize(target.params.lm_head)  # [H, V] (packed on a CPU)
    codes, directions = transfer_codes_from_head(head, RANK, chunk=48)  # chunking with a padded tail
    np.testing.assert_allclose(np.linalg.norm(np.asarray(codes), axis=-1), 1.0, atol=1e-5)
    again, _ = transfer_codes_from_head(head, RANK, chunk=48)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(again))
    # Consistent row permutation of the head → the same codes, permuted.
    perm = np.random.RandomState(0).permutation(head.shape[1])
    permuted, dirs_p = transfer_codes_from_head(head[:, perm], RANK)
    np.testing.assert_allclose(np.asarray(permuted), np.asarray(codes)[perm], atol=2e-4)
    np.testing.assert_allclose(np.asarray(dirs_p), np.asarray(directions), atol=2e-4)
    # Agrees with a float64 torch PCA up to each direction's sign.
    require("torch")
    from torch_reference import torch_transfer_space

    ref_codes, ref_dirs = torch_transfer_space(hf_target.lm_head.weight.detach(), RANK)
    signs = np.sign(np.sum(np.asarray(directions) * ref_dirs.numpy(), axis=0))
    np.testing.assert_allclose(np.asarray(directions), ref_dirs.numpy() * signs, atol=1e-4)
    # Flipping a direction flips that code column (whitening and normalisation are sign-blind).
    np.testing.assert_allclose(np.asarray(codes), ref_codes.numpy() * signs[None, :], atol=1e-4)
    with pytest.raises(ValueError, match="transfer rank"):
        transfer_codes_from_head(head, head.shape[0] + 1)


def test_fresh_dspine_readouts_are_pca_directions(qwen3_target):
    target, _ = qwen3_target
    drafter = init_drafter(
        target, kind="dspine", num_layers=2, transfer_rank=RANK, message_size=MSG, target_layer_ids=TAPS
    )
    codes, directions = transfer_codes_from_head(target.params.lm_head, RANK)
    inj = drafter.params.injection
    for layer in range(2):
        np.testing.assert_array_equal(np.asarray(inj.readouts[layer]), np.asarray(directions))
    np.testing.assert_array_equal(np.asarray(drafter.params.transfer_codes), np.asarray(codes))
    assert (
        not any(np.asarray(w).any() for w in inj.writes)
        and not np.asarray(inj.predecessor_gate).any()
        and not np.asarray(inj.bias).any()
    )
    assert np.asarray(inj.message).any() and np.asarray(inj.receiver_gate).any()
