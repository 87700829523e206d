"""The soak test at CI size (``experiments/serving/soak.py``): 16 clients, mixed greedy / sampled / streamed /
hung-up / malformed chat requests and multi-turn conversations against an in-process tiny server with the
prefix cache on and a lazy warmup; every greedy completion equals ``generate``'s, malformed requests get a 4xx,
nothing is left running and the server stays healthy. Bounded: a request timeout and a deadline."""

from __future__ import annotations

import asyncio
import pathlib
import sys
import time

import httpx
from conftest import make_tiny_hf_model, require

require("uvicorn")
require("starlette")

from test_serve import make_tiny_tokenizer, start_uvicorn  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments" / "serving"))
import soak  # noqa: E402

from dspine_jax import init_drafter  # noqa: E402
from dspine_jax.decoding.autoregressive import generate  # noqa: E402
from dspine_jax.models.target import load_target  # noqa: E402
from dspine_jax.models.tokenizer import load_tokenizer  # noqa: E402
from dspine_jax.serve.engine import EngineCore  # noqa: E402
from dspine_jax.serve.server import ServerConfig, build_app  # noqa: E402

PREFIX_BUDGET = 1 << 24


def test_soak_at_ci_size(tmp_path):
    model_dir, _ = make_tiny_hf_model("llama", tmp_path / "tiny", tie_word_embeddings=True)
    make_tiny_tokenizer(model_dir)
    target, tokenizer = load_target(model_dir), load_tokenizer(model_dir)
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=8, seed=3)

    def load():
        core = EngineCore(target, drafter, num_slots=4, context_length=160, max_prompt_bucket=64,
                          prefix_cache_bytes=PREFIX_BUDGET)
        core.warmup("lazy")
        return core, tokenizer

    app, engine = build_app(load, ServerConfig(model_name="tiny"), max_queue=64)
    engine.start()
    uv, thread, base = start_uvicorn(app)
    try:
        assert engine.ready.wait(300)
        turns = [" ".join(f"w{7 + (i * 13 + j * 5) % 110}" for j in range(3 + i % 6)) for i in range(12)]
        start = time.monotonic()
        result = asyncio.run(soak.soak(base, "tiny", requests=64, clients=16, seed=1, timeout=240, deadline_s=600,
                                       max_tokens=(4, 12), turns=turns))
        assert time.monotonic() - start < 900

        def reference(messages, n):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            return tokenizer.decode(generate(target, [ids], n).token_ids[0], skip_special_tokens=True)

        verdict = soak.check(result, reference, base, PREFIX_BUDGET)
        assert verdict["requests"] == verdict["planned"] == 64
        assert verdict["greedy_checked"] >= 10 and verdict["malformed"] >= 2 and verdict["cancelled"] >= 1
        assert verdict["first_mismatch"] is None, verdict["first_mismatch"]
        assert soak.passed(verdict), {k: v for k, v in verdict.items() if k != "first_mismatch"}
        multi_turn = [r for r in result["records"] if r["kind"] != "malformed" and len(r["messages"]) > 1]
        assert multi_turn  # conversations resent their history (shared prefixes)
        assert not any(engine.core.occupied) and engine.core.num_prefilling() == 0
        assert httpx.get(base + "/health").json()["status"] == "ok"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        engine.stop()
