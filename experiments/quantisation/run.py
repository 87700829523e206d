"""Weight and KV-cache precision for SmolLM2-135M-Instruct on this machine, side by side: decode tok/s, weight
memory and KV-cache memory of f32, bf16, weight-only int8 (f32 and bf16 compute) and the int8 KV cache (f32
weights, int8 weights), and the quality cost against f32 on held-out prompts (greedy agreement over the
generated tokens and the mean KL(f32 ‖ config) of the next-token distributions along f32's greedy
continuation; int8-KV rows also against the same weights with a float KV cache). Then f32 vs int8 KV at a
long context (where the cache is a larger share of the bytes a step reads), and the one matmul shape of each
kind alone, to show where the time goes. Writes results.json and RESULTS-table.md here.

    python experiments/quantisation/run.py [--tokens 128] [--prompts-per-domain 1] [--repeats 3] [--long 1536]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.bench import load_heldout_prompts, median_seconds, select_prompts
from dspine_jax.decoding.autoregressive import generate
from dspine_jax.models import quant
from dspine_jax.models import target as tgt
from dspine_jax.models.cache import quantize_kv
from dspine_jax.models.layers import cached_attention
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.train.prompts import encode_messages

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIGS = {  # name → (compute dtype, quantize, kv_cache_dtype)
    "f32": ("float32", None, "auto"),
    "bf16": ("bfloat16", None, "auto"),
    "int8 (f32 compute)": ("float32", "int8", "auto"),
    "int8 (bf16 compute)": ("bfloat16", "int8", "auto"),
    "f32 + int8 KV": ("float32", None, "int8"),
    "int8 + int8 KV (f32 compute)": ("float32", "int8", "int8"),
}
KV_POSITIONS = 2048  # KV-cache memory is reported for one row of this many positions (the server's default context)


def weight_bytes(target: tgt.Target) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(target.params))


def kv_bytes(target: tgt.Target, positions: int = KV_POSITIONS) -> int:
    """Bytes of a batch-1 target cache of ``positions`` slots (K/V, their scales and ``lengths``)."""
    shapes = jax.eval_shape(lambda: tgt.init_cache(target, 1, positions))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def float_kv_twin(name: str) -> str | None:
    """The config with the same weights and a float KV cache (for an int8-KV config)."""
    dtype, quantize, kv = CONFIGS[name]
    if kv == "auto":
        return None
    return next(other for other, c in CONFIGS.items() if c == (dtype, quantize, "auto"))


def agreement_and_kl(
    targets: dict, outputs: dict, prompts: list[list[int]], ref: str, name: str
) -> tuple[float, float, float]:
    """Greedy agreement, matched prefix and mean KL(ref ‖ name) along ``ref``'s greedy continuation."""
    agree, prefix, kls = [], [], []
    for p, want, got in zip(prompts, outputs[ref], outputs[name]):
        same = [a == b for a, b in zip(want, got)]
        agree.append(float(np.mean(same)))
        prefix.append(same.index(False) if False in same else len(same))
        lp_ref, lp = teacher_logprobs(targets[ref], p, want), teacher_logprobs(targets[name], p, want)
        kls.append(float(np.mean(np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1))))
    return float(np.mean(agree)), float(np.mean(prefix)), float(np.mean(kls))


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
        out[name] = {case: median_seconds(f, a, b, repeats=repeats) * 1e6 for case, (f, a, b) in cases.items()}
    return out


