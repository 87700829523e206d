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
from typing import Any

import jax.numpy as jnp

from dspine_jax.decoding.planning import enable_compilation_cache
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.config import build_target_layer_ids, load_drafter_config
from dspine_jax.drafters.io import (
    cast_drafter,
    copy_target_layers,
    default_mask_token_id,
    init_drafter,
    load_drafter,
    save_drafter,
    with_draft_vocab,
)
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.train.data import build_features, load_heldout
from dspine_jax.train.loop import Dataset, TrainConfig, train
from dspine_jax.train.vocab import data_draft_vocab

# Runs recorded before --loss-decay-gamma existed trained both kinds with γ = 7.
LEGACY_GAMMA = 7.0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dspine_jax.train", description="Train a DFlash / DSpine drafter.")
    ap.add_argument("--target", required=True, help="target model path or alias (e.g. smollm2-135m-instruct)")
    ap.add_argument("--kind", choices=("dspine", "dflash", "dflash2"), default="dspine")
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
    ap.add_argument("--target-layers", default=None,
                    help="comma-separated target layers to tap (default: z-lab's rule, one per drafter layer); "
                    "drafters of different depths share features when they tap the same layers")
    ap.add_argument("--init-from-target", action="store_true",
                    help="initialise the drafter's layers from the target's last layers (needs the target's MLP "
                    "width: --intermediate-size = the target's)")
    ap.add_argument("--init-from", default=None,
                    help="continue from an exported drafter checkpoint directory (a second training stage, e.g. on "
                    "more data): its kind must match --kind, and its shape, taps, block and mask token replace the "
                    "shape arguments; the optimiser and schedule start afresh")
    ap.add_argument("--alignment-warmup-steps", type=int, default=None, help="DSpine β warm-up (default: the config's)")
    ap.add_argument("--loss-decay-gamma", type=float, default=None,
                    help="position decay γ of the loss weights exp(-(k-1)/γ); default: SpecForge's "
                    "(DSpine 7, DFlash none); 0: none")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="block mask token; default: a dedicated unused token (drafter_io.default_mask_token_id)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="propose only the N most frequent response tokens of --data (a draft vocabulary, train/vocab.py): "
                         "the unary logits then cost N/V of the target head")
    ap.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def train_config(run: dict[str, Any]):
    """The ``TrainConfig`` of a run (its ``run.json`` / argument dict)."""

    return TrainConfig(
        steps=run["steps"], batch_size=run["batch_size"], anchors=run["anchors"], lr=run["lr"], seed=run["seed"],
        checkpoint_every=run.get("checkpoint_every", 25), eval_every=run.get("eval_every", 0),
        alignment_warmup_steps=run.get("alignment_warmup_steps"), gamma=run.get("loss_decay_gamma", LEGACY_GAMMA),
    )  # fmt: skip


def adopt_init_shape(run: dict[str, Any]) -> None:
    """With ``--init-from``, record the starting checkpoint's shape in ``run`` (so ``run.json`` and the model
    card describe the drafter that trains); a checkpoint of another kind is refused."""

    source = run.get("init_from")
    if not source:
        return
    config = load_drafter_config(Path(source))
    if config.kind != run["kind"]:
        raise SystemExit(f"--init-from {source} is a {config.kind} drafter, but --kind is {run['kind']}")
    run.update(
        layers=config.num_layers, intermediate_size=config.intermediate_size, block_size=config.block_size,
        target_layers=",".join(str(i) for i in config.target_layer_ids), mask_token_id=config.mask_token_id,
        init_from_target=False,
    )  # fmt: skip
    if config.kind == "dspine":
        run.update(transfer_rank=config.transfer_rank, message_size=config.message_size)


def build_drafter(target, run: dict[str, Any]):
    """The run's starting drafter: the ``--init-from`` checkpoint in float32, or a fresh one, with the run's
    draft vocabulary (``card.export_step`` rebuilds it the same way to restore a checkpoint)."""

    if run.get("init_from"):
        drafter = load_drafter(run["init_from"], target, dtype="float32")
    else:
        drafter = fresh_drafter(target, run)
    if run.get("draft_vocab"):
        drafter = with_draft_vocab(drafter, target, data_draft_vocab(run["data"], run["draft_vocab"], target.config.vocab_size))
    return drafter


