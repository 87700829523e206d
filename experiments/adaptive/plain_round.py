"""What a drafter that never pays costs: the speculative loop held at plain rounds (T = 1, the adaptive
policy's statistics kept) with the drafter and without one, against our AR's step; then whole calls,
``speculative_generate`` with the drafter against ``generate``, prefill and decode apart. One prompt,
interleaved repeats, medians. Usage:

    python experiments/adaptive/plain_round.py [--draft init:dspine] [--domain code] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics

from round_cost import segment_seconds  # this folder is on sys.path when run
from switch_cost import heldout_prompt

from dspine_jax.bench import machine_info
from dspine_jax.decoding import adaptive
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.proposers import NoProposer, as_proposer
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target

LENGTHS = (1, 2, 4, 8)


def plain_round_seconds(target, proposer, prompt: list[int], rounds: int) -> float:
    """Seconds per round of one segment of ``rounds`` plain rounds under the adaptive policy (statistics kept)."""
    policy = adaptive.make_policy(LENGTHS, dict.fromkeys(LENGTHS, 1.0))
    seconds, ran = segment_seconds(target, proposer, prompt, 1, False, rounds, max(LENGTHS), policy)
    return seconds / ran


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="init:dspine")
    ap.add_argument("--domain", default="code")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    target = load_target(args.model)
    prompt = heldout_prompt(args.model, args.domain)
    draft = load_draft(args.draft, target)
    proposer = as_proposer(draft)
    n = args.tokens
    cases = {
        "plain round, drafter": lambda: (plain_round_seconds(target, proposer, prompt, n), 0.0),
        "plain round, no drafter": lambda: (plain_round_seconds(target, NoProposer(), prompt, n), 0.0),
        "our AR step": lambda: (generate(target, [prompt], n, stop_ids=[]).decode_seconds / n, 0.0),
        "call: generate": lambda: (lambda r: (r.decode_seconds, r.prefill_seconds))(
            generate(target, [prompt], n, stop_ids=[])),
        "call: speculative_generate": lambda: (lambda r: (r.decode_seconds, r.prefill_seconds))(
            speculative_generate(target, draft, [prompt], n, stop_ids=[])),
    }  # fmt: skip
    for f in cases.values():  # compile
        f()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, f in cases.items():
            times[name].append(f())
    print(f"{machine_info()}; {args.draft}; {args.domain} prompt ({len(prompt)} tokens), {n} tokens, "
          f"medians of {args.repeats}")  # fmt: skip
    step = statistics.median(t for t, _ in times["our AR step"])
    for name in ("plain round, drafter", "plain round, no drafter", "our AR step"):
        med = statistics.median(t for t, _ in times[name])
        print(f"{name:28s} {med * 1e3:7.2f} ms  {med / step:5.3f}× our AR step")
    for name in ("call: generate", "call: speculative_generate"):
        dec, pre = (statistics.median(x[i] for x in times[name]) for i in (0, 1))
        print(f"{name:28s} prefill {pre * 1e3:7.1f} ms  decode {dec * 1e3:7.1f} ms  total {(pre + dec) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
