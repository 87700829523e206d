"""speculative_generate, greedy: token-for-token equal to ``generate`` (f32) on tiny Llama / Qwen3 / hybrid
targets, with fresh random drafters of both kinds and with oracle proposers that force every acceptance
length; stop ids and max_new_tokens mid-block; capacity; no recompilation on a same-shape call.

Compilations dominate the runtime on CPU, so tests share shapes: every batch is the same 5 prompts
(lengths 3…12, one prompt bucket), every oracle has the same reference / schedule shapes, and
max_new_tokens (traced) stays inside one output bucket.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_tiny_hf_model, missing_reference

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.decoder import run_segment
from dspine_jax.decoding.proposers import OracleProposer
from dspine_jax.decoding.speculative import prefill, speculative_generate
from dspine_jax.drafters.io import init_drafter
from dspine_jax.models.target import load_target

MAX_NEW = 24
VERIFY = 5  # oracle verify length: anchor + 4 proposals → acceptance lengths 0…4 (5 rows)
PROMPTS = [np.random.default_rng(i).integers(3, 128, n).tolist() for i, n in enumerate([3, 7, 12, 5, 9])]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """conftest's tiny models with a larger init range: its default ones decode one repeated token,
    which would make "equal to generate" a weak check; these produce varied text."""
    root = tmp_path_factory.mktemp("spec")
    llama = dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    dirs = {
        "llama": make_tiny_hf_model("llama", root / "llama", initializer_range=0.15, **llama)[0],
        "qwen3": make_tiny_hf_model("qwen3", root / "qwen3", seed=1, initializer_range=0.15, tie_word_embeddings=False)[0],
    }
    return {name: load_target(d) for name, d in dirs.items()}


@pytest.fixture(scope="module")
def references(targets):
    """Greedy AR output of PROMPTS per target (the exactness reference, and the oracle's continuation)."""
    return {name: generate(t, PROMPTS, MAX_NEW, stop_ids=[]).token_ids for name, t in targets.items()}


def oracle(reference: list[list[int]], accept: np.ndarray, vocab_size: int) -> OracleProposer:
    ref = np.zeros((len(reference), 64), np.int32)
    for i, row in enumerate(reference):
        ref[i, : len(row)] = row
    return OracleProposer(reference=jnp.asarray(ref), accept=jnp.asarray(accept, jnp.int32), vocab_size=vocab_size)


def every_length_schedule(rows: int = len(PROMPTS), proposals: int = VERIFY - 1) -> np.ndarray:
    """accept[b, r] = (b + r) mod (P + 1): in every round the rows take different lengths, and every
    row sees every length 0…P."""
    return (np.arange(rows)[:, None] + np.arange(proposals + 1)[None, :]) % (proposals + 1)


def check_accounting(result, prompts=PROMPTS) -> None:
    for row, kept, raw in zip(result.token_ids, result.acceptance_lengths, result.accepted_proposals):
        assert sum(kept) == len(row) - 1  # the first token is prefill's, every other one a verify step's
        assert all(1 <= k <= result.verify_length for k in kept)
        assert all(k <= a + 1 for k, a in zip(kept, raw))
    steps = sum(len(k) for k in result.acceptance_lengths)
    assert result.mean_acceptance == pytest.approx(sum(map(sum, result.acceptance_lengths)) / steps)
    assert result.num_iterations == max(len(k) for k in result.acceptance_lengths)


@pytest.mark.parametrize(
    "family,kind,extra",
    [
        ("llama", "dspine", {}),
        ("llama", "dflash", {"block_size": 4}),  # bidirectional: full draft, first 3 proposals verified
        # batch 5 → the table's "4" entry: a DSpine block of 5 verified 3 at a time (shorter causal draft).
        ("qwen3", "dspine", {"sps_table": {"verify_length": {"1": 5, "4": 3}}}),
    ],
)
def test_greedy_random_drafter_matches_generate(targets, references, family, kind, extra):
    target = targets[family]
    drafter = init_drafter(target, kind, num_layers=1, block_size=VERIFY, top_k=8, seed=3)
    result = speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[], **extra)
    assert result.token_ids == references[family]
    assert result.finish_reasons == ["length"] * len(PROMPTS)
    assert result.verify_length == extra.get("block_size", 3 if "sps_table" in extra else VERIFY)
    check_accounting(result)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_oracle_every_acceptance_length(targets, references, family):
    target, reference = targets[family], references[family]
    accept = every_length_schedule()
    result = speculative_generate(
        target, oracle(reference, accept, target.config.vocab_size), PROMPTS, MAX_NEW, stop_ids=[], block_size=VERIFY
    )
    assert result.token_ids == reference
    check_accounting(result)
    for b, (kept, raw) in enumerate(zip(result.acceptance_lengths, result.accepted_proposals)):
        forced = [int(accept[b, r % accept.shape[1]]) for r in range(len(kept))]
        assert raw[:-1] == forced[:-1]  # the last step may run past the reference (and is cut anyway)
        assert kept[:-1] == [a + 1 for a in forced[:-1]]
    assert {a for raw in result.accepted_proposals for a in raw[:-1]} == set(range(VERIFY))


