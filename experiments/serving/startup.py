"""How soon the default server answers, and whether its programs and memory stay bounded under every bucket.

Starts ``python -m dspine_jax.serve`` with the given flags (default: none, i.e. the shipped DSpine drafter,
lazy warmup, 8 slots, context 2048) on 127.0.0.1 with an **empty** compilation cache (a fresh folder), sends
one greedy chat completion as soon as ``/health`` says ok, and checks its tokens against ``generate``'s
(run in this process afterwards). Then a load that touches every capacity bucket (prompts and budgets that
reach 128 … 2,048 positions) at concurrency 1, 2, 4 and 8, sampling ``/metrics`` (programs held, memory
maps, resident memory) every second; the server must stay up. Finally a restart on the now warm cache, timed
to its first answer. Writes one JSON.

    PYTHONPATH=. python experiments/serving/startup.py --out experiments/serving/startup.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import httpx  # noqa: E402
from load import FALLBACK_PROMPTS, free_port, one_request, stop_server  # noqa: E402

from dspine_jax.bench import machine_info  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def start(flags: list[str], port: int, log: pathlib.Path, cache: str):
    import subprocess

    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache)
    cmd = [sys.executable, "-m", "dspine_jax.serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def first_answer(proc, base: str, prompt: str, max_tokens: int, deadline_s: float) -> dict:
    """Seconds until /health is ok and until one chat completion came back (its text and token count)."""
    t0 = time.perf_counter()
    ready = None
    while time.perf_counter() - t0 < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                ready = time.perf_counter() - t0
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    if ready is None:
        raise RuntimeError("server never became ready")
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=deadline_s)
    r.raise_for_status()
    return {"ready_s": round(ready, 1), "answered_s": round(time.perf_counter() - t0, 1),
            "text": r.json()["choices"][0]["message"]["content"], "status": r.status_code}


def scrape(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("dspine_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def bucket_load(base: str, model: str, concurrency: int, max_tokens: int, words: int) -> list[dict]:
    """``concurrency`` requests at once whose prompts have about ``words`` words."""
    filler = " ".join(f"item{i}" for i in range(words))

    async def go():
        async with httpx.AsyncClient() as client:
            prompts = [f"{FALLBACK_PROMPTS[i % 8]} Context: {filler}" for i in range(concurrency)]
            return await asyncio.gather(*[one_request(client, base, model, p, max_tokens, 900) for p in prompts])

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flags", default="", help="server flags (default: none, the product's default)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip-load", action="store_true", help="only the cold and warm start-up timings")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    flags = args.flags.split()
    cache = tempfile.mkdtemp(prefix="dspine_jit_cache_")
    prompt = FALLBACK_PROMPTS[0]
    report: dict = {"machine": machine_info(), "flags": args.flags, "compilation_cache": "empty, then warm"}
    samples: list[dict] = []
    for phase in ("cold", "warm"):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start(flags, port, pathlib.Path(f"/tmp/startup_{phase}.log"), cache)
        try:
            first = first_answer(proc, base, prompt, args.max_tokens, 600)
            print(f"{phase}: /health ok after {first['ready_s']} s, first answer after {first['answered_s']} s",
                  flush=True)
            report[phase] = first
            if phase == "cold" and not args.skip_load:
                stop = threading.Event()

                def sample():
                    while not stop.is_set():
                        try:
                            samples.append({"t": time.time(), **scrape(base)})
                        except httpx.HTTPError:
                            pass
                        stop.wait(1.0)

                model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                levels = []
                # a filler word is ~4 tokens: the caches move through 128, 256, 512, 1024 and 2056 positions
                for words, max_tokens in ((10, 32), (60, 64), (150, 64), (330, 64), (420, 240)):
                    for c in (1, 2, 4, 8):
                        t0 = time.perf_counter()
                        results = bucket_load(base, model, c, max_tokens, words)
                        ok = sum(r["ok"] for r in results)
                        errors = [r for r in results if not r["ok"]]
                        if errors:
                            print("   failed:", errors[0], flush=True)
                        levels.append({"words": words, "max_tokens": max_tokens, "concurrency": c, "ok": ok,
                                       "seconds": round(time.perf_counter() - t0, 1)})
                        print(f"  {words} words × {c}: {ok}/{c} ok in {levels[-1]['seconds']} s; "
                              f"programs {samples[-1].get('dspine_programs') if samples else '?'}, "
                              f"maps {samples[-1].get('dspine_process_memory_maps') if samples else '?'}", flush=True)
                        if proc.poll() is not None:
                            raise RuntimeError(f"server died ({proc.returncode}) under load")
                stop.set()
                sampler.join()
                report["load"] = levels
                report["peak"] = {k: max(s.get(k, 0) for s in samples) for k in (
                    "dspine_programs", "dspine_process_memory_maps", "dspine_process_resident_bytes",
                    "dspine_program_compiles_total", "dspine_program_evictions_total")}
                report["final"] = scrape(base)
                report["compiles_by_function"] = {
                    line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in httpx.get(base + "/metrics").text.splitlines()
                    if line.startswith("dspine_program_compiles_by_function_total{")}
                print("peak:", report["peak"], flush=True)
        finally:
            stop_server(proc)
    # The first answer must be generate's greedy text.
    from dspine_jax.decoding.autoregressive import generate
    from dspine_jax.models.target import load_target
    from dspine_jax.models.tokenizer import encode_prompt, load_tokenizer

    target, tok = load_target(args.model), load_tokenizer(args.model)
    ids = encode_prompt(tok, prompt, chat=True)
    expected = tok.decode(generate(target, [ids], args.max_tokens).token_ids[0], skip_special_tokens=True)
    report["first_answer_equals_generate"] = {p: report[p]["text"] == expected for p in ("cold", "warm")}
    print("first answer == generate:", report["first_answer_equals_generate"])
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
