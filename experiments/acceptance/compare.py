"""Every drafter kind trained at one budget on SmolLM2-135M-Instruct: the paper's comparison in miniature.

    python experiments/acceptance/compare.py [--steps 400] [--shards-per-domain 2] [--work DIR]

Each kind (DFlash, DFlash2, DSpark, DSpine, EAGLE-3, an MTP head) is trained from scratch by
``python -m dspine_jax.train`` with the same data (the first ``--shards-per-domain`` shards of each domain of
the committed corpus), the same seed, steps, batch, anchors, learning rate and draft vocabulary, and the
same draft length: blocks of 8 for the block drafters, 7 test-time-training steps (verify 8) for the
sequential heads. One target feature pass taps the union of every kind's layers (each run reads its columns).
Resumable: finished stages are skipped, an interrupted run continues from its last checkpoint.

Then, on the held-out split (greedy output checked equal to AR):
* τ per domain at temperature 0 and 1, verify = 8 (the whole draft);
* a drafted round's cost against a plain step, both measured in the same greedy runs at batch 1;
* end-to-end decode tok/s with the default ``--verify auto`` against our AR, batch 1, interleaved, medians.

Writes ``NAME.json`` and ``NAME.md`` (``--name``, default ``compare``) beside this file (``--out``); trained
drafters stay under ``--work``. ``--kinds dspark-r128`` trains and measures a variant the same way (DSpark with a
rank-128 Markov head: the shipped one, since rank 256 over SmolLM2's 49k vocabulary passes 60 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from run import tau_per_domain  # noqa: E402  (this directory's τ study: the same per-domain τ)

from dspine_jax.decoding.autoregressive import generate  # noqa: E402
from dspine_jax.decoding.planning import enable_compilation_cache  # noqa: E402
from dspine_jax.decoding.speculative import speculative_generate  # noqa: E402
from dspine_jax.drafters.io import SEQUENTIAL_KINDS, load_draft  # noqa: E402
from dspine_jax.models.target import load_target  # noqa: E402
from dspine_jax.train.__main__ import tapped_layers  # noqa: E402
from dspine_jax.train.data import (  # noqa: E402
    PLAN_FILE,
    build_features,
    default_data_dir,
    load_heldout,
    read_plan,
    read_shard,
    shard_paths,
)
from dspine_jax.train.prompts import DOMAINS  # noqa: E402

KINDS = ("dflash", "dflash2", "dspark", "dspine", "eagle3", "mtp")
# Variants trained like their kind with one option changed: NAME → (kind, extra train flags).
VARIANTS = {"dspark-r128": ("dspark", ["--markov-rank", "128"])}  # (rank 256's Markov table does not fit 60 MB)
DRAFT_LEN = 7  # tokens drafted per round by every kind: verify 8
TARGET = "smollm2-135m-instruct"
CORPUS = ROOT / "experiments/data/smollm2-v2"


def subset_corpus(work: Path, per_domain: int) -> Path:
    """A corpus directory of the first ``per_domain`` shards of each domain (links to the committed files)."""
    out = work / f"corpus-{per_domain}-per-domain"
    if (out / "shards").exists():
        return out
    plan = read_plan(CORPUS)
    chosen: dict[str, list[Path]] = {d: [] for d in DOMAINS}
    for path in shard_paths(CORPUS):
        domain = read_shard(path, plan)[0]["domain"]
        if len(chosen[domain]) < per_domain:
            chosen[domain].append(path)
    tmp = out.with_name(out.name + ".tmp")
    (tmp / "shards").mkdir(parents=True, exist_ok=True)
    for name in (PLAN_FILE, "prompts_heldout.json", "manifest.json"):  # (the manifest checksums every shard)
        (tmp / name).symlink_to(CORPUS / name)
    for paths in chosen.values():
        for path in paths:
            (tmp / "shards" / path.name).symlink_to(path)
    tmp.rename(out)
    return out


def train_args(name: str, data: Path, out: Path, args: argparse.Namespace) -> list[str]:
    kind, extra = VARIANTS.get(name, (name, []))
    shape = ["--ttt-steps", str(DRAFT_LEN)] if kind in SEQUENTIAL_KINDS else ["--block-size", str(DRAFT_LEN + 1)]
    vocab = [] if kind == "mtp" else ["--draft-vocab", str(args.draft_vocab)]  # an MTP head keeps the target's head
    return [sys.executable, "-m", "dspine_jax.train", "--target", TARGET, "--kind", kind, "--data", str(data),
            "--out", str(out), "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--anchors",
            str(args.anchors), "--lr", str(args.lr), "--seed", "0", "--checkpoint-every", "50", "--resume",
            "--no-progress", *shape, *vocab, *extra]  # fmt: skip


def train(kind: str, data: Path, work: Path, args: argparse.Namespace) -> dict:
    """Train (or finish training) one kind; its wall-clock seconds summed over runs, compilation included."""
    out = work / kind
    record_path = out / "compare_train.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"seconds": 0.0, "runs": 0}
    if (out / "export" / "config.json").exists():
        return record
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out / "train.log", "a") as log:
        code = subprocess.call(train_args(kind, data, out, args), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    record = {"seconds": record["seconds"] + time.perf_counter() - start, "runs": record["runs"] + 1}
    record_path.write_text(json.dumps(record))
    if code:
        raise SystemExit(f"training {kind} failed (exit {code}); see {out / 'train.log'}")
    return record


def evaluate(target, drafters: dict, held: dict, args: argparse.Namespace) -> dict:
    prompts = [r["prompt_ids"] for d in DOMAINS for r in held[d][: args.prompts]]
    row_domain = [d for d in DOMAINS for _ in held[d][: args.prompts]]
    n = args.max_new_tokens
    result: dict = {"tau": {}, "greedy_exact": {}, "round_ms": {}, "step_ms": {}, "speed": {}}
    ar = generate(target, prompts, max_new_tokens=n)
    for kind, draft in drafters.items():
        for temp in (0.0, 1.0):
            res = speculative_generate(target, draft, prompts, n, temperature=temp, seed=0, verify=DRAFT_LEN + 1)
            result["tau"][f"{kind}@T{temp:g}"] = tau_per_domain(res, row_domain, list(DOMAINS))
            if temp == 0:
                result["greedy_exact"][kind] = res.token_ids == ar.token_ids
        print(kind, result["tau"][f"{kind}@T0"], result["greedy_exact"][kind], flush=True)
    # Batch 1, greedy, one prompt per domain, interleaved: a plain step, a drafted round (verify 8) and the
    # default policy's speed, against AR; each after a compiling run.
    one = [held[d][0]["prompt_ids"] for d in DOMAINS]
    for prompt in one:  # compile everything first
        generate(target, [prompt], max_new_tokens=n)
        for draft in drafters.values():
            speculative_generate(target, draft, [prompt], n, verify=DRAFT_LEN + 1)
            speculative_generate(target, draft, [prompt], n)
    samples: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for d, prompt in zip(DOMAINS, one):
            ar1 = generate(target, [prompt], max_new_tokens=n)
            samples.setdefault(f"ar/{d}", []).append(ar1.decode_tokens_per_second)
            samples.setdefault("step_ms", []).append(1e3 * ar1.decode_seconds / max(1, len(ar1.token_ids[0]) - 1))
            for kind, draft in drafters.items():
                fixed = speculative_generate(target, draft, [prompt], n, verify=DRAFT_LEN + 1)
                samples.setdefault(f"round_ms/{kind}", []).append(
                    1e3 * fixed.decode_seconds / max(1, len(fixed.acceptance_lengths[0])))
                auto = speculative_generate(target, draft, [prompt], n)
                assert auto.token_ids == ar1.token_ids, f"{kind}: verify auto differs from AR on {d}"
                samples.setdefault(f"auto/{kind}/{d}", []).append(auto.decode_tokens_per_second)
    med = {k: statistics.median(v) for k, v in samples.items()}
    result["step_ms"] = med["step_ms"]
    for kind in drafters:
        result["round_ms"][kind] = med[f"round_ms/{kind}"]
        result["speed"][kind] = {d: med[f"auto/{kind}/{d}"] / med[f"ar/{d}"] for d in DOMAINS}
    result["ar_tokens_per_second"] = {d: med[f"ar/{d}"] for d in DOMAINS}
    return result


def write_report(results: dict, path: Path) -> None:
    ev, budget = results["eval"], results["budget"]
    cols = [*DOMAINS, "all"]
    lines = [f"| kind | train min | s/step | {' | '.join(f'τ {d} T0' for d in cols)} | τ all T1 | round × step | "
             f"{' | '.join(f'auto × AR {d}' for d in DOMAINS)} | == AR |", "|---" * (len(cols) + len(DOMAINS) + 6) + "|"]
    for kind in results["kinds"]:
        t0, t1 = ev["tau"][f"{kind}@T0"], ev["tau"][f"{kind}@T1"]
        seconds = results["train"][kind]["seconds"]
        lines.append(f"| {kind} | {seconds / 60:.1f} | {seconds / budget['steps']:.2f} | "
                     + " | ".join(f"{t0[d]:.2f}" for d in cols) + f" | {t1['all']:.2f} | "
                     + f"{ev['round_ms'][kind] / ev['step_ms']:.2f} | "
                     + " | ".join(f"{ev['speed'][kind][d]:.2f}" for d in DOMAINS)
                     + f" | {'yes' if ev['greedy_exact'][kind] else 'NO'} |")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def ship(names: list[str], results: dict, args: argparse.Namespace) -> None:
    """Each trained drafter as ``checkpoints/smollm2-135m-KIND-b8`` (bf16, with its model card and the τ this
    script measured, from ``NAME.json``)."""
    from dspine_jax.train import card

    measured = json.loads((args.out / f"{args.name}.json").read_text())["eval"]["tau"]
    for name in names:
        kind = VARIANTS.get(name, (name,))[0]
        run = args.work / name
        (run / f"wall_at_{args.steps}.json").write_text(json.dumps({"wall_seconds": results["train"][name]["seconds"]}))
        tau = args.work / f"{name}_tau.json"
        tau.write_text(json.dumps({"tau": {f"{kind}@{t}": measured[f"{name}@{t}"] for t in ("T0", "T1")}}))
        dest = ROOT / "checkpoints" / f"smollm2-135m-{kind}-b{DRAFT_LEN + 1}"
        card.write_card(run, dest, tau, step=args.steps)
        print(f"shipped {name} → {dest}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"kinds, or variants: {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--shards-per-domain", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per domain for τ")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=default_data_dir() / "compare")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--ship", help="comma-separated kinds (or variants) to write to checkpoints/ (after a measuring run)")
    ap.add_argument("--name", default="compare", help="the results' file names (NAME.json, NAME.md)")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    enable_compilation_cache()
    data = subset_corpus(args.work, args.shards_per_domain)
    target = load_target(TARGET)
    runs = [{"kind": k, "layers": 1 if k == "eagle3" else 5, "target_layers": None}
            for k in (VARIANTS.get(name, (name,))[0] for name in kinds)]
    union = tuple(sorted({t for run in runs for t in tapped_layers(target, run)}))
    print(f"corpus {data} ({len(shard_paths(data))} shards); one feature pass over taps {union}", flush=True)
    build_features(TARGET, data, union)
    results = {"kinds": kinds, "budget": {k: v for k, v in vars(args).items() if k not in ("work", "out", "kinds")},
               "shards": [p.name for p in shard_paths(data)], "train": {}}
    results["budget"]["draft_len"] = DRAFT_LEN
    for kind in kinds:
        print(f"training {kind}", flush=True)
        results["train"][kind] = train(kind, data, args.work, args)
        print(f"  {results['train'][kind]['seconds'] / 60:.1f} min", flush=True)
    if args.train_only:
        return
    if args.ship:
        ship(args.ship.split(","), results, args)
        return
    drafters = {kind: load_draft(str(args.work / kind / "export"), target) for kind in kinds}
    results["eval"] = evaluate(target, drafters, load_heldout(data), args)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(results, args.out / f"{args.name}.md")


if __name__ == "__main__":
    main()
