"""The carried-prior trap, reproduced: greedy ``speculative_generate`` with the shipped DSpine drafter on held-out
prompts in sequence, three runs each, in one process (so each run starts from the prior the last one left, as in
the bench). Prints τ, the verify lengths each run used, and the host's segments (length, peek, rounds).

    python experiments/adaptive/carried_trap.py gsm_symbolic/44 chitchat/114

Before the probe wait was capped by the probe's cost (``adaptive.wait_cap``), chitchat/114 after gsm_symbolic/44
drafted nothing (τ 1.00 in every run; τ 1.94 when run alone): the prior carried from gsm_symbolic/44 started it
plain, its two peeks (rounds 17 and 50) both missed — the drafter's first proposal is right about half the time
there — the doubled wait (64) allowed no third, and each run passed the same prior to the next.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from dspine_jax.bench import load_heldout_prompts, select_prompts
from dspine_jax.decoding import decoder as dec
from dspine_jax.decoding import speculative as spec
from dspine_jax.decoding.proposers import as_proposer
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.train.prompts import encode_messages

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sources", nargs="+", help="held-out prompt sources, e.g. chitchat/114")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    target, tok = load_target(args.model), load_tokenizer(args.model)
    held = load_heldout_prompts(args.model, ROOT / "experiments/data/smollm2-v2")
    prompts = {p.source: p for p in select_prompts(held, 4, lambda m: encode_messages(tok, m))}
    drafter = as_proposer(load_draft(args.draft, target))
    segments: list[tuple[int, str, int]] = []
    observe = dec.Decoder.observe

    def logged(self, bucket, plan, seconds, rounds, choice):  # noqa: ANN001
        segments.append((plan.length, "peek" if plan.peek else "", rounds))
        return observe(self, bucket, plan, seconds, rounds, choice)

    dec.Decoder.observe = logged
    for source in args.sources:
        for run in range(args.runs):
            segments.clear()
            result = spec.speculative_generate(target, drafter, [prompts[source].ids], 96, stop_ids=[])
            lengths = dict(Counter(result.verify_lengths[0]))
            print(f"{source} run {run}: tau {result.mean_acceptance:.2f} lengths {lengths} segments {segments[:10]}")


if __name__ == "__main__":
    main()
