"""Serving-engine ceiling with a controlled acceptance length (no HTTP, SmolLM2, greedy).

The untrained drafter never gets a proposal accepted (τ = 1), so the HTTP load test cannot show what
the engine does with a good drafter. Here the real drafter still runs every round (its cost is paid),
but its proposals are replaced by the reference continuation, wrong at slot ``a`` of every round, so
each round commits ``min(a + 1, T)`` tokens. Requests join and leave slots exactly as in the server
(``EngineCore``); output is asserted equal to ``generate``'s.

    python experiments/serving/engine_ceiling.py --concurrency 1 2 4 8 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from engine_vs_generate import run_engine  # experiments/serving/ (this script's directory is on sys.path)
from flax import struct
from jax.experimental import io_callback
from load import FALLBACK_PROMPTS

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.drafters.drafter import DraftOutput
from dspine_jax.drafters.io import load_draft
from dspine_jax.drafters.proposer import DrafterProposer
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.serve.engine import EngineCore

PROMPTS = FALLBACK_PROMPTS  # the HTTP load test's built-in prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--configs", nargs="+", default=["ar", "T8a3", "T8a7"],
                    help="ar, or TxAy: verify length x, y correct proposals per round")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).with_name("engine_ceiling.json")))
    args = ap.parse_args()

    target = load_target("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=False) for p in PROMPTS]
    prompts = [tok.encode(p, add_special_tokens=False) for p in prompts]
    n_new = args.new_tokens
    refs = [generate(target, [p], n_new, stop_ids=[]).token_ids[0] for p in prompts]
    width = max(len(p) for p in prompts) + n_new + 64
    seqs = np.zeros((len(prompts), width), np.int32)
    for i, (p, r) in enumerate(zip(prompts, refs)):
        seqs[i, : len(p) + len(r)] = p + r
    seqs_dev = jnp.asarray(seqs)
    mapping = np.zeros(args.slots, np.int32)
    @struct.dataclass
    class Oracle(DrafterProposer):
        """Pays the real draft cost, then proposes the reference continuation, wrong at slot ``a`` (static:
        each ``a`` compiles its own step)."""

        a: int = struct.field(pytree_node=False, default=0)

        def propose(self, target, cache, anchor, counts, keys, sampling, num):
            out = super().propose(target, cache, anchor, counts, keys, sampling, num)
            rows = io_callback(lambda: mapping.copy(), jax.ShapeDtypeStruct((args.slots,), jnp.int32))
            rows = rows[: cache.lengths.shape[0]]
            pos = cache.lengths[:, None] + 1 + jnp.arange(num)[None, :]
            tokens = jnp.take_along_axis(seqs_dev[rows], jnp.clip(pos, 0, width - 1), axis=1)
            wrong = jnp.arange(num)[None, :] == self.a
            tokens = jnp.where(wrong, (tokens + 1) % target.config.vocab_size, tokens).astype(jnp.int32)
            return DraftOutput(tokens=tokens, cand_ids=out.cand_ids, q=out.q)

    drafter = load_draft("init:dspine", target)
    records = []
    for config in args.configs:
        if config == "ar":
            core = EngineCore(target, None, num_slots=args.slots, context_length=args.context_length, stop_ids=[])
        else:
            t, a = (int(x) for x in config[1:].split("a"))
            core = EngineCore(target, drafter, num_slots=args.slots, context_length=args.context_length,
                              verify_len=t, stop_ids=[], proposer=Oracle(drafter, a=a))
        for c in args.concurrency:
            # Warm-up (compile) pass on the same shapes, then the timed pass.
            for s in range(c):
                mapping[s] = s % len(prompts)
            batch = [prompts[s % len(prompts)] for s in range(c)]
            for timed in (False, True):
                seconds, outs, steps, taus = run_engine(core, batch, n_new)
                for s in range(c):
                    assert outs[s] == refs[s % len(prompts)], (config, c, s)
            tokens = sum(len(v) - 1 for v in outs)
            rec = dict(config=config, concurrency=c, steps=steps, tau=round(float(np.mean(taus)), 2),
                       ms_per_step=round(1000 * seconds / steps, 1), decode_tok_per_s=round(tokens / seconds, 2))
            records.append(rec)
            print(json.dumps(rec), flush=True)
            pathlib.Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
