"""Decode-speed benchmark: our jitted ``generate`` vs HF transformers' ``generate``, side by side.

    python -m dspine_jax.bench [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
                               [--max-new-tokens 64] [--repeats 3] [--draft D]
                               [--out experiments/results/bench_ar.json]

``--draft`` adds our speculative decoding as a third column (τ and its speedup over our AR).

    python -m dspine_jax.bench --report [--prompts-per-domain 2] [--dflash D] [--dspine D] [--data DIR]
                               [--dtypes float32] [--out experiments/results/report.json]

``--report`` compares five systems on the held-out drafter prompts of every domain (code, math, chat,
prose): HF AR, HF prompt-lookup decoding, our AR, ours + DFlash, ours + DSpine — tokens/s, τ, speedups
and a token-for-token check against HF AR; writes ``report.json``, ``report.md`` and ``report.png``.

Same weights, prompts (chat-formatted), dtype and token count (stop ids disabled on both sides so every
run decodes exactly N tokens), greedy. Each (system, dtype, prompt) is warmed up once — compilation
for us, first-call allocations for torch — then timed ``--repeats`` times; the table reports medians.
Systems alternate within each repeat, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.decoder import parse_verify
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import load_draft
from dspine_jax.models.hub import resolve_model_dir
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import encode_prompt, load_tokenizer
from dspine_jax.train.data import default_data_dir, load_heldout
from dspine_jax.train.prompts import DOMAINS, encode_messages

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Tell me a short story about a lighthouse keeper.",
]
REPO_ROOT = Path(__file__).resolve().parents[1]


def median_seconds(f: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Median wall seconds of ``f(*args)`` (outputs ready) over ``repeats`` calls after one warm-up call
    (compilation): the timer of the profiling scripts in ``experiments/``."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_median_ms(calls: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall milliseconds of each zero-argument call (outputs ready) over ``repeats`` rounds after one
    warm-up call each, the calls interleaved within every round so machine noise hits them alike."""
    for f in calls.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, f in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux; else what ``platform`` says): timings and float32
    rounding differ between CPUs, so every result names its own."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "python": platform.python_version(),
    }


# ----------------------------------------------------------------------------------------------
# One timed decode per system: seconds, the token ids, and (speculative systems) acceptance counts


@dataclasses.dataclass
class Run:
    seconds: float
    token_ids: list[int]
    accepted: int | None = None  # output tokens produced by verify steps (bonus tokens included)
    verify_lengths: list[int] | None = None  # per verify step (speculative systems)
    steps: int | None = None  # verify steps (target forwards that checked proposals)

    @property
    def tau(self) -> float | None:
        return self.accepted / self.steps if self.steps else None


def run_ours(target, prompt: list[int], n: int) -> Run:

    result = generate(target, [prompt], n, stop_ids=[])
    assert len(result.token_ids[0]) == n
    return Run(result.seconds, result.token_ids[0])


def run_speculative(target, drafter, prompt: list[int], n: int, verify: int | str = "auto") -> Run:
    """τ = tokens per verify step; the first token is prefill's and not counted (``mean_acceptance``).
    ``verify="auto"``: the adaptive policy (its plain decode steps count as steps of τ 1)."""

    result = speculative_generate(target, drafter, [prompt], n, stop_ids=[], verify=verify)
    assert len(result.token_ids[0]) == n
    kept = result.acceptance_lengths[0]
    return Run(result.seconds, result.token_ids[0], accepted=sum(kept), steps=len(kept),
               verify_lengths=result.verify_lengths[0])


def run_hf(model, prompt: list[int], n: int, prompt_lookup: int | None = None) -> Run:
    """HF greedy ``generate``; with ``prompt_lookup`` its prompt-lookup decoding, whose τ is output tokens
    per target forward (counted with a forward hook; the prefill forward also verifies lookup candidates,
    so it counts as a step)."""
    import torch

    forwards = [0]
    hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    ids = torch.tensor([prompt])
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, **extra)
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    assert out.shape[1] - len(prompt) == n
    tokens = out[0, len(prompt):].tolist()
    return Run(seconds, tokens, accepted=n, steps=forwards[0]) if prompt_lookup else Run(seconds, tokens)


def load_hf(model_dir: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype), local_files_only=True)
    return model.eval()


