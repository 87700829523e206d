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


# ----------------------------------------------------------------------------------------------
# Dynamic verification: the confidence head cuts a round to a shorter verify (adaptive.confidence_cut)

CUT_COSTS = {1: 1.0, 2: 1.0, 4: 1.5, 5: 1.6}  # a drafted round of 4 pays only when ~0.5 more tokens come


def with_confidence(drafter: Drafter, scale: float, bias: float, seed: int = 11) -> Drafter:
    """A confidence head with O(``scale``) random weights (confidences that vary with the previous token)."""
    head = drafter.params.confidence
    weight = scale / math.sqrt(head.weight.shape[0]) * jax.random.normal(jax.random.PRNGKey(seed), head.weight.shape)
    head = head.replace(weight=weight.astype(head.weight.dtype), bias=jnp.asarray(bias, head.bias.dtype))
    return drafter.replace(params=drafter.params.replace(confidence=head))


def decode_with_cut(target, drafter, prompts, verify_len, costs, *, temperature=0.0, key=None, max_new=MAX_NEW):
    """``generate_impl`` with every round at ``verify_len`` and the confidence cut on (no policy choice between
    rounds): the emitted tokens per row and the verify lengths of its rounds that the budget did not cut."""
    from dspine_jax.decoding import adaptive
    from dspine_jax.decoding.planning import plan_request
    from dspine_jax.decoding.speculative import generate_impl

    _, capacity, tokens, lengths, _ = plan_request(target, prompts, max_new, temperature or 1.0, 1.0, 0, [])
    policy = adaptive.make_policy(list(costs), costs)
    out = jax.jit(generate_impl, static_argnames=("capacity", "out_width", "verify_len", "top_k", "greedy"))(
        target, DrafterProposer(drafter), jnp.asarray(tokens), jnp.asarray(lengths),
        jax.random.key(0) if key is None else key, jnp.float32(temperature or 1.0), jnp.float32(1.0),
        jnp.asarray([-1], jnp.int32), jnp.int32(max_new), capacity=capacity + verify_len, out_width=max_new,
        verify_len=verify_len, top_k=0, greedy=temperature == 0, cut=policy,
    )  # fmt: skip
    rounds, kept = np.asarray(out.rounds), np.asarray(out.kept)
    lengths = []  # per row, the lengths of the rounds that had at least 5 tokens of budget left (others cut by it)
    for i in range(len(prompts)):
        left = max_new - 1 - np.concatenate([[0], np.cumsum(kept[i, : rounds[i]])[:-1]])
        lengths.append([int(t) for t, n in zip(np.asarray(out.lengths)[i, : rounds[i]], left) if n >= 5])
    return [np.asarray(out.tokens)[i, : int(out.written[i])].tolist() for i in range(len(prompts))], lengths


def test_confidence_cut_is_a_stopping_rule():
    """Whether a proposal is verified depends only on confidences of earlier slots (which depend on proposals
    already kept): changing every confidence past the chosen length never changes the choice. Sure
    proposals are all verified, hopeless ones cut to the shortest drafted length; a pinned length is kept."""
    from dspine_jax.decoding import adaptive

    policy = adaptive.make_policy(list(CUT_COSTS) + [8], {**CUT_COSTS, 8: 2.2})
    lengths = adaptive.cut_lengths(policy, 8)
    assert lengths == (2, 4, 5, 8)
    rng = np.random.default_rng(0)
    running, remaining = jnp.ones((3,), bool), jnp.full((3,), 50, jnp.int32)
    choices = set()
    for _ in range(60):
        c = rng.uniform(0.2, 1.0, (3, 7)).astype(np.float32)
        index = int(adaptive.confidence_cut(policy, lengths, jnp.asarray(c), running, remaining))
        choices.add(index)
        c[:, lengths[index]:] = rng.uniform(0.0, 1.0, c[:, lengths[index]:].shape)
        assert int(adaptive.confidence_cut(policy, lengths, jnp.asarray(c), running, remaining)) == index
    assert len(choices) > 1  # (the trials reach several lengths: the check above is not vacuous)
    assert int(adaptive.confidence_cut(policy, lengths, jnp.ones((3, 7)), running, remaining)) == len(lengths) - 1
    assert int(adaptive.confidence_cut(policy, lengths, jnp.full((3, 7), 0.01), running, remaining)) == 0
    pinned = adaptive.make_policy(list(CUT_COSTS), CUT_COSTS, schedule=[4])
    assert int(adaptive.confidence_cut(pinned, (2, 4), jnp.full((3, 4), 0.01), running, remaining)) == 1


