"""Per prompt, the paired ratio of a plain ``python -m dspine_jax.bench --draft D --prompts FILE`` run (the outside
prompts): the median over repeats of ``ours+draft``'s tok/s over ``ours``'s in the same repeat (the runs are stored
prompt-major, ``repeats`` per prompt).

    python experiments/adaptive/outside_cells.py experiments/adaptive/twentieth/outside_dspine.json
"""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> None:
    report = json.load(open(path))
    repeats, prompts = report["repeats"], report["prompts"]
    rates = {row["system"]: row["tokens_per_second_all"] for row in report["results"]}
    cells = []
    for i, prompt in enumerate(prompts):
        pairs = range(i * repeats, (i + 1) * repeats)
        cells.append(statistics.median(rates["ours+draft"][j] / rates["ours"][j] for j in pairs))
        print(f"{cells[-1]:.3f}  {prompt[:70]}")
    print(f"{report['draft']}: medians of rates {report['speedups']['ours+draft/ours']['float32']:.3f}×, "
          f"worst prompt {min(cells):.3f}×")


if __name__ == "__main__":
    main(sys.argv[1])
