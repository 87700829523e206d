"""DFlash vs the z-lab reference (``dflash==0.1.0``): backbone logits across rounds with the context cache,
sliding layers, and the draft distribution built with the target's sampling transform.

Only the z-lab parity checks live here (they need ``dflash``); the context cache's own checks (ragged
rows, ring buffer) are in test_drafter_cache.py."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require
from drafter_helpers import append, block_logits, tapped_features

from dspine_jax.drafters import drafter as D
from dspine_jax.drafters.io import load_drafter
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models.sampling import Sampling

torch = require("torch")
dflash_model = require("dflash.model")

BLOCK = 4
MASK_ID = 5
TAPS = [0, 1]


def make_zlab_drafter(out_dir: Path, seed: int, **overrides) -> dflash_model.DFlashDraftModel:
    """A z-lab ``DFlashDraftModel`` with O(1) random weights (the default N(0, 0.02) init would hide
    wiring mistakes in near-zero activations), saved with ``save_pretrained``."""
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    cfg = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "num_target_layers": 3,
        "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS},
    }
    model = dflash_model.DFlashDraftModel(Qwen3Config(**{**cfg, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return model


def zlab_round(model, hf_target, ctx_features, anchor: int, start: int, cache) -> np.ndarray:
    """One z-lab draft forward (exactly dflash_generate's call) → logits of slots 1.. [P, V]."""
    n_ctx = ctx_features.shape[1]
    block = torch.full((1, BLOCK), MASK_ID, dtype=torch.long)
    block[0, 0] = anchor
    with torch.no_grad():
        noise = hf_target.get_input_embeddings()(block)
        positions = torch.arange(start - n_ctx, start + BLOCK)[None]
        hidden = model(
            target_hidden=ctx_features,
            noise_embedding=noise,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        dflash_model._crop_to(cache, start)
        return hf_target.lm_head(hidden[:, 1:]).numpy()[0]


def hf_taps(hf_target, tokens: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        out = hf_target(torch.as_tensor(tokens)[None], output_hidden_states=True)
    return dflash_model.extract_context_feature(out.hidden_states, TAPS)  # [1, T, n*H]


def test_matches_zlab_across_two_rounds(qwen3_target, tmp_path):
    target, hf_target = qwen3_target
    model = make_zlab_drafter(tmp_path / "zlab", seed=3)
    drafter = load_drafter(tmp_path / "zlab", target)
    assert drafter.config.kind == "dflash" and drafter.config.layer_causal == (False, False)

    seq = np.random.RandomState(0).randint(3, 128, size=12)
    prompt, produced = 7, 3  # round 2 commits the anchor + 2 accepted tokens
    feats = hf_taps(hf_target, seq)
    tapped = tapped_features(target, seq[None], drafter.config.target_layer_ids)

    zcache = dflash_model._make_cache(model.config)
    ref1 = zlab_round(model, hf_target, feats[:, :prompt], int(seq[prompt]), prompt, zcache)
    cache = append(drafter, init_draft_cache(drafter, 1, 32), tapped[:, :, :prompt], jnp.array([prompt]))
    np.testing.assert_allclose(block_logits(drafter, target, cache, [seq[prompt]])[0], ref1, atol=1e-4, rtol=1e-4)

    start = prompt + produced
    ref2 = zlab_round(model, hf_target, feats[:, prompt:start], int(seq[start]), start, zcache)
    cache = append(drafter, cache, tapped[:, :, prompt : prompt + BLOCK], jnp.array([produced]))
    assert int(cache.lengths[0]) == start
    np.testing.assert_allclose(block_logits(drafter, target, cache, [seq[start]])[0], ref2, atol=1e-4, rtol=1e-4)


def test_matches_zlab_sliding_layers_causal_by_default(qwen3_target, tmp_path):
    """Sliding layers are causal in-block unless ``is_causal`` says otherwise (z-lab / SGLang rule),
    and the window bounds the context. One round only: z-lab's DynamicCache keeps a W-1 ring for
    sliding layers but its mask assumes key index = position, so its later rounds are not a reference."""
    target, hf_target = qwen3_target
    window = 6
    model = make_zlab_drafter(
        tmp_path / "zlab_sw",
        seed=4,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=window,
    )
    drafter = load_drafter(tmp_path / "zlab_sw", target)
    assert drafter.config.layer_windows == (window, 0) and drafter.config.layer_causal == (True, False)
    seq = np.random.RandomState(1).randint(3, 128, size=10)
    prompt = 9
    ref = zlab_round(
        model,
        hf_target,
        hf_taps(hf_target, seq)[:, :prompt],
        int(seq[prompt]),
        prompt,
        dflash_model._make_cache(model.config),
    )
    tapped = tapped_features(target, seq[None], drafter.config.target_layer_ids)
    cache = append(drafter, init_draft_cache(drafter, 1, 32), tapped[:, :, :prompt], jnp.array([prompt]))
    np.testing.assert_allclose(block_logits(drafter, target, cache, [seq[prompt]])[0], ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def zlab_drafter_round(qwen3_target, tmp_path_factory):
    """A z-lab drafter loaded as ours, its context committed, and its block logits (the backbone's parity
    with z-lab is checked above; here the decode head's transform of the same logits is)."""
    target, _ = qwen3_target
    path = tmp_path_factory.mktemp("zlab") / "drafter"
    make_zlab_drafter(path, seed=5)
    drafter = load_drafter(path, target)
    seq = np.random.RandomState(4).randint(3, 128, size=9)
    prompt, anchor = 8, int(seq[8])
    cache = append(
        drafter, init_draft_cache(drafter, 1, 32), tapped_features(target, seq[None, :prompt], TAPS),
        jnp.array([prompt]),
    )  # fmt: skip
    return target, drafter, cache, jnp.array([anchor], jnp.int32), block_logits(drafter, target, cache, [anchor])[0]


draft = jax.jit(D.draft)


def test_dflash_greedy_draft_is_the_argmax(zlab_drafter_round):
    target, drafter, cache, anchor, logits = zlab_drafter_round
    greedy = draft(drafter, target, cache, anchor, jax.random.split(jax.random.key(0), 1), Sampling.rows(1))
    np.testing.assert_array_equal(np.asarray(greedy.tokens)[0], logits.argmax(-1))
    assert greedy.q.shape == (1, BLOCK - 1, 128)  # DFlash: C = V, candidates = the vocabulary
    np.testing.assert_array_equal(np.asarray(greedy.q)[0], np.eye(128)[logits.argmax(-1)])


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 1.0, 0), (0.7, 1.0, 5), (1.3, 0.6, 0), (0.9, 0.8, 7)])
def test_dflash_draft_distribution_is_zlabs(zlab_drafter_round, temperature, top_p, top_k):
    """z-lab's ``dflash_generate`` draws the proposals from ``_sampling_probs(draft_logits, temperature,
    top_p, top_k)`` — the target's own transform — so q has p's filters: top-k / top-p support only."""
    target, drafter, cache, anchor, logits = zlab_drafter_round
    out = draft(drafter, target, cache, anchor, jax.random.split(jax.random.key(1), 1), Sampling.rows(1, temperature, top_p, top_k))
    zlab_q = dflash_model._sampling_probs(torch.tensor(logits), temperature, top_p, top_k).numpy()
    q = np.asarray(D.q_full(out, 128))[0]
    np.testing.assert_allclose(q, zlab_q, atol=1e-6)
    if top_k:
        assert ((q > 0).sum(-1) <= top_k).all()
    tokens = np.asarray(out.tokens)[0]
    assert (q[np.arange(BLOCK - 1), tokens] > 0).all()  # proposals drawn from q itself