def attention_profile(slots: int = 1664, repeats: int = 200) -> dict[str, float]:
    """Microseconds of one layer's batch-1 decode attention over ``slots`` cached positions at SmolLM2's
    shapes (9 query / 3 KV heads of 64): f32 K/V vs int8 K/V read through their scales."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 9, 64)).astype(np.float32))
    k, v = (jnp.asarray(rng.standard_normal((1, 3, slots, 64)).astype(np.float32)) for _ in range(2))
    visible = jnp.ones((1, 1, slots), bool)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    cases = {"f32": (jax.jit(cached_attention), (q, k, v, visible)),
             "int8": (jax.jit(cached_attention), (q, kq, vq, visible, ks, vs))}
    return {case: median_seconds(f, *args, repeats=repeats) * 1e6 for case, (f, args) in cases.items()}


def long_context(targets: dict, prompts: list[list[int]], length: int, tokens: int, repeats: int) -> dict[str, dict]:
    """f32 vs f32 + int8 KV decoding ``tokens`` after a ``length``-token prompt (the held-out prompts end to end):
    the cache is then a larger share of what a step reads (SmolLM2 f32: 46 KB of K/V per position)."""
    prompt = [t for p in prompts for t in p] * (length // sum(map(len, prompts)) + 1)
    prompt = prompt[:length]
    names = ["f32", "f32 + int8 KV"]
    outputs = {name: generate(targets[name], [prompt], tokens, stop_ids=[]).token_ids[0] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            seconds[name].append(generate(targets[name], [prompt], tokens, stop_ids=[]).decode_seconds)
    capacity = len(prompt) + tokens
    rows = {}
    for name in names:
        med = statistics.median(seconds[name])
        same = [a == b for a, b in zip(outputs["f32"], outputs[name])]
        rows[name] = {"tokens_per_second": (tokens - 1) / med, "decode_seconds_median": med,
                      "kv_mb": kv_bytes(targets[name], capacity) / 2**20, "greedy_agreement": float(np.mean(same))}
    for r in rows.values():
        r["speed_vs_f32"] = r["tokens_per_second"] / rows["f32"]["tokens_per_second"]
    return {"prompt_tokens": len(prompt), "new_tokens": tokens, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts-per-domain", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", type=int, default=1536,
                    help="prompt tokens of the long-context f32 vs int8-KV run (0: skip)")
    ap.add_argument("--long-tokens", type=int, default=64)
    ap.add_argument("--attention-only", action="store_true", help="print the decode-attention profile and stop")
    args = ap.parse_args()
    if args.attention_only:
        print(json.dumps(attention_profile()))
        return
    tok = load_tokenizer(args.model)
    held = load_heldout_prompts(args.model, ROOT / "experiments/data/smollm2-v2")
    prompts = [p.ids for p in select_prompts(held, args.prompts_per_domain, lambda m: encode_messages(tok, m))]
    n = args.tokens
    loaded: dict[tuple, tgt.Target] = {}  # int8-KV configs share their weights with the float-KV one
    targets = {}
    for name, (d, q, kv) in CONFIGS.items():
        if (d, q) not in loaded:
            loaded[d, q] = tgt.load_target(args.model, dtype=d, quantize=q)
        targets[name] = tgt.with_kv_cache_dtype(loaded[d, q], kv)
    outputs = {name: [generate(t, [p], n, stop_ids=[]).token_ids[0] for p in prompts] for name, t in targets.items()}
    seconds: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(args.repeats):  # interleaved: a busy machine slows every config alike
        for p in prompts:
            for name, t in targets.items():
                seconds[name].append(generate(t, [p], n, stop_ids=[]).decode_seconds)
    rows = {}
    for name, t in targets.items():
        agree, prefix, kl = agreement_and_kl(targets, outputs, prompts, "f32", name)
        med = statistics.median(seconds[name])
        rows[name] = {"tokens_per_second": (n - 1) / med, "decode_seconds_median": med, "weight_mb": weight_bytes(t) / 2**20,
                      "kv_mb_at_2048": kv_bytes(t) / 2**20, "kv_cache_dtype": t.kv_cache_dtype,
                      "greedy_agreement": agree, "matched_prefix_mean": prefix, "mean_kl_vs_f32": kl}
        twin = float_kv_twin(name)
        if twin is not None:
            agree, prefix, kl = agreement_and_kl(targets, outputs, prompts, twin, name)
            rows[name].update({"float_kv_twin": twin, "greedy_agreement_vs_float_kv": agree,
                               "matched_prefix_vs_float_kv": prefix, "mean_kl_vs_float_kv": kl})
    base = rows["f32"]["tokens_per_second"]
    for r in rows.values():
        r["speed_vs_f32"] = r["tokens_per_second"] / base
    long = long_context(targets, prompts, args.long, args.long_tokens, args.repeats) if args.long else None
    profile = matmul_profile()
    attention = attention_profile()
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": jax.device_count(),
                          "device": jax.devices()[0].device_kind, "jax": jax.__version__},
              "model": args.model, "prompts": len(prompts), "new_tokens": n, "repeats": args.repeats,
              "configs": rows, "long_context": long, "matmul_microseconds": profile,
              "decode_attention_microseconds_1664_slots": attention}
    (HERE / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"| config | tok/s | × f32 | weights MB | KV MB @ {KV_POSITIONS} | greedy agreement | matched prefix | "
             "mean KL vs f32 | vs float KV: agreement, KL |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        twin = (f"{r['greedy_agreement_vs_float_kv']:.3f}, {r['mean_kl_vs_float_kv']:.4f}"
                if "float_kv_twin" in r else "—")
        lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {r['speed_vs_f32']:.2f} | {r['weight_mb']:.0f} | "
                     f"{r['kv_mb_at_2048']:.1f} | {r['greedy_agreement']:.3f} | {r['matched_prefix_mean']:.1f} / {n} | "
                     f"{r['mean_kl_vs_f32']:.4f} | {twin} |")
    if long:
        lines += ["", f"| long context ({long['prompt_tokens']}-token prompt, {long['new_tokens']} new) | tok/s | "
                  "× f32 | KV MB | greedy agreement |", "|---|---|---|---|---|"]
        for name, r in long["rows"].items():
            lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {r['speed_vs_f32']:.2f} | {r['kv_mb']:.1f} | "
                         f"{r['greedy_agreement']:.3f} |")
    lines += ["", "| one matmul, batch 1 (µs, median) | f32 | bf16 | int8 weights |", "|---|---|---|---|"]
    for name, r in profile.items():
        lines.append(f"| {name} | {r['f32']:.0f} | {r['bf16']:.0f} | {r['int8']:.0f} |")
    lines += ["", f"one layer's decode attention over 1664 slots (µs, median): f32 K/V {attention['f32']:.0f}, "
              f"int8 K/V {attention['int8']:.0f}"]
    (HERE / "RESULTS-table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
