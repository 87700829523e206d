"""What a plain (T = 1) segment costs per round in the speculative loop, by what ran before it and by its
length, against our AR decode step in the same process. One prompt is prefilled once per pattern; segments
then run back to back exactly as the decoder's host loop runs them (one dispatch and one read-back each):

* ``plain×R``: T = 1 segments of R rounds, one after another;
* ``after T=L``: a segment of ``DECIDE_EVERY`` rounds at T = L, then a T = 1 segment of R rounds (only the
  T = 1 segment is timed), repeated.

Medians over the repeats, ms per round, and what one launch of a segment costs beyond its rounds (from the
shortest and the longest plain segments: ``(x1 − x16) / (1 − 1/16)`` with the default rounds). Usage:

    python experiments/adaptive/switch_cost.py [--repeats 12] [--rounds 1,4,16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from dspine_jax.bench import load_heldout_prompts, select_prompts
from dspine_jax.decoding import adaptive
from dspine_jax.decoding import speculative as spec
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.decoder import DECIDE_EVERY, run_segment
from dspine_jax.decoding.proposers import as_proposer
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.train.prompts import encode_messages

ROOT = Path(__file__).resolve().parents[2]


def heldout_prompt(model: str, domain: str) -> list[int]:
    """The first held-out prompt of ``domain`` (``experiments/data/smollm2-v2``), chat-templated, as token ids."""
    tok = load_tokenizer(model)
    held = load_heldout_prompts(model, ROOT / "experiments/data/smollm2-v2")
    return [p.ids for p in select_prompts({domain: held[domain]}, 1, lambda m: encode_messages(tok, m))][0]


def fresh(target, proposer, prompt: list[int], budget: int, t_max: int):
    """(state, transcript) right after the prefill, for ``budget`` new tokens."""
    rows, capacity, tokens, lengths, stops = spec.plan_request(target, [prompt], budget, 0.0, 1.0, 0, [])
    key = jax.random.key(0)
    cache, state, first = spec.prefill(target, proposer, tokens, lengths, key, jnp.float32(1.0), jnp.float32(1.0),
                                       capacity=capacity + t_max, top_k=0, greedy=True)
    stop = jnp.full((spec.STOP_BUCKET,), -1, jnp.int32)
    carry = spec.begin(cache, state, first, key, Sampling.rows(1), stop, jnp.int32(budget), max_verify=t_max,
                       out_width=spec.round_up(budget, spec.TOKEN_BUCKET))
    return jax.block_until_ready(carry), stop


def pattern(target, proposer, prompt, policy, t_max, before: int | None, rounds: int, segments: int) -> list[float]:
    """Seconds per round of each timed T = 1 segment (``before``: the length of the untimed segment run ahead of
    each; None: none)."""
    per_segment = rounds + (DECIDE_EVERY if before else 0)
    (state, transcript), stop = fresh(target, proposer, prompt, per_segment * segments + 8, t_max)
    out = []
    for _ in range(segments):
        if before:
            state, transcript, choice = run_segment(target, proposer, state, transcript, stop, jnp.int32(DECIDE_EVERY),
                                                    policy, verify_len=before, greedy=True)  # fmt: skip
            jax.device_get((choice, transcript.iterations))
        begin = time.perf_counter()
        state, transcript, choice = run_segment(target, proposer, state, transcript, stop, jnp.int32(rounds), policy,
                                                verify_len=1, greedy=True)  # fmt: skip
        jax.device_get((choice, transcript.iterations))
        out.append((time.perf_counter() - begin) / rounds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--domain", default="prose")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--rounds", default="1,4,16")
    args = ap.parse_args()
    target = load_target(args.model)
    prompt = heldout_prompt(args.model, args.domain)
    proposer = as_proposer(load_draft(args.draft, target))
    lengths = adaptive.candidate_lengths(proposer.block_limit)
    policy = adaptive.make_policy(lengths, dict.fromkeys(lengths, 1.0))
    t_max = max(lengths)
    n_rounds = [int(r) for r in args.rounds.split(",")]
    segments = max(4, 64 // max(n_rounds))
    cases = {f"plain x{r}": (None, r) for r in n_rounds}
    cases |= {f"after T={t}, plain x{r}": (t, r) for t in lengths if t > 1 for r in n_rounds if r > 1}
    ar_tokens = 64
    for before, r in cases.values():  # compile every program
        pattern(target, proposer, prompt, policy, t_max, before, r, 1)
    generate(target, [prompt], ar_tokens, stop_ids=[])
    times: dict[str, list[float]] = {k: [] for k in cases} | {"our AR (generate, decode)": []}
    for _ in range(args.repeats):  # interleaved
        for name, (before, r) in cases.items():
            times[name].append(statistics.median(pattern(target, proposer, prompt, policy, t_max, before, r, segments)))
        times["our AR (generate, decode)"].append(generate(target, [prompt], ar_tokens, stop_ids=[]).decode_seconds
                                                  / ar_tokens)  # fmt: skip
    ar = statistics.median(times["our AR (generate, decode)"])
    print(f"{jax.devices()[0].device_kind}, {args.domain} prompt ({len(prompt)} tokens), medians of {args.repeats}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:32s} {med * 1e3:7.2f} ms/round  {med / ar:5.3f}× our AR step")
    short, long = min(n_rounds), max(n_rounds)
    if short < long:
        per = {r: statistics.median(times[f"plain x{r}"]) for r in (short, long)}
        launch = (per[short] - per[long]) / (1 / short - 1 / long)
        print(f"one launch beyond its rounds: {launch * 1e3:.2f} ms ({launch / ar:.2f}× our AR step)")


if __name__ == "__main__":
    main()
