"""One side of a before/after comparison of plain and speculative decoding across two checkouts of this package.

Runs ``generate`` and ``speculative_generate`` (a drafter, verify 4) on SmolLM2-135M-Instruct, 4 chat prompts
(batch 1: the first; batch 8: the four twice), 64 tokens, greedy, stop ids off; prints ``RESULT {json}`` with
the median tok/s of REPEATS runs (compilation excluded). Interleave the two checkouts, each run a fresh
process, e.g.::

    for r in 1 2 3; do for tree in /path/before /path/after; do
      (cd $tree && PYTHONPATH=$tree python /path/after/experiments/serving/generate_ab.py 5 \
         /path/after/checkpoints/smollm2-135m-dspine-b8 | grep RESULT); done; done

Summary of the one-decoder change: ``generate_before_after.json``.
"""
import json
import statistics
import sys

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import encode_prompt, load_tokenizer

target = load_target("smollm2-135m-instruct")
tok = load_tokenizer("smollm2-135m-instruct")
prompts = ["Write a Python function that reverses a linked list.", "Explain why the sky is blue in two sentences.",
           "List three prime numbers and explain why they are prime.", "def fibonacci(n):"]
ids = [encode_prompt(tok, p, chat=True) for p in prompts]
draft = load_draft(sys.argv[2], target)
repeats = int(sys.argv[1])
out = {}
for batch in (1, 8):
    rows = ids[:1] if batch == 1 else (ids * 2)[:8]
    systems = {"ar": lambda: generate(target, rows, 64, stop_ids=[]),
               "spec4": lambda: speculative_generate(target, draft, rows, 64, stop_ids=[], verify=4)}
    for f in systems.values():
        f()
    tps = {k: [] for k in systems}
    for _ in range(repeats):
        for k, f in systems.items():
            r = f()
            tps[k].append(r.num_tokens / r.seconds)
            out[f"{k}_b{batch}_tokens"] = r.token_ids[0][:6]
    for k in systems:
        out[f"{k}_b{batch}"] = statistics.median(tps[k])
print("RESULT " + json.dumps(out))
