"""int8 KV cache (``kv_cache_dtype="int8"``, ``models/cache.py`` ``Int8KV``): the rounding bound of quantise →
dequantise, attention through the scales against attention over the dequantised cache, the cache layouts
(GDN state stays float32, the drafter's ring follows the target), and speculative decoding staying exact
with respect to the served int8-KV target: greedy speculative == greedy AR of the same int8-KV model for
a dense and a hybrid target (random drafter and an oracle forcing every acceptance length, so rejected
K/V beyond the committed length and GDN replay both run), on a 2×2 CPU mesh, and through the serving
engine (capacity buckets and the prefix cache)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_tiny_hf_model
from test_speculative import oracle

from dspine_jax.decoding import speculative as spec
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.drafters.io import init_drafter
from dspine_jax.drafters.proposer import DrafterProposer
from dspine_jax.drafters.ring import DraftCache
from dspine_jax.models import cache as kv
from dspine_jax.models import target as tgt
from dspine_jax.models.layers import cached_attention

MAX_NEW = 20
VERIFY = 5  # the oracle's verify length: acceptance 0…4
PROMPTS = [[5, 17, 33, 9, 60, 11], [7, 3, 99]]


def test_quantise_dequantise_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 16)).astype(np.float32) * rng.uniform(0.01, 5.0, (2, 3, 5, 1)).astype(np.float32)
    x[0, 1, 2] = 0.0  # an all-zero vector (an unwritten-looking token)
    q, scale = kv.quantize_kv(jnp.asarray(x))
    q, scale = np.asarray(q), np.asarray(scale)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (2, 3, 5, 1)
    amax = np.abs(x).max(-1, keepdims=True)
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    nonzero = amax[..., 0] > 0
    assert np.all(np.abs(q).max(-1)[nonzero] == 127)  # every vector uses the whole range
    err = np.abs(q * scale - x)
    assert np.all(err <= scale / 2 * (1 + 1e-6))
    assert np.all(q[0, 1, 2] == 0)

    # Written into a cache: the block's slots hold exactly its quantisation, the others stay empty.
    buf = kv.kv_zeros((2, 3, 12, 16), jnp.float32, "int8")
    block = jnp.asarray(x.transpose(0, 2, 1, 3))  # [B, T, K, D] as the forward produces it
    lengths = jnp.asarray([4, 7], jnp.int32)
    written = kv.write_block(buf, block, lengths)
    deq = np.asarray(kv.dequantize_kv(written, jnp.float32))
    for row, start in enumerate([4, 7]):
        np.testing.assert_array_equal(deq[row, :, start : start + 5], q[row] * scale[row])
        assert np.all(deq[row, :, :start] == 0) and np.all(deq[row, :, start + 5 :] == 0)
    # The scatter path (many rows) stores the same bytes as the row loop.
    scattered = kv.write_block(buf, block, lengths, scatter_above=0)
    np.testing.assert_array_equal(np.asarray(scattered.q), np.asarray(written.q))
    np.testing.assert_array_equal(np.asarray(scattered.scale), np.asarray(written.scale))


@pytest.mark.parametrize("t", [1, 4])  # the multiply-and-reduce decode path and the dot path
def test_attention_through_scales_equals_attention_over_the_dequantised_cache(t):
    rng = np.random.default_rng(t)
    b, n, k, s, d = 2, 4, 2, 9, 16
    q = jnp.asarray(rng.standard_normal((b, t, n, d)).astype(np.float32))
    # Per-token magnitudes vary, as real K/V do (the scales must follow them).
    keys, values = (rng.standard_normal((b, k, s, d)) * rng.uniform(0.1, 4.0, (b, k, s, 1)) for _ in range(2))
    keys, values = keys.astype(np.float32), values.astype(np.float32)
    kq, ks = kv.quantize_kv(jnp.asarray(keys))
    vq, vs = kv.quantize_kv(jnp.asarray(values))
    visible = jnp.asarray(rng.random((b, t, s)) < 0.7).at[:, :, 0].set(True)
    got = cached_attention(q, kq, vq, visible, ks, vs)
    want = cached_attention(q, kq.astype(jnp.float32) * ks, vq.astype(jnp.float32) * vs, visible)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # ... and the int8 cache really is lossy: not the float attention.
    exact = cached_attention(q, jnp.asarray(keys), jnp.asarray(values), visible)
    assert 0 < np.abs(np.asarray(got) - np.asarray(exact)).max() < 0.05 * np.abs(np.asarray(exact)).max()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """test_speculative's varied-output Llama (f32 K/V) and the same weights with int8 K/V."""
    d = make_tiny_hf_model("llama", tmp_path_factory.mktemp("kv8") / "llama", initializer_range=0.15,
                           tie_word_embeddings=True, attention_bias=True, mlp_bias=True)[0]  # fmt: skip
    target = tgt.load_target(d)
    return target, tgt.load_target(d, kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from test_hybrid import make_tiny_hybrid

    d = make_tiny_hybrid("qwen3_5_text", tmp_path_factory.mktemp("kv8h") / "qwen3_5", seed=0)[0]
    return tgt.load_target(d, kv_cache_dtype="int8")


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_int8_caches_layout_memory_and_errors(dense, hybrid, monkeypatch):
    f32, q8 = dense
    c = q8.config
    cache = tgt.init_cache(q8, 2, 32)
    assert all(isinstance(x, kv.Int8KV) for x in cache.k + cache.v)
    assert cache.k[0].q.dtype == jnp.int8 and cache.k[0].scale.dtype == jnp.float32
    assert cache.k[0].q.shape == (2, c.num_kv_heads, 32, c.head_dim)
    assert cache.k[0].scale.shape == (2, c.num_kv_heads, 32, 1)
    assert cache.capacity == 32 and cache.with_capacity(48).capacity == 48
    assert cache.with_capacity(8).k[0].scale.shape == (2, c.num_kv_heads, 8, 1)
    float_cache = tgt.init_cache(f32, 2, 32)
    # D int8 values + one f32 scale against D f32 values per head and token: (D + 4) / 4D of the bytes.
    assert _nbytes((cache.k, cache.v)) * 4 * c.head_dim == _nbytes((float_cache.k, float_cache.v)) * (c.head_dim + 4)
    # The drafter's ring follows the target's setting; the hybrid's GDN state stays float32.
    drafter = init_drafter(q8, "dspine", num_layers=1, block_size=4, top_k=4, seed=3)
    ring = DrafterProposer(drafter).init(q8, 2, 32).ring
    assert isinstance(ring, DraftCache) and all(isinstance(x, kv.Int8KV) for x in ring.k + ring.v)
    assert not isinstance(DrafterProposer(drafter).init(f32, 2, 32).ring.k[0], kv.Int8KV)
    hc = tgt.init_cache(hybrid, 1, 16)
    assert all(isinstance(x, kv.Int8KV) for x in hc.k + hc.v)
    assert {x.dtype for x in hc.conv + hc.state} == {jnp.dtype(jnp.float32)}
    # Teacher-forced logits: close to the float cache's, but not equal (the K/V really are int8).
    seq = jnp.asarray([PROMPTS[0] + PROMPTS[1]])
    a, b = (np.asarray(tgt.lm_logits(t, tgt.forward(t, tgt.init_cache(t, 1, 16), seq).hidden)) for t in (q8, f32))
    assert 0 < np.abs(a - b).max() < 0.05 * np.abs(b).max()

    assert tgt.with_kv_cache_dtype(q8, "none").kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        tgt.load_target(q8.model_dir, kv_cache_dtype="fp8")
    # A family that does not declare int8 K/V says so instead of ignoring the option.
    auto_only = dataclasses.replace(f32.family, kv_cache_dtypes=("auto",))
    monkeypatch.setattr(tgt, "family_for", lambda model_type: auto_only)
    with pytest.raises(ValueError, match="has no int8 KV cache"):
        tgt.with_kv_cache_dtype(f32, "int8")
    with pytest.raises(ValueError, match="has no int8 KV cache"):
        tgt.init_cache(q8, 1, 8)


def test_greedy_speculative_equals_ar_of_the_int8_kv_dense_target(dense):
    _, target = dense
    reference = generate(target, PROMPTS, MAX_NEW, stop_ids=[]).token_ids
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=4, seed=3)
    assert spec.speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[], verify=4).token_ids == reference
    # An oracle: rounds keep 1…5 tokens, rejected K/V stay in the buffer beyond the committed length.
    accept = (np.arange(len(PROMPTS))[:, None] + np.arange(VERIFY)[None, :]) % VERIFY
    result = spec.speculative_generate(target, oracle(reference, accept, target.config.vocab_size), PROMPTS, MAX_NEW,
                                       stop_ids=[], block_size=VERIFY)  # fmt: skip
    assert result.token_ids == reference
    assert {a for raw in result.accepted_proposals for a in raw[:-1]} == set(range(VERIFY))


