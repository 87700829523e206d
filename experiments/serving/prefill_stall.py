"""How long a long prompt stalls the running requests, with chunked prefill and without (SmolLM2 f32, AR).

``EngineCore`` without HTTP, driven as the scheduler drives it (admit → one prefill call → one step):
``--running`` requests decode; once they have, a ``--long``-token prompt arrives. Reported per
``--prefill-chunk`` value: the longest gap between two decode steps of the running requests while the
long prompt is prefilled (the stall), the median gap before it arrived, and the long prompt's time to
first token. A chunk as wide as the prompt stalls the running requests for the whole prompt, as the
engine did before chunks were interleaved with decode steps (it ran them back to back). Each
configuration runs twice; the second (compiled) pass is reported.

    PYTHONPATH=. python experiments/serving/prefill_stall.py --out experiments/serving/prefill_stall.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dspine_jax.bench import machine_info
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import encode_prompt, load_tokenizer
from dspine_jax.serve.engine import EngineCore, SlotParams


def run(core: EngineCore, short: list[list[int]], long: list[int], before: int, new_tokens: int) -> dict:
    """The short prompts decode for ``before`` steps, then the long one arrives → gaps and its TTFT."""
    for slot, prompt in enumerate(short):
        core.add(slot, prompt, new_tokens, SlotParams())
    stamps, arrived, first_at, slot = [], None, None, len(short)
    while core.num_running() or core.num_prefilling():
        if len(stamps) == before and arrived is None:
            arrived = time.perf_counter()
            core.admit(slot, long, 4, SlotParams())
        chunk = slot in core.prefilling  # this iteration runs a chunk of the long prompt
        if slot in core.prefill():
            first_at = time.perf_counter()
        result = core.step(rounds=1 if core.num_prefilling() else None)
        if any(result.tokens.get(s) for s in range(len(short))):
            stamps.append((time.perf_counter(), chunk))  # the gap ending here held a chunk
        for s in result.finished:
            core.release(s)
        if arrived is not None and first_at is not None and all(not core.running[s] for s in range(len(short))):
            break
    for s in range(core.num_slots):
        if core.occupied[s]:
            core.release(s)
    gaps = [(b - a, during) for (a, _), (b, during) in zip(stamps, stamps[1:])]
    return {
        "gap_before_s": round(statistics.median(g for g, d in gaps[: before - 1]), 3),
        "max_gap_during_s": round(max([g for g, d in gaps if d] + [0.0]), 3),
        "long_ttft_s": round(first_at - arrived, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--running", type=int, default=4)
    ap.add_argument("--long", type=int, default=1000, help="tokens of the long prompt")
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_target(args.model)
    tok = load_tokenizer(args.model)
    texts = ["Write a haiku about autumn leaves.", "Explain why the sky is blue in two sentences.",
             "List three uses of a binary search tree.", "What is 17 times 23? Show your steps."]
    short = [encode_prompt(tok, texts[i % len(texts)], chat=True) for i in range(args.running)]
    filler = encode_prompt(tok, " ".join(["Summarize the following notes carefully."] * 200), chat=True)
    long = filler[: args.long]
    rows = []
    for chunk in args.chunks:
        core = EngineCore(target, None, num_slots=args.running + 1, context_length=args.context_length, stop_ids=[],
                          prefill_chunk=chunk)
        run(core, short, long, 4, args.new_tokens)  # compile
        result = run(core, short, long, 4, args.new_tokens)
        rows.append({"prefill_chunk": chunk, **result})
        print(f"prefill chunk {chunk}: decode gap {result['gap_before_s']:.3f} s before, longest "
              f"{result['max_gap_during_s']:.3f} s while the {len(long)}-token prompt prefills; its TTFT "
              f"{result['long_ttft_s']:.3f} s", flush=True)
    if args.out:
        report = {"machine": machine_info(), "model": args.model, "running": args.running, "long_tokens": len(long),
                  "new_tokens": args.new_tokens, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
