"""Roofline for Qwen3-8B bf16 + a DSpine block-16 drafter: predicted tok/s of AR decoding and of DSpine
on H200, TPU v5e and TPU v6e at batch 1, 8 and 32, from the FLOPs and bytes of the programs
``python -m dspine_jax.lower`` lowers (no device, no weights), beside published anchors.

    python experiments/roofline/roofline.py                       # lowers, then writes roofline.{json,png}
    python experiments/roofline/roofline.py --lowering FILE.json  # reuse a `python -m dspine_jax.lower --json`

Model (every assumption, RESULTS.md repeats them):

* One AR token per row costs one ``ar_decode`` loop iteration; one DSpine round costs one ``round_T16``
  iteration (draft 15 proposals with the 5-layer drafter, verify 16 tokens with the target, accept,
  commit). XLA's HLO cost analysis counts a ``while`` body once, so each program's FLOPs and bytes are
  one step's (plus the few ops around the loop).
* A step takes ``max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)``: perfect overlap, peak rates
  reached, no launch or host overhead, one chip, no collectives.
* Bytes: two estimates. ``hlo`` = the cost analysis' "bytes accessed" of the *unfused* program (every
  op's operands and result, so intermediates that a fused kernel keeps on chip are counted: an upper
  bound). ``floor`` = what must cross HBM at least: every weight once per step (target + drafter, bf16)
  plus the KV cache read (and the drafter's context ring) at the stated context. The prediction uses
  the floor (the roofline's ceiling); the HLO figure is reported beside it.
* DSpine tokens per round per row = τ from the paper: 7.83 greedy, 6.98 at T = 1, the same at every
  batch size (in practice acceptance does not depend on batch, but the policy may pick shorter blocks
  at large batch: that would only help).
* Context: every row holds ``--context`` tokens (default 1,024) in its KV cache.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

HERE = Path(__file__).resolve().parent
BATCHES = (1, 8, 32)
TAU = {"greedy": 7.83, "T=1": 6.98}  # the DSpine paper's block-16 acceptance on Qwen3-8B
HARDWARE = {  # HBM bytes/s, dense bf16 FLOP/s (vendor peak figures, one chip)
    "H200": (4.8e12, 989e12),
    "TPU v5e": (819e9, 197e12),
    "TPU v6e": (1.6e12, 918e12),
}
# Published figures a reader compares with (not reproduced here; their sources are in RESULTS.md).
ANCHORS = [
    {"what": "seed: DSpine on an RTX 3090 (Qwen3.8-27B GGUF, llama.cpp)", "speedup": 3.19, "tok_s": None},
    {"what": "SGLang DFlash, Qwen3-8B, B200, concurrency 1 (tau ~ 6.35)", "speedup": None, "tok_s": 1162.0},
    {"what": "sglang-jax DSpark, Qwen3-8B, TPU v7x-8, concurrency 1", "speedup": 5.03, "tok_s": 537.0},
]
PROGRAMS = ("ar_decode", "round_T16")


def lower_qwen(context: int) -> dict:
    """The lowering report for Qwen3-8B + init:dspine-b16 at every batch size (TPU lowering; its cost)."""
    from dspine_jax import lower

    args = lower.parse_args(["--target", "qwen3-8b", "--draft", "init:dspine-b16", "--platforms", "tpu",
                             "--batch", ",".join(map(str, BATCHES)), "--programs", ",".join(PROGRAMS),
                             "--context", str(context)])
    return lower.run(args, log=lambda line: print(line, file=sys.stderr, flush=True))


@functools.lru_cache(maxsize=1)
def _model_bytes() -> tuple[int, int, object, object]:
    """(target weight bytes, drafter weight bytes, target config, drafter config) of the abstract models."""
    import jax

    from dspine_jax import lower

    target = lower.abstract_target("qwen3-8b")
    drafter = lower.abstract_drafter("init:dspine-b16", target)
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    return size(target.params), size(drafter.params), target.config, drafter.config


def floor_bytes(batch: int, context: int, program: str) -> float:
    """Bytes that must cross HBM per step: the weights once, the caches read (bf16, see module doc)."""
    weights, draft_weights, c, d = _model_bytes()
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * context * batch  # K and V, bf16
    if program == "ar_decode":
        return float(weights + kv)
    ring = 2 * d.num_layers * d.num_kv_heads * d.head_dim * 2 * context * batch
    return float(weights + kv + draft_weights + ring)


def predict(report: dict, context: int) -> dict:
    rows = {(r["program"], r["batch"]): r for r in report["rows"] if r["ok"]}
    out = {"hardware": {}, "programs": {}}
    for (program, batch), r in sorted(rows.items()):
        out["programs"][f"{program}@{batch}"] = {
            "flops": r["flops"], "hlo_bytes": r["bytes_accessed"], "floor_bytes": floor_bytes(batch, context, program)}
    for hw, (bandwidth, peak) in HARDWARE.items():
        per = {}
        for batch in BATCHES:
            ar, rnd = out["programs"].get(f"ar_decode@{batch}"), out["programs"].get(f"round_T16@{batch}")
            if ar is None or rnd is None:
                continue
            t_ar = max(ar["flops"] / peak, ar["floor_bytes"] / bandwidth)
            t_round = max(rnd["flops"] / peak, rnd["floor_bytes"] / bandwidth)
            t_ar_hlo = max(ar["flops"] / peak, ar["hlo_bytes"] / bandwidth)
            t_round_hlo = max(rnd["flops"] / peak, rnd["hlo_bytes"] / bandwidth)
            entry = {"ar_tok_s": batch / t_ar, "ar_bound": "compute" if ar["flops"] / peak > ar["floor_bytes"] / bandwidth else "memory",
                     "round_bound": "compute" if rnd["flops"] / peak > rnd["floor_bytes"] / bandwidth else "memory",
                     "round_over_ar": t_round / t_ar, "ar_tok_s_hlo_bytes": batch / t_ar_hlo}
            for name, tau in TAU.items():
                entry[f"dspine_{name}_tok_s"] = batch * tau / t_round
                entry[f"dspine_{name}_speedup"] = (batch * tau / t_round) / (batch / t_ar)
                entry[f"dspine_{name}_tok_s_hlo_bytes"] = batch * tau / t_round_hlo
            per[str(batch)] = entry
        out["hardware"][hw] = {"bandwidth": bandwidth, "peak_flops": peak, "batch": per}
    return out


def plot(pred: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(HARDWARE), figsize=(13, 4.2), sharey=True)
    for ax, (hw, data) in zip(axes, pred["hardware"].items()):
        batches = list(data["batch"])
        xs = range(len(batches))
        width = 0.27
        series = [("AR", "ar_tok_s", "#888888"), ("DSpine τ 6.98 (T=1)", "dspine_T=1_tok_s", "#6fa8dc"),
                  ("DSpine τ 7.83 (greedy)", "dspine_greedy_tok_s", "#1c4587")]
        for i, (label, key, color) in enumerate(series):
            values = [data["batch"][b][key] for b in batches]
            ax.bar([x + (i - 1) * width for x in xs], values, width, label=label, color=color)
            for x, v in zip(xs, values):
                ax.text(x + (i - 1) * width, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(list(xs), [f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_title(f"{hw} (roofline, Qwen3-8B bf16)", fontsize=9)
        if hw == "TPU v5e" or hw == "TPU v6e":
            ax.axhline(537, color="#cc4125", ls="--", lw=1)
            ax.text(-0.4, 560, "sglang-jax DSpark v7x-8, c=1: 537", fontsize=6, color="#cc4125")
        if hw == "H200":
            ax.axhline(1162, color="#cc4125", ls="--", lw=1)
            ax.text(-0.4, 1210, "SGLang DFlash B200, c=1: 1,162", fontsize=6, color="#cc4125")
    axes[0].set_ylabel("tokens/s (all rows)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Predicted, not measured: max(FLOPs/peak, HBM-floor bytes/bandwidth) per step; anchors are published figures "
                 "on other hardware", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lowering", type=Path, help="a `python -m dspine_jax.lower --json` report to reuse")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    report = json.loads(args.lowering.read_text()) if args.lowering else lower_qwen(args.context)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.lowering:
        (args.out / "lowering.json").write_text(json.dumps(report, indent=1) + "\n")
    pred = predict(report, args.context)
    pred.update({"tau": TAU, "context": args.context, "anchors": ANCHORS, "cost_source": report["cost_source"]})
    (args.out / "roofline.json").write_text(json.dumps(pred, indent=1) + "\n")
    plot(pred, args.out / "roofline.png")
    for hw, data in pred["hardware"].items():
        for b, e in data["batch"].items():
            print(f"{hw:8} B={b:>2}: AR {e['ar_tok_s']:8.0f} tok/s ({e['ar_bound']}), DSpine greedy "
                  f"{e['dspine_greedy_tok_s']:8.0f} ({e['dspine_greedy_speedup']:.2f}x), T=1 {e['dspine_T=1_tok_s']:8.0f} "
                  f"({e['dspine_T=1_speedup']:.2f}x); round/AR step {e['round_over_ar']:.2f} ({e['round_bound']})")
    return pred


if __name__ == "__main__":
    main()
