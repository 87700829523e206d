"""Offline study of the adaptive verify policy: greedy acceptance traces replayed under a cost model.

Under greedy decoding the committed text is AR's output whatever lengths the rounds verify, so how many
proposals verification accepts at position ``p`` depends on ``p`` alone: ``accept[p]`` = leading
proposals of a full block drafted after ``y[:p]`` (anchor ``y[p]``) that equal ``y[p+1:]``. One batched
pass per prompt (every prefix a row) gives the whole trace; any policy then replays exactly on the host
(``simulate``, the segment structure of ``decoder.Decoder``, with ``adaptive.choose`` and
``adaptive.update`` themselves) with seconds per round at each length measured by fixed-length loops in
the same run. The seconds are the model's, so the ratios between policies are what this measures, not
wall time.

    python experiments/adaptive/policy_sim.py --drafter checkpoints/smollm2-135m-dspine-b8 \
        --prompts-per-domain 4 --out experiments/adaptive/policy_sim.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax import bench
from dspine_jax.decoding import adaptive, decoder, speculative
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters import drafter as drafter_mod
from dspine_jax.drafters.io import load_drafter
from dspine_jax.drafters.proposer import DrafterProposer
from dspine_jax.models.hub import resolve_model_dir
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import load_target

ROWS = 16  # prefixes per batched pass


@jax.jit
def greedy_draft_with_confidence(drafter, target, state, anchor):
    """The greedy walk's proposals ``[B, P]`` and the softmax probability of each chosen candidate ``[B, P]``
    (the drafter's confidence; ``confidence_sim.py``)."""
    fwd = drafter_mod.forward(drafter, target, state, drafter_mod.block_tokens(drafter, anchor))
    cands = drafter.kind.candidates(drafter, target, fwd, anchor)
    keys = jnp.zeros((cands.cand_ids.shape[1],), jnp.uint32)

    def pick(scores, _key):
        best = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        return best, jax.nn.softmax(scores, axis=-1)

    tokens, q = drafter.kind.select(cands, keys, pick)  # token ids, the walk's distributions
    return tokens, jnp.max(q, axis=-1)


def acceptance_trace(target, proposer: DrafterProposer, prompt: list[int], n: int, confidence: bool = False):
    """``accept[p]`` for ``p < n``: proposals (of ``block - 1``) verification would accept after AR's
    first ``p`` tokens. ``confidence``: also the drafter's confidence in each proposal ``[n, block - 1]``."""
    block = proposer.drafter.config.block_size
    y = generate(target, [prompt], n + block, stop_ids=[]).token_ids[0]
    width = len(prompt) + n
    trace, conf = [], []
    for start in range(0, n, ROWS):
        ps = list(range(start, min(start + ROWS, n)))
        tokens = np.zeros((ROWS, width), np.int32)
        lengths = np.ones(ROWS, np.int32)
        for i, p in enumerate(ps):
            row = prompt + y[:p]
            tokens[i, : len(row)], lengths[i] = row, len(row)
        cache, state, first = speculative.prefill(
            target, proposer, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), jnp.float32(1.0),
            jnp.float32(1.0), capacity=width + block, top_k=0, greedy=True,
        )  # fmt: skip
        if confidence:
            proposals, c = jax.device_get(greedy_draft_with_confidence(proposer.drafter, target, state, first))
        else:
            counts = jnp.asarray([p + 1 for p in ps] + [1] * (ROWS - len(ps)), jnp.int32)
            out = proposer.propose(target, state, first, counts, jax.random.split(jax.random.key(1), ROWS),
                                   Sampling.rows(ROWS), block - 1)  # fmt: skip
            proposals, c = np.asarray(out.tokens), None
        first = np.asarray(first)
        for i, p in enumerate(ps):
            assert first[i] == y[p], "the batched prefix pass disagrees with AR"
            match = proposals[i] == np.asarray(y[p + 1 : p + block])
            trace.append(int(np.argmin(match)) if not match.all() else block - 1)
            if confidence:
                conf.append(c[i])
    return (trace, np.asarray(conf)) if confidence else trace


