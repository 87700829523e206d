"""Micro-benchmark: the drafter's two kernels, XLA reference vs Pallas kernel, at drafter shapes.

    JAX_PLATFORMS=cpu python experiments/kernels/bench.py                      # CPU: kernel in interpret mode
    python experiments/kernels/bench.py --backend pallas --shapes smollm2,27b  # TPU / GPU: compiled kernel

For each (kernel, shape, dtype): compile time, max relative error vs the reference (``inf`` = non-finite
output), median wall time of the jitted reference and of the jitted kernel, and for the attention the
fraction of context tiles the kernel visits (the rest are skipped: empty or out of the window).

On CPU the kernel can only run in interpret mode (Pallas lowers to Mosaic TPU / Triton, not to XLA:CPU
code): interpret mode runs the grid as an XLA loop over per-program bodies, so its times measure the
emulation, not the kernel — they are printed for completeness, never as a speed result.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
from common import SHAPES, Shape, attention_inputs, env_line, relative_error, tiles_visited, transition_inputs
from dspine_jax.pallas import dispatch
from dspine_jax.pallas import draft_attention as DA
from dspine_jax.pallas import transition_cache as TC

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def timed(fn, args, iters: int) -> tuple[object, float, float]:
    """(output, compile seconds, median run ms) of ``jax.jit(fn)(*args)``."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return out, compile_s, 1e3 * statistics.median(times)


def run(kernel: str, shape: Shape, dtype, backend: dispatch.Backend, iters: int) -> dict:
    """One benchmark row; errors are reported in the row, not raised."""
    row = dict(kernel=kernel, shape=shape.name, dtype=jnp.dtype(dtype).name, backend=backend.name)
    try:
        if kernel == "draft_attention":
            args = attention_inputs(shape, dtype)
            opts = dict(window=shape.window, causal=True)
            ref_fn = functools.partial(DA.draft_attention_reference, **opts)
            ker_fn = functools.partial(DA.draft_attention_pallas, backend=backend, **opts)
            tile = (512 if backend.flavor == "tpu" else (32 if shape.head_dim > 128 else 64))
            visited, total = tiles_visited(shape, min(tile, shape.ring))
            row["tiles"] = f"{visited}/{total}"
        else:
            args = transition_inputs(shape, dtype)
            ref_fn = lambda *a: TC.transition_scores_reference(*a, 1e-6)  # noqa: E731
            ker_fn = lambda *a: TC.transition_scores_pallas(*a, 1e-6, backend=backend)  # noqa: E731
            b, p, c, h = shape.batch, shape.block - 1, shape.candidates, shape.hidden
            row["tiles"] = f"{b * p * c * h * jnp.dtype(dtype).itemsize / 2**20:.2f} MiB kept on chip"
        ref, _, row["ref_ms"] = timed(ref_fn, args, iters)
        out, row["compile_s"], row["kernel_ms"] = timed(ker_fn, args, iters)
        row["rel_err"] = relative_error(out, ref)
    except Exception as e:  # a failed compile is a result too
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| kernel | shape | dtype | backend | compile s | max rel err | reference ms | kernel ms | ref/kernel "
        "| tiles visited / on-chip |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['backend']} | FAILED: {r['error']} |||||")
            continue
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['backend']} | {r['compile_s']:.2f} | "
            f"{r['rel_err']:.2e} | {r['ref_ms']:.3f} | {r['kernel_ms']:.3f} | {r['ref_ms'] / r['kernel_ms']:.2f}x | "
            f"{r.get('tiles', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="smollm2,27b-small", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernels", default="draft_attention,transition_cache")
    parser.add_argument(
        "--backend", default=None, help="auto|pallas|interpret (default: interpret on CPU, else pallas)"
    )
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    mode = args.backend or ("interpret" if jax.default_backend() == "cpu" else "pallas")
    backend = dispatch.select("bench", mode)
    print(f"{env_line()}; kernel backend {backend.name} (flavor {backend.flavor}), median of {args.iters} runs\n")
    rows = []
    for kernel in args.kernels.split(","):
        for name in args.shapes.split(","):
            for dtype in args.dtypes.split(","):
                rows.append(run(kernel, SHAPES[name], DTYPES[dtype], backend, args.iters))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print("\n" + table(rows))


if __name__ == "__main__":
    main()
