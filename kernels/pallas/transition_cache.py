"""Transition cache: fused last-write refinement (LWR) + candidate scoring.

``T[b, i, k, j] = ⟨LWR(pre_i, code_{i,k}), head_row_{i,j}⟩`` for every slot i, predecessor candidate k and
candidate j (docs/ARCHITECTURE.md §2.3–2.4; exactly ``dspine_jax.drafters.dspine.DSpine.transition_table``):

    gate    = σ(receiver_logit_i + code_k @ predecessor_gate + bias)                 [C, M]
    written = pre_i + (‖pre_i‖/√H) · ((gate ⊙ (code_k @ message)) @ write_last)       [C, H]
    refined = rms_norm(written) · norm                                                [C, H]
    T_i     = refined @ head_rows_iᵀ  (float32)                                       [C, C]

Inputs (per row b and slot i): ``pre [B, P, H]`` (last layer's pre-injection states), ``receiver_logit
[B, P, M]`` = ``receiver_gate(√R·normalize(readout_last(pre)))`` — one per slot, not per candidate, so it
is computed outside with the rest of the per-slot work — ``codes [B, P, C, R]`` (``√R·C[pred]``: the
anchor's for slot 1, slot i-1's candidates after) and ``head_rows [B, P, C, H]`` (LM-head rows of the
candidates). The kernel's grid is (B, P); the ``[C, H]`` refined states of a slot live in VMEM/registers and
never reach HBM — only the ``[C, C]`` scores are written.

* TPU flavor (Mosaic): whole-H blocks (a ``[16, 5120]`` f32 tile is 320 KiB of VMEM).
* GPU flavor (Triton): everything padded to powers of two ≥ 16 (C, R, M; zero padding changes no score),
  and H walked in chunks in two passes (row sums of squares of the written states, then normalise and
  score), re-computing each ``[C, Hc]`` delta chunk instead of keeping ``[C, H]`` live in registers.

Rounding mirrors the reference: products are accumulated in float32 and rounded to the input dtype at the
points where the reference (which runs in the parameter dtype) rounds, so bf16 tracks bf16.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl

from . import dispatch

KERNEL_NAME = "transition_cache"
_NN = (((1,), (0,)), ((), ()))  # A @ B
_NT = (((1,), (1,)), ((), ()))  # A @ B.T


class LWRWeights(NamedTuple):
    """The last layer's write and the shared injection weights LWR needs (``[in, out]`` layout)."""

    predecessor_gate: Array  # [R, M]
    message: Array  # [R, M]
    bias: Array  # [M]
    write: Array  # [M, H] (the last layer's write_l)
    norm: Array  # [H] final norm weight


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp; the same ops as DSpine.write + rms_norm + the scoring einsum)


