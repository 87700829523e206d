"""DFlash2 vs the z-lab reference (``dflash==0.1.0``, ``DFlash2DraftModel``): its checkpoint loads as our
``dflash2`` kind; greedy ``speculative_generate`` commits the same tokens with the same per-round
acceptance as ``dflash_generate``; every round's proposals are the reference's; the draft distribution q
at temperature 1 is the one ``propose`` samples from; the convolution alone matches ``dflash``'s; a save →
load round trip (ours and ``DFlash2DraftModel.from_pretrained``) keeps every tensor; fresh drafters.
Training's forward (blocks side by side) is checked against inference in test_train.py, as for every kind.

The reference drafter has O(1) random weights (z-lab leaves ``base_kernel`` uninitialised and the default
N(0, 0.02) init would hide wiring mistakes); the tests check that its convolutions and its selector really
change what is proposed, so agreeing with the reference is not agreeing with plain DFlash."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require
from drafter_helpers import append, block_logits

from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters import drafter as D
from dspine_jax.drafters import params as params_mod
from dspine_jax.drafters.config import DrafterConfigError, drafter_config_from_dict
from dspine_jax.drafters.dflash2 import DFlash2Params, DynamicConv, grouped_causal_conv
from dspine_jax.drafters.io import init_drafter, load_drafter, save_drafter
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import forward as target_forward
from dspine_jax.models.target import init_cache

torch = require("torch")
dflash_model = require("dflash.model")

BLOCK = 4
MASK_ID = 5
TAPS = [0, 1]
VOCAB = 128
SETTINGS = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
MAX_NEW = 40
PROMPTS = [np.random.RandomState(seed).randint(3, VOCAB, size=n).tolist() for seed, n in ((0, 7), (1, 5), (2, 11))]
CAPACITY = 64  # ≥ the longest prompt + MAX_NEW


def make_zlab_dflash2(out_dir: Path, seed: int, **overrides) -> dflash_model.DFlash2DraftModel:
    """A z-lab ``DFlash2DraftModel`` with O(1) random weights, saved with ``save_pretrained``. The static
    kernels are the identity plus 0.3·N(0, 1) taps (every slot mixes its predecessors'); the codebooks are
    scaled so the selector's transition term competes with the unary logits without drowning them."""
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    cfg = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "num_target_layers": 3, "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS, **SETTINGS},
    }  # fmt: skip
    model = dflash_model.DFlash2DraftModel(Qwen3Config(**{**cfg, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("base_kernel"):
                p.copy_(0.3 * torch.randn_like(p))
                p[:, 0] += 1.0
            elif "codebook" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return model


def our_taps(target, seqs: np.ndarray) -> jax.Array:
    """Our target's tapped features ``[n, B, S, H]`` of ``seqs [B, S]``."""
    seqs = np.asarray(seqs)
    return target_forward(target, init_cache(target, seqs.shape[0], CAPACITY), jnp.asarray(seqs), tuple(TAPS))[1]


def hf_taps(hf_target, tokens) -> torch.Tensor:
    with torch.no_grad():
        out = hf_target(torch.as_tensor(np.asarray(tokens))[None], output_hidden_states=True)
    return dflash_model.extract_context_feature(out.hidden_states, TAPS)  # [1, S, n·H]


def zlab_block_hidden(model, hf_target, feats: torch.Tensor, anchor: int, start: int) -> torch.Tensor:
    """z-lab's draft forward for the block at ``start`` (context = the first ``start`` positions' features,
    no cache) → final-normed hidden of slots 1.. ``[1, P, H]``, what ``dflash_generate`` hands ``propose``."""
    block = torch.full((1, BLOCK), MASK_ID, dtype=torch.long)
    block[0, 0] = anchor
    with torch.no_grad():
        noise = dflash_model._raw_input_embeddings(hf_target, block)
        hidden = model(
            target_hidden=feats[:, :start], noise_embedding=noise,
            position_ids=torch.arange(start + BLOCK)[None], past_key_values=None, use_cache=False,
        )  # fmt: skip
    return hidden[:, 1:]


@pytest.fixture(scope="module")
def zlab(qwen3_target, tmp_path_factory):
    """(our target, the HF target, the z-lab model, its checkpoint loaded as ours, the checkpoint dir)."""
    target, hf_target = qwen3_target
    path = tmp_path_factory.mktemp("dflash2") / "zlab"
    model = make_zlab_dflash2(path, seed=3)
    return target, hf_target, model, load_drafter(path, target), path


@pytest.fixture(scope="module")
def trajectory(zlab):
    """``dflash_generate`` (greedy) on every prompt, recording each round's start, anchor, proposals, the
    reference's plain unary argmax (what DFlash would propose) and its verify size."""
    _, hf_target, model, _, _ = zlab
    rounds: list[dict] = []
    propose = model.propose

    def recording(hidden, anchor_ids, head, temperature):
        out = propose(hidden, anchor_ids, head, temperature)
        unary = model.compute_logits(hidden, head).argmax(-1)
        rounds.append({"anchor": int(anchor_ids[0]), "proposals": out[0][0].tolist(), "unary": unary[0].tolist()})
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(model, "propose", recording)
    mp.setattr(dflash_model, "_cuda_time", time.perf_counter)  # return_stats times with torch.cuda.synchronize
    runs = []
    try:
        for prompt in PROMPTS:
            rounds.clear()
            stats = dflash_model.dflash_generate(
                model, hf_target, torch.tensor([prompt]), MAX_NEW, None, temperature=0.0, return_stats=True
            )
            start = len(prompt)
            for r, produced in zip(rounds, stats.acceptance_lengths, strict=True):
                r["start"], r["verify"] = start, min(BLOCK, len(prompt) + MAX_NEW - start)
                start += produced
            runs.append({"output": stats.output_ids[0].tolist(), "acceptance": stats.acceptance_lengths, "rounds": list(rounds)})
    finally:
        mp.undo()
    return runs


def round_contexts(target, trajectory) -> tuple[jax.Array, np.ndarray, np.ndarray, list[tuple[int, dict]]]:
    """Every recorded round of every prompt as one batch row: tapped ``[n, R, S, H]`` of the row's final
    output sequence, its context length (the round's start) ``[R]``, anchor ``[R]`` and (prompt, round)."""
    outputs = [run["output"] for run in trajectory]
    seqs = np.zeros((len(outputs), max(map(len, outputs))), np.int64)
    for i, out in enumerate(outputs):
        seqs[i, : len(out)] = out  # the padding is after every context (causal target)
    taps = our_taps(target, seqs)
    rows = [(i, r) for i, run in enumerate(trajectory) for r in run["rounds"]]
    index = np.array([i for i, _ in rows])
    starts = np.array([r["start"] for _, r in rows], np.int32)
    anchors = np.array([r["anchor"] for _, r in rows], np.int32)
    assert all(seqs[i, r["start"]] == r["anchor"] for i, r in rows)
    return taps[:, index], starts, anchors, rows


draft = jax.jit(D.draft)


def draft_rounds(drafter, target, trajectory, temperature: float = 0.0, seed: int = 0) -> tuple[D.DraftOutput, list]:
    """Our draft for every recorded round's context (one batch) → its output and the rows' (prompt, round)."""
    taps, starts, anchors, rows = round_contexts(target, trajectory)
    cache = append(drafter, init_draft_cache(drafter, len(rows), CAPACITY), taps, jnp.asarray(starts))
    keys = jax.random.split(jax.random.key(seed), len(rows))
    return draft(drafter, target, cache, jnp.asarray(anchors), keys, Sampling.rows(len(rows), temperature)), rows


# ----------------------------------------------------------------------------------------------
# Convolution and config


@pytest.mark.parametrize("kernel,group", [(3, 16), (5, 8), (1, 64)])
def test_convolution_matches_zlab_block_by_block(kernel, group):
    """Two blocks side by side (training's layout) convolve exactly like z-lab's ``_grouped_dynamic_convolve``
    on each block alone: causal, zero before each block start (a kernel longer than the block included)."""
    rng = np.random.default_rng(kernel)
    b, a, h = 2, 2, 64
    x = rng.standard_normal((b, a * BLOCK, h)).astype(np.float32)
    dynamic = rng.standard_normal((b, a * BLOCK, kernel, h // group)).astype(np.float32)
    base = rng.standard_normal((kernel, h)).astype(np.float32)
    ours = np.asarray(grouped_causal_conv(jnp.asarray(x), jnp.asarray(dynamic), jnp.asarray(base), BLOCK))
    for j in range(a):
        cols = slice(j * BLOCK, (j + 1) * BLOCK)
        ref = dflash_model._grouped_dynamic_convolve(
            torch.tensor(x[:, cols]), torch.tensor(dynamic[:, cols]), torch.tensor(base), group
        ).numpy()
        np.testing.assert_allclose(ours[:, cols], ref, rtol=1e-6, atol=1e-6)
    # Position t only sees t-K+1 … t of its own block.
    bumped = x.copy()
    bumped[:, BLOCK + 1] += 1.0
    moved = np.asarray(grouped_causal_conv(jnp.asarray(bumped), jnp.asarray(dynamic), jnp.asarray(base), BLOCK)) != ours
    changed = np.flatnonzero(moved.any(axis=(0, 2)))
    assert changed.tolist() == list(range(BLOCK + 1, min(BLOCK + 1 + kernel, 2 * BLOCK)))


def _config(**top_level) -> dict:
    return {
        "architectures": ["DFlash2DraftModel"], "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_target_layers": 3, "block_size": BLOCK, "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS},
        **top_level,
    }  # fmt: skip


def test_config_keys_are_read_like_zlabs_draft_value():
    """``_draft_value``: ``dflash_config`` first, else the top level; every key is required."""
    top = drafter_config_from_dict(_config(**SETTINGS))
    assert (top.kind, top.conv_kernel_size, top.conv_group_size, top.selector_rank, top.top_k) == ("dflash2", 3, 16, 8, 6)
    cfg = _config(**SETTINGS)
    cfg["dflash_config"].update(conv_kernel_size=2, selector_top_k=9)
    both = drafter_config_from_dict(cfg)
    assert (both.conv_kernel_size, both.top_k, both.selector_rank) == (2, 9, 8)
    assert both.layer_causal == (False, False)  # DFlash's rule: full-attention layers are bidirectional
    with pytest.raises(DrafterConfigError, match="selector_rank"):
        drafter_config_from_dict(_config(**{k: v for k, v in SETTINGS.items() if k != "selector_rank"}))
    with pytest.raises(DrafterConfigError, match="conv_group_size"):
        drafter_config_from_dict(_config(**{**SETTINGS, "conv_group_size": 24}))


# ----------------------------------------------------------------------------------------------
# Parity with dflash_generate


def test_loads_zlab_checkpoint(zlab):
    _, _, model, drafter, path = zlab
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    c = drafter.config
    assert (c.kind, c.top_k, c.conv_kernel_size, c.conv_group_size, c.selector_rank) == ("dflash2", 6, 3, 16, 8)
    assert isinstance(drafter.params, DFlash2Params)
    conv = model.layers[1].mlp_conv
    np.testing.assert_array_equal(np.asarray(drafter.params.mlp_convs[1].base), conv.base_kernel.detach().numpy())
    projection = conv.kernel_projection.weight.detach().numpy().T
    np.testing.assert_array_equal(np.asarray(drafter.params.mlp_convs[1].projection), projection)


def test_greedy_tokens_and_acceptance_match_dflash_generate(zlab, trajectory):
    """Same committed tokens and the same acceptance length in every round. z-lab drafts a shorter block
    when fewer tokens remain; with its bidirectional attention that last block's proposals can differ from
    a full block's, so a truncated last round is compared only through the tokens."""
    target, _, _, drafter, _ = zlab
    result = speculative_generate(target, drafter, PROMPTS, MAX_NEW, stop_ids=[], verify=BLOCK)
    assert drafter.config.layer_causal == (False, False)
    for prompt, run, ours, kept in zip(PROMPTS, trajectory, result.token_ids, result.acceptance_lengths, strict=True):
        assert ours == run["output"][len(prompt) :]
        full = len(run["acceptance"]) - (run["rounds"][-1]["verify"] < BLOCK)
        assert kept[:full] == run["acceptance"][:full]
        assert len(kept) == len(run["acceptance"])
    assert any(k > 1 for run in trajectory for k in run["acceptance"])  # not only rejected rounds


def test_every_rounds_greedy_proposals_are_zlabs(zlab, trajectory):
    """In every full-size round of the reference trajectory, our greedy draft for the same context proposes
    exactly z-lab's tokens — and those are not plain DFlash's (the selector changed some), nor what our
    backbone proposes with identity convolutions (the convolutions changed some)."""
    target, _, _, drafter, _ = zlab
    out, rows = draft_rounds(drafter, target, trajectory)
    tokens = np.asarray(out.tokens)
    full = [j for j, (_, r) in enumerate(rows) if r["verify"] == BLOCK]
    assert len(full) > 60
    for j in full:
        assert tokens[j].tolist() == rows[j][1]["proposals"], f"round {j}"
    assert np.asarray(out.q)[full].max(-1).min() == 1.0  # greedy q: one-hot on the proposal
    proposals = np.array([rows[j][1]["proposals"] for j in full])
    unary = np.array([rows[j][1]["unary"] for j in full])
    assert 0.1 < (proposals != unary).mean() < 0.9

    k, n = drafter.config.conv_kernel_size, drafter.config.num_layers
    projection = drafter.params.mlp_convs[0].projection
    identity = DynamicConv(base=jnp.zeros((2, k, 64)).at[:, 0].set(1.0), projection=jnp.zeros_like(projection))
    plain = drafter.replace(params=drafter.params.replace(attention_convs=(identity,) * n, mlp_convs=(identity,) * n))
    plain_out, _ = draft_rounds(plain, target, trajectory)
    assert (np.asarray(plain_out.tokens)[full] != proposals).mean() > 0.3


def test_q_at_temperature_one_is_zlabs(zlab, trajectory):
    """At T = 1 our walk samples its own path; z-lab's ``propose`` is made to follow that path (its sampler
    picks our token among its candidates) and must produce the same q over the same candidates, slot by
    slot: ``softmax(unary + transition)`` over the top-k, zero elsewhere (what ``_rejection_sample`` uses)."""
    target, hf_target, model, drafter, _ = zlab
    out, rows = draft_rounds(drafter, target, trajectory, temperature=1.0, seed=7)
    tokens, q = np.asarray(out.tokens), np.asarray(D.q_full(out, VOCAB))
    head = dflash_model._output_head(hf_target)
    feats = [hf_taps(hf_target, run["output"]) for run in trajectory]
    k = SETTINGS["selector_top_k"]
    differs = 0
    for j in range(0, len(rows), 3):  # every third round: the reference runs one forward per round
        i, r = rows[j]
        hidden = zlab_block_hidden(model, hf_target, feats[i], r["anchor"], r["start"])
        with torch.no_grad():
            cands = torch.topk(model.compute_logits(hidden, head), k, dim=-1, sorted=False)[1]  # as ``select`` does
        steps = iter(range(BLOCK - 1))

        def follow(probs: torch.Tensor) -> torch.Tensor:
            slot = next(steps)
            hit = (cands[0, slot] == int(tokens[j, slot])).nonzero()[:, 0]
            assert hit.numel() == 1, f"our token {tokens[j, slot]} is not among z-lab's candidates {cands[0, slot].tolist()}"
            return hit

        with pytest.MonkeyPatch.context() as mp, torch.no_grad():
            mp.setattr(dflash_model, "_sample_probs", follow)
            path, cand_ids, q_rows = model.propose(hidden, torch.tensor([r["anchor"]]), head, 1.0)
        assert path[0].tolist() == tokens[j].tolist()
        ref = torch.zeros(BLOCK - 1, VOCAB).scatter(-1, cand_ids[0], q_rows[0]).numpy()
        np.testing.assert_allclose(q[j], ref, atol=2e-5, rtol=1e-4)
        assert ((q[j] > 0).sum(-1) == k).all()
        differs += tokens[j].tolist() != r["proposals"]
    assert differs > 0  # sampled paths left the greedy one, so q was compared off it too


# ----------------------------------------------------------------------------------------------
# Checkpoints and fresh drafters


def test_save_load_round_trip(zlab, tmp_path):
    """Ours → z-lab layout (codebooks without ``.weight``, the four keys in ``dflash_config``) → z-lab's
    ``from_pretrained`` gives back every tensor of the original model, and our loader reads it back equal."""
    target, _, model, drafter, _ = zlab
    save_drafter(drafter, tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in SETTINGS} == SETTINGS
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "candidate_selector.predecessor_codebook" in names and "candidate_selector.successor_codebook.weight" not in names

    again = dflash_model.DFlash2DraftModel.from_pretrained(tmp_path / "ours").float().eval()
    expected = model.state_dict()
    assert set(again.state_dict()) == set(expected)
    for name, value in again.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)

    reloaded = load_drafter(tmp_path / "ours", target)
    assert reloaded.config == drafter.config
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), reloaded.params, drafter.params))


def test_fresh_dflash2_backbone_is_dflash(zlab, tmp_path):
    """``init_drafter(target, "dflash2")``: identity convolutions, so its unary logits are DFlash's with the
    same backbone weights; it proposes from its own top-k candidates; saves and reloads."""
    target = zlab[0]
    fresh = init_drafter(target, "dflash2", num_layers=2, block_size=BLOCK, top_k=5, conv_kernel_size=2, selector_rank=4, seed=1)
    c = fresh.config
    assert (c.kind, c.top_k, c.conv_kernel_size, c.conv_group_size, c.selector_rank) == ("dflash2", 5, 2, 64, 4)
    backbone = params_mod.with_kind_weights(params_mod.DrafterParams, fresh.params)
    dflash = params_mod.Drafter(params=backbone, config=dataclasses.replace(c, kind="dflash", top_k=c.vocab_size))
    seq = np.random.RandomState(5).randint(3, VOCAB, size=(1, 9))
    cache = append(fresh, init_draft_cache(fresh, 1, CAPACITY), our_taps(target, seq), jnp.array([8]))
    anchor = seq[:, 8]
    ours, dflash_logits = block_logits(fresh, target, cache, anchor), block_logits(dflash, target, cache, anchor)
    np.testing.assert_allclose(ours, dflash_logits, rtol=1e-6, atol=1e-6)
    key = jax.random.split(jax.random.key(0), 1)
    out = draft(fresh, target, cache, jnp.asarray(anchor, jnp.int32), key, Sampling.rows(1, 1.0))
    assert out.cand_ids.shape == (1, BLOCK - 1, 5)
    assert (np.asarray(out.tokens)[0, :, None] == np.asarray(out.cand_ids)[0]).any(-1).all()

    save_drafter(fresh, tmp_path / "fresh")
    reloaded = load_drafter(tmp_path / "fresh", target)
    assert reloaded.config == fresh.config
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), reloaded.params, fresh.params))
    with pytest.raises(ValueError, match="conv_kernel_size"):
        init_drafter(target, "dspine", num_layers=1, conv_kernel_size=2)
