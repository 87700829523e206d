"""GPU (or TPU) check of the Pallas kernels: compile, compare with the XLA reference, time, print a table.

    python experiments/kernels/gpu_check.py            # on the accelerator machine; < 5 minutes
    python experiments/kernels/gpu_check.py --quick    # SmolLM2 shapes only

Standalone (needs only jax with CUDA or TPU support and this repository). What it does:

1. Prints the environment: JAX version, device and compute capability, whether this JAX still ships the
   Pallas Triton backend, what the dispatcher picks in ``auto`` and ``pallas`` mode.
2. For each kernel × shape × dtype (SmolLM2 drafter f32 + bf16, 27B drafter bf16 — see common.py):
   compiles the kernel through the dispatcher's compiled backend (Triton on GPU, Mosaic on TPU), runs it
   once with a NaN-poisoned aliased output buffer (every element must be written and finite), compares it
   with the jitted reference, and times both (median of --iters runs).
3. Probes whether Mosaic GPU (JAX's default ``pallas_call`` lowering on CUDA since 0.10) accepts the GPU
   kernels — informational only; the dispatcher does not use it.
4. Prints a markdown table ready for experiments/kernels/RESULTS.md and exits 1 if any check failed.

Tolerances: bf16 ≤ 2e-2 and f32 ≤ 5e-3 relative to max |reference| — f32 matmuls on Ampere+ may run as TF32
in both XLA and Triton, so the CPU tests' 1e-5 does not apply on GPU; a wrong mask or index gives O(1).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench
import jax
import jax.numpy as jnp
from common import SHAPES, attention_inputs, env_line, transition_inputs
from dspine_jax.pallas import dispatch
from dspine_jax.pallas import draft_attention as DA
from dspine_jax.pallas import transition_cache as TC

TOL = {"float32": 5e-3, "bfloat16": 2e-2}
BUDGET_S = 270  # stop starting new rows past this (the whole script must stay under 5 minutes)


def poisoned_output_finite(kernel: str, shape, dtype, backend: dispatch.Backend) -> bool:
    """Run once with the NaN-poisoned aliased output: False if any element stayed unwritten or is NaN."""
    if kernel == "draft_attention":
        fn = functools.partial(
            DA.draft_attention_pallas, window=shape.window, causal=True, backend=backend, poison=True
        )
        out = jax.jit(fn)(*attention_inputs(shape, dtype, seed=1))
    else:
        fn = lambda *a: TC.transition_scores_pallas(*a, 1e-6, backend=backend, poison=True)  # noqa: E731
        out = jax.jit(fn)(*transition_inputs(shape, dtype, seed=1))
    return bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))


def probe_mosaic_gpu() -> str:
    """Does Mosaic GPU lower the GPU-flavor kernels? (Lowering only; nothing runs.)"""
    if jax.default_backend() != "gpu":
        return "n/a (not a GPU)"
    backend = dispatch.Backend("mosaic_gpu", flavor="gpu")  # no compiler params → JAX's default GPU lowering
    shape = SHAPES["smollm2"]
    fn = functools.partial(DA.draft_attention_pallas, window=shape.window, causal=True, backend=backend)
    try:
        jax.jit(fn).lower(*attention_inputs(shape, jnp.bfloat16)).compile()
        return "draft_attention lowers and compiles (unexpected: consider enabling it)"
    except Exception as e:
        return f"rejected: {type(e).__name__}: {str(e).splitlines()[0][:140]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="SmolLM2 shapes only")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--interpret", action="store_true", help="dry run of this script on CPU (interpret mode)")
    args = parser.parse_args()
    start = time.perf_counter()

    print(f"# Pallas kernel check — {datetime.date.today().isoformat()}")
    print(env_line())
    dev = jax.devices()[0]
    print(f"device kind: {getattr(dev, 'device_kind', '?')}; triton backend available: {dispatch.triton_available()}")
    if hasattr(jax.config, "jax_pallas_use_mosaic_gpu"):
        mgpu = jax.config.jax_pallas_use_mosaic_gpu
        print(f"jax_pallas_use_mosaic_gpu (default GPU lowering of pallas_call): {mgpu}")
    print(f"dispatcher auto → {dispatch.resolve('auto')[0]}")
    try:
        backend, why = dispatch.resolve("interpret" if args.interpret else "pallas")
    except Exception as e:
        print(f"FAIL: no compiled Pallas backend here: {e}")
        return 1
    print(f"checking backend {backend.name} (flavor {backend.flavor}; {why})\n")

    plan = [("smollm2", "float32"), ("smollm2", "bfloat16")]
    if not args.quick:
        plan += [("27b", "bfloat16")]
    rows, failed = [], False
    for kernel in ("draft_attention", "transition_cache"):
        for name, dtype_name in plan:
            if time.perf_counter() - start > BUDGET_S:
                print(f"(time budget reached: skipping {kernel} {name} {dtype_name})")
                failed = True
                continue
            dtype = bench.DTYPES[dtype_name]
            # f32 comparisons as tight as the hardware allows (XLA honours this; Triton may still use TF32).
            with jax.default_matmul_precision("highest" if dtype_name == "float32" else "default"):
                row = bench.run(kernel, SHAPES[name], dtype, backend, args.iters)
                if "error" not in row:
                    try:
                        row["poison_ok"] = poisoned_output_finite(kernel, SHAPES[name], dtype, backend)
                    except Exception as e:
                        row["poison_ok"] = False
                        row["poison_err"] = str(e).splitlines()[0][:120]
            ok = "error" not in row and row["rel_err"] <= TOL[dtype_name] and row["poison_ok"]
            row["status"] = "PASS" if ok else "FAIL"
            failed |= not ok
            rows.append(row)
            line = bench.table([row]).splitlines()[-1]
            print(f"{row['status']} {line} poison-check={row.get('poison_ok')}", flush=True)

    print(f"\nMosaic GPU probe: {probe_mosaic_gpu()}")
    card = getattr(dev, "device_kind", dev.platform)
    print(f"\n## Results ({datetime.date.today().isoformat()}, {card}, jax {jax.__version__})\n")
    print(bench.table(rows))
    print("\nstatus: " + ", ".join(f"{r['kernel']}/{r['shape']}/{r['dtype']}={r['status']}" for r in rows))
    print(f"total {time.perf_counter() - start:.0f} s; {'FAILED' if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
