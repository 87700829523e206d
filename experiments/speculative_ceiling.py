"""Speculative engine on SmolLM2-135M-Instruct (CPU): per-round time split and the oracle ceiling.

    JAX_PLATFORMS=cpu python experiments/speculative_ceiling.py [--max-new-tokens 128] [--out FILE.md]

* AR baseline: ``generate`` greedy (f32), decode tokens/s.
* Untrained DSpine drafter (``init_drafter``, 5 layers, block 16): ``speculative_generate`` greedy — τ ≈ 1,
  so this is the engine's overhead; its output must equal AR's.
* Oracle proposer (the AR output as proposals, a wrong token after τ-1 of them): τ = 4, 8, 16 with the
  verify length fixed at 16 and with the verify length equal to τ. Output must equal AR's. This is the
  ceiling the engine gives a perfect drafter on this machine (the oracle's own cost is ~0; a real
  drafter adds its draft time, measured separately).
* Per-round split at batch 1, verify 16: draft (``draft`` alone, jitted), verify (target forward over 16
  tokens with the drafter's taps + LM head, jitted, cache donated), and the rest of a loop iteration
  (accept + commit + stop checks + loop overhead) = round − draft − verify, where round = decode seconds
  per while_loop iteration of the untrained-drafter run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.proposers import OracleProposer
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.drafter import draft
from dspine_jax.drafters.io import init_drafter
from dspine_jax.drafters.ring import append_context, init_draft_cache
from dspine_jax.models import target as tgt
from dspine_jax.models.tokenizer import load_tokenizer

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a Python function that checks whether a number is prime, and explain how it works."


def best_of(fn, repeats: int = 5) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n = args.max_new_tokens

    target = tgt.load_target(MODEL)
    tok = load_tokenizer(MODEL)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    lines = [f"SmolLM2-135M-Instruct f32, {jax.devices()[0].device_kind} ({os.cpu_count()} cores), "
             f"batch 1, prompt {len(prompt)} tokens, {n} new tokens, greedy", ""]

    generate(target, [prompt], n, stop_ids=[])  # compile
    ar = min((generate(target, [prompt], n, stop_ids=[]) for _ in range(2)), key=lambda r: r.decode_seconds)
    reference = ar.token_ids[0]
    ar_step = ar.decode_seconds / (n - 1)
    rows = [("AR (generate)", "-", "1.00", f"{ar_step * 1e3:.1f}", f"{ar.decode_tokens_per_second:.1f}", "1.00×")]

    def spec(proposer, block: int, label: str):
        speculative_generate(target, proposer, [prompt], n, stop_ids=[], block_size=block)  # compile
        runs = [speculative_generate(target, proposer, [prompt], n, stop_ids=[], block_size=block) for _ in range(2)]
        res = min(runs, key=lambda r: r.decode_seconds)  # the machine is shared: keep the least disturbed run
        assert res.token_ids[0] == reference, f"{label}: speculative output differs from AR"
        round_s = res.decode_seconds / res.num_iterations
        tps = res.decode_tokens_per_second
        rows.append((label, str(block), f"{res.mean_acceptance:.2f}", f"{round_s * 1e3:.1f}", f"{tps:.1f}",
                     f"{tps / ar.decode_tokens_per_second:.2f}×"))
        return res, round_s

    drafter = init_drafter(target, "dspine", num_layers=5, block_size=16)
    _, round_untrained = spec(drafter, 16, "untrained DSpine (5 layers)")
    ref = jnp.asarray([reference + [0] * 32], jnp.int32)
    for tau in (4, 8, 16):
        for block in sorted({16, tau}):
            oracle = OracleProposer(reference=ref, accept=jnp.full((1, 1), tau - 1, jnp.int32),
                                    vocab_size=target.config.vocab_size)
            spec(oracle, block, f"oracle τ={tau}")

    # Per-round split at verify 16 with the untrained drafter, context = prompt + n/2 generated tokens.
    taps = drafter.config.target_layer_ids
    context = jnp.asarray([prompt + reference[: n // 2]], jnp.int32)
    length = context.shape[1]
    cache = tgt.init_cache(target, 1, length + 32)
    _, tapped, cache, _ = jax.jit(tgt.forward, static_argnames="taps")(target, cache, context, taps)
    cache = cache.commit(jnp.asarray([length]))
    dcache = jax.jit(append_context)(drafter, init_draft_cache(drafter, 1, length + 32), tapped, jnp.asarray([length]))
    anchor = jnp.asarray([reference[n // 2]], jnp.int32)
    draft_fn = jax.jit(draft)
    key = jax.random.key(0)
    greedy = jnp.float32(0.0)
    t_draft = best_of(lambda: jax.block_until_ready(draft_fn(drafter, target, dcache, anchor, key, greedy)))
    block = jnp.concatenate([anchor[:, None], draft_fn(drafter, target, dcache, anchor, key, greedy).tokens], 1)

    def verify_impl(target, cache, block):
        hidden, tapped, cache, _ = tgt.forward(target, cache, block, taps)
        return tgt.lm_logits(target, hidden), tapped, cache

    verify = jax.jit(verify_impl, donate_argnums=1)
    state = {"cache": cache}

    def run_verify():
        logits, _, state["cache"] = verify(target, state["cache"], block)
        jax.block_until_ready(logits)

    t_verify = best_of(run_verify)
    one = jnp.asarray([[reference[n // 2]]], jnp.int32)

    def run_one():
        logits, _, state["cache"] = verify(target, state["cache"], one)
        jax.block_until_ready(logits)

    t_one = best_of(run_one)
    rest = round_untrained - t_draft - t_verify

    lines += ["| decoding | verify T | τ | ms / round | decode tok/s | speedup vs AR |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Per-round split (batch 1, verify 16, untrained 5-layer DSpine, context "
              f"{length} tokens):", "", "| piece | ms |", "|---|---|",
              f"| draft (`draft`, jitted alone) | {t_draft * 1e3:.2f} |",
              f"| verify (target forward 16 tokens + taps + LM head) | {t_verify * 1e3:.2f} |",
              f"| accept + commit + loop (round − draft − verify) | {rest * 1e3:.2f} |",
              f"| whole round (loop iteration) | {round_untrained * 1e3:.2f} |",
              f"| for scale: target forward of 1 token (+ taps + head) | {t_one * 1e3:.2f} |"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
