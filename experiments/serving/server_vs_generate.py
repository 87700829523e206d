"""The server against ``generate``, side by side in one run (SmolLM2 f32, greedy, chat prompts).

Starts ``python -m dspine_jax.serve`` (loopback only) with the given flags, measures streaming chat
requests at concurrency 1 (one request at a time) and 8 (eight at once), then — with the server idle —
runs ``generate`` in this process on the same prompts, batch 1 and batch 8, same token budget. Reports
tok/s (server: output tokens / request latency at c = 1, aggregate tokens / wall at c = 8; generate:
tokens / (prefill + decode), compilation excluded), the ratios, p50 TTFT per level, and whether the
greedy texts agree. Medians over ``--waves`` repeats of each level.

    PYTHONPATH=. python experiments/serving/server_vs_generate.py --out experiments/serving/server_vs_generate.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import httpx  # noqa: E402
from load import FALLBACK_PROMPTS, free_port, one_request, start_server, stop_server  # noqa: E402

from dspine_jax.bench import machine_info  # noqa: E402
from dspine_jax.decoding.autoregressive import generate  # noqa: E402
from dspine_jax.models.target import load_target  # noqa: E402
from dspine_jax.models.tokenizer import encode_prompt, load_tokenizer  # noqa: E402


async def level(base: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Concurrency 1: the prompts one after the other (tok/s = tokens / latency, averaged); 8: all at
    once (tok/s = all tokens / wall). One keep-alive client, as a real client would hold."""
    async with httpx.AsyncClient() as client:
        if concurrency == 1:
            results = [await one_request(client, base, model, p, max_tokens, 600) for p in prompts]
        else:
            start = time.perf_counter()
            results = await asyncio.gather(*[one_request(client, base, model, p, max_tokens, 600) for p in prompts])
            wall = time.perf_counter() - start
    if not all(r["ok"] for r in results):
        raise RuntimeError(f"failed requests: {[r for r in results if not r['ok']]}")
    if concurrency == 1:
        tok_s = statistics.mean(r["tokens"] / r["latency"] for r in results)
    else:
        tok_s = sum(r["tokens"] for r in results) / wall
    return {"tok_s": tok_s, "ttft": statistics.median(r["ttft"] for r in results), "texts": [r["text"] for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    # The prefix cache is off: the waves repeat the same prompts, which it would serve from cache.
    ap.add_argument("--flags", default="--no-speculative --context-length 1024 --max-running-requests 8 --prefix-cache-mb 0")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--log", default="/tmp/server_vs_generate.log")
    args = ap.parse_args()
    prompts = FALLBACK_PROMPTS[:8]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = start_server(f"--model {args.model} {args.flags}", port, pathlib.Path(args.log), 1200)
    startup = time.perf_counter() - t0
    try:
        while httpx.get(base + "/health", timeout=10).json().get("warmup", {}).get("pending"):
            time.sleep(1)  # measure a warmed-up server: the background warmup done
        warmed = time.perf_counter() - t0
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        server: dict[int, list[dict]] = {1: [], 8: []}
        for wave in range(args.waves + 1):  # the first wave only warms the HTTP path
            for c in (1, 8):
                result = asyncio.run(level(base, model, prompts, c, args.max_tokens))
                if wave:
                    server[c].append(result)
        target = load_target(args.model)
        tok = load_tokenizer(args.model)
        ids = [encode_prompt(tok, p, chat=True) for p in prompts]
        gen: dict[int, list[float]] = {1: [], 8: []}
        texts = {}
        for wave in range(args.waves + 1):
            singles = [generate(target, [p], args.max_tokens) for p in ids]
            batch = generate(target, ids, args.max_tokens)
            if wave:
                gen[1].append(statistics.mean(r.tokens_per_second for r in singles))
                gen[8].append(batch.tokens_per_second)
            texts = {1: [tok.decode(r.token_ids[0], skip_special_tokens=True) for r in singles],
                     8: [tok.decode(t, skip_special_tokens=True) for t in batch.token_ids]}
    finally:
        stop_server(proc)
    rows = []
    for c in (1, 8):
        s = statistics.median(r["tok_s"] for r in server[c])
        g = statistics.median(gen[c])
        same = all(r["texts"] == texts[c] for r in server[c])
        rows.append({"concurrency": c, "server_tok_s": round(s, 2), "generate_tok_s": round(g, 2), "ratio": round(s / g, 3),
                     "ttft_p50_s": round(statistics.median(r["ttft"] for r in server[c]), 3), "same_text": same})
        print(f"c={c}: server {s:.1f} tok/s, generate {g:.1f} tok/s, ratio {s / g:.2f}, "
              f"p50 TTFT {rows[-1]['ttft_p50_s']:.3f} s, same text: {same}", flush=True)
    ttft_ratio = rows[1]["ttft_p50_s"] / rows[0]["ttft_p50_s"]
    print(f"p50 TTFT c=8 / c=1: {ttft_ratio:.2f}")
    print(f"server startup (load + warmup): {startup:.0f} s until /health ok, {warmed:.0f} s until the warmup finished")
    if args.out:
        report = {"machine": machine_info(), "flags": args.flags, "max_tokens": args.max_tokens, "waves": args.waves,
                  "startup_s": round(startup, 1), "warmed_s": round(warmed, 1), "ttft_ratio_c8_c1": round(ttft_ratio, 2), "rows": rows}
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
