"""The one script to run when a GPU or TPU is lent: everything the CPU could not show, into one JSON.

    python experiments/device_check.py --out device_check.json          # on the accelerator (≤ ~8 min, H200)
    python experiments/device_check.py --tiny --out /tmp/check.json     # CPU dry run (CI): tiny models, interpret

Sections (each timed, each failure recorded in the JSON rather than raised, exit 1 if any check failed):

1. ``environment`` — JAX version, platform, device kind, what the kernel dispatcher picks.
2. ``kernels`` — both Pallas kernels (draft attention, the DSpine transition table) **compiled** for the
   device (the dispatcher's ``pallas`` mode: Mosaic on TPU, Triton on GPU; ``--tiny``: interpret mode) vs
   their XLA references at the SmolLM2 drafter's and the Qwen3-8B drafter's shapes, f32 and bf16: max
   relative error, NaN-poisoned output check, kernel vs reference time. Reuses
   ``experiments/kernels/bench.py`` and ``gpu_check.py`` (same tolerances).
3. ``decode`` — SmolLM2-135M-Instruct, AR and speculative with the shipped drafter
   ``checkpoints/smollm2-135m-dspine-b8`` (``--verify auto`` and the full block), f32 and bf16: tok/s
   (compilation excluded), τ, and greedy speculative == AR token for token.
4. ``verify_cost`` — seconds per round at each verify length the adaptive policy can pick (1 = a plain AR
   step), from fixed-length decodes: the device's cost model, for ``experiments/roofline``.
5. ``training`` — a few steps of the GPU recipe (``experiments/train_gpu.py``'s train stage) on a slice
   of the committed corpus: steps/s and that the loss is finite.

The device machine cannot reach PyPI or the hub: carry SmolLM2's dequantised weights (``~/.cache/dspine_jax``,
or point ``DSPINE_JAX_CACHE`` at a carried copy) with the tree. ``--tiny`` needs neither: a tiny random
Llama with SmolLM2's vocabulary (written with transformers, so torch is needed there) and a fresh drafter.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments" / "kernels"))
sys.path.insert(0, str(REPO / "experiments"))

import bench as kernel_bench
import gpu_check
import jax
import numpy as np
from common import SHAPES, Shape, env_line
from dspine_jax.pallas import dispatch

from dspine_jax.decoding import adaptive
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import init_drafter, load_drafter
from dspine_jax.models import weights
from dspine_jax.models.target import load_target

SHIPPED_DRAFTER = REPO / "checkpoints" / "smollm2-135m-dspine-b8"
COMMITTED_CORPUS = REPO / "experiments" / "data" / "smollm2-v2"
# The Qwen3-8B DSpine drafter's kernel shapes: block 16, Qwen3-8B attention (32 heads / 8 KV heads of 128),
# a 2,048-token context ring, width 4,096, 16 candidates, SpecForge's transfer rank / message 1024 / 512.
QWEN3_8B_DRAFTER = Shape("qwen3-8b", 4, 16, 32, 8, 128, 2047, 2048, 4096, 16, 1024, 512)
TINY_SHAPE = Shape("tiny", 2, 4, 4, 2, 32, 63, 64, 64, 4, 32, 16)
TINY_LLAMA = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 2, "tie_word_embeddings": True}


def section(report: dict, name: str):
    """Run a section; its result or its error lands in ``report[name]`` with its seconds."""
    def wrap(fn):
        begin = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001  (a failed section is a result; the others still run)
            report[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400],
                            "traceback": traceback.format_exc()[-2000:], "ok": False}
        report[name]["seconds"] = round(time.perf_counter() - begin, 2)
        print(f"[device_check] {name}: {'ok' if report[name].get('ok') else 'FAILED'} "
              f"({report[name]['seconds']} s)", file=sys.stderr, flush=True)
        return fn
    return wrap


def environment(tiny: bool) -> dict:
    dev = jax.devices()[0]
    auto = dispatch.resolve("auto")[0]
    return {"ok": True, "jax": jax.__version__, "platform": dev.platform, "device_kind": getattr(dev, "device_kind", "?"),
            "devices": len(jax.devices()), "env": env_line(), "triton_available": dispatch.triton_available(),
            "dispatcher_auto": auto.name, "tiny": tiny}


def kernels(tiny: bool, iters: int) -> dict:
    """Both kernels compiled (interpreted under --tiny) vs their references (``kernels/bench.py``)."""
    backend, why = dispatch.resolve("interpret" if tiny else "pallas")
    plan = ([(TINY_SHAPE, "float32"), (TINY_SHAPE, "bfloat16")] if tiny else
            [(SHAPES["smollm2"], "float32"), (SHAPES["smollm2"], "bfloat16"), (QWEN3_8B_DRAFTER, "bfloat16")])
    rows = []
    for kernel in ("draft_attention", "transition_cache"):
        for shape, dtype_name in plan:
            dtype = kernel_bench.DTYPES[dtype_name]
            with jax.default_matmul_precision("highest" if dtype_name == "float32" else "default"):
                row = kernel_bench.run(kernel, shape, dtype, backend, iters)
                if "error" not in row:
                    try:
                        row["poison_ok"] = gpu_check.poisoned_output_finite(kernel, shape, dtype, backend)
                    except Exception as e:  # noqa: BLE001
                        row["poison_ok"], row["poison_err"] = False, str(e).splitlines()[0][:160]
            row["ok"] = "error" not in row and row["rel_err"] <= gpu_check.TOL[dtype_name] and row["poison_ok"]
            if "error" not in row:
                row["speedup_vs_xla"] = row["ref_ms"] / row["kernel_ms"]
            rows.append(row)
    return {"ok": all(r["ok"] for r in rows), "backend": backend.name, "flavor": backend.flavor, "why": why,
            "compiled": not backend.interpret, "rows": rows}


def tiny_target_dir(root: Path) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary (so the committed corpus' token ids fit), weights named
    as transformers names them (``lower.meta_specs``), random values."""
    from dspine_jax.lower import meta_specs

    out = root / "tiny-llama"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {name: (rng.standard_normal(s.shape) * (0.05 if len(s.shape) == 2 else 0.1) + (len(s.shape) == 1))
               .astype(np.float32) for name, s in meta_specs(TINY_LLAMA).items()}
    tensors.pop("lm_head.weight", None)  # tied
    weights.save_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]}))
    return out


