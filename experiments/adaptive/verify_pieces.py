"""What a verify of T tokens costs on this device, piece by piece, × a plain step (issue: a cheaper drafted round).

For SmolLM2-135M-Instruct (f32) at batch 1 with a 200-token context: the whole verify (target forward over T
tokens + LM head), the forward without the head, and the LM head ``[T, H] @ [H, V]`` in three formulations —
``x @ W`` (today's), ``einsum("tk,nk->tn", x, W_T)`` with the head stored transposed, and a broadcast multiply
and sum over ``W_T`` — each jitted alone, median of ``--repeats`` calls, the pieces interleaved per repeat.

    PYTHONPATH=. python experiments/adaptive/verify_pieces.py --out experiments/adaptive/verify_pieces.json
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from dspine_jax.bench import interleaved_median_ms, machine_info
from dspine_jax.models import target as tgt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = tgt.load_target(args.model, products="xla")  # the XLA formulations (panels.py is timed in verify_forms.py)
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
        table[t] = interleaved_median_ms({k: functools.partial(f, x, block) for k, f in pieces.items()}, args.repeats)
    report(table, "verify (forward + head + argmax)", "a plain step's verify", args.out,
           {"model": args.model, "context": n, "repeats": args.repeats}, "plain_step_ms")  # fmt: skip


def report(table: dict[int, dict[str, float]], base: str, label: str, out: str | None, meta: dict, base_key: str) -> None:
    """Print ``{T: {piece: ms}}`` with each piece × ``table[1][base]``, and write it (with ``meta``) to ``out``."""
    ms = table[1][base]
    print(f"{jax.devices()[0].device_kind}; ms (median of {meta['repeats']}), × {label} ({ms:.2f} ms)")
    for t, row in table.items():
        print(f"T = {t}: " + "; ".join(f"{k} {v:.2f} ({v / ms:.2f}×)" for k, v in row.items()))
    if out:
        with open(out, "w") as f:
            json.dump({"machine": machine_info(), **meta, "ms": {str(t): row for t, row in table.items()}, base_key: ms},
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
