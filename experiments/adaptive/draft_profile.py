"""Where a drafting round's time goes on this device: each piece of DSpine drafting (block forward, unary
logits over the vocabulary, top-k, transition table, walk, context append) timed alone, next to the
target's verify forward at T = 1, 2, 4, 8 (SmolLM2, batch 1, a 200-token context). The weights are arguments of
every timed program, as in the package's own programs (closed over, XLA would compile them in as constants).

    python experiments/adaptive/draft_profile.py [--draft checkpoints/smollm2-135m-dspine-b8] [--products xla|auto]

``--products xla`` times XLA's matmuls, ``auto`` (default) the CPU panel kernel where it applies (``panels.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from dspine_jax.bench import median_seconds
from dspine_jax.decoding import speculative as spec
from dspine_jax.decoding.proposers import as_proposer
from dspine_jax.drafters import drafter as dr
from dspine_jax.drafters.io import load_draft
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling

ROOT = Path(__file__).resolve().parents[2]


def timed(f, *args, repeats: int = 30) -> float:
    """Median milliseconds of ``f(*args)`` (``bench.median_seconds``)."""
    return median_seconds(f, *args, repeats=repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--products", default="auto", choices=("auto", "xla"))
    args = ap.parse_args()
    target = tgt.load_target(args.model, products=args.products)
    drafter = load_draft(args.draft, target)
    proposer = as_proposer(drafter)
    n = args.context
    tokens = jnp.asarray([list(range(100, 100 + n))], jnp.int32)
    cache, state, first = spec.prefill(target, proposer, tokens, jnp.asarray([n], jnp.int32), jax.random.key(0),
                                       jnp.float32(1.0), jnp.float32(1.0), capacity=n + 64, top_k=0, greedy=True)
    anchor = first
    keys = jax.random.split(jax.random.key(1), 1)
    sampling = Sampling.rows(1)
    rows = {}

    @jax.jit
    def verify(target, cache, block):
        fwd = tgt.forward(target, cache, block, proposer.taps)
        return tgt.lm_logits(target, fwd.hidden).argmax(-1)

    for t in (1, 2, 4, 8):
        rows[f"target verify T={t} (+ logits, argmax)"] = timed(verify, target, cache, jnp.zeros((1, t), jnp.int32))
    p = drafter.config.block_size
    block = dr.block_tokens(drafter, anchor)
    fwd_fn = jax.jit(lambda d, t, c, b: dr.forward(d, t, c, b))
    rows[f"drafter block forward ({p} positions)"] = timed(fwd_fn, drafter, target, state.ring, block)
    fwd = fwd_fn(drafter, target, state.ring, block)
    logits_fn = jax.jit(lambda d, t, h: dr.unary_logits(d, t, h))
    rows[f"unary logits [{p - 1}, {drafter.config.draft_vocab_size or target.config.vocab_size}]"] = timed(
        logits_fn, drafter, target, fwd.hidden[:, 1:])
    logits = logits_fn(drafter, target, fwd.hidden[:, 1:])
    rows[f"top-{drafter.config.top_k} of those"] = timed(jax.jit(lambda l: dr.top_candidates(l, drafter.config.top_k)), logits)
    kind = drafter.kind
    cands = jax.jit(lambda f, a: kind.candidates(drafter, target, f, a))(fwd, anchor)
    cand_ids = dr.vocab_ids(drafter, dr.top_candidates(logits, drafter.config.top_k)[1])
    rows["transition table"] = timed(jax.jit(lambda d, t, pre, ids, a: kind.transition_table(d, t, pre, ids, a)),
                                     drafter, target, fwd.pre_injection[:, 1:], cand_ids, anchor)
    rows["walk"] = timed(jax.jit(lambda c, k: kind.select(c, dr.slot_keys(k, c.cand_ids.shape[1]),
                                                          lambda s, kk: dr.choose(s, kk, sampling.temperature))), cands, keys)
    for num in (1, 3, 7):
        rows[f"whole draft, {num} proposals"] = timed(
            jax.jit(lambda pr, t, s, a, k: pr.propose(t, s, a, jnp.ones((1,), jnp.int32), k, sampling, num)),
            proposer, target, state, anchor, keys)
    tapped = jnp.zeros((len(proposer.taps), 1, 8, target.config.hidden_size), jnp.float32)
    rows["context append (8 tokens: commit + flush)"] = timed(
        jax.jit(lambda pr, t, s, x: pr.flush(t, pr.commit(t, s, None, x, jnp.asarray([8])))), proposer, target, state, tapped)
    for t, num in ((2, 1), (4, 3), (8, 7)):  # what a drafted round adds up to (its pieces timed apart)
        rows[f"drafted round T={t} (verify + {num} proposals)"] = (
            rows[f"target verify T={t} (+ logits, argmax)"] + rows[f"whole draft, {num} proposals"])
    base = rows["target verify T=1 (+ logits, argmax)"]
    print(f"{jax.devices()[0].device_kind}; products {args.products}; context {n}; ms (median of 30) and × a plain step")
    for name, ms in rows.items():
        print(f"{name:44s} {ms:8.2f} ms  {ms / base:5.2f}×")


if __name__ == "__main__":
    main()
