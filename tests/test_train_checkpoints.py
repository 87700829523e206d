"""The shipped SmolLM2 drafters (checkpoints/smollm2-135m-{dspine,dflash}-b16): they load with
``load_drafter``, speculative decoding with them is greedy-exact, and the DFlash export loads in z-lab's
``dflash`` reference package with every tensor consumed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspine_jax import generate, load_drafter, load_target, load_tokenizer, speculative_generate
from dspine_jax.generate import encode_prompt

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CKPTS = {kind: ROOT / "checkpoints" / f"smollm2-135m-{kind}-b16" for kind in ("dspine", "dflash")}


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m-instruct"), load_tokenizer("smollm2-135m-instruct")


@pytest.mark.parametrize("kind", ["dspine", "dflash"])
def test_shipped_drafter_loads_and_is_greedy_exact(smollm2, kind):
    if not (CKPTS[kind] / "model.safetensors").exists():
        pytest.skip(f"{CKPTS[kind]} not shipped")
    target, tokenizer = smollm2
    drafter = load_drafter(CKPTS[kind], target)
    assert drafter.config.kind == kind and drafter.config.block_size == 16 and drafter.config.num_layers == 5
    assert (CKPTS[kind] / "model.safetensors").stat().st_size <= 60 * 2**20
    prompts = [encode_prompt(tokenizer, "Write a Python function that returns the sum of a list.", chat=True),
               encode_prompt(tokenizer, "What is 17 times 3?", chat=True)]  # fmt: skip
    ref = generate(target, prompts, 32)
    spec = speculative_generate(target, drafter, prompts, 32)
    assert spec.token_ids == ref.token_ids
    assert spec.mean_acceptance >= 1.0


def test_shipped_dflash_loads_in_zlab_reference():
    dflash_model = pytest.importorskip("dflash.model")
    if not (CKPTS["dflash"] / "model.safetensors").exists():
        pytest.skip("dflash checkpoint not shipped")
    model, info = dflash_model.DFlashDraftModel.from_pretrained(str(CKPTS["dflash"]), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.block_size == 16
