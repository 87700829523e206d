"""Builds of the CPU panel kernel side by side in one process: each source file given (a variant of
``kernels/cpu/panel_matmul.cc``) is compiled as the package compiles it and registered under its own FFI target, and
SmolLM2's products (``panel_products.products``: every layer's four, then the head) run through each build for
blocks of several row counts, interleaved per repeat, medians in ms. The builds must pick the same tokens.

    python experiments/adaptive/kernel_ab.py kernels/cpu/panel_matmul.cc /tmp/variant.cc [--rows 1,4,6,8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from panel_products import products  # this folder is on sys.path when run

from dspine_jax.bench import machine_info
from dspine_jax.models import panels
from dspine_jax.models.target import load_target


def register(source: Path, index: int, build_dir: Path) -> dict:
    """Build ``source`` as the package builds its kernel and register its handlers under targets of their own:
    ``panels.FFI_TARGETS`` for this build (dtype → (target name, symbol))."""
    library = build_dir / f"panel_ab_{index}.so"
    panels._build(library, source)
    targets = {dtype: (f"panel_ab_{index}_{name}", symbol) for dtype, (name, symbol) in panels.FFI_TARGETS.items()}
    panels._register(library, targets)
    return targets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--rows", default="1,2,4,6,8")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    target = load_target("smollm2-135m-instruct")
    if not panels.is_packed(target.params):
        raise SystemExit("the target is not packed for the panel kernel on this machine")
    xs = {m: jax.random.normal(jax.random.key(m), (m, target.config.hidden_size), jnp.float32) for m in rows}
    runs, first = {}, {}
    shipped = dict(panels.FFI_TARGETS)
    with tempfile.TemporaryDirectory() as build_dir:
        for i, source in enumerate(args.sources):
            targets = register(source, i, Path(build_dir))
            runs[i] = jax.jit(products.__wrapped__)  # its own cache: traced with this build's targets
            panels.FFI_TARGETS.update(targets)
            try:
                for m, x in xs.items():
                    first[i, m] = np.asarray(runs[i](target.params, x))
            finally:
                panels.FFI_TARGETS.update(shipped)
    for (i, m), out in first.items():
        if not np.array_equal(out, first[0, m]):
            raise SystemExit(f"{args.sources[i]} picks other tokens than {args.sources[0]} at {m} rows")
    times = {key: [] for key in first}
    for _ in range(args.repeats):
        for m, x in xs.items():
            for i, run in runs.items():
                begin = time.perf_counter()
                run(target.params, x).block_until_ready()
                times[i, m].append(time.perf_counter() - begin)
    print(f"# {machine_info()}; SmolLM2's products, ms (medians of {args.repeats}, interleaved)")
    for i, source in enumerate(args.sources):
        print(f"{source!s:40s} " + "  ".join(f"{m}: {statistics.median(times[i, m]) * 1e3:5.1f}" for m in rows))


if __name__ == "__main__":
    main()
