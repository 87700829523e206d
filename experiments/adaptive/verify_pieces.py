"""What a verify of T tokens costs on this device, piece by piece, × a plain step (issue: a cheaper drafted round).

For SmolLM2-135M-Instruct (f32) at batch 1 with a 200-token context: the whole verify (target forward over T
tokens + LM head), the forward without the head, and the LM head ``[T, H] @ [H, V]`` in three formulations —
``x @ W`` (today's), ``einsum("tk,nk->tn", x, W_T)`` with the head stored transposed, and a broadcast multiply
and sum over ``W_T`` — each jitted alone, median of ``--repeats`` calls, the pieces interleaved per repeat.

    PYTHONPATH=. python experiments/adaptive/verify_pieces.py --out experiments/adaptive/verify_pieces.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from dspine_jax.bench import machine_info
from dspine_jax.models import target as tgt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = tgt.load_target(args.model)
    n = args.context
    prompt = jnp.asarray([[100 + i % 1000 for i in range(n)]], jnp.int32)
    cache = tgt.init_cache(target, 1, n + 16)
    _, _, cache, saved = jax.jit(tgt.forward)(target, cache, prompt)
    cache = tgt.replay(target, cache, saved, jnp.asarray([n], jnp.int32))
    head = target.params.lm_head  # [H, V]
    head_t = jnp.asarray(head.T)  # [V, H], prepared once

    @jax.jit
    def verify(cache, block):
        hidden, _, _, _ = tgt.forward(target, cache, block)
        return jnp.argmax(tgt.lm_logits(target, hidden), axis=-1)

    @jax.jit
    def body(cache, block):
        return tgt.forward(target, cache, block)[0]

    pieces = {
        "verify (forward + head + argmax)": lambda x, b: verify(cache, b),
        "forward without the head": lambda x, b: body(cache, b),
        "head x @ W": jax.jit(lambda x, b: jnp.matmul(x, head, preferred_element_type=jnp.float32)),
        "head einsum tk,nk->tn (W_T)": jax.jit(lambda x, b: jnp.einsum("tk,nk->tn", x, head_t,
                                                                      preferred_element_type=jnp.float32)),
        "head multiply-sum over W_T": jax.jit(lambda x, b: jnp.sum(x[:, None, :] * head_t[None], axis=-1)),
    }
    table: dict[int, dict[str, float]] = {}
    for t in (1, 2, 4, 8):
        block = jnp.asarray([[7 + i for i in range(t)]], jnp.int32)
        x = jax.random.normal(jax.random.key(t), (t, head.shape[0]), jnp.float32)
        for f in pieces.values():  # compile
            jax.block_until_ready(f(x, block))
        times: dict[str, list[float]] = {k: [] for k in pieces}
        for _ in range(args.repeats):
            for name, f in pieces.items():
                start = time.perf_counter()
                jax.block_until_ready(f(x, block))
                times[name].append(time.perf_counter() - start)
        table[t] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    plain = table[1]["verify (forward + head + argmax)"]
    print(f"{jax.devices()[0].device_kind}; ms (median of {args.repeats}), × a plain step's verify ({plain:.2f} ms)")
    for t, row in table.items():
        print(f"T = {t}: " + "; ".join(f"{k} {v:.2f} ({v / plain:.2f}×)" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "model": args.model, "context": n, "repeats": args.repeats,
                       "ms": {str(t): row for t, row in table.items()}, "plain_step_ms": plain}, f, indent=1)


if __name__ == "__main__":
    main()
