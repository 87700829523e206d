"""EAGLE-3 (``drafters/eagle3.py``) against vLLM's ``speculators==0.9.0`` ``Eagle3DraftModel``.

A tiny random speculators model is saved in its own format and loaded into ours. Given the same target
features and tokens, every draft step's logits equal theirs (float32) and the greedy proposals are theirs:
after a prompt, and after a round that committed only part of its block (drafted positions that were not
committed must not stay visible). Our save loads back into their class, tensor for tensor. Speculative
decoding with the head is greedy-exact at batch > 1 (dense and hybrid targets) and lossless at temperature > 0.

Their forward is the training one (test-time training steps with teacher forcing): step s at sequence index
i reads the token at index i + s and the previous step's output at index i. With the sequence ``[x_1 … x_n,
d_1 … d_{P-1}]`` (index i holds token x_{i+1} and the features of position i, speculators' ``shift_batch``),
index n - 1 follows exactly the draft our ``propose`` runs from anchor x_n with proposals d_1, d_2, …
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_COMMON, float32_noise, make_tiny_hf_model, require

from dspine_jax.decoding.autoregressive import generate
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters import eagle3 as E
from dspine_jax.drafters.io import load_draft
from dspine_jax.models import panels, quant
from dspine_jax.models import target as tgt
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import load_target

torch = require("torch")
require("speculators.models")
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import AutoConfig  # noqa: E402

V, H = TINY_COMMON["vocab_size"], TINY_COMMON["hidden_size"]
STEPS = 4  # draft steps compared per anchor
# Draft logits are compared with the reference run in float64: ours (float32) must be within
# ROUNDING_FACTOR × the float32 noise of the reference (``conftest.float32_noise``: |theirs f32 − theirs f64|,
# max over the draft steps, over their float32 model and copies with each weight one ulp away) + LOGIT_FLOOR.
# The chain of steps amplifies rounding: measured on the 2-layer case, both float32 implementations drift from
# float64 alike (3e-6 at step 0 to 1e-4–3e-4 at step 6; logit scale ~6).
ROUNDING_FACTOR = 2.0
LOGIT_FLOOR = 1e-5
LOGIT_ATOL = 1e-4  # packed (CPU panel kernel) vs plain products, both ours: a different summation order only

# (decoder layer type, layers, draft vocabulary size, speculators' fused ids on the 3-layer target, flags)
CASES = {
    "qwen3-1layer-vocab": ("qwen3", 1, 48, [1, 2, 3], {}),
    "llama-2layers-norms": ("llama", 2, V, [3, 1], dict(norm_before_residual=True, norm_output=True, fc_norm=True)),
    "qwen3-norm_before_fc": ("qwen3", 1, 40, [2, 3], dict(norm_before_fc=True)),
    # A 3-token window over 5–10 committed entries (speculators counts it from the anchor, for every draft step)
    "qwen3-sliding": ("qwen3", 2, V, [1, 2, 3], dict(layer=dict(layer_types=["sliding_attention", "full_attention"],
                                                               sliding_window=3, use_sliding_window=True))),
}


def make_reference(out_dir, layer_type: str, num_layers: int, draft_vocab: int, layer_ids: list[int], seed: int,
                   layer: dict | None = None, **flags) -> Eagle3DraftModel:  # fmt: skip
    """A random speculators Eagle3DraftModel for the tiny target, saved with ``save_pretrained`` (``layer``:
    overrides of its transformer_layer_config)."""
    torch.manual_seed(seed)
    layer = AutoConfig.for_model(
        layer_type, vocab_size=V, hidden_size=H, intermediate_size=80, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
        **(layer or {}),
    )  # fmt: skip
    layer._attn_implementation = "eager"  # (flex attention's block masks need a compiler on CPU)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=layer_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
        **flags,
    )  # fmt: skip
    model = Eagle3DraftModel(config).float().eval()
    if draft_vocab < V:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.randperm(V)[:draft_vocab]] = True
        ids = torch.nonzero(t2d)[:, 0]
        model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    with torch.no_grad():  # random weights of a useful scale; norms away from one so their wiring shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.25 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model


def reference_logits(model: Eagle3DraftModel, tokens: list[int], features: np.ndarray, steps: int) -> np.ndarray:
    """Their per-step logits ``[steps, len(tokens), Vd]`` for the shifted sequence ``tokens`` (index i: token
    x_{i+1}) with ``features [len, n·H]`` (index i: position i's taps, concatenated)."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: captured.append(output[0].detach()))
    try:
        with torch.no_grad():
            ids = torch.tensor([tokens])
            model(hidden_states=torch.from_numpy(features)[None], input_ids=ids, document_ids=torch.zeros_like(ids),
                  ttt_steps=steps)  # fmt: skip
    finally:
        hook.remove()
    return torch.stack(captured).numpy()


def concat_taps(tapped: np.ndarray) -> np.ndarray:
    """``[n, B, T, H]`` → ``[B, T, n·H]`` (speculators concatenates the aux layers in id order)."""
    n, b, t, h = tapped.shape
    return np.transpose(tapped, (1, 2, 0, 3)).reshape(b, t, n * h)


@pytest.fixture(scope="module")
def qwen3_tiny(tmp_path_factory):
    model_dir, _ = make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("e3t") / "qwen3", seed=1,
                                      tie_word_embeddings=False)  # fmt: skip
    return load_target(model_dir)