def test_stop_ids_and_max_new_tokens_mid_block(targets, references):
    """Full-accept oracle (blocks of 5 tokens after the first): a stop id and a token limit that fall
    inside an accepted block cut it there; nothing past the stop is returned."""
    target, reference = targets["llama"], references["llama"]
    proposer = oracle(reference, np.full((len(PROMPTS), 5), VERIFY - 1), target.config.vocab_size)

    def mid_block(i: int) -> bool:  # output index i (0 = prefill's) is not the last token of its block
        return i >= 1 and (i - 1) % VERIFY != VERIFY - 1

    # A token whose first occurrence in row 0 falls mid-block.
    row0 = reference[0]
    stop = next(tok for i, tok in enumerate(row0) if mid_block(i) and row0.index(tok) == i)
    expected = [row[: row.index(stop) + 1] if stop in row else row for row in reference]
    result = speculative_generate(target, proposer, PROMPTS, MAX_NEW, stop_ids=[stop], block_size=VERIFY)
    assert result.token_ids == expected
    assert result.finish_reasons == ["stop" if stop in row else "length" for row in reference]
    assert result.acceptance_lengths[0][-1] < result.accepted_proposals[0][-1] + 1  # cut inside the block
    check_accounting(result)

    # max_new_tokens = 8: tokens 1 | 2-6 | 7-8 (the third block is cut after 2 of its 5 tokens).
    result = speculative_generate(target, proposer, PROMPTS, 8, stop_ids=[], block_size=VERIFY)
    assert result.token_ids == [row[:8] for row in reference]
    assert result.acceptance_lengths == [[5, 2]] * len(PROMPTS)
    assert result.finish_reasons == ["length"] * len(PROMPTS)


def test_no_recompile_on_same_shapes(targets, references):
    """Seed, max_new_tokens (same bucket), stop ids (same count bucket) and sampling values are traced."""
    target = targets["llama"]
    proposer = oracle(references["llama"], every_length_schedule(), target.config.vocab_size)
    speculative_generate(target, proposer, PROMPTS, MAX_NEW, stop_ids=[], block_size=VERIFY)
    if not hasattr(run_segment, "_cache_size"):
        missing_reference("the jit cache size (jitted functions' _cache_size) in this JAX")
    sizes = (prefill._cache_size(), run_segment._cache_size())
    other = [p[::-1] for p in PROMPTS]  # same lengths, other tokens
    speculative_generate(target, proposer, other, MAX_NEW - 7, stop_ids=[5, 6, 7], seed=11, block_size=VERIFY)
    speculative_generate(target, proposer, other, MAX_NEW, temperature=0.0, stop_ids=None, seed=2, block_size=VERIFY)
    assert (prefill._cache_size(), run_segment._cache_size()) == sizes


