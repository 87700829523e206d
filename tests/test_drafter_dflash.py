"""DFlash backbone vs the z-lab reference (``dflash==0.1.0``), context cache across rounds, ring buffer."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax import drafter as D
from dspine_jax.drafter_io import init_drafter, load_drafter
from dspine_jax.target import forward as target_forward
from dspine_jax.target import init_cache, load_target

torch = pytest.importorskip("torch")
dflash_model = pytest.importorskip("dflash.model")

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


@pytest.fixture(scope="module")
def qwen3_target(tiny_models):
    model_dir, hf_model = tiny_models["qwen3"]
    return load_target(model_dir), hf_model


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


@jax.jit
def _logits(drafter, target, cache, anchor):
    fwd = D.forward(drafter, target, cache, D.block_tokens(drafter, anchor))
    return D.unary_logits(drafter, target, fwd.hidden[:, 1:])


# Jitted so the tests do not pay op-by-op dispatch on a busy 2-core machine.
append = jax.jit(D.append_context)


def our_logits(drafter, target, cache, anchor) -> np.ndarray:
    return np.asarray(_logits(drafter, target, cache, jnp.asarray(anchor, jnp.int32)))


def test_matches_zlab_across_two_rounds(qwen3_target, tmp_path):
    target, hf_target = qwen3_target
    model = make_zlab_drafter(tmp_path / "zlab", seed=3)
    drafter = load_drafter(tmp_path / "zlab", target)
    assert drafter.config.kind == "dflash" and drafter.config.layer_causal == (False, False)

    seq = np.random.RandomState(0).randint(3, 128, size=12)
    prompt, produced = 7, 3  # round 2 commits the anchor + 2 accepted tokens
    feats = hf_taps(hf_target, seq)
    _, tapped, _ = target_forward(
        target, init_cache(target, 1, 32), jnp.asarray(seq)[None], drafter.config.target_layer_ids
    )

    zcache = dflash_model._make_cache(model.config)
    ref1 = zlab_round(model, hf_target, feats[:, :prompt], int(seq[prompt]), prompt, zcache)
    cache = append(drafter, D.init_draft_cache(drafter, 1, 32), tapped[:, :, :prompt], jnp.array([prompt]))
    np.testing.assert_allclose(our_logits(drafter, target, cache, [seq[prompt]])[0], ref1, atol=1e-4, rtol=1e-4)

    start = prompt + produced
    ref2 = zlab_round(model, hf_target, feats[:, prompt:start], int(seq[start]), start, zcache)
    cache = append(drafter, cache, tapped[:, :, prompt : prompt + BLOCK], jnp.array([produced]))
    assert int(cache.lengths[0]) == start
    np.testing.assert_allclose(our_logits(drafter, target, cache, [seq[start]])[0], ref2, atol=1e-4, rtol=1e-4)


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
    _, tapped, _ = target_forward(
        target, init_cache(target, 1, 32), jnp.asarray(seq)[None], drafter.config.target_layer_ids
    )
    cache = append(drafter, D.init_draft_cache(drafter, 1, 32), tapped[:, :, :prompt], jnp.array([prompt]))
    np.testing.assert_allclose(our_logits(drafter, target, cache, [seq[prompt]])[0], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_ragged_batch_equals_single_rows(qwen3_target, kind):
    """Rows with their own lengths, committed in two uneven appends, draft exactly as they would alone."""
    target, _ = qwen3_target
    drafter = init_drafter(
        target,
        kind=kind,
        num_layers=2,
        block_size=BLOCK,
        transfer_rank=16,
        message_size=8,
        top_k=4,
        target_layer_ids=TAPS,
        initializer_range=0.2,
    )
    rng = np.random.RandomState(2)
    seqs = rng.randint(3, 128, size=(2, 12))
    _, tapped, _ = target_forward(target, init_cache(target, 2, 32), jnp.asarray(seqs), drafter.config.target_layer_ids)
    first, second = np.array([7, 4]), np.array([2, 3])
    cache = append(drafter, D.init_draft_cache(drafter, 2, 32), tapped[:, :, :8], jnp.asarray(first))
    # Second append: each row's new features start at its own length.
    block = np.stack([np.asarray(tapped[:, b, first[b] : first[b] + 4]) for b in range(2)], axis=1)
    cache = append(drafter, cache, jnp.asarray(block), jnp.asarray(second))
    anchors = seqs[np.arange(2), first + second]
    batched = our_logits(drafter, target, cache, anchors)
    for b in range(2):
        n = first[b] + second[b]
        alone = append(
            drafter, D.init_draft_cache(drafter, 1, 32), tapped[:, b : b + 1], jnp.array([n])
        )  # padding past n is ignored
        np.testing.assert_allclose(
            batched[b], our_logits(drafter, target, alone, anchors[b : b + 1])[0], atol=1e-5, rtol=1e-5
        )


def test_ring_buffer_window_equals_unbounded_cache(qwen3_target):
    """A windowed drafter's W-1-slot ring, wrapped several times by many small appends, drafts exactly
    like a cache that holds the whole history."""
    target, _ = qwen3_target
    window = 5
    drafter = init_drafter(
        target,
        kind="dspine",
        num_layers=2,
        block_size=BLOCK,
        transfer_rank=16,
        message_size=8,
        top_k=4,
        target_layer_ids=TAPS,
        sliding_window=window,
        initializer_range=0.2,
    )
    ring = D.init_draft_cache(drafter, 1, 64)
    assert ring.capacity == window - 1
    b, kh, _, d = ring.k[0].shape
    unbounded = tuple(jnp.zeros((b, kh, 64, d), ring.k[0].dtype) for _ in ring.k)
    full = D.DraftCache(k=unbounded, v=unbounded, lengths=ring.lengths)
    seq = np.random.RandomState(3).randint(3, 128, size=(1, 24))
    _, tapped, _ = target_forward(target, init_cache(target, 1, 32), jnp.asarray(seq), drafter.config.target_layer_ids)
    pos = 0
    for n in [6, 3, 1, 4, 2]:  # the first append is longer than the ring
        chunk = tapped[:, :, pos : pos + 6]
        chunk = jnp.pad(chunk, ((0, 0), (0, 0), (0, 6 - chunk.shape[2]), (0, 0)))
        ring = append(drafter, ring, chunk, jnp.array([n]))
        full = append(drafter, full, chunk, jnp.array([n]))
        pos += n
        anchor = seq[:, pos]
        np.testing.assert_allclose(
            our_logits(drafter, target, ring, anchor), our_logits(drafter, target, full, anchor), atol=1e-5, rtol=1e-5
        )


def test_dflash_decode_greedy_and_sampling(qwen3_target, tmp_path):
    target, _ = qwen3_target
    make_zlab_drafter(tmp_path / "zlab", seed=5)
    drafter = load_drafter(tmp_path / "zlab", target)
    seq = np.random.RandomState(4).randint(3, 128, size=(1, 8))
    _, tapped, _ = target_forward(target, init_cache(target, 1, 32), jnp.asarray(seq), drafter.config.target_layer_ids)
    cache = append(drafter, D.init_draft_cache(drafter, 1, 32), tapped, jnp.array([8]))
    anchor = jnp.array([7], jnp.int32)
    logits = our_logits(drafter, target, cache, anchor)
    step = jax.jit(D.draft)
    greedy = step(drafter, target, cache, anchor, jax.random.PRNGKey(0), jnp.float32(0.0))
    np.testing.assert_array_equal(np.asarray(greedy.tokens), logits.argmax(-1))
    assert greedy.q.shape == (1, BLOCK - 1, 128)  # DFlash: C = V, candidates = the vocabulary
    hot = step(drafter, target, cache, anchor, jax.random.PRNGKey(1), jnp.float32(0.7))
    np.testing.assert_allclose(np.asarray(hot.q), np.asarray(jax.nn.softmax(logits / 0.7, axis=-1)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(D.q_full(hot, 128)), np.asarray(hot.q), atol=0)
