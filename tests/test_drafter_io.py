"""Drafter checkpoints: bit-exact round trips, reference-layout interop, clear errors for broken files."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require
from safetensors.numpy import load_file, save_file

from dspine_jax.drafters import drafter as D
from dspine_jax.drafters.config import DrafterConfigError, build_target_layer_ids, drafter_config_from_dict
from dspine_jax.drafters.dspine import transfer_codes_from_head
from dspine_jax.drafters.io import copy_target_layers, init_drafter, load_drafter, save_drafter
from dspine_jax.drafters.ring import init_draft_cache
from dspine_jax.models.sampling import Sampling
from dspine_jax.models.target import load_target
from dspine_jax.models.weights import CheckpointError

TAPS = [0, 1]


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_target(tiny_models["qwen3"][0])


def _leaves_equal(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for (path, x), y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=str(path))


@pytest.mark.parametrize("kind,dtype", [("dspine", "float32"), ("dspine", "bfloat16"), ("dflash", "float32")])
def test_save_load_round_trip_is_bit_exact(target, tmp_path, kind, dtype):
    drafter = init_drafter(
        target,
        kind=kind,
        num_layers=2,
        block_size=6,
        transfer_rank=12,
        message_size=8,
        top_k=4,
        target_layer_ids=TAPS,
        sliding_window=32,
        initializer_range=0.3,
        dtype=dtype,
        seed=1,
    )
    if kind == "dspine":  # make every injection leaf non-trivial
        inj = drafter.params.injection
        inj = inj.replace(
            writes=tuple(w + 0.5 for w in inj.writes),
            predecessor_gate=inj.predecessor_gate - 0.25,
            bias=inj.bias + 0.125,
        )
        drafter = drafter.replace(params=drafter.params.replace(injection=inj))
    save_drafter(drafter, tmp_path / "a")
    loaded = load_drafter(tmp_path / "a", target, dtype=dtype)
    assert loaded.config == drafter.config
    _leaves_equal(drafter.params, loaded.params)
    save_drafter(loaded, tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads(
        (tmp_path / "b" / "config.json").read_text()
    )


def test_saved_dflash_loads_in_zlab_reference(target, tmp_path):
    """Our DFlash layout is the z-lab one: ``from_pretrained`` finds every tensor and nothing extra."""
    dflash_model = require("dflash.model")
    drafter = init_drafter(target, kind="dflash", num_layers=2, block_size=4, target_layer_ids=TAPS, seed=2)
    save_drafter(drafter, tmp_path / "d")
    model, info = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path / "d"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.target_layer_ids == TAPS and model.block_size == 4
    np.testing.assert_array_equal(model.fc.weight.detach().numpy(), np.asarray(drafter.params.fc).T)


@pytest.fixture()
def dspine_dir(target, tmp_path) -> Path:
    drafter = init_drafter(
        target,
        kind="dspine",
        num_layers=2,
        block_size=4,
        transfer_rank=12,
        message_size=8,
        top_k=4,
        target_layer_ids=TAPS,
    )
    save_drafter(drafter, tmp_path / "ok")
    return tmp_path / "ok"


def _edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _edit_config(model_dir: Path, edit) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "missing tensor 'layers.1.mlp.up_proj.weight'"),
        (lambda t: t.pop("injection.writes.0.weight"), "missing tensor 'injection.writes.0.weight'"),
        (
            lambda t: t.update({"layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)}),
            "unexpected tensors.*layers.2.mlp.up_proj.weight",
        ),
        (
            lambda t: t.update({"injection.message.weight": np.zeros((8, 11), np.float32)}),
            "'injection.message.weight' has shape \\(8, 11\\), expected \\(8, 12\\)",
        ),
        (
            lambda t: t.update({"fc.weight": np.zeros((64, 64), np.float32)}),
            "'fc.weight' has shape \\(64, 64\\), expected \\(64, 128\\)",
        ),
        (lambda t: t.update({"transfer_codes": np.zeros((128, 11), np.float32)}), "'transfer_codes' has shape"),
    ],
)
def test_malformed_tensors_fail_naming_the_tensor(target, dspine_dir, edit, message):
    _edit_tensors(dspine_dir, edit)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(dspine_dir, target)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(hidden_size=32), "hidden_size 32 does not match the target's hidden_size 64"),
        # Larger than the target's: a smaller one would first fail the config's own mask_token_id < vocab_size.
        (lambda c: c.update(vocab_size=200), "vocab_size 200 does not match the target's vocab_size 128"),
        (lambda c: c.update(num_target_layers=36), "36-layer target"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 3]), "outside the 3-layer target"),
        (
            lambda c: c.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=False),
            "no effective window",
        ),
        (lambda c: c["dspine_config"].update(transfer_rank=65), "transfer_rank=65"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    ],
)
def test_mismatched_configs_fail_clearly(target, dspine_dir, edit, message):
    _edit_config(dspine_dir, edit)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(dspine_dir, target)


def test_missing_files(target, dspine_dir, tmp_path):
    (dspine_dir / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_drafter(dspine_dir, target)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(empty, target)
    (empty / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        load_drafter(empty, target)


def test_missing_or_uninitialised_codes_are_recomputed(target, dspine_dir):
    expected = np.asarray(transfer_codes_from_head(target.params.lm_head, 12)[0])
    _edit_tensors(dspine_dir, lambda t: (t.pop("transfer_codes"), t.pop("transfer_ready")))
    np.testing.assert_array_equal(np.asarray(load_drafter(dspine_dir, target).params.transfer_codes), expected)
    # SpecForge's state before initialize_transfer_space: zero codes, transfer_ready = False.
    _edit_tensors(
        dspine_dir, lambda t: t.update(transfer_codes=np.zeros((128, 12), np.float32), transfer_ready=np.array(False))
    )
    np.testing.assert_array_equal(np.asarray(load_drafter(dspine_dir, target).params.transfer_codes), expected)


class FakeTokenizer:
    """The attributes ``default_mask_token_id`` reads from a transformers tokenizer."""

    def __init__(self, size: int, special: dict[int, str], template: str = "", mask: int | None = None) -> None:
        from transformers import AddedToken

        self.size, self.mask_token_id, self.chat_template = size, mask, template
        self.added_tokens_decoder = {i: AddedToken(text, special=True) for i, text in special.items()}
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id = 1, 2, 2, 0

    def __len__(self) -> int:
        return self.size


def test_mask_token_is_dedicated_and_a_checkpoints_own_is_kept(target, dspine_dir):
    """New drafters get a token the target never reads in text (tiny target: pad 0, BOS 1, EOS 2, V 128)."""
    from dspine_jax.drafters.io import default_mask_token_id

    specials = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 3: "<file_sep>", 4: "<turn>", 5: "<empty>"}
    template = "{{ '<|im_start|>' + m['content'] + '<turn>' + '<|im_end|>' }}"
    assert default_mask_token_id(target, FakeTokenizer(128, specials, mask=9)) == 9  # the tokenizer's MASK
    assert default_mask_token_id(target, FakeTokenizer(120, specials)) == 120  # first unused embedding row
    assert default_mask_token_id(target, FakeTokenizer(128, specials, template)) == 5  # last special chat never uses
    in_template = FakeTokenizer(128, {**specials, 5: "<|im_end|>x"}, template + "<|im_end|>x")
    assert default_mask_token_id(target, in_template) == 3
    assert default_mask_token_id(target) == 127  # no tokenizer: the highest id that is not BOS/EOS/PAD
    assert init_drafter(target, "dflash", num_layers=1, block_size=4).config.mask_token_id == 127  # not the pad id 0
    # A checkpoint's own mask token is what it was trained with: loading keeps it.
    _edit_config(dspine_dir, lambda c: c["dflash_config"].update(mask_token_id=0))
    assert load_drafter(dspine_dir, target).config.mask_token_id == 0


def test_config_defaults_follow_the_reference():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(28, 5) == (1, 7, 13, 19, 25)
    assert build_target_layer_ids(3, 5) == (1, 1, 0, 0, 0)  # the reference's rule wherever it names real layers
    # where it does not (1 or 2 layers: 1, 0, 0, 0, -1), taps spread over the layers there are
    assert build_target_layer_ids(2, 5) == (0, 0, 0, 1, 1)
    assert build_target_layer_ids(1, 2) == (0, 0)
    base = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "num_hidden_layers": 5,
        "vocab_size": 128,
        "num_target_layers": 36,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 3},
    }
    cfg = drafter_config_from_dict(base)
    assert cfg.kind == "dflash" and cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.layer_causal == (False,) * 5
    assert cfg.top_k == 128  # DFlash drafts over the whole vocabulary
    sliding = drafter_config_from_dict(
        {**base, "layer_types": ["sliding_attention"] * 5, "use_sliding_window": True, "sliding_window": 8192}
    )
    assert sliding.layer_windows == (8192,) * 5 and sliding.layer_causal == (True,) * 5
    spine = drafter_config_from_dict({**base, "dspine_config": {"transfer_rank": 32}, "is_causal": False})
    assert (
        spine.kind == "dspine"
        and spine.layer_causal == (True,) * 5
        and (spine.transfer_rank, spine.message_size, spine.top_k) == (32, 512, 16)
    )
    with pytest.raises(DrafterConfigError, match="block_size"):
        drafter_config_from_dict({**base, "block_size": 1})


def test_an_untrained_drafter_for_a_two_layer_target(tmp_path):
    """``init:dspine`` on a target of two layers (the reference's tap rule names layer -1 there) drafts, and greedy
    speculative output equals plain decoding."""
    from conftest import make_tiny_hf_model

    from dspine_jax.decoding.autoregressive import generate
    from dspine_jax.decoding.speculative import speculative_generate
    from dspine_jax.drafters.io import load_draft

    model_dir, _ = make_tiny_hf_model("qwen3", tmp_path / "two", num_hidden_layers=2, seed=3)
    two = load_target(model_dir)
    drafter = load_draft("init:dspine:4", two)
    assert drafter.config.target_layer_ids == (0, 0, 0, 1, 1)
    prompt = [[5, 9, 17, 33, 65]]
    want = generate(two, prompt, 8, stop_ids=[]).token_ids
    assert speculative_generate(two, drafter, prompt, 8, stop_ids=[], verify=4).token_ids == want


def test_one_jitted_draft_call_for_block_16(target):
    """The whole round-draft lowers to one XLA computation with static shapes for B=16."""
    drafter = init_drafter(
        target,
        kind="dspine",
        num_layers=2,
        block_size=16,
        transfer_rank=12,
        message_size=8,
        top_k=16,
        target_layer_ids=TAPS,
    )
    cache = init_draft_cache(drafter, 2, 64)
    args = (drafter, target, cache, jnp.zeros((2,), jnp.int32), jax.random.split(jax.random.key(0), 2), Sampling.rows(2))
    lowered = jax.jit(D.draft).lower(*args)
    shapes = jax.eval_shape(D.draft, *args)
    assert shapes.tokens.shape == (2, 15) and shapes.cand_ids.shape == (2, 15, 16) and shapes.q.shape == (2, 15, 16)
    assert "stablehlo.while" in lowered.as_text()  # the walk is a scan, not 15 unrolled steps


def test_copy_target_layers_takes_the_hf_weights(tiny_models, target):
    """Layers initialised from the target hold the HF model's own tensors (torch [out, in] transposed),
    the last L layers by default, explicit ones on request; a shape mismatch is refused."""
    hf = tiny_models["qwen3"][1]
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    n = target.config.num_layers
    drafter = init_drafter(target, "dspine", num_layers=1, intermediate_size=target.config.intermediate_size)
    for ids, expect in ((None, n - 1), ([0], 0)):
        layer = copy_target_layers(drafter, target, ids).params.layers[0]
        pre = f"model.layers.{expect}."
        for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                             ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                             ("down", "mlp.down_proj")):
            np.testing.assert_array_equal(np.asarray(getattr(layer, ours)), state[pre + theirs + ".weight"].T, err_msg=ours)
        for ours, theirs in (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"),
                             ("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")):
            np.testing.assert_array_equal(np.asarray(getattr(layer, ours)), state[pre + theirs + ".weight"], err_msg=ours)
    narrow = init_drafter(target, "dflash", num_layers=1, intermediate_size=target.config.intermediate_size // 2)
    with pytest.raises(ValueError, match="intermediate_size"):
        copy_target_layers(narrow, target)
    with pytest.raises(ValueError, match="layer ids"):
        copy_target_layers(drafter, target, [n])
