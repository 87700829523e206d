"""Could the drafter's own confidence choose the verify length? An offline study beside ``policy_sim.py``.

``policy_sim.py`` showed that a policy reading only the history of acceptance reaches 0.99–1.26× our AR where
an oracle that knows the trace reaches 1.2–1.7×: the history cannot see which *next* position is good. The
drafter can: DSpine's walk scores its C candidates at every slot, and the softmax of the chosen one,
``c_i``, is its belief that slot i is right given slots < i. Choosing the length **after** drafting costs a
host round trip per round (draft, read ``c``, verify at the chosen length) and the draft is paid even when
the choice is ``T = 1``. This script measures whether that can pay, before building it:

* traces as in ``policy_sim`` (greedy: what verification accepts at position p depends on p alone), plus
  ``c[p, i]`` of the block drafted at p;
* the same cost model (seconds per round of fixed-length loops, measured here), split into the draft
  (timed alone) and the rest, plus ``--split-ms`` for the extra dispatch and read-back per round;
* policies: fixed lengths, ``auto`` (the shipped history policy), ``confidence`` (every round drafts, then
  ``argmax_T E_c(T) / cost(T)`` with ``E_c(T) = 1 + Σ_{k<T} Π_{i≤k} c_i``), ``auto + confidence`` (the
  history decides whether to draft; once drafted, the confidence picks the length) and the oracle.

    python experiments/adaptive/confidence_sim.py --prompts-per-domain 4 --skip 2 \
        --out experiments/adaptive/confidence_sim.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from policy_sim import (  # this folder is on sys.path when run
    acceptance_trace,
    committed,
    greedy_draft_with_confidence,
    load_study,
    oracle_seconds,
    print_table,
    simulate,
    study_parser,
)

from dspine_jax import bench
from dspine_jax.decoding import adaptive, speculative
from dspine_jax.drafters.proposer import DrafterProposer


def expected(conf_row: np.ndarray, t: int, budget: int) -> float:
    """Tokens a round of length ``t`` commits if slot i is right with probability ``conf_row[i]``."""
    usable = min(t, budget)
    return 1.0 + float(np.sum(np.cumprod(conf_row[: usable - 1])))


def simulate_confidence(trace, conf, n: int, costs: dict[int, float], draft: float, split: float,
                        gate: bool) -> float:
    """Model seconds to decode ``n`` tokens choosing every round's length after drafting (``gate``: only in rounds
    where the history policy would draft; its plain rounds and probes run as in ``simulate``)."""
    lengths = tuple(sorted(costs))
    policy = adaptive.make_policy(lengths, costs)
    stats = adaptive.init_state(1, max(lengths))
    running = jnp.ones((1,), bool)
    pos, seconds = 1, 0.0
    verify = {t: costs[t] - (draft if t > 1 else 0.0) for t in lengths}  # the rest of a round, draft excluded
    while pos < n:
        wants_draft = True
        if gate:
            choice, _ = adaptive.choose(policy, stats, running, jnp.asarray([n - pos]), 0)
            wants_draft = lengths[int(choice)] > 1
        if not wants_draft:
            t, cost = 1, costs[1]
        else:
            row = conf[pos - 1]
            t = max(lengths, key=lambda t: expected(row, t, n - pos) / (verify[t] + draft + split))
            cost = verify[t] + draft + split
        step = committed(trace, pos, t, n)
        stats = adaptive.update(stats, jnp.int32(t), jnp.asarray([step - 1]), running)
        pos, seconds = pos + step, seconds + cost
    return seconds


def time_draft(target, proposer: DrafterProposer, prompt: list[int], repeats: int) -> float:
    """Seconds of one greedy draft of the whole block (what a round choosing after drafting always pays)."""
    block = proposer.drafter.config.block_size
    tokens = jnp.asarray([prompt], jnp.int32)
    _, state, first = speculative.prefill(target, proposer, tokens, jnp.asarray([len(prompt)], jnp.int32),
                                          jax.random.key(0), jnp.float32(1.0), jnp.float32(1.0),
                                          capacity=len(prompt) + block, top_k=0, greedy=True)  # fmt: skip
    run = lambda: jax.block_until_ready(greedy_draft_with_confidence(proposer.drafter, target, state, first))  # noqa: E731
    return bench.median_seconds(run, repeats=max(repeats, 5) * 4)


def main() -> None:
    ap = study_parser(__doc__.splitlines()[0], "experiments/adaptive/confidence_sim.json", skip=2)
    ap.add_argument("--draft-ms", type=float, help="ms of one draft instead of measuring it")
    ap.add_argument("--traces", type=Path, help="reuse the traces of an earlier --out (its drafter and prompts)")
    ap.add_argument("--split-ms", type=float, default=0.5, help="extra dispatch + read-back per round (host split)")
    args = ap.parse_args()
    n = args.max_new_tokens
    begin = time.perf_counter()
    prompts, target, proposer, lengths, costs, _peek = load_study(args)
    draft = args.draft_ms / 1e3 if args.draft_ms else time_draft(target, proposer, prompts[0].ids, args.repeats)
    split = args.split_ms / 1e3
    print(f"draft {draft * 1e3:.1f} ms", file=sys.stderr)
    rows: dict[str, dict[str, list[float]]] = {}
    ar = (n - 1) * costs[1]
    calibration, traces = [], []
    earlier = json.loads(args.traces.read_text())["traces"] if args.traces else None
    for i, p in enumerate(prompts):
        if earlier:
            trace, conf = earlier[i]["accept"], np.asarray(earlier[i]["confidence"])
        else:
            trace, conf = acceptance_trace(target, proposer, p.ids, n, confidence=True)
        traces.append({"domain": p.domain, "source": p.source, "accept": trace, "confidence": np.round(conf, 4).tolist()})
        # calibration: P(slot i accepted | slots < i accepted) against the confidence there
        for pos in range(1, n):
            for k in range(min(trace[pos - 1] + 1, len(conf[pos - 1]))):
                calibration.append((float(conf[pos - 1][k]), int(k < trace[pos - 1])))
        results = {f"fixed {t}": simulate(trace, n, costs, fixed=t)["seconds"] for t in lengths if t > 1}
        results["auto (history)"] = simulate(trace, n, costs)["seconds"]
        results["confidence (every round drafts)"] = simulate_confidence(trace, conf, n, costs, draft, split, gate=False)
        results["auto + confidence"] = simulate_confidence(trace, conf, n, costs, draft, split, gate=True)
        results["oracle (knows the trace)"] = oracle_seconds(trace, n, costs)
        for name, s in results.items():
            rows.setdefault(name, {}).setdefault(p.domain, []).append(ar / s)
        print(f"[{i + 1}/{len(prompts)}] {p.domain}: mean accept {np.mean(trace):.2f}", file=sys.stderr)
    summary = print_table(rows, prompts)
    bins = np.linspace(0, 1, 6)
    conf_arr = np.asarray(calibration)
    table = []
    for lo, hi in zip(bins[:-1], bins[1:]):
        sel = (conf_arr[:, 0] >= lo) & (conf_arr[:, 0] < hi + (hi == 1))
        if sel.any():
            table.append({"conf": f"{lo:.1f}-{hi:.1f}", "slots": int(sel.sum()), "accepted": float(conf_arr[sel, 1].mean())})
    print("calibration (confidence bin → accepted fraction):", table)
    args.out.write_text(json.dumps({
        "model": args.model, "drafter": args.drafter, "max_new_tokens": n, "skip": args.skip, "costs": costs,
        "costs_given": bool(args.costs), "draft_seconds": draft, "split_seconds": split, "calibration": table, "speedup_vs_ar": summary, "traces": traces,
        "seconds": time.perf_counter() - begin, "machine": bench.machine_info(),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
