"""A server holding two drafters (``serve/drafter_choice.py``), chosen per request by its ``drafter`` field:
greedy completions through either drafter (and the default) equal ``generate``, alone and mixed at
concurrency 4 with more requests per drafter than its engine has slots; bad names are 400s; ``--draft``
flags parse as documented."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from conftest import make_tiny_hf_model, require
from test_serve import make_tiny_tokenizer, start_uvicorn

openai = require("openai")

from dspine_jax.serve.drafter_choice import DrafterEngines, parse_draft_flags  # noqa: E402

PROMPTS = [" ".join(f"w{7 + (i * 11 + j * 5) % 120}" for j in range(3 + i % 4)) for i in range(6)]
MAX_TOKENS = 16
SLOTS = 2  # per drafter's engine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dspine_jax.drafters.io import init_drafter
    from dspine_jax.models.target import load_target
    from dspine_jax.models.tokenizer import load_tokenizer
    from dspine_jax.serve.engine import EngineCore
    from dspine_jax.serve.server import ServerConfig, build_app

    model_dir, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("drafters") / "tiny", tie_word_embeddings=True)
    make_tiny_tokenizer(model_dir)
    target = load_target(model_dir)
    tokenizer = load_tokenizer(model_dir)
    drafters = {"code": init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=8, seed=3),
                "prose": init_drafter(target, "dflash", num_layers=1, block_size=4, seed=5)}  # fmt: skip
    cores = {name: EngineCore(target, d, num_slots=SLOTS, context_length=128, max_prompt_bucket=32, verify=4,
                              prefix_cache_bytes=1 << 24) for name, d in drafters.items()}  # fmt: skip
    engines = DrafterEngines(cores)
    app, engine = build_app(lambda: (engines, tokenizer), ServerConfig(model_name="tiny"), max_queue=32)
    engine.start()
    assert engine.ready.wait(60)
    uv, thread, base = start_uvicorn(app)
    yield dict(base=base, target=target, tokenizer=tokenizer, engines=engines,
               client=openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300))
    uv.should_exit = True
    thread.join(timeout=10)
    engine.stop()


@pytest.fixture(scope="module")
def expected(server) -> dict[str, str]:
    from dspine_jax.decoding.autoregressive import generate

    tok = server["tokenizer"]
    out = generate(server["target"], [tok.encode(p) for p in PROMPTS], MAX_TOKENS)
    return {p: tok.decode(ids, skip_special_tokens=True) for p, ids in zip(PROMPTS, out.token_ids)}


def complete(server, prompt: str, drafter: str | None) -> str:
    extra = {} if drafter is None else {"drafter": drafter}
    out = server["client"].completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body=extra)  # fmt: skip
    return out.choices[0].text


def test_each_drafter_and_the_default_decode_like_generate(server, expected):
    for prompt, drafter in zip(PROMPTS[:3], ("code", "prose", None)):
        assert complete(server, prompt, drafter) == expected[prompt]


def test_mixed_requests_beyond_each_engines_slots(server, expected):
    """Six requests at once, four for one drafter (two slots): they wait for their own engine's slots."""
    jobs = [(p, "prose" if i < 4 else "code") for i, p in enumerate(PROMPTS)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda job: complete(server, *job), jobs))
    assert got == [expected[p] for p, _ in jobs]
    engines = server["engines"]
    assert engines.num_running() == 0 and engines.free_slot("prose") == SLOTS and engines.free_slot("code") == 0


@pytest.mark.parametrize("drafter, message", [("poetry", "unknown drafter 'poetry'; this server holds code, prose"),
                                              (3, "'drafter' must be a string")])  # fmt: skip
def test_bad_drafter_names_are_400(server, drafter, message):
    r = httpx.post(server["base"] + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "drafter": drafter})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_draft_flags():
    assert parse_draft_flags(None) is None
    assert parse_draft_flags(["checkpoints/x"]) == {"default": "checkpoints/x"}
    assert parse_draft_flags(["org/name@v1"]) == {"default": "org/name@v1"}
    assert parse_draft_flags(["code=a", "prose=init:dflash2:8"]) == {"code": "a", "prose": "init:dflash2:8"}
    for bad, why in ((["a", "b=c"], "each must be NAME=DIR"), (["x=a", "x=b"], "given twice")):
        with pytest.raises(ValueError, match=why):
            parse_draft_flags(bad)
