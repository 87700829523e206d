"""The CPU panel kernel (``models/panels.py``, ``kernels/cpu/panel_matmul.cc``): equal to its reference (XLA's
matmul on the unpacked matrix) to float tolerance for every row count, the same bits for a row whatever rows
surround it (why greedy speculative output equals plain greedy output by construction), and a packed target
that decodes like an unpacked one."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import init_drafter, load_draft
from dspine_jax.drafters.params import pack_drafter
from dspine_jax.models import panels, quant
from dspine_jax.models.target import QUANTIZED_MATRICES, load_target
from dspine_jax.parallel.mesh import make_mesh
from dspine_jax.parallel.sharding import shard_drafter, shard_target

pytestmark = pytest.mark.skipif(not panels.kernel_available(), reason="no C++ compiler: the kernel cannot build")


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17, 300])
def test_kernel_matches_its_reference(rows):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((96, 160), np.float32)
    x = jnp.asarray(rng.standard_normal((rows, 96), np.float32))
    packed = panels.pack(w)
    assert packed.shape == (96, 160) and np.array_equal(np.asarray(packed.unpacked()), w)
    got = np.asarray(jax.jit(lambda x, p: x @ p)(x, packed))
    np.testing.assert_allclose(got, np.asarray(x) @ w, rtol=2e-5, atol=2e-5)


def test_a_rows_product_is_the_same_bits_in_any_block():
    rng = np.random.default_rng(0)
    packed = panels.pack(rng.standard_normal((576, 1024), np.float32))
    block = jnp.asarray(rng.standard_normal((12, 576), np.float32))
    product = jax.jit(lambda x, p: x @ p)
    alone = np.stack([np.asarray(product(block[i : i + 1], packed))[0] for i in range(12)])
    for t in (2, 3, 4, 5, 7, 8, 12):  # row groups of 8 (AVX-512) or 6, passes of 1–4 panels
        np.testing.assert_array_equal(np.asarray(product(block[:t], packed)), alone[:t])
    # Leading axes are rows too ([B, T, K]), and vmap over rows keeps the bits.
    np.testing.assert_array_equal(np.asarray(product(block.reshape(3, 4, 576), packed)).reshape(12, -1), alone)
    np.testing.assert_array_equal(np.asarray(jax.vmap(product, in_axes=(0, None))(block[:, None], packed))[:, 0], alone)


def assert_float32_product(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """``got`` is ``x @ w`` summed in float32: within the rounding bound of a sum of K products
    (|error| ≤ γ_K · Σ_k |x_k w_k|, γ_K = K·u / (1 - K·u)) of the exact product, computed in float64. (A float32
    BLAS reference has rounding errors of its own, which vary with the machine's kernels: against one, elements
    where the sum cancels were off by more than a fixed tolerance.)"""
    k, u = x.shape[-1], np.finfo(np.float32).eps / 2
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bound = k * u / (1 - k * u) * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)


def bf16_values(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """float32 values that are all bfloat16 values (a bfloat16 checkpoint loaded as float32)."""
    return np.array(jnp.asarray(rng.standard_normal(shape, np.float32)).astype(jnp.bfloat16).astype(jnp.float32))


def bf16_rounded(params):
    """``params`` unpacked, every float32 leaf rounded to bfloat16 values (kept in float32)."""
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype) if x.dtype == jnp.float32 else x,
                        panels.unpack_params(params))  # fmt: skip


def test_a_bfloat16_matrix_is_packed_in_bfloat16_with_the_same_products():
    """A matrix whose values are all bfloat16 packs in half the bytes, and its products are the float32 packing's
    bits for every row count; a single value off bfloat16 keeps the matrix in float32."""
    rng = np.random.default_rng(2)
    w = bf16_values(rng, (576, 1024))
    compact = panels.pack(w)
    wide = panels.widen_params(compact)
    assert compact.panels.dtype == jnp.bfloat16 and compact.dtype == jnp.float32
    assert compact.panels.nbytes * 2 == wide.panels.nbytes
    np.testing.assert_array_equal(np.asarray(compact.unpacked()), w)
    product = jax.jit(lambda x, p: x @ p)
    for t in (1, 2, 3, 4, 5, 8, 9):
        x = jnp.asarray(rng.standard_normal((t, 576), np.float32))
        got = np.asarray(product(x, compact))
        np.testing.assert_array_equal(got, np.asarray(product(x, wide)))
        assert_float32_product(got, np.asarray(x), w)
    ids = jnp.asarray([[0, 17], [1023, 5]])
    columns = quant.take_columns(compact, ids)
    assert columns.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(columns), np.take(w, np.asarray(ids), axis=1))
    w[3, 7] = np.nextafter(w[3, 7], np.float32(np.inf))
    assert panels.pack(w).panels.dtype == jnp.float32


def test_packed_matrices_stand_in_for_arrays():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 48), np.float32)
    packed = panels.pack(w)
    ids = jnp.asarray([[0, 17], [47, 5]])
    np.testing.assert_array_equal(np.asarray(quant.take_columns(packed, ids)), np.take(w, np.asarray(ids), axis=1))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(packed)), w)
    x = jnp.asarray(rng.standard_normal((2, 32), np.float32))
    np.testing.assert_allclose(np.asarray(quant.matmul_f32(x, packed)), np.asarray(x) @ w, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        panels.pack(w[:, :40])
    with pytest.raises(ValueError, match="products must be"):
        panels.resolve_products("fast", {})


def test_a_packed_target_decodes_like_xlas_products(tiny_models):
    plain = load_target(tiny_models["llama"][0], products="xla")
    packed = load_target(tiny_models["llama"][0])
    assert panels.is_packed(packed.params) and not panels.is_packed(plain.params)
    assert not panels.is_packed(panels.unpack_params(packed.params))
    prompt = [[5, 17, 33, 9, 60, 11], [7, 3]]
    reference = generate(plain, prompt, 24, stop_ids=[]).token_ids
    assert generate(packed, prompt, 24, stop_ids=[]).token_ids == reference
    drafter = init_drafter(packed, "dspine", num_layers=1, block_size=4, top_k=4, seed=3)
    for t in (2, 4):
        assert speculative_generate(packed, drafter, prompt, 24, stop_ids=[], verify=t).token_ids == reference


def test_a_drafter_loaded_for_a_packed_target_is_packed_too(tiny_models):
    """``load_draft`` packs the drafter's linear weights and draft head like its target's (``pack_drafter``);
    speculative output stays the target's greedy output, and a mesh gets plain arrays back."""
    packed = load_target(tiny_models["llama"][0])
    plain = load_target(tiny_models["llama"][0], products="xla")
    drafter = load_draft("init:dspine:4", packed)
    assert panels.is_packed(drafter.params) and not panels.is_packed(load_draft("init:dspine:4", plain).params)
    assert isinstance(drafter.params.fc, panels.PanelWeight)
    prompt = [[5, 17, 33, 9, 60, 11]]
    reference = generate(packed, prompt, 20, stop_ids=[]).token_ids
    assert speculative_generate(packed, drafter, prompt, 20, stop_ids=[], verify=4).token_ids == reference
    mesh = make_mesh(tp=1, dp=1)
    assert not panels.is_packed(shard_drafter(drafter, mesh).params)
    assert not panels.is_packed(shard_target(packed, mesh).params)


