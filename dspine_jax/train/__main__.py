"""``python -m dspine_jax.train --target M --kind dspine|dflash|dflash2|dspark|eagle3|mtp --data DIR --out DIR [options]
[--resume]``

Trains a drafter against a frozen target on the regenerated dataset in ``DIR`` (built by
``python -m dspine_jax.train.data``; target features are computed once and cached there). Orbax
checkpoints go to ``OUT/checkpoints`` every ``--checkpoint-every`` steps; ``--resume`` continues exactly
from the latest one (same arguments). The final drafter is exported to ``OUT/export`` in its kind's layout:
z-lab DFlash / DFlash2, SpecForge DSpine, vLLM speculators for DSpark, EAGLE-3 and MTP (``load_draft`` reads
every one; ``--export-dtype bfloat16`` halves it).

Kinds: the block drafters (``dspine``, ``dflash``, ``dflash2``, ``dspark``: DFlash's backbone with a Markov
logit bias over the previous token, ``--markov-head-type`` / ``--markov-rank``, and a confidence head) and
``eagle3`` (a sequential head trained with ``--ttt-steps`` test-time-training steps; ``--anchors`` chains per
sequence, every position by default as speculators does) and ``mtp`` (a multi-token-prediction head: one
decoder layer of the target's own kind over the target's final hidden state and the next token's embedding,
trained like EAGLE-3 with ``--ttt-steps`` steps, speculators' ``num_speculative_steps``, and its step weights;
fresh, or ``--init-from self:mtp`` (a Qwen3-Next / Qwen3.5 target's own head) or a speculators mtp checkpoint).
An option that does not apply to the kind is an error (``OPTION_KINDS``).
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
from dspine_jax.drafters import eagle3, mtp
from dspine_jax.drafters.config import build_target_layer_ids, load_drafter_config
from dspine_jax.drafters.dspark import MARKOV_HEAD_TYPES
from dspine_jax.drafters.io import (
    SEQUENTIAL_KINDS,
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
BLOCK_KINDS = ("dspine", "dflash", "dflash2", "dspark")
KINDS = (*BLOCK_KINDS, *SEQUENTIAL_KINDS)
# Kind-specific options and the kinds that take them; given for another kind they are an error. (DFlash and
# DFlash2 have always accepted DSpine's, and ignore them.)
OPTION_KINDS: dict[str, tuple[str, ...]] = {
    "transfer_rank": ("dspine", "dflash", "dflash2"),
    "message_size": ("dspine", "dflash", "dflash2"),
    "alignment_warmup_steps": ("dspine", "dflash", "dflash2"),
    "markov_rank": ("dspark",),
    "markov_head_type": ("dspark",),
    "ttt_steps": SEQUENTIAL_KINDS,
    # an MTP head is one layer of the target's shape over its final hidden state, with the full vocabulary
    "layers": (*BLOCK_KINDS, eagle3.KIND),
    "intermediate_size": (*BLOCK_KINDS, eagle3.KIND),
    "target_layers": (*BLOCK_KINDS, eagle3.KIND),
    "draft_vocab": (*BLOCK_KINDS, eagle3.KIND),
    "block_size": BLOCK_KINDS,
    "mask_token_id": BLOCK_KINDS,
    "init_from_target": BLOCK_KINDS,
}
# Defaults of the shape options left unset (None), per kind: the block drafters' historical ones; EAGLE-3's are
# speculators' (one layer, 3 TTT steps, the target's MLP width) and it trains a chain from every position.
BLOCK_DEFAULTS: dict[str, Any] = {"layers": 5, "intermediate_size": 768, "block_size": 16, "anchors": 8}
DSPINE_SHAPE_DEFAULTS: dict[str, Any] = {"transfer_rank": 64, "message_size": 64}
EAGLE3_DEFAULTS: dict[str, Any] = {"layers": 1, "ttt_steps": 3}
MTP_DEFAULTS: dict[str, Any] = {"ttt_steps": mtp.DEFAULT_STEPS}  # speculators' num_speculative_steps
# speculators' EAGLE-3 training recipe (draft_arch llama, norm_before_residual / norm_before_fc / norm_output on).
EAGLE3_LAYER_TYPE = "llama"
EAGLE3_FLAGS = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dspine_jax.train", description="Train a drafter (DFlash, DFlash2, "
                                 "DSpine, DSpark, an EAGLE-3 or an MTP head).")  # fmt: skip
    ap.add_argument("--target", required=True, help="target model path or alias (e.g. smollm2-135m-instruct)")
    ap.add_argument("--kind", choices=KINDS, default="dspine")
    ap.add_argument("--data", type=Path, required=True, help="dataset dir from python -m dspine_jax.train.data")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--anchors", type=int, default=None,
                    help="blocks per sequence (default 8); eagle3: test-time-training chains per sequence (default: "
                    "every position, as speculators trains)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-at", type=int, default=None, help="stop (with a checkpoint) before --steps; resume later")
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out τ every N steps (0: off)")
    ap.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts per domain for periodic τ")
    ap.add_argument("--max-len", type=int, default=256)
    # drafter shape
    ap.add_argument("--layers", type=int, default=None, help="drafter layers (default 5; eagle3: 1)")
    ap.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default 768; eagle3: the target's)")
    ap.add_argument("--transfer-rank", type=int, default=None, help="DSpine transfer rank R (default 64)")
    ap.add_argument("--message-size", type=int, default=None, help="DSpine message width M (default 64)")
    ap.add_argument("--block-size", type=int, default=None, help="block drafters' block T (default 16)")
    ap.add_argument("--markov-head-type", choices=MARKOV_HEAD_TYPES, default=None,
                    help="DSpark's Markov head over the previous token (default vanilla)")
    ap.add_argument("--markov-rank", type=int, default=None,
                    help="DSpark's Markov rank (default min(256, H); 0: no Markov head)")
    ap.add_argument("--ttt-steps", type=int, default=None,
                    help="eagle3 / mtp: test-time-training steps = tokens drafted per round (default 3; verify "
                    "block = steps + 1; mtp: speculators' --num-speculative-steps)")
    ap.add_argument("--target-layers", default=None,
                    help="comma-separated target layers to tap (default: z-lab's rule, one per drafter layer); "
                    "drafters of different depths share features when they tap the same layers")
    ap.add_argument("--init-from-target", action="store_true",
                    help="initialise the drafter's layers from the target's last layers (needs the target's MLP "
                    "width: --intermediate-size = the target's)")
    ap.add_argument("--init-from", default=None,
                    help="continue from an exported drafter checkpoint directory (a second training stage, e.g. on "
                    "more data): its kind must match --kind, and its shape, taps, block and mask token replace the "
                    "shape arguments; the optimiser and schedule start afresh. mtp: a speculators mtp checkpoint or "
                    "self:mtp, the target checkpoint's own head (Qwen3-Next / Qwen3.5)")
    ap.add_argument("--alignment-warmup-steps", type=int, default=None, help="DSpine β warm-up (default: the config's)")
    ap.add_argument("--loss-decay-gamma", type=float, default=None,
                    help="position decay γ of the loss weights exp(-(k-1)/γ); default: the reference's "
                    "(SpecForge: DSpine 7, DFlash none; speculators: DSpark 4, EAGLE-3 none: its TTT step k weighs "
                    "exp(-(k-1)/γ), speculators' --ttt-step-loss-decay e^(-1/γ); MTP: --step-weight-beta 0.6, "
                    "γ = -1/ln 0.6, weights normalised to sum 1); 0: none")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="block mask token; default: a dedicated unused token (drafter_io.default_mask_token_id)")
    ap.add_argument("--draft-vocab", type=int, default=None,  # (EAGLE-3: its reduced head, d2t)
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
    if run["kind"] == mtp.KIND or mtp.is_mtp_spec(source):
        check_mtp_init(run, source)
        return
    if eagle3.is_eagle3_dir(source):
        adopt_eagle3_shape(run, source)
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
    if config.kind == "dspark":
        run.update(markov_rank=config.markov_rank, markov_head_type=config.markov_head_type)


def adopt_eagle3_shape(run: dict[str, Any], source: str) -> None:
    """``adopt_init_shape`` for a speculators eagle3 checkpoint."""
    if run["kind"] != eagle3.KIND:
        raise SystemExit(f"--init-from {source} is an eagle3 head, but --kind is {run['kind']}")
    if run.get("draft_vocab"):
        raise SystemExit("--draft-vocab with an eagle3 --init-from: the head keeps its checkpoint's vocabulary")
    config = eagle3.config_from_dict(json.loads((Path(source) / "config.json").read_text()))
    run.update(
        layers=config.num_layers, intermediate_size=config.intermediate_size, ttt_steps=config.speculative_tokens,
        target_layers=",".join(str(i) for i in config.taps),
    )  # fmt: skip


def check_mtp_init(run: dict[str, Any], source: str) -> None:
    """``adopt_init_shape`` for an MTP head: ``self:mtp`` or a speculators mtp checkpoint, for ``--kind mtp``.
    Nothing to adopt: the head has the target's shape, and ``--ttt-steps`` says how many steps it trains for
    (speculators' ``num_speculative_steps``, whatever the checkpoint was trained with)."""
    spec = mtp.parse_spec(source)
    if run["kind"] != mtp.KIND:
        raise SystemExit(f"--init-from {source} is an mtp head, but --kind is {run['kind']}")
    if (spec is not None and spec[0] != mtp.SELF) or not mtp.is_mtp_spec(source):
        raise SystemExit(f"--init-from {source}: expected {mtp.SELF}:{mtp.KIND} or a speculators mtp checkpoint")


def check_kind_options(run: dict[str, Any]) -> None:
    """Refuse the options given (not None / False) that the run's kind does not take (``OPTION_KINDS``)."""
    for key, kinds in OPTION_KINDS.items():
        if run.get(key) not in (None, False) and run["kind"] not in kinds:
            raise SystemExit(f"--{key.replace('_', '-')} does not apply to --kind {run['kind']} "
                             f"(it is for {', '.join(kinds)})")  # fmt: skip


def resolve_defaults(run: dict[str, Any]) -> None:
    """Fill the run's unset shape options with its kind's defaults (recorded in ``run.json``). An EAGLE-3 run's
    block is its TTT steps + the anchor."""
    if run["kind"] in SEQUENTIAL_KINDS:  # chains from every position (anchors ≥ S − 1)
        defaults = {**(EAGLE3_DEFAULTS if run["kind"] == eagle3.KIND else MTP_DEFAULTS), "anchors": run["max_len"]}
    else:
        defaults = {**BLOCK_DEFAULTS, **(DSPINE_SHAPE_DEFAULTS if run["kind"] != "dspark" else {})}
    for key, value in defaults.items():
        if run.get(key) is None:
            run[key] = value
    if run["kind"] in SEQUENTIAL_KINDS:
        run["block_size"] = run["ttt_steps"] + 1


def build_drafter(target, run: dict[str, Any]):
    """The run's starting drafter: the ``--init-from`` checkpoint in float32, or a fresh one, with the run's
    draft vocabulary (``card.export_step`` rebuilds it the same way to restore a checkpoint)."""

    if run["kind"] == eagle3.KIND:
        return build_eagle3(target, run)
    if run["kind"] == mtp.KIND:
        return build_mtp(target, run)
    if run.get("init_from"):
        drafter = load_drafter(run["init_from"], target, dtype="float32")
    else:
        drafter = fresh_drafter(target, run)
    if run.get("draft_vocab"):
        drafter = with_draft_vocab(drafter, target, data_draft_vocab(run["data"], run["draft_vocab"], target.config.vocab_size))
    return drafter


def build_eagle3(target, run: dict[str, Any]) -> eagle3.Eagle3Proposer:
    """An EAGLE-3 run's starting head: the ``--init-from`` checkpoint in float32, or a fresh one
    (``init_eagle3`` with speculators' training recipe: ``EAGLE3_LAYER_TYPE``, ``EAGLE3_FLAGS``) over the run's
    taps, whose head is the target head's columns of the run's draft vocabulary (all of it by default)."""
    if run.get("init_from"):
        return eagle3.load_eagle3(run["init_from"], target, dtype="float32")
    vocab = run.get("draft_vocab")
    ids = data_draft_vocab(run["data"], vocab, target.config.vocab_size) if vocab else None
    return eagle3.init_eagle3(
        target, num_layers=run["layers"], block_size=run["block_size"], draft_ids=ids, seed=run["seed"],
        layer_ids=tuple(t + 1 for t in tapped_layers(target, run)), layer_type=EAGLE3_LAYER_TYPE,
        intermediate_size=run.get("intermediate_size"), **EAGLE3_FLAGS,
    )  # fmt: skip


def build_mtp(target, run: dict[str, Any]) -> mtp.MTPProposer:
    """An MTP run's starting head in float32, drafting ``--ttt-steps`` steps: the target checkpoint's own head
    (``--init-from self:mtp``), a speculators mtp checkpoint, or a fresh ``init_mtp`` (the target family's
    layer; a dense target has no head of its own)."""
    block, source = run["block_size"], run.get("init_from")
    if not source:
        return mtp.init_mtp(target, block_size=block, seed=run["seed"], dtype="float32")
    spec = mtp.parse_spec(source)
    own = spec is not None and spec[0] == mtp.SELF
    head = mtp.load_own_mtp(target, "float32") if own else mtp.load_mtp(source, target, "float32")
    return head.replace(config=dataclasses.replace(head.config, speculative_tokens=block - 1), max_block=block)


def save_model(model, path: Path, verifier: str | None = None) -> None:
    """Write a trained drafter in its kind's layout (EAGLE-3, MTP: speculators', ``verifier`` naming the
    target)."""
    if isinstance(model, eagle3.Eagle3Proposer):
        eagle3.save_eagle3(model, path, verifier=verifier)
    elif isinstance(model, mtp.MTPProposer):
        mtp.save_mtp(model, path, verifier=verifier)
    else:
        save_drafter(model, path)


def fresh_drafter(target, run: dict[str, Any]):
    """A new drafter of the run's shape (its layers copied from the target with ``--init-from-target``). Runs
    recorded before ``--mask-token-id`` existed used the target's pad id."""
    mask = run.get("mask_token_id")
    if mask is None:
        pad = target.config.pad_token_id
        mask = pad if pad is not None else target.config.vocab_size - 1
    options = {}
    if run["kind"] == "dspark":
        options = {"markov_rank": run.get("markov_rank"), "markov_head_type": run.get("markov_head_type")}
    drafter = init_drafter(
        target, kind=run["kind"], num_layers=run["layers"], intermediate_size=run["intermediate_size"],
        transfer_rank=run["transfer_rank"] if run["kind"] == "dspine" else None,
        message_size=run["message_size"] if run["kind"] == "dspine" else None,
        block_size=run["block_size"], seed=run["seed"], mask_token_id=mask, target_layer_ids=tapped_layers(target, run),
        **options,
    )  # fmt: skip
    return copy_target_layers(drafter, target) if run.get("init_from_target") else drafter


def tapped_layers(target, run: dict[str, Any]) -> tuple[int, ...]:
    """The run's target taps: ``--target-layers`` or z-lab's rule for its depth."""

    given = run.get("target_layers")
    if given:
        return tuple(int(x) for x in str(given).split(","))
    if run["kind"] == mtp.KIND:
        return ()  # it reads the target's final hidden state (the features' last column)
    if run["kind"] == eagle3.KIND:  # speculators' ids are HF hidden_states indices: our tap i is their i + 1
        return tuple(i - 1 for i in eagle3.init_layer_ids(target.config.num_layers))
    return tuple(build_target_layer_ids(target.config.num_layers, run["layers"]))


def _tokenizer_or_none(source: str):
    """The target's tokenizer, or None (a bare model directory): it tells which token ids are unused."""

    try:
        return load_tokenizer(source)
    except (OSError, ValueError) as e:
        print(f"no tokenizer for {source} ({type(e).__name__}); the mask token is chosen from the vocabulary alone")
        return None


def verify_block(drafter) -> int:
    """The longest verify block a trained drafter drafts for (a sequential head: its steps + the anchor)."""
    return drafter.block_limit if isinstance(drafter, eagle3.SequentialHead) else drafter.config.block_size


def make_eval_fn(target, data_dir: Path, per_domain: int, max_new_tokens: int = 32):

    held = load_heldout(data_dir)

    def eval_fn(drafter, step: int) -> dict[str, float]:
        out = {}
        for domain, records in held.items():
            prompts = [r["prompt_ids"] for r in records[:per_domain]]
            if prompts:
                res = speculative_generate(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                           verify=verify_block(drafter))  # τ of the whole block
                out[f"tau_{domain}"] = res.mean_acceptance
        return out

    return eval_fn


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("resume", "stop_at", "no_progress")}
    check_kind_options(run)

    enable_compilation_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    run_file = args.out / "run.json"
    adopt_init_shape(run)
    resolve_defaults(run)
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
    if run["mask_token_id"] is None and previous is None and run["kind"] not in SEQUENTIAL_KINDS:
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
    stats["blocks_per_step"] = args.batch_size * run["anchors"]
    stats["config"] = dataclasses.asdict(cfg)
    stats_file.write_text(json.dumps(stats, indent=2) + "\n")
    if history and history[-1]["step"] >= args.steps:
        export = drafter
        if args.export_dtype == "bfloat16":
            export = cast_drafter(drafter, jnp.bfloat16)
        save_model(export, args.out / "export", verifier=args.target)
        print(f"exported to {args.out / 'export'}")


if __name__ == "__main__":
    main()
