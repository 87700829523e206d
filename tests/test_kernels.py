"""Pallas kernels (kernels/pallas) in interpret mode against their jnp references, the references against
the drafter's own code, the tile schedule, the dispatcher, cross-platform lowering, and the drafter's
``draft`` with the interpret path forced.

Every kernel run uses fresh random inputs (the seed is in the failure message), poisons its output buffer
with NaN (``poison=True``: a NaN-filled buffer aliased to the output, so an element the kernel does not
write stays NaN) and must be finite before it is compared. Sizes are tiny: interpret mode compiles a scan
over the grid, and compilation dominates on CPU.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import missing_reference
from drafter_helpers import with_random_injection
from dspine_jax.pallas import dispatch
from dspine_jax.pallas import draft_attention as DA
from dspine_jax.pallas import transition_cache as TC
from jax.experimental import pallas as pl

from dspine_jax.drafters import drafter as D
from dspine_jax.drafters import params as params_mod
from dspine_jax.drafters.dspine import SPINE
from dspine_jax.drafters.ring import append_context, init_draft_cache
from dspine_jax.models.layers import MASK_VALUE
from dspine_jax.models.sampling import Sampling

F32_TOL, BF16_TOL = 1e-5, 2e-2
FLAVORS = ["gpu", "tpu"]


def interpret(flavor: str) -> dispatch.Backend:
    return dispatch.Backend("interpret", flavor=flavor, interpret=True)


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def assert_close(out, ref, tol: float, msg: str = "") -> None:
    """Finite first (NaN never passes), then max |out - ref| ≤ tol · max |ref| (ref in float32)."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape, msg
    assert np.isfinite(out).all(), f"non-finite kernel output ({np.isnan(out).sum()} NaN) {msg}"
    assert np.isfinite(ref).all(), f"non-finite reference {msg}"
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= tol, f"relative error {err:.3g} > {tol} {msg}"


def test_assert_close_rejects_nan_and_poison_marks_unwritten():
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(np.array([1.0, np.nan]), np.array([1.0, 1.0]), 1.0)

    # The poisoning pattern the kernels use: an aliased NaN buffer keeps whatever the kernel skips.
    def half(x_ref, poison_ref, o_ref):
        del poison_ref

        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    x = jnp.ones((16, 8), jnp.float32)
    out = pl.pallas_call(
        half,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 8), lambda i: (i, 0))] * 2,
        out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)),
        input_output_aliases={1: 0},
        interpret=True,
    )(x, jnp.full(x.shape, jnp.nan))
    out = np.asarray(out)
    assert np.isfinite(out[:8]).all() and np.isnan(out[8:]).all()


# ----------------------------------------------------------------------------------------------
# Draft attention


def normal(rng: np.random.Generator, shape: tuple[int, ...], dtype, scale: float = 1.0) -> jax.Array:
    # numpy, not jax.random: no compilation per shape (compiles dominate this file's runtime on CPU)
    return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def attention_inputs(seed: int, b, t, n, kh, d, s, dtype) -> tuple[jax.Array, ...]:
    """q [B,T,N,D], ctx_k/ctx_v [B,K,S,D], k/v [B,T,K,D]."""
    rng = np.random.default_rng(seed)
    shapes = [(b, t, n, d), (b, kh, s, d), (b, kh, s, d), (b, t, kh, d), (b, t, kh, d)]
    return tuple(normal(rng, shape, dtype) for shape in shapes)


def test_mask_value_matches_the_library():
    """kernels/ cannot import the library (which imports the kernels), so it repeats the constant."""
    assert DA.MASK_VALUE == MASK_VALUE


# (block T, heads N, kv heads K, head_dim D, ring S, window W, causal, dtype): windows below the context,
# above it (W > S: the ring caps), none; block sizes 4/8/16; ragged lengths always include 0, the capacity
# S, a partial ring and a wrapped one.
F32, BF16 = jnp.float32, jnp.bfloat16
ATTENTION_CASES = [
    (4, 4, 2, 16, 24, 6, True, F32),  # window < context, GQA 2
    (8, 3, 1, 32, 20, 64, True, F32),  # window > context, GQA 3 (T*G = 24: not a power of two)
    (16, 2, 2, 8, 40, 0, True, F32),  # unwindowed, MHA, S not a multiple of the tile
    (8, 4, 2, 16, 33, 5, False, F32),  # DFlash bidirectional, window < block size
    (4, 6, 2, 24, 12, 0, False, F32),  # bidirectional unwindowed, head_dim 24 (padded on the GPU flavor)
    (16, 8, 1, 136, 20, 7, True, F32),  # 128 query rows x head_dim 136→256: GPU flavor splits the rows
    (16, 4, 2, 16, 24, 9, True, BF16),
    (8, 3, 1, 32, 20, 64, True, BF16),
    (4, 4, 2, 16, 33, 5, False, BF16),
]


