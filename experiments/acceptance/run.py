"""Acceptance-length study: τ per domain on held-out prompts, greedy and temperature 1, for the shipped
DFlash, DFlash2 and DSpine SmolLM2 drafters and two DSpine ablations, plus end-to-end speed against our AR decode.

    python experiments/acceptance/run.py [--data DIR] [--max-new-tokens 64] [--out experiments/acceptance]

Variants (all inference-time switches on the same trained weights — nothing is retrained):

* ``dflash``        the DFlash drafter (bidirectional block, independent per-slot decode over V);
* ``dflash2``       the DFlash2 drafter (dynamic causal convolutions + candidate-selector walk), when given;
* ``dflash2-no-sel`` the DFlash2 forward with proposals straight from its unary logits (no selector);
* ``dspine``        the DSpine drafter (injection + last-write refinement + transition-table walk);
* ``dspine-no-lwr`` same forward (injection on), proposals straight from the unary logits (top-K,
                    independent per slot): no last-write refinement / transition walk;
* ``dspine-no-inj`` injection switched off in every layer and no LWR: the causal backbone alone. The
                    backbone was trained *with* injection, so this under-states a DSpine trained
                    without it (the paper's ablation retrains); it shows what the injection carries.

At temperature 1 every variant reports its exact draft distribution ``q`` (over its candidates), so
verification stays lossless; at temperature 0 greedy output equals AR output token for token (checked).
Writes ``results.json``, ``RESULTS.md`` (table) and ``tau.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flax import struct  # noqa: E402

from dspine_jax.decoding.autoregressive import generate  # noqa: E402
from dspine_jax.decoding.planning import enable_compilation_cache
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters import drafter as D  # noqa: E402
from dspine_jax.drafters.io import load_drafter  # noqa: E402
from dspine_jax.drafters.proposer import DrafterProposer  # noqa: E402
from dspine_jax.models.target import load_target  # noqa: E402
from dspine_jax.train.data import default_data_dir, load_heldout  # noqa: E402
from dspine_jax.train.prompts import DOMAINS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@struct.dataclass
class AblatedProposer(DrafterProposer):
    """A DSpine drafter decoded without LWR (``inject=True``) or without any injection (``inject=False``),
    or a DFlash2 drafter without its selector: unary top-K logits, each slot chosen independently (greedy
    argmax / sample from the softmax over the K candidates, which is the reported ``q``)."""

    inject: bool = struct.field(pytree_node=False, default=True)

    def propose(self, target, state, anchor, counts, keys, sampling, num):
        drafter = self.drafter
        if num + 1 < drafter.config.block_size:
            drafter = drafter.replace(config=dataclasses.replace(drafter.config, block_size=num + 1))
        fwd = D.forward(drafter, target, state.ring, D.block_tokens(drafter, anchor), inject=self.inject)
        unary = drafter.replace(config=dataclasses.replace(drafter.config, kind="dflash"))
        out = D.decode(unary, target, fwd, anchor, keys, sampling)
        return D.DraftOutput(tokens=out.tokens[:, :num], cand_ids=out.cand_ids[:, :num], q=out.q[:, :num])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, default=ROOT / "experiments/data/smollm2-v2")
    ap.add_argument("--dspine", type=Path, default=ROOT / "checkpoints/smollm2-135m-dspine-b8")
    ap.add_argument("--dflash", type=Path, default=ROOT / "checkpoints/smollm2-135m-dflash-b8")
    ap.add_argument("--dflash2", type=Path, default=ROOT / "checkpoints/smollm2-135m-dflash2-b8",
                    help="DFlash2 drafter (its variants are skipped when the directory does not exist)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per domain")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--variants", default="dflash,dflash2,dflash2-no-sel,dspine,dspine-no-lwr,dspine-no-inj")
    ap.add_argument("--timing", action="store_true", help="second greedy run of AR / dflash / dspine for speed")
    ap.add_argument("--outside", type=int, default=0,
                    help="also τ (greedy, DFlash and DSpine) on N prompts per domain drawn outside the repository (outside.py)")
    ap.add_argument("--curve", type=Path, action="append", default=[],
                    help="training run dir(s) whose periodic held-out τ (metrics.jsonl) is plotted as a learning curve")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    enable_compilation_cache()

    target = load_target(args.target)
    data = args.data or default_data_dir() / Path(args.target).name
    held = load_heldout(data)
    dspine = load_drafter(args.dspine, target)
    dflash = load_drafter(args.dflash, target)
    if dspine.config.block_size != dflash.config.block_size:
        raise SystemExit("the DSpine and DFlash drafters must share a block size (τ is measured over the whole block)")
    block = dspine.config.block_size
    proposers = {
        "dflash": dflash,
        "dspine": dspine,
        "dspine-no-lwr": AblatedProposer(drafter=dspine, inject=True),
        "dspine-no-inj": AblatedProposer(drafter=dspine, inject=False),
    }
    variants = args.variants.split(",")
    if (args.dflash2 / "config.json").exists():
        dflash2 = load_drafter(args.dflash2, target)
        if dflash2.config.block_size != block:
            raise SystemExit("the DFlash2 drafter must share the others' block size (τ is measured over the whole block)")
        proposers.update({"dflash2": dflash2, "dflash2-no-sel": AblatedProposer(drafter=dflash2)})
    else:
        print(f"no DFlash2 drafter at {args.dflash2}: its variants are skipped", flush=True)
        variants = [v for v in variants if v in proposers]
    temps = [float(t) for t in args.temperatures.split(",")]
    # One batch holds every domain's prompts (one compilation per variant and temperature); τ per domain
    # is then computed from the per-row acceptance lengths.
    prompts, row_domain = [], []
    for domain in DOMAINS:
        for r in held.get(domain, [])[: args.prompts]:
            prompts.append(r["prompt_ids"])
            row_domain.append(domain)
    domains = [d for d in DOMAINS if d in row_domain]
    results: dict = {"max_new_tokens": args.max_new_tokens, "block": block, "tau": {}, "speed": {}, "greedy_exact": {},
                     "prompts": {d: row_domain.count(d) for d in domains}, "batch": len(prompts)}

    t0 = time.perf_counter()
    ar = generate(target, prompts, max_new_tokens=args.max_new_tokens)
    print(f"AR batch {len(prompts)}: {time.perf_counter() - t0:.1f}s", flush=True)
    for temp in temps:
        for name in variants:
            t0 = time.perf_counter()
            res = speculative_generate(target, proposers[name], prompts, args.max_new_tokens, temperature=temp, seed=0,
                                       verify=block)  # τ of the whole block (auto would mix in plain steps)
            tau = results["tau"][f"{name}@T{temp:g}"] = tau_per_domain(res, row_domain, domains)
            if temp == 0:
                results["greedy_exact"][name] = res.token_ids == ar.token_ids
            print(f"T={temp:g} {name:14s} " + " ".join(f"{d}={v:.2f}" for d, v in tau.items())
                  + f" ({time.perf_counter() - t0:.1f}s)", flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if args.timing:  # second runs: everything is compiled now
        ar = generate(target, prompts, max_new_tokens=args.max_new_tokens)
        speed = {"ar": ar.decode_tokens_per_second}
        for name in ("dflash", "dspine"):
            speed[name] = speculative_generate(
                target, proposers[name], prompts, args.max_new_tokens, verify=block).decode_tokens_per_second
        results["speed"]["all (batch %d)" % len(prompts)] = speed
        print({k: round(v, 1) for k, v in speed.items()}, flush=True)
    if args.outside:
        from outside import outside_prompts

        from dspine_jax.models.tokenizer import load_tokenizer

        outside = outside_prompts(load_tokenizer(args.target), data, default_data_dir(), args.outside)
        o_prompts = [r["prompt_ids"] for d in domains for r in outside[d]]
        o_domain = [d for d in domains for _ in outside[d]]
        results["outside_prompts"] = {d: [r["source"] for r in outside[d]] for d in domains}
        for name in [v for v in ("dflash", "dflash2", "dspine") if v in proposers]:
            res = speculative_generate(target, proposers[name], o_prompts, args.max_new_tokens, verify=block)
            results.setdefault("tau_outside", {})[f"{name}@T0"] = tau_per_domain(res, o_domain, domains)
            print("outside", name, results["tau_outside"][f"{name}@T0"], flush=True)
    results["curves"] = {str(run): learning_curve(run) for run in args.curve}
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(results, args.out)


def tau_per_domain(res, row_domain: list[str], domains: list[str]) -> dict[str, float]:
    """Tokens per verify step per domain and over all rows, from the per-row acceptance lengths."""
    out = {}
    for d in domains + ["all"]:
        rows = [i for i, rd in enumerate(row_domain) if d in ("all", rd)]
        steps = sum(len(res.acceptance_lengths[i]) for i in rows)
        out[d] = sum(sum(res.acceptance_lengths[i]) for i in rows) / max(steps, 1)
    return out


def learning_curve(run: Path) -> list[dict]:
    """(step, response tokens supervised so far, τ per domain) at every periodic evaluation of a run."""
    config = json.loads((run / "run.json").read_text())
    per_step = config["batch_size"] * config["anchors"] * (config["block_size"] - 1)
    points = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        taus = {k[4:]: v for k, v in m.items() if k.startswith("tau_")}
        if taus:
            points.append({"step": m["step"], "slot_tokens_seen": m["step"] * per_step, "tau": taus})
    return points


def write_report(results: dict, out: Path) -> None:
    domains = [d for d in DOMAINS if d in results["prompts"]] + ["all"]
    lines = ["| variant | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
    for name, row in results["tau"].items():
        vals = [row.get(d, float("nan")) for d in domains]
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    table = "\n".join(lines)
    speed = ""
    if results["speed"]:
        s_lines = ["| prompts | AR tok/s | DFlash tok/s | DSpine tok/s | DSpine speedup |", "|---|---|---|---|---|"]
        for d, sp in results["speed"].items():
            s_lines.append(f"| {d} | {sp['ar']:.1f} | {sp['dflash']:.1f} | {sp['dspine']:.1f} | {sp['dspine'] / sp['ar']:.2f}× |")
        speed = "\n".join(s_lines)
    outside = ""
    if results.get("tau_outside"):
        o_lines = ["| variant (outside prompts) | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
        for name, row in results["tau_outside"].items():
            o_lines.append(f"| {name} | " + " | ".join(f"{row.get(d, float('nan')):.2f}" for d in domains) + " |")
        outside = "\n".join(o_lines)
    curve = ""
    for run, points in results.get("curves", {}).items():
        c_lines = [f"Learning curve of `{Path(run).name}` (periodic held-out τ, greedy, the run's eval prompts):", "",
                   "| step | slot tokens seen | " + " | ".join(points[0]["tau"]) + " |" if points else "",
                   "|---|---|" + "---|" * (len(points[0]["tau"]) if points else 0)]  # fmt: skip
        for p in points:
            c_lines.append(f"| {p['step']} | {p['slot_tokens_seen']} | " + " | ".join(f"{v:.2f}" for v in p["tau"].values()) + " |")
        curve += "\n".join(c_lines) + "\n\n"
    (out / "table.md").write_text(table + "\n\n" + speed + "\n\n" + outside + "\n\n" + curve)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        names = list(results["tau"])
        x = np.arange(len(domains))  # noqa: F841
        width = 0.8 / max(len(names), 1)
        fig, ax = plt.subplots(figsize=(9, 4.8))
        for i, name in enumerate(names):
            ax.bar(x + i * width, [results["tau"][name].get(d, 0) for d in domains], width, label=name)
        ax.set_xticks(x + 0.4 - width / 2, domains)
        ax.set_ylabel("acceptance length τ (tokens / verify step)")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
        ax.set_ylim(0.9, None)
        ax.set_title(f"SmolLM2-135M-Instruct, held-out prompts, block {results.get('block', 8)}")
        fig.tight_layout()
        fig.savefig(out / "tau.png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
