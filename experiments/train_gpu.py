"""GPU recipe for a SmolLM2 drafter: extend the corpus, build target features, train, measure τ.

Sized for about 8 minutes of one H200 with the defaults below (an estimate: no device has run it yet —
the numbers it writes are the measurement). Every stage is resumable and timed into ``OUT/recipe.json``:

1. corpus   — copy the committed CPU corpus (``experiments/data/smollm2-v2``) to ``OUT/corpus`` and
              regenerate further plan rows with the target until ``--tokens`` response tokens exist
              (large batches; resume is by plan row, so the batch size may differ from the CPU run's);
2. features — the frozen target over every row (packed float16 features in the user cache);
3. train    — ``python -m dspine_jax.train`` (orbax checkpoints, exact resume), export to
              ``OUT/run/export`` (bfloat16);
4. τ        — greedy and T = 1 speculative decoding on the held-out prompts per domain
              (``OUT/tau.json``).

    python experiments/train_gpu.py --out /tmp/gpu_run                  # the H200 defaults
    python experiments/train_gpu.py --out DIR --tokens 0 --steps 2 ...  # CPU smoke size (tests do this)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a checkout without installing

from dspine_jax.decoding.proposers import as_proposer  # noqa: E402
from dspine_jax.decoding.speculative import speculative_generate  # noqa: E402
from dspine_jax.drafters.io import SEQUENTIAL_KINDS, load_draft  # noqa: E402
from dspine_jax.models.target import load_target  # noqa: E402
from dspine_jax.models.tokenizer import load_tokenizer  # noqa: E402
from dspine_jax.train import __main__ as train_cli  # noqa: E402
from dspine_jax.train import corpus  # noqa: E402
from dspine_jax.train.data import PLAN_FILE, load_heldout, read_plan  # noqa: E402
from dspine_jax.train.prompts import DOMAINS, encode_messages  # noqa: E402

COMMITTED = REPO / "experiments" / "data" / "smollm2-v2"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--corpus", type=Path, default=COMMITTED, help="corpus to start from (copied, never modified)")
    ap.add_argument("--kind", choices=train_cli.KINDS, default="dspine")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="response tokens to reach (0: use the corpus as is)")
    ap.add_argument("--regen-batch", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=512, help="training sequence length (prompt + response)")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--layers", type=int, default=5, help="block kinds' layers (eagle3: 1; mtp: the target's one layer)")
    ap.add_argument("--block-size", type=int, default=16, help="verify block (sequential kinds: block − 1 TTT steps)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per domain")
    ap.add_argument("--eval-tokens", type=int, default=96)
    return ap


def stage_corpus(args: argparse.Namespace, out: Path) -> dict:
    dst = out / "corpus"
    if not (dst / PLAN_FILE).exists():
        shutil.copytree(args.corpus, dst, ignore=shutil.ignore_patterns("features"), dirs_exist_ok=True)
    if args.tokens:
        tokenizer = load_tokenizer(args.target)
        plan = read_plan(dst)
        for r in plan:
            r["prompt_ids"] = encode_messages(tokenizer, r["messages"])
        corpus.regenerate_rows(load_target(args.target), plan, dst, args.tokens, args.regen_batch, args.max_new_tokens)
    manifest = corpus.write_manifest(dst, {"target": args.target, "out": dst, "tokens": args.tokens,
                                           "batch_size": args.regen_batch, "max_new_tokens": args.max_new_tokens})  # fmt: skip
    return {"sequences": manifest["sequences"], "response_tokens": manifest["response_tokens"]}


def stage_train(args: argparse.Namespace, out: Path) -> dict:
    run = out / "run"
    argv = [
        "--target", args.target, "--kind", args.kind, "--data", str(out / "corpus"), "--out", str(run),
        "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--anchors", str(args.anchors),
        "--lr", str(args.lr), "--max-len", str(args.max_len), "--export-dtype", "bfloat16", "--no-progress",
    ]  # fmt: skip
    if args.kind in SEQUENTIAL_KINDS:  # a head drafting one token per step: block − 1 steps
        argv += ["--ttt-steps", str(args.block_size - 1)] + (["--layers", "1"] if args.kind == "eagle3" else [])
    else:
        argv += ["--layers", str(args.layers), "--block-size", str(args.block_size)]
    if (run / "run.json").exists():
        argv.append("--resume")
    train_cli.main(argv)
    return {"export": str(run / "export")}


def stage_tau(args: argparse.Namespace, out: Path) -> dict:
    target = load_target(args.target)
    drafter = load_draft(str(out / "run" / "export"), target)
    block = as_proposer(drafter).block_limit
    held = load_heldout(out / "corpus")
    result: dict[str, dict[str, float]] = {}
    for temperature in (0.0, 1.0):
        per = {}
        for domain in DOMAINS:
            prompts = [r["prompt_ids"] for r in held[domain][: args.eval_prompts]]
            res = speculative_generate(target, drafter, prompts, args.eval_tokens, temperature=temperature, seed=0,
                                       verify=block)  # τ of the whole block
            per[domain] = round(res.mean_acceptance, 4)
        result["greedy" if temperature == 0 else "T=1"] = per
    (out / "tau.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    for name in ("regen_batch", "max_new_tokens", "max_len", "steps", "batch_size", "eval_prompts", "eval_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.corpus / PLAN_FILE).exists():
        raise SystemExit(f"{args.corpus} is not a corpus directory (no {PLAN_FILE})")
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "recipe.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    for name, stage in (("corpus", stage_corpus), ("train", stage_train), ("tau", stage_tau)):
        t0 = time.perf_counter()
        log[name] = {**stage(args, args.out), "seconds": round(time.perf_counter() - t0, 1)}
        log_path.write_text(json.dumps(log, indent=1) + "\n")
        print(f"[train_gpu] {name}: {log[name]}", file=sys.stderr, flush=True)
    return log


if __name__ == "__main__":
    main()
