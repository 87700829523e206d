"""Why verifying T > 1 tokens costs much more than one on XLA:CPU: one ``[T, K] @ [K, N]`` at SmolLM2's
shapes for T = 1, 2, 4, 8 (µs, median of 30). Run it under different ``XLA_FLAGS`` to compare the CPU
matmul back ends, e.g.::

    for f in "" --xla_cpu_use_onednn=true --xla_cpu_use_xnnpack=true; do
        XLA_FLAGS="$f" python experiments/adaptive/gemm_rows.py; done
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_us(f, *args, repeats: int = 30) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    matmul = jax.jit(lambda x, w: x @ w)
    cells = []
    for name, (k, n) in {"gate_up": (576, 3072), "lm_head": (576, 49152)}.items():
        w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))
        for t in (1, 2, 4, 8):
            x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32))
            cells.append(f"{name} T={t}: {median_us(matmul, x, w):.0f}")
    print(os.environ.get("XLA_FLAGS") or "(default flags)", "|", " | ".join(cells))


if __name__ == "__main__":
    main()