@contextlib.contextmanager
def policy_constants(**values):
    """Run with some of ``adaptive``'s constants (or functions: ``acceptance``) changed (a variant of the policy).
    Jitted functions read the constants when traced: their caches are cleared on the way in and out."""
    old = {k: getattr(adaptive, k) for k in values}
    for k, v in values.items():
        setattr(adaptive, k, v)
    jax.clear_caches()
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(adaptive, k, v)
        jax.clear_caches()


def committed(trace: list[int], pos: int, t: int, n: int) -> int:
    """Tokens a round of length ``t`` commits at position ``pos`` (accepted proposals + the target's token),
    within the budget of ``n``."""
    return (min(trace[pos - 1], t - 1, n - pos - 1) if t > 1 else 0) + 1


def simulate(trace: list[int], n: int, costs: dict[int, float], fixed: int | None = None,
             every: int = decoder.DECIDE_AFTER, peek: float | None = None, host: float = 0.0,
             hold: bool = True, bonus: bool = False, prior: adaptive.Prior | None = None,
             carry: str = "totals") -> dict:  # fmt: skip
    """Decode ``n`` tokens (the first is prefill's) over ``trace`` under the current policy constants, in the
    segments ``speculative_generate`` runs (or at a ``fixed`` length, one loop): model seconds, rounds and the
    lengths run. ``peek``: seconds of a peek (greedy probes at ``PROBE_LENGTH`` run as one, as
    ``speculative_generate`` does; None: as a real round); ``host``: seconds of host work per segment (a launch of
    a device loop and its read-back). ``hold`` (``Decoder.plan``'s): drafted rounds run, after ``every`` of them,
    while the policy would choose them again, and a peek's segment goes on with the plain rounds up to the next
    probe; else (the serving engine's) a segment is ``every`` drafted rounds and a probe is a segment of its own.
    ``bonus``: a drafted round whose proposals were all accepted also tests the next slot (under greedy decoding
    the target's bonus token against one more proposal: a variant, not what the decoder does). ``prior``: where the
    statistics start (``adaptive.Prior``, what an earlier request carried; None: the coin flip); the result's
    ``carried`` is what this request passes on: ``adaptive.carried`` (``carry="totals"``: the request's undecayed
    counts per slot, the decoder's), or the same of its final, decayed estimates (``"final"``: the rule before
    2026-12-07, biased low since a drafted stretch ends when the recent estimates turned bad)."""
    lengths = tuple(sorted(costs))
    policy = adaptive.make_policy(lengths, costs)
    stats = adaptive.init_state(1, max(lengths), prior)
    running, pos, seconds, rounds, ran = jnp.ones((1,), bool), 1, 0.0, 0, []

    def run(t: int, peeking: bool = False) -> None:  # one round (a peek: the statistics see its one-token draft)
        nonlocal stats, pos, seconds, rounds
        step = 1 if peeking else committed(trace, pos, t, n)
        accepted = min(trace[pos - 1], 1) if peeking else step - 1
        length = adaptive.PROBE_LENGTH if peeking else t
        if bonus and not peeking and t > 1:  # the statistics see a round one proposal longer where all were accepted
            length = min(t + 1, max(lengths))
            accepted = min(trace[pos - 1], length - 1, n - pos - 1)
        stats = adaptive.update(stats, jnp.int32(length), jnp.asarray([accepted]), running)
        pos, seconds, rounds = pos + step, seconds + (peek if peeking else costs[t]), rounds + 1
        ran.append(1 if peeking else t)

    def choose(current: int | None = None) -> decoder.Choice:  # the device's rule, as segment and Decoder.plan run it
        return decoder.choose(policy, stats, running, jnp.asarray([max(n - pos, 0)]), rounds, current)

    def plain(count: int) -> None:
        for _ in range(count):
            if pos < n:
                run(1)

    choice = choose()
    while pos < n:
        if fixed:
            run(fixed)
            continue
        t, probe = lengths[int(choice.index)], bool(choice.probe)
        seconds += host
        held = None  # the index of a held drafted length (``choose``'s current)
        if peek is not None and adaptive.peeks(t, probe, greedy=True):
            run(1, peeking=True)
            after = choose()
            if hold and int(after.index) == lengths.index(1) and not bool(after.probe):
                plain(int(after.until_probe))
        elif probe:
            run(t)
        elif t == 1:
            plain(int(choice.until_probe))
        else:
            held = int(choice.index) if hold else None
            for i in range(1, n):
                run(t)
                if pos >= n or i >= every and not hold:
                    break
                if i >= every and (int((c := choose(held)).index) != int(choice.index) or bool(c.probe)):
                    break
        choice = choose(held)
    if carry == "final":
        stats = stats.replace(total_hits=stats.hits, total_tries=stats.tries)
    carried = jax.device_get(decoder.carried(stats, jnp.ones((1,), bool)))  # (the decoder's compiled one)
    return {"seconds": seconds, "rounds": rounds, "lengths": ran, "carried": carried}


