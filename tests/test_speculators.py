"""vLLM ``speculators`` (0.9.0) checkpoints ↔ our ``dflash``, ``dflash2`` and ``dspark`` kinds.

For each kind (DSpark in each Markov variant and both anchor conventions), a tiny random model built and
saved by speculators itself (``save_pretrained``) loads with ``load_drafter``; on the same context features,
anchored at two different positions (two rows), our block's per-slot draft logits equal those of its
``_backbone_forward`` (the anchored-block forward its training runs; DSpark's Markov bias and confidence
head applied exactly as its ``forward`` does, teacher-forced with our walked tokens), and our greedy
proposals are its greedy choices slot by slot (DFlash2: its ``CandidateSelector`` over the unary top-k).
Our export (``save_drafter(format="speculators")``) loads back through ``SpeculatorModel.from_pretrained``
with the same config and every tensor identical, and a fresh drafter of ours exported that way runs the
same in speculators.

The reference models get O(1) random weights (speculators' init leaves the DFlash2 convolutions at the
identity and the Markov head small, which would hide wiring mistakes); the tests check that the DFlash2
selector and the DSpark Markov head really change the proposals.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require
from drafter_helpers import append, block_logits, tapped_features
from safetensors.numpy import load_file

from dspine_jax.drafters import drafter as D
from dspine_jax.drafters import dspark
from dspine_jax.drafters.config import DrafterConfigError, drafter_config_from_dict
from dspine_jax.drafters.io import init_drafter, load_drafter, save_drafter
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.weights import CheckpointError

torch = require("torch")
require("speculators.models")
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.model import SpeculatorModel  # noqa: E402
from speculators.models.attention import create_float_mask  # noqa: E402
from speculators.models.dflash import DFlashSpeculatorConfig  # noqa: E402
from speculators.models.dflash.core import DFlashDraftModel  # noqa: E402
from speculators.models.dflash2 import DFlash2SpeculatorConfig  # noqa: E402
from speculators.models.dflash2.core import DFlash2DraftModel  # noqa: E402
from speculators.models.dspark import DSparkSpeculatorConfig  # noqa: E402
from speculators.models.dspark.core import DSparkDraftModel  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402

BLOCK = 4
MASK_ID = 5
AUX_IDS = [1, 2]  # speculators' hidden_states indices = our taps [0, 1] of the 3-layer tiny Qwen3
VOCAB = 128
HIDDEN = 64
ANCHORS = [6, 11]  # one anchored block per row, at different context lengths
SEQ = 20  # ≥ max(ANCHORS) + 2·BLOCK: speculators never anchors in a sequence's last block
CLASSES = {
    "dflash": (DFlashSpeculatorConfig, DFlashDraftModel),
    "dflash2": (DFlash2SpeculatorConfig, DFlash2DraftModel),
    "dspark": (DSparkSpeculatorConfig, DSparkDraftModel),
}
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
CASES = [
    ("dflash", {}),
    ("dflash2", DFLASH2),
    ("dspark", {"markov_rank": 8, "markov_head_type": "vanilla"}),
    ("dspark", {"markov_rank": 8, "markov_head_type": "gated"}),
    ("dspark", {"markov_rank": 8, "markov_head_type": "rnn"}),
    ("dspark", {"markov_rank": 8, "markov_head_type": "rnn", "sample_from_anchor": False}),
    ("dspark", {"markov_rank": 8, "markov_head_type": "gated", "confidence_head_with_markov": False}),
    # A reduced draft vocabulary (d2t / t2d, speculators' lm_head rows and Markov w2 over it).
    ("dflash", {"draft_vocab_size": 96}),
    ("dspark", {"markov_rank": 8, "markov_head_type": "rnn", "draft_vocab_size": 96}),
]
CASE_IDS = ["dflash", "dflash2", "dspark-vanilla", "dspark-gated", "dspark-rnn", "dspark-rnn-dflash-anchor",
            "dspark-gated-plain-confidence", "dflash-draft-vocab", "dspark-rnn-draft-vocab"]  # fmt: skip


def eager(model):
    """Run speculators' model with eager attention and a dense float mask (its default, flex attention with
    a torch.compile'd block mask, needs a C++ toolchain at first use on CPU)."""
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl = "eager"
    model._create_mask_fn = create_float_mask
    return model


def with_verifier(model, hf_target):
    """The verifier-owned weights speculators reloads from the verifier (none is named here): its embedding,
    and its head (the draft vocabulary's rows of it)."""
    with torch.no_grad():
        model.embed_tokens.weight.copy_(hf_target.model.embed_tokens.weight)
        head = hf_target.lm_head.weight
        model.lm_head.weight.copy_(head[model.t2d.bool()] if model.use_draft_vocab else head)
    return model