def build_pair(case: str, target, tmp_path_factory):
    """(their model, ours loaded from its checkpoint, the checkpoint directory) for ``CASES[case]``."""
    layer_type, num_layers, vd, ids, flags = CASES[case]
    out = tmp_path_factory.mktemp(f"e3-{case}")
    reference = make_reference(out, layer_type, num_layers, vd, ids, seed=3, **flags)
    return reference, E.load_eagle3(out, target, dtype="float32"), out


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, qwen3_tiny, tmp_path_factory):
    return build_pair(request.param, qwen3_tiny, tmp_path_factory)


@pytest.fixture(scope="module")
def deep_pair(qwen3_tiny, tmp_path_factory):
    """The 2-layer case alone (tests that need one head, not every layout)."""
    return build_pair("llama-2layers-norms", qwen3_tiny, tmp_path_factory)


_prefill = jax.jit(lambda p, t, s, hidden, tapped, lengths, tokens: p.prefill(t, s, hidden, tapped, lengths, tokens))
_commit = jax.jit(lambda p, t, s, hidden, tapped, n, tokens: p.commit(t, s, hidden, tapped, n, tokens))
_steps = jax.jit(E.draft_steps, static_argnames="num")


def greedy_steps(proposer, target, state, anchor, num=STEPS):
    keys = jax.random.split(jax.random.key(0), len(anchor))
    anchor = jnp.asarray(anchor, jnp.int32)
    out, logits = _steps(proposer, target, state, anchor, keys, Sampling.rows(len(anchor)), num=num)
    return np.asarray(out.tokens), np.asarray(logits)


def check_against_reference(reference, proposer, committed: list[list[int]], features: list[np.ndarray],
                            anchors: list[int], tokens: np.ndarray, logits: np.ndarray) -> None:  # fmt: skip
    """Row b committed ``committed[b]`` with features ``features[b] [n, n·H]``; from ``anchors[b]`` ours drafted
    ``tokens[b]`` with ``logits[b] [P, Vd]``: theirs must give the same logits and argmaxes."""
    ids = np.asarray(E.vocab_ids(proposer))
    reference64 = copy.deepcopy(reference).double()
    for b, (seq, feats, anchor) in enumerate(zip(committed, features, anchors, strict=True)):
        n = len(seq)
        shifted = seq[1:] + [anchor] + [int(x) for x in tokens[b, :-1]]
        padded = np.concatenate([feats, np.zeros((STEPS - 1, feats.shape[1]), np.float32)])
        run = lambda model: reference_logits(model, shifted, padded, STEPS)[:, n - 1]  # noqa: B023 [P, Vd]
        theirs = run(reference)
        exact = reference_logits(reference64, shifted, padded.astype(np.float64), STEPS)[:, n - 1]
        rounding = float32_noise(run, reference, exact)
        assert np.abs(logits[b] - exact).max() <= ROUNDING_FACTOR * rounding + LOGIT_FLOOR
        assert (ids[exact.argmax(-1)] == tokens[b]).all() and (theirs.argmax(-1) == exact.argmax(-1)).all()
        top2 = np.sort(exact, -1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 100 * (rounding + LOGIT_FLOOR)).all()  # no near-ties: proposals are robust


