"""A process's first call against its second: what the first run of each program adds to the timings a user
sees (prefill, decode) and to ``compile_seconds``. Each repeat is a fresh process (the compiled programs come
from the persistent compilation cache after the first), running the same request twice.

    python experiments/adaptive/first_call.py [--repeats 5] [--draft checkpoints/smollm2-135m-dspine-b8]

Prints, per system, the medians over the processes of the first and the second call, and the first/second ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Write a Python function that merges two sorted lists into one sorted list, then explain it briefly."

CHILD = """
import json, sys
from dspine_jax.decoding.planning import enable_compilation_cache
enable_compilation_cache()
from dspine_jax import generate, load_target, speculative_generate
from dspine_jax.drafters.io import load_drafter
from dspine_jax.models.tokenizer import encode_prompt, load_tokenizer
model, draft, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = load_target(model)
ids = encode_prompt(load_tokenizer(model), sys.argv[4], chat=True)
run = (lambda: generate(target, [ids], n, stop_ids=[])) if draft == "-" else (
    lambda d=load_drafter(draft, target): speculative_generate(target, d, [ids], n, stop_ids=[]))
calls = [run() for _ in range(2)]
print(json.dumps([{"prefill": r.prefill_seconds, "decode": r.decode_seconds, "compile": r.compile_seconds}
                  for r in calls]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    samples: dict[str, list] = {"AR": [], "DSpine auto": []}
    for i in range(args.repeats + 1):  # the first processes may compile (persistent cache cold): dropped
        for name, draft in (("AR", "-"), ("DSpine auto", args.draft)):
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, draft, str(args.max_new_tokens), PROMPT],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            if i:
                samples[name].append(json.loads(out.strip().splitlines()[-1]))
    for name, runs in samples.items():
        row = []
        for key in ("prefill", "decode", "compile"):
            first = statistics.median(r[0][key] for r in runs) * 1e3
            second = statistics.median(r[1][key] for r in runs) * 1e3
            row.append(f"{key} {first:.0f} / {second:.0f} ms" + (f" ({first / second:.2f}×)" if key != "compile" else ""))
        print(f"{name:12s} first / second call: " + ", ".join(row))


if __name__ == "__main__":
    main()
