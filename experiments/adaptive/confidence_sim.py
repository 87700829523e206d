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

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from policy_sim import ROWS, committed, fixed_costs, oracle_seconds, simulate  # this folder is on sys.path when run

from dspine_jax import bench
from dspine_jax.decoding import adaptive, speculative
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import DrafterProposer
from dspine_jax.drafters import drafter as drafter_mod
from dspine_jax.drafters.io import load_drafter
from dspine_jax.models.hub import resolve_model_dir
from dspine_jax.models.target import load_target


@jax.jit
def greedy_draft_with_confidence(drafter, target, state, anchor):
    """The greedy walk's proposals ``[B, P]`` and the softmax probability of each chosen candidate ``[B, P]``."""
    fwd = drafter_mod.forward(drafter, target, state, drafter_mod.block_tokens(drafter, anchor))
    cands = drafter.kind.candidates(drafter, target, fwd, anchor)
    keys = jnp.zeros((cands.cand_ids.shape[1],), jnp.uint32)

    def pick(scores, _key):
        best = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        return best, jax.nn.softmax(scores, axis=-1)

    tokens, q = drafter.kind.select(cands, keys, pick)  # token ids, the walk's distributions
    return tokens, jnp.max(q, axis=-1)


def trace_with_confidence(target, proposer: DrafterProposer, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """``accept[p]`` as in ``policy_sim.acceptance_trace`` and ``conf [n, P]``."""
    drafter = proposer.drafter
    block = drafter.config.block_size
    y = generate(target, [prompt], n + block, stop_ids=[]).token_ids[0]
    width = len(prompt) + n
    accept, conf = [], []
    for start in range(0, n, ROWS):
        ps = list(range(start, min(start + ROWS, n)))
        tokens = np.zeros((ROWS, width), np.int32)
        lengths = np.ones(ROWS, np.int32)
        for i, p in enumerate(ps):
            row = prompt + y[:p]
            tokens[i, : len(row)], lengths[i] = row, len(row)
        _, state, first = speculative.prefill(
            target, proposer, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), jnp.float32(1.0),
            jnp.float32(1.0), capacity=width + block, top_k=0, greedy=True,
        )  # fmt: skip
        proposals, c = jax.device_get(greedy_draft_with_confidence(drafter, target, state, first))
        for i, p in enumerate(ps):
            match = proposals[i] == np.asarray(y[p + 1 : p + block])
            accept.append(int(np.argmin(match)) if not match.all() else block - 1)
            conf.append(c[i])
    return accept, np.asarray(conf)


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="checkpoints/smollm2-135m-dspine-b8")
    ap.add_argument("--data", default="experiments/data/smollm2-v2")
    ap.add_argument("--prompts-per-domain", type=int, default=4)
    ap.add_argument("--skip", type=int, default=2, help="skip each domain's first N held-out prompts (the bench's)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--costs", help="ms per round instead of measuring them, e.g. 1:25.3,2:35.5,4:39.1,8:48.0")
    ap.add_argument("--draft-ms", type=float, help="ms of one draft instead of measuring it")
    ap.add_argument("--traces", type=Path, help="reuse the traces of an earlier --out (its drafter and prompts)")
    ap.add_argument("--split-ms", type=float, default=0.5, help="extra dispatch + read-back per round (host split)")
    ap.add_argument("--out", type=Path, default=Path("experiments/adaptive/confidence_sim.json"))
    args = ap.parse_args()
    n = args.max_new_tokens
    model_dir = resolve_model_dir(args.model)
    held = {d: list(v)[args.skip :] for d, v in bench.load_heldout_prompts(args.model, Path(args.data)).items()}
    prompts = bench.select_prompts(held, args.prompts_per_domain, bench.encoder(model_dir, held))
    target = load_target(model_dir)
    drafter = load_drafter(args.drafter, target)
    proposer = DrafterProposer(drafter)
    lengths = adaptive.candidate_lengths(drafter.config.block_size)
    begin = time.perf_counter()
    if args.costs:
        costs = {int(t): float(ms) / 1e3 for t, ms in (x.split(":") for x in args.costs.split(","))}
    else:
        costs = fixed_costs(target, drafter, prompts[0].ids, lengths, n, args.repeats)
    draft = args.draft_ms / 1e3 if args.draft_ms else time_draft(target, proposer, prompts[0].ids, args.repeats)
    split = args.split_ms / 1e3
    print("ms per round:", {t: round(s * 1e3, 1) for t, s in costs.items()}, f"draft {draft * 1e3:.1f}", file=sys.stderr)
    rows: dict[str, dict[str, list[float]]] = {}
    ar = (n - 1) * costs[1]
    calibration, traces = [], []
    earlier = json.loads(args.traces.read_text())["traces"] if args.traces else None
    for i, p in enumerate(prompts):
        if earlier:
            trace, conf = earlier[i]["accept"], np.asarray(earlier[i]["confidence"])
        else:
            trace, conf = trace_with_confidence(target, proposer, p.ids, n)
        traces.append({"domain": p.domain, "source": p.source, "accept": trace, "confidence": np.round(conf, 4).tolist()})
        # calibration: P(slot i accepted | slots < i accepted) against the mean confidence there
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
    domains = list(dict.fromkeys(p.domain for p in prompts))
    print("| policy | " + " | ".join(domains) + " | all |")
    print("|---" * (len(domains) + 2) + "|")
    summary = {}
    for name, by in rows.items():
        cells = [float(np.mean(by[d])) for d in domains] + [float(np.mean([x for d in domains for x in by[d]]))]
        summary[name] = dict(zip(domains + ["all"], cells))
        print(f"| {name} | " + " | ".join(f"{c:.2f}×" for c in cells) + " |")
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
