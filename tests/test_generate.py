"""Autoregressive ``generate``: greedy equality with HF, stop handling, seeded and statistical sampling."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dspine_jax import generate, init_drafter, load_target, speculative_generate
from dspine_jax.decoding import planning
from dspine_jax.decoding.planning import max_new_tokens_cap

cli = importlib.import_module("dspine_jax.generate")  # the module (the package attribute is the function)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 55))]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_batch_equals_hf(tiny_models, family):
    model_dir, hf = tiny_models[family]
    result = generate(load_target(model_dir), PROMPTS, max_new_tokens=24, stop_ids=[])
    for prompt, got in zip(PROMPTS, result.token_ids):
        assert got == hf_greedy(hf, prompt, 24)
    assert result.finish_reasons == ["length"] * 3
    assert result.num_tokens == 72 and result.tokens_per_second > 0


def test_stop_ids_end_rows_independently(tiny_models):
    model_dir, hf = tiny_models["llama"]
    target = load_target(model_dir)
    free = generate(target, PROMPTS, max_new_tokens=16, stop_ids=[]).token_ids
    # Stop on the 4th token of row 0: that row ends there (stop token included), the others go on
    # unless they meet the same id.
    stop = free[0][3]
    result = generate(target, PROMPTS, max_new_tokens=16, stop_ids=[stop])
    for row, tokens in zip(free, result.token_ids):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert tokens == row[:cut]
    assert result.finish_reasons[0] == "stop"
    # The model's own EOS ids are the default stop ids.
    assert target.config.eos_token_ids == (2,)


def test_capacity_limit_is_reported(tiny_models):
    model_dir, _ = tiny_models["qwen3"]
    target = load_target(model_dir)  # max_position_embeddings = 512
    # A batch whose short row can hold all 200 new tokens; the long row cannot.
    result = generate(target, [list(range(1, 120)) * 4, [3, 4]], max_new_tokens=200, stop_ids=[])
    # 476 prompt tokens + up to 512 - 476 = 36 cache slots: the last token is returned, not fed.
    assert len(result.token_ids[0]) == 512 - 476 + 1 and len(result.token_ids[1]) == 200
    assert result.finish_reasons == ["capacity", "length"]


def test_max_new_tokens_beyond_the_context_is_rejected(tiny_models):
    """No row could ever produce that many tokens: an error naming the cap, not a long silent run."""
    target = load_target(tiny_models["llama"][0])  # 512 positions
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4)
    # The shortest row (500 tokens) leaves 12 slots: 13 tokens (the last is returned, not fed back).
    prompts = [[1] * 500, [1] * 505]
    for run in (generate, functools.partial(speculative_generate, drafter=drafter)):
        with pytest.raises(ValueError, match=r"max_new_tokens=14 .*at most 13\b"):
            run(target, prompt_ids=prompts, max_new_tokens=14)
    assert max_new_tokens_cap([500, 505], 512) == 13


def test_prompt_bucket_wider_than_the_cache(tiny_models):
    """A position limit that is not a multiple of the prompt bucket (32), with the prompt in the last
    bucket: the padded prompt (64 wide) must not be written past the 40-slot cache."""
    model_dir, hf = tiny_models["llama"]
    target = load_target(model_dir)
    target = target.replace(config=dataclasses.replace(target.config, max_position_embeddings=40))
    prompt = list(range(20, 55))  # 35 tokens: positions 35…39 remain, so up to 6 new tokens
    ar = generate(target, [prompt], max_new_tokens=6, stop_ids=[])
    assert ar.token_ids[0] == hf_greedy(hf, prompt, 6) and ar.finish_reasons == ["length"]
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4)
    spec = speculative_generate(target, drafter, [prompt], max_new_tokens=6, stop_ids=[])
    assert spec.token_ids == ar.token_ids


@contextlib.contextmanager
def compiles_seen():
    """The seconds of every backend compilation while the block runs, as they happen."""
    import jax

    compiles: list[float] = []

    def listener(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_compilation_is_timed_apart(tiny_models):
    """``compile_seconds`` holds the compilation a first call pays; ``seconds`` (and tokens/s) hold only
    prefill + decode, so a second call of the same shapes reports no compilation and a similar speed."""
    target = load_target(tiny_models["qwen3"][0])
    with compiles_seen() as compiles:
        first = generate(target, [[9, 8, 7]], max_new_tokens=11, stop_ids=[])  # a shape no other test uses
        compiled = sum(compiles)
        second = generate(target, [[9, 8, 6]], max_new_tokens=11, stop_ids=[])
    assert compiled > 0 and sum(compiles) == compiled  # the second call compiled nothing
    assert first.compile_seconds >= compiled  # all of it inside compile_seconds ...
    assert first.seconds < first.compile_seconds  # ... none in the decode timing (tiny model: decode is fast)
    assert second.compile_seconds < first.compile_seconds / 4
    assert first.tokens_per_second == pytest.approx(first.num_tokens / first.seconds)


def test_a_compiled_signature_is_not_lowered_again():
    """``CompileTimer.compile`` lowers a program once per signature (shapes, dtypes, static values) in a process;
    a new shape, dtype or static value lowers again; NumPy leaves key by shape and dtype too (a prompt's tokens, the
    carried prior), a Python scalar (weakly typed) is lowered every time."""
    import jax
    import jax.numpy as jnp

    from dspine_jax.decoding.planning import CompileTimer

    class Counted:  # a jitted function that counts its lowerings
        def __init__(self) -> None:
            self.jitted, self.lowered = jax.jit(lambda x, *, k: x * k, static_argnames="k"), 0

        def lower(self, *args, **kwargs):
            self.lowered += 1
            return self.jitted.lower(*args, **kwargs)

    fn, clock = Counted(), CompileTimer()
    clock.compile(fn, jnp.ones(3), k=2)
    clock.compile(fn, jnp.zeros(3), k=2)  # other values, the same signature
    CompileTimer().compile(fn, jnp.ones(3), k=2)  # another call's timer: the process compiled it already
    assert fn.lowered == 1
    clock.compile(fn, jnp.ones(4), k=2)
    clock.compile(fn, jnp.ones(3, jnp.int32), k=2)
    clock.compile(fn, jnp.ones(3), k=3)
    assert fn.lowered == 4
    clock.compile(fn, np.ones(3), k=2)  # float64 on the host: its own key
    clock.compile(fn, np.zeros(3), k=2)
    assert fn.lowered == 5
    clock.compile(fn, np.ones(4), k=2)
    clock.compile(fn, np.int32(2), k=2)
    clock.compile(fn, np.int32(3), k=2)
    assert fn.lowered == 7
    clock.compile(fn, 2.0, k=2)
    clock.compile(fn, 2.0, k=2)
    assert fn.lowered == 9


def test_a_speculative_call_compiles_nothing_while_it_decodes(tiny_models, monkeypatch):
    """Every program ``speculative_generate`` may run (each length's, the peek's, the policy's first choice) is
    compiled before the decode clock starts: a first call's decode time holds no compilation."""
    from dspine_jax.decoding.decoder import Decoder

    at_decode: list[int] = []  # compilations so far, at each step of the decode loop and after it
    plan, store = Decoder.plan, Decoder.store

    def counted_plan(self, *args, **kwargs):  # each step of the decode loop
        at_decode.append(len(compiles))
        return plan(self, *args, **kwargs)

    def counted_store(self):  # right after the decode clock stops
        at_decode.append(len(compiles))
        return store(self)

    target = load_target(tiny_models["qwen3"][0])
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=4, seed=11)
    monkeypatch.setattr(Decoder, "plan", counted_plan)
    monkeypatch.setattr(Decoder, "store", counted_store)
    with compiles_seen() as compiles:  # (read by counted_plan / counted_store as they run)
        result = speculative_generate(target, drafter, [[4, 9, 2, 7, 7]], max_new_tokens=13, stop_ids=[],
                                      verify_costs={1: 1.0, 2: 1.1, 4: 1.2})  # fmt: skip
    assert compiles and len(at_decode) >= 3 and len(set(at_decode)) == 1, at_decode  # (several segments)
    assert len(result.token_ids[0]) == 13


