"""Server startup: it listens before the engine is built and compiled, says "starting" (503) on /health and
to requests until the loader returns, then "ok"; a loader that fails is reported, not hung on."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from conftest import require  # noqa: E402

require("uvicorn")
require("starlette")

from conftest import make_tiny_hf_model  # noqa: E402
from test_serve import make_tiny_tokenizer, start_uvicorn  # noqa: E402

from dspine_jax.serve.scheduler import StartupError  # noqa: E402
from dspine_jax.serve.server import ServerConfig, build_app  # noqa: E402


def serve(load, on_failure=None):
    app, engine = build_app(load, ServerConfig(model_name="tiny"))
    engine.on_failure = on_failure
    engine.start()
    uv, thread, base = start_uvicorn(app)
    return engine, uv, thread, base


def stop(engine, uv, thread) -> None:
    uv.should_exit = True
    thread.join(timeout=10)
    engine.stop()


def assert_unavailable(response: httpx.Response, code: str) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) > 0
    err = response.json()["error"]
    assert err["type"] == "server_error" and err["code"] == code and err["message"]


def test_health_says_starting_until_the_engine_is_ready(tmp_path):
    from dspine_jax.decoding.autoregressive import generate
    from dspine_jax.models.target import load_target
    from dspine_jax.models.tokenizer import load_tokenizer
    from dspine_jax.serve.engine import EngineCore

    model_dir, _ = make_tiny_hf_model("llama", tmp_path / "tiny", tie_word_embeddings=True)
    make_tiny_tokenizer(model_dir)
    hold = threading.Event()  # keeps the engine "starting" until the test has looked

    def load():
        assert hold.wait(60)
        target, tokenizer = load_target(model_dir), load_tokenizer(model_dir)
        core = EngineCore(target, None, num_slots=2, context_length=64)
        core.warmup()
        return core, tokenizer

    t0 = time.perf_counter()
    engine, uv, thread, base = serve(load)
    try:
        assert time.perf_counter() - t0 < 10  # listening does not wait for the loader
        r = httpx.get(base + "/health")
        assert (r.status_code, r.json()) == (503, {"status": "starting"})
        assert_unavailable(httpx.post(base + "/v1/completions", json={"prompt": "w9", "max_tokens": 2}),
                           "server_starting")
        assert_unavailable(httpx.post(base + "/v1/chat/completions",
                                      json={"messages": [{"role": "user", "content": "w9"}]}), "server_starting")
        assert_unavailable(httpx.get(base + "/v1/models"), "server_starting")
        assert httpx.get(base + "/metrics").status_code == 200

        hold.set()
        seen, deadline = set(), time.time() + 120
        while (r := httpx.get(base + "/health")).status_code != 200:
            seen.add(r.json()["status"])
            assert time.time() < deadline, "engine never became ready"
            time.sleep(0.1)
        assert r.json()["status"] == "ok" and seen <= {"starting"}

        out = httpx.post(base + "/v1/completions", json={"prompt": [1, 5, 9], "max_tokens": 6, "temperature": 0},
                         timeout=60)
        assert out.status_code == 200, out.text
        ref = generate(engine.core.target, [[1, 5, 9]], 6).token_ids[0]
        assert out.json()["choices"][0]["text"] == engine.tokenizer.decode(ref, skip_special_tokens=True)
        assert httpx.get(base + "/v1/models").json()["data"][0]["max_model_len"] == 64
    finally:
        hold.set()
        stop(engine, uv, thread)


def test_a_failed_load_is_reported():
    def load():
        raise StartupError("no weights at /nowhere")

    failures = []
    engine, uv, thread, base = serve(load, on_failure=failures.append)
    try:
        deadline = time.time() + 30
        while (r := httpx.get(base + "/health")).json()["status"] == "starting":
            assert time.time() < deadline
            time.sleep(0.05)
        assert (r.status_code, r.json()) == (503, {"status": "failed", "error": "no weights at /nowhere"})
        assert failures == ["no weights at /nowhere"]
        assert_unavailable(httpx.post(base + "/v1/completions", json={"prompt": "w9"}), "server_failed")
    finally:
        stop(engine, uv, thread)


def _tiny_server(tmp_path, warmup: str, configure=None):
    """A tiny llama + DSpine drafter server whose loader warms up with ``warmup`` (``configure(core)`` first)."""
    from dspine_jax import init_drafter
    from dspine_jax.models.target import load_target
    from dspine_jax.models.tokenizer import load_tokenizer
    from dspine_jax.serve.engine import EngineCore

    model_dir, _ = make_tiny_hf_model("llama", tmp_path / "tiny", tie_word_embeddings=True)
    make_tiny_tokenizer(model_dir)

    def load():
        target = load_target(model_dir)
        drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)
        core = EngineCore(target, drafter, num_slots=2, context_length=96, max_prompt_bucket=32)
        if configure:
            configure(core)
        core.warmup(warmup)
        return core, load_tokenizer(model_dir)

    engine, uv, thread, base = serve(load)
    deadline = time.time() + 300
    while httpx.get(base + "/health").status_code != 200:
        assert time.time() < deadline, "engine never became ready"
        time.sleep(0.1)
    return engine, uv, thread, base


def _complete(base: str, prompt: list[int], n: int) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0},
                      timeout=300)


def _expected(engine, prompt: list[int], n: int) -> str:
    from dspine_jax.decoding.autoregressive import generate

    return engine.tokenizer.decode(generate(engine.core.target, [prompt], n).token_ids[0], skip_special_tokens=True)


def _together(engine, base: str, prompts: list[list[int]], n: int) -> None:
    """Greedy completions of ``prompts`` sent at once: each 200 and equal to ``generate``'s text."""

    async def send():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[client.post(base + "/v1/completions", json={
                "prompt": p, "max_tokens": n, "temperature": 0}) for p in prompts])

    for r, p in zip(asyncio.run(send()), prompts):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _expected(engine, p, n)


