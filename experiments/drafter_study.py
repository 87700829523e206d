"""Drafter design study for a 135M target: depth, MLP width, block size, initialisation from the
target's own layers — each variant trained on the same data for the same wall-clock budget, then
measured by τ per domain and by end-to-end decode speed against our AR decode on this machine.

    python experiments/drafter_study.py --data experiments/data/smollm2-v2 --budget-minutes 5 \
        --out experiments/drafter_study [--variants d5-f768-b16,d2-f1536-b16-init] [--prompts 4]

Same budget, not the same steps: a variant that trains faster sees more data, which is the trade a
user makes. The step count per variant comes from a short timing probe (``--probe-steps``) of the
real training step; the learning-rate schedule then spans exactly that many steps. Every variant taps
the same five target layers (so all of them read one feature store) and trains as DSpine with the
repository's objective; only the listed knobs differ.

Writes ``OUT/results.json`` and ``OUT/RESULTS.md`` (appending variants already measured: the study is
resumable per variant, a finished one is not retrained).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspine_jax.decoding.autoregressive import generate  # noqa: E402
from dspine_jax.decoding.planning import enable_compilation_cache
from dspine_jax.decoding.speculative import speculative_generate  # noqa: E402
from dspine_jax.drafters.io import load_drafter  # noqa: E402
from dspine_jax.models.target import load_target  # noqa: E402
from dspine_jax.train.__main__ import main as train_main  # noqa: E402
from dspine_jax.train.data import load_heldout  # noqa: E402
from dspine_jax.train.prompts import DOMAINS  # noqa: E402

TAPS = "1,8,14,20,27"  # z-lab's rule for a 5-layer drafter on a 30-layer target
COMMON = ["--kind", "dspine", "--batch-size", "4", "--anchors", "8", "--lr", "0.001", "--max-len", "512",
          "--target-layers", TAPS, "--checkpoint-every", "100000", "--no-progress"]  # fmt: skip

# name → training options (everything else: COMMON and the train CLI's defaults)
VARIANTS: dict[str, list[str]] = {
    "d5-f768-b16": ["--layers", "5", "--intermediate-size", "768", "--block-size", "16"],
    "d2-f1536-b16-init": ["--layers", "2", "--intermediate-size", "1536", "--block-size", "16", "--init-from-target"],
    "d2-f1536-b16": ["--layers", "2", "--intermediate-size", "1536", "--block-size", "16"],
    "d1-f1536-b16-init": ["--layers", "1", "--intermediate-size", "1536", "--block-size", "16", "--init-from-target"],
    "d2-f768-b16": ["--layers", "2", "--intermediate-size", "768", "--block-size", "16"],
    "d2-f1536-b8-init": ["--layers", "2", "--intermediate-size", "1536", "--block-size", "8", "--init-from-target"],
}


def step_seconds(run_dir: Path) -> float:
    """Median step time of a probe run (its logged steps, compilation excluded: step 1 is not logged)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time"] for r in rows)