def prompts_for(target_name: str, tiny: bool, n: int) -> list[list[int]]:
    if tiny:
        rng = np.random.default_rng(1)
        return [rng.integers(3, 49152, size=int(k)).tolist() for k in rng.integers(8, 24, size=n)]
    from dspine_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer(target_name)
    texts = ["Write a Python function that reverses a string.", "What is 17 * 23? Explain step by step.",
             "Write a short poem about the sea.", "def fibonacci(n):"][:n]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
            for t in texts]


# --tiny: a fixed cost model instead of measuring one (the calibration alone would take a minute of CPU).
TINY_COSTS = {1: 1.0, 2: 1.3, 4: 1.6}


def decode(target_name: str, drafter_spec: str, tiny: bool, max_new_tokens: int) -> dict:
    """AR and speculative tok/s, τ and greedy equality, in f32 and bf16 (``--verify auto`` calibrates its
    cost model on the device first, once per model, drafter and batch: ``calibration_s``)."""
    prompts = prompts_for(target_name, tiny, 2 if tiny else 4)
    out: dict = {"ok": True, "target": target_name, "drafter": drafter_spec, "prompts": len(prompts)}
    for dtype in ("float32", "bfloat16"):
        target = load_target(target_name, dtype)
        drafter = (init_drafter(target, "dspine", num_layers=1, block_size=4) if drafter_spec.startswith("init:")
                   else load_drafter(drafter_spec, target))
        ar = generate(target, prompts, max_new_tokens, stop_ids=[])
        entry = {"ar_tok_s": ar.tokens_per_second, "ar_compile_s": ar.compile_seconds}
        for verify in ("auto", drafter.config.block_size):
            spec = speculative_generate(target, drafter, prompts, max_new_tokens, stop_ids=[], verify=verify,
                                        verify_costs=TINY_COSTS if tiny and verify == "auto" else None)
            same = spec.token_ids == ar.token_ids
            entry[f"spec@{verify}"] = {"tok_s": spec.tokens_per_second, "tau": spec.mean_acceptance,
                                      "speedup": spec.tokens_per_second / ar.tokens_per_second,
                                      "greedy_equal_ar": same, "compile_s": spec.compile_seconds,
                                      "calibration_s": spec.calibration_seconds}
            out["ok"] &= same
        out[dtype] = entry
    return out


