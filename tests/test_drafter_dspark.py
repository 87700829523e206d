"""The ``dspark`` kind in the speculative loop: greedy ``speculative_generate`` equals ``generate`` token for
token at batch 5 on dense (Llama, Qwen3) and hybrid (Qwen3.5 Gated DeltaNet) targets, for each Markov head
variant and both anchor conventions; sampled decoding is lossless (the joint law of the first 4 tokens on
a vocab-6 target, as tests/test_speculative_sampling.py checks the other kinds), with a Markov head strong
enough that the draft distribution of a slot depends on the token drawn before it; ``init:dspark`` works
as a ``--draft`` value. Parity with vLLM's speculators is in test_speculators.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafter_helpers import append, tapped_features
from test_speculative import MAX_NEW, PROMPTS, check_accounting, hybrid, references, targets  # noqa: F401  (fixtures)
from test_speculative_sampling import (  # noqa: F401  (small_vocab_target: a fixture)
    N_TOKENS,
    PROMPT,
    V,
    assert_fits,
    exact_joint,
    sample_first_tokens,
    small_vocab_target,
)

from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters import dspark
from dspine_jax.drafters.io import (
    draft_block_size,
    init_drafter,
    load_draft,
    load_drafter,
    save_drafter,
    with_draft_vocab,
)
from dspine_jax.drafters.params import Drafter
from dspine_jax.drafters.proposer import DrafterProposer
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models.sampling import Sampling

VERIFY = 5


def with_strong_heads(drafter: Drafter, seed: int) -> Drafter:
    """A "trained" DSpark drafter: O(1) random Markov and confidence weights (a fresh one's ``w1`` is
    N(0, 0.01), so its bias barely moves the logits and q would hardly depend on the previous token)."""
    params = drafter.params
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8))

    def normal(x: jax.Array, scale: float) -> jax.Array:
        return (scale * jax.random.normal(next(keys), x.shape)).astype(x.dtype)

    m = params.markov
    markov = m.replace(w1=normal(m.w1, 1.0), w2=normal(m.w2, 2.0 / math.sqrt(m.w2.shape[0])))
    if m.gate_proj is not None:
        gate = normal(m.gate_proj, 1.0 / math.sqrt(m.gate_proj.shape[0]))
        markov = markov.replace(gate_proj=gate, gate_bias=normal(m.gate_bias, 0.5))
    if m.joint_proj is not None:
        joint = normal(m.joint_proj, 1.0 / math.sqrt(m.joint_proj.shape[0]))
        markov = markov.replace(joint_proj=joint, joint_bias=normal(m.joint_bias, 0.5))
    return drafter.replace(params=params.replace(markov=markov))


def make_dspark(target, head: str, sample_from_anchor: bool = True, block_size: int = VERIFY, seed: int = 3) -> Drafter:
    drafter = init_drafter(target, "dspark", num_layers=1, block_size=block_size, seed=seed, markov_rank=8,
                           markov_head_type=head, sample_from_anchor=sample_from_anchor, initializer_range=0.2)  # fmt: skip
    return with_strong_heads(drafter, seed + 1)


@pytest.mark.parametrize(
    "family,head,sample_from_anchor",
    [("llama", "vanilla", True), ("qwen3", "gated", True), ("qwen3", "rnn", False)],
)
def test_greedy_dspark_matches_generate(targets, references, family, head, sample_from_anchor):  # noqa: F811
    target = targets[family]
    drafter = make_dspark(target, head, sample_from_anchor)
    result = speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[], verify=VERIFY)
    assert result.token_ids == references[family]
    assert result.verify_length == VERIFY
    check_accounting(result)


def test_anchored_dspark_drafts_its_whole_block(targets, references):  # noqa: F811
    """With ``sample_from_anchor`` each of the block's T positions proposes, as speculators drafts: verify blocks
    of T + 1; without it, T."""
    from dspine_jax.decoding.proposers import as_proposer

    target = targets["llama"]
    anchored, plain = make_dspark(target, "vanilla", True), make_dspark(target, "rnn", False)
    assert (as_proposer(anchored).block_limit, as_proposer(plain).block_limit) == (VERIFY + 1, VERIFY)
    result = speculative_generate(target, anchored, PROMPTS, MAX_NEW, stop_ids=[], verify=VERIFY + 1)
    assert result.token_ids == references["llama"] and result.verify_length == VERIFY + 1
    check_accounting(result)


def test_hybrid_greedy_dspark_matches_ar(hybrid):  # noqa: F811
    target, reference = hybrid
    result = speculative_generate(target, make_dspark(target, "rnn", seed=5), PROMPTS, MAX_NEW, stop_ids=[], verify=VERIFY)
    assert result.token_ids == reference
    check_accounting(result)


@pytest.mark.parametrize("head,temperature,top_p,top_k", [("rnn", 0.8, 0.9, 5), ("vanilla", 1.0, 1.0, 0)])
def test_dspark_speculative_sampling_joint_distribution(small_vocab_target, head, temperature, top_p, top_k):  # noqa: F811
    target = small_vocab_target
    drafter = make_dspark(target, head, block_size=4, seed=7)

    # The point of the DSpark case: a slot's q depends on the token drawn at the slot before it. 256 rows of
    # one context, each with its own key: rows whose slot-1 tokens differ get different slot-2 distributions.
    rows = 256
    tapped = tapped_features(target, [PROMPT] * rows, drafter.config.target_layer_ids)
    cache = append(drafter, init_draft_cache(drafter, rows, 16), tapped, jnp.full((rows,), len(PROMPT)))
    walk = jax.jit(dspark.walk)(
        drafter, target, cache, jnp.full((rows,), PROMPT[-1], jnp.int32), jax.random.split(jax.random.key(1), rows),
        Sampling.rows(rows, temperature, top_p, top_k),
    )  # fmt: skip
    first, q2 = np.asarray(walk.tokens[:, 0]), np.asarray(walk.q[:, 1])
    assert len(set(first.tolist())) > 1
    spread = max(np.abs(q2[first == a][0] - q2[first == b][0]).max() for a in set(first) for b in set(first))
    assert spread > 0.1
    # q is a distribution, zero where the sampling filters cut the token (top-k 5 of 6 leaves one out).
    np.testing.assert_allclose(np.asarray(walk.q).sum(-1), 1.0, rtol=1e-5)
    if top_k:
        assert ((np.asarray(walk.q) > 0).sum(-1) <= top_k).all()

    samples, accepted = sample_first_tokens(target, DrafterProposer(drafter), temperature, top_p, top_k, 4)
    assert 0.05 < (accepted == 0).mean() < 0.95 and (accepted == 3).mean() > 0.02
    counts = np.zeros((V,) * N_TOKENS, np.int64)
    np.add.at(counts, tuple(samples.T), 1)
    assert_fits(counts, exact_joint(target, temperature, top_p, top_k))


def test_init_dspark_draft_value(targets):  # noqa: F811
    target = targets["qwen3"]
    assert draft_block_size("init:dspark:6") == 6
    drafter = load_draft("init:dspark:6", target)
    assert drafter.config.kind == "dspark" and drafter.config.block_size == 6
    assert drafter.config.markov_rank == min(256, target.config.hidden_size)
    assert drafter.params.markov is not None and drafter.params.confidence is not None
    with pytest.raises(ValueError, match="markov_head_type"):
        init_drafter(target, "dspark", num_layers=1, markov_head_type="lstm")


def test_draft_vocabulary_save_load_round_trip(targets, tmp_path):  # noqa: F811
    """``with_draft_vocab`` on a DSpark drafter: proposals stay in the vocabulary, its Markov ``w2`` is read at
    those columns, and the export (speculators' layout: ``w2`` and ``lm_head`` over the draft vocabulary, ``d2t``,
    ``t2d``) loads back drafting the same."""
    target = targets["qwen3"]
    ids = list(range(0, 128, 2))
    drafter = with_draft_vocab(make_dspark(target, "gated", block_size=4), target, ids)
    rows = 3
    tapped = tapped_features(target, [PROMPTS[1][:5]] * rows, drafter.config.target_layer_ids)
    cache = append(drafter, init_draft_cache(drafter, rows, 16), tapped, jnp.full((rows,), 5))
    args = (jnp.asarray([7, 8, 9], jnp.int32), jax.random.split(jax.random.key(0), rows), Sampling.rows(rows, 1.0))
    out = jax.jit(dspark.walk)(drafter, target, cache, *args)
    assert set(np.asarray(out.tokens).ravel().tolist()) <= set(ids)
    assert np.asarray(out.cand_ids[0, 0]).tolist() == ids
    save_drafter(drafter, tmp_path / "d")
    back = load_drafter(tmp_path / "d", target)
    assert back.config.draft_vocab_size == len(ids) and back.params.markov.w2.shape == (8, len(ids))
    again = jax.jit(dspark.walk)(back, target, cache, *args)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out.tokens))
    np.testing.assert_allclose(np.asarray(again.q), np.asarray(out.q), rtol=1e-6, atol=1e-7)
