"""What one round of the speculative loop costs at each verify length, × our AR decode step, side by side in
one process: a segment of ``--rounds`` rounds held at T (a fixed policy; T = 1 is a plain round, ``peek`` a
plain round plus a one-token draft: its segment less the plain rounds that follow it there), one dispatch and one
read-back each as the decoder runs them; our AR decode (``generate``) timed between them. Interleaved repeats,
medians, prefill excluded. Usage:

    python experiments/adaptive/round_cost.py [--domain code] [--rounds 16] [--repeats 9] [--lengths 1,4] \
        [--json out.json]

``--f32-drafter`` adds each drafted length with the drafter's bfloat16 panels widened to float32 (the same
products from twice the bytes: what packing a bfloat16 checkpoint in bfloat16 saves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from switch_cost import fresh, heldout_prompt  # this folder is on sys.path when run

from dspine_jax.bench import machine_info
from dspine_jax.decoding import adaptive
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.decoder import run_segment
from dspine_jax.decoding.proposers import as_proposer
from dspine_jax.drafters.io import load_draft
from dspine_jax.models import panels
from dspine_jax.models.target import load_target

ROOT = Path(__file__).resolve().parents[2]


def segment_seconds(target, proposer, prompt: list[int], t: int, peek: bool, rounds: int, t_max: int,
                    policy: adaptive.VerifyPolicy | None = None) -> tuple[float, int]:
    """Seconds of one segment of up to ``rounds`` rounds at verify length ``t`` after a fresh prefill, under
    ``policy`` (None: the fixed length ``t``, no statistics kept), and the rounds it ran (a peek's segment runs the
    peek, then the plain rounds until the policy's next probe: fewer than ``rounds``)."""
    carry, stop = fresh(target, proposer, prompt, rounds * t + 8, t_max)
    policy, max_rounds = policy or adaptive.fixed_policy(t), jnp.int32(rounds)
    begin = time.perf_counter()
    out = run_segment(target, proposer, *carry, stop, max_rounds, policy, verify_len=t, greedy=True, peek=peek)
    _, ran = jax.device_get((out[2], out[1].iterations))
    return time.perf_counter() - begin, int(ran)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--domain", default="code")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None, help="also write the medians here")
    ap.add_argument("--f32-drafter", action="store_true", help="also time drafted rounds with float32 drafter panels")
    ap.add_argument("--lengths", default=None,
                    help="time only these verify lengths, e.g. 1,4 (default: every candidate)")
    args = ap.parse_args()
    target = load_target(args.model)
    prompt = heldout_prompt(args.model, args.domain)
    proposer = as_proposer(load_draft(args.draft, target))
    lengths = adaptive.candidate_lengths(proposer.block_limit)
    t_max = max(lengths)
    if args.lengths:
        lengths = tuple(sorted({1} | {int(t) for t in args.lengths.split(",")}))  # (T = 1: the peek's plain rounds)
    cases = {f"T={t}": (t, False, proposer) for t in lengths} | {"peek": (1, True, proposer)}
    if args.f32_drafter:
        cases |= {f"T={t} f32": (t, False, panels.widen_params(proposer)) for t in lengths if t > 1}
    ar_tokens = args.rounds * 4
    for t, peek, drafter in cases.values():  # compile every program
        segment_seconds(target, drafter, prompt, t, peek, args.rounds, t_max)
    generate(target, [prompt], ar_tokens, stop_ids=[])
    times: dict[str, list[float]] = {k: [] for k in cases} | {"AR step": []}
    for _ in range(args.repeats):
        for name, (t, peek, drafter) in cases.items():
            seconds, ran = segment_seconds(target, drafter, prompt, t, peek, args.rounds, t_max)
            if peek:  # the peek alone: its segment less the plain rounds after it, at this repeat's T = 1 cost
                seconds -= (ran - 1) * times["T=1"][-1]
                ran = 1
            times[name].append(seconds / ran)
        times["AR step"].append(generate(target, [prompt], ar_tokens, stop_ids=[]).decode_seconds / ar_tokens)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    ar = medians["AR step"]
    print(f"{machine_info()}; {args.domain} prompt ({len(prompt)} tokens), segments of {args.rounds} rounds, "
          f"medians of {args.repeats}")  # fmt: skip
    for name, med in medians.items():
        print(f"{name:8s} {med * 1e3:7.2f} ms/round  {med / ar:5.3f}× our AR step")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "ms": {k: v * 1e3 for k, v in medians.items()},
                                               "x_ar": {k: v / ar for k, v in medians.items()}}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