def make_theirs(kind: str, out_dir: Path, seed: int, hf_target, **settings):
    """A speculators ``kind`` model with O(1) random weights, saved with its own ``save_pretrained``."""
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    layer = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    )  # fmt: skip
    layer._attn_implementation = "eager"
    config_class, model_class = CLASSES[kind]
    settings = dict(settings)
    draft_vocab = settings.pop("draft_vocab_size", VOCAB)
    anchored = settings.get("sample_from_anchor", kind == "dspark")
    spec = SpeculatorsConfig(
        algorithm=kind, default_proposal_method="greedy",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK if anchored else BLOCK - 1)],
        verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
    )  # fmt: skip
    config = config_class(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=BLOCK, aux_hidden_state_layer_ids=AUX_IDS,
        mask_token_id=MASK_ID, speculators_config=spec, **settings,
    )  # fmt: skip
    model = model_class(config).float().eval()
    if draft_vocab != VOCAB:
        ids = np.sort(np.random.RandomState(seed).choice(VOCAB, draft_vocab, replace=False))
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, torch.as_tensor(ids - np.arange(draft_vocab)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "lm_head", "verifier_")):
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("base_kernel"):
                p.copy_(0.3 * torch.randn_like(p))
                p[:, 0] += 1.0
            elif "codebook" in name or name.endswith("markov_w1.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    with_verifier(model, hf_target)
    model.save_pretrained(out_dir)
    return model


def theirs_block(model, features: np.ndarray, ids: np.ndarray, anchor: int) -> dict[str, np.ndarray]:
    """Speculators' outputs for the one block anchored at ``anchor`` of ``ids [S]`` with context features
    ``[S, n·H]`` (its training forward with one anchor): hidden ``[T, H]``, logits ``[T, V]`` (DSpark: with
    its Markov bias, its previous tokens teacher-forced from ``ids``), confidence ``[T]`` (DSpark)."""
    s = len(ids)
    loss_mask = torch.zeros(1, s)
    loss_mask[0, anchor] = 1  # the only valid anchor: select_anchors picks exactly it
    input_ids = torch.as_tensor(ids[None], dtype=torch.long)
    with torch.no_grad():
        hidden, logits, _, _, indices = model._backbone_forward(
            torch.as_tensor(features[None]), input_ids, loss_mask, torch.zeros(1, s, HIDDEN),
            torch.zeros(1, s, dtype=torch.long), max_anchors=1,
        )  # fmt: skip
        out = {"hidden": hidden[0].numpy(), "logits": logits[0].numpy()}
        if isinstance(model, DSparkDraftModel):  # the lines of DSparkDraftModel.forward after the backbone
            block_tokens = input_ids[0, indices].view(1, BLOCK)
            prev = block_tokens if model.config.sample_from_anchor else torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], 1)
            hidden_blocks = hidden.view(1, BLOCK, -1)
            prev_emb = None
            if model.markov_head is not None:
                prev_emb = model.markov_head.prev_embeddings(prev)
                bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden_blocks, prev_emb=prev_emb)
                out["logits"] = (logits.view(1, BLOCK, -1) + bias)[0].numpy()
            if model.confidence_head is not None:
                features_c = hidden_blocks
                if model.config.confidence_head_with_markov:
                    features_c = torch.cat([hidden_blocks, prev_emb], dim=-1)
                out["confidence"] = torch.sigmoid(model.confidence_head(features_c))[0].numpy()
    return out


@pytest.fixture(scope="module")
def context(qwen3_target):
    """Token rows ``[2, SEQ]`` and their tapped features: ours ``[n, 2, SEQ, H]``, speculators' ``[2, SEQ, n·H]``."""
    target, _ = qwen3_target
    seqs = np.random.RandomState(0).randint(6, VOCAB, size=(2, SEQ)).astype(np.int32)
    tapped = tapped_features(target, seqs, [i - 1 for i in AUX_IDS])
    return seqs, tapped, np.concatenate(list(np.asarray(tapped)), axis=-1)