def _case_id(c) -> str:
    t, n, kh, d, s, w, causal, dtype = c
    return f"T{t}-N{n}-K{kh}-D{d}-S{s}-W{w}-{'causal' if causal else 'bidir'}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
def test_draft_attention_matches_reference(case, flavor):
    t, n, kh, d, s, window, causal, dtype = case
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lengths = jnp.array([0, s, int(rng.integers(1, s)), s + int(rng.integers(1, 3 * s))], jnp.int32)
    q, ck, cv, k, v = attention_inputs(seed, 4, t, n, kh, d, s, dtype)
    reference = functools.partial(DA.draft_attention_reference, window=window, causal=causal)
    ref = jax.jit(reference)(q, ck, cv, k, v, lengths)
    tile = 8 if flavor == "tpu" else 16  # several tiles per ring, a ragged last one
    out = jax.jit(
        lambda *a: DA.draft_attention_pallas(
            *a, window=window, causal=causal, backend=interpret(flavor), block_kv=tile, poison=True
        )
    )(q, ck, cv, k, v, lengths)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref, F32_TOL if dtype == jnp.float32 else BF16_TOL, f"seed={seed} lengths={lengths}")


@pytest.mark.parametrize("flavor", FLAVORS)
def test_draft_attention_never_reads_invisible_slots(flavor):
    """NaN in every ring slot no query may see (empty, out of the window, beyond the capacity's tail) does
    not reach the output: skipped tiles are not read and masked scores get exactly zero weight."""
    t, n, kh, d, s, window = 4, 4, 2, 16, 40, 9
    seed = fresh_seed()
    lengths = jnp.array([0, 5, 23, 77], jnp.int32)
    q, ck, cv, k, v = attention_inputs(seed, 4, t, n, kh, d, s, jnp.float32)
    seen = np.asarray(DA.visible_mask(lengths, s, t, window, True)[:, :, :s].any(axis=1))  # [B, S]
    poison = lambda x: jnp.where(jnp.asarray(seen)[:, None, :, None], x, jnp.nan)  # noqa: E731
    ref = jax.jit(functools.partial(DA.draft_attention_reference, window=window, causal=True))(q, ck, cv, k, v, lengths)
    out = DA.draft_attention_pallas(
        q, poison(ck), poison(cv), k, v, lengths, window=window, causal=True, backend=interpret(flavor), block_kv=8
    )
    assert_close(out, ref, F32_TOL, f"seed={seed}")


