"""Where a wider verify's extra time goes on this device: the target's verify forward at T = 1, 2, 4, 8 with pieces
taken out — the LM head, the attention over the cache, the cache write — so what is left is the weight products
(SmolLM2-135M-Instruct f32, batch 1, a 200-token context, weights passed as arguments as in the package's
programs, variants interleaved per repeat, medians).

    PYTHONPATH=. python experiments/adaptive/verify_ablation.py
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from dspine_jax.bench import interleaved_median_ms
from dspine_jax.models import dense
from dspine_jax.models import target as tgt

ATTENTION, WRITE_BLOCK = dense.cached_attention, dense.write_block


def variant(name: str):
    """The verify (forward + head + argmax) without the pieces ``name`` lists (``head``, ``attention``, ``write``)."""

    def verify(target, cache, block):
        dense.cached_attention = (lambda q, *a, **k: q * 1.0001) if "attention" in name else ATTENTION
        dense.write_block = (lambda c, b, lengths, **k: c) if "write" in name else WRITE_BLOCK
        try:
            hidden, _, cache, _ = tgt.forward(target, cache, block)
        finally:
            dense.cached_attention, dense.write_block = ATTENTION, WRITE_BLOCK
        return (hidden if "head" in name else jnp.argmax(tgt.lm_logits(target, hidden), -1)), cache

    return jax.jit(verify)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    target = tgt.load_target(args.model)
    n = args.context
    cache = tgt.init_cache(target, 1, n + 72)
    _, _, cache, saved = jax.jit(tgt.forward)(target, cache, jnp.asarray([[100 + i % 1000 for i in range(n)]], jnp.int32))
    cache = tgt.replay(target, cache, saved, jnp.asarray([n], jnp.int32))
    names = ["whole verify", "without head", "without head, attention", "without head, write",
             "without head, attention, write"]  # fmt: skip
    programs = {k: variant(k) for k in names}
    table = {}
    for t in (1, 2, 4, 8):
        block = jnp.asarray([[7 + i for i in range(t)]], jnp.int32)
        table[t] = interleaved_median_ms({k: functools.partial(f, target, cache, block) for k, f in programs.items()},
                                         args.repeats)  # fmt: skip
    print(f"{jax.devices()[0].device_kind}; ms, median of {args.repeats}")
    for t, row in table.items():
        print(f"T = {t}: " + "; ".join(f"{k} {v:.2f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
