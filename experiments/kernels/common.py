"""Shapes and input builders shared by the kernel micro-benchmark (bench.py) and the GPU check (gpu_check.py).

Drafter shapes (one drafter layer's attention call and one transition table per round, block T = 16,
P = 15 proposal slots, C = 16 candidates):

* ``smollm2``: a DSpine drafter on SmolLM2-135M — width 576, 9 heads / 3 kv heads, head_dim 64; transfer
  rank / message = init_drafter's defaults for that target (R = min(1024, H, V-1) = 576, M = R/2 = 288).
  Context ring 2047 slots (window 2048).
* ``27b``: the Qwen3.8-27B drafter as far as docs/ARCHITECTURE.md §1 pins it (block 16, sliding window 8192 →
  ring of 8191 slots, C = 16) with Qwen3.5/3.6-27B-style attention dims we assume (H 5120, 24 heads / 4 kv
  heads, head_dim 256) and SpecForge's default R 1024 / M 512. ``27b-small`` scales it down for CPU runs: width
  and heads ÷4 (H 1280, 6 heads / 1 kv head, head_dim 256 kept: it is what stresses the kernel), ring 1023,
  R 256, M 128.

Rows are ragged: the ring lengths cycle through empty, a quarter, exactly full and wrapped several times.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (dspine_jax, kernels)

import jax
import jax.numpy as jnp
from dspine_jax.pallas import transition_cache as TC


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    block: int  # T
    heads: int  # N
    kv_heads: int  # K
    head_dim: int  # D
    ring: int  # S (context slots)
    window: int  # W
    hidden: int  # H
    candidates: int  # C
    rank: int  # R
    message: int  # M


SHAPES = {
    "smollm2": Shape("smollm2", 4, 16, 9, 3, 64, 2047, 2048, 576, 16, 576, 288),
    "27b-small": Shape("27b-small", 2, 16, 6, 1, 256, 1023, 1024, 1280, 16, 256, 128),
    "27b": Shape("27b", 4, 16, 24, 4, 256, 8191, 8192, 5120, 16, 1024, 512),
}


def ragged_lengths(shape: Shape) -> jax.Array:
    """Empty, a quarter, exactly full, wrapped (the ring rotated several times)."""
    cycle = [0, shape.ring // 4, shape.ring, 5 * shape.ring + 17]
    return jnp.asarray([cycle[i % 4] for i in range(shape.batch)], jnp.int32)


def attention_inputs(shape: Shape, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    b, t, n, kh, d, s = shape.batch, shape.block, shape.heads, shape.kv_heads, shape.head_dim, shape.ring
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    normal = lambda k, sh: jax.random.normal(k, sh, jnp.float32).astype(dtype)  # noqa: E731
    return (
        normal(ks[0], (b, t, n, d)),
        normal(ks[1], (b, kh, s, d)),
        normal(ks[2], (b, kh, s, d)),
        normal(ks[3], (b, t, kh, d)),
        normal(ks[4], (b, t, kh, d)),
        ragged_lengths(shape),
    )


def transition_inputs(shape: Shape, dtype, seed: int = 0) -> tuple:
    b, p, c, r, m, h = shape.batch, shape.block - 1, shape.candidates, shape.rank, shape.message, shape.hidden
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)

    def normal(k, sh, scale=1.0):
        return (scale * jax.random.normal(k, sh, jnp.float32)).astype(dtype)

    weights = TC.LWRWeights(
        predecessor_gate=normal(ks[4], (r, m), r**-0.5),
        message=normal(ks[5], (r, m), r**-0.5),
        bias=normal(ks[6], (m,), 0.1),
        write=normal(ks[7], (m, h), m**-0.5),
        norm=(1.0 + normal(ks[8], (h,), 0.1)).astype(dtype),
    )
    return (
        normal(ks[0], (b, p, h)),
        normal(ks[1], (b, p, m)),
        normal(ks[2], (b, p, c, r), float(r) ** 0.5),
        normal(ks[3], (b, p, c, h), h**-0.5),
        weights,
    )


def tiles_visited(shape: Shape, tile: int) -> tuple[int, int]:
    """(tiles the kernel visits over the batch, tiles a dense kernel would touch)."""
    from dspine_jax.pallas import draft_attention as DA

    info = DA.row_schedule(ragged_lengths(shape), shape.ring, tile, shape.window)
    return int(info[:, 4].sum()), shape.batch * -(-shape.ring // tile)


def relative_error(out, ref) -> float:
    """max |out - ref| / max |ref| in float32; inf if the kernel output is not finite."""
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(out))):
        return float("inf")
    return float(jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def env_line() -> str:
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    cap = getattr(dev, "compute_capability", None)
    return f"jax {jax.__version__}, {dev.platform} ({kind}{', sm ' + str(cap) if cap else ''}), pid {os.getpid()}"