def test_config_and_weights_load(pair, qwen3_tiny):
    reference, proposer, _ = pair
    c, theirs = proposer.config, reference.config
    assert c.layer_ids == tuple(theirs.eagle_aux_hidden_state_layer_ids)
    assert proposer.taps == tuple(i - 1 for i in theirs.eagle_aux_hidden_state_layer_ids)
    assert c.draft_vocab_size == theirs.draft_vocab_size
    assert c.num_layers == theirs.transformer_layer_config.num_hidden_layers
    assert (c.norm_before_residual, c.norm_before_fc, c.fc_norm, c.norm_output) == (
        theirs.norm_before_residual, theirs.norm_before_fc, theirs.fc_norm, theirs.norm_output)
    assert proposer.block_limit == 4  # speculative_tokens 3 + the anchor
    types = getattr(theirs.transformer_layer_config, "layer_types", None) or ["full_attention"] * c.num_layers
    assert c.layer_windows == tuple(3 if t == "sliding_attention" else 0 for t in types)
    if c.has_draft_vocab:
        assert np.array_equal(np.asarray(proposer.params.draft_ids), torch.nonzero(reference.t2d)[:, 0].numpy())
    else:
        assert proposer.params.draft_ids is None
    assert proposer.params.embed is not None  # their random embedding differs from the target's


def test_draft_logits_and_proposals_match_after_prefill(pair, qwen3_tiny):
    reference, proposer, _ = pair
    target = qwen3_tiny
    prompts = [[5, 9, 17, 33, 2, 71, 100], [40, 3, 88, 12, 7]]
    anchors = [21, 64]
    width = max(map(len, prompts))
    tokens = np.asarray([p + [0] * (width - len(p)) for p in prompts], np.int32)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    hidden, tapped, _, _ = tgt.forward(target, tgt.init_cache(target, 2, 32), jnp.asarray(tokens), proposer.taps)
    state = _prefill(proposer, target, proposer.init(target, 2, 32), hidden, tapped, lengths, jnp.asarray(tokens))
    assert np.asarray(state.lengths).tolist() == [len(p) for p in prompts]
    drafted, logits = greedy_steps(proposer, target, state, anchors)
    feats = concat_taps(np.asarray(tapped))
    check_against_reference(reference, proposer, prompts, [feats[b, : len(p)] for b, p in enumerate(prompts)],
                            anchors, drafted, logits)  # fmt: skip


def test_partial_commit_keeps_only_committed_positions(pair, qwen3_tiny):
    """A round whose block [anchor, d1, d2, d3] was kept to 2 and 4 tokens: the next draft equals theirs over
    exactly the committed sequence (nothing of the uncommitted drafts or of the draft steps stays visible)."""
    reference, proposer, _ = pair
    target = qwen3_tiny
    prompts = [[5, 9, 17, 33, 2, 71], [40, 3, 88, 12, 7, 1]]
    anchors, n_keep = [21, 64], [2, 4]
    tokens = jnp.asarray(prompts, jnp.int32)
    cache = tgt.init_cache(target, 2, 32)
    hidden, tapped, cache, _ = tgt.forward(target, cache, tokens, proposer.taps)
    cache = cache.commit(jnp.full((2,), 6, jnp.int32))  # the prompts' K/V
    six = jnp.full((2,), 6, jnp.int32)
    state = _prefill(proposer, target, proposer.init(target, 2, 32), hidden, tapped, six, tokens)
    drafted, _ = greedy_steps(proposer, target, state, anchors, num=3)
    block = np.concatenate([np.asarray(anchors)[:, None], drafted], axis=1).astype(np.int32)
    block_hidden, block_tapped, _, _ = tgt.forward(target, cache, jnp.asarray(block), proposer.taps)
    kept = jnp.asarray(n_keep, jnp.int32)
    state = _commit(proposer, target, state, block_hidden, block_tapped, kept, jnp.asarray(block))
    assert np.asarray(state.lengths).tolist() == [6 + k for k in n_keep]
    next_anchors = [99, 11]
    redrafted, logits = greedy_steps(proposer, target, state, next_anchors)
    feats, block_feats = concat_taps(np.asarray(tapped)), concat_taps(np.asarray(block_tapped))
    committed = [prompts[b] + block[b, : n_keep[b]].tolist() for b in range(2)]
    features = [np.concatenate([feats[b], block_feats[b, : n_keep[b]]]) for b in range(2)]
    check_against_reference(reference, proposer, committed, features, next_anchors, redrafted, logits)