def ours_block(drafter, target, seqs: np.ndarray, tapped) -> dict[str, np.ndarray]:
    """Our greedy draft of the blocks anchored at ``ANCHORS``: tokens ``[B, P]``, per-slot logits ``[B, P, V]``
    (DSpark: with the Markov bias along our walk), confidence ``[B, P]`` (DSpark)."""
    cache = append(drafter, init_draft_cache(drafter, 2, 32), tapped, jnp.asarray(ANCHORS, jnp.int32))
    anchor = jnp.asarray(seqs[np.arange(2), ANCHORS], jnp.int32)
    keys, sampling = jax.random.split(jax.random.key(0), 2), Sampling.rows(2)
    if drafter.config.kind == "dspark":
        out = jax.jit(dspark.walk)(drafter, target, cache, anchor, keys, sampling)
        result = {"tokens": np.asarray(out.tokens), "logits": np.asarray(out.logits)}
        if out.confidence is not None:
            result["confidence"] = np.asarray(out.confidence)
        return result
    out = jax.jit(D.draft)(drafter, target, cache, anchor, keys, sampling)
    return {"tokens": np.asarray(out.tokens), "logits": block_logits(drafter, target, cache, anchor)}


def check_parity(theirs, drafter, target, context) -> dict[str, np.ndarray]:
    """Per-slot logits, confidence and greedy choices of ``drafter`` (ours) against ``theirs`` on both rows."""
    seqs, tapped, features = context
    ours = ours_block(drafter, target, seqs, tapped)
    kind = drafter.config.kind
    draft_ids = drafter.params.draft_ids  # their logits index the draft vocabulary; our tokens are target ids
    to_target = (lambda i: i) if draft_ids is None else (lambda i: np.asarray(draft_ids)[i])  # noqa: E731
    offset = 0 if getattr(drafter.config, "sample_from_anchor", False) else 1  # block position of slot 1
    for row, anchor in enumerate(ANCHORS):
        ids = seqs[row].copy()
        # Teacher-force our walk (DSpark's previous tokens; an anchored DSpark's last proposal, past the block, is
        # nobody's previous token).
        ids[anchor + 1 : anchor + BLOCK] = ours["tokens"][row][: BLOCK - 1]
        ref = theirs_block(theirs, features[row], ids, anchor)
        slots = slice(offset, BLOCK)  # every block position proposes from `offset` on
        scale = np.abs(ref["logits"][slots]).max()
        np.testing.assert_allclose(ours["logits"][row], ref["logits"][slots], rtol=1e-5, atol=1e-5 * scale)
        if "confidence" in ref:
            np.testing.assert_allclose(ours["confidence"][row], ref["confidence"][slots], rtol=1e-5, atol=1e-6)
        if kind == "dflash2":  # speculators' selector, given the predecessors we walked
            prev = torch.as_tensor(np.concatenate([[seqs[row, anchor]], ours["tokens"][row][:-1]])[None])
            unary = torch.as_tensor(ref["logits"][None, 1:])
            hidden = torch.as_tensor(ref["hidden"][None, 1:])
            with torch.no_grad():
                cand, scores = theirs.candidate_selector.select(unary, hidden, prev)
            choice = torch.gather(cand, -1, scores.argmax(-1, keepdim=True))[0, :, 0].numpy()
        else:
            choice = ref["logits"][slots].argmax(-1)
        np.testing.assert_array_equal(ours["tokens"][row], to_target(choice))
    return ours