def chained(traces: list[list[int]], n: int, costs: dict[int, float], repeats: int, **kwargs) -> list[float]:
    """Model seconds per prompt as the bench measures them: each prompt decoded ``repeats + 1`` times in a row (a
    warm-up, then the timed repeats; their median), every request starting from the prior the request before it
    carried — the previous prompt's last one for a warm-up. Under greedy decoding a repeat replays the same text,
    so a carried prior that sends the policy down one path sends every repeat down it (seen in a bench: τ 1.00 on
    four repeats of a code prompt where the run before had drafted at τ 1.40)."""
    prior, out = None, []
    for trace in traces:
        seconds = []
        for _ in range(repeats + 1):
            result = simulate(trace, n, costs, prior=prior, **kwargs)
            prior = result["carried"]
            seconds.append(result["seconds"])
        out.append(float(np.median(seconds[1:])))
    return out


def oracle_seconds(trace: list[int], n: int, costs: dict[int, float]) -> float:
    """The least model seconds any sequence of lengths needs (it knows the trace): the headroom of adapting."""
    best = np.zeros(n + 1)
    for pos in range(n - 1, 0, -1):
        best[pos] = min(costs[t] + best[pos + committed(trace, pos, t, n)] for t in costs)
    return float(best[1])


def capped_acceptance(cap: float | None):
    """``adaptive.acceptance`` with an untested slot's prior (the estimate of the slot before it) at most ``cap``
    (None: the prior of every slot is the coin flip, ``PRIOR_ACCEPT``, not chained)."""

    def acceptance(state: adaptive.PolicyState):
        prior = jnp.full(state.hits.shape[:1], adaptive.PRIOR_ACCEPT, jnp.float32)
        columns = []
        for i in range(state.hits.shape[1]):
            estimate = (state.hits[:, i] + adaptive.PRIOR_WEIGHT * prior) / (state.tries[:, i] + adaptive.PRIOR_WEIGHT)
            columns.append(estimate)
            prior = jnp.full_like(prior, adaptive.PRIOR_ACCEPT) if cap is None else jnp.minimum(estimate, cap)
        return jnp.stack(columns, axis=1)

    return acceptance


