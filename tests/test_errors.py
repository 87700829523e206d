"""Bad input gets a clear error."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from dspine_jax import generate, load_target
from dspine_jax.models.config import UnsupportedModelError
from dspine_jax.models.weights import CheckpointError


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


class _Loaded(Exception):
    """Raised by the stubbed loaders: the CLI got past argument checking."""


@pytest.fixture
def cli_without_loading(monkeypatch):
    """``python -m dspine_jax.generate``'s main with every loader stubbed to raise ``_Loaded``."""
    import importlib

    import dspine_jax.models.hub
    import dspine_jax.models.target
    import dspine_jax.models.tokenizer

    def loaded(*args, **kwargs):
        raise _Loaded

    for module, name in [(dspine_jax.models.target, "load_target"), (dspine_jax.models.tokenizer, "load_tokenizer"),
                         (dspine_jax.models.hub, "resolve_model_dir")]:
        monkeypatch.setattr(module, name, loaded)
    cli = importlib.import_module("dspine_jax.generate")
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)  # keep this process's JAX config
    return lambda *args: cli.main(["--model", "smollm2-135m-instruct", "--prompt", "hi", *args])


@pytest.mark.parametrize(
    "args, match",
    [
        (["--max-new-tokens", "-1"], r"--max-new-tokens: .*-1"),
        (["--max-new-tokens", "0"], r"--max-new-tokens"),
        (["--draft", "/no/such/drafter"], r"--draft: .*/no/such/drafter.*(not|no)"),
        (["--draft", "{empty}"], r"--draft: .*config\.json"),
        (["--draft", "init:medusa"], r"--draft: .*init:dspine"),
        (["--draft", "init:dspine:1"], r"--draft"),
        (["--draft", "init:dspine", "--block-size", "1"], r"--block-size: .*>= 2"),
        (["--draft", "init:dspine:8", "--block-size", "9"], r"--block-size: .*9.*8"),
        (["--draft", "checkpoints/smollm2-135m-dspine-b8", "--block-size", "9"], r"--block-size: .*9.*8"),
        (["--block-size", "4"], r"--block-size .*--draft"),
        (["--sps-table", "t.json"], r"--sps-table .*--draft"),
        (["--draft", "init:dspine", "--sps-table", "/no/such/table.json"], r"--sps-table: .*/no/such/table\.json"),
        (["--temperature", "-0.5"], r"temperature"),
        (["--temperature", "nan"], r"temperature"),
        (["--top-p", "0"], r"top_p"),
        (["--top-p", "1.5"], r"top_p"),
        (["--top-k", "-1"], r"top_k"),
    ],
)
def test_cli_rejects_bad_arguments_before_loading(cli_without_loading, capsys, tmp_path, monkeypatch, args, match):
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parent.parent)  # the shipped checkpoints/ are relative
    (tmp_path / "empty").mkdir()
    args = [a.replace("{empty}", str(tmp_path / "empty")) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        cli_without_loading(*args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert re.search(match, err), err
    assert "Traceback" not in err


def test_cli_accepts_good_arguments_then_loads(cli_without_loading, monkeypatch):
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parent.parent)
    for args in (["--max-new-tokens", "5", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5"],
                 ["--draft", "init:dflash:8", "--block-size", "8"],
                 ["--draft", "checkpoints/smollm2-135m-dspine-b8", "--block-size", "8"]):
        with pytest.raises(_Loaded):
            cli_without_loading(*args)


def test_cli_names_a_missing_package_in_one_line(cli_without_loading, monkeypatch, capsys):
    import dspine_jax.models.target

    def missing(*args, **kwargs):
        raise ImportError("apply_chat_template requires jinja2 to be installed")

    monkeypatch.setattr(dspine_jax.models.target, "load_target", missing)
    with pytest.raises(SystemExit) as exit_info:
        cli_without_loading()
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert err == ("error: a package this command needs is missing: "
                   "apply_chat_template requires jinja2 to be installed\n")
