"""Engine step cost against ``generate``, side by side in one process (SmolLM2 f32, greedy).

For concurrency c ∈ {1, 8}: ``generate`` with batch c (decode tok/s, compile excluded) and the serving
engine (``EngineCore``, no HTTP) with c requests admitted at once (decode tok/s over the steps, compile
excluded by a warm-up pass with the same shapes). Medians over ``--repeats``.

    PYTHONPATH=. python experiments/serving/engine_vs_generate.py --out experiments/serving/engine_vs_generate.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dspine_jax.bench import machine_info
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import encode_prompt, load_tokenizer
from dspine_jax.serve.engine import EngineCore, SlotParams

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue in two sentences.",
    "What is 17 times 23? Show your steps.",
    "Write a haiku about autumn leaves.",
    "List three uses of a binary search tree.",
    "Translate 'good morning, friends' into French.",
    "Write a function that reverses a linked list in Python.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
]


def run_engine(core: EngineCore, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]], int, list[int]]:
    """Admit every prompt (slot i ← prompt i), step until all finish → (decode seconds, outputs, engine
    steps, per-round acceptance lengths); prefill time excluded."""
    outs, steps, taus = {}, 0, []
    for slot, p in enumerate(prompts):
        first, _ = core.add(slot, p, n, SlotParams())
        outs[slot] = [first]
    start = time.perf_counter()
    while core.num_running():
        res = core.step()
        steps += 1
        taus += res.accepted
        for slot, toks in res.tokens.items():
            outs[slot] += toks
        for slot in res.finished:
            core.release(slot)
    seconds = time.perf_counter() - start
    for slot in list(outs):
        if core.occupied[slot]:
            core.release(slot)
    return seconds, [outs[i] for i in range(len(prompts))], steps, taus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="a drafter for the engine's speculative rows (default: AR only)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = load_target(args.model)
    tok = load_tokenizer(args.model)
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    n = args.new_tokens
    drafter = load_draft(args.draft, target) if args.draft else None
    core = EngineCore(target, drafter, num_slots=8, context_length=args.context_length, stop_ids=[],
                      verify_len=args.block_size)
    rows = []
    for c in args.concurrency:
        batch = prompts[:c]
        gen_rates, eng_rates = [], []
        generate(target, batch, n, stop_ids=[])  # compile
        run_engine(core, batch, n)  # compile every shape this level uses
        for _ in range(args.repeats):
            result = generate(target, batch, n, stop_ids=[])
            ref = result.token_ids
            gen_rates.append(sum(map(len, ref)) / result.decode_seconds)
            seconds, outs, _, _ = run_engine(core, batch, n)
            assert outs == ref, "the engine's greedy output differs from generate's"
            eng_rates.append(sum(map(len, outs)) / seconds)
        g, e = statistics.median(gen_rates), statistics.median(eng_rates)
        rows.append({"concurrency": c, "generate_tok_s": round(g, 2), "engine_tok_s": round(e, 2), "ratio": round(e / g, 3)})
        print(f"c={c}: generate {g:.1f} tok/s, engine {e:.1f} tok/s, ratio {e / g:.2f}", flush=True)
    report = {"machine": machine_info(), "model": args.model, "draft": args.draft, "new_tokens": n,
              "context_length": args.context_length, "repeats": args.repeats, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