def test_greedy_speculative_equals_ar_of_the_int8_kv_hybrid_target(hybrid):
    """An oracle forcing partial accepts of every length: the GDN state is replayed next to int8 K/V."""
    target = hybrid
    for prompt in PROMPTS:  # one row each: AR prefill of right-padded rows keeps pads in the GDN state
        reference = generate(target, [prompt], MAX_NEW, stop_ids=[]).token_ids
        proposer = oracle(reference, np.asarray([[2, 0, 4, 1, 3]]), target.config.vocab_size)
        result = spec.speculative_generate(target, proposer, [prompt], MAX_NEW, stop_ids=[], block_size=VERIFY)
        assert result.token_ids == reference
        assert set(result.accepted_proposals[0][:-1]) == set(range(VERIFY))


def _axes(array: jax.Array) -> tuple[str | None, ...]:
    spec_ = tuple(array.sharding.spec)
    return spec_ + (None,) * (array.ndim - len(spec_))


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest sets 8 CPU devices)")
def test_int8_kv_on_a_mesh_equals_one_device(dense):
    """tp=2 × dp=2: the scales are split like their K/V (rows on data, KV heads on model), and greedy
    speculative output equals the single-device int8-KV output."""
    from dspine_jax.parallel.mesh import make_mesh, use_mesh
    from dspine_jax.parallel.sharding import shard_drafter, shard_target

    _, target = dense
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=4, seed=3)
    single = spec.speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[], verify=4)
    mesh = make_mesh(tp=2, dp=2)
    st, sd = shard_target(target, mesh), shard_drafter(drafter, mesh)
    assert st.kv_cache_dtype == "int8"
    with use_mesh(mesh):
        result = spec.speculative_generate(st, sd, PROMPTS, MAX_NEW, stop_ids=[], verify=4)
        tokens, lengths = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int32), np.array([4, 4], np.int32)
        cache, ring, _ = spec.prefill(st, spec.as_proposer(sd), tokens, lengths, jax.random.key(0), np.float32(0),
                                      np.float32(1), capacity=32, top_k=0, greedy=True)  # fmt: skip
    assert result.token_ids == single.token_ids
    assert result.acceptance_lengths == single.acceptance_lengths
    kh = target.config.num_kv_heads
    for buf in (cache.k[0], cache.v[-1], ring.ring.k[0]):
        assert _axes(buf.q) == _axes(buf.scale) == ("data", "model", None, None)
        assert buf.scale.addressable_shards[0].data.shape == (1, kh // 2, buf.shape[2], 1)


def test_int8_kv_engine_equals_generate(dense):
    """The serving engine on int8 K/V: a multi-turn transcript whose rows start from the prefix cache and
    grow past the first capacity bucket (a refit and a start_row resize of int8 caches and rings)."""
    from test_serve_engine import run_multi_turn

    from dspine_jax.serve.engine import EngineCore

    _, target = dense
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    core = EngineCore(target, drafter, num_slots=2, context_length=300, stop_ids=[], verify=4,
                      prefix_cache_bytes=1 << 30, max_prompt_bucket=32)  # fmt: skip
    assert core.capacity_buckets == [128, core.capacity] and isinstance(core.cache.k[0], kv.Int8KV)
    rng = np.random.default_rng(4)
    turns = [(rng.integers(3, 120, n).tolist(), 12) for n in (100, 5, 5)]
    prompts, answers = run_multi_turn(core, turns)
    assert len(prompts[-1]) > 128  # the last turns ran in the larger bucket
    assert answers == generate(target, prompts, 12, stop_ids=[]).token_ids  # (dense rows: one batch, one compile)
    stats = core.prefix_stats()
    assert stats.hits == 2 and stats.hit_tokens == sum(len(p) + len(a) - 1 for p, a in zip(prompts[:-1], answers[:-1]))
    assert isinstance(core.pstate.ring.k[0], kv.Int8KV) and core.pstate.ring.capacity == core.cache_capacity