def test_save_loads_back_into_speculators(pair, qwen3_tiny, tmp_path):
    reference, proposer, _ = pair
    E.save_eagle3(proposer, tmp_path, target=qwen3_tiny)
    config = Eagle3SpeculatorConfig.from_pretrained(tmp_path)
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = Eagle3DraftModel(config).float().eval()
    from safetensors.torch import load_file

    missing, unexpected = theirs.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"verifier_lm_head.weight", "verifier_norm.weight"}
    want = reference.state_dict()
    got = theirs.state_dict()
    for name, value in want.items():
        if name.startswith("verifier_"):
            continue
        assert torch.equal(got[name].to(value.dtype), value), name
    assert config.eagle_aux_hidden_state_layer_ids == reference.config.eagle_aux_hidden_state_layer_ids
    assert (config.norm_before_residual, config.norm_before_fc, config.fc_norm, config.norm_output) == (
        reference.config.norm_before_residual, reference.config.norm_before_fc, reference.config.fc_norm,
        reference.config.norm_output)  # fmt: skip
    again = E.load_eagle3(tmp_path, qwen3_tiny, dtype="float32")  # and back into ours
    assert again.config == proposer.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(proposer.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_load_draft_dispatches_eagle3(pair, qwen3_tiny):
    _, proposer, path = pair
    loaded = load_draft(str(path), qwen3_tiny)
    assert isinstance(loaded, E.Eagle3Proposer) and loaded.config == proposer.config
    fresh = load_draft("init:eagle3:3", qwen3_tiny)
    assert isinstance(fresh, E.Eagle3Proposer) and fresh.block_limit == 3
    assert fresh.params.embed is None  # shares the target's embedding


def test_rejects_mismatched_checkpoints(qwen3_tiny, tmp_path):
    make_reference(tmp_path, "qwen3", 1, V, [1, 4], seed=0)  # id 4 > the target's 3 layers
    with pytest.raises(E.CheckpointError, match="fuses target layers"):
        E.load_eagle3(tmp_path, qwen3_tiny)
    make_reference(tmp_path, "qwen3", 1, V, [0, 2], seed=0)  # id 0: the embedding output, not a tap
    with pytest.raises(E.CheckpointError, match="id 0"):
        E.load_eagle3(tmp_path, qwen3_tiny)


def test_load_draft_quantized_and_packed_proposes_like_plain(deep_pair, qwen3_tiny):
    """``load_draft`` packs the head's matrices for the CPU panel kernel (as the target's) or quantises them."""
    _, proposer, path = deep_pair
    target = qwen3_tiny
    prompt = jnp.asarray([[5, 9, 17, 33, 2, 71]], jnp.int32)
    hidden, tapped, _, _ = tgt.forward(target, tgt.init_cache(target, 1, 32), prompt, proposer.taps)
    lengths = jnp.asarray([6], jnp.int32)

    def run(head):
        state = _prefill(head, target, head.init(target, 1, 32), hidden, tapped, lengths, prompt)
        return greedy_steps(head, target, state, [21])

    want_tokens, want_logits = run(proposer)
    packed = load_draft(str(path), target)
    assert panels.is_packed(packed.params) == panels.is_packed(target.params)  # packed where the target is
    got_tokens, got_logits = run(packed)
    assert (got_tokens == want_tokens).all()
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=LOGIT_ATOL)
    int8 = load_draft(str(path), target, quantize="int8")
    assert quant.is_quantized(int8.params)
    _, int8_logits = run(int8)
    # Per-channel int8 rounding moves the first step's logits by ~2 % of their scale (measured 1.8–2.2 %); later
    # steps feed the rounded outputs back, so only the first is compared.
    assert np.isfinite(int8_logits).all()
    assert np.abs(int8_logits[:, 0] - want_logits[:, 0]).max() < 0.05 * np.abs(want_logits[:, 0]).max()


