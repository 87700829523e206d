"""Draft vocabularies (EAGLE-3's reduced drafter head): the target tokens a drafter may propose.

A 135M target's greedy answers use few of its 49,152 tokens (the 1 M-token `smollm2-v2` corpus: 11,157
distinct; the 8,192 most frequent cover 99.7 % of it), while the drafter's unary logits over the whole
vocabulary are most of its cost, in drafting and in training. A draft vocabulary of the ``size`` most
frequent response tokens keeps every weight as it is and reads only those columns of the target's head;
tokens outside it are never proposed (greedy output stays exact: the target verifies every token).

    python -m dspine_jax.train.vocab --target T --drafter DIR --data DATA --size 8192 --out DIR2

writes ``DIR``'s drafter with the vocabulary of ``DATA``'s responses (``train --draft-vocab N`` trains
with one).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dspine_jax.drafters.io import load_drafter, save_drafter, with_draft_vocab
from dspine_jax.models.target import load_target
from dspine_jax.train.data import load_sequences


def frequent_tokens(responses: list[np.ndarray] | list[list[int]], size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` most frequent token ids over ``responses`` (ties: lower id first), ascending ``[size]``.
    Fewer distinct tokens than ``size``: the rest are filled with the lowest unused ids, so the size (and a
    compiled shape) does not depend on the data."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {vocab_size}]")
    counts = np.zeros(vocab_size, np.int64)
    for ids in responses:
        ids = np.asarray(ids, np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id ascending
    return np.sort(order[:size])


def data_draft_vocab(data_dir: Path, size: int, vocab_size: int) -> np.ndarray:
    """``frequent_tokens`` over the response tokens of a training dataset directory."""
    return frequent_tokens([r["response_ids"] for r in load_sequences(Path(data_dir))], size, vocab_size)


def coverage(responses: list, ids: np.ndarray) -> float:
    """Share of the response tokens inside the vocabulary ``ids``."""
    flat = np.concatenate([np.asarray(r, np.int64) for r in responses]) if responses else np.zeros(0, np.int64)
    return float(np.isin(flat, ids).mean()) if len(flat) else 1.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target model path, alias or hub id")
    ap.add_argument("--drafter", required=True, help="drafter checkpoint directory or hub id")
    ap.add_argument("--data", type=Path, required=True, help="dataset dir whose responses give the token counts")
    ap.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = ap.parse_args(argv)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target, dtype=args.export_dtype)
    responses = [r["response_ids"] for r in load_sequences(args.data)]
    ids = frequent_tokens(responses, args.size, target.config.vocab_size)
    save_drafter(with_draft_vocab(drafter, target, ids), args.out)
    print(f"draft vocabulary of {len(ids)} tokens, covering {coverage(responses, ids):.2%} of {args.data}'s responses → {args.out}")


if __name__ == "__main__":
    main()
