"""Tensor / data parallel decoding on 8 CPU devices (conftest.py asks JAX for 8 before first use).

Every mesh must reproduce single-device greedy output token for token, for a dense Llama (MHA, biases,
tied head), a dense Qwen3 (GQA, qk-norm) and a hybrid Qwen3.5 (Gated DeltaNet + gated attention), with a
random DSpine drafter; and the weights must really be split the way the rules say.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import make_tiny_hf_model
from dspine_jax.pallas import dispatch
from jax.sharding import PartitionSpec as P
from test_hybrid import make_tiny_hybrid

from dspine_jax.decoding import speculative as spec
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.drafters.io import init_drafter
from dspine_jax.models.target import load_target
from dspine_jax.parallel.mesh import make_mesh, use_mesh
from dspine_jax.parallel.sharding import describe, shard_drafter, shard_target

MAX_NEW = 12
PROMPTS = [np.random.default_rng(i).integers(3, 128, n).tolist() for i, n in enumerate([5, 11])]
MESHES = [(2, 1), (4, 1), (8, 1), (1, 2), (4, 2)]  # (tp, dp)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (conftest sets 8 CPU devices)")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Head counts chosen so that every TP degree up to 8 splits attention (llama: 8 heads of MHA;
    qwen3: 16 query / 8 KV heads) and the MLP (width 128)."""
    root = tmp_path_factory.mktemp("sharding")
    shape = dict(hidden_size=64, intermediate_size=128, head_dim=8, initializer_range=0.15)
    dirs = {
        "llama": make_tiny_hf_model("llama", root / "llama", num_attention_heads=8, num_key_value_heads=8,
                                    tie_word_embeddings=True, attention_bias=True, mlp_bias=True, **shape)[0],
        "qwen3": make_tiny_hf_model("qwen3", root / "qwen3", seed=1, num_attention_heads=16, num_key_value_heads=8,
                                    tie_word_embeddings=False, **shape)[0],
        "hybrid": make_tiny_hybrid("qwen3_5_text", root / "hybrid", num_hidden_layers=2,
                                   layer_types=["linear_attention", "full_attention"], num_attention_heads=8, num_key_value_heads=8,
                                   head_dim=8, intermediate_size=128, linear_num_key_heads=4,
                                   linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8)[0],
    }  # fmt: skip
    out = {}
    for name, d in dirs.items():
        target = load_target(d)
        drafter = init_drafter(target, "dspine", num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
                               intermediate_size=128, target_layer_ids=(0, 1), seed=3)  # fmt: skip
        reference = generate(target, PROMPTS, MAX_NEW, stop_ids=[]).token_ids
        single = spec.speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[], verify=drafter.config.block_size)
        assert single.token_ids == reference
        out[name] = (target, drafter, reference, single.acceptance_lengths)
    return out


@pytest.mark.parametrize("tp,dp", MESHES, ids=[f"tp{tp}-dp{dp}" for tp, dp in MESHES])
@pytest.mark.parametrize("family", ["llama", "qwen3", "hybrid"])
def test_sharded_greedy_equals_single_device(models, family, tp, dp):
    target, drafter, reference, acceptance = models[family]
    mesh = make_mesh(tp=tp, dp=dp)
    sharded_target, sharded_drafter = shard_target(target, mesh), shard_drafter(drafter, mesh)
    with use_mesh(mesh):
        result = spec.speculative_generate(sharded_target, sharded_drafter, PROMPTS, MAX_NEW, stop_ids=[], verify=sharded_drafter.config.block_size)
        if (tp, dp) == (4, 2):  # plain autoregressive decoding too, on the mixed mesh
            assert generate(sharded_target, PROMPTS, MAX_NEW, stop_ids=[]).token_ids == reference
    assert result.token_ids == reference
    assert result.acceptance_lengths == acceptance  # the drafter proposed the same tokens


def _shard_shape(array: jax.Array) -> tuple[int, ...]:
    return array.addressable_shards[0].data.shape


