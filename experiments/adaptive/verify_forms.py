"""How the formulation of the target's projections sets a verify's cost on XLA:CPU (issue: a cheaper drafted round).

The body of a verify is the target's weight products: per layer ``qkv``, ``o``, ``gate_up``, ``down``, then the LM
head. This runs exactly those products of SmolLM2-135M-Instruct (its real f32 weights, norms and attention left
out, a cheap nonlinearity between them so nothing folds) over ``T`` rows, in four forms, each jitted alone, the
forms interleaved per repeat, medians:

* ``dot, weights as arguments`` — ``x @ W`` with the weights passed in, as every program of the package does;
* ``dot, weights as constants`` — the same with the weights closed over (compiled into the program);
* ``multiply-sum over W_T, arguments`` — ``sum(x[:, None, :] * W_T[None], -1)`` with ``W_T = W.T`` prepared once;
* ``multiply-sum over W_T, constants`` — the same, closed over;
* ``panel kernel, arguments`` — the package's CPU products (``models/panels.py``): weights packed in panels once,
  one FFI kernel call per product.

XLA:CPU (jax 0.10) lowers the multiply-sum to a YNNPACK fusion, which prepares (packs) a constant weight once and
a parameter on every call: the reason the constant form is the only fast XLA form at T >= 2 — and compiling
every weight into every program is no way to serve. The panel kernel gets there with the weights as arguments.

    PYTHONPATH=. python experiments/adaptive/verify_forms.py --out experiments/adaptive/verify_forms.json
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from verify_pieces import report  # this folder is on sys.path when run

from dspine_jax.bench import interleaved_median_ms
from dspine_jax.models import panels
from dspine_jax.models import target as tgt


def dot(x, w):
    return x @ w


def multiply_sum(x, w_t):
    return jnp.sum(x[:, None, :] * w_t[None], axis=-1)


def projections(product, layers, head):
    """``x [T, H]`` → logits ``[T, V]`` through every layer's four products and the head."""

    def run(x):
        h = x.shape[-1]
        for qkv, o, gate_up, down in layers:
            x = x + jnp.tanh(product(jnp.tanh(product(x, qkv)[:, :h]), o))
            g = product(x, gate_up)
            f = g.shape[-1] // 2
            x = x + jnp.tanh(product(jax.nn.silu(g[:, :f]) * g[:, f:], down))
        return product(x, head)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = tgt.load_target(args.model, products="xla").params
    layers = [(lp.qkv, lp.o, lp.gate_up, lp.down) for lp in params.layers]
    layers_t = jax.tree.map(lambda w: jnp.asarray(w.T), layers)  # prepared once
    head, head_t = params.lm_head, jnp.asarray(params.lm_head.T)
    packed = (jax.tree.map(panels.pack, layers), panels.pack(head))  # prepared once
    forms = {
        "dot, weights as arguments": (jax.jit(lambda w, x: projections(dot, *w)(x)), (layers, head)),
        "dot, weights as constants": (jax.jit(lambda w, x: projections(dot, layers, head)(x)), None),
        "multiply-sum over W_T, arguments": (jax.jit(lambda w, x: projections(multiply_sum, *w)(x)), (layers_t, head_t)),
        "multiply-sum over W_T, constants": (jax.jit(lambda w, x: projections(multiply_sum, layers_t, head_t)(x)), None),
    }
    if panels.kernel_available():
        forms["panel kernel, arguments"] = (jax.jit(lambda w, x: projections(panels.panel_matmul, *w)(x)), packed)
    table: dict[int, dict[str, float]] = {}
    for t in (1, 2, 4, 8):
        x = jax.random.normal(jax.random.key(t), (t, head.shape[0]), jnp.float32)
        table[t] = interleaved_median_ms({k: functools.partial(f, w, x) for k, (f, w) in forms.items()}, args.repeats)
    report(table, "dot, weights as arguments", "T = 1 dot with arguments", args.out,
           {"model": args.model, "repeats": args.repeats}, "baseline_ms")  # fmt: skip


if __name__ == "__main__":
    main()
