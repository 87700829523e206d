"""``python -m dspine_jax.train --target M --kind dspine|dflash --data DIR --out DIR [options] [--resume]``

Trains a drafter against a frozen target on the regenerated dataset in ``DIR`` (built by
``python -m dspine_jax.train.data``; target features are computed once and cached there). Orbax
checkpoints go to ``OUT/checkpoints`` every ``--checkpoint-every`` steps; ``--resume`` continues exactly
from the latest one (same arguments). The final drafter is exported to ``OUT/export`` in the z-lab
DFlash / SpecForge DSpine layout (``--export-dtype bfloat16`` halves it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dspine_jax.train", description="Train a DFlash / DSpine drafter.")
    ap.add_argument("--target", required=True, help="target model path or alias (e.g. smollm2-135m-instruct)")
    ap.add_argument("--kind", choices=("dspine", "dflash"), default="dspine")
    ap.add_argument("--data", type=Path, required=True, help="dataset dir from python -m dspine_jax.train.data")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--anchors", type=int, default=8, help="blocks per sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-at", type=int, default=None, help="stop (with a checkpoint) before --steps; resume later")
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out τ every N steps (0: off)")
    ap.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts per domain for periodic τ")
    ap.add_argument("--max-len", type=int, default=256)
    # drafter shape
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--intermediate-size", type=int, default=768)
    ap.add_argument("--transfer-rank", type=int, default=64)
    ap.add_argument("--message-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--alignment-warmup-steps", type=int, default=None)
    ap.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def make_eval_fn(target, data_dir: Path, per_domain: int, max_new_tokens: int = 32):
    from dspine_jax.speculative import speculative_generate
    from dspine_jax.train.data import load_heldout

    held = load_heldout(data_dir)

    def eval_fn(drafter, step: int) -> dict[str, float]:
        out = {}
        for domain, records in held.items():
            prompts = [r["prompt_ids"] for r in records[:per_domain]]
            if prompts:
                res = speculative_generate(target, drafter, prompts, max_new_tokens=max_new_tokens)
                out[f"tau_{domain}"] = res.mean_acceptance
        return out

    return eval_fn


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp

    from dspine_jax.drafter_config import build_target_layer_ids
    from dspine_jax.drafter_io import init_drafter, save_drafter
    from dspine_jax.generate import enable_compilation_cache
    from dspine_jax.target import load_target
    from dspine_jax.train.data import build_features
    from dspine_jax.train.loop import Dataset, TrainConfig, train

    enable_compilation_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    run_file = args.out / "run.json"
    run = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("resume", "stop_at", "no_progress")}
    if args.resume and run_file.exists():
        previous = json.loads(run_file.read_text())
        changed = {k: (previous.get(k), v) for k, v in run.items() if k in previous and previous[k] != v and k not in ("eval_every", "eval_prompts", "checkpoint_every", "export_dtype")}
        if changed:
            raise SystemExit(f"--resume with different arguments than the run in {args.out}: {changed}")
    run_file.write_text(json.dumps(run, indent=2) + "\n")

    target = load_target(args.target)
    taps = build_target_layer_ids(target.config.num_layers, args.layers)
    tokens, mask, features = build_features(args.target, args.data, taps, args.max_len, progress=not args.no_progress)
    dataset = Dataset(tokens, mask, features)
    drafter = init_drafter(
        target, kind=args.kind, num_layers=args.layers, intermediate_size=args.intermediate_size,
        transfer_rank=args.transfer_rank if args.kind == "dspine" else None,
        message_size=args.message_size if args.kind == "dspine" else None,
        block_size=args.block_size, seed=args.seed,
    )  # fmt: skip
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, anchors=args.anchors, lr=args.lr, seed=args.seed,
        checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
        alignment_warmup_steps=args.alignment_warmup_steps,
    )  # fmt: skip
    eval_fn = make_eval_fn(target, args.data, args.eval_prompts) if args.eval_every else None
    t0 = time.time()
    drafter, history = train(
        drafter, target.params.embed, target.params.lm_head, dataset, cfg, args.out,
        resume=args.resume, stop_at=args.stop_at, eval_fn=eval_fn, progress=not args.no_progress,
    )  # fmt: skip
    wall = time.time() - t0
    # bookkeeping for model cards: cumulative wall time and tokens seen across resumed segments
    stats_file = args.out / "stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() and args.resume else {"wall_seconds": 0.0}
    stats["wall_seconds"] += wall
    if history:
        stats["last_step"] = history[-1]["step"]
        stats["last_metrics"] = history[-1]
    stats["sequences_per_step"] = args.batch_size
    stats["blocks_per_step"] = args.batch_size * args.anchors
    stats["config"] = dataclasses.asdict(cfg)
    stats_file.write_text(json.dumps(stats, indent=2) + "\n")
    if history and history[-1]["step"] >= args.steps:
        export = drafter
        if args.export_dtype == "bfloat16":
            export = drafter.replace(params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), drafter.params))
        save_drafter(export, args.out / "export")
        print(f"exported to {args.out / 'export'}")


if __name__ == "__main__":
    main()