def run(model: str, dtypes: list[str], n: int, repeats: int, prompts: list[str], draft: str | None = None) -> dict[str, Any]:

    model_dir = resolve_model_dir(model)
    tokenizer = load_tokenizer(model_dir)
    prompt_ids = [encode_prompt(tokenizer, p, chat=bool(tokenizer.chat_template)) for p in prompts]
    rows = []
    for dtype in dtypes:
        ours = load_target(model_dir, dtype=dtype)
        hf = load_hf(model_dir, dtype)
        systems = {"ours": lambda p: run_ours(ours, p, n), "hf": lambda p: run_hf(hf, p, n)}
        if draft:

            drafter = load_draft(draft, ours)
            systems["ours+draft"] = lambda p: run_speculative(ours, drafter, p, n)
        times: dict[str, list[float]] = {name: [] for name in systems}
        taus: dict[str, list[float]] = {name: [] for name in systems}
        for p in prompt_ids:
            for fn in systems.values():
                fn(p)  # warm-up
            for r in range(repeats):
                for name in repeat_order(list(systems), r):
                    result = systems[name](p)
                    seconds, tau = result.seconds, result.tau
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


# ----------------------------------------------------------------------------------------------
# --report: five systems on the held-out prompts of every domain

SYSTEMS = ("hf", "hf_prompt_lookup", "ours", "ours+dflash", "ours+dspine")
DEFAULT_DRAFTERS = {
    "ours+dflash": str(REPO_ROOT / "checkpoints/smollm2-135m-dflash-b8"),
    "ours+dspine": str(REPO_ROOT / "checkpoints/smollm2-135m-dspine-b8"),
}
PROMPT_LOOKUP_TOKENS = 10


@dataclasses.dataclass(frozen=True)
class ReportPrompt:
    domain: str
    source: str
    ids: list[int]


def load_heldout_prompts(model: str, data_dir: Path | None = None) -> dict[str, list[dict]]:
    """The drafter data's held-out split (``dspine_jax.train.data.load_heldout``): never trained on."""

    data = Path(data_dir) if data_dir else default_data_dir() / Path(model).name
    if not any(data.glob("prompts*.json")):
        raise FileNotFoundError(f"no held-out prompts (prompts*.json) under {data}; build them with "
                                f"`python -m dspine_jax.train.data --target {model}` or pass --data DIR")
    return load_heldout(data)


def select_prompts(held: Mapping[str, Sequence[Mapping]], per_domain: int,
                   encode: Callable[[list[dict]], list[int]] | None = None) -> list[ReportPrompt]:
    """The first ``per_domain`` records of each domain (DOMAINS order). A record's chat ``messages`` are
    encoded with ``encode`` (the acceptance study's ``encode_messages``); else its ``prompt_ids`` are used."""

    if per_domain < 1:
        raise ValueError(f"--prompts-per-domain must be >= 1, got {per_domain}")
    out = []
    for domain in [d for d in DOMAINS if d in held] + [d for d in held if d not in DOMAINS]:
        records = list(held[domain])[:per_domain]
        if len(records) < per_domain:
            print(f"warning: {domain} has only {len(records)} held-out prompts (asked for {per_domain})",
                  file=sys.stderr)
        for i, r in enumerate(records):
            ids = encode(r["messages"]) if encode and "messages" in r else list(r["prompt_ids"])
            out.append(ReportPrompt(domain, r.get("source", f"{domain}/{i}"), ids))
    if not out:
        raise ValueError("no held-out prompts in any domain")
    return out


def check_drafter(name: str, spec: str) -> None:
    """Fail early (before any model loads) on a drafter path that is not a checkpoint directory."""
    if spec.startswith("init:"):
        return
    if not (Path(spec) / "config.json").is_file():
        flag = "--" + name.split("+")[-1]
        raise FileNotFoundError(f"{flag} {spec}: not a drafter checkpoint directory (no config.json there)")


