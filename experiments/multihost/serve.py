"""The server across processes: 2 processes × 4 CPU devices vs 1 process × 8, the same ``--tp 4 --dp 2`` mesh,
greedy completions through HTTP at concurrency 1 and 4 (tok/s = completion tokens / wall time of the batch of
requests, after a warm-up pass that compiles); plus what the replication itself costs per engine step on
this machine: ``replica.exchange`` of a step's call and ``distributed.check_step`` (both collectives over
the two processes), timed in a two-process run of their own.

    python experiments/multihost/serve.py --model smollm2-135m-instruct --repeats 3 --out experiments/multihost/results_serve.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dspine_jax.parallel.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Write a Python function that reverses a string.", "Explain what a hash map is in two sentences.",
           "List three prime numbers and say why they are prime.", "Write a haiku about the sea."]


def env(devices: int) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def start(args: argparse.Namespace, processes: int, log_dir: Path) -> tuple[list[subprocess.Popen], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "dspine_jax.serve", "--model", args.model, "--port", str(port), "--tp", "4",
           "--dp", "2", "--max-running-requests", "4", "--context-length", "512", "--warmup", "none",
           *(["--draft", args.draft, "--verify", args.verify] if args.draft else ["--no-speculative"])]  # fmt: skip
    if processes == 1:
        ranks = [(cmd, env(8))]
    else:
        coordinator = f"127.0.0.1:{free_port()}"
        ranks = [([*cmd, "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(r)], env(4))
                 for r in range(2)]  # fmt: skip
    procs = [subprocess.Popen(c, cwd=REPO, env=e, stdout=subprocess.DEVNULL,
                              stderr=open(log_dir / f"serve_{processes}p_{i}.log", "w"))
             for i, (c, e) in enumerate(ranks)]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return procs, base
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{processes}-process server did not start")


def complete(base: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()  # fmt: skip
    request = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as r:
        out = json.loads(r.read())
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]


def batch(base: str, concurrency: int, max_tokens: int) -> tuple[float, list[str]]:
    """tok/s of ``concurrency`` requests sent together (the prompts, in order) and their texts."""
    begin = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: complete(base, p, max_tokens), PROMPTS[:concurrency]))
    seconds = time.perf_counter() - begin
    return sum(n for _, n in results) / seconds, [t for t, _ in results]


def stop(procs: list[subprocess.Popen]) -> None:
    procs[0].send_signal(2)  # Ctrl-C on process 0 stops every process
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


REPLICATION_PROBE = r'''
import json, os, pickle, statistics, sys, time
import jax, numpy as np
from dspine_jax.parallel import distributed
from dspine_jax.serve import replica
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
leader = distributed.is_leader()
calls = {"launch": ("launch", (None,), {}), "admit, 60-token prompt": ("admit", (0, list(range(60)), 64, None), {}),
         "admit, 2000-token prompt": ("admit", (0, list(range(2000)), 64, None), {})}
out = {}
for name, call in calls.items():
    message = pickle.dumps(call)
    times = []
    for i in range(60):
        begin = time.perf_counter()
        replica.exchange(message if leader else None)
        times.append(time.perf_counter() - begin)
    out[f"exchange: {name} ({len(message)} bytes)"] = statistics.median(times[10:]) * 1e3
times = []
for i in range(60):
    begin = time.perf_counter()
    distributed.check_step(0.01, 12345)
    times.append(time.perf_counter() - begin)
out["check_step"] = statistics.median(times[10:]) * 1e3
if leader:
    print(json.dumps(out), flush=True)
'''


def replication_costs() -> dict[str, float]:
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", REPLICATION_PROBE, coordinator, str(r)], cwd=REPO, env=env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in range(2)]  # fmt: skip
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=60)
    line = [x for x in out.splitlines() if x.startswith("{")][-1]
    return {k: round(v, 3) for k, v in json.loads(line).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="a drafter (default: plain decoding)")
    ap.add_argument("--verify", default="4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="dspine_multihost_serve_"))  # the servers' stderr (gloo's chatter)
    print(f"server logs in {log_dir}", flush=True)
    record: dict = {"model": args.model, "draft": args.draft, "max_tokens": args.max_tokens, "runs": {}}
    texts: dict[str, list[str]] = {}
    servers = {f"{n}p": start(args, n, log_dir) for n in (1, 2)}  # both up at once, loaded in turn (interleaved)
    try:
        for _, base in servers.values():
            for concurrency in (1, 4):
                batch(base, concurrency, args.max_tokens)  # compiles
        runs = {name: {"c1": [], "c4": []} for name in servers}
        for _ in range(args.repeats):
            for concurrency in (1, 4):
                for name, (_, base) in servers.items():
                    rate, got = batch(base, concurrency, args.max_tokens)
                    runs[name][f"c{concurrency}"].append(rate)
                    assert texts.setdefault(f"c{concurrency}", got) == got, "outputs differ between configurations"
        record["runs"] = runs
    finally:
        for procs, _ in servers.values():
            stop(procs)
    record["medians"] = {k: {c: round(statistics.median(v), 2) for c, v in r.items()} for k, r in record["runs"].items()}
    record["ratio_2p_over_1p"] = {c: round(record["medians"]["2p"][c] / record["medians"]["1p"][c], 3)
                                  for c in ("c1", "c4")}  # fmt: skip
    record["replication_ms"] = replication_costs()
    record["same_texts"] = True
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("medians", "ratio_2p_over_1p", "replication_ms")}, indent=1))


if __name__ == "__main__":
    main()
