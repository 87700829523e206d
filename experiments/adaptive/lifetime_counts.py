"""The first slot's counts over a drafter's requests (``PolicyState.lifetime_hits`` / ``lifetime_tries``, what
``adaptive.never_paid`` reads) as the bench's order carries them: each prompt of a trace file a warm-up and 5
repeats, replayed by ``policy_sim.simulate`` at given costs. The longest stretch of first-slot misses in each trace
beside it (why the rule reads a rate over requests, not misses in a row). Usage:

    python experiments/adaptive/lifetime_counts.py [--traces seventeenth/traces96.json] [--costs 1:20.9,…]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from policy_sim import parse_costs, simulate  # this folder is on sys.path when run

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=Path, default=HERE / "seventeenth/traces96.json")
    ap.add_argument("--costs", default="1:20.9,2:23.7,4:24.7,8:38.1,peek:22.6")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    study = json.loads(args.traces.read_text())
    costs, peek = parse_costs(args.costs)
    n = study["max_new_tokens"]
    prior = None
    print(f"# {args.traces.name}, costs {args.costs}, each prompt a warm-up and {args.repeats} repeats, in order")
    print("prompt | first-slot hits / tries over requests, after each request | longest run of misses in the trace")
    for p in study["prompts"]:
        counts = []
        for _ in range(args.repeats + 1):
            prior = simulate(p["trace"], n, costs, peek=peek, host=0.003, prior=prior)["carried"]
            counts.append(f"{float(prior.lifetime_hits):.1f}/{float(prior.lifetime_tries):.0f}")
        misses = max(len(run) for run in re.split("1+", "".join("0" if t == 0 else "1" for t in p["trace"])))
        print(f"{p['source']} | {', '.join(counts)} | {misses}")


if __name__ == "__main__":
    main()
