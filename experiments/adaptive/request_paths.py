"""The path `--verify auto` takes through each request, decoded for real in the bench's order (each held-out prompt a
warm-up and ``--repeats`` requests in a row, each starting from the prior the one before it carried): per request, its
rounds (``.`` a plain round or a peek, a digit the proposals a round of 2 accepted, ``a``–``h`` 0–7 accepted at 4,
``[T:k]`` k accepted at another T) and, with ``--segments``, each segment the host launched (``PxN``: a peek and the
plain rounds after it, ``TxN``: N rounds at T) with its wall time in ms. Our AR's decode of the same prompt runs just
before each request, for scale. Shipped DSpine drafter, SmolLM2, greedy, 96 tokens. Usage:

    python experiments/adaptive/request_paths.py [--repeats 3] [--domain prose] [--segments]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax

from dspine_jax import bench
from dspine_jax.decoding import speculative as spec
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.hub import resolve_model_dir
from dspine_jax.models.target import load_target

ROOT = Path(__file__).resolve().parents[2]


def rounds_text(lengths: list[int], accepted: list[int]) -> str:
    """One character (or bracket) per round: see the module doc."""
    out = []
    for t, a in zip(lengths, accepted):
        out.append("." if t == 1 else str(a) if t == 2 else "abcdefgh"[a] if t == 4 else f"[{t}:{a}]")
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3, help="requests per prompt after its warm-up (request 0)")
    ap.add_argument("--domain", help="only this domain's prompts (default: all four, the bench's order)")
    ap.add_argument("--segments", action="store_true", help="also each launched segment and its wall time")
    args = ap.parse_args()
    model_dir = resolve_model_dir("smollm2-135m-instruct")
    held = bench.load_heldout_prompts("smollm2-135m-instruct", ROOT / "experiments/data/smollm2-v2")
    if args.domain:
        held = {args.domain: held[args.domain]}
    prompts = bench.select_prompts(held, 4, bench.encoder(model_dir, held))
    target = load_target(model_dir)
    drafter = load_draft(str(ROOT / "checkpoints/smollm2-135m-dspine-b8"), target)

    launched: list[tuple[int, bool, float, int]] = []  # (verify length, peek, ms, rounds run so far)
    run_segment = spec.run_segment

    def timed_segment(*a, **k):
        begin = time.perf_counter()
        out = jax.block_until_ready(run_segment(*a, **k))
        launched.append((k["verify_len"], k.get("peek", False), (time.perf_counter() - begin) * 1e3,
                         int(out[1].iterations)))  # fmt: skip
        return out

    timed_segment.lower = run_segment.lower  # (CompileTimer compiles through it)
    if args.segments:  # (the wait for each segment adds a sync the decoder does anyway: it reads the choice back)
        spec.run_segment = timed_segment
    print(f"# {bench.machine_info()}; shipped DSpine drafter, verify auto, 96 tokens, a warm-up and {args.repeats} "
          "requests per prompt")
    for p in prompts:
        for r in range(args.repeats + 1):
            ar = generate(target, [p.ids], 96, stop_ids=[])
            launched.clear()
            res = spec.speculative_generate(target, drafter, [p.ids], 96, stop_ids=[])
            line = (f"{r} {p.source[-24:]:>24} AR {ar.decode_seconds * 1e3:5.0f} ms, auto "
                    f"{res.decode_seconds * 1e3:5.0f} ms τ {res.mean_acceptance:.2f} | "
                    f"{rounds_text(res.verify_lengths[0], res.accepted_proposals[0])}")
            if args.segments:
                done, parts = 0, []
                for t, peek, ms, iterations in launched:
                    parts.append(f"{'P' if peek else t}x{iterations - done}:{ms:.0f}")
                    done = iterations
                line += " | " + " ".join(parts)
            print(line, flush=True)


if __name__ == "__main__":
    main()
