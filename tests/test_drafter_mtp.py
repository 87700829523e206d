"""MTP heads (``drafters/mtp.py``) against vLLM's ``speculators==0.9.0`` ``MTPDraftModel``.

Two heads, each a tiny random speculators model sharing its target's embedding and LM head: a Qwen3 layer
saved in speculators' format (dense Qwen3 target), and a Qwen3.5 layer (gated attention, partial RoPE,
zero-centred norms) written into a tiny Qwen3.5 hybrid checkpoint as its own ``mtp.*`` tensors (names from
speculators' converter tables), loaded with ``self:mtp``. Given the same target hidden states and tokens,
every draft step's logits equal theirs (float32) and the greedy proposals are theirs, after a prompt and after
a round that committed part of its block; our save loads back into their class, tensor for tensor.
Speculative decoding with a head is greedy-exact at batch > 1 on both targets (the hybrid with its own head; the
dense one with a head built to echo its token, whose drafts the repetitive tiny target often accepts in full)
and lossless at temperature > 0.

The reference runs their MTP layer the way vLLM drafts (``Qwen3NextMTP`` behind its EAGLE proposer): the
entries ``(h_j, x_{j+1})`` of the committed positions at RoPE positions ``j``, then draft step ``s`` appended
as ``(out_{s-1}, d_s)`` at position ``n - 1 + s`` and read at the last index (one layer: an entry's K/V depend
on its own inputs only, so the causal pass over the whole sequence is the cached draft). Their teacher-forced
``forward`` runs later steps over each step's own entries, a training approximation: it is compared at step 0.
"""

from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import float32_noise, make_tiny_hf_model, require

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters import eagle3 as E
from dspine_jax.drafters import mtp as M
from dspine_jax.drafters.io import draft_block_size, load_draft
from dspine_jax.models import panels, quant
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import load_target
from dspine_jax.models.weights import load_safetensors_dir, save_safetensors

torch = require("torch")
require("speculators.models")
from safetensors.torch import load_file  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.convert.mtp import MTP_EXACT_REMAP, MTP_PREFIX_REMAP, MTPConverter  # noqa: E402
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig  # noqa: E402
from speculators.models.mtp.core import _prepare_mtp_position_ids  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402

V = 16  # a small vocabulary: random heads then guess a fair share of the target's tokens
STEPS = 4  # draft steps compared per anchor
# As test_drafter_eagle3: ours (float32) within ROUNDING_FACTOR × the reference's float32 noise
# (``conftest.float32_noise``: |theirs f32 − theirs f64|, max over the steps and over ulp-moved weights)
# + LOGIT_FLOOR of the float64 reference.
ROUNDING_FACTOR = 2.0
LOGIT_FLOOR = 1e-5
VERIFIER_OWNED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}


