"""What the target's weight products cost for a block of T rows, T = 1, 2, 4, 8: every layer's `qkv`, `o`,
`gate_up` and `down`, then the LM head and an argmax, chained as in a forward (each product feeds the next, so
they run one after another and every weight streams from memory once per call), through the packed target's own
products (the CPU panel kernel where it is built). Nothing else of a forward: this isolates what a wider verify
adds in the products. Interleaved repeats, medians, × T = 1. Usage:

    python experiments/adaptive/panel_products.py [--model smollm2-135m-instruct] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from dspine_jax.bench import machine_info
from dspine_jax.models import panels
from dspine_jax.models.quant import matmul_f32
from dspine_jax.models.target import load_target

ROWS = (1, 2, 4, 8)


@jax.jit
def products(params, x: jax.Array) -> jax.Array:
    """``x [T, H]`` through every layer's four products (tanh keeps the values bounded), then the head's argmax."""
    h = x
    for layer in params.layers:
        width = h.shape[-1]
        attention = jnp.tanh(matmul_f32(h, layer.qkv)[:, :width])
        h = h + matmul_f32(attention, layer.o)
        gate, up = jnp.split(matmul_f32(h, layer.gate_up), 2, axis=-1)
        h = h + matmul_f32(jnp.tanh(gate) * up, layer.down)
    return jnp.argmax(matmul_f32(h, params.lm_head), axis=-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    target = load_target(args.model)
    params = target.params
    if not hasattr(params, "layers") or not hasattr(params.layers[0], "gate_up"):
        raise SystemExit(f"{args.model}: this study runs dense targets (qkv, o, gate_up, down per layer)")
    key = jax.random.key(0)
    xs = {t: jax.random.normal(jax.random.fold_in(key, t), (t, target.config.hidden_size), jnp.float32) for t in ROWS}
    for x in xs.values():  # compile
        products(params, x).block_until_ready()
    times: dict[int, list[float]] = {t: [] for t in ROWS}
    for _ in range(args.repeats):
        for t, x in xs.items():
            begin = time.perf_counter()
            products(params, x).block_until_ready()
            times[t].append(time.perf_counter() - begin)
    med = {t: statistics.median(v) * 1e3 for t, v in times.items()}
    print(f"{machine_info()}; {args.model}; products: {'panel kernel' if panels.is_packed(params) else 'XLA'}; "
          f"medians of {args.repeats}")  # fmt: skip
    print("  ".join(f"T={t}: {m:.2f} ms ({m / med[1]:.2f}×)" for t, m in med.items()))


if __name__ == "__main__":
    main()
