"""Autoregressive ``generate``: greedy equality with HF, stop handling, seeded and statistical sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dspine_jax import generate, load_target

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
    result = generate(target, [list(range(1, 120)) * 4], max_new_tokens=200, stop_ids=[])
    # 476 prompt tokens + up to 512 - 476 = 36 cache slots: the last token is returned, not fed.
    assert len(result.token_ids[0]) == 512 - 476 + 1
    assert result.finish_reasons == ["capacity"]


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