VARIANTS = {  # name → (adaptive constants (or its acceptance estimate) relative to the shipped ones, the held
    # segments' DECIDE_AFTER (a segment's rounds without hold), hold,
    # peek[, how]); how: {"bonus": simulate's, "drop_longest": no longest length, "carry": simulate's}
    "auto": ({}, decoder.DECIDE_AFTER, True, True),
    "auto, a segment every 4 rounds and probes apart (no hold)": ({}, decoder.DECIDE_EVERY, False, True),
    "auto, probes verify 2 (no peeks)": ({}, decoder.DECIDE_AFTER, True, False),
    "auto, probes verify 4 (no peeks)": ({"PROBE_LENGTH": 4}, decoder.DECIDE_AFTER, True, False),
    "auto, probes priced without their launch": ({"PROBE_LAUNCHES": 0.0}, decoder.DECIDE_AFTER, True, True),
    "auto, prior 0.3": ({"PRIOR_ACCEPT": 0.3}, decoder.DECIDE_AFTER, True, True),
    "auto, first wait 8": ({"FIRST_WAIT": 8}, decoder.DECIDE_AFTER, True, True),
    "auto, decay 0.9": ({"DECAY": 0.9}, decoder.DECIDE_AFTER, True, True),
    "auto, decide from round 4 (before 2026-12-07, thirteenth)": ({}, decoder.DECIDE_EVERY, True, True),
    "auto, decide from round 8": ({}, 8, True, True),
    "auto, prior weight 2": ({"PRIOR_WEIGHT": 2.0}, decoder.DECIDE_AFTER, True, True),
    "auto, no wait doubling": ({"MAX_WAIT": adaptive.FIRST_WAIT}, decoder.DECIDE_AFTER, True, True),
    "auto, an untested slot no better than a coin flip": ({"acceptance": capped_acceptance(adaptive.PRIOR_ACCEPT)},
                                                          decoder.DECIDE_AFTER, True, True),
    "auto, an untested slot a coin flip (no chain)": ({"acceptance": capped_acceptance(None)}, decoder.DECIDE_AFTER,
                                                      True, True),
    "auto, a full round's bonus tests the next slot": ({}, decoder.DECIDE_AFTER, True, True, {"bonus": True}),
    "auto, both (bonus, no better than a coin flip)": ({"acceptance": capped_acceptance(adaptive.PRIOR_ACCEPT)},
                                                       decoder.DECIDE_AFTER, True, True, {"bonus": True}),
    "auto without its longest length": ({}, decoder.DECIDE_AFTER, True, True, {"drop_longest": True}),
    "auto, a slot's prior at most 0.8": ({"acceptance": capped_acceptance(0.8)}, decoder.DECIDE_AFTER, True, True),
    "auto, carrying the final estimates (before 2026-12-07)": ({}, decoder.DECIDE_AFTER, True, True,
                                                               {"carry": "final"}),
    "auto, a drafter that never paid probed as any other (before 2026-12-07, late)": (
        {"NEVER_PAID_TRIES": 1 << 30}, decoder.DECIDE_AFTER, True, True),
    "auto, a held length gives way to any better one (before 2026-12-07, fourteenth)": (
        {"SWITCH_MARGIN": 0.0}, decoder.DECIDE_AFTER, True, True),
    **{f"auto, a held length gives way only {m:.0%} faster": ({"SWITCH_MARGIN": m}, decoder.DECIDE_AFTER, True, True)
       for m in (0.03, 0.06, 0.1, 0.15, 0.2)},
    **{f"auto, probes at least every {k} rounds": ({"wait_cap": lambda policy, k=k: jnp.int32(k)},
                                                   decoder.DECIDE_AFTER, True, True) for k in (7, 9, 14)},
}


def fixed_costs(target, proposer, prompt: list[int], lengths: tuple[int, ...], n: int,
                repeats: int) -> tuple[dict[int, float], float]:
    """Seconds per round of fixed-length loops (T = 1: ``generate``) and of a peek (a loop of peeks), medians of
    ``repeats`` interleaved."""
    from overhead import plain_rounds  # this folder is on sys.path when run

    samples: dict = {t: [] for t in [*lengths, "peek"]}
    for _ in range(repeats + 1):  # the first pass compiles
        for t in lengths:
            if t == 1:
                r = generate(target, [prompt], n, stop_ids=[])
                samples[t].append(r.decode_seconds / (n - 1))
            else:
                r = speculative_generate(target, proposer, [prompt], n, stop_ids=[], verify=t)
                samples[t].append(r.decode_seconds / r.num_iterations)
        samples["peek"].append(plain_rounds(target, proposer, prompt, n, peek=True) / n)
    peek = statistics.median(samples.pop("peek")[1:])
    return {t: statistics.median(v[1:]) for t, v in samples.items()}, peek


