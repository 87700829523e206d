"""Dynamic verification: measure, per batch size, the verify length that maximises expected tokens/s.

    python -m dspine_jax.tune --model M --draft D --prompts FILE --out sps.json \\
        [--batch-sizes 1,2,4,8] [--verify-lengths 2,4,8,16] [--max-new-tokens 64]

Two measurements on the same hardware and shapes as serving:

* **Acceptance** — one speculative run over the prompts at the drafter's full block records, per verify
  step, how many proposals verification accepted (``a``). A shorter verify length T checks a prefix of
  the same proposals (a causal drafter drafts the prefix itself, a bidirectional one is cut), so its
  expected tokens per step is ``τ(T) = E[min(a, T - 1)] + 1``.
* **Cost** — for every batch size b and verify length T, seconds per loop iteration (one round: draft,
  verify, accept, commit) of a timed, already-compiled run (stop ids off, so every row runs every round).

Expected throughput ``b · τ(T) / cost(b, T)``; the table keeps the best T per b. The greedy AR decode
throughput of ``generate`` at each b is recorded next to it for reference. ``speculative_generate(...,
sps_table="sps.json")`` picks the entry for the largest tabulated batch size ≤ the call's batch.

Prompts FILE: ``.jsonl`` lines with ``"ids"`` / ``"token_ids"`` (token ids, used as is) or ``"prompt"`` /
``"text"`` (tokenized), ``.json`` (a list of such objects or strings), or plain text, one prompt per line.
``--chat`` wraps text prompts in the tokenizer's chat template.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.proposers import Proposer, as_proposer
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import Target, load_target
from dspine_jax.models.tokenizer import load_tokenizer


def read_prompts(path: str | os.PathLike, tokenizer_source: str | None = None, chat: bool = False) -> list[list[int]]:
    """Prompts FILE (see the module doc) → token-id lists."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".jsonl":
        items: list[Any] = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of prompts")
    else:
        items = [line for line in text.splitlines() if line.strip()]
    tokenizer = None
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and ("ids" in item or "token_ids" in item):
            prompts.append([int(t) for t in item.get("ids", item.get("token_ids"))])
            continue
        if isinstance(item, dict):
            item = item.get("prompt", item.get("text"))
        if not isinstance(item, str):
            raise ValueError(f"{path}: prompt {i} has neither token ids nor text")
        if tokenizer is None:
            if tokenizer_source is None:
                raise ValueError(f"{path}: text prompts need the model's tokenizer")
            tokenizer = load_tokenizer(tokenizer_source)
        if chat:
            turn = [{"role": "user", "content": item}]
            text = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(item))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _batch(prompts: list[list[int]], size: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(size)]


def expected_acceptance(accepted: Sequence[int], verify_length: int) -> float:
    """τ(T) = E[min(a, T - 1)] + 1 from the accepted-proposal counts ``a`` of full-block verify steps."""
    a = np.asarray(accepted)
    return float(np.minimum(a, verify_length - 1).mean() + 1)


def tune(
    target: Target,
    drafter: Any,
    prompts: list[list[int]],
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    verify_lengths: Sequence[int] | None = None,
    max_new_tokens: int = 64,
    log=print,
) -> dict[str, Any]:
    """Measure acceptance and round cost; return the sps table (JSON-ready dict, see the module doc)."""
    proposer: Proposer = as_proposer(drafter)
    block = proposer.block_limit
    if block is None or block < 2:
        raise ValueError("tune needs a drafter with a block of at least 2 (its block bounds the verify lengths)")
    if verify_lengths is None:
        verify_lengths = sorted({t for t in (2, 3, 4, 6, 8, 12, 16, block) if t <= block})
    verify_lengths = sorted({int(t) for t in verify_lengths})
    if verify_lengths[0] < 2 or verify_lengths[-1] > block:
        raise ValueError(f"verify lengths must lie in [2, {block}] (the drafter's block), got {verify_lengths}")
    batch_sizes = sorted({int(b) for b in batch_sizes})

    # Acceptance at the full block, in batches of the largest size (stop ids on: representative text).
    accepted: list[int] = []
    size = max(batch_sizes)
    for start in range(0, len(prompts), size):
        chunk = prompts[start : start + size]
        result = speculative_generate(target, proposer, _batch(chunk, size), max_new_tokens, block_size=block)
        accepted += [a for row in result.accepted_proposals[: len(chunk)] for a in row]
    tau = {t: expected_acceptance(accepted, t) for t in verify_lengths}
    log(f"acceptance over {len(accepted)} verify steps: " + ", ".join(f"T={t}: τ={v:.2f}" for t, v in tau.items()))

    seconds: dict[int, dict[int, float]] = {}
    throughput: dict[int, dict[int, float]] = {}
    ar: dict[int, float] = {}
    best: dict[int, int] = {}
    for b in batch_sizes:
        batch = _batch(prompts, b)
        generate(target, batch, max_new_tokens, stop_ids=[])  # compile
        ar[b] = generate(target, batch, max_new_tokens, stop_ids=[]).decode_tokens_per_second
        seconds[b], throughput[b] = {}, {}
        for t in verify_lengths:
            speculative_generate(target, proposer, batch, max_new_tokens, stop_ids=[], block_size=t)  # compile
            run = speculative_generate(target, proposer, batch, max_new_tokens, stop_ids=[], block_size=t)
            seconds[b][t] = run.decode_seconds / max(run.num_iterations, 1)
            throughput[b][t] = b * tau[t] / seconds[b][t]
        best[b] = max(verify_lengths, key=lambda t: throughput[b][t])
        cells = [f"T={t}: {seconds[b][t] * 1e3:.1f} ms/round → {throughput[b][t]:.1f} tok/s" for t in verify_lengths]
        log(f"batch {b}: AR {ar[b]:.1f} tok/s; " + ", ".join(cells) + f"; best T={best[b]}")
    return {
        "verify_length": {str(b): best[b] for b in batch_sizes},
        "acceptance": {str(t): tau[t] for t in verify_lengths},
        "acceptance_steps": len(accepted),
        "round_seconds": {str(b): {str(t): s for t, s in row.items()} for b, row in seconds.items()},
        "expected_tokens_per_second": {str(b): {str(t): x for t, x in row.items()} for b, row in throughput.items()},
        "ar_tokens_per_second": {str(b): x for b, x in ar.items()},
        "drafter_block_size": block,
        "max_new_tokens": max_new_tokens,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspine_jax.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="target: HF-format directory or alias")
    parser.add_argument("--draft", required=True, help="drafter directory, init:KIND[:BLOCK] (untrained) or self:mtp")
    parser.add_argument("--prompts", required=True, help="prompts file (.jsonl / .json / text lines)")
    parser.add_argument("--out", required=True, help="where to write the sps table (JSON)")
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--verify-lengths", type=_ints, default=None, help="default: 2,3,4,6,8,12,16 up to the block")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    args = parser.parse_args(argv)

    target = load_target(args.model, dtype=args.dtype)
    drafter = load_draft(args.draft, target)
    prompts = read_prompts(args.prompts, tokenizer_source=args.model, chat=args.chat)
    table = tune(target, drafter, prompts, args.batch_sizes, args.verify_lengths, args.max_new_tokens,
                 log=lambda s: print(s, file=sys.stderr))
    table.update(model=str(args.model), draft=str(args.draft), dtype=args.dtype)
    Path(args.out).write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print(json.dumps(table["verify_length"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
