"""Every cell of a bench report: per prompt, the median over repeats of each system's tok/s over our AR's in the
same repeat round (the report's paired ratio, per prompt instead of per domain), and each system's worst prompts.

    python experiments/adaptive/cells.py experiments/adaptive/sixteenth/report.json
"""

from __future__ import annotations

import json
import sys

from dspine_jax.bench import summarize


def main(path: str) -> None:
    prompts = json.load(open(path))["results"]["float32"]["prompts"]
    systems = [s for s in prompts[0]["systems"] if s != "ours"]
    cells: dict[str, list[tuple[float, str]]] = {s: [] for s in systems}
    for entry in prompts:
        one = summarize([entry])["all"]  # the report's own summary, of this prompt alone
        row = [f"{entry['domain'][:5]:5s}", f"{entry['source'][-26:]:26s}"]
        for s in systems:
            ratio = one[s]["paired_speedup_vs_ours"]
            cells[s].append((ratio, entry["source"]))
            row.append(f"{ratio:.3f} (tau {one[s]['tau'] or 0:.2f})")
        print(*row)
    for s in systems:
        print(s, "worst:", ", ".join(f"{r:.3f} {src}" for r, src in sorted(cells[s])[:3]))


if __name__ == "__main__":
    main(sys.argv[1])
