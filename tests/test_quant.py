"""Weight-only int8 (``models/quant.py``): the rounding bound of quantise → dequantise, the quantised
matmul / lookup / head-column gather against the dequantised matrix, and speculative decoding staying
exact with respect to the served (quantised) target: greedy speculative == greedy AR of the same
quantised model, for a dense and a hybrid target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import init_drafter
from dspine_jax.models import quant
from dspine_jax.models.target import lm_logits, load_target

PROMPTS = [[5, 17, 33, 9, 60, 11], [7, 3, 99]]


def test_quantise_dequantise_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32) * rng.uniform(0.01, 3.0, size=(1, 48)).astype(np.float32)
    w[:, 7] = 0.0  # an all-zero channel
    for per, axis in (("column", 0), ("row", 1)):
        q = quant.quantize_int8(jnp.asarray(w), per=per)
        assert q.q.dtype == jnp.int8 and int(jnp.max(jnp.abs(q.q))) == quant.QMAX  # each channel uses the range
        scale = np.asarray(q.scale)
        assert scale.shape == ((1, 48) if per == "column" else (64, 1))
        np.testing.assert_allclose(scale, np.where(np.abs(w).max(axis, keepdims=True) > 0,
                                                   np.abs(w).max(axis, keepdims=True) / 127, 1.0), rtol=1e-6)  # fmt: skip
        err = np.abs(np.asarray(quant.dequantize(q)) - w)
        assert np.all(err <= scale / 2 * (1 + 1e-5) + 1e-12)
        assert np.all(np.asarray(quant.dequantize(q))[:, 7] == 0.0)


def test_quantised_ops_equal_the_dequantised_matrix():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((32, 40)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((2, 3, 32)).astype(np.float32))
    cols = quant.quantize_int8(w)
    dense = quant.dequantize(cols)
    np.testing.assert_allclose(np.asarray(x @ cols), np.asarray(x @ dense), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(quant.matmul_f32(x, cols)), np.asarray(x @ dense), rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([[3, 0], [39, 3]])
    np.testing.assert_array_equal(np.asarray(quant.take_columns(cols, ids)), np.asarray(jnp.take(dense, ids, axis=1)))
    rows = quant.quantize_int8(w, per="row")
    np.testing.assert_array_equal(np.asarray(rows[ids]), np.asarray(quant.dequantize(rows)[ids]))
    with pytest.raises(TypeError, match="needs per-column"):
        x @ rows
    with pytest.raises(TypeError, match="selects rows"):
        cols[ids]  # noqa: B018


@pytest.fixture(scope="module")
def llama_int8(tiny_models):
    return load_target(tiny_models["llama"][0], quantize="int8"), load_target(tiny_models["llama"][0])


def test_quantised_target_is_int8_and_close_to_float(llama_int8):
    q8, f32 = llama_int8
    leaves = jax.tree.leaves(q8.params)
    assert quant.is_quantized(q8.params) and not quant.is_quantized(f32.params)
    assert isinstance(q8.params.embed, quant.Int8Weight) and isinstance(q8.params.lm_head, quant.Int8Weight)
    assert all(isinstance(getattr(layer, name), quant.Int8Weight) for layer in q8.params.layers
               for name in ("qkv", "o", "gate_up", "down"))  # fmt: skip
    bytes8 = sum(x.nbytes for x in leaves)
    bytes32 = sum(x.nbytes for x in jax.tree.leaves(f32.params))
    assert bytes8 < 0.3 * bytes32  # ~1/4, plus scales and norms
    hidden = jnp.asarray(np.random.default_rng(2).standard_normal((1, 4, f32.config.hidden_size)).astype(np.float32))
    a, b = np.asarray(lm_logits(q8, hidden)), np.asarray(lm_logits(f32, hidden))
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()
    with pytest.raises(ValueError, match="quantize must be"):
        load_target(q8.model_dir, quantize="int4")


def test_greedy_speculative_equals_ar_of_the_quantised_dense_target(llama_int8):
    target, _ = llama_int8
    reference = generate(target, PROMPTS, 24, stop_ids=[]).token_ids
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=4, seed=3)
    for verify in (4, "auto"):
        result = speculative_generate(target, drafter, PROMPTS, 24, stop_ids=[], verify=verify,
                                      verify_costs={1: 1.0, 2: 1.0, 4: 1.0} if verify == "auto" else None)  # fmt: skip
        assert result.token_ids == reference


def test_greedy_speculative_equals_ar_of_the_quantised_hybrid_target(tmp_path):
    from test_hybrid import make_tiny_hybrid  # tests/ is on sys.path (pytest rootdir conftest)

    model_dir, _ = make_tiny_hybrid("qwen3_5_text", tmp_path / "qwen3_5", seed=0)
    target = load_target(model_dir, quantize="int8")
    assert all(isinstance(getattr(layer, "gate"), quant.Int8Weight) for layer in target.params.layers)
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=4, seed=4)
    for prompt in PROMPTS:  # one row each: AR prefill of right-padded rows keeps pads in the GDN state
        reference = generate(target, [prompt], 20, stop_ids=[]).token_ids
        result = speculative_generate(target, drafter, [prompt], 20, stop_ids=[], verify=4)
        assert result.token_ids == reference


def test_a_quantised_target_is_not_sharded(llama_int8):
    from dspine_jax.parallel.mesh import make_mesh
    from dspine_jax.parallel.sharding import shard_target

    with pytest.raises(ValueError, match="one device"):
        shard_target(llama_int8[0], make_mesh(tp=1, dp=1))


@pytest.mark.parametrize("kind", ["dspine", "dflash2"])
def test_quantised_drafter_proposes_like_its_dequantised_twin(llama_int8, kind):
    """``--quantize int8`` quantises the drafter's linear weights too: they are Int8Weight, its proposals are
    those of a float drafter holding the dequantised values, and greedy speculative output equals AR."""
    from drafter_helpers import append, tapped_features

    from dspine_jax.drafters import drafter as D
    from dspine_jax.drafters.io import DRAFTER_MATRICES, load_draft, quantize_drafter
    from dspine_jax.drafters.ring import init_draft_cache
    from dspine_jax.models.sampling import Sampling

    target, _ = llama_int8
    drafter = init_drafter(target, kind, num_layers=1, block_size=4, top_k=4, seed=3, initializer_range=0.2)
    q8 = quantize_drafter(drafter, "int8")
    assert isinstance(q8.params.fc, quant.Int8Weight)
    assert all(isinstance(getattr(q8.params.layers[0], name), quant.Int8Weight) for name in DRAFTER_MATRICES[1:])
    twin = drafter.replace(params=jax.tree.map(
        lambda x: quant.dequantize(x) if isinstance(x, quant.Int8Weight) else x, q8.params,
        is_leaf=lambda x: isinstance(x, quant.Int8Weight)))  # fmt: skip
    tapped = tapped_features(target, [PROMPTS[0]], drafter.config.target_layer_ids)
    anchor, keys = jnp.array([PROMPTS[0][-1]], jnp.int32), jax.random.split(jax.random.key(0), 1)
    outs = []
    for d in (q8, twin):
        cache = append(d, init_draft_cache(d, 1, 32), tapped, jnp.array([len(PROMPTS[0])]))
        outs.append(D.draft(d, target, cache, anchor, keys, Sampling.rows(1, temperature=1.0)))
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    np.testing.assert_allclose(np.asarray(outs[0].q), np.asarray(outs[1].q), rtol=1e-4, atol=1e-6)
    reference = generate(target, PROMPTS, 16, stop_ids=[]).token_ids
    assert speculative_generate(target, q8, PROMPTS, 16, stop_ids=[], verify=4).token_ids == reference
    assert isinstance(load_draft("init:dflash:4", target, quantize="int8").params.fc, quant.Int8Weight)
    with pytest.raises(ValueError, match="quantize must be"):
        quantize_drafter(drafter, "int4")
