"""The first slot's counts over a drafter's requests (``PolicyState.lifetime_hits`` / ``lifetime_tries``, what
``adaptive.never_paid`` reads) as the bench's order carries them: each prompt a warm-up and R repeats. Replayed by
``policy_sim.simulate`` over a trace file at given costs (with the longest stretch of first-slot misses in each
trace beside it: why the rule reads a rate over requests, not misses in a row), or with ``--real``, decoded by
``speculative_generate`` with the shipped DSpine drafter on the bench's prompts (the carried prior read after each
request, with its wait and τ). Usage:

    python experiments/adaptive/lifetime_counts.py [--traces seventeenth/traces96.json] [--costs 1:20.9,…] [--repeats 5]
    python experiments/adaptive/lifetime_counts.py --real [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from policy_sim import parse_costs, simulate  # this folder is on sys.path when run

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def replayed(args: argparse.Namespace) -> None:
    study = json.loads(args.traces.read_text())
    costs, peek = parse_costs(args.costs)
    n, prior = study["max_new_tokens"], None
    print(f"# {args.traces.name}, costs {args.costs}, each prompt a warm-up and {args.repeats} repeats, in order")
    print("prompt | first-slot hits / tries over requests, after each request | longest run of misses in the trace")
    for p in study["prompts"]:
        counts = []
        for _ in range(args.repeats + 1):
            prior = simulate(p["trace"], n, costs, peek=peek, host=0.003, prior=prior)["carried"]
            counts.append(f"{float(prior.lifetime_hits):.1f}/{float(prior.lifetime_tries):.0f}")
        misses = max(len(run) for run in re.split("1+", "".join("0" if t == 0 else "1" for t in p["trace"])))
        print(f"{p['source']} | {', '.join(counts)} | {misses}")


def decoded(args: argparse.Namespace) -> None:
    from dspine_jax import bench
    from dspine_jax.decoding import decoder
    from dspine_jax.decoding.speculative import speculative_generate
    from dspine_jax.drafters.io import load_draft
    from dspine_jax.models.hub import resolve_model_dir
    from dspine_jax.models.target import load_target

    model_dir = resolve_model_dir("smollm2-135m-instruct")
    held = bench.load_heldout_prompts("smollm2-135m-instruct", ROOT / "experiments/data/smollm2-v2")
    prompts = bench.select_prompts(held, 4, bench.encoder(model_dir, held))
    target = load_target(model_dir)
    drafter = load_draft(str(ROOT / "checkpoints/smollm2-135m-dspine-b8"), target)
    print(f"# speculative_generate, shipped DSpine drafter, 96 tokens, each prompt {args.repeats + 1} requests, in order")
    print("prompt | first-slot hits / tries over requests, the probe wait and τ, after each request")
    for p in prompts:
        counts = []
        for _ in range(args.repeats + 1):
            result = speculative_generate(target, drafter, [p.ids], 96, stop_ids=[])
            (prior,) = decoder._PRIORS.values()  # (one target and drafter in this process)
            counts.append(f"{float(prior.lifetime_hits):.1f}/{float(prior.lifetime_tries):.0f} "
                          f"wait {int(prior.wait)} τ {result.mean_acceptance:.2f}")
        print(f"{p.source} | {', '.join(counts)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=Path, default=HERE / "seventeenth/traces96.json")
    ap.add_argument("--costs", default="1:20.9,2:23.7,4:24.7,8:38.1,peek:22.6")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real", action="store_true", help="decode the bench's prompts (no traces)")
    args = ap.parse_args()
    (decoded if args.real else replayed)(args)


if __name__ == "__main__":
    main()