# ----------------------------------------------------------------------------------------------
# Speculative decoding with an EAGLE-3 head

# An entry pairs a token with the previous position's features: the round hands ``prefill`` / ``commit`` the
# tokens it ran (``tokens=``).
PROMPTS = [[5, 9, 17, 33, 2, 71, 100], [40, 3, 88], [7, 7, 7, 7, 7]]


def test_speculative_generate_is_greedy_exact_dense(pair, qwen3_tiny):
    _, proposer, _ = pair
    want = generate(qwen3_tiny, PROMPTS, 24, stop_ids=[]).token_ids
    got = speculative_generate(qwen3_tiny, proposer, PROMPTS, 24, stop_ids=[], verify=4)
    assert got.token_ids == want


@pytest.fixture(scope="module")
def hybrid_target(tmp_path_factory):
    from test_hybrid import make_tiny_hybrid

    model_dir, _ = make_tiny_hybrid("qwen3_5_text", tmp_path_factory.mktemp("e3h") / "qwen3_5", seed=0)
    return load_target(model_dir)


def test_speculative_generate_is_greedy_exact_hybrid(hybrid_target):
    """A Qwen3.5 hybrid (Gated DeltaNet layers replay the committed tokens); the adaptive policy switches lengths."""
    target = hybrid_target
    proposer = E.init_eagle3(target, block_size=4, layer_ids=(1, 2, 4), draft_ids=np.arange(0, V, 2),
                             initializer_range=0.3, seed=4)  # fmt: skip
    want = generate(target, PROMPTS, 20, stop_ids=[]).token_ids
    got = speculative_generate(target, proposer, PROMPTS, 20, stop_ids=[], verify_schedule=[4, 2, 1, 2],
                               verify_costs={1: 1.0, 2: 1.0, 4: 1.0})  # fmt: skip
    assert got.token_ids == want
    assert all(set(row) >= {4, 2} for row in got.verify_lengths)


@pytest.fixture(scope="module")
def vocab6_target(tmp_path_factory):
    import test_speculative_sampling as law

    model_dir, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("v6e3") / "llama", seed=2, vocab_size=law.V)
    return load_target(model_dir)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.8, 0.9, 3)])
def test_speculative_sampling_is_lossless(vocab6_target, temperature, top_p, top_k):
    """The joint law of the first 4 tokens (one verify of 3 proposals after the prefill's token) equals plain
    sampling's (test_speculative_sampling's chi-square check), on a vocab-6 target, with a draft vocabulary of
    4 of the 6 tokens (q zero on the other two) and the rows' own temperature / top-p / top-k in q."""
    import test_speculative_sampling as law

    target = vocab6_target
    proposer = E.init_eagle3(target, block_size=4, layer_ids=(1, 2, 3), draft_ids=[0, 2, 3, 5], layer_type="llama",
                             initializer_range=0.5, seed=5)  # fmt: skip
    samples, accepted = law.sample_first_tokens(target, proposer, temperature, top_p, top_k, 4)
    # A useful check needs proposals both rejected and (fully) accepted often enough.
    assert 0.05 < (accepted == 0).mean() < 0.95 and (accepted == 3).mean() > 0.02
    counts = np.zeros((law.V,) * law.N_TOKENS, np.int64)
    np.add.at(counts, tuple(samples.T), 1)
    law.assert_fits(counts, law.exact_joint(target, temperature, top_p, top_k))


def test_serving_engine_with_eagle3_equals_generate(deep_pair, qwen3_tiny):
    """The engine: chunked prefill (a 45-token prompt in 32-token chunks), row and capacity buckets, slots
    reused by later requests."""
    import test_serve_engine as serve

    _, proposer, _ = deep_pair
    prompts = serve.PROMPTS + [[(7 * i) % V for i in range(1, 46)]]
    budgets = serve.BUDGETS + [12]
    want = [generate(qwen3_tiny, [p], b, stop_ids=[]).token_ids[0] for p, b in zip(prompts, budgets, strict=True)]
    core = serve.EngineCore(qwen3_tiny, proposer, num_slots=3, context_length=64, stop_ids=[], prefill_chunk=32,
                            sps_table={1: 4, 2: 2})  # fmt: skip
    got, _, _ = serve.run_engine(core, prompts, budgets)
    assert got == want