def test_row_schedule_visits_exactly_the_needed_tiles():
    """The per-row tile range is the set of tiles holding a slot some query sees: no tile missed, none
    twice, none extra (wholly invisible tiles are skipped) — brute force from the ring formula over
    capacities, tiles, windows and lengths (0, the capacity, wrapped rings)."""
    rng = np.random.default_rng(fresh_seed())
    schedule = jax.jit(DA.row_schedule, static_argnums=(1, 2, 3))
    for _ in range(25):
        s, tile = int(rng.integers(1, 50)), int(rng.integers(1, 20))
        window = int(rng.choice([0, int(rng.integers(1, 70))]))
        lengths = np.array([0, s, s + 1, *rng.integers(0, 4 * s + 2, 5)], np.int32)
        info = np.asarray(schedule(jnp.asarray(lengths), s, tile, window))
        n_tiles = -(-s // tile)
        for row, length in enumerate(lengths):
            last = int(length) - 1
            key_pos = last - np.mod(last - np.arange(s), s)  # ring.context_slot_positions
            seen = (key_pos >= 0) & ((window == 0) | (length - key_pos < window))  # query 0 is the loosest
            needed = set((np.flatnonzero(seen) // tile).tolist())
            first, count = int(info[row, 3]), int(info[row, 4])
            visited = [(first + j) % n_tiles for j in range(count)]
            assert len(set(visited)) == len(visited) and set(visited) == needed, (s, tile, window, length)


# ----------------------------------------------------------------------------------------------
# Transition cache


def transition_inputs(seed: int, b, p, c, r, m, h, dtype) -> tuple:
    """pre [B,P,H], receiver_logit [B,P,M], codes [B,P,C,R] (√R-scale), head_rows [B,P,C,H], weights."""
    rng = np.random.default_rng(seed)
    weights = TC.LWRWeights(
        predecessor_gate=normal(rng, (r, m), dtype, r**-0.5),
        message=normal(rng, (r, m), dtype, r**-0.5),
        bias=normal(rng, (m,), dtype, 0.1),
        write=normal(rng, (m, h), dtype, m**-0.5),
        norm=(1.0 + normal(rng, (h,), jnp.float32, 0.1)).astype(dtype),
    )
    return (
        normal(rng, (b, p, h), dtype),
        normal(rng, (b, p, m), dtype),
        normal(rng, (b, p, c, r), dtype, float(np.sqrt(r))),
        normal(rng, (b, p, c, h), dtype, 0.2),
        weights,
    )


# (C, P, R, M, H, dtype): C = 4 and 16; R/M that are not powers of two (padded on the GPU flavor); P = 15.
TRANSITION_CASES = [
    (4, 3, 12, 8, 64, F32),
    (4, 3, 12, 8, 64, BF16),
    (16, 7, 40, 24, 96, F32),
    (16, 15, 64, 32, 48, F32),
    (16, 15, 64, 32, 48, BF16),
]


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize(
    "c, p, r, m, h, dtype",
    TRANSITION_CASES,
    ids=[f"C{c}-P{p}-R{r}-M{m}-H{h}-{jnp.dtype(dt).name}" for c, p, r, m, h, dt in TRANSITION_CASES],
)
def test_transition_cache_matches_reference(c, p, r, m, h, dtype, flavor):
    seed = fresh_seed()
    pre, rl, codes, rows, weights = transition_inputs(seed, 2, p, c, r, m, h, dtype)
    ref = jax.jit(TC.transition_scores_reference, static_argnums=5)(pre, rl, codes, rows, weights, 1e-6)
    out = jax.jit(
        lambda *a: TC.transition_scores_pallas(*a, 1e-6, backend=interpret(flavor), poison=True)
    )(pre, rl, codes, rows, weights)
    assert out.dtype == jnp.float32 and out.shape == (2, p, c, c)
    assert_close(out, ref, F32_TOL if dtype == jnp.float32 else BF16_TOL, f"seed={seed}")


def test_transition_cache_gpu_flavor_chunks_hidden_and_rank():
    """Large R/M force the GPU flavor's chunked loops over R and H (64 KiB operand tiles)."""
    seed = fresh_seed()
    pre, rl, codes, rows, weights = transition_inputs(seed, 1, 2, 4, 256, 256, 512, jnp.float32)
    ref = TC.transition_scores_reference(pre, rl, codes, rows, weights, 1e-6)
    assert TC._gpu_chunk(512, 256, 4, "h") < 512 and TC._gpu_chunk(256, 256, 4, "r") < 256
    out = TC.transition_scores_pallas(pre, rl, codes, rows, weights, 1e-6, backend=interpret("gpu"), poison=True)
    assert_close(out, ref, F32_TOL, f"seed={seed}")


# ----------------------------------------------------------------------------------------------
# Dispatcher


def test_dispatch_modes(monkeypatch, caplog):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv(dispatch.FLAVOR_ENV_VAR, raising=False)
    assert dispatch.get_mode() == "auto"
    assert dispatch.resolve("auto", "cpu")[0].is_reference
    assert dispatch.resolve("auto", "tpu")[0] == dispatch.Backend("mosaic_tpu", "tpu")
    gpu = dispatch.resolve("auto", "gpu")[0]
    assert gpu == (dispatch.Backend("triton", "gpu") if dispatch.triton_available() else dispatch.REFERENCE)
    assert dispatch.resolve("interpret", "cpu")[0] == dispatch.Backend("interpret", "gpu", True)
    assert dispatch.resolve("interpret", "tpu")[0] == dispatch.Backend("interpret", "tpu", True)
    assert dispatch.resolve("reference", "tpu")[0].is_reference
    with pytest.raises(RuntimeError, match="no Pallas lowering"):
        dispatch.resolve("pallas", "cpu")
    with pytest.raises(ValueError, match="not one of"):
        dispatch.resolve("fast", "cpu")

    monkeypatch.setenv(dispatch.ENV_VAR, "interpret")
    monkeypatch.setenv(dispatch.FLAVOR_ENV_VAR, "tpu")
    assert dispatch.select("x") == dispatch.Backend("interpret", "tpu", True)
    with dispatch.force("reference"):
        assert dispatch.get_mode() == "reference" and dispatch.select("x").is_reference
    assert dispatch.get_mode() == "interpret"  # back to the environment

    caplog.set_level(logging.INFO, logger=dispatch.logger.name)
    dispatch._logged.clear()
    for _ in range(3):
        dispatch.select("some_kernel")
    assert sum("some_kernel" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_kernels_lower_for_tpu_and_gpu():
    """Cross-platform lowering on this CPU: Pallas → Mosaic TPU MLIR and Pallas → Triton IR succeed for
    the shapes the drafters use (a large class of unsupported-op / block-shape errors is caught here; the
    final Mosaic / PTX compilation needs the hardware: experiments/kernels/gpu_check.py)."""
    if not dispatch.triton_available():
        missing_reference("Pallas's Triton backend in this JAX")
    z = lambda *shape: jnp.zeros(shape, jnp.bfloat16)  # noqa: E731
    weights = TC.LWRWeights(z(48, 32), z(48, 32), z(32), z(32, 576), z(576))
    targets = [(dispatch.Backend("mosaic_tpu", "tpu"), "tpu"), (dispatch.Backend("triton", "gpu"), "cuda")]
    for backend, platform in targets:
        attention = lambda *a: DA.draft_attention_pallas(*a, window=64, causal=True, backend=backend)  # noqa: E731
        ring = z(2, 3, 100, 64)
        args = (z(2, 16, 9, 64), ring, ring, z(2, 16, 3, 64), z(2, 16, 3, 64), jnp.zeros(2, jnp.int32))
        text = jax.jit(attention).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert "custom_call" in text
        table = lambda *a: TC.transition_scores_pallas(*a, weights, 1e-6, backend=backend)  # noqa: E731
        args = (z(2, 15, 576), z(2, 15, 32), z(2, 15, 16, 48), z(2, 15, 16, 576))
        assert "custom_call" in jax.jit(table).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# ----------------------------------------------------------------------------------------------
# The drafter through the dispatcher


@pytest.fixture(scope="module")
def drafters(tiny_models):
    """A windowed DSpine drafter with trained (non-zero) injection weights whose ring wraps, and an
    unwindowed bidirectional DFlash drafter, each with a ragged context cache (a row of length 0)."""
    from dspine_jax.drafters.io import init_drafter
    from dspine_jax.models.target import forward as target_forward
    from dspine_jax.models.target import init_cache, load_target

    target = load_target(tiny_models["qwen3"][0])
    dspine = init_drafter(
        target, kind="dspine", num_layers=2, block_size=8, transfer_rank=12, message_size=8, top_k=4,
        target_layer_ids=(0, 1), sliding_window=6, initializer_range=0.2, seed=5,
    )  # fmt: skip
    dspine = with_random_injection(dspine, seed=11)
    dflash = init_drafter(
        target, kind="dflash", num_layers=1, block_size=4, target_layer_ids=(0, 1), initializer_range=0.2, seed=6
    )
    seq = np.random.RandomState(8).randint(3, 128, size=(3, 12))
    _, tapped, _, _ = target_forward(target, init_cache(target, 3, 32), jnp.asarray(seq), (0, 1))
    lengths = jnp.array([12, 7, 0])
    out = []
    for drafter in (dspine, dflash):
        cache = jax.jit(append_context)(drafter, init_draft_cache(drafter, 3, 32), tapped, lengths)
        out.append((drafter, cache))
    return target, out


def test_draft_identical_with_interpret_forced(drafters):
    """``draft`` (attention kernel in every layer; DSpine also the transition kernel) gives the same
    candidates, proposals and q with the dispatcher forced to interpret as with the reference."""
    target, pairs = drafters
    anchor, keys = jnp.array([4, 50, 99], jnp.int32), jax.random.split(jax.random.key(3), 3)
    for drafter, cache in pairs:
        results = {}
        for mode in ("reference", "interpret"):
            with dispatch.force(mode):  # clears JAX's caches: the jitted draft retraces per mode
                step = jax.jit(D.draft)
                results[mode] = [step(drafter, target, cache, anchor, keys, Sampling.rows(3, t)) for t in (0.0, 0.7)]
        for ref, ker in zip(results["reference"], results["interpret"]):
            np.testing.assert_array_equal(np.asarray(ker.cand_ids), np.asarray(ref.cand_ids))
            np.testing.assert_array_equal(np.asarray(ker.tokens), np.asarray(ref.tokens))
            np.testing.assert_allclose(np.asarray(ker.q), np.asarray(ref.q), rtol=1e-5, atol=1e-6)


def lwr_table_float64(drafter: params_mod.Drafter, target, pre: np.ndarray, cand: np.ndarray, anchor: np.ndarray) -> np.ndarray:
    """``T[b, i, k, j] = ⟨LWR(pre_i, √R·C[pred_{i,k}]), head[cand_{i,j}]⟩`` written from
    docs/ARCHITECTURE.md §2.4 in float64 numpy on the drafter's raw weights: nothing from drafter.py or
    transition_cache.py."""
    f64 = lambda x: np.asarray(x, np.float64)
    inj, config = drafter.params.injection, drafter.config
    last, r, h = config.num_layers - 1, config.transfer_rank, config.hidden_size
    pre = f64(pre)  # [B, P, H]
    preds = np.concatenate([np.broadcast_to(anchor[:, None, None], cand[:, :1].shape), cand[:, :-1]], axis=1)
    code = np.sqrt(r) * f64(drafter.params.transfer_codes)[preds]  # [B, P, C, R]
    readout = pre @ f64(inj.readouts[last])
    feature = np.sqrt(r) * readout / np.maximum(np.linalg.norm(readout, axis=-1, keepdims=True), 1e-12)
    logit = (feature @ f64(inj.receiver_gate))[:, :, None] + code @ f64(inj.predecessor_gate) + f64(inj.bias)
    gate = 1 / (1 + np.exp(-logit))
    delta = (gate * (code @ f64(inj.message))) @ f64(inj.writes[last])  # [B, P, C, H]
    written = pre[:, :, None] + np.linalg.norm(pre, axis=-1, keepdims=True)[:, :, None] / np.sqrt(h) * delta
    refined = f64(drafter.params.norm) * written / np.sqrt((written**2).mean(-1, keepdims=True) + config.rms_norm_eps)
    rows = np.moveaxis(f64(target.params.lm_head)[:, cand], 0, -1)  # [B, P, C, H]
    return np.einsum("bpkh,bpjh->bpkj", refined, rows)


@pytest.mark.parametrize("mode", ["reference", "interpret"])
def test_transition_table_matches_an_independent_float64_lwr(drafters, mode):
    """``DSpine.transition_table`` through the dispatcher — the jnp reference, or the Pallas kernel in
    interpret mode — against the float64 restatement above, on the drafter's own per-slot inputs."""
    target, [(drafter, cache), _] = drafters
    anchor = jnp.array([4, 50, 99], jnp.int32)
    fwd = jax.jit(D.forward)(drafter, target, cache, D.block_tokens(drafter, anchor))
    pre = fwd.pre_injection[:, 1:]
    cand = jax.lax.top_k(D.unary_logits(drafter, target, fwd.hidden[:, 1:]), drafter.config.top_k)[1].astype(jnp.int32)
    with dispatch.force(mode):
        table = jax.jit(SPINE.transition_table)(drafter, target, pre, cand, anchor)
    ref = lwr_table_float64(drafter, target, np.asarray(pre), np.asarray(cand), np.asarray(anchor))
    assert np.abs(ref - ref[:, :, :1]).max() > 1e-2  # the table depends on the predecessor
    assert_close(table, ref, 1e-5)
