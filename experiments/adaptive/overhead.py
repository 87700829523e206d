"""Where adaptive verification loses time against plain AR decoding, measured side by side (interleaved
repeats, medians) on held-out prompts: our AR decode; the speculative loop held at T = 1 (a plain step
inside the speculative round: taps, drafter context append, bookkeeping), without a drafter and with one;
and --verify auto with a drafter that never proposes anything accepted (probes only) and with the shipped
one. Decode time, and prefill + decode time as the bench counts it. Usage:

    python experiments/adaptive/overhead.py [--domain code] [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from switch_cost import fresh  # this folder is on sys.path when run

from dspine_jax.bench import load_heldout_prompts, select_prompts
from dspine_jax.decoding import adaptive
from dspine_jax.decoding import speculative as spec
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.decoder import run_segment
from dspine_jax.decoding.proposers import NoProposer, as_proposer
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.train.prompts import encode_messages

ROOT = Path(__file__).resolve().parents[2]


def plain_rounds(target, proposer, prompt: list[int], n: int, peek: bool = False) -> float:
    """Decode seconds of ``n`` T = 1 rounds of the speculative loop (one segment, prefill excluded); ``peek``:
    every round a peek (a plain round plus a one-token draft)."""
    carry, stop = fresh(target, proposer, prompt, n, max(adaptive.candidate_lengths(proposer.block_limit)))
    policy = adaptive.fixed_policy(1)
    begin = time.perf_counter()
    out = run_segment(target, proposer, *carry, stop, jnp.int32(n), policy, verify_len=1, greedy=True, peek=peek)
    jax.block_until_ready(out)
    return time.perf_counter() - begin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--domain", default="code")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    target = load_target(args.model)
    tok = load_tokenizer(args.model)
    held = load_heldout_prompts(args.model, ROOT / "experiments/data/smollm2-v2")
    prompts = [p.ids for p in select_prompts({args.domain: held[args.domain]}, args.prompts,
                                             lambda m: encode_messages(tok, m))]
    trained = as_proposer(load_draft(args.draft, target))
    untrained = as_proposer(load_draft("init:dspine", target))  # as bench's ours+init:dspine
    n = args.tokens
    systems = {  # each → (decode seconds, prefill + decode seconds or None)
        "ar": lambda p: seconds(generate(target, [p], n, stop_ids=[])),
        "T=1 loop (no drafter)": lambda p: (plain_rounds(target, NoProposer(), p, n), None),
        "T=1 loop (trained drafter state)": lambda p: (plain_rounds(target, trained, p, n), None),
        "auto, init:dspine": lambda p: seconds(spec.speculative_generate(target, untrained, [p], n, stop_ids=[])),
        "auto, trained drafter": lambda p: seconds(spec.speculative_generate(target, trained, [p], n, stop_ids=[])),
    }
    for f in systems.values():  # compile (and measure the verify costs) before timing
        f(prompts[0])
    times: dict[str, list[tuple[float, float | None]]] = {k: [] for k in systems}
    for _ in range(args.repeats):
        for p in prompts:
            for name, f in systems.items():
                times[name].append(f(p))
    ar = statistics.median(d for d, _ in times["ar"])
    ar_total = statistics.median(t for _, t in times["ar"])
    print(f"{jax.devices()[0].device_kind}, {args.domain}, {n} tokens, {len(prompts)} prompts × {args.repeats}")
    for name, ts in times.items():
        med = statistics.median(d for d, _ in ts)
        line = f"{name:36s} decode median {med * 1e3:8.1f} ms  {n / med:6.1f} tok/s  {ar / med:5.3f}× AR"
        if ts[0][1] is not None:
            total = statistics.median(t for _, t in ts)
            line += f"  | with prefill {total * 1e3:8.1f} ms  {ar_total / total:5.3f}× AR"
        print(line)


def seconds(result) -> tuple[float, float]:
    """(decode seconds, prefill + decode seconds) of a generation result (compilation excluded)."""
    return result.decode_seconds, result.seconds


if __name__ == "__main__":
    main()
