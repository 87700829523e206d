"""What Python's cyclic garbage collector costs a process's first calls, which compile their programs: each repeat
runs, in fresh processes, one ``generate`` and one ``speculative_generate`` (shipped DSpine drafter, ``auto``) of 96
tokens on a held-out code prompt, once with compiles under ``planning.collection_paused`` (as shipped) and once
without it (``unpaused``: the collector runs during tracing). Seconds inside collections come from ``gc.callbacks``;
``compile_seconds`` from the results. Medians over repeats, the two modes interleaved.

    python experiments/adaptive/compile_gc.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("unpaused", "paused")


def child(mode: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from switch_cost import heldout_prompt

    from dspine_jax.decoding import planning
    from dspine_jax.decoding.autoregressive import generate
    from dspine_jax.decoding.speculative import speculative_generate
    from dspine_jax.drafters.io import load_draft
    from dspine_jax.models.target import load_target

    if mode == "unpaused":
        planning.collection_paused = contextlib.nullcontext
    target = load_target("smollm2-135m-instruct")
    drafter = load_draft(str(ROOT / "checkpoints/smollm2-135m-dspine-b8"), target)
    prompt = heldout_prompt("smollm2-135m-instruct", "code")
    spent, began = [0.0], [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - began[0]

    gc.callbacks.append(timed)
    out = {}
    for name, call in (("ar", lambda: generate(target, [prompt], 96, stop_ids=[])),
                       ("dspine", lambda: speculative_generate(target, drafter, [prompt], 96, stop_ids=[]))):
        spent[0] = 0.0
        result = call()
        out[name] = {"gc_seconds": spent[0], "compile_seconds": result.compile_seconds}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=MODES, default=None)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            run = subprocess.run([sys.executable, __file__, "--child", mode], capture_output=True, text=True, check=True)
            rows[mode].append(json.loads(run.stdout.strip().splitlines()[-1]))
    for mode in MODES:
        for call in ("ar", "dspine"):
            gcs = [r[call]["gc_seconds"] for r in rows[mode]]
            compiles = [r[call]["compile_seconds"] for r in rows[mode]]
            print(f"{mode:8s} {call:6s} first call: collections {statistics.median(gcs):5.2f} s "
                  f"({min(gcs):.2f}–{max(gcs):.2f}), compile_seconds {statistics.median(compiles):5.2f}")


if __name__ == "__main__":
    main()
