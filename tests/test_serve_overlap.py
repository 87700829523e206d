"""The scheduler streams a step's tokens while the device runs the next one (``EngineCore.launch`` /
``collect``). What that must not break: a slot freed by a stop string while a step is in flight is released
only after that step, the step's tokens for it reach nobody (not the next request in the slot), and the
prefix-cache entry it leaves matches its row. Driven through ``AsyncEngine`` directly (no HTTP)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import make_tiny_hf_model
from test_serve import make_tiny_tokenizer

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.serve.engine import EngineCore, SlotParams
from dspine_jax.serve.metrics import Metrics
from dspine_jax.serve.scheduler import AsyncEngine, GenRequest


async def _collect(req: GenRequest) -> tuple[str, str]:
    text = []
    while True:
        event = await req.queue.get()
        if event[0] == "text":
            text.append(event[1])
        elif event[0] == "done":
            return "".join(text), event[1]
        else:
            raise AssertionError(event)


def _run(engine: AsyncEngine, requests: list[tuple[list[int], int, list[str]]]) -> list[tuple[str, str]]:
    async def main():
        loop = asyncio.get_running_loop()
        reqs = [GenRequest(ids, n, SlotParams(), stops, loop, "test") for ids, n, stops in requests]
        for r in reqs:
            engine.submit(r)
        return await asyncio.gather(*[_collect(r) for r in reqs])

    return asyncio.run(main())


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_stop_string_during_an_overlapped_step(tmp_path, monkeypatch, family):
    if family == "llama":
        model_dir, _ = make_tiny_hf_model("llama", tmp_path / "tiny", tie_word_embeddings=True)
    else:
        from test_hybrid import make_tiny_hybrid

        model_dir = make_tiny_hybrid(family, tmp_path / "tiny", seed=0)[0]
    make_tiny_tokenizer(model_dir)
    target, tok = load_target(model_dir), load_tokenizer(model_dir)
    # One slot: the second request can only start in the slot the first one's stop string frees. The prefix
    # cache keeps that row; the third prompt extends the first request's prompt and text.
    core = EngineCore(target, None, num_slots=1, context_length=128, stop_ids=[], max_prompt_bucket=32,
                      max_rounds=4, prefix_cache_bytes=1 << 28)  # fmt: skip
    engine = AsyncEngine(lambda: (core, tok), Metrics(), max_queue=8)
    delivered_in_flight = []  # for each delivery: was a step in flight?
    deliver = AsyncEngine._deliver

    def recording(self, *args):
        delivered_in_flight.append(self.in_flight)
        return deliver(self, *args)

    monkeypatch.setattr(AsyncEngine, "_deliver", recording)
    engine.start()
    assert engine.ready.wait(60)
    try:
        first, second = tok.encode("w9 w17 w33 w41"), tok.encode("w70 w5 w88")

        def ref(ids: list[int], n: int) -> str:
            return tok.decode(generate(target, [ids], n, stop_ids=[]).token_ids[0], skip_special_tokens=True)

        full = ref(first, 24)
        # A stop string first met past the first step's 4 rounds: found while a later step is in flight.
        starts = [i for i in range(len(full)) if full[i] != " " and (i == 0 or full[i - 1] == " ")]
        stop = next(w for i, w in zip(starts, full.split()) if i >= starts[6] and full.find(w) == i)
        cut = full[: full.find(stop)]
        (a_text, a_reason), (b_text, b_reason) = _run(engine, [(first, 24, [stop]), (second, 12, [])])
        assert (a_text, a_reason) == (cut, "stop")
        assert (b_text, b_reason) == (ref(second, 12), "length")
        assert any(delivered_in_flight), "no step's tokens were streamed while the next step ran"
        third = first + tok.encode(cut)
        ((c_text, _),) = _run(engine, [(third, 8, [])])
        assert c_text == ref(third, 8)
        if family == "llama":  # a dense row serves any prefix of itself
            assert core.prefix_stats().hits >= 1
    finally:
        engine.stop()