def train_variant(name: str, data: Path, out: Path, budget_s: float, probe_steps: int, target: str) -> dict:
    run_dir, probe_dir = out / name, out / f"{name}.probe"
    base = ["--target", target, "--data", str(data), *COMMON, *VARIANTS[name]]
    if not (probe_dir / "metrics.jsonl").exists():
        train_main([*base, "--out", str(probe_dir), "--steps", str(probe_steps)])
    per_step = step_seconds(probe_dir)
    steps = max(int(budget_s / per_step), 20)
    if not (run_dir / "export" / "config.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        t0 = time.perf_counter()
        train_main([*base, "--out", str(run_dir), "--steps", str(steps), "--alignment-warmup-steps",
                    str(max(steps // 5, 1))])  # fmt: skip
        wall = time.perf_counter() - t0
    else:
        wall = json.loads((run_dir / "stats.json").read_text())["wall_seconds"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tail = rows[-5:]
    return {
        "steps": steps, "probe_step_seconds": per_step, "wall_seconds": wall,
        "blocks_per_second": steps * 4 * 8 / wall,
        "train_acc_last": statistics.mean(r["acc"] for r in tail), "train_loss_last": statistics.mean(r["loss"] for r in tail),
    }  # fmt: skip


def evaluate(target, drafter_dir: Path, held: dict, prompts: int, max_new_tokens: int, verify: list[int]) -> dict:
    """τ per domain (greedy, one batch of every domain's prompts) and batch-1 decode speed on the code
    prompts: AR and speculative at each verify length, side by side in this call."""
    drafter = load_drafter(drafter_dir, target)
    batch, row_domain = [], []
    for domain in DOMAINS:
        for r in held[domain][:prompts]:
            batch.append(r["prompt_ids"])
            row_domain.append(domain)
    ar = generate(target, batch, max_new_tokens)
    res = speculative_generate(target, drafter, batch, max_new_tokens, verify=drafter.config.block_size)
    tau = {}
    for d in [*DOMAINS, "all"]:
        rows = [i for i, rd in enumerate(row_domain) if d in ("all", rd)]
        steps = sum(len(res.acceptance_lengths[i]) for i in rows)
        tau[d] = sum(sum(res.acceptance_lengths[i]) for i in rows) / max(steps, 1)
    speed: dict[str, float] = {}
    code = [r["prompt_ids"] for r in held["code"][:prompts]]
    for label, run in [("ar", lambda p: generate(target, [p], max_new_tokens, stop_ids=[]))] + [
        (f"T{t}", lambda p, t=t: speculative_generate(target, drafter, [p], max_new_tokens, stop_ids=[], block_size=t))
        for t in verify if t <= drafter.config.block_size
    ]:
        run(code[0])  # compile
        seconds = sum(run(p).seconds for p in code)
        speed[label] = len(code) * max_new_tokens / seconds
    best = max((k for k in speed if k != "ar"), key=speed.get)
    return {"tau_greedy": tau, "greedy_exact": res.token_ids == ar.token_ids, "code_tok_s": speed,
            "best_verify": best, "speedup_code": speed[best] / speed["ar"]}  # fmt: skip


def write_report(results: dict, out: Path) -> None:
    lines = [
        f"Budget {results['budget_minutes']} min of training per variant on {results['machine']}; data: "
        f"{results['data']} ({results['sequences']} sequences, {results['response_tokens']} response tokens). "
        f"τ: greedy, {results['prompts']} held-out prompts per domain, {results['max_new_tokens']} new tokens; "
        "speed: batch 1 on the code prompts, tokens/s without compilation, AR and speculative in the same run.",
        "",
        "| variant | steps | blocks/s | train acc | τ code | τ math | τ chat | τ prose | τ all | AR tok/s | best T | spec tok/s | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["variants"].items():
        if "eval" not in r:
            continue
        e, t = r["eval"], r["train"]
        tau = e["tau_greedy"]
        lines.append(
            f"| {name} | {t['steps']} | {t['blocks_per_second']:.1f} | {t['train_acc_last']:.3f} | "
            + " | ".join(f"{tau[d]:.2f}" for d in [*DOMAINS, "all"])
            + f" | {e['code_tok_s']['ar']:.1f} | {e['best_verify']} | {e['code_tok_s'][e['best_verify']]:.1f} | "
            f"{e['speedup_code']:.2f}× |"
        )
    (out / "RESULTS.md").write_text("# Drafter design study (generated by drafter_study.py)\n\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "drafter_study")
    ap.add_argument("--runs", type=Path, default=Path.home() / ".cache" / "dspine_jax" / "runs" / "drafter_study",
                    help="training runs (checkpoints, exports): outside the repository")
    ap.add_argument("--budget-minutes", type=float, default=5.0)
    ap.add_argument("--probe-steps", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--verify", default="4,8,16", help="verify lengths timed on the code prompts")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    enable_compilation_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"variants": {}}
    from dspine_jax.bench import machine_info
    from dspine_jax.train.data import load_sequences

    rows = load_sequences(args.data)
    results.update(budget_minutes=args.budget_minutes, data=str(args.data), sequences=len(rows),
                   response_tokens=sum(len(r["response_ids"]) for r in rows), prompts=args.prompts,
                   max_new_tokens=args.max_new_tokens, machine="{processor}, {cpu_count} cores, jax {jax} ({jax_backend})".format(**machine_info()))  # fmt: skip
    target = load_target(args.target)
    held = load_heldout(args.data)
    for name in args.variants.split(","):
        entry = results["variants"].setdefault(name, {"options": VARIANTS[name]})
        if "eval" in entry:
            continue
        entry["train"] = train_variant(name, args.data, args.runs, 60 * args.budget_minutes, args.probe_steps, args.target)
        entry["eval"] = evaluate(target, args.runs / name / "export", held, args.prompts, args.max_new_tokens,
                                 [int(t) for t in args.verify.split(",")])  # fmt: skip
        print(name, json.dumps(entry["eval"]), flush=True)
        results_path.write_text(json.dumps(results, indent=2) + "\n")
        write_report(results, args.out)
    if not all(math.isfinite(v["eval"]["speedup_code"]) for v in results["variants"].values() if "eval" in v):
        raise SystemExit("a variant produced no speed measurement")


if __name__ == "__main__":
    main()