def study_parser(description: str, out: str, skip: int = 0) -> argparse.ArgumentParser:
    """The arguments every trace study takes (this one and ``confidence_sim.py``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="checkpoints/smollm2-135m-dspine-b8")
    ap.add_argument("--data", default="experiments/data/smollm2-v2")
    ap.add_argument("--prompts-per-domain", type=int, default=4)
    ap.add_argument("--skip", type=int, default=skip,
                    help="skip each domain's first N held-out prompts (the bench's: tune on others)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--costs", help="ms per round instead of measuring them, e.g. 1:25.3,2:35.5,4:39.1,8:48.0,peek:31")
    ap.add_argument("--host-ms", type=float, default=3.0, help="host work per segment (ms)")
    ap.add_argument("--traces", type=Path, help="replay the prompts and traces of an earlier run's JSON (no model run)")
    ap.add_argument("--chain", type=int, default=0, metavar="R",
                    help="replay requests as the bench runs them: each prompt a warm-up and R repeats, every request "
                         "starting from the prior the one before carried (0: each request from the coin flip)")
    ap.add_argument("--variants", nargs="*", help="replay only these policy variants (VARIANTS' names; default: all)")
    ap.add_argument("--out", type=Path, default=Path(out))
    return ap


def parse_costs(text: str) -> tuple[dict[int, float], float]:
    """``1:25.3,2:35.5,peek:31`` (ms) → ({length: seconds per round}, seconds of a peek; a plain step's if not given)."""
    costs = {k: float(ms) / 1e3 for k, ms in (x.split(":") for x in text.split(","))}
    peek = costs.pop("peek", None)
    costs = {int(t): s for t, s in costs.items()}
    return costs, costs[1] if peek is None else peek


def load_study(args: argparse.Namespace):
    """(prompts, target, proposer, candidate lengths, seconds per round at each length, seconds of a peek) of a
    study."""
    model_dir = resolve_model_dir(args.model)
    held = {d: list(v)[args.skip :] for d, v in bench.load_heldout_prompts(args.model, Path(args.data)).items()}
    prompts = bench.select_prompts(held, args.prompts_per_domain, bench.encoder(model_dir, held))
    target = load_target(model_dir)
    proposer = DrafterProposer(load_drafter(args.drafter, target))
    lengths = adaptive.candidate_lengths(proposer.drafter.config.block_size)
    if args.costs:
        costs, peek = parse_costs(args.costs)
    else:
        costs, peek = fixed_costs(target, proposer, prompts[0].ids, lengths, args.max_new_tokens, args.repeats)
    print("ms per round:", {t: round(s * 1e3, 1) for t, s in costs.items()}, "peek", round(peek * 1e3, 1),
          file=sys.stderr)
    return prompts, target, proposer, lengths, costs, peek


NEVER = "never right"  # a drafter whose proposals are never accepted (a trace of zeros), apart from "all"
ALWAYS = "always right"  # one whose proposals are all accepted: does the policy reach its longest block?


def print_table(rows: dict[str, dict[str, list[float]]], prompts) -> dict[str, dict[str, float]]:
    """Print ``{policy: {domain: [× AR per prompt]}}`` as a markdown table (``NEVER`` and ``ALWAYS`` columns, where
    a policy has them, after "all" and not in it); returns the means."""
    domains = list(dict.fromkeys(p.domain for p in prompts))
    extra = [d for d in (NEVER, ALWAYS) if any(d in by for by in rows.values())]
    print("| policy | " + " | ".join(domains + ["all"] + extra) + " |")
    print("|---" * (len(domains) + len(extra) + 2) + "|")
    summary = {}
    for name, by in rows.items():
        cells = [float(np.mean(by[d])) for d in domains] + [float(np.mean([x for d in domains for x in by[d]]))]
        cells += [float(np.mean(by[d])) if d in by else float("nan") for d in extra]
        summary[name] = dict(zip(domains + ["all"] + extra, cells))
        print(f"| {name} | " + " | ".join("–" if np.isnan(c) else f"{c:.2f}×" for c in cells) + " |")
    return summary


def main() -> None:
    args = study_parser(__doc__.splitlines()[0], "experiments/adaptive/policy_sim.json").parse_args()
    n = args.max_new_tokens
    begin = time.perf_counter()
    if args.traces:  # replay an earlier run: its prompts, traces and costs
        earlier = json.loads(args.traces.read_text())
        n, costs = earlier["max_new_tokens"], {int(t): s for t, s in earlier["costs"].items()}
        peek = earlier.get("peek_seconds", costs[1])
        prompts = [argparse.Namespace(domain=p["domain"], source=p["source"]) for p in earlier["prompts"]]
        traces = [p["trace"] for p in earlier["prompts"]]
        if args.costs:  # the same traces under other costs
            costs, peek = parse_costs(args.costs)
    else:
        prompts, target, proposer, lengths, costs, peek = load_study(args)
        traces = []
        for i, p in enumerate(prompts):
            traces.append(acceptance_trace(target, proposer, p.ids, n))
            print(f"[{i + 1}/{len(prompts)}] {p.domain}: mean accept {np.mean(traces[-1]):.2f}", file=sys.stderr)
    lengths, host = tuple(sorted(costs)), args.host_ms / 1e3
    rows: dict[str, dict[str, list[float]]] = {}
    ar = (n - 1) * costs[1]

    def record(name: str, domain: str, seconds: float) -> None:
        rows.setdefault(name, {}).setdefault(domain, []).append(ar / seconds)

    for t in [t for t in lengths if t > 1]:
        for p, trace in zip(prompts, traces):
            record(f"fixed {t}", p.domain, simulate(trace, n, costs, fixed=t)["seconds"])
    never = argparse.Namespace(domain=NEVER, source="no proposal ever accepted")  # what probing costs
    always = argparse.Namespace(domain=ALWAYS, source="every proposal accepted")  # whether long blocks are reached
    for name, (constants, every, hold, peeks, *how) in VARIANTS.items():
        if args.variants and name not in args.variants:
            continue
        how = how[0] if how else {}
        variant_costs = {t: c for t, c in costs.items() if t != max(costs)} if how.get("drop_longest") else costs
        options = dict(every=every, peek=peek if peeks else None, host=host, hold=hold, bonus=how.get("bonus", False),
                       carry=how.get("carry", "totals"))
        with policy_constants(**constants):
            if args.chain:  # the bench's order; a drafter never (always) right as a chain of its own
                for group in (list(zip(prompts, traces)), [(never, [0] * n)] * 4, [(always, [n] * n)] * 4):
                    seconds = chained([t for _, t in group], n, variant_costs, args.chain, **options)
                    for (p, _), s in zip(group, seconds):
                        record(name, p.domain, s)
                continue
            for p, trace in [*zip(prompts, traces), (never, [0] * n), (always, [n] * n)]:
                record(name, p.domain, simulate(trace, n, variant_costs, **options)["seconds"])
    for p, trace in zip(prompts, traces):
        record("oracle (knows the trace)", p.domain, oracle_seconds(trace, n, costs))
    summary = print_table(rows, prompts)
    args.out.write_text(json.dumps({
        "model": args.model, "drafter": args.drafter, "max_new_tokens": n, "skip": args.skip, "costs": costs,
        "peek_seconds": peek, "host_seconds_per_segment": host, "costs_given": bool(args.costs),
        "traces_from": str(args.traces) if args.traces else None, "chain": args.chain,
        "prompts": [{"domain": p.domain, "source": p.source, "trace": t} for p, t in zip(prompts, traces)],
        "speedup_vs_ar": summary, "seconds": time.perf_counter() - begin, "machine": bench.machine_info(),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