def make_reference(layer_config, embed: torch.Tensor, head: torch.Tensor, seed: int) -> MTPDraftModel:
    """A random speculators MTPDraftModel over ``layer_config`` with the target's ``embed`` / ``head``."""
    torch.manual_seed(seed)
    layer_config = copy.deepcopy(layer_config)
    layer_config._attn_implementation = "eager"
    config = MTPSpeculatorConfig(
        transformer_layer_config=layer_config,
        speculators_config=SpeculatorsConfig(
            algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )  # fmt: skip
    model = MTPDraftModel(config).float().eval()
    zero_centred = layer_config.model_type in M.GATED_TYPES
    with torch.no_grad():  # random weights of a useful scale; norms away from the identity so their wiring shows
        for name, p in model.named_parameters():
            if name == "embed_tokens.weight":
                p.copy_(embed)
            elif name in ("lm_head.weight", "verifier_lm_head.weight"):
                p.copy_(head)
            elif "norm" in name:
                p.copy_((0.0 if zero_centred else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.25 * torch.randn_like(p))
    return model


def native_name(name: str) -> str:
    """speculators' name → the target checkpoint's (``mtp.*``), inverting speculators' own converter tables."""
    for theirs, ours in MTP_EXACT_REMAP.items():
        if name == ours:
            return theirs
    for theirs, ours in MTP_PREFIX_REMAP:  # the norms' prefixes first, then the layer's
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    raise AssertionError(name)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(target, their model, ours loaded from their save_pretrained, checkpoint dir): a Qwen3 MTP layer."""
    model_dir, hf = make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("mtpd") / "qwen3", seed=1, vocab_size=V,
                                       tie_word_embeddings=False)  # fmt: skip
    target = load_target(model_dir)
    reference = make_reference(hf.config, hf.model.embed_tokens.weight, hf.lm_head.weight, seed=3)
    out = tmp_path_factory.mktemp("mtpd-spec")
    reference.save_pretrained(out)
    return target, reference, M.load_mtp(out, target, dtype="float32"), out


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(target, their model, ours loaded with self:mtp, checkpoint dir): a Qwen3.5 hybrid that ships its head."""
    from test_hybrid import make_tiny_hybrid

    model_dir, hf = make_tiny_hybrid("qwen3_5_text", tmp_path_factory.mktemp("mtph") / "qwen3_5", seed=0, vocab_size=V)
    reference = make_reference(hf.config, hf.model.embed_tokens.weight, hf.lm_head.weight, seed=4)
    tensors = load_safetensors_dir(model_dir)
    tensors.update({native_name(name): value.numpy() for name, value in reference.state_dict().items()
                    if name.startswith("mtp_layers.")})  # fmt: skip
    save_safetensors(tensors, model_dir / "model.safetensors")
    target = load_target(model_dir)
    return target, reference, M.load_own_mtp(target, dtype="float32"), model_dir


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def case(request):
    return request.getfixturevalue(request.param)


# The head taps no layer: ``tapped`` is ``[0, B, T, H]``, as the round passes it.
_prefill = jax.jit(lambda p, t, s, hidden, lengths, tokens: p.prefill(t, s, hidden, hidden[None][:0], lengths, tokens))
_commit = jax.jit(lambda p, t, s, hidden, n, tokens: p.commit(t, s, hidden, hidden[None][:0], n, tokens))
_steps = jax.jit(E.draft_steps, static_argnames="num")
_forward = jax.jit(tgt.forward)  # (hidden, tapped, cache, replay record)


def greedy_steps(proposer, target, state, anchor, num=STEPS):
    keys = jax.random.split(jax.random.key(0), len(anchor))
    out, logits = _steps(proposer, target, state, jnp.asarray(anchor, jnp.int32), keys, Sampling.rows(len(anchor)),
                         num=num)  # fmt: skip
    return np.asarray(out.tokens), np.asarray(logits)


def reference_draft(model: MTPDraftModel, tokens: list[int], hidden: np.ndarray, anchor: int, drafted) -> np.ndarray:
    """Their per-step logits ``[P, V]`` drafting from ``anchor`` after the committed ``tokens`` (final target
    hidden ``hidden [n, H]``), fed our proposals ``drafted`` (module doc)."""
    dtype = next(model.parameters()).dtype
    layer_config = model.config.transformer_layer_config
    hid = list(torch.from_numpy(np.array(hidden)).to(dtype))
    ids = tokens[1:] + [anchor]
    out = []
    with torch.no_grad():
        for s in range(len(drafted)):
            states = torch.stack(hid)[None]
            positions = torch.arange(len(ids))[None]
            text_positions, rotary_positions = _prepare_mtp_position_ids(positions, len(ids), layer_config.model_type)
            mask = create_causal_mask(config=layer_config, inputs_embeds=states, attention_mask=None,
                                      cache=None, position_ids=text_positions)  # fmt: skip
            last = model.mtp_layers[0](
                hidden_states=states, token_embeddings=model.embed_tokens(torch.tensor([ids])), attention_mask=mask,
                position_ids=text_positions, position_embeddings=model.rotary_emb(states, rotary_positions),
            )[0, -1]  # fmt: skip
            out.append(model.lm_head(last))
            hid.append(last)
            ids.append(int(drafted[s]))
    return torch.stack(out).numpy()


def teacher_forced_step0(model: MTPDraftModel, tokens: list[int], hidden: np.ndarray, anchor: int) -> np.ndarray:
    """Their ``forward``'s step-0 logits ``[V]`` at the last committed position (hidden h_{n-1}, token: the anchor)."""
    n, steps = len(tokens), model.config.num_speculative_steps
    ids = torch.tensor([tokens + [anchor] + [0] * steps])  # valid length n: the filler is never read at n - 1
    states = torch.from_numpy(np.concatenate([hidden, np.zeros((steps + 1, hidden.shape[1]), hidden.dtype)]))[None]
    with torch.no_grad():
        logits, _, _ = model(input_ids=ids, hidden_states=states)
    return logits[0][0, n - 1].numpy()


def check_against_reference(reference, committed, hidden, anchors, tokens, logits) -> None:
    """Row b committed ``committed[b]`` with final target hidden ``hidden[b] [n, H]``; from ``anchors[b]`` ours
    drafted ``tokens[b]`` with ``logits[b] [P, V]``: theirs must give the same logits and argmaxes."""
    reference64 = copy.deepcopy(reference).double()
    for b, (seq, hid, anchor) in enumerate(zip(committed, hidden, anchors, strict=True)):
        run = lambda model: reference_draft(model, seq, hid, anchor, tokens[b])  # noqa: B023
        theirs = run(reference)
        exact = reference_draft(reference64, seq, hid.astype(np.float64), anchor, tokens[b])
        rounding = float32_noise(run, reference, exact)
        assert np.abs(logits[b] - exact).max() <= ROUNDING_FACTOR * rounding + LOGIT_FLOOR
        assert (exact.argmax(-1) == tokens[b]).all() and (theirs.argmax(-1) == exact.argmax(-1)).all()
        top2 = np.sort(exact, -1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 100 * (rounding + LOGIT_FLOOR)).all()  # no near-ties: proposals are robust
        step0 = teacher_forced_step0(reference64, seq, hid.astype(np.float64), anchor)
        np.testing.assert_allclose(step0, exact[0], rtol=0, atol=1e-9)  # their own forward: the same step 0


def test_config_and_weights_load(case):
    target, reference, proposer, _ = case
    c, layer = proposer.config, reference.config.transformer_layer_config
    assert c.layer_type == layer.model_type and c.gated == (layer.model_type != "qwen3")
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (
        layer.hidden_size, layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim,
        layer.intermediate_size)  # fmt: skip
    assert c.rotary_dim == (4 if c.gated else 16)  # Qwen3.5's partial_rotary_factor 0.25 of head_dim 16
    assert proposer.taps == () and proposer.block_limit == 4  # speculative_tokens 3 + the anchor
    proposer.check_compatible(target)


def test_draft_logits_and_proposals_match_after_prefill(case):
    target, reference, proposer, _ = case
    prompts = [[5, 9, 1, 13, 2, 11, 0], [14, 3, 8, 12, 7]]
    anchors = [6, 15]
    width = max(map(len, prompts))
    tokens = jnp.asarray([p + [0] * (width - len(p)) for p in prompts], jnp.int32)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    hidden, _, _, _ = _forward(target, tgt.init_cache(target, 2, 32), tokens)
    state = _prefill(proposer, target, proposer.init(target, 2, 32), hidden, lengths, tokens)
    assert np.asarray(state.lengths).tolist() == [len(p) for p in prompts]
    drafted, logits = greedy_steps(proposer, target, state, anchors)
    hidden = np.asarray(hidden)
    check_against_reference(reference, prompts, [hidden[b, : len(p)] for b, p in enumerate(prompts)], anchors,
                            drafted, logits)  # fmt: skip


def test_partial_commit_keeps_only_committed_positions(case):
    """A round whose block [anchor, d1, d2, d3] was kept to 2 and 4 tokens: the next draft equals theirs over
    exactly the committed sequence (nothing of the uncommitted drafts or of the draft steps stays visible)."""
    target, reference, proposer, _ = case
    prompts = [[5, 9, 1, 13, 2, 11], [14, 3, 8, 12, 7, 1]]
    anchors, n_keep = [6, 15], [2, 4]
    tokens = jnp.asarray(prompts, jnp.int32)
    six = jnp.full((2,), 6, jnp.int32)
    hidden, _, cache, record = _forward(target, tgt.init_cache(target, 2, 32), tokens)
    cache = tgt.replay(target, cache, record, six)  # the prompts' K/V (and GDN states) kept
    state = _prefill(proposer, target, proposer.init(target, 2, 32), hidden, six, tokens)
    drafted, _ = greedy_steps(proposer, target, state, anchors, num=3)
    block = np.concatenate([np.asarray(anchors)[:, None], drafted], axis=1).astype(np.int32)
    block_hidden, _, _, _ = _forward(target, cache, jnp.asarray(block))
    state = _commit(proposer, target, state, block_hidden, jnp.asarray(n_keep, jnp.int32), jnp.asarray(block))
    assert np.asarray(state.lengths).tolist() == [6 + k for k in n_keep]
    next_anchors = [9, 11]
    redrafted, logits = greedy_steps(proposer, target, state, next_anchors)
    hidden, block_hidden = np.asarray(hidden), np.asarray(block_hidden)
    committed = [prompts[b] + block[b, : n_keep[b]].tolist() for b in range(2)]
    states = [np.concatenate([hidden[b], block_hidden[b, : n_keep[b]]]) for b in range(2)]
    check_against_reference(reference, committed, states, next_anchors, redrafted, logits)


def test_save_loads_back_into_speculators(case, tmp_path):
    target, reference, proposer, _ = case
    M.save_mtp(proposer, tmp_path)
    config = MTPSpeculatorConfig.from_pretrained(tmp_path)
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 3
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = MTPDraftModel(config).float().eval()
    missing, unexpected = theirs.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= VERIFIER_OWNED
    got = theirs.state_dict()
    for name, value in reference.state_dict().items():
        if name not in VERIFIER_OWNED:
            assert torch.equal(got[name], value), name
    again = M.load_mtp(tmp_path, target, dtype="float32")  # and back into ours
    assert again.config == proposer.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(proposer.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_target_checkpoint_head_is_speculators_converters(hybrid):
    """speculators' converter reads the hybrid checkpoint's ``mtp.*`` tensors as the head we load."""
    _, reference, _, model_dir = hybrid
    converted = MTPConverter().convert_to_state_dict(model_dir)
    want = {k: v for k, v in reference.state_dict().items() if k not in VERIFIER_OWNED}
    assert set(converted) == set(want) and all(torch.equal(converted[k], want[k]) for k in want)


def test_init_head_saves_in_speculators_format(hybrid, tmp_path):
    """An untrained head for a hybrid target builds its layer config from the target's: their class loads it."""
    target = hybrid[0]
    fresh = M.init_mtp(target, block_size=3, seed=1)
    assert fresh.config.layer_type == "qwen3_5_text" and fresh.block_limit == 3
    assert float(jnp.abs(fresh.params.norm).max()) == 0.0  # zero-centred norms start at the identity
    M.save_mtp(fresh, tmp_path)
    config = MTPSpeculatorConfig.from_pretrained(tmp_path)
    theirs = MTPDraftModel(config)
    missing, unexpected = theirs.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= VERIFIER_OWNED
    assert M.load_mtp(tmp_path, target).config == fresh.config


def test_load_draft_dispatches_mtp(dense, hybrid, tmp_path):
    target, _, proposer, path = dense
    loaded = load_draft(str(path), target)
    assert isinstance(loaded, M.MTPProposer) and loaded.config == proposer.config
    assert panels.is_packed(loaded.params) == panels.is_packed(target.params)  # packed where the target is
    prompt = jnp.asarray([[5, 9, 1, 13, 2, 11]], jnp.int32)
    hidden, _, _, _ = _forward(target, tgt.init_cache(target, 1, 32), prompt)
    six = jnp.asarray([6], jnp.int32)
    runs = [greedy_steps(head, target, _prefill(head, target, head.init(target, 1, 32), hidden, six, prompt), [6])
            for head in (proposer, loaded)]  # fmt: skip
    assert (runs[0][0] == runs[1][0]).all()
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=0, atol=1e-4)  # packed products: another sum order
    int8 = load_draft(str(path), target, quantize="int8")
    assert quant.is_quantized(int8.params)
    first = greedy_steps(int8, target, _prefill(int8, target, int8.init(target, 1, 32), hidden, six, prompt), [6])[1]
    scale = np.abs(runs[0][1][:, 0]).max()  # per-channel int8 rounding: a few % of the first step's logit scale
    assert np.isfinite(first).all() and np.abs(first[:, 0] - runs[0][1][:, 0]).max() < 0.05 * scale
    assert draft_block_size(str(path)) == 4 and draft_block_size("self:mtp") == 4
    assert draft_block_size("init:mtp:5") == 5 and draft_block_size("self:mtp:3") == 3
    fresh = load_draft("init:mtp:3", target)
    assert isinstance(fresh, M.MTPProposer) and fresh.block_limit == 3 and fresh.config.layer_type == "qwen3"
    own = load_draft("self:mtp:3", hybrid[0])
    assert isinstance(own, M.MTPProposer) and own.block_limit == 3 and own.config == hybrid[2].config
    with pytest.raises(M.CheckpointError, match="no MTP head of its own"):
        load_draft("self:mtp", target)  # a dense target
    (tmp_path / "config.json").write_text(json.dumps(json.loads((hybrid[3] / "config.json").read_text())))
    save_safetensors({"model.norm.weight": np.zeros(4, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(M.CheckpointError, match="no mtp"):
        load_draft("self:mtp", hybrid[0].replace(model_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="BLOCK >= 2"):
        load_draft("self:mtp:1", hybrid[0])


# ----------------------------------------------------------------------------------------------
# Speculative decoding with an MTP head

PROMPTS = [[5, 9, 1, 13, 2, 11, 10], [14, 3, 8], [7, 7, 7, 7, 7]]


def echo_head(target) -> M.MTPProposer:
    """A head that proposes its input token again (the anchor, then its own proposals): the embedding mapped by
    ``fc`` onto directions the target's LM head reads as that token, the hidden and the layer silenced. Tiny
    random targets often repeat a token, so its proposals are often accepted, in full."""
    head = M.init_mtp(target, block_size=4, seed=2)  # norms at the identity
    embed = np.asarray(quant.dequantize(target.params.embed), np.float64)  # [V, H]
    lm_head = np.asarray(quant.dequantize(target.params.lm_head), np.float64)  # [H, V]
    normed = embed / np.sqrt((embed**2).mean(-1, keepdims=True) + head.config.rms_norm_eps)  # token_norm(e)
    wanted = np.linalg.pinv(lm_head.T)  # [H, V]: column t has logits one-hot on t
    fc = np.concatenate([np.linalg.pinv(normed) @ wanted.T, np.zeros((target.config.hidden_size,) * 2)])  # [2H, H]
    params = head.params.replace(fc=jnp.asarray(fc, jnp.float32), o=jnp.zeros_like(head.params.o),
                                 down=jnp.zeros_like(head.params.down))  # fmt: skip
    return head.replace(params=params)


def test_speculative_generate_is_greedy_exact_dense(dense):
    target = dense[0]
    want = generate(target, PROMPTS, 16, stop_ids=[]).token_ids
    got = speculative_generate(target, echo_head(target), PROMPTS, 16, stop_ids=[], verify=4)
    assert got.token_ids == want
    accepted = [n for row in got.accepted_proposals for n in row]
    assert accepted.count(3) >= 3 and any(0 < n < 3 for n in accepted)  # full and partial commits of drafts


def test_speculative_generate_is_greedy_exact_hybrid_with_its_own_head(hybrid):
    """The hybrid's own head (``self:mtp``, packed like the target): Gated DeltaNet layers replay the committed
    tokens of every round."""
    target = hybrid[0]
    proposer = load_draft("self:mtp", target)
    want = generate(target, PROMPTS, 16, stop_ids=[]).token_ids
    got = speculative_generate(target, proposer, PROMPTS, 16, stop_ids=[], verify=4)
    assert got.token_ids == want


@pytest.fixture(scope="module")
def vocab6_target(tmp_path_factory):
    import test_speculative_sampling as law

    model_dir, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("v6mtp") / "llama", seed=2, vocab_size=law.V)
    return load_target(model_dir)


def test_speculative_sampling_is_lossless(vocab6_target):
    """The joint law of the first 4 tokens (one verify of 3 proposals after the prefill's token) equals plain
    sampling's (test_speculative_sampling's chi-square check) on a vocab-6 target, with the rows' temperature,
    top-p and top-k in q: q is the sampling transform of the head's logits."""
    import test_speculative_sampling as law

    target = vocab6_target
    proposer = M.init_mtp(target, block_size=4, initializer_range=0.5, seed=5)
    samples, accepted = law.sample_first_tokens(target, proposer, 0.8, 0.9, 3, 4)
    # A useful check needs proposals both rejected and (fully) accepted often enough.
    assert 0.05 < (accepted == 0).mean() < 0.95 and (accepted == 3).mean() > 0.02
    counts = np.zeros((law.V,) * law.N_TOKENS, np.int64)
    np.add.at(counts, tuple(samples.T), 1)
    law.assert_fits(counts, law.exact_joint(target, 0.8, 0.9, 3))
