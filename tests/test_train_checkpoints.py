"""The shipped SmolLM2 drafters (checkpoints/smollm2-135m-{dspine,dflash,dspark,eagle3,mtp}-b8): they load with
``load_drafter``, speculative decoding with them is greedy-exact, and the DFlash export loads in z-lab's
``dflash`` reference package with every tensor consumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import missing_reference, require

from dspine_jax import generate, load_drafter, load_target, load_tokenizer, speculative_generate
from dspine_jax.drafters.io import default_mask_token_id
from dspine_jax.models.tokenizer import encode_prompt

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CKPTS = {kind: ROOT / "checkpoints" / f"smollm2-135m-{kind}-b8" for kind in ("dspine", "dflash")}


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m-instruct"), load_tokenizer("smollm2-135m-instruct")


def shipped(kind: str) -> Path:
    if not (CKPTS[kind] / "model.safetensors").exists():
        missing_reference(f"shipped checkpoint {CKPTS[kind]}")
    return CKPTS[kind]


@pytest.mark.parametrize("kind", ["dspine", "dflash"])
def test_shipped_drafter_loads_and_is_greedy_exact(smollm2, kind):
    target, tokenizer = smollm2
    drafter = load_drafter(shipped(kind), target)
    assert drafter.config.kind == kind and drafter.config.block_size == 8 and drafter.config.num_layers == 2
    # Trained with the dedicated mask token (not the pad/EOS id 2 the first drafters used).
    assert drafter.config.mask_token_id == default_mask_token_id(target, tokenizer) == 16
    assert (CKPTS[kind] / "model.safetensors").stat().st_size <= 60 * 2**20
    prompts = [encode_prompt(tokenizer, "Write a Python function that returns the sum of a list.", chat=True),
               encode_prompt(tokenizer, "What is 17 times 3?", chat=True)]  # fmt: skip
    ref = generate(target, prompts, 32)
    # The drafter's whole block, pinned: under verify="auto" the lengths follow the machine's timings, and
    # plain decode steps (T = 1, acceptance 1 by definition) would dilute the acceptance asserted below.
    spec = speculative_generate(target, drafter, prompts, 32, verify=8)
    assert spec.token_ids == ref.token_ids
    assert {t for row in spec.verify_lengths for t in row} == {8}
    # A trained drafter really drafts (held-out greedy τ at verify 8: 1.82 DSpine / 1.40 DFlash); a fresh drafter, or
    # this one with a wrong mask token or mis-loaded weights, gets ~1.0.
    assert spec.mean_acceptance > 1.2


def test_smollm2_mask_token_is_dedicated(smollm2):
    """SmolLM2's pad id 2 is ``<|im_end|>``, its EOS / end of turn, which the drafter also reads as anchor and
    context; its vocabulary has no unused row, so new drafters take its last special token no chat uses."""
    target, tokenizer = smollm2
    assert tokenizer.convert_ids_to_tokens(target.config.pad_token_id) == "<|im_end|>" == tokenizer.eos_token
    mask = default_mask_token_id(target, tokenizer)
    assert (mask, tokenizer.convert_ids_to_tokens(mask)) == (16, "<empty_output>")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert mask not in tokenizer.encode(chat)


def test_shipped_dspine_config_records_its_training_warmup():
    """The card's reproduce command is the run's; the config's training knobs must be the ones it used."""
    readme = (shipped("dspine") / "README.md").read_text().split()
    warmup = int(readme[readme.index("--alignment-warmup-steps") + 1])
    config = json.loads((CKPTS["dspine"] / "config.json").read_text())
    assert config["dspine_config"]["alignment_warmup_steps"] == warmup


def test_shipped_dflash_loads_in_zlab_reference():
    dflash_model = require("dflash.model")
    model, info = dflash_model.DFlashDraftModel.from_pretrained(str(shipped("dflash")), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.block_size == 8


SEQUENTIAL_AND_DSPARK = {kind: ROOT / "checkpoints" / f"smollm2-135m-{kind}-b8" for kind in ("dspark", "eagle3", "mtp")}


@pytest.mark.parametrize("kind", sorted(SEQUENTIAL_AND_DSPARK))
def test_shipped_speculators_drafters_are_greedy_exact(smollm2, kind):
    """The DSpark, EAGLE-3 and MTP drafters of the equal-budget comparison (speculators layout, bf16): each
    loads through ``--draft``'s loader, fits the size limit, decodes exactly and really drafts."""
    from dspine_jax.decoding.proposers import as_proposer
    from dspine_jax.drafters.io import load_draft

    path = SEQUENTIAL_AND_DSPARK[kind]
    if not (path / "model.safetensors").exists():
        missing_reference(f"shipped checkpoint {path}")
    assert (path / "model.safetensors").stat().st_size <= 60 * 2**20
    assert json.loads((path / "config.json").read_text())["speculators_model_type"] == kind
    target, tokenizer = smollm2
    draft = load_draft(str(path), target)
    assert as_proposer(draft).block_limit == (9 if kind == "dspark" else 8)  # (an anchored DSpark block drafts all 8)
    prompts = [encode_prompt(tokenizer, "Write a Python function that returns the sum of a list.", chat=True),
               encode_prompt(tokenizer, "What is 17 times 3?", chat=True)]  # fmt: skip
    spec = speculative_generate(target, draft, prompts, 32, verify=8)
    assert spec.token_ids == generate(target, prompts, 32).token_ids
    assert {t for row in spec.verify_lengths for t in row} == {8}
    assert spec.mean_acceptance > 1.1  # (held-out greedy τ 1.30–1.39 at verify 8; a fresh head's ~1.0)
