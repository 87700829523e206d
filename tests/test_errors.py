"""Bad input gets a clear error."""

from __future__ import annotations

import json
import shutil

import pytest

from dspine_jax import generate, load_target
from dspine_jax.config import UnsupportedModelError
from dspine_jax.weights import CheckpointError


def test_unknown_path_or_alias():
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        load_target("no-such-model-anywhere")


def test_unsupported_model_type(tiny_models, tmp_path):
    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny_models["llama"][0], model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported.*llama.*qwen3"):
        load_target(model_dir)


def test_corrupt_safetensors(tiny_models, tmp_path):
    model_dir = tmp_path / "corrupt"
    shutil.copytree(tiny_models["llama"][0], model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated download
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_target(model_dir)


def test_missing_and_misshapen_tensors(tiny_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    model_dir = tmp_path / "bad"
    shutil.copytree(tiny_models["qwen3"][0], model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_target(model_dir)
    tensors["model.layers.1.self_attn.k_norm.weight"] = tensors["model.norm.weight"]  # wrong shape
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_norm\.weight.*shape"):
        load_target(model_dir)


def test_prompt_longer_than_capacity(tiny_models):
    target = load_target(tiny_models["llama"][0])  # 512 positions
    with pytest.raises(ValueError, match="capacity"):
        generate(target, [[1] * 600], max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_invalid_sampling_parameters(tiny_models, kwargs, match):
    target = load_target(tiny_models["llama"][0])
    with pytest.raises(ValueError, match=match):
        generate(target, [[1, 2, 3]], **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("prompts", [[], [[]], "hello", [[1, 2, 999]]])
def test_invalid_prompts(tiny_models, prompts):
    target = load_target(tiny_models["llama"][0])
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(target, prompts, max_new_tokens=4)


def test_invalid_dtype(tiny_models):
    with pytest.raises(ValueError, match="dtype"):
        load_target(tiny_models["llama"][0], dtype="float8")
