"""Why verifying T > 1 tokens costs much more than one on XLA:CPU: one ``[T, K] @ [K, N]`` at SmolLM2's
shapes for T = 1, 2, 4, 8 (µs, median of 30). Run it under different ``XLA_FLAGS`` to compare the CPU
matmul back ends, e.g.::

    for f in "" --xla_cpu_use_onednn=true --xla_cpu_use_xnnpack=true; do
        XLA_FLAGS="$f" python experiments/adaptive/gemm_rows.py; done
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from draft_profile import timed  # the same median timer (this folder is on sys.path when run)


def main() -> None:
    rng = np.random.default_rng(0)
    matmul = jax.jit(lambda x, w: x @ w)
    cells = []
    for name, (k, n) in {"gate_up": (576, 3072), "lm_head": (576, 49152)}.items():
        w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))
        for t in (1, 2, 4, 8):
            x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32))
            cells.append(f"{name} T={t}: {timed(matmul, x, w) * 1e3:.0f}")
    print(os.environ.get("XLA_FLAGS") or "(default flags)", "|", " | ".join(cells))


if __name__ == "__main__":
    main()