def test_a_bfloat16_drafter_drafts_the_same_from_bfloat16_panels(tiny_models):
    """A drafter whose weights are bfloat16 values (as a bfloat16 checkpoint loads) packs its matrices in
    bfloat16; it proposes what the same drafter with float32 panels proposes, and decoding stays exact."""
    packed = load_target(tiny_models["llama"][0])
    drafter = load_draft("init:dspine:4", packed)
    compact = pack_drafter(drafter.replace(params=bf16_rounded(drafter.params)), packed)
    wide = drafter.replace(params=panels.widen_params(compact.params))
    assert compact.params.fc.panels.dtype == jnp.bfloat16 and wide.params.fc.panels.dtype == jnp.float32
    prompt = [[5, 17, 33, 9, 60, 11], [7, 3]]
    reference = generate(packed, prompt, 20, stop_ids=[]).token_ids
    runs = [speculative_generate(packed, d, prompt, 20, stop_ids=[], verify=4) for d in (compact, wide)]
    assert runs[0].token_ids == runs[1].token_ids == reference
    assert runs[0].acceptance_lengths == runs[1].acceptance_lengths


def test_a_target_holding_bfloat16_values_decodes_the_same_from_bfloat16_panels(tiny_models):
    """A target whose weights are bfloat16 values (a bfloat16 checkpoint loaded as float32) packs its matrices and
    head in bfloat16 and decodes the tokens it decodes from float32 panels."""
    packed = load_target(tiny_models["llama"][0])
    compact = packed.replace(params=panels.pack_params(bf16_rounded(packed.params), QUANTIZED_MATRICES))
    wide = packed.replace(params=panels.widen_params(compact.params))
    assert compact.params.lm_head.panels.dtype == jnp.bfloat16 and wide.params.lm_head.panels.dtype == jnp.float32
    prompt = [[5, 17, 33, 9, 60, 11], [7, 3]]
    assert generate(compact, prompt, 24, stop_ids=[]).token_ids == generate(wide, prompt, 24, stop_ids=[]).token_ids


def test_without_a_compiler_the_target_keeps_xlas_products(tmp_path):
    """A machine that cannot build the kernel warns once and decodes with XLA's matmuls (``products="auto"``)."""
    env = {**os.environ, "CXX": "no-such-compiler", "DSPINE_JAX_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    probe = "from dspine_jax.models import panels; print(panels.resolve_products('auto', {}))"
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "xla" and "did not build" in run.stderr


def test_auto_packs_only_on_cpus_the_kernel_was_tuned_for(monkeypatch):
    """``"auto"`` keeps XLA's products on a CPU without AVX2 and FMA, or not x86-64 (the kernel's shapes were never
    timed there); asking for ``"panels"`` still packs."""
    params = {"w": np.zeros((4, 16), np.float32)}
    monkeypatch.setattr(panels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(panels, "cpu_flags", lambda: {"sse4_2", "avx"})
    assert panels.resolve_products("auto", params) == "xla"
    assert panels.resolve_products("panels", params) == "panels"
    monkeypatch.setattr(panels, "cpu_flags", lambda: {"sse4_2", "avx", "avx2", "fma"})
    assert panels.resolve_products("auto", params) == "panels"
    monkeypatch.setattr(panels.platform, "machine", lambda: "aarch64")
    assert panels.resolve_products("auto", params) == "xla"