@pytest.mark.parametrize("bias,expected", [(-30.0, {2}), (30.0, {5}), (0.5, None)])
def test_confidence_cut_rounds_stay_greedy_exact(targets, references, bias, expected):  # noqa: F811
    """Rounds of 5 cut by the drafter's confidence: all to 2 when it is sure of nothing, none when it is sure
    of everything, a mix in between; the output equals ``generate`` whatever the cut."""
    target = targets["qwen3"]
    drafter = with_confidence(make_dspark(target, "vanilla", sample_from_anchor=False), 4.0, bias)
    tokens, lengths = decode_with_cut(target, drafter, PROMPTS, 5, CUT_COSTS)
    assert tokens == references["qwen3"]
    seen = {t for row in lengths for t in row}
    assert seen == expected if expected else len(seen) > 1 and seen <= {2, 4, 5}, seen


def test_confidence_cut_keeps_dspark_sampling_lossless(small_vocab_target):  # noqa: F811
    """The cut is decided row by row here (one row per vmapped call), so it follows each row's own draft as
    closely as it can; the joint law of the first tokens is still the target's."""
    from test_speculative_sampling import CHUNK, SAMPLES

    from dspine_jax.decoding import adaptive
    from dspine_jax.decoding.speculative import generate_impl
    from dspine_jax.models.panels import unpack_params

    # (vmap turns the round's switch into a select over batched operands, weights included: the CPU panel
    # kernel takes one weight matrix, so this target multiplies through XLA)
    target = small_vocab_target.replace(params=unpack_params(small_vocab_target.params))
    drafter = with_confidence(make_dspark(target, "vanilla", block_size=4, seed=7, sample_from_anchor=False), 3.0, 1.0)
    tokens = jnp.asarray([PROMPT + [0] * (16 - len(PROMPT))], jnp.int32)

    def sampler(cost_4: float):
        policy = adaptive.make_policy([1, 2, 4], {1: 1.0, 2: 1.0, 4: cost_4})

        def one(key):
            return generate_impl(target, DrafterProposer(drafter), tokens, jnp.asarray([len(PROMPT)], jnp.int32), key,
                                 jnp.float32(1.0), jnp.float32(1.0), jnp.asarray([-1], jnp.int32), jnp.int32(N_TOKENS),
                                 capacity=20, out_width=N_TOKENS, verify_len=4, top_k=0, greedy=False, cut=policy)  # fmt: skip

        return jax.jit(jax.vmap(one))

    def cut_share(out) -> float:  # of the first rounds, those cut to 2
        return float((np.asarray(out.lengths)[:, 0, 0] == 2).mean())

    # The price of a round of 4 that puts the cut among this drafter's confidences (a trial on other keys): a
    # row's length then depends on its own proposals, which is what could break the law.
    for cost_4 in (1.1, 1.2, 1.3, 1.4, 1.5):
        run = sampler(cost_4)
        if 0.2 < cut_share(run(jax.random.split(jax.random.key(7), CHUNK))) < 0.8:
            break
    else:
        pytest.fail("no price of a round of 4 mixes cut and uncut rounds")
    samples, shares = [], []
    for chunk in range(SAMPLES // CHUNK):
        out = run(jax.random.split(jax.random.key(300 + chunk), CHUNK))
        assert (np.asarray(out.written) == N_TOKENS).all()
        samples.append(np.asarray(out.tokens)[:, 0, :N_TOKENS])
        shares.append(cut_share(out))
    assert 0.05 < np.mean(shares) < 0.95, shares
    counts = np.zeros((V,) * N_TOKENS, np.int64)
    np.add.at(counts, tuple(np.concatenate(samples).T), 1)
    assert_fits(counts, exact_joint(target, 1.0, 1.0, 0))
