"""What a peek adds where the decoder runs one: from one decode state (``--before`` plain rounds in, so the
drafter's taps of those rounds are parked), a segment of ``--rounds`` plain rounds against a segment of a peek and
``--rounds`` − 1 plain rounds (what ``decoder.segment(peek=True)`` runs), interleaved from copies of that state.
Both launch once, so the difference is the peek's draft and flush, not its launch (``adaptive.PROBE_LAUNCHES``).
Against ``adaptive.wait_cap``'s premise: a peek adds what a round at ``PROBE_LENGTH`` adds over a plain one.

    python experiments/adaptive/peek_insitu.py [--draft init:dspine] [--rounds 5] [--repeats 31]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from switch_cost import fresh, heldout_prompt  # this folder is on sys.path when run

from dspine_jax.bench import machine_info
from dspine_jax.decoding import adaptive
from dspine_jax.decoding.decoder import run_segment
from dspine_jax.decoding.proposers import as_proposer
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", action="append", help="drafters (repeatable; default: untrained and shipped DSpine)")
    ap.add_argument("--domain", default="code")
    ap.add_argument("--before", type=int, default=29, help="plain rounds before (parked taps: 29 mod 16 = 13)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per timed segment (short: less noise)")
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args()
    target = load_target(args.model)
    prompt = heldout_prompt(args.model, args.domain)
    print(machine_info())
    for spec in args.draft or ["init:dspine", "checkpoints/smollm2-135m-dspine-b8"]:
        proposer = as_proposer(load_draft(spec, target))
        lengths = adaptive.candidate_lengths(proposer.block_limit)
        t_max = max(lengths)
        # Drafting never pays here (a drafted round priced at 3T plain ones): after its peek a segment runs plain
        # rounds until the next probe is due (at least FIRST_WAIT = 4 of them: --rounds 5 at most).
        policy = adaptive.make_policy(lengths, {t: 1.0 if t == 1 else 3.0 * t for t in lengths})
        (state, transcript), stop = fresh(target, proposer, prompt, args.before + args.rounds + 8, t_max)
        state, transcript, _ = run_segment(target, proposer, state, transcript, stop, jnp.int32(args.before), policy,
                                           verify_len=1, greedy=True)  # fmt: skip
        base = jax.block_until_ready((state, transcript))
        done = int(base[1].iterations)

        def segment(peek: bool) -> float:
            carry = jax.block_until_ready(jax.tree.map(jnp.copy, base))  # (run_segment donates its state)
            begin = time.perf_counter()
            _, out, _ = run_segment(target, proposer, *carry, stop, jnp.int32(args.rounds), policy, verify_len=1,
                                    greedy=True, peek=peek)  # fmt: skip
            ran = int(jax.device_get(out.iterations)) - done
            assert ran == args.rounds, (peek, ran)
            return time.perf_counter() - begin

        for peek in (False, True, False, True):  # compile, first runs
            segment(peek)
        plain, peeked = [], []
        for r in range(args.repeats):
            for peek in (False, True) if r % 2 == 0 else (True, False):
                (peeked if peek else plain).append(segment(peek))
        step = statistics.median(plain) / args.rounds
        added = statistics.median(b - a for a, b in zip(plain, peeked))
        print(f"{spec}: plain round {step * 1e3:.2f} ms; a peek adds {added * 1e3:.1f} ms = {added / step:.2f} plain "
              f"rounds (median of {args.repeats} interleaved pairs of {args.rounds}-round segments)")


if __name__ == "__main__":
    main()