def parse_system(name: str, drafters: Mapping[str, str]) -> tuple[str, str | None, int | str]:
    """A system name → (kind, drafter spec, verify). ``hf``, ``hf_prompt_lookup``, ``ours`` and ``ours:xla`` (our
    AR with XLA's matmuls instead of the CPU panel kernel, ``models/panels.py``) draft nothing;
    ``ours+dflash`` / ``ours+dspine`` use the report's drafters, ``ours+init:dspine`` a fresh, untrained one and
    ``ours+DIR`` the drafter checkpoint in directory DIR; a suffix ``@N`` fixes the verify length, ``@auto`` (the
    default) lets the policy choose it."""
    base, _, verify = name.partition("@")
    if base in ("hf", "hf_prompt_lookup", "ours", "ours:xla"):
        if verify:
            raise ValueError(f"system {name!r}: only speculative systems (ours+…) take @verify")
        return base, None, "auto"
    if not base.startswith("ours+"):
        raise ValueError(f"unknown system {name!r}: use hf, hf_prompt_lookup, ours, ours+dflash, ours+dspine, "
                         "ours+init:dspine or ours+DIR (a drafter checkpoint), optionally with @N or @auto")
    spec = drafters.get(base, base.removeprefix("ours+"))
    if not spec.startswith("init:") and base not in drafters and not (Path(spec) / "config.json").is_file():
        raise ValueError(f"unknown drafter in system {name!r} (not ours+dflash, ours+dspine, ours+init:KIND or a checkpoint directory)")
    return base, spec, parse_verify(verify or "auto")


def make_systems(model_dir: Path, dtype: str, n: int, drafters: Mapping[str, str],
                 systems: Sequence[str] = SYSTEMS) -> dict[str, Callable[[list[int]], Run]]:

    ours = load_target(model_dir, dtype=dtype)
    hf = load_hf(model_dir, dtype) if any(s.startswith("hf") for s in systems) else None
    loaded: dict[str, Any] = {}
    out: dict[str, Callable[[list[int]], Run]] = {}
    for name in systems:
        base, spec, verify = parse_system(name, drafters)
        if base == "hf":
            out[name] = lambda p: run_hf(hf, p, n)
        elif base == "hf_prompt_lookup":
            out[name] = lambda p: run_hf(hf, p, n, prompt_lookup=PROMPT_LOOKUP_TOKENS)
        elif base == "ours":
            out[name] = lambda p: run_ours(ours, p, n)
        elif base == "ours:xla":
            xla = loaded.setdefault(base, load_target(model_dir, dtype=dtype, products="xla"))
            out[name] = lambda p, t=xla: run_ours(t, p, n)
        else:
            drafter = loaded.setdefault(spec, load_draft(spec, ours))
            out[name] = lambda p, d=drafter, v=verify: run_speculative(ours, d, p, n, verify=v)
    return out


def repeat_order(names: Sequence[str], r: int) -> list[str]:
    """The systems' order in repeat round ``r``: the start rotates, so no system always runs right after the same
    other one (a torch run's threads, say, may still spin when the next call starts)."""
    k = r % len(names)
    return [*names[k:], *names[:k]]


def measure_prompt(systems: Mapping[str, Callable[[list[int]], Run]], prompt: ReportPrompt, n: int,
                   repeats: int, label: str) -> dict[str, Any]:
    """Warm-up once per system, then ``repeats`` rounds over all systems (start rotated each round)."""
    names = list(systems)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    warm = {name: fn(prompt.ids) for name, fn in systems.items()}
    for r in range(repeats):
        for name in repeat_order(names, r):
            runs[name].append(systems[name](prompt.ids))
            tau = runs[name][-1].tau
            print(f"  {label} {prompt.source} {name}: {n / runs[name][-1].seconds:.1f} tok/s"
                  + (f" tau {tau:.2f}" if tau else ""), file=sys.stderr)
    reference = warm["hf" if "hf" in warm else "ours"].token_ids  # ours AR equals HF AR (test_smollm2)
    out = {"domain": prompt.domain, "source": prompt.source, "prompt_tokens": len(prompt.ids), "systems": {}}
    for name in names:
        rates = [n / x.seconds for x in runs[name]]
        last = runs[name][-1]
        out["systems"][name] = {
            "tokens_per_second": rates, "tokens_per_second_median": statistics.median(rates),
            "tau": last.tau, "accepted_tokens": last.accepted, "verify_steps": last.steps,
            "matches_hf": all(x.token_ids == reference for x in [warm[name], *runs[name]]),
        }
        if last.verify_lengths is not None:
            out["systems"][name]["verify_lengths"] = last.verify_lengths
    return out


