"""Server startup: it listens before the engine is built and compiled, says "starting" (503) on /health and
to requests until the loader returns, then "ok"; a loader that fails is reported, not hung on."""

from __future__ import annotations

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
        assert r.json() == {"status": "ok"} and seen <= {"starting"}

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
