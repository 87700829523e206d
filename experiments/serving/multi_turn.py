"""A multi-turn chat replayed through the server, with the prefix cache on and off (SmolLM2, greedy).

Each turn's request carries the whole transcript: the previous turns' user messages and the server's own
answers, then a new user message. With the cache on, the server starts each turn from the row the last
turn left (prompt + answer) and prefills only the new message. Reports TTFT per turn for both servers,
prefix-cache hits from ``/metrics``, and whether the answers are identical.

    PYTHONPATH=. python experiments/serving/multi_turn.py --out experiments/serving/multi_turn.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import httpx  # noqa: E402
from load import free_port, start_server, stop_server  # noqa: E402

from dspine_jax.bench import machine_info  # noqa: E402

MESSAGES = [
    "I am planning a small vegetable garden. Which vegetables are easy for a beginner?",
    "How much sun do tomatoes need?",
    "What about watering? How often should I water them?",
    "Can I grow basil next to the tomatoes?",
    "Which pests should I watch out for?",
    "How do I know when the tomatoes are ripe?",
    "Can you summarise the plan in a short list?",
    "Thanks! One last question: when should I plant them?",
]


async def replay(base: str, model: str, max_tokens: int) -> list[dict]:
    turns, messages = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for text in MESSAGES:
            messages.append({"role": "user", "content": text})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            start = asyncio.get_running_loop().time()
            ttft, answer = None, []
            async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            ttft = ttft if ttft is not None else asyncio.get_running_loop().time() - start
                            answer.append(piece)
            messages.append({"role": "assistant", "content": "".join(answer)})
            turns.append({"ttft_s": round(ttft, 4), "answer": "".join(answer)})
    return turns


def prefix_metrics(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("dspine_prefix_cache_") or line.startswith("dspine_prompt_tokens_total"):
            name, value = line.split()
            out[name] = float(value)
    return out


def plot(report: dict, path: pathlib.Path) -> None:
    """TTFT per turn, cache on and off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, label in (("cache_on", "prefix cache on"), ("cache_off", "prefix cache off")):
        ttft = [t["ttft_s"] for t in report["runs"][name]["turns"]]
        ax.plot(range(1, len(ttft) + 1), ttft, marker="o", label=label)
    ax.set_xlabel("turn (each carries the whole transcript)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Multi-turn chat through the server (SmolLM2-135M, CPU)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--flags", default="--no-speculative --context-length 1024 --max-running-requests 8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = {}
    for name, mb in (("cache_on", 512), ("cache_off", 0)):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start_server(f"--model {args.model} {args.flags} --prefix-cache-mb {mb}", port,
                            pathlib.Path(f"/tmp/multi_turn_{name}.log"), 1200)
        try:
            model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
            asyncio.run(replay(base, model, 4))  # warm the HTTP path and the tokenizer (a different transcript length)
            before = prefix_metrics(base)
            turns = asyncio.run(replay(base, model, args.max_tokens))
            after = prefix_metrics(base)
        finally:
            stop_server(proc)
        runs[name] = {"turns": turns, "metrics": {k: after[k] - before.get(k, 0) if k.endswith("_total") else after[k]
                                                  for k in after}}
    on, off = runs["cache_on"]["turns"], runs["cache_off"]["turns"]
    same = [a["answer"] == b["answer"] for a, b in zip(on, off)]
    print("turn | TTFT cache on | TTFT cache off")
    for i, (a, b) in enumerate(zip(on, off)):
        print(f"{i + 1} | {a['ttft_s']:.3f} | {b['ttft_s']:.3f}")
    later = slice(1, None)
    print(f"median TTFT turns 2-8: on {statistics.median(t['ttft_s'] for t in on[later]):.3f} s, "
          f"off {statistics.median(t['ttft_s'] for t in off[later]):.3f} s; identical answers: {all(same)}")
    print("prefix cache (cache on):", {k: v for k, v in runs["cache_on"]["metrics"].items() if "prefix" in k})
    if args.out:
        report = {"machine": machine_info(), "flags": args.flags, "max_tokens": args.max_tokens, "runs": runs,
                  "identical_answers": all(same)}
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        plot(report, pathlib.Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot-only"]:  # redraw from a saved report: --plot-only REPORT.json
        plot(json.loads(pathlib.Path(sys.argv[2]).read_text()), pathlib.Path(sys.argv[2]).with_suffix(".png"))
    else:
        main()
