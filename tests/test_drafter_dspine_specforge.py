"""DSpine vs SpecForge's semantics on z-lab's causal DFlash backbone (``dflash==0.1.0``): a SpecForge-layout
checkpoint with every injection weight random loads as ours, and the forward (injection after every layer),
the LWR transition table and the greedy walk match a torch re-statement (tests/torch_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from conftest import require
from drafter_helpers import append, forward, tapped_features

from dspine_jax.drafters import drafter as D
from dspine_jax.drafters.dspine import SPINE
from dspine_jax.drafters.io import load_drafter
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models.sampling import Sampling

torch = require("torch")
dflash_model = require("dflash.model")
from torch_reference import TorchInjection, torch_transfer_space  # after require("torch")

BLOCK = 5
MASK_ID = 5
TAPS = [0, 1]
RANK, MSG, TOPK = 12, 8, 4


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

    tapped = tapped_features(target, seq[None], drafter.config.target_layer_ids)
    cache = append(drafter, init_draft_cache(drafter, 1, 32), tapped, jnp.array([prompt]))
    fwd = forward(drafter, target, cache, D.block_tokens(drafter, jnp.array([anchor])))
    np.testing.assert_allclose(np.asarray(fwd.hidden), ref_hidden.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(fwd.pre_injection), pre.numpy(), atol=1e-4, rtol=1e-4)
    out = jax.jit(D.draft)(drafter, target, cache, jnp.array([anchor]), jax.random.split(jax.random.key(0), 1), Sampling.rows(1))
    np.testing.assert_array_equal(np.asarray(out.cand_ids), cand.numpy())
    table = SPINE.transition_table(drafter, target, fwd.pre_injection[:, 1:], out.cand_ids, jnp.array([anchor]))
    np.testing.assert_allclose(np.asarray(table), ref_table.numpy(), atol=2e-4, rtol=1e-4)
    assert np.asarray(out.tokens)[0].tolist() == ref_tokens