@pytest.mark.parametrize("kind,settings", CASES, ids=CASE_IDS)
def test_speculators_checkpoint_loads_and_drafts_alike(qwen3_target, context, tmp_path, kind, settings):
    target, hf_target = qwen3_target
    theirs = eager(make_theirs(kind, tmp_path / "theirs", seed=3, hf_target=hf_target, **settings))
    drafter = load_drafter(tmp_path / "theirs", target)
    config = drafter.config
    assert config.kind == kind and config.block_size == BLOCK and config.mask_token_id == MASK_ID
    assert config.target_layer_ids == (0, 1) and not any(config.layer_causal) and config.num_target_layers == 0
    for key, value in settings.items():
        assert getattr(config, "top_k" if key == "selector_top_k" else key) == value
    if "draft_vocab_size" in settings:
        assert np.asarray(drafter.params.draft_ids).tolist() == np.flatnonzero(theirs.t2d.numpy()).tolist()
    ours = check_parity(theirs, drafter, target, context)

    # The kind's own head decides proposals: without it (DFlash2's selector, DSpark's Markov bias) they differ.
    if kind == "dflash2":
        plain = ours["logits"].argmax(-1)
        assert (plain != ours["tokens"]).any()
    if kind == "dspark":
        bare_config = dataclasses.replace(config, markov_rank=0, enable_confidence_head=False)
        bare = drafter.replace(params=drafter.params.replace(markov=None, confidence=None), config=bare_config)
        assert (ours_block(bare, target, *context[:2])["tokens"] != ours["tokens"]).any()

    # Our export loads back into speculators: the same config and exactly the same tensors.
    save_drafter(drafter, tmp_path / "ours", format="speculators")
    back = SpeculatorModel.from_pretrained(str(tmp_path / "ours"))
    assert type(back) is type(theirs)
    theirs_file, ours_file = load_file(tmp_path / "theirs" / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert sorted(ours_file) == sorted(theirs_file)
    state = back.state_dict()
    for name, value in theirs_file.items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)
    keys = ("speculators_model_type", "block_size", "mask_token_id", "aux_hidden_state_layer_ids", "draft_vocab_size",
            "sample_from_anchor", *settings)  # fmt: skip
    theirs_cfg, ours_cfg = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("theirs", "ours"))
    assert {k: ours_cfg[k] for k in keys} == {k: theirs_cfg[k] for k in keys}
    # And our re-load of our own export drafts the same.
    again = load_drafter(tmp_path / "ours", target)
    assert ours_block(again, target, *context[:2])["tokens"].tolist() == ours["tokens"].tolist()


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_fresh_dspark_export_runs_the_same_in_speculators(qwen3_target, context, tmp_path, head):
    """``init_drafter(kind="dspark")`` → ``save_drafter`` (speculators' layout by default for DSpark) →
    ``SpeculatorModel.from_pretrained`` → the same per-slot logits, confidence and greedy proposals."""
    target, hf_target = qwen3_target
    drafter = init_drafter(target, "dspark", num_layers=2, intermediate_size=96, block_size=BLOCK, mask_token_id=MASK_ID,
                           target_layer_ids=[0, 1], markov_rank=8, markov_head_type=head, seed=2, initializer_range=0.3)  # fmt: skip
    save_drafter(drafter, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["speculators_model_type"] == "dspark"
    theirs = eager(with_verifier(SpeculatorModel.from_pretrained(str(tmp_path / "ours")), hf_target))
    assert type(theirs) is DSparkDraftModel and theirs.config.markov_head_type == head
    check_parity(theirs, drafter, target, context)


def test_speculators_config_translation_refuses_what_it_cannot_run(tmp_path):
    base = {
        "speculators_model_type": "dflash", "block_size": 4, "mask_token_id": 5, "aux_hidden_state_layer_ids": [1, 3],
        "draft_vocab_size": 128,
        "transformer_layer_config": {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64,
                                     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "head_dim": 16},
    }  # fmt: skip
    config = drafter_config_from_dict(base)
    assert config.kind == "dflash" and config.target_layer_ids == (0, 2) and config.draft_vocab_size == 0
    bad = [
        ({"speculators_model_type": "peagle"}, "not a drafter kind"),
        ({"aux_hidden_state_layer_ids": [0, 2]}, "embeddings"),
        ({"sample_from_anchor": True}, "sample_from_anchor"),
        ({"transformer_layer_config": {**base["transformer_layer_config"], "layer_types": ["sliding_attention"] * 2,
                                       "use_sliding_window": True, "sliding_window": 8}}, "anchor"),
        ({"mask_token_id": None}, "mask_token_id"),
    ]  # fmt: skip
    for edit, message in bad:
        with pytest.raises(DrafterConfigError, match=message):
            drafter_config_from_dict({**base, **edit})
    # DSpark: speculators' defaults fill what a file leaves out.
    dspark_config = drafter_config_from_dict({**base, "speculators_model_type": "dspark"})
    assert (dspark_config.markov_rank, dspark_config.markov_head_type, dspark_config.sample_from_anchor) == (256, "vanilla", True)
    with pytest.raises(DrafterConfigError, match="markov_head_type"):
        drafter_config_from_dict({**base, "speculators_model_type": "dspark", "markov_head_type": "lstm"})


def test_speculators_export_refuses_what_speculators_cannot_run(qwen3_target, tmp_path):
    target, _ = qwen3_target
    causal = init_drafter(target, "dflash", num_layers=1, block_size=BLOCK, is_causal=True)
    with pytest.raises(ValueError, match="bidirectional"):
        save_drafter(causal, tmp_path / "a", format="speculators")
    with pytest.raises(ValueError, match="no speculators format"):
        save_drafter(init_drafter(target, "dspine", num_layers=1, block_size=BLOCK), tmp_path / "b", format="speculators")
    # A checkpoint missing a head tensor its config asks for is refused by name.
    drafter = init_drafter(target, "dspark", num_layers=1, block_size=BLOCK, markov_rank=4, markov_head_type="rnn")
    save_drafter(drafter, tmp_path / "c")
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    del tensors["markov_head.joint_proj.bias"]
    from safetensors.numpy import save_file

    save_file(tensors, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="joint_proj.bias"):
        load_drafter(tmp_path / "c", target)
