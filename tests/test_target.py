"""Target forward parity against HF transformers (torch, f32) on tiny random Llama / Qwen3 models, and a block
forward that reads the cache where it lies."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_tiny_hf_model

from dspine_jax import load_target
from dspine_jax.models.target import forward, init_cache, lm_logits

TOL = 1e-4


def hf_forward(model, tokens: np.ndarray):
    with torch.no_grad():
        return model(torch.tensor(tokens), output_hidden_states=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_logits_and_taps_match_hf(tiny_models, family):
    model_dir, hf = tiny_models[family]
    target = load_target(model_dir)
    tokens = np.random.RandomState(0).randint(0, 128, (2, 11))
    ref = hf_forward(hf, tokens)
    taps = (0, 1)
    hidden, tapped, _, _ = forward(target, init_cache(target, 2, 32), jnp.asarray(tokens), taps=taps)
    np.testing.assert_allclose(np.asarray(lm_logits(target, hidden)), ref.logits.numpy(), atol=TOL, rtol=0)
    for j, layer in enumerate(taps):
        np.testing.assert_allclose(np.asarray(tapped[j]), ref.hidden_states[layer + 1].numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_step_decode_and_block_on_cache_match_hf(tiny_models, family):
    """Prefill 7 tokens, then 3 one-token steps, then a 16-token block on top of the cache."""
    model_dir, hf = tiny_models[family]
    target = load_target(model_dir)
    rng = np.random.RandomState(1)
    tokens = rng.randint(0, 128, (1, 7 + 3 + 16))
    ref_logits = hf_forward(hf, tokens).logits.numpy()  # one full causal pass is the reference

    cache = init_cache(target, 1, 64)
    hidden, _, cache, _ = forward(target, cache, jnp.asarray(tokens[:, :7]))
    cache = cache.commit(jnp.array([7]))
    got = [np.asarray(lm_logits(target, hidden))]
    for i in range(7, 10):
        hidden, _, cache, _ = forward(target, cache, jnp.asarray(tokens[:, i : i + 1]))
        cache = cache.commit(jnp.array([1]))
        got.append(np.asarray(lm_logits(target, hidden)))
    hidden, _, cache, _ = forward(target, cache, jnp.asarray(tokens[:, 10:]))
    got.append(np.asarray(lm_logits(target, hidden)))
    np.testing.assert_allclose(np.concatenate(got, axis=1), ref_logits, atol=TOL, rtol=0)


def test_rows_with_different_lengths_are_independent(tiny_models):
    """Two rows at different cache lengths give the same logits as each row alone."""
    model_dir, hf = tiny_models["qwen3"]
    target = load_target(model_dir)
    rng = np.random.RandomState(2)
    a, b = rng.randint(0, 128, 9), rng.randint(0, 128, 4)
    block = rng.randint(0, 128, (2, 5))
    padded = np.zeros((2, 9), np.int64)
    padded[0], padded[1, :4] = a, b
    cache = init_cache(target, 2, 32)
    _, _, cache, _ = forward(target, cache, jnp.asarray(padded))
    cache = cache.commit(jnp.array([9, 4]))
    hidden, _, _, _ = forward(target, cache, jnp.asarray(block))
    got = np.asarray(lm_logits(target, hidden))
    for row, prefix in enumerate([a, b]):
        ref = hf_forward(hf, np.concatenate([prefix, block[row]])[None]).logits.numpy()[0, len(prefix) :]
        np.testing.assert_allclose(got[row], ref, atol=TOL, rtol=0)


def test_sharded_checkpoint_and_bf16(tmp_path):
    """A sharded save (index.json) loads; bf16 tracks HF's bf16 within a documented tolerance."""
    model_dir, hf = make_tiny_hf_model("llama", tmp_path / "m", seed=3, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    tokens = np.random.RandomState(3).randint(0, 128, (1, 12))
    ref = hf_forward(hf, tokens).logits.numpy()
    sharded = load_target(tmp_path / "sharded")
    hidden, _, _, _ = forward(sharded, init_cache(sharded, 1, 16), jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(lm_logits(sharded, hidden)), ref, atol=TOL, rtol=0)

    bf16 = load_target(model_dir, dtype="bfloat16")
    assert bf16.dtype == jnp.bfloat16
    hidden, _, _, _ = forward(bf16, init_cache(bf16, 1, 16), jnp.asarray(tokens))
    with torch.no_grad():
        ref_bf16 = hf.to(torch.bfloat16)(torch.tensor(tokens)).logits.float().numpy()
    hf.float()
    # bf16 has 8 mantissa bits; logits here are O(1-10): both sides round differently at every op.
    scale = np.abs(ref).max()
    assert np.abs(np.asarray(lm_logits(bf16, hidden)) - ref_bf16).max() <= 0.05 * scale


def test_sliding_window_layers_match_hf(tmp_path):
    """Qwen3 with sliding-window layers (window 4) over a 12-token prompt."""
    model_dir, hf = make_tiny_hf_model(
        "qwen3", tmp_path / "sw", seed=4, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )
    target = load_target(model_dir)
    assert target.params.layers[1].window == 4 and target.params.layers[0].window == 0
    tokens = np.random.RandomState(4).randint(0, 128, (1, 12))
    ref = hf_forward(hf, tokens).logits.numpy()
    hidden, _, _, _ = forward(target, init_cache(target, 1, 16), jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(lm_logits(target, hidden)), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_block_forward_reads_the_cache_in_place(tiny_models, family):
    """The compiled forward of a 1-, 2-, 4- or 8-token block over a donated cache copies no buffer the size of a
    layer's K/V cache: each attention product reads the cache in its stored layout (a dot spelled the other way
    round makes XLA:CPU copy every layer's cache transposed, every verify round)."""
    target = load_target(tiny_models[family][0])
    cache = init_cache(target, 1, 256)
    layer_cache = math.prod(cache.k[0].shape)
    step = jax.jit(lambda c, x: forward(target, c, x)[2], donate_argnums=0)
    for t in (1, 2, 4, 8):
        hlo = step.lower(cache, jnp.zeros((1, t), jnp.int32)).compile().as_text()
        copied = [m.group(0) for m in re.finditer(r"= \w+\[([0-9,]*)\]\S* copy\(", hlo)
                  if math.prod(int(d) for d in m.group(1).split(",") if d) >= layer_cache]  # fmt: skip
        assert not copied, (t, copied)
