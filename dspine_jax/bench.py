"""Decode-speed benchmark: our jitted ``generate`` vs HF transformers' ``generate``, side by side.

    python -m dspine_jax.bench [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
                               [--max-new-tokens 64] [--repeats 3] [--draft D]
                               [--out experiments/results/bench_ar.json]

``--draft`` adds our speculative decoding as a third column (τ and its speedup over our AR).

Same weights, prompts (chat-formatted), dtype and token count (stop ids disabled on both sides so every
run decodes exactly N tokens), greedy. Each (system, dtype, prompt) is warmed up once — compilation
for us, first-call allocations for torch — then timed ``--repeats`` times; the table reports medians.
Systems alternate within each repeat, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Tell me a short story about a lighthouse keeper.",
]


def machine_info() -> dict[str, Any]:
    import os

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "python": platform.python_version(),
    }


def time_ours(target, prompt: list[int], n: int) -> float:
    from dspine_jax.generate import generate

    result = generate(target, [prompt], n, stop_ids=[])
    assert len(result.token_ids[0]) == n
    return result.seconds


def time_speculative(target, drafter, prompt: list[int], n: int) -> tuple[float, float]:
    """Seconds and mean acceptance τ of one speculative run (same tokens as ``time_ours``, greedy)."""
    from dspine_jax.speculative import speculative_generate

    result = speculative_generate(target, drafter, [prompt], n, stop_ids=[])
    assert len(result.token_ids[0]) == n
    return result.seconds, result.mean_acceptance


def time_hf(model, prompt: list[int], n: int) -> float:
    import torch

    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    seconds = time.perf_counter() - start
    assert out.shape[1] - len(prompt) == n
    return seconds


def run(model: str, dtypes: list[str], n: int, repeats: int, prompts: list[str], draft: str | None = None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from dspine_jax.generate import encode_prompt
    from dspine_jax.hub import resolve_model_dir
    from dspine_jax.target import load_target
    from dspine_jax.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(model)
    tokenizer = load_tokenizer(model_dir)
    prompt_ids = [encode_prompt(tokenizer, p, chat=bool(tokenizer.chat_template)) for p in prompts]
    rows = []
    for dtype in dtypes:
        ours = load_target(model_dir, dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype), local_files_only=True
        ).eval()
        systems = {"ours": lambda p: (time_ours(ours, p, n), None), "hf": lambda p: (time_hf(hf, p, n), None)}
        if draft:
            from dspine_jax.speculative import load_draft

            drafter = load_draft(draft, ours)
            systems["ours+draft"] = lambda p: time_speculative(ours, drafter, p, n)
        times: dict[str, list[float]] = {name: [] for name in systems}
        taus: dict[str, list[float]] = {name: [] for name in systems}
        for p in prompt_ids:
            for fn in systems.values():
                fn(p)  # warm-up
            for _ in range(repeats):
                for name, fn in systems.items():
                    seconds, tau = fn(p)
                    times[name].append(seconds)
                    if tau is not None:
                        taus[name].append(tau)
                    print(f"  {dtype} {name}: {n / seconds:.1f} tok/s" + (f" tau {tau:.2f}" if tau else ""), file=sys.stderr)
        for name, ts in times.items():
            rate = [n / t for t in ts]
            row = {"system": name, "dtype": dtype, "tokens_per_second_median": statistics.median(rate),
                   "tokens_per_second_all": rate, "seconds_median": statistics.median(ts)}
            if taus[name]:
                row["mean_acceptance_median"] = statistics.median(taus[name])
            rows.append(row)
    by = {(r["system"], r["dtype"]): r["tokens_per_second_median"] for r in rows}
    ratios = {f"{system}/hf" if system != "ours" else "ours/hf": {d: by[(system, d)] / by[("hf", d)] for d in dtypes}
              for system in {r["system"] for r in rows} - {"hf"}}
    if draft:
        ratios["ours+draft/ours"] = {d: by[("ours+draft", d)] / by[("ours", d)] for d in dtypes}
    return {"model": model, "draft": draft, "max_new_tokens": n, "repeats": repeats, "prompts": prompts,
            "prompt_lengths": [len(p) for p in prompt_ids], "machine": machine_info(), "results": rows,
            "speedups": ratios}


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['model']}: greedy, {report['max_new_tokens']} new tokens, "
          f"{len(report['prompts'])} prompts x {report['repeats']} repeats, medians (tok/s incl. prefill)")
    systems = list(dict.fromkeys(r["system"] for r in report["results"]))
    print(f"{'dtype':<10}" + "".join(f"{s:>12}" for s in systems) + "".join(f"{k:>18}" for k in report["speedups"]))
    by = {(r["system"], r["dtype"]): r for r in report["results"]}
    for dtype in dict.fromkeys(r["dtype"] for r in report["results"]):
        cells = "".join(f"{by[(s, dtype)]['tokens_per_second_median']:>12.1f}" for s in systems)
        ratios = "".join(f"{v[dtype]:>17.2f}x" for v in report["speedups"].values())
        tau = by.get(("ours+draft", dtype), {}).get("mean_acceptance_median")
        print(f"{dtype:<10}{cells}{ratios}" + (f"   tau={tau:.2f}" if tau else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspine_jax.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=Path, help="text file, one prompt per line (default: 3 built-in prompts)")
    parser.add_argument("--draft", help="drafter checkpoint (or init:dspine) for a speculative column")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/bench_ar.json"))
    args = parser.parse_args(argv)
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
        if not prompts:
            parser.exit(2, f"error: {args.prompts} has no prompts\n")
    report = run(args.model, args.dtypes.split(","), args.max_new_tokens, args.repeats, prompts, args.draft)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
