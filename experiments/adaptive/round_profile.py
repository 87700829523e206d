"""Where a round's time goes inside the compiled decode loop: segments of ``--rounds`` rounds at each verify length
(the shipped DSpine drafter, a held-out prompt) under JAX's profiler with XLA:CPU's per-operation trace events
(``--xla_cpu_enable_xprof_traceme``, set before JAX starts its backend), summed per round by kind of operation (``ffi_call``:
the panel kernel's products; ``cond``: a conditional, its inner operations included, which are also counted
under their own kinds). Usage:

    python experiments/adaptive/round_profile.py [--lengths 1,4] [--rounds 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import tempfile
from pathlib import Path

import jax
from round_cost import segment_seconds  # this folder is on sys.path when run
from switch_cost import heldout_prompt

from dspine_jax.bench import machine_info
from dspine_jax.decoding.proposers import as_proposer
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target

ROOT = Path(__file__).resolve().parents[2]


def per_round(trace: Path, rounds: int) -> dict[str, tuple[float, int]]:
    """{kind: (ms per round, operations per round)} over the trace's operations that ran a multiple of ``rounds``
    times (those of the loop's body)."""
    (path,) = trace.glob("**/*.trace.json.gz")
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith("$") and "Thunk" not in e["name"]:
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, us in total.items():
        if count[name] % rounds == 0 and not name.startswith("end:"):
            kind = re.sub(r"[.\d]+$", "", name)
            kinds[kind][0] += us / rounds / 1e3
            kinds[kind][1] += count[name] // rounds
    return {k: (ms, n) for k, (ms, n) in kinds.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1,4")
    ap.add_argument("--domain", default="code")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    target = load_target("smollm2-135m-instruct")
    prompt = heldout_prompt("smollm2-135m-instruct", args.domain)
    proposer = as_proposer(load_draft(str(ROOT / "checkpoints/smollm2-135m-dspine-b8"), target))
    print(f"# {machine_info()}; shipped DSpine drafter, {args.domain} prompt; ms per round in the loop, by kind")
    for t in (int(x) for x in args.lengths.split(",")):
        for _ in range(2):  # compile, first runs
            segment_seconds(target, proposer, prompt, t, False, args.rounds, 8)
        with tempfile.TemporaryDirectory() as trace:
            with jax.profiler.trace(trace, create_perfetto_trace=True):
                for _ in range(args.repeats):
                    segment_seconds(target, proposer, prompt, t, False, args.rounds, 8)
            kinds = per_round(Path(trace), args.rounds * args.repeats)
        traced = sum(ms for k, (ms, _) in kinds.items() if k != "cond")
        top = sorted(kinds.items(), key=lambda kv: -kv[1][0])[: args.top]
        print(f"T={t}: {traced:.2f} ms traced a round; " + ", ".join(f"{k} {ms:.2f} ({n})" for k, (ms, n) in top))


if __name__ == "__main__":
    main()
