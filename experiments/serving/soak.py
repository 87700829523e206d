"""Soak test of ``python -m dspine_jax.serve``: many clients, mixed traffic, nothing left behind.

``--requests`` chat requests (default 200) from ``--clients`` concurrent clients (default 16), seeded: greedy
and sampled, streamed and not, 4–48 new tokens, multi-turn conversations that resend their history (shared
prefixes for the prefix cache), clients that hang up mid-stream, and malformed requests. Checks: every
greedy completion that ran to its end equals ``generate``'s text for the same prompt; every malformed request
got a 4xx; afterwards ``/metrics`` shows no running or queued request and the prefix cache within its budget,
and ``/health`` is ok. Bounded: a request timeout and a deadline; loopback only.

    PYTHONPATH=. python experiments/serving/soak.py --out experiments/serving/soak.json

``tests/test_serve_soak.py`` runs the same client (``soak``) at CI size against an in-process tiny server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

TURNS = [f"Tell me about {topic}." for topic in (
    "sorting a list", "the boiling point of water", "prime numbers", "a haiku about rain", "binary search",
    "the French revolution", "recursion", "photosynthesis", "a limerick about cats", "HTTP status codes")]
MALFORMED: list[tuple[str, Any]] = [  # (what, request body) — each must be answered with a 4xx
    ("not json", b"{not json"),
    ("no messages", {"max_tokens": 4}),
    ("negative max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}),
    ("temperature out of range", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("messages not a list", {"messages": "hi"}),
    ("top_p above 1", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}),
]


async def _one(client: httpx.AsyncClient, base: str, model: str, body: dict, stream: bool, hang_up: bool,
               timeout: float) -> dict:
    """One chat request → {status, text, finish, cancelled}."""
    body = {**body, "model": model, "stream": stream}
    if not stream:
        r = await client.post(base + "/v1/chat/completions", json=body, timeout=timeout)
        if r.status_code != 200:
            return {"status": r.status_code}
        choice = r.json()["choices"][0]
        return {"status": 200, "text": choice["message"]["content"], "finish": choice["finish_reason"]}
    text, finish = [], None
    async with client.stream("POST", base + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 500, "error": chunk["error"]}
            for c in chunk.get("choices", []):
                text.append(c.get("delta", {}).get("content") or "")
                finish = c.get("finish_reason") or finish
            if hang_up and text:
                return {"status": 200, "cancelled": True}  # leaving the block closes the connection mid-stream
    return {"status": 200, "text": "".join(text), "finish": finish}


async def soak(base: str, model: str, *, requests: int, clients: int, seed: int = 0, timeout: float = 300,
               deadline_s: float = 1800, max_tokens: tuple[int, int] = (4, 48), turns: list[str] = TURNS) -> dict:
    """Run the mixed traffic (user turns drawn from ``turns``); returns the records (per request: kind, body,
    outcome) and counts."""
    rng = random.Random(seed)
    plan = []
    conversations: dict[int, list[dict]] = {}
    for i in range(requests):
        u = rng.random()
        if u < 0.06:
            plan.append({"kind": "malformed", "malformed": MALFORMED[i % len(MALFORMED)]})
            continue
        convo = rng.randrange(clients * 2)
        greedy = rng.random() < 0.6
        body = {"max_tokens": rng.randint(*max_tokens), "temperature": 0.0 if greedy else 0.8}
        if not greedy:
            body |= {"top_p": 0.9, "seed": rng.randrange(1 << 30)}
        plan.append({"kind": "greedy" if greedy else "sampled", "convo": convo, "body": body,
                     "stream": rng.random() < 0.5, "hang_up": rng.random() < 0.1, "turn": rng.choice(turns)})
    records: list[dict] = []
    queue = list(range(len(plan)))
    stop_at = time.monotonic() + deadline_s
    locks = {c: asyncio.Lock() for c in range(clients * 2)}  # one turn at a time per conversation

    async def worker(client: httpx.AsyncClient) -> None:
        while queue and time.monotonic() < stop_at:
            item = plan[queue.pop(0)]
            if item["kind"] == "malformed":
                what, body = item["malformed"]
                kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                    else {"json": body}
                r = await client.post(base + "/v1/chat/completions", timeout=timeout, **kw)
                records.append({"kind": "malformed", "what": what, "status": r.status_code})
                continue
            async with locks[item["convo"]]:
                history = conversations.setdefault(item["convo"], [])
                messages = history + [{"role": "user", "content": item["turn"]}]
                try:
                    out = await _one(client, base, model, {**item["body"], "messages": messages}, item["stream"],
                                     item["hang_up"], timeout)
                except (httpx.HTTPError, asyncio.TimeoutError) as e:
                    out = {"status": None, "error": f"{type(e).__name__}: {e}"}
                records.append({"kind": item["kind"], "messages": messages, "body": item["body"],
                                "stream": item["stream"], **out})
                if out.get("text") is not None and len(history) < 6:  # the conversation goes on with this answer
                    history += [messages[-1], {"role": "assistant", "content": out["text"]}]

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*[worker(client) for _ in range(clients)])
    return {"records": records, "planned": len(plan), "sent": len(records)}


def settle(base: str, seconds: float = 60) -> dict[str, float]:
    """``/metrics`` once no request runs or waits (cancelled streams are freed at the engine's next step)."""
    deadline = time.monotonic() + seconds
    while True:
        metrics = {}
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("dspine_") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                metrics[name] = float(value)
        if (metrics.get("dspine_running_requests"), metrics.get("dspine_queued_requests")) == (0, 0):
            return metrics
        if time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def check(result: dict, reference: Callable[[list[dict], int], str], base: str, prefix_budget: float) -> dict:
    """The soak's verdict: greedy texts vs ``reference(messages, max_tokens)``, 4xx for malformed requests,
    nothing left running, the prefix cache within budget, the server healthy."""
    records = result["records"]
    greedy = [r for r in records if r["kind"] == "greedy" and r.get("text") is not None]
    mismatches = [r for r in greedy if r["text"] != reference(r["messages"], r["body"]["max_tokens"])]
    malformed = [r for r in records if r["kind"] == "malformed"]
    metrics = settle(base)
    failed = [r for r in records if r["kind"] != "malformed" and r.get("status") != 200]
    return {
        "requests": len(records), "planned": result["planned"],
        "greedy_checked": len(greedy), "greedy_mismatches": len(mismatches),
        "sampled_completed": sum(r["kind"] == "sampled" and r.get("text") is not None for r in records),
        "cancelled": sum(bool(r.get("cancelled")) for r in records),
        "malformed": len(malformed), "malformed_not_4xx": [r for r in malformed if not 400 <= r["status"] < 500],
        "failed": failed,
        "running_after": metrics.get("dspine_running_requests"), "queued_after": metrics.get("dspine_queued_requests"),
        "prefix_cache_bytes": metrics.get("dspine_prefix_cache_bytes", 0.0), "prefix_cache_budget": prefix_budget,
        "health": httpx.get(base + "/health", timeout=10).json()["status"],
        "first_mismatch": mismatches[0] if mismatches else None,
    }


def passed(verdict: dict) -> bool:
    return (verdict["greedy_mismatches"] == 0 and not verdict["malformed_not_4xx"] and not verdict["failed"]
            and verdict["running_after"] == 0 and verdict["queued_after"] == 0
            and verdict["prefix_cache_bytes"] <= verdict["prefix_cache_budget"] and verdict["health"] == "ok")


def main() -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from load import free_port, start_server, stop_server

    from dspine_jax.bench import machine_info
    from dspine_jax.decoding.autoregressive import generate
    from dspine_jax.models.target import load_target
    from dspine_jax.models.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--flags", default="--prefix-cache-mb 256", help="server flags (default: speculative, shipped drafter)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(f"--model {args.model} --max-running-requests 8 {args.flags}", port,
                        pathlib.Path("/tmp/soak_server.log"), 600)
    start = time.perf_counter()
    try:
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        result = asyncio.run(soak(base, model, requests=args.requests, clients=args.clients, seed=args.seed))
        seconds = time.perf_counter() - start
        target, tok = load_target(args.model), load_tokenizer(args.model)

        def reference(messages: list[dict], n: int) -> str:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
            return tok.decode(generate(target, [ids], n).token_ids[0], skip_special_tokens=True)

        budget = float(args.flags.split("--prefix-cache-mb")[1].split()[0]) * 2**20 if "--prefix-cache-mb" in args.flags \
            else 512 * 2**20
        verdict = check(result, reference, base, budget)
    finally:
        stop_server(proc)
    verdict["seconds"] = round(seconds, 1)
    print(json.dumps({k: v for k, v in verdict.items() if k not in ("failed", "first_mismatch")}, indent=1))
    print("PASSED" if passed(verdict) else "FAILED")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"machine": machine_info(), "flags": args.flags, **verdict},
                                                     indent=1, default=str) + "\n")
    sys.exit(0 if passed(verdict) else 1)


if __name__ == "__main__":
    main()
