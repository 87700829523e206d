"""DSpine: injection + LWR + transition table vs a torch reference written from SpecForge's semantics,
fresh-DSpine == causal DFlash, cached walk == sequential refinement, transfer codes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax import drafter as D
from dspine_jax.drafter_io import init_drafter, load_drafter
from dspine_jax.target import forward as target_forward
from dspine_jax.target import init_cache, load_target

torch = pytest.importorskip("torch")
F = torch.nn.functional
dflash_model = pytest.importorskip("dflash.model")

BLOCK = 5
MASK_ID = 5
TAPS = [0, 1]
RANK, MSG, TOPK = 12, 8, 4


@pytest.fixture(scope="module")
def qwen3_target(tiny_models):
    model_dir, hf_model = tiny_models["qwen3"]
    return load_target(model_dir), hf_model


append = jax.jit(D.append_context)
forward = jax.jit(D.forward, static_argnames="inject")


# ----------------------------------------------------------------------------------------------
# Torch reference (independent re-statement of SpecForge's AdjacentInjection / refine / transition_scores)


def torch_transfer_space(head: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    normalized = F.normalize(head.double(), dim=-1)
    mean = normalized.mean(0)
    cov = normalized.T @ normalized - head.shape[0] * torch.outer(mean, mean)
    values, directions = torch.linalg.eigh(cov)
    values, directions = values[-rank:], directions[:, -rank:]
    codes = F.normalize((normalized - mean) @ directions / values.sqrt(), dim=-1)
    return codes.float(), directions.float()


class TorchInjection:
    def __init__(self, w: dict, codes: torch.Tensor, norm) -> None:
        self.w, self.codes, self.norm = w, codes, norm
        self.rank = codes.shape[1]

    def feature(self, h, layer):
        return math.sqrt(self.rank) * F.normalize(h @ self.w[f"injection.readouts.{layer}.weight"].T, dim=-1)

    def write(self, h, receiver, pred, layer):
        w = self.w
        gate = torch.sigmoid(
            receiver @ w["injection.receiver_gate.weight"].T
            + pred @ w["injection.predecessor_gate.weight"].T
            + w["injection.bias"]
        )
        delta = (gate * (pred @ w["injection.message.weight"].T)) @ w[f"injection.writes.{layer}.weight"].T
        return h + torch.linalg.vector_norm(h, dim=-1, keepdim=True) / math.sqrt(h.shape[-1]) * delta

    def inject(self, h, layer, anchor):
        f = self.feature(h, layer)
        pred = torch.cat([math.sqrt(self.rank) * self.codes[anchor][:, None], f[:, 1:-1]], dim=1)
        return torch.cat([h[:, :1], self.write(h[:, 1:], f[:, 1:], pred, layer)], dim=1)

    def refine(self, pre, pred_ids, last):
        return self.norm(self.write(pre, self.feature(pre, last), math.sqrt(self.rank) * self.codes[pred_ids], last))


def make_specforge_dspine(out_dir: Path, hf_target, seed: int) -> tuple:
    """A SpecForge-layout DSpine checkpoint with O(1) random weights everywhere (writes and
    predecessor_gate non-zero, i.e. "trained"), built on z-lab's causal DFlash backbone."""
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    dspine_cfg = {"transfer_rank": RANK, "message_size": MSG, "top_k": TOPK}
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        num_target_layers=3,
        block_size=BLOCK,
        is_causal=True,
        dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": TAPS},
    )
    model = dflash_model.DFlashDraftModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[1] ** 0.5)
    codes, directions = torch_transfer_space(hf_target.lm_head.weight.detach(), RANK)
    h = cfg.hidden_size
    w = {}
    for layer in range(cfg.num_hidden_layers):
        w[f"injection.readouts.{layer}.weight"] = directions.T + 0.05 * torch.randn(RANK, h)
        w[f"injection.writes.{layer}.weight"] = torch.randn(h, MSG) / MSG**0.5
    for name in ("message", "receiver_gate", "predecessor_gate"):
        w[f"injection.{name}.weight"] = torch.randn(MSG, RANK) / RANK**0.5
    w["injection.bias"] = 0.1 * torch.randn(MSG)
    model.save_pretrained(out_dir)
    from safetensors.torch import load_file, save_file

    state = load_file(str(out_dir / "model.safetensors"))
    state.update({k: v.contiguous() for k, v in w.items()})
    state["transfer_codes"] = codes.contiguous()
    state["transfer_ready"] = torch.tensor(True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["architectures"] = ["DSpineDraftModel"]
    config["dspine_config"] = dspine_cfg
    (out_dir / "config.json").write_text(json.dumps(config))
    return model, TorchInjection(w, codes, model.norm)


def test_forward_table_and_walk_match_specforge_semantics(qwen3_target, tmp_path):
    target, hf_target = qwen3_target
    model, inj = make_specforge_dspine(tmp_path / "dspine", hf_target, seed=7)
    drafter = load_drafter(tmp_path / "dspine", target)
    assert drafter.config.kind == "dspine" and all(drafter.config.layer_causal)
    np.testing.assert_array_equal(np.asarray(drafter.params.transfer_codes), inj.codes.numpy())

    seq = np.random.RandomState(5).randint(3, 128, size=9)
    prompt, anchor = 8, int(seq[8])
    with torch.no_grad():
        out = hf_target(torch.as_tensor(seq)[None], output_hidden_states=True)
        ctx = model.hidden_norm(model.fc(dflash_model.extract_context_feature(out.hidden_states, TAPS)[:, :prompt]))
        block = torch.full((1, BLOCK), MASK_ID)
        block[0, 0] = anchor
        hidden = hf_target.get_input_embeddings()(block)
        positions = torch.arange(0, prompt + BLOCK)[None]
        rope = model.rotary_emb(hidden, positions)
        for layer, module in enumerate(model.layers):
            hidden = module(hidden_states=hidden, target_hidden=ctx, position_ids=positions, position_embeddings=rope)
            pre = hidden
            hidden = inj.inject(hidden, layer, torch.tensor([anchor]))
        ref_hidden = model.norm(hidden)
        logits = hf_target.lm_head(ref_hidden[:, 1:])
        cand = logits.topk(TOPK, dim=-1).indices  # [1, P, C]
        preds = torch.cat([torch.full((1, 1, TOPK), anchor), cand[:, :-1]], dim=1)
        refined = inj.refine(pre[:, 1:, None, :].expand(-1, -1, TOPK, -1), preds, len(model.layers) - 1)
        ref_table = torch.einsum("bikh,bijh->bikj", refined, hf_target.lm_head.weight[cand])
        # SpecForge select_cached: greedy walk over the table.
        index, ref_tokens = torch.zeros(1, dtype=torch.long), []
        for i in range(BLOCK - 1):
            index = ref_table[0, i, index[0]].argmax()[None]
            ref_tokens.append(int(cand[0, i, index[0]]))

    _, tapped, _ = target_forward(
        target, init_cache(target, 1, 32), jnp.asarray(seq)[None], drafter.config.target_layer_ids
    )
    cache = append(drafter, D.init_draft_cache(drafter, 1, 32), tapped, jnp.array([prompt]))
    fwd = forward(drafter, target, cache, D.block_tokens(drafter, jnp.array([anchor])))
    np.testing.assert_allclose(np.asarray(fwd.hidden), ref_hidden.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(fwd.pre_injection), pre.numpy(), atol=1e-4, rtol=1e-4)
    out = jax.jit(D.draft)(drafter, target, cache, jnp.array([anchor]), jax.random.PRNGKey(0), jnp.float32(0.0))
    np.testing.assert_array_equal(np.asarray(out.cand_ids), cand.numpy())
    table = D.transition_table(drafter, target, fwd.pre_injection[:, 1:], out.cand_ids, jnp.array([anchor]))
    np.testing.assert_allclose(np.asarray(table), ref_table.numpy(), atol=2e-4, rtol=1e-4)
    assert np.asarray(out.tokens)[0].tolist() == ref_tokens


def test_fresh_dspine_equals_causal_dflash_exactly(qwen3_target):
    target, _ = qwen3_target
    dspine = init_drafter(
        target,
        kind="dspine",
        num_layers=2,
        block_size=BLOCK,
        transfer_rank=RANK,
        message_size=MSG,
        top_k=TOPK,
        target_layer_ids=TAPS,
        initializer_range=0.2,
        seed=3,
    )
    # The same weights as a causal DFlash: drop the injection, keep everything else.
    dflash_config = dataclasses.replace(
        dspine.config, kind="dflash", top_k=dspine.config.vocab_size, transfer_rank=0, message_size=0
    )
    dflash = D.Drafter(params=dspine.params.replace(injection=None, transfer_codes=None), config=dflash_config)
    seq = np.random.RandomState(6).randint(3, 128, size=(2, 9))
    _, tapped, _ = target_forward(target, init_cache(target, 2, 32), jnp.asarray(seq), TAPS)
    cache = append(dspine, D.init_draft_cache(dspine, 2, 32), tapped, jnp.array([9, 6]))
    tokens = D.block_tokens(dspine, jnp.array([4, 9]))

    @jax.jit
    def logits(drafter, cache, tokens):
        return D.unary_logits(drafter, target, D.forward(drafter, target, cache, tokens).hidden)

    np.testing.assert_array_equal(np.asarray(logits(dspine, cache, tokens)), np.asarray(logits(dflash, cache, tokens)))


@pytest.fixture(scope="module")
def trained_dspine(qwen3_target):
    """A DSpine drafter with every injection weight non-zero, plus a forward to decode from."""
    target, _ = qwen3_target
    drafter = init_drafter(
        target,
        kind="dspine",
        num_layers=2,
        block_size=8,
        transfer_rank=RANK,
        message_size=MSG,
        top_k=6,
        target_layer_ids=TAPS,
        initializer_range=0.2,
        seed=5,
    )
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(11), 3)
    inj = drafter.params.injection
    inj = inj.replace(
        writes=tuple(
            jax.random.normal(k, w.shape) / math.sqrt(MSG)
            for k, w in zip(jax.random.split(k1, len(inj.writes)), inj.writes)
        ),
        predecessor_gate=jax.random.normal(k2, inj.predecessor_gate.shape) / math.sqrt(RANK),
        bias=0.1 * jax.random.normal(k3, inj.bias.shape),
    )
    drafter = drafter.replace(params=drafter.params.replace(injection=inj))
    seq = np.random.RandomState(8).randint(3, 128, size=(3, 10))
    _, tapped, _ = target_forward(target, init_cache(target, 3, 32), jnp.asarray(seq), TAPS)
    cache = append(drafter, D.init_draft_cache(drafter, 3, 32), tapped, jnp.array([10, 7, 3]))
    anchor = jnp.array([4, 50, 99], jnp.int32)
    return target, drafter, cache, anchor


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cached_walk_equals_sequential_refinement(trained_dspine, temperature):
    target, drafter, cache, anchor = trained_dspine
    key = jax.random.PRNGKey(42)
    out = jax.jit(D.draft)(drafter, target, cache, anchor, key, jnp.float32(temperature))
    fwd = forward(drafter, target, cache, D.block_tokens(drafter, anchor))
    seq_tokens, seq_q = jax.jit(D.walk_sequential)(
        drafter, target, fwd.pre_injection[:, 1:], out.cand_ids, anchor, key, jnp.float32(temperature)
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(seq_tokens))
    np.testing.assert_allclose(np.asarray(out.q), np.asarray(seq_q), atol=1e-6, rtol=1e-6)
    # q is a distribution over the candidates, and the proposal is one of them.
    np.testing.assert_allclose(np.asarray(out.q.sum(-1)), 1.0, atol=1e-6)
    assert bool(jnp.all(jnp.any(out.cand_ids == out.tokens[..., None], axis=-1)))
    full = np.asarray(D.q_full(out, drafter.config.vocab_size))
    np.testing.assert_allclose(full.sum(-1), 1.0, atol=1e-6)
    picked = np.take_along_axis(full, np.asarray(out.tokens)[..., None], -1)[..., 0]
    assert (picked > 0).all()
    if temperature == 0.0:
        np.testing.assert_array_equal(picked, 1.0)


