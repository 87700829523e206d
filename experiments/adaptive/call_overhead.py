"""Host time of a ``speculative_generate`` call outside its timed region (wall − prefill − decode): what a user waits
for that no tokens/s shows. Interleaved calls, with ``CompileTimer``'s signature cache and with it switched off
(every program lowered again before it is found compiled). Usage:

    python experiments/adaptive/call_overhead.py [--draft checkpoints/smollm2-135m-dspine-b8] [--calls 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from dspine_jax.bench import machine_info
from dspine_jax.decoding import planning
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(ROOT / "checkpoints/smollm2-135m-dspine-b8"))
    ap.add_argument("--calls", type=int, default=8)
    args = ap.parse_args()
    target = load_target(args.model)
    drafter = load_draft(args.draft, target)
    prompt = list(range(100, 214))
    keyed = planning._signature
    modes = {"signature cache": keyed, "lower every call": lambda *_: None}
    outside: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(args.calls + 1):  # the first round compiles
        for mode in list(modes)[:: 1 if r % 2 == 0 else -1]:
            planning._signature = modes[mode]
            begin = time.perf_counter()
            result = speculative_generate(target, drafter, [prompt], 32, stop_ids=[])
            if r:
                outside[mode].append(time.perf_counter() - begin - result.seconds)
    planning._signature = keyed
    print(f"{machine_info()}; 114-token prompt, 32 tokens, {args.calls} interleaved calls each")
    for mode, seconds in outside.items():
        print(f"{mode:18s} outside the clock: median {statistics.median(seconds) * 1e3:6.1f} ms "
              f"({', '.join(f'{s * 1e3:.0f}' for s in seconds)})")


if __name__ == "__main__":
    main()