def summarize(entries: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per domain and ``all``: pooled median tok/s, pooled τ (Σ accepted / Σ steps), speedups, exactness."""
    domains = list(dict.fromkeys(e["domain"] for e in entries)) + ["all"]
    summary = {}
    for domain in domains:
        chosen = [e for e in entries if domain in ("all", e["domain"])]
        rows = {}
        for name in chosen[0]["systems"]:
            cells = [e["systems"][name] for e in chosen]
            steps = sum(c["verify_steps"] or 0 for c in cells)
            rows[name] = {
                "tokens_per_second": statistics.median(r for c in cells for r in c["tokens_per_second"]),
                "tau": sum(c["accepted_tokens"] for c in cells) / steps if steps else None,
                "matches_hf": all(c["matches_hf"] for c in cells), "prompts": len(cells),
            }
        for name, row in rows.items():
            for ref in ("hf", "ours"):
                if ref in rows:
                    row[f"speedup_vs_{ref}"] = row["tokens_per_second"] / rows[ref]["tokens_per_second"]
            if "ours" in rows:  # pairs measured back to back (same prompt, same repeat round): machine drift cancels
                row["paired_speedup_vs_ours"] = statistics.median(
                    mine / ours for e in chosen
                    for mine, ours in zip(e["systems"][name]["tokens_per_second"], e["systems"]["ours"]["tokens_per_second"])
                )  # fmt: skip
        summary[domain] = rows
    return summary


def build_report(model: str, n: int, repeats: int, per_domain: int, drafters: Mapping[str, str] | None = None,
                 dtypes: Sequence[str] = ("float32",), held: Mapping[str, Sequence[Mapping]] | None = None,
                 data_dir: Path | None = None, torch_threads: int | None = None,
                 systems: Sequence[str] = SYSTEMS) -> dict[str, Any]:
    """Measure every system on every selected prompt, per dtype. ``held`` ({domain: [records]}) replaces
    the held-out data (tests); records carry chat ``messages`` or ready ``prompt_ids``. ``torch_threads``
    sets torch's intra-op threads for the HF systems (default: torch's own choice); recorded either way."""
    import torch


    drafters = {**DEFAULT_DRAFTERS, **(drafters or {})}
    if n < 1 or repeats < 1:
        raise ValueError(f"--max-new-tokens and --repeats must be >= 1, got {n} and {repeats}")
    if per_domain < 1:
        raise ValueError(f"--prompts-per-domain must be >= 1, got {per_domain}")
    if "ours" not in systems:
        raise ValueError("--systems must include ours (our AR: the speedups' reference)")
    for name in systems:
        parse_system(name, drafters)  # unknown names fail before any model loads
    for name in ("ours+dflash", "ours+dspine"):
        if any(s.partition("@")[0] == name for s in systems):
            check_drafter(name, drafters[name])
    if torch_threads is not None:
        if torch_threads < 1:
            raise ValueError(f"--torch-threads must be >= 1, got {torch_threads}")
        torch.set_num_threads(torch_threads)
    model_dir = resolve_model_dir(model)
    if held is None:
        held = load_heldout_prompts(model, data_dir)
    prompts = select_prompts(held, per_domain, encoder(model_dir, held))
    results = {}
    for dtype in dtypes:
        print(f"[{dtype}] loading {model} + drafters", file=sys.stderr)
        runners = make_systems(model_dir, dtype, n, drafters, systems)
        entries = [measure_prompt(runners, p, n, repeats, f"[{dtype} {i + 1}/{len(prompts)}]")
                   for i, p in enumerate(prompts)]
        results[dtype] = {"summary": summarize(entries), "prompts": entries}
    return {"model": model, "max_new_tokens": n, "repeats": repeats, "prompts_per_domain": per_domain,
            "greedy": True, "systems": list(systems), "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
            "drafters": {k: _shown(drafters[k]) for k in ("ours+dflash", "ours+dspine")}, "dtypes": list(dtypes),
            "machine": machine_info(), "torch": {"version": torch.__version__, "threads": torch.get_num_threads()},
            "results": results}


def _shown(spec: str) -> str:
    """A drafter path relative to the repository when it lies inside it (reports stay machine-independent)."""
    path = Path(spec).resolve()
    return str(path.relative_to(REPO_ROOT)) if not spec.startswith("init:") and path.is_relative_to(REPO_ROOT) else spec


def encoder(model_dir: Path, held: Mapping[str, Sequence[Mapping]]) -> Callable[[list[dict]], list[int]] | None:
    """``encode_messages`` with the model's tokenizer, loaded only if some record has chat messages."""
    if not any("messages" in r for rs in held.values() for r in rs):
        return None

    tokenizer = load_tokenizer(model_dir)
    return lambda messages: encode_messages(tokenizer, messages)


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _table(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], systems: list[str],
           cell: Callable[[Mapping[str, Any]], str]) -> list[str]:
    domains = list(summary)
    return (["| system | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|"]
            + [f"| {s} | " + " | ".join(cell(summary[d][s]) for d in domains) + " |" for s in systems])