def verify_cost(target_name: str, drafter_spec: str, tiny: bool, max_new_tokens: int) -> dict:
    """Seconds per round at each candidate verify length (fixed-length decodes; T = 1 is AR's step)."""
    target = load_target(target_name, "bfloat16" if not tiny else "float32")
    drafter = (init_drafter(target, "dspine", num_layers=1, block_size=4) if drafter_spec.startswith("init:")
               else load_drafter(drafter_spec, target))
    prompts = prompts_for(target_name, tiny, 1)
    costs = {}
    for t in adaptive.candidate_lengths(drafter.config.block_size):
        best = None
        for _ in range(2):  # the faster of two (a busy moment must not make a length look dear)
            if t == 1:
                res = generate(target, prompts, max_new_tokens, stop_ids=[])
                rounds = max(len(r) for r in res.token_ids) - 1
            else:
                res = speculative_generate(target, drafter, prompts, max_new_tokens, stop_ids=[], verify=t)
                rounds = res.num_iterations
            per = res.decode_seconds / max(rounds, 1)
            best = per if best is None else min(best, per)
        costs[str(t)] = best
    base = costs["1"]
    return {"ok": all(v > 0 for v in costs.values()), "dtype": str(target.dtype), "seconds_per_round": costs,
            "relative_to_ar_step": {t: v / base for t, v in costs.items()}}


def training(target_name: str, tiny: bool, steps: int, workdir: Path) -> dict:
    """A few steps of train_gpu.py's train stage on a slice of the committed corpus."""
    import train_gpu  # experiments/train_gpu.py

    out = workdir / "train"
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for name in ("plan.jsonl.xz", "prompts_heldout.json", "manifest.json"):
        shutil.copy(COMMITTED_CORPUS / name, corpus / name)
    (corpus / "shards").mkdir(exist_ok=True)
    for shard in sorted((COMMITTED_CORPUS / "shards").glob("*.npz"))[: 1 if tiny else 4]:
        shutil.copy(shard, corpus / "shards" / shard.name)
    sizes = (["--layers", "1", "--block-size", "4", "--batch-size", "2", "--anchors", "2", "--max-len", "96"] if tiny
             else ["--batch-size", "32", "--anchors", "16", "--max-len", "512"])
    args = train_gpu.build_parser().parse_args(["--out", str(out), "--target", target_name, "--tokens", "0",
                                                "--steps", str(steps), *sizes])
    begin = time.perf_counter()
    train_gpu.stage_train(args, out)
    seconds = time.perf_counter() - begin
    metrics_file = out / "run" / "metrics.jsonl"
    history = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()] \
        if metrics_file.exists() else []
    losses = [m["loss"] for m in history if isinstance(m.get("loss"), (int, float))]
    # metrics.jsonl holds every log_every-th step and the last one
    finite = bool(losses) and history[-1].get("step") == steps and all(np.isfinite(losses))
    return {"ok": finite and (out / "run" / "export" / "config.json").exists(), "steps": steps,
            "seconds_incl_features_and_compile": seconds, "losses": losses[-5:],
            # the last step's time (the first one compiles): the training speed
            "seconds_per_step": history[-1]["step_time"] if history and steps > 1 else None,
            "last_metrics": history[-1] if history else None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "device_check.json")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny models, kernels in interpret mode")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=str(SHIPPED_DRAFTER))
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--train-steps", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="kernel timing repeats")
    ap.add_argument("--skip", default="", help="comma list of sections to skip (kernels,decode,verify_cost,training)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    max_new = args.max_new_tokens or (8 if tiny else 128)
    steps = args.train_steps or (2 if tiny else 20)
    iters = args.iters or (1 if tiny else 20)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report: dict = {"script": "experiments/device_check.py", "argv": sys.argv[1:] if argv is None else argv}
    begin = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="device_check_"))
    try:
        target_name, drafter_spec = args.target, args.draft
        if tiny:
            target_name, drafter_spec = str(tiny_target_dir(workdir)), "init:dspine"
        report["target"], report["drafter"] = target_name, drafter_spec
        section(report, "environment")(lambda: environment(tiny))
        plan = [("kernels", lambda: kernels(tiny, iters)),
                ("decode", lambda: decode(target_name, drafter_spec, tiny, max_new)),
                ("verify_cost", lambda: verify_cost(target_name, drafter_spec, tiny, max_new)),
                ("training", lambda: training(target_name, tiny, steps, workdir))]
        # The kernels section picks its backend itself (compiled; interpreted under --tiny). The rest runs what
        # a user's run runs: the dispatcher's ``auto`` choice (compiled kernels on the device).
        for name, fn in plan:
            if name not in skip:
                section(report, name)(fn)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["seconds"] = round(time.perf_counter() - begin, 1)
    report["ok"] = all(v.get("ok", False) for k, v in report.items() if isinstance(v, dict))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"[device_check] {'all checks passed' if report['ok'] else 'FAILED'} in {report['seconds']} s → {args.out}",
          file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