def test_requests_during_a_lazy_warmup_are_served_exactly(tmp_path):
    """``lazy``: /health is ok while the background still compiles (its progress in /health and /metrics);
    requests sent then, two at once, are answered exactly (drafted lengths not compiled yet run as plain
    rounds), never with a 5xx; the warmup then finishes while the server serves."""
    engine, uv, thread, base = _tiny_server(tmp_path, "lazy")
    try:
        warmup = httpx.get(base + "/health").json()["warmup"]
        assert warmup["pending"] > 0 and warmup["compiled"] < warmup["planned"]
        metrics = httpx.get(base + "/metrics").text
        assert "dspine_warmup_pending" in metrics and "dspine_process_memory_maps" in metrics
        prompts = [[1, 5, 9, 13], [1, 7, 7, 30, 31, 2, 8]]
        _together(engine, base, prompts, 24)
        deadline = time.time() + 600
        while httpx.get(base + "/health").json()["warmup"]["pending"]:
            assert time.time() < deadline, "the background warmup never finished"
            time.sleep(0.5)
        r = _complete(base, prompts[0], 30)
        assert r.json()["choices"][0]["text"] == _expected(engine, prompts[0], 30)
    finally:
        stop(engine, uv, thread)


def test_without_warmup_two_requests_compile_each_program_once(tmp_path):
    """``none``: nothing compiled before serving; two requests arriving together that need the same
    programs compile each of them once (no program compiled twice, none evicted)."""
    engine, uv, thread, base = _tiny_server(tmp_path, "none")
    try:
        core = engine.core
        assert len(core.programs) == 0
        _together(engine, base, [[1, 5, 9, 13], [1, 6, 10, 14]], 12)
        stats = core.programs.stats
        assert stats.compiles == len(core.programs) > 0 and stats.evictions == 0
    finally:
        stop(engine, uv, thread)


def test_a_compile_failure_fails_its_request_and_the_server_answers_the_next(tmp_path):
    """An injected compile failure of the decode step: that request gets a 500 JSON error, the server
    stays up (/health ok) and answers the next request exactly."""
    failures = [True]

    def configure(core):
        core.programs.fail_next = lambda name: name == "step" and bool(failures) and failures.pop()

    engine, uv, thread, base = _tiny_server(tmp_path, "none", configure)
    try:
        r = _complete(base, [1, 5, 9, 13], 8)
        assert r.status_code == 500 and "injected compile failure" in r.json()["error"]["message"]
        assert httpx.get(base + "/health").json()["status"] == "ok"
        r = _complete(base, [1, 5, 9, 13], 8)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _expected(engine, [1, 5, 9, 13], 8)
        assert engine.core.programs.stats.failures == 1
        assert 'dspine_requests_total{endpoint="completions",status="error"} 1' in httpx.get(base + "/metrics").text
    finally:
        stop(engine, uv, thread)