def report_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# Decode speed on held-out prompts: {Path(report['model']).name}", "",
        f"Greedy, batch 1, exactly {report['max_new_tokens']} new tokens per prompt (stop ids off); "
        f"the first {report['prompts_per_domain']} held-out prompt(s) per domain; one warm-up, then "
        f"{report['repeats']} timed repeat(s) with the systems alternating. tok/s = new tokens / wall time "
        f"incl. prefill, median over prompts × repeats. HF prompt lookup: "
        f"`prompt_lookup_num_tokens={report['prompt_lookup_num_tokens']}`.", "",
        f"Machine: {m['platform']}, {m['processor']}, {m['cpu_count']} CPUs; JAX {m['jax']} ({m['jax_backend']}), "
        f"Python {m['python']}; torch {report['torch']['version']} with {report['torch']['threads']} thread(s). "
        f"Drafters: DFlash `{report['drafters']['ours+dflash']}`, "
        f"DSpine `{report['drafters']['ours+dspine']}`.", "",
    ]
    for dtype, res in report["results"].items():
        summary = res["summary"]
        systems = list(summary["all"])
        lines += [f"## {report['model']}, {dtype}", "",
                  "| system | tok/s | τ | × HF AR | × ours AR | tokens = HF AR |", "|---|---|---|---|---|---|"]
        for s in systems:
            row = summary["all"][s]
            lines.append(f"| {s} | {row['tokens_per_second']:.1f} | {_fmt(row['tau'], '.2f')} | "
                         f"{_fmt(row.get('speedup_vs_hf'), '.2f', '×')} | {row['speedup_vs_ours']:.2f}× | "
                         f"{'yes' if row['matches_hf'] else 'NO'} |")
        spec = [s for s in systems if summary["all"][s]["tau"] is not None]
        lines += ["", "tokens/s per domain", ""] + _table(summary, systems, lambda c: f"{c['tokens_per_second']:.1f}")
        lines += ["", "τ per domain", ""] + _table(summary, spec, lambda c: _fmt(c["tau"], ".2f"))
        lines += ["", "speedup per domain (× HF AR / × ours AR)", ""] + _table(
            summary, systems, lambda c: f"{_fmt(c.get('speedup_vs_hf'), '.2f', '×')} / {c['speedup_vs_ours']:.2f}×")
        lines += ["", "× ours AR, paired: median over prompts × repeats of the ratio to ours AR run on the same prompt "
                  "in the same repeat round (machine drift between rounds cancels)", ""] + _table(
            summary, systems, lambda c: f"{c['paired_speedup_vs_ours']:.2f}×")
        lines.append("")
    lines += ["τ: ours = output tokens per verify step after the prefill token (`mean_acceptance`); HF prompt "
              "lookup = new tokens / target forwards (its prefill forward also verifies lookup candidates). "
              "\"tokens = HF AR\": the system's token ids equal HF greedy AR's on every prompt (ours AR's when hf is "
              "not among the systems; the two are equal, tests/test_smollm2.py).", ""]
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(report["results"])
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(13, 4.6 * len(dtypes)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    colors = {s: f"C{i}" for i, s in enumerate(report["systems"])}
    for row, dtype in zip(axes, dtypes):
        summary = report["results"][dtype]["summary"]
        domains, systems = list(summary), list(summary["all"])
        x = np.arange(len(domains))
        top = max(summary[d][s]["tokens_per_second"] for d in domains for s in systems)
        _bars(row[0], x, domains, systems, colors, lambda d, s: summary[d][s]["tokens_per_second"],
              ".0f" if top >= 100 else ".1f")
        row[0].set_ylabel("tokens/s (median)")
        row[0].set_title(f"{Path(report['model']).name} {dtype}, {report['max_new_tokens']} new tokens: decode speed")
        spec = [s for s in systems if summary["all"][s]["tau"] is not None]
        _bars(row[1], x, domains, spec, colors, lambda d, s: summary[d][s]["tau"] or 0.0, ".2f")
        row[1].axhline(1.0, color="k", lw=0.5)
        row[1].set_ylim(0.9, None)
        row[1].set_ylabel("τ (tokens / verify step)")
        row[1].set_title("acceptance length τ")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, x, domains: list[str], systems: list[str], colors: Mapping[str, str],
          value: Callable[[str, str], float], fmt: str) -> None:
    width = 0.8 / max(len(systems), 1)
    for i, s in enumerate(systems):
        bars = ax.bar(x + i * width, [value(d, s) for d in domains], width, label=s, color=colors.get(s))
        ax.bar_label(bars, fmt=f"%{fmt}", fontsize=6)
    ax.set_xticks(x + 0.4 - width / 2, domains)
    ax.margins(y=0.12)
    ax.legend(fontsize=8, ncol=len(systems), loc="upper center", bbox_to_anchor=(0.5, -0.07), frameon=False)


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path, Path]:
    """``out`` (JSON) plus ``.md`` and ``.png`` beside it; returns the three paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    out.write_text(json.dumps(report, indent=2) + "\n")
    md.write_text(report_markdown(report))
    plot_report(report, png)
    return out, md, png


def report_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.draft or args.prompts:
        parser.exit(2, "error: --report takes --dflash/--dspine and held-out prompts, not --draft/--prompts\n")
    drafters = {"ours+dflash": args.dflash or DEFAULT_DRAFTERS["ours+dflash"],
                "ours+dspine": args.dspine or DEFAULT_DRAFTERS["ours+dspine"]}
    try:
        report = build_report(args.model, args.max_new_tokens, args.repeats, args.prompts_per_domain, drafters,
                              (args.dtypes or "float32").split(","), data_dir=args.data,
                              torch_threads=args.torch_threads,
                              systems=args.systems.split(",") if args.systems else SYSTEMS)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"error: {e}\n")
    paths = write_report(report, args.out or Path("experiments/results/report.json"))
    print(report_markdown(report))
    print("wrote " + ", ".join(map(str, paths)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspine_jax.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default=None, help="comma-separated (default float32,bfloat16; --report: float32)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=Path, help="text file, one prompt per line (default: 3 built-in prompts)")
    parser.add_argument("--draft", help="drafter checkpoint (or init:KIND, self:mtp) for a speculative column")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default experiments/results/bench_ar.json; --report: .../report.json)")
    report = parser.add_argument_group("--report: five systems on held-out prompts per domain")
    report.add_argument("--report", action="store_true")
    report.add_argument("--prompts-per-domain", type=int, default=2, help="first K held-out prompts per domain")
    report.add_argument("--dflash", help=f"DFlash drafter (default {DEFAULT_DRAFTERS['ours+dflash']})")
    report.add_argument("--dspine", help=f"DSpine drafter (default {DEFAULT_DRAFTERS['ours+dspine']})")
    report.add_argument("--data", type=Path, help="drafter data dir with prompts*.json (default: the cache's)")
    report.add_argument("--systems", help="comma-separated systems (default: " + ",".join(SYSTEMS) + "); a "
                        "speculative one takes @N (fixed verify length) or @auto (default), and ours+init:dspine "
                        "is a fresh, untrained drafter; ours:xla is our AR with XLA's matmuls instead of the CPU panel kernel; without hf, "
                        "tokens are checked against ours AR")
    report.add_argument("--torch-threads", type=int,
                        help="torch intra-op threads for the HF systems (default: torch's)")
    args = parser.parse_args(argv)
    if args.report:
        return report_main(args, parser)
    prompts = DEFAULT_PROMPTS
    if args.prompts:
        prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
        if not prompts:
            parser.exit(2, f"error: {args.prompts} has no prompts\n")
    result = run(args.model, (args.dtypes or "float32,bfloat16").split(","), args.max_new_tokens, args.repeats,
                 prompts, args.draft)
    print_table(result)
    out = args.out or Path("experiments/results/bench_ar.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
