"""Hybrid targets (Qwen3.5 text / dense Qwen3-Next): HF parity, recurrent-state replay, greedy decode.

Tiny random HF models (4 layers: 3 Gated DeltaNet + 1 gated full attention, width 64) are built with
``save_pretrained`` in a tmp dir and compared against transformers' torch fallback paths (f32, eager
attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require

from dspine_jax.models import target as tgt
from dspine_jax.models.cache import HybridCache
from dspine_jax.models.config import HybridConfig, UnsupportedModelError
from dspine_jax.models.family import target_config_from_dict
from dspine_jax.models.weights import load_safetensors_dir, save_safetensors

HYBRID_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # layer_types default: linear, linear, linear, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    pad_token_id=0,
)
# bf16 tolerance. bf16 keeps 8 mantissa bits, so HF's own bf16 logits differ from its f32 logits by
# several % of the logit scale on these tiny models (weights ×4 amplify rounding). Measured on the
# test inputs: |HF bf16 − HF f32| ≈ 0.11–0.21 and |ours bf16 − HF bf16| ≈ 0.09–0.18 at a logit scale of
# ≈ 2.5. Tested: |ours bf16 − HF bf16| ≤ BF16_NOISE_FACTOR × |HF bf16 − HF f32| (HF's own rounding
# noise on the same inputs) and ≤ BF16_REL_TOL × the logit scale, with ≥ 85 % argmax agreement.
BF16_NOISE_FACTOR = 2.0
BF16_REL_TOL = 0.12


def _perturb(model, seed: int) -> None:
    """Make every parameter matter: random inits leave norms at 0/1 and decays far too strong."""
    import torch

    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rate A in [0.05, 0.5]: the state keeps a memory
                p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.mul_(4.0)  # logits of order 1-10 instead of 0.1


def make_tiny_hybrid(model_type: str, out_dir, seed: int = 0, **overrides):
    """(dir, torch model) for a tiny random ``qwen3_5_text`` or dense ``qwen3_next`` model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {"num_experts": 0} if model_type == "qwen3_next" else {}
    cfg = AutoConfig.for_model(model_type, **{**HYBRID_COMMON, **extra, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    _perturb(model, seed)
    model.save_pretrained(out_dir)
    return out_dir, model


def make_tiny_qwen3_5_multimodal(out_dir, seed: int = 2):
    """A ``Qwen3_5ForConditionalGeneration`` (tiny vision tower) plus a stray ``mtp.*`` tensor."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, patch_size=4)
    cfg = Qwen3_5Config(text_config=dict(HYBRID_COMMON), vision_config=vision, tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    _perturb(model, seed)
    model.save_pretrained(out_dir)
    tensors = load_safetensors_dir(out_dir)
    assert any(k.startswith("model.language_model.") for k in tensors)
    assert any(k.startswith("model.visual.") for k in tensors)
    tensors["mtp.fc.weight"] = np.ones((4, 4), np.float32)  # real Qwen3.5 checkpoints ship an MTP head
    save_safetensors(tensors, out_dir / "model.safetensors")
    return out_dir, model


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid")
    return {
        "qwen3_5": make_tiny_hybrid("qwen3_5_text", root / "qwen3_5", seed=0),
        "qwen3_next": make_tiny_hybrid("qwen3_next", root / "qwen3_next", seed=1),
    }


@functools.cache
def _jitted():
    # (hidden, tapped, cache) alone, and the whole TargetForward with its replay record
    fwd = jax.jit(lambda target, cache, tokens, taps=(): tgt.forward(target, cache, tokens, taps)[:3], static_argnames=("taps",))
    fwd_replay = jax.jit(tgt.forward)
    return fwd, fwd_replay, jax.jit(tgt.replay), jax.jit(tgt.lm_logits)


def _hf_logits(model, ids, cache=None):
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long), cache=cache, use_cache=True)
    return out.logits.float().numpy(), out.cache


# ----------------------------------------------------------------------------------------------
# Config


def test_config_parsing_and_moe_rejection():
    text = dict(HYBRID_COMMON, model_type="qwen3_5_text", rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    wrapped = {"model_type": "qwen3_5", "text_config": text, "vision_config": {}, "tie_word_embeddings": True,
               "eos_token_id": 7}
    cfg = target_config_from_dict(wrapped)
    assert isinstance(cfg, HybridConfig) and cfg.model_type == "qwen3_5"
    assert cfg.layer_kinds == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.gdn_layers == (0, 1, 2) and cfg.attention_layers == (3,)
    assert cfg.rotary_dim == 4 and cfg.rope_theta == 1e7 and cfg.tie_word_embeddings and cfg.eos_token_ids == (7,)
    assert cfg.gdn_conv_dim == 2 * 2 * 16 + 4 * 16 and cfg.gdn_projection_layout == "split"
    hash(cfg)  # usable as a static jit argument

    dense_next = dict(HYBRID_COMMON, model_type="qwen3_next", num_experts=512, mlp_only_layers=[0, 1, 2, 3])
    assert target_config_from_dict(dense_next).gdn_projection_layout == "fused"
    assert target_config_from_dict(dict(dense_next, num_experts=0, mlp_only_layers=[])).model_type == "qwen3_next"

    with pytest.raises(UnsupportedModelError, match=r"qwen3_next with mixture-of-experts.*not supported yet"):
        target_config_from_dict(dict(HYBRID_COMMON, model_type="qwen3_next", num_experts=8, decoder_sparse_step=1))
    with pytest.raises(UnsupportedModelError, match=r"layers \[1, 3\]"):
        target_config_from_dict(dict(HYBRID_COMMON, model_type="qwen3_next", num_experts=8, decoder_sparse_step=2))
    with pytest.raises(UnsupportedModelError, match="not supported yet"):
        target_config_from_dict({"model_type": "qwen3_5_moe", "text_config": text})


def test_moe_checkpoint_rejected_by_load_target(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3_next", **HYBRID_COMMON, num_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="not supported yet"):
        tgt.load_target(tmp_path)


# ----------------------------------------------------------------------------------------------
# Parity against transformers


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_parity_f32_prefill_step_block(hybrid_models, family):
    """Prefill (70 tokens: two GDN chunks, one padded), one-token step, then a 16-token block."""
    model_dir, model = hybrid_models[family]
    target = tgt.load_target(model_dir)
    assert isinstance(target.config, HybridConfig)
    fwd, _, _, logits_fn = _jitted()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128, (2, 70))
    step = rng.integers(0, 128, (2, 1))
    block = rng.integers(0, 128, (2, 16))

    import torch

    with torch.no_grad():
        hf = model(input_ids=torch.as_tensor(prompt), use_cache=True, output_hidden_states=True)
    ref_prefill, hf_cache = hf.logits.numpy(), hf.cache
    ref_step, hf_cache = _hf_logits(model, step, hf_cache)
    ref_block, _ = _hf_logits(model, block, hf_cache)

    cache = tgt.init_cache(target, 2, 128)
    assert isinstance(cache, HybridCache)
    hidden, tapped, cache = fwd(target, cache, jnp.asarray(prompt), taps=(0, 2))
    cache = cache.commit(jnp.full((2,), 70))
    np.testing.assert_allclose(logits_fn(target, hidden), ref_prefill, atol=1e-4, rtol=0)
    np.testing.assert_allclose(tapped[0], hf.hidden_states[1].numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(tapped[1], hf.hidden_states[3].numpy(), atol=1e-4, rtol=0)
    assert np.abs(ref_prefill).max() > 1.0  # the comparison is not vacuous

    hidden, _, cache = fwd(target, cache, jnp.asarray(step))
    cache = cache.commit(jnp.ones((2,), jnp.int32))
    np.testing.assert_allclose(logits_fn(target, hidden), ref_step, atol=1e-4, rtol=0)

    hidden, _, cache = fwd(target, cache, jnp.asarray(block))
    np.testing.assert_allclose(logits_fn(target, hidden), ref_block, atol=1e-4, rtol=0)


def test_multimodal_qwen3_5_checkpoint_loads(tmp_path):
    """Weights under ``model.language_model.*`` (vision tower and ``mtp.*`` ignored) load and match."""
    model_dir, model = make_tiny_qwen3_5_multimodal(tmp_path / "mm")
    target = tgt.load_target(model_dir)
    assert target.config.model_type == "qwen3_5"
    fwd, _, _, logits_fn = _jitted()
    prompt = np.random.default_rng(1).integers(0, 128, (2, 12))
    ref, _ = _hf_logits(model, prompt)
    hidden, _, _ = fwd(target, tgt.init_cache(target, 2, 32), jnp.asarray(prompt))
    np.testing.assert_allclose(logits_fn(target, hidden), ref, atol=1e-4, rtol=0)


def test_parity_bf16(hybrid_models):
    """bf16 weights on both sides: our error is of the size of HF's own bf16 rounding noise."""
    import torch

    model_dir, model = hybrid_models["qwen3_5"]
    model16 = type(model).from_pretrained(model_dir, attn_implementation="eager", dtype=torch.bfloat16).eval()
    target = tgt.load_target(model_dir, dtype="bfloat16")
    assert target.dtype == jnp.bfloat16
    fwd, _, _, logits_fn = _jitted()
    rng = np.random.default_rng(2)
    prompt, block = rng.integers(0, 128, (2, 20)), rng.integers(0, 128, (2, 16))
    ref_prefill, hf_cache = _hf_logits(model16, prompt)
    ref_block, _ = _hf_logits(model16, block, hf_cache)
    f32_prefill, hf_cache = _hf_logits(model, prompt)
    f32_block, _ = _hf_logits(model, block, hf_cache)

    cache = tgt.init_cache(target, 2, 64)
    assert cache.state[0].dtype == jnp.float32 and cache.conv[0].dtype == jnp.float32
    assert cache.k[0].dtype == jnp.bfloat16
    hidden, _, cache = fwd(target, cache, jnp.asarray(prompt))
    cache = cache.commit(jnp.full((2,), 20))
    assert cache.state[0].dtype == jnp.float32
    ours_prefill = np.asarray(logits_fn(target, hidden))
    hidden, _, cache = fwd(target, cache, jnp.asarray(block))
    ours_block = np.asarray(logits_fn(target, hidden))
    for ours, ref, f32 in ((ours_prefill, ref_prefill, f32_prefill), (ours_block, ref_block, f32_block)):
        err, noise, scale = np.abs(ours - ref).max(), np.abs(ref - f32).max(), np.abs(f32).max()
        assert err <= BF16_NOISE_FACTOR * noise and err <= BF16_REL_TOL * scale, (err, noise, scale)
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.85


# ----------------------------------------------------------------------------------------------
# Recurrent-state replay


def _select_rows(snapshots: list[HybridCache], n: np.ndarray) -> HybridCache:
    """Row b of ``snapshots[n[b]]`` (every leaf is batch-first)."""
    rows = np.arange(len(n))
    return jax.tree.map(lambda *leaves: jnp.stack(leaves)[n, rows], *snapshots)


def _assert_replayed(got: HybridCache, want: HybridCache, block_cache: HybridCache, atol: float) -> None:
    """``got``'s lengths are ``want``'s, its GDN windows and states within ``atol`` of ``want``'s, and its K/V
    in every valid slot exactly the block forward's (``block_cache``): replay keeps the block's entries as
    written. (That a block's K/V equal a token-by-token forward's is the forward's own claim, checked against
    HF above; here the two would differ by the chunked vs recurrent GDN rounding, which is the CPU's, not
    replay's.)"""
    np.testing.assert_array_equal(got.lengths, want.lengths)
    for a, b in zip(got.state + got.conv, want.state + want.conv, strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
    valid = np.arange(got.capacity)[None, :] < np.asarray(want.lengths)[:, None]  # [B, S]
    for a, b in zip(got.k + got.v, block_cache.k + block_cache.v, strict=True):  # [B, K, S, D]
        a, b = np.moveaxis(np.asarray(a), 2, 1), np.moveaxis(np.asarray(b), 2, 1)  # [B, S, K, D]
        np.testing.assert_array_equal(a[valid], b[valid])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_replay_every_length(hybrid_models, family):
    """Rows commit 0…16 tokens of a 16-token block; replay's GDN state == feeding only those tokens (≤1e-5),
    its K/V the block's own.

    A second round starts from rows of different lengths and commits the reverse amounts.
    """
    target = tgt.load_target(hybrid_models[family][0])
    fwd, fwd_replay, replay, logits_fn = _jitted()
    rng = np.random.default_rng(3)
    batch, block_len = 17, 16
    cache = tgt.init_cache(target, batch, 64)
    _, _, cache = fwd(target, cache, jnp.asarray(rng.integers(0, 128, (batch, 8))))
    cache = cache.commit(jnp.full((batch,), 8))

    for round_, n in enumerate((np.arange(batch), block_len - np.arange(batch))):
        block = jnp.asarray(rng.integers(0, 128, (batch, block_len)))
        _, _, after, saved = fwd_replay(target, cache, block)
        assert len(saved) == 3 and saved[0].state.shape == (batch, 4, 16, 16)
        assert saved[0].k.shape[:2] == (batch, block_len)
        replayed = replay(target, after, saved, jnp.asarray(n, jnp.int32))

        # Reference: feed the block one token at a time (recurrent path), snapshot after each.
        snapshots, c = [cache], cache
        for t in range(block_len):
            _, _, c = fwd(target, c, block[:, t : t + 1])
            c = c.commit(jnp.ones((batch,), jnp.int32))
            snapshots.append(c)
        expected = _select_rows(snapshots, n)
        _assert_replayed(replayed, expected, after, atol=1e-5)

        # Keeping the whole block equals the forward's own (chunked) result.
        full = replay(target, after, saved, jnp.full((batch,), block_len, jnp.int32))
        _assert_replayed(full, after.commit(jnp.full((batch,), block_len)), after, atol=1e-5)

        if round_ == 0:
            # …and equals a chunked forward over exactly the kept tokens (row 9 keeps 9).
            _, _, direct = fwd(target, cache, block[:, :9])
            direct = direct.commit(jnp.full((batch,), 9))
            for got, want in zip(replayed.state + replayed.conv, direct.state + direct.conv, strict=True):
                np.testing.assert_allclose(got[9], want[9], atol=1e-5, rtol=0)
            # Row 0 kept nothing: GDN state untouched.
            for got, before in zip(replayed.state + replayed.conv, cache.state + cache.conv, strict=True):
                np.testing.assert_array_equal(got[0], before[0])

        # Next-step logits from the replayed cache match the token-by-token cache.
        nxt = jnp.asarray(rng.integers(0, 128, (batch, 1)))
        h_got, _, _ = fwd(target, replayed, nxt)
        h_want, _, _ = fwd(target, expected, nxt)
        np.testing.assert_allclose(logits_fn(target, h_got), logits_fn(target, h_want), atol=1e-5, rtol=0)
        cache = replayed


# ----------------------------------------------------------------------------------------------
# Greedy decoding


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.as_tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_greedy_local_loop_matches_hf(hybrid_models):
    """init_cache / forward / commit / lm_logits decode loop == HF greedy, token for token."""
    model_dir, model = hybrid_models["qwen3_5"]
    target = tgt.load_target(model_dir)
    fwd, _, _, logits_fn = _jitted()
    prompt = np.random.default_rng(4).integers(3, 128, 11).tolist()
    new = 20
    expected = _hf_greedy(model, prompt, new)

    cache = tgt.init_cache(target, 1, 64)
    hidden, _, cache = fwd(target, cache, jnp.asarray([prompt]))
    cache = cache.commit(jnp.asarray([len(prompt)]))
    tokens = [int(jnp.argmax(logits_fn(target, hidden[:, -1]), -1)[0])]
    while len(tokens) < new:
        hidden, _, cache = fwd(target, cache, jnp.asarray([[tokens[-1]]]))
        cache = cache.commit(jnp.ones((1,), jnp.int32))
        tokens.append(int(jnp.argmax(logits_fn(target, hidden[:, -1]), -1)[0]))
    assert tokens == expected


def test_generate_matches_hf_greedy(hybrid_models):
    """``dspine_jax.decoding.autoregressive.generate`` on a hybrid target (rows of different prompt lengths)."""
    generate_mod = require("dspine_jax.decoding.autoregressive")
    model_dir, model = hybrid_models["qwen3_next"]
    target = tgt.load_target(model_dir)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 128, 7).tolist(), rng.integers(3, 128, 13).tolist()]
    new = 12
    result = generate_mod.generate(target, prompts, new, stop_ids=[])
    assert result.token_ids == [_hf_greedy(model, p, new) for p in prompts], (
        "right-padded prefill must not leave the pad tokens in the GDN state: prefill should run "
        "forward and keep the prompt with target.replay(target, cache, saved, lengths)"
    )
