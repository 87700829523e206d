"""Sliding-window draft attention: a block of T queries over the drafter's context ring + the block itself.

Semantics (the reference path below, ``visible_mask`` + the joint softmax; see ``dspine_jax/drafters/drafter.py``'s module doc):

* q ``[B, T, N, D]`` (block queries, after q_norm + RoPE), the layer's context ring ctx_k/ctx_v
  ``[B, K, S, D]`` (heads-major; position p lives in slot p mod S), the block's own k/v ``[B, T, K, D]``,
  lengths ``[B]`` (committed context tokens = position of the block's first slot).
* Ring slot s holds position ``last - ((last - s) mod S)`` with ``last = lengths - 1``; negative = empty.
* Query t (absolute position ``lengths + t``) sees a context slot when it is filled and, for a windowed
  layer, ``query_pos - key_pos < W``; it sees block slot u when ``u <= t`` (causal, DSpine) or always
  (bidirectional, DFlash), with ``t - u < W`` and, bidirectional, ``u - t < W`` under a window.
* One joint float32 softmax over [context ; block] scores scaled by D^-1/2; GQA (query head n reads kv
  head n // G).

Kernels (one online softmax over KV tiles; the visible context slots of a row form one circular interval
of the ring, so only the tiles that intersect it are visited — the rest are skipped, not masked):

* TPU flavor (Mosaic): grid (B, K, n_tiles) with the per-row tile range scalar-prefetched into SMEM; the
  context BlockSpec's index map walks the row's tiles in ring order and repeats the last one once the range
  is done, so skipped steps issue no DMA and ``pl.when`` skips their compute. Block keys + the final
  normalisation run on the last step. m/l/acc live in VMEM scratch.
* GPU flavor (Triton): grid (B, K, query-row blocks), an in-kernel ``fori_loop`` over exactly the row's
  tiles (dynamic trip count), masked loads for the ring's ragged tail and a non-power-of-two head_dim; all
  block shapes are padded to powers of two (Triton's tensor-size rule) and at least 16 (``tl.dot``'s minimum).

Rows of the G query heads sharing a kv head are folded into one ``[T*G, D]`` query tile (row r = t*G + g),
so each K/V tile is read once per kv head. Masks are finite (MASK_VALUE) and probabilities of masked
scores are forced to exactly 0, so NaN/garbage in padding or unfilled tiles never reaches the output;
every output element is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl

from . import dispatch

# Finite "minus infinity", the same constant as dspine_jax.models.layers.MASK_VALUE (kernels/ does not import the
# library, which imports the kernels).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

KERNEL_NAME = "draft_attention"
_NT = (((1,), (1,)), ((), ()))  # dot_general dims: contract the last dims (A @ B.T)
_INFO = 8  # int32 scalars per row: lengths, ring base, newest slot, first tile, tile count, (pad)


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp; the XLA path the dispatcher falls back to)


def ring_positions(lengths: Array, capacity: int) -> Array:
    """Absolute position held by each ring slot ``[B, S]`` (negative = empty) — ring.context_slot_positions."""
    last = lengths[:, None] - 1  # [B, 1]
    return last - jnp.mod(last - jnp.arange(capacity)[None, :], capacity)


def visible_mask(lengths: Array, capacity: int, t: int, window: int, causal: bool) -> Array:
    """``[B, T, S + T]`` bool: which [ring slots ; block] keys each block query sees."""
    key_pos = ring_positions(lengths, capacity)  # [B, S]
    query_pos = lengths[:, None] + jnp.arange(t)  # [B, T]
    ctx = jnp.broadcast_to((key_pos >= 0)[:, None, :], (key_pos.shape[0], t, key_pos.shape[1]))
    if window:
        ctx = ctx & (query_pos[:, :, None] - key_pos[:, None, :] < window)
    q_off, k_off = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    blk = jnp.ones((t, t), bool)
    if causal:
        blk = blk & (k_off <= q_off)
    if window:
        blk = blk & (q_off - k_off < window)
        if not causal:
            blk = blk & (k_off - q_off < window)
    return jnp.concatenate([ctx, jnp.broadcast_to(blk, (ctx.shape[0], t, t))], axis=-1)


def draft_attention_reference(
    q: Array, ctx_k: Array, ctx_v: Array, k: Array, v: Array, lengths: Array, *, window: int, causal: bool
) -> Array:
    """q ``[B,T,N,D]``, ctx_k/v ``[B,K,S,D]``, k/v ``[B,T,K,D]``, lengths ``[B]`` → ``[B,T,N,D]``."""
    b, t, n, d = q.shape
    kh, s = ctx_k.shape[1], ctx_k.shape[2]
    groups = n // kh
    visible = visible_mask(lengths, s, t, window, causal)
    qg = q.reshape(b, t, kh, groups, d)
    # The ring's products per KV head with the group's queries flattened, [G·T, D] @ [D, S] and [G·T, S] @ [S, D]
    # (as ``cached_attention``: spelled with ``btkgd`` queries or outputs, XLA:CPU copies the ring transposed).
    flat = qg.transpose(0, 2, 3, 1, 4).reshape(b, kh, groups * t, d)  # [B, K, G·T, D]
    ctx_scores = jnp.einsum("bkqd,bksd->bkqs", flat, ctx_k, preferred_element_type=jnp.float32)
    ctx_scores = ctx_scores.reshape(b, kh, groups, t, s)  # [B, K, G, T, S]
    blk_scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.concatenate([ctx_scores, blk_scores], axis=-1) * (d**-0.5)  # [B, K, G, T, S+T]
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    ctx_out = jnp.einsum("bkqs,bksd->bkqd", probs[..., :s].reshape(b, kh, groups * t, s), ctx_v)
    ctx_out = ctx_out.reshape(b, kh, groups, t, d).transpose(0, 3, 1, 2, 4)  # [B, T, K, G, D]
    out = ctx_out + jnp.einsum("bkgts,bskd->btkgd", probs[..., s:], v)
    return out.reshape(b, t, n, d)


# ----------------------------------------------------------------------------------------------
# Per-row tile schedule (plain XLA, outside the kernel: a handful of int32 ops per row)


def row_schedule(lengths: Array, capacity: int, tile: int, window: int) -> Array:
    """``[B, 8]`` int32 per row: lengths, ring base, newest slot q0, first tile, number of tiles, 0, 0, 0.

    Slot s holds position ``base + s`` if ``s <= q0`` else ``base + s - S`` (``q0 = (len-1) mod S``,
    ``base = len-1-q0``): the ring formula without a vector mod inside the kernel. The visible positions of
    the row (union over the block's queries; query 0 is the loosest) are ``[lo, len)`` with
    ``lo = max(0, len - S, len - W + 1)``; their slots are a circular interval of the ring, so the tiles
    that intersect it are ``first, first+1, …`` (mod n_tiles), ``count`` of them, each at most once.
    """
    s = capacity
    n_tiles = -(-s // tile)
    lens = lengths.astype(jnp.int32)
    last = lens - 1
    q0 = jnp.mod(last, s)  # Python-style mod: an empty row (last = -1) gives q0 = S-1, base = -S
    base = last - q0
    lo = jnp.maximum(0, lens - s)
    if window:
        lo = jnp.maximum(lo, lens - window + 1)
    n_vis = jnp.maximum(lens - lo, 0)
    first_slot = jnp.mod(lo, s)
    last_slot = jnp.mod(lo + n_vis - 1, s)
    t_first, t_last = first_slot // tile, last_slot // tile
    wraps = first_slot + n_vis > s
    count = jnp.where(wraps, jnp.minimum(n_tiles, n_tiles - t_first + t_last + 1), t_last - t_first + 1)
    count = jnp.where(n_vis > 0, count, 0)
    zero = jnp.zeros_like(lens)
    return jnp.stack([lens, base, q0, t_first, count, zero, zero, zero], axis=1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Shared in-kernel math (operates on loaded values; used by both flavors)


def _ctx_mask(tix: Array, tile: int, capacity: int, lens: Array, base: Array, q0: Array, row_t: Array, window: int):
    """Context-tile masks: ``[R, tile]`` per-query visibility and ``[tile, 1]`` slot validity."""
    slots = tix * tile + lax.broadcasted_iota(jnp.int32, (1, tile), 1)  # [1, tile]
    key_pos = base + slots - jnp.where(slots > q0, capacity, 0)
    slot_ok = (slots < capacity) & (key_pos >= 0)  # [1, tile]
    mask = jnp.broadcast_to(slot_ok, (row_t.shape[0], tile))
    if window:
        mask = mask & (lens + row_t - key_pos < window)  # [R, 1] - [1, tile]
    # The same per-slot test as a column (no transpose), for zeroing V rows: filled and, windowed, visible to
    # query 0 (the loosest) — a slot no query sees contributes exactly nothing, whatever it holds.
    slots_c = tix * tile + lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
    key_pos_c = base + slots_c - jnp.where(slots_c > q0, capacity, 0)
    key_ok = (slots_c < capacity) & (key_pos_c >= 0)
    if window:
        key_ok = key_ok & (lens - key_pos_c < window)
    return mask, key_ok


def _block_mask(row_t: Array, width: int, t: int, window: int, causal: bool) -> tuple[Array, Array]:
    """Block-key masks: ``[R, width]`` visibility (u < T real keys) and ``[width, 1]`` key validity."""
    u = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    mask = jnp.broadcast_to(u < t, (row_t.shape[0], width))
    if causal:
        mask = mask & (u <= row_t)
    if window:
        mask = mask & (row_t - u < window)
        if not causal:
            mask = mask & (u - row_t < window)
    return mask, lax.broadcasted_iota(jnp.int32, (width, 1), 0) < t


def _update(
    carry: tuple[Array, Array, Array], q: Array, kt: Array, vt: Array, mask: Array, key_ok: Array, scale: float
) -> tuple[Array, Array, Array]:
    """One online-softmax step. carry = (m [R,1], l [R,1], acc [R,Dv]) in f32; q [R,D], kt/vt [n,D]."""
    m, l, acc = carry
    s = lax.dot_general(q, kt, _NT, preferred_element_type=jnp.float32) * scale  # [R, n]
    s = jnp.where(mask, s, MASK_VALUE)  # select, not add: garbage/NaN in unread slots cannot leak
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    # Masked probabilities are exactly 0 even while a row has seen nothing yet (m_new == MASK_VALUE).
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    vt = jnp.where(key_ok, vt, jnp.zeros_like(vt))  # 0 * NaN would still be NaN in the PV product
    pv = lax.dot_general(p.astype(vt.dtype), vt, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def _finish(l: Array, acc: Array) -> Array:
    # Real rows always see their own block slot (l > 0); padding rows would divide 0 by 0.
    return acc / jnp.where(l > 0, l, 1.0)


def _ring_tile(first: Array, j: Array, n_tiles: int) -> Array:
    tix = first + j
    return jnp.where(tix >= n_tiles, tix - n_tiles, tix)


# ----------------------------------------------------------------------------------------------
# TPU flavor: grid over KV tiles, scalar-prefetched schedule


def _tpu_kernel(
    info_ref, row_t_ref, q_ref, ck_ref, cv_ref, bk_ref, bv_ref, *rest,
    tile: int, capacity: int, n_tiles: int, t: int, window: int, causal: bool, scale: float, aliased: bool,
):  # fmt: skip
    if aliased:
        rest = rest[1:]  # the poisoned output buffer (pl.ANY); the output ref aliases it
    o_ref, m_ref, l_ref, acc_ref = rest
    b, j = pl.program_id(0), pl.program_id(2)
    lens, base, q0, first, count = (info_ref[b, i] for i in range(5))
    row_t = row_t_ref[...]  # [R, 1]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def carry() -> tuple[Array, Array, Array]:
        # m/l are stored lane-replicated [R, 128] (the TPU idiom); the math uses one column.
        return m_ref[...][:, :1], l_ref[...][:, :1], acc_ref[...]

    def store(new: tuple[Array, Array, Array]) -> None:
        m_ref[...] = jnp.broadcast_to(new[0], m_ref.shape)
        l_ref[...] = jnp.broadcast_to(new[1], l_ref.shape)
        acc_ref[...] = new[2]

    @pl.when(j < count)
    def _context_tile():
        tix = _ring_tile(first, j, n_tiles)
        mask, key_ok = _ctx_mask(tix, tile, capacity, lens, base, q0, row_t, window)
        store(_update(carry(), q_ref[...], ck_ref[...], cv_ref[...], mask, key_ok, scale))

    @pl.when(j == n_tiles - 1)
    def _block_and_finish():
        mask, key_ok = _block_mask(row_t, t, t, window, causal)
        _, l, acc = _update(carry(), q_ref[...], bk_ref[...], bv_ref[...], mask, key_ok, scale)
        o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


def _tpu_call(
    qr: Array, ctx_k: Array, ctx_v: Array, bk: Array, bv: Array, info: Array, row_t: Array, *,
    t: int, window: int, causal: bool, scale: float, backend: dispatch.Backend, tile: int, poison: bool,
) -> Array:  # fmt: skip
    """qr ``[B,K,R,D]``, ctx ``[B,K,S,D]``, block k/v ``[B,K,T,D]``, info ``[B,8]``, row_t ``[R,1]`` → ``[B,K,R,D]``."""
    b, kh, r, d = qr.shape
    s = ctx_k.shape[2]
    tile = min(tile, s)  # a block equal to the full dim is always legal; else a multiple of 16 (bf16 sublanes)
    n_tiles = -(-s // tile)

    def ctx_map(bi, hi, j, info_ref):
        count = info_ref[bi, 4]
        # Past the row's range repeat its last tile: an unchanged block index issues no new DMA.
        jj = jnp.minimum(j, jnp.maximum(count - 1, 0))
        return bi, hi, _ring_tile(info_ref[bi, 3], jj, n_tiles), 0

    full = lambda bi, hi, j, info_ref: (bi, hi, 0, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((r, 1), lambda bi, hi, j, info_ref: (0, 0)),
        pl.BlockSpec((None, None, r, d), full),
        pl.BlockSpec((None, None, tile, d), ctx_map),
        pl.BlockSpec((None, None, tile, d), ctx_map),
        pl.BlockSpec((None, None, t, d), full),
        pl.BlockSpec((None, None, t, d), full),
    ]
    args = [info, row_t, qr, ctx_k, ctx_v, bk, bv]
    out_shape = jax.ShapeDtypeStruct((b, kh, r, d), qr.dtype)
    aliases = {}
    if poison:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        aliases = {len(args) - 1: 0}
    from jax.experimental.pallas import tpu as pltpu  # import here: only the TPU flavor needs it

    kernel = functools.partial(
        _tpu_kernel, tile=tile, capacity=s, n_tiles=n_tiles, t=t, window=window, causal=causal, scale=scale,
        aliased=poison,
    )  # fmt: skip
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, kh, n_tiles),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, r, d), full),
            scratch_shapes=[
                pltpu.VMEM((r, 128), jnp.float32),
                pltpu.VMEM((r, 128), jnp.float32),
                pltpu.VMEM((r, d), jnp.float32),
            ],
        ),
        input_output_aliases=aliases,
        compiler_params=dispatch.compiler_params(backend, dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=backend.interpret,
        name="dspine_draft_attention_tpu",
    )(*args)


# ----------------------------------------------------------------------------------------------
# GPU flavor: in-kernel loop over the row's tiles, power-of-two blocks


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, pl.next_power_of_2(n))


def _gpu_kernel(
    info_ref, row_t_ref, q_ref, ck_ref, cv_ref, bk_ref, bv_ref, *rest,
    tile: int, capacity: int, head_dim: int, n_tiles: int, t: int, window: int, causal: bool, scale: float,
    aliased: bool, masked_loads: bool,
):  # fmt: skip
    o_ref = rest[-1]  # (rest[0] is the aliased poison buffer when present)
    del aliased
    lens, base, q0, first, count = (info_ref[i] for i in range(5))
    row_t = row_t_ref[...]  # [R, 1]
    q = q_ref[...]  # [R, Dp]
    r, dp = q.shape

    def load(ref, tix):
        window_ = ref.at[pl.ds(tix * tile, tile), :]
        if not masked_loads:
            return window_[...]
        from jax.experimental.pallas import triton as plt

        rows = tix * tile + lax.broadcasted_iota(jnp.int32, (tile, dp), 0)
        cols = lax.broadcasted_iota(jnp.int32, (tile, dp), 1)
        return plt.load(window_, mask=(rows < capacity) & (cols < head_dim), other=0.0)

    def body(j, carry):
        tix = _ring_tile(first, j, n_tiles)
        mask, key_ok = _ctx_mask(tix, tile, capacity, lens, base, q0, row_t, window)
        return _update(carry, q, load(ck_ref, tix), load(cv_ref, tix), mask, key_ok, scale)

    init = (
        jnp.full((r, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((r, 1), jnp.float32),
        jnp.zeros((r, dp), jnp.float32),
    )
    carry = lax.fori_loop(0, count, body, init)  # only this row's tiles: the others are never touched
    mask, key_ok = _block_mask(row_t, bk_ref.shape[0], t, window, causal)
    _, l, acc = _update(carry, q, bk_ref[...], bv_ref[...], mask, key_ok, scale)
    o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


def _gpu_call(
    qr: Array, ctx_k: Array, ctx_v: Array, bk: Array, bv: Array, info: Array, row_t: Array, *,
    t: int, window: int, causal: bool, scale: float, backend: dispatch.Backend, tile: int, poison: bool,
) -> Array:  # fmt: skip
    """qr ``[B,K,R,D]``, ctx ``[B,K,S,D]``, block k/v ``[B,K,T,D]``, info ``[B,8]``, row_t ``[R,1]`` → ``[B,K,R,D]``."""
    b, kh, r, d = qr.shape
    s = ctx_k.shape[2]
    rp, dp, tp = _pow2(r), _pow2(d), _pow2(t)
    tile = min(_pow2(tile), _pow2(s))
    n_tiles = -(-s // tile)
    # Query rows per program: the f32 accumulator [rows, Dp] lives in registers (the official Pallas GPU
    # attention's 128 x 128 budget), so wide heads get fewer rows and the rest go to a third grid axis.
    rows = min(rp, 128 if dp <= 128 else 64)
    # Small operands are padded here (cheap); the ring is not (a copy per draft): its blocks overhang the
    # array and the loads are masked instead.
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rp - r), (0, dp - d)))
    bk = jnp.pad(bk, ((0, 0), (0, 0), (0, tp - t), (0, dp - d)))
    bv = jnp.pad(bv, ((0, 0), (0, 0), (0, tp - t), (0, dp - d)))
    row_t = jnp.pad(row_t, ((0, rp - r), (0, 0)))
    masked_loads = (s % tile != 0) or dp != d

    full = lambda bi, hi, ri: (bi, hi, 0, 0)  # noqa: E731
    row_block = lambda bi, hi, ri: (bi, hi, ri, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, _INFO), lambda bi, hi, ri: (bi, 0)),
        pl.BlockSpec((rows, 1), lambda bi, hi, ri: (ri, 0)),
        pl.BlockSpec((None, None, rows, dp), row_block),
        pl.BlockSpec((None, None, n_tiles * tile, dp), full),
        pl.BlockSpec((None, None, n_tiles * tile, dp), full),
        pl.BlockSpec((None, None, tp, dp), full),
        pl.BlockSpec((None, None, tp, dp), full),
    ]
    args = [info, row_t, qr, ctx_k, ctx_v, bk, bv]
    out_shape = jax.ShapeDtypeStruct((b, kh, rp, dp), qr.dtype)
    aliases = {}
    if poison:
        in_specs.append(pl.BlockSpec((None, None, rows, dp), row_block))
        args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        aliases = {len(args) - 1: 0}
    kernel = functools.partial(
        _gpu_kernel, tile=tile, capacity=s, head_dim=d, n_tiles=n_tiles, t=t, window=window, causal=causal,
        scale=scale, aliased=poison, masked_loads=masked_loads,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, kh, rp // rows),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, rows, dp), row_block),
        input_output_aliases=aliases,
        compiler_params=dispatch.compiler_params(backend, num_warps=4 if dp <= 64 else 8),
        interpret=backend.interpret,
        name="dspine_draft_attention_gpu",
    )(*args)
    return out[:, :, :r, :d]


# ----------------------------------------------------------------------------------------------
# Entry points


def draft_attention_pallas(
    q: Array,
    ctx_k: Array,
    ctx_v: Array,
    k: Array,
    v: Array,
    lengths: Array,
    *,
    window: int,
    causal: bool,
    backend: dispatch.Backend,
    block_kv: int | None = None,
    poison: bool = False,
) -> Array:
    """The Pallas kernel (``backend.flavor`` tpu|gpu, compiled or interpreted); same contract as the reference.

    ``block_kv``: context tile length (default 512 on TPU, 64 on GPU — 32 at head_dim 256). ``poison``
    (tests): the output buffer is pre-filled with NaN and aliased, so any element the kernel fails to write
    shows up as NaN.
    """
    b, t, n, d = q.shape
    kh, s = ctx_k.shape[1], ctx_k.shape[2]
    if ctx_k.shape != (b, kh, s, d) or ctx_v.shape != ctx_k.shape or k.shape != (b, t, kh, d) or v.shape != k.shape:
        raise ValueError(f"shape mismatch: q {q.shape}, ctx_k/v {ctx_k.shape}/{ctx_v.shape}, k/v {k.shape}/{v.shape}")
    if n % kh:
        raise ValueError(f"{n} query heads are not a multiple of {kh} kv heads")
    g = n // kh
    # [B, T, N, D] → [B, K, T*G, D]: the G query heads of a kv head share its K/V tiles (row r = t*G + g).
    qr = q.reshape(b, t, kh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, d)
    bk, bv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D] (the block: small copies)
    row_t = (jnp.arange(t * g, dtype=jnp.int32) // g)[:, None]  # [R, 1] block offset of each query row
    flavor = backend.flavor or "gpu"
    if block_kv is None:
        block_kv = 512 if flavor == "tpu" else (32 if d > 128 else 64)
    tile = min(block_kv, s) if flavor == "tpu" else min(_pow2(block_kv), _pow2(s))
    info = row_schedule(lengths, s, tile, window)
    call = _tpu_call if flavor == "tpu" else _gpu_call
    out = call(
        qr, ctx_k, ctx_v, bk, bv, info, row_t, t=t, window=window, causal=causal, scale=d**-0.5,
        backend=backend, tile=tile, poison=poison,
    )  # fmt: skip  [B, K, T*G, D]
    return out.reshape(b, kh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, n, d)


def draft_attention(
    q: Array,
    ctx_k: Array,
    ctx_v: Array,
    k: Array,
    v: Array,
    lengths: Array,
    *,
    window: int,
    causal: bool,
    backend: dispatch.Backend | str | None = None,
) -> Array:
    """Dispatching entry point: the reference or the Pallas kernel per ``dspine_jax.pallas.dispatch``."""
    chosen = dispatch.as_backend(backend, KERNEL_NAME)
    if chosen.is_reference:
        return draft_attention_reference(q, ctx_k, ctx_v, k, v, lengths, window=window, causal=causal)
    return draft_attention_pallas(q, ctx_k, ctx_v, k, v, lengths, window=window, causal=causal, backend=chosen)


def reference_flops(b: int, t: int, n: int, d: int, s: int) -> int:
    """Dense score + PV flops of the reference (for the benchmark's roofline column)."""
    return 4 * b * t * n * d * (s + t)


__all__ = [
    "draft_attention",
    "draft_attention_pallas",
    "draft_attention_reference",
    "ring_positions",
    "row_schedule",
    "visible_mask",
    "reference_flops",
]
