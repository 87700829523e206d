"""Weight precision for SmolLM2-135M-Instruct on this machine, side by side: decode tok/s and weight memory
of f32, bf16 and weight-only int8 (f32 and bf16 compute), and the quality cost against f32 on held-out
prompts (greedy agreement over the generated tokens and the mean KL(f32 ‖ config) of the next-token
distributions along f32's greedy continuation). Also the one matmul shape of each kind alone, to show
where the time goes. Writes results.json and RESULTS-table.md here.

    python experiments/quantisation/run.py [--tokens 128] [--prompts-per-domain 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.bench import load_heldout_prompts, select_prompts
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.models import quant
from dspine_jax.models import target as tgt
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.train.data import encode_messages

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIGS = {  # name → (compute dtype, quantize)
    "f32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8 (f32 compute)": ("float32", "int8"),
    "int8 (bf16 compute)": ("bfloat16", "int8"),
}


def weight_bytes(target: tgt.Target) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(target.params))


def teacher_logprobs(target: tgt.Target, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """log-softmax of the next-token logits at every continuation position ``[N, V]`` (teacher forced)."""
    tokens = jnp.asarray([prompt + continuation[:-1]], jnp.int32)
    cache = tgt.init_cache(target, 1, tokens.shape[1])
    hidden = tgt.forward(target, cache, tokens).hidden[:, len(prompt) - 1 :]
    return np.asarray(jax.nn.log_softmax(tgt.lm_logits(target, hidden)[0], axis=-1))


def matmul_profile(repeats: int = 20) -> dict[str, dict[str, float]]:
    """Microseconds of one [1, I] @ [I, O] at SmolLM2's shapes: f32, bf16, int8 weights (f32 compute)."""
    rng = np.random.default_rng(0)
    out = {}
    for name, (i, o) in {"qkv [576, 960]": (576, 960), "gate_up [576, 3072]": (576, 3072),
                         "down [1536, 576]": (1536, 576), "lm_head [576, 49152]": (576, 49152)}.items():
        w = jnp.asarray(rng.standard_normal((i, o)).astype(np.float32))
        x = jnp.asarray(rng.standard_normal((1, i)).astype(np.float32))
        cases = {"f32": (jax.jit(lambda x, w: x @ w), x, w),
                 "bf16": (jax.jit(lambda x, w: x @ w), x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)),
                 "int8": (jax.jit(lambda x, w: x @ w), x, quant.quantize_int8(w))}
        row = {}
        for case, (f, a, b) in cases.items():
            jax.block_until_ready(f(a, b))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(f(a, b))
                times.append(time.perf_counter() - t0)
            row[case] = statistics.median(times) * 1e6
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts-per-domain", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = load_tokenizer(args.model)
    held = load_heldout_prompts(args.model, ROOT / "experiments/data/smollm2-v2")
    prompts = [p.ids for p in select_prompts(held, args.prompts_per_domain, lambda m: encode_messages(tok, m))]
    n = args.tokens
    targets = {name: tgt.load_target(args.model, dtype=d, quantize=q) for name, (d, q) in CONFIGS.items()}
    outputs = {name: [generate(t, [p], n, stop_ids=[]).token_ids[0] for p in prompts] for name, t in targets.items()}
    seconds: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(args.repeats):  # interleaved: a busy machine slows every config alike
        for p in prompts:
            for name, t in targets.items():
                seconds[name].append(generate(t, [p], n, stop_ids=[]).decode_seconds)
    reference = outputs["f32"]
    rows = {}
    for name, t in targets.items():
        agree, prefix, kls = [], [], []
        for p, ref, got in zip(prompts, reference, outputs[name]):
            same = [a == b for a, b in zip(ref, got)]
            agree.append(float(np.mean(same)))
            prefix.append(same.index(False) if False in same else len(same))
            lp_ref, lp = teacher_logprobs(targets["f32"], p, ref), teacher_logprobs(t, p, ref)
            kls.append(float(np.mean(np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1))))
        med = statistics.median(seconds[name])
        rows[name] = {"tokens_per_second": (n - 1) / med, "decode_seconds_median": med, "weight_mb": weight_bytes(t) / 2**20,
                      "greedy_agreement": float(np.mean(agree)), "matched_prefix_mean": float(np.mean(prefix)),
                      "mean_kl_vs_f32": float(np.mean(kls))}
    base = rows["f32"]["tokens_per_second"]
    for r in rows.values():
        r["speed_vs_f32"] = r["tokens_per_second"] / base
    profile = matmul_profile()
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": jax.device_count(),
                          "device": jax.devices()[0].device_kind, "jax": jax.__version__},
              "model": args.model, "prompts": len(prompts), "new_tokens": n, "repeats": args.repeats,
              "configs": rows, "matmul_microseconds": profile}
    (HERE / "results.json").write_text(json.dumps(result, indent=1))
    lines = ["| config | tok/s | × f32 | weights MB | greedy agreement | matched prefix | mean KL vs f32 |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {r['speed_vs_f32']:.2f} | {r['weight_mb']:.0f} | "
                     f"{r['greedy_agreement']:.3f} | {r['matched_prefix_mean']:.1f} / {n} | {r['mean_kl_vs_f32']:.4f} |")
    lines += ["", "| one matmul, batch 1 (µs, median) | f32 | bf16 | int8 weights |", "|---|---|---|---|"]
    for name, r in profile.items():
        lines.append(f"| {name} | {r['f32']:.0f} | {r['bf16']:.0f} | {r['int8']:.0f} |")
    (HERE / "RESULTS-table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