def test_capacity_limit_mid_block(targets):
    """A row whose prompt nearly fills the model's positions stops at the same token as ``generate``
    ("capacity") while a short row runs to max_new_tokens; the verify block never writes past the cache."""
    target = targets["llama"]
    target = target.replace(config=dataclasses.replace(target.config, max_position_embeddings=40))
    prompts = [np.random.default_rng(9).integers(3, 128, 30).tolist(), PROMPTS[0]]
    ar = generate(target, prompts, 20, stop_ids=[])
    assert ar.finish_reasons == ["capacity", "length"] and len(ar.token_ids[0]) == 40 - 30 + 1
    proposer = oracle(ar.token_ids, np.full((2, 5), VERIFY - 1), target.config.vocab_size)
    result = speculative_generate(target, proposer, prompts, 20, stop_ids=[], block_size=VERIFY)
    assert result.token_ids == ar.token_ids
    assert result.finish_reasons == ar.finish_reasons
    check_accounting(result, prompts)


# ----------------------------------------------------------------------------------------------
# Hybrid (Qwen3.5 Gated DeltaNet) target: the commit step replays the GDN state to the kept prefix.


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    import torch
    from test_hybrid import make_tiny_hybrid  # tests/ is on sys.path (pytest rootdir conftest)

    model_dir, model = make_tiny_hybrid("qwen3_5_text", tmp_path_factory.mktemp("hyb") / "qwen3_5", seed=0)
    # Reference: HF greedy (== our AR decoding, see test_hybrid). Not ``generate``: its right-padded
    # prefill currently leaves pad tokens in the GDN state (test_hybrid::test_generate_matches_hf_greedy).
    reference = []
    with torch.no_grad():
        for p in PROMPTS:
            out = model.generate(torch.as_tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                 do_sample=False, pad_token_id=0)
            reference.append(out[0, len(p) :].tolist())
    return load_target(model_dir), reference


def test_hybrid_greedy_matches_ar(hybrid):
    target, reference = hybrid
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=VERIFY, top_k=8, seed=4)
    result = speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[])
    assert result.token_ids == reference
    check_accounting(result)

    accept = every_length_schedule()
    result = speculative_generate(
        target, oracle(reference, accept, target.config.vocab_size), PROMPTS, MAX_NEW, stop_ids=[], block_size=VERIFY
    )
    assert result.token_ids == reference
    assert [k[:-1] for k in result.acceptance_lengths] == [
        [int(accept[b, r % 5]) + 1 for r in range(len(k) - 1)] for b, k in enumerate(result.acceptance_lengths)
    ]
    check_accounting(result)


# ----------------------------------------------------------------------------------------------
# Adaptive verification: the length changes between rounds (pinned here, so every switch is exercised).


def test_adaptive_lengths_changing_every_round_match_generate(targets, references):
    target = targets["llama"]
    drafter = init_drafter(target, "dspine", num_layers=1, block_size=8, top_k=8, seed=4)
    schedule = [2, 8, 1, 4]
    result = speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[], verify_schedule=schedule)
    assert result.token_ids == references["llama"]
    assert all(row == (schedule * MAX_NEW)[: len(row)] for row in result.verify_lengths)
    assert all(k == 1 for row, ks in zip(result.verify_lengths, result.acceptance_lengths)
               for t, k in zip(row, ks) if t == 1)  # fmt: skip
    check_accounting(result)
    with pytest.raises(ValueError, match="pins the lengths"):
        speculative_generate(target, drafter, PROMPTS, MAX_NEW, verify=4, verify_schedule=schedule)


def test_hybrid_adaptive_lengths_replay_exactly(hybrid):
    """GDN replay after rounds of 16, 1, 4 and 2 tokens (an oracle: acceptance is known per round)."""
    target, reference = hybrid
    accept = every_length_schedule()
    schedule = [16, 1, 4, 2]
    result = speculative_generate(
        target, oracle(reference, accept, target.config.vocab_size), PROMPTS, MAX_NEW, stop_ids=[],
        verify_schedule=schedule, verify_costs={1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0},
    )
    assert result.token_ids == reference
    for b, (lengths, kept) in enumerate(zip(result.verify_lengths, result.acceptance_lengths)):
        assert lengths == (schedule * MAX_NEW)[: len(lengths)]
        assert kept[:-1] == [min(int(accept[b, r % 5]) + 1, t) for r, t in enumerate(lengths[:-1])]
    check_accounting(result)