def fresh_drafter(target, run: dict[str, Any]):
    """A new drafter of the run's shape (its layers copied from the target with ``--init-from-target``). Runs
    recorded before ``--mask-token-id`` existed used the target's pad id."""
    mask = run.get("mask_token_id")
    if mask is None:
        pad = target.config.pad_token_id
        mask = pad if pad is not None else target.config.vocab_size - 1
    drafter = init_drafter(
        target, kind=run["kind"], num_layers=run["layers"], intermediate_size=run["intermediate_size"],
        transfer_rank=run["transfer_rank"] if run["kind"] == "dspine" else None,
        message_size=run["message_size"] if run["kind"] == "dspine" else None,
        block_size=run["block_size"], seed=run["seed"], mask_token_id=mask, target_layer_ids=tapped_layers(target, run),
    )  # fmt: skip
    return copy_target_layers(drafter, target) if run.get("init_from_target") else drafter


def tapped_layers(target, run: dict[str, Any]) -> tuple[int, ...]:
    """The run's target taps: ``--target-layers`` or z-lab's rule for its depth."""

    given = run.get("target_layers")
    if given:
        return tuple(int(x) for x in str(given).split(","))
    return tuple(build_target_layer_ids(target.config.num_layers, run["layers"]))


def _tokenizer_or_none(source: str):
    """The target's tokenizer, or None (a bare model directory): it tells which token ids are unused."""

    try:
        return load_tokenizer(source)
    except (OSError, ValueError) as e:
        print(f"no tokenizer for {source} ({type(e).__name__}); the mask token is chosen from the vocabulary alone")
        return None


def make_eval_fn(target, data_dir: Path, per_domain: int, max_new_tokens: int = 32):

    held = load_heldout(data_dir)

    def eval_fn(drafter, step: int) -> dict[str, float]:
        out = {}
        for domain, records in held.items():
            prompts = [r["prompt_ids"] for r in records[:per_domain]]
            if prompts:
                res = speculative_generate(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                           verify=drafter.config.block_size)  # τ of the whole block
                out[f"tau_{domain}"] = res.mean_acceptance
        return out

    return eval_fn


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)


    enable_compilation_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    run_file = args.out / "run.json"
    run = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("resume", "stop_at", "no_progress")}
    adopt_init_shape(run)
    previous = json.loads(run_file.read_text()) if args.resume and run_file.exists() else None
    if previous is not None:
        # A resumed run keeps the mask token and γ it trained with unless they are given again.
        for key, legacy in (("mask_token_id", None), ("loss_decay_gamma", LEGACY_GAMMA)):
            if run[key] is None:
                run[key] = previous.get(key, legacy)
        changed = {k: (previous.get(k), v) for k, v in run.items() if k in previous and previous[k] != v and k not in ("eval_every", "eval_prompts", "checkpoint_every", "export_dtype")}
        if changed:
            raise SystemExit(f"--resume with different arguments than the run in {args.out}: {changed}")

    target = load_target(args.target, products="xla")  # training reads the head as a matrix
    if run["mask_token_id"] is None and previous is None:
        run["mask_token_id"] = default_mask_token_id(target, _tokenizer_or_none(args.target))
    run_file.write_text(json.dumps(run, indent=2) + "\n")
    taps = tapped_layers(target, run)
    tokens, mask, features = build_features(args.target, args.data, taps, args.max_len, progress=not args.no_progress)
    dataset = Dataset(tokens, mask, features)
    drafter = build_drafter(target, run)
    cfg = train_config(run)
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
            export = cast_drafter(drafter, jnp.bfloat16)
        save_drafter(export, args.out / "export")
        print(f"exported to {args.out / 'export'}")


if __name__ == "__main__":
    main()
