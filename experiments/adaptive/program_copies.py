"""Copies in the compiled decode-segment programs: every ``copy`` of more than 100 KB that XLA put into the program
of each verify length (and the peek), with the computation it sits in and the JAX operation it came from. A copy
in the ``while`` body, or in a branch of a ``lax.cond`` inside it, runs every round. Compiles only (nothing runs).

    python experiments/adaptive/program_copies.py [--draft checkpoints/smollm2-135m-dspine-b8] [--tokens 300]
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
from switch_cost import fresh  # this folder is on sys.path when run

from dspine_jax.decoding import adaptive
from dspine_jax.decoding.decoder import run_segment
from dspine_jax.decoding.proposers import as_proposer
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target

ROOT = Path(__file__).resolve().parents[2]
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "pred": 1}


def copies(hlo: str, least: int = 100_000) -> list[tuple[str, str, int, str]]:
    """(computation, shape, bytes, JAX op) of every copy of at least ``least`` bytes in an optimised HLO module."""
    out = []
    for computation in re.split(r"\n(?=\S)", hlo):
        name = computation.split(" ", 1)[0]
        for m in re.finditer(r"= (\w+)\[([0-9,]*)\]\S* copy\(\S+\)(.*)", computation):
            dtype, dims, rest = m.groups()
            size = math.prod(int(d) for d in dims.split(",") if d) * BYTES.get(dtype, 4)
            if size >= least:
                op = re.search(r'op_name="([^"]*)"', rest)
                out.append((name, f"{dtype}[{dims}]", size, op.group(1).split(")/", 1)[-1] if op else ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--tokens", type=int, default=300, help="the request's budget (sets the cache capacity)")
    args = ap.parse_args()
    target = load_target(args.model)
    proposer = as_proposer(load_draft(args.draft, target))
    lengths = adaptive.candidate_lengths(proposer.block_limit)
    policy = adaptive.make_policy(lengths, dict.fromkeys(lengths, 1.0))
    prompt = [1] + [(7 * i + 3) % 4000 + 3 for i in range(132)]
    (state, transcript), stop = fresh(target, proposer, prompt, args.tokens, max(lengths))
    for t, peek in adaptive.programs(lengths, greedy_probes=True):
        hlo = run_segment.lower(target, proposer, state, transcript, stop, jnp.int32(4), policy, verify_len=t,
                                greedy=True, peek=peek).compile().as_text()  # fmt: skip
        found = copies(hlo)
        total = sum(size for _, _, size, _ in found)
        print(f"{'peek' if peek else f'T={t}'}: {len(found)} copies, {total / 1e6:.2f} MB")
        for (shape, op), n in Counter((shape, op) for _, shape, _, op in found).most_common():
            print(f"    {n:3d} × {shape} ({op})")


if __name__ == "__main__":
    main()