def _axes(array: jax.Array) -> tuple[str | None, ...]:
    """The mesh axis of each dimension (JAX drops trailing Nones from specs)."""
    spec = tuple(array.sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


def test_weights_and_caches_are_split_as_the_rules_say(models):
    target, drafter, *_ = models["qwen3"]
    mesh = make_mesh(tp=4, dp=2)
    st, sd = shard_target(target, mesh), shard_drafter(drafter, mesh)
    c = target.config
    layer = st.params.layers[0]
    h, n, k, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    # Column-parallel into heads / MLP width, row-parallel back out, vocab-split head; 1/4 per device.
    assert _axes(layer.qkv) == (None, "model") and _shard_shape(layer.qkv) == (h, (n + 2 * k) * d // 4)
    assert _axes(layer.o) == ("model", None) and _shard_shape(layer.o) == (n * d // 4, h)
    assert _axes(layer.gate_up) == (None, "model") and _shard_shape(layer.gate_up) == (h, 2 * f // 4)
    assert _axes(layer.down) == ("model", None) and _shard_shape(layer.down) == (f // 4, h)
    assert _shard_shape(st.params.lm_head) == (h, c.vocab_size // 4)
    # Small tensors stay whole.
    assert _shard_shape(st.params.embed) == st.params.embed.shape
    assert _shard_shape(layer.input_norm) == layer.input_norm.shape
    assert _shard_shape(sd.params.fc) == sd.params.fc.shape
    dl = sd.params.layers[0]
    assert _axes(dl.q) == (None, "model") and _axes(dl.k) == (None, "model")
    assert _axes(dl.down) == ("model", None)
    # Each device's qkv slice holds whole heads: its own q, k and v heads (group-major columns).
    local = np.asarray(layer.qkv.addressable_shards[0].data)
    full = np.asarray(target.params.layers[0].qkv)
    q_cols, kv_cols = (n // 4) * d, (k // 4) * d
    shard = layer.qkv.addressable_shards[0]
    group = shard.index[1].start // local.shape[1]
    np.testing.assert_array_equal(local[:, :q_cols], full[:, group * q_cols : (group + 1) * q_cols])
    np.testing.assert_array_equal(local[:, q_cols : q_cols + kv_cols], full[:, n * d + group * kv_cols : n * d + (group + 1) * kv_cols])
    # describe() reports the split leaves.
    specs = describe(st)
    assert specs[".params.layers[0].qkv"] == str(P(None, "model"))
    # Caches created inside jit under the mesh: rows on data, KV heads on model.
    with use_mesh(mesh):
        tokens, lengths = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int32), np.array([4, 4], np.int32)
        cache, draft_cache, _ = spec.prefill(st, spec.as_proposer(sd), tokens, lengths, jax.random.key(0),
                                             np.float32(0), np.float32(1), capacity=32, top_k=0, greedy=True)  # fmt: skip
    assert _axes(cache.k[0]) == ("data", "model", None, None)
    assert _shard_shape(cache.k[0]) == (1, k // 4, 32, d)
    assert _shard_shape(cache.lengths) == (1,)
    dc = drafter.config
    ring = draft_cache.ring
    assert _shard_shape(ring.k[0]) == (1, dc.num_kv_heads // 4, ring.k[0].shape[2], dc.head_dim)
    assert _axes(draft_cache.pending)[0] == "data" and _shard_shape(draft_cache.num_pending) == (1,)


def test_pallas_kernels_inside_shard_map(models, monkeypatch):
    """The drafter's Pallas kernels (interpreted here) run per device under a 2×4 mesh — each sees its
    own rows and heads — and give the same greedy output as the XLA reference on one device."""
    from dspine_jax.pallas import draft_attention, transition_cache

    target, drafter, reference, acceptance = models["qwen3"]
    mesh = make_mesh(tp=4, dp=2)
    st, sd = shard_target(target, mesh), shard_drafter(drafter, mesh)
    seen = {"attention": set(), "transition": set()}
    for module, fn_name, key in [(draft_attention, "draft_attention_pallas", "attention"),
                                 (transition_cache, "transition_scores_pallas", "transition")]:  # fmt: skip
        original = getattr(module, fn_name)

        def spy(first, *args, _original=original, _key=key, **kwargs):
            seen[_key].add(first.shape)
            return _original(first, *args, **kwargs)

        monkeypatch.setattr(module, fn_name, spy)
    with dispatch.force("interpret"), use_mesh(mesh):
        result = spec.speculative_generate(st, sd, PROMPTS, MAX_NEW, stop_ids=[], verify=sd.config.block_size)
    assert result.token_ids == reference
    assert result.acceptance_lengths == acceptance
    n, d = drafter.config.num_heads, drafter.config.head_dim
    assert seen["attention"] and all(s[0] == 1 and s[2:] == (n // 4, d) for s in seen["attention"])  # [B/2, T, N/4, D]
    assert seen["transition"] and all(s[0] == 1 for s in seen["transition"])  # rows split over data


def test_mesh_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(tp=8, dp=2)
    with pytest.raises(ValueError, match=">= 1"):
        make_mesh(tp=0)


def test_uneven_heads_fall_back_to_replicated_attention(tiny_models):
    """conftest's Llama has 4 query / 2 KV heads: on a 4-way model axis attention stays whole (KV heads
    cannot split 4 ways) while the MLP still splits, and decoding is unchanged."""
    target = load_target(tiny_models["llama"][0])
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
    mesh = make_mesh(tp=4)
    st, sd = shard_target(target, mesh), shard_drafter(drafter, mesh)
    layer = st.params.layers[0]
    assert _axes(layer.qkv) == (None, None) and layer.qkv_groups == 1
    assert _axes(layer.gate_up) == (None, "model") and layer.mlp_groups == 4
    assert _axes(sd.params.layers[0].q) == (None, None)  # drafter: 4 query / 2 KV heads as well
    reference = spec.speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[], verify=drafter.config.block_size)
    with use_mesh(mesh):
        result = spec.speculative_generate(st, sd, PROMPTS, MAX_NEW, stop_ids=[], verify=sd.config.block_size)
    assert result.token_ids == reference.token_ids


def test_gdn_conv_channels_split_by_heads(models):
    """A hybrid's Gated-DeltaNet q|k|v conv channels are regrouped so each model shard holds its own key
    and value heads; regrouping there and back is the identity."""
    from dspine_jax.models import gdn, panels

    target, *_ = models["hybrid"]
    c = target.config
    params = panels.unpack_params(target.params)  # raw layouts (a CPU target's matrices come packed)
    layer = next(lp.mixer for lp in params.layers if isinstance(lp.mixer, gdn.GdnParams))
    back = gdn.regroup(gdn.regroup(layer, c.linear_num_key_heads, 4), c.linear_num_key_heads, 1)
    np.testing.assert_array_equal(np.asarray(back.qkv), np.asarray(layer.qkv))
    np.testing.assert_array_equal(np.asarray(back.conv), np.asarray(layer.conv))

    st = shard_target(target, make_mesh(tp=4, dp=2))
    sharded = next(lp.mixer for lp in st.params.layers if isinstance(lp.mixer, gdn.GdnParams))
    assert sharded.groups == 4 and _axes(sharded.qkv) == (None, "model") and _axes(sharded.conv) == ("model", None)
    key_dim, value_dim = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    shard = sharded.qkv.addressable_shards[0]
    group = shard.index[1].start // shard.data.shape[1]
    kq, vq = key_dim // 4, value_dim // 4
    full = np.asarray(layer.qkv)
    expected = np.concatenate([full[:, group * kq : (group + 1) * kq], full[:, key_dim + group * kq : key_dim + (group + 1) * kq],
                               full[:, 2 * key_dim + group * vq : 2 * key_dim + (group + 1) * vq]], axis=1)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(shard.data), expected)