def test_a_slow_compile_says_so(tiny_models, monkeypatch, caplog):
    target = load_target(tiny_models["qwen3"][0])
    caplog.set_level("INFO", logger="dspine_jax")
    monkeypatch.setattr(planning, "COMPILE_NOTICE_SECONDS", 0.0)  # every compile counts as slow
    monkeypatch.setattr(planning, "_COMPILED", set())  # (earlier tests may have compiled these shapes)
    generate(target, [[9, 8, 7, 6]], max_new_tokens=13, stop_ids=[])
    assert [r.getMessage() for r in caplog.records].count(
        "compiling … (first run of these shapes; later runs reuse the compiled programs)") == 1  # once per call
    caplog.clear()
    monkeypatch.setattr(planning, "COMPILE_NOTICE_SECONDS", 60.0)
    generate(target, [[9, 8, 7, 6]], max_new_tokens=13, stop_ids=[])
    assert not caplog.records


class _FakeTokenizer:
    """Just enough tokenizer for the CLI on a tiny model without tokenizer files: one id per character."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(c) % 100 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def test_cli_caps_max_new_tokens_and_reports_compile_time(tiny_models, tmp_path, monkeypatch, capsys):
    import json
    import shutil

    import dspine_jax.models.tokenizer

    model_dir = tmp_path / "short"
    shutil.copytree(tiny_models["llama"][0], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    monkeypatch.setattr(dspine_jax.models.tokenizer, "load_tokenizer", lambda path: _FakeTokenizer())
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)  # keep this process's JAX config
    cli.main(["--model", str(model_dir), "--prompt", "ten chars!", "--max-new-tokens", "100000", "--json"])
    out, err = capsys.readouterr()
    assert "--max-new-tokens 100000" in err and "capped at 31" in err  # 40 positions - 10 prompt + 1
    record = json.loads(out)
    assert record["num_tokens"] <= 31 and len(record["token_ids"]) == record["num_tokens"]
    assert record["compile_seconds"] > 0 and record["seconds"] > 0
    assert record["tokens_per_second"] == pytest.approx(record["num_tokens"] / record["seconds"], rel=0.02)


def test_seeded_sampling_is_reproducible(tiny_models):
    target = load_target(tiny_models["qwen3"][0])
    kwargs = dict(max_new_tokens=12, temperature=1.3, top_p=0.9, top_k=20, stop_ids=[])
    a = generate(target, PROMPTS, seed=7, **kwargs).token_ids
    b = generate(target, PROMPTS, seed=7, **kwargs).token_ids
    c = generate(target, PROMPTS, seed=8, **kwargs).token_ids
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 10, 1.0), (1.5, 0, 0.8), (2.0, 12, 0.9)]
)
def test_first_token_follows_processed_softmax(tiny_models, temperature, top_k, top_p):
    """Many rows of one prompt: the first sampled token's histogram matches HF's warped softmax.

    Chi-square goodness of fit at significance 1e-4 (a correct sampler fails once in 10,000 runs per
    case), plus zero samples outside the warpers' support.
    """
    model_dir, hf = tiny_models["llama"]
    prompt = [7, 3, 9, 1]
    n = 4000
    result = generate(load_target(model_dir), [prompt] * n, max_new_tokens=1, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=11, stop_ids=[])
    counts = np.bincount([row[0] for row in result.token_ids], minlength=128)

    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[:, -1].double()
    ids = torch.tensor([prompt])
    logits = TemperatureLogitsWarper(temperature)(ids, logits)
    if top_k:
        logits = TopKLogitsWarper(top_k)(ids, logits)
    if top_p < 1:
        logits = TopPLogitsWarper(top_p)(ids, logits)
    probs = torch.softmax(logits, -1)[0].numpy()

    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * n
    # Merge rare categories so every expected count is >= 5 (chi-square validity).
    order = np.argsort(expected)
    obs, exp = counts[support][order], expected[order]
    merged_obs, merged_exp, acc_o, acc_e = [], [], 0, 0.0
    for o, e in zip(obs, exp):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            merged_obs.append(acc_o), merged_exp.append(acc_e)
            acc_o, acc_e = 0, 0.0
    if acc_e:
        merged_obs[-1] += acc_o
        merged_exp[-1] += acc_e
    assert len(merged_exp) >= 2, "degenerate distribution: the test would prove nothing"
    p_value = stats.chisquare(merged_obs, merged_exp).pvalue
    assert p_value > 1e-4, f"sampled histogram does not follow the processed softmax (p={p_value:.2e})"