def transition_scores_reference(
    pre: Array, receiver_logit: Array, codes: Array, head_rows: Array, weights: LWRWeights, eps: float
) -> Array:
    """pre ``[B,P,H]``, receiver_logit ``[B,P,M]``, codes ``[B,P,C,R]``, head_rows ``[B,P,C,H]`` → f32 ``[B,P,C,C]``."""
    h = pre[:, :, None, :]  # [B, P, 1, H]
    gate = jax.nn.sigmoid(receiver_logit[:, :, None, :] + codes @ weights.predecessor_gate + weights.bias)
    delta = (gate * (codes @ weights.message)) @ weights.write  # [B, P, C, H]
    scale = (jnp.linalg.norm(h.astype(jnp.float32), axis=-1, keepdims=True) / math.sqrt(h.shape[-1])).astype(h.dtype)
    written = h + scale * delta
    x32 = written.astype(jnp.float32)
    refined = weights.norm * (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(written.dtype)
    return jnp.einsum("bpch,bpjh->bpcj", refined, head_rows, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Kernel


def _dot(a: Array, b: Array, dims=_NN) -> Array:
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _kernel(
    pre_ref, rl_ref, codes_ref, rows_ref, pg_ref, msg_ref, bias_ref, write_ref, norm_ref, *rest,
    hidden: int, chunk: int, r_chunk: int, eps: float,
):  # fmt: skip
    """One (row, slot): pre ``[1,H]``, rl ``[1,M]``, codes ``[C,R]``, rows ``[C,H]`` → out ``[C,C]`` f32."""
    out_ref = rest[-1]  # (rest[0] is the aliased poison buffer when present)
    dt = pre_ref.dtype
    c = codes_ref.shape[0]

    def chunked(fn, init, total: int, size: int):
        """Fold ``fn(slice, carry)`` over ``total/size`` chunks: one static slice, or a loop of ``pl.ds``."""
        if size == total:
            return fn(slice(None), init)
        return lax.fori_loop(0, total // size, lambda i, acc: fn(pl.ds(i * size, size), acc), init)

    # Per-candidate gate and message, contracted over R in chunks: [C, M] f32 accumulators.
    def project(rs, acc):
        codes = codes_ref[:, rs]
        return acc[0] + _dot(codes, pg_ref[rs, :]), acc[1] + _dot(codes, msg_ref[rs, :])

    m = pg_ref.shape[1]
    zero_cm = jnp.zeros((c, m), jnp.float32)
    to_pg, to_msg = chunked(project, (zero_cm, zero_cm), codes_ref.shape[1], r_chunk)
    # Reference: every op in the parameter dtype, rounding after each one.
    z = to_pg.astype(dt).astype(jnp.float32) + rl_ref[...].astype(jnp.float32)
    z = (z.astype(dt).astype(jnp.float32) + bias_ref[...].astype(jnp.float32)).astype(dt)
    gate = jax.nn.sigmoid(z.astype(jnp.float32)).astype(dt)
    gm = (gate.astype(jnp.float32) * to_msg.astype(dt).astype(jnp.float32)).astype(dt)  # [C, M]

    def pre_sq(hs, acc):
        return acc + jnp.sum(jnp.square(pre_ref[:, hs].astype(jnp.float32)))

    scale = (jnp.sqrt(chunked(pre_sq, jnp.float32(0.0), hidden, chunk)) / math.sqrt(hidden)).astype(dt)
    scale = scale.astype(jnp.float32)

    def written(hs) -> Array:
        """``pre + scale·delta`` on one H chunk ``[C, Hc]`` (dtype-rounded like the reference)."""
        delta = _dot(gm, write_ref[:, hs]).astype(dt).astype(jnp.float32)
        return (pre_ref[:, hs].astype(jnp.float32) + (scale * delta).astype(dt).astype(jnp.float32)).astype(dt)

    def sum_sq(hs, acc):
        w = written(hs).astype(jnp.float32)
        return acc + jnp.sum(w * w, axis=1, keepdims=True)

    inv = lax.rsqrt(chunked(sum_sq, jnp.zeros((c, 1), jnp.float32), hidden, chunk) / hidden + eps)  # [C, 1]

    def score(hs, acc):
        normed = (written(hs).astype(jnp.float32) * inv).astype(dt).astype(jnp.float32)
        refined = (norm_ref[:, hs].astype(jnp.float32) * normed).astype(dt)
        return acc + _dot(refined, rows_ref[:, hs], _NT)

    out_ref[...] = chunked(score, jnp.zeros((c, c), jnp.float32), hidden, chunk)


def _pad_to(x: Array, axis: int, size: int) -> Array:
    if x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads)


def _gpu_chunk(total: int, other: int, itemsize: int, what: str) -> int:
    """Largest power of two dividing ``total``, ≥ 16, with an ``[other, chunk]`` tile ≤ 64 KiB (Triton keeps
    whole operand tiles in registers/shared memory)."""
    cap = max(16, 65536 // (other * itemsize))
    chunk = total & -total  # largest power-of-two divisor
    while chunk > cap:
        chunk //= 2
    if chunk < 16:
        raise NotImplementedError(f"{what} {total} is not a multiple of 16 (GPU flavor)")
    return chunk


def transition_scores_pallas(
    pre: Array,
    receiver_logit: Array,
    codes: Array,
    head_rows: Array,
    weights: LWRWeights,
    eps: float,
    *,
    backend: dispatch.Backend,
    poison: bool = False,
) -> Array:
    """The fused kernel (``backend.flavor`` tpu|gpu, compiled or interpreted); same contract as the reference.

    ``poison`` (tests): the output buffer is pre-filled with NaN and aliased, so unwritten elements show.
    """
    b, p, h = pre.shape
    c, r = codes.shape[2], codes.shape[3]
    m = weights.message.shape[1]
    if receiver_logit.shape != (b, p, m) or codes.shape[:2] != (b, p) or head_rows.shape != (b, p, c, h):
        raise ValueError(
            f"shape mismatch: pre {pre.shape}, receiver_logit {receiver_logit.shape}, codes {codes.shape}, "
            f"head_rows {head_rows.shape}, message {weights.message.shape}"
        )
    pg, msg, write = weights.predecessor_gate, weights.message, weights.write
    bias, norm = weights.bias.reshape(1, m), weights.norm.reshape(1, h)
    chunk, r_chunk = h, r
    if backend.flavor == "gpu":
        # Triton: power-of-two shapes ≥ 16 (tl.dot). Zero rows/columns add nothing to any score.
        cp, rp, mp = (max(16, pl.next_power_of_2(x)) for x in (c, r, m))
        codes, head_rows = _pad_to(_pad_to(codes, 2, cp), 3, rp), _pad_to(head_rows, 2, cp)
        pg, msg = _pad_to(_pad_to(pg, 0, rp), 1, mp), _pad_to(_pad_to(msg, 0, rp), 1, mp)
        write, bias, receiver_logit = _pad_to(write, 0, mp), _pad_to(bias, 1, mp), _pad_to(receiver_logit, 2, mp)
        itemsize = jnp.dtype(pre.dtype).itemsize
        chunk, r_chunk = _gpu_chunk(h, mp, itemsize, "hidden size"), _gpu_chunk(rp, mp, itemsize, "rank")
        c_out, r, m = cp, rp, mp
    else:
        c_out = c
    slot = lambda bi, pi: (bi, pi, 0, 0)  # noqa: E731
    weight = lambda bi, pi: (0, 0)  # noqa: E731  same block every step: fetched once
    in_specs = [
        pl.BlockSpec((None, None, 1, h), slot),
        pl.BlockSpec((None, None, 1, m), slot),
        pl.BlockSpec((None, None, c_out, r), slot),
        pl.BlockSpec((None, None, c_out, h), slot),
        pl.BlockSpec((r, m), weight),
        pl.BlockSpec((r, m), weight),
        pl.BlockSpec((1, m), weight),
        pl.BlockSpec((m, h), weight),
        pl.BlockSpec((1, h), weight),
    ]
    args = [pre[:, :, None, :], receiver_logit[:, :, None, :], codes, head_rows, pg, msg, bias, write, norm]
    out_shape = jax.ShapeDtypeStruct((b, p, c_out, c_out), jnp.float32)
    out_spec = pl.BlockSpec((None, None, c_out, c_out), slot)
    aliases = {}
    if poison:
        in_specs.append(out_spec)
        args.append(jnp.full(out_shape.shape, jnp.nan, jnp.float32))
        aliases = {len(args) - 1: 0}
    extra = {}
    if backend.name == "mosaic_tpu":
        # Whole weights sit in VMEM (double-buffered by the pipeline, though fetched once): raise the scoped
        # limit past the 16/32 MiB default when the last layer's write [M, H] is large (27B: 5 MiB bf16).
        itemsize = jnp.dtype(pre.dtype).itemsize
        need = 2 * itemsize * (2 * r * m + m + m * h + h + c_out * (r + h) + h + m) + 2 * 4 * c_out * c_out
        extra = dict(
            dimension_semantics=("parallel", "parallel"),
            vmem_limit_bytes=int(min(max(32 << 20, need + (16 << 20)), 64 << 20)),
        )
    table = pl.pallas_call(
        functools.partial(_kernel, hidden=h, chunk=chunk, r_chunk=r_chunk, eps=float(eps)),
        out_shape=out_shape,
        grid=(b, p),
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases=aliases,
        compiler_params=dispatch.compiler_params(backend, num_warps=8 if m >= 256 else 4, **extra),
        interpret=backend.interpret,
        name=f"dspine_transition_cache_{backend.flavor}",
    )(*args)
    return table[:, :, :c, :c]


def transition_scores(
    pre: Array,
    receiver_logit: Array,
    codes: Array,
    head_rows: Array,
    weights: LWRWeights,
    eps: float,
    *,
    backend: dispatch.Backend | str | None = None,
) -> Array:
    """Dispatching entry point: the reference or the Pallas kernel per ``dspine_jax.pallas.dispatch``."""
    chosen = dispatch.as_backend(backend, KERNEL_NAME)
    if chosen.is_reference:
        return transition_scores_reference(pre, receiver_logit, codes, head_rows, weights, eps)
    return transition_scores_pallas(pre, receiver_logit, codes, head_rows, weights, eps, backend=chosen)