def test_walk_depends_on_predecessor_and_sampling_is_seeded(trained_dspine):
    """With trained injection weights LWR changes the table along k; a fixed key reproduces the sample."""
    target, drafter, cache, anchor = trained_dspine
    fwd = forward(drafter, target, cache, D.block_tokens(drafter, anchor))
    cand = jax.lax.top_k(D.unary_logits(drafter, target, fwd.hidden[:, 1:]), 6)[1].astype(jnp.int32)
    table = np.asarray(D.transition_table(drafter, target, fwd.pre_injection[:, 1:], cand, anchor))
    np.testing.assert_allclose(
        table[:, 0], np.broadcast_to(table[:, 0, :1], table[:, 0].shape), atol=1e-6
    )  # slot 1: all rows = anchor
    assert np.abs(table[:, 1:] - table[:, 1:, :1]).max() > 1e-3
    step = jax.jit(D.draft)
    a = step(drafter, target, cache, anchor, jax.random.PRNGKey(1), jnp.float32(1.0))
    b = step(drafter, target, cache, anchor, jax.random.PRNGKey(1), jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


# ----------------------------------------------------------------------------------------------
# Transfer codes


def test_transfer_codes_properties(qwen3_target):
    target, hf_target = qwen3_target
    head = target.params.lm_head  # [H, V]
    codes, directions = D.transfer_codes_from_head(head, RANK, chunk=48)  # chunking with a padded tail
    np.testing.assert_allclose(np.linalg.norm(np.asarray(codes), axis=-1), 1.0, atol=1e-5)
    again, _ = D.transfer_codes_from_head(head, RANK, chunk=48)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(again))
    # Consistent row permutation of the head → the same codes, permuted.
    perm = np.random.RandomState(0).permutation(head.shape[1])
    permuted, dirs_p = D.transfer_codes_from_head(head[:, perm], RANK)
    np.testing.assert_allclose(np.asarray(permuted), np.asarray(codes)[perm], atol=2e-4)
    np.testing.assert_allclose(np.asarray(dirs_p), np.asarray(directions), atol=2e-4)
    # Agrees with a float64 torch PCA up to each direction's sign.
    ref_codes, ref_dirs = torch_transfer_space(hf_target.lm_head.weight.detach(), RANK)
    signs = np.sign(np.sum(np.asarray(directions) * ref_dirs.numpy(), axis=0))
    np.testing.assert_allclose(np.asarray(directions), ref_dirs.numpy() * signs, atol=1e-4)
    # Flipping a direction flips that code column (whitening and normalisation are sign-blind).
    np.testing.assert_allclose(np.asarray(codes), ref_codes.numpy() * signs[None, :], atol=1e-4)
    with pytest.raises(ValueError, match="transfer rank"):
        D.transfer_codes_from_head(head, head.shape[0] + 1)


def test_fresh_dspine_readouts_are_pca_directions(qwen3_target):
    target, _ = qwen3_target
    drafter = init_drafter(
        target, kind="dspine", num_layers=2, transfer_rank=RANK, message_size=MSG, target_layer_ids=TAPS
    )
    codes, directions = D.transfer_codes_from_head(target.params.lm_head, RANK)
    inj = drafter.params.injection
    for layer in range(2):
        np.testing.assert_array_equal(np.asarray(inj.readouts[layer]), np.asarray(directions))
    np.testing.assert_array_equal(np.asarray(drafter.params.transfer_codes), np.asarray(codes))
    assert (
        not any(np.asarray(w).any() for w in inj.writes)
        and not np.asarray(inj.predecessor_gate).any()
        and not np.asarray(inj.bias).any()
    )
    assert np.asarray(inj.message).any() and np.asarray(inj.receiver_gate).any()
