"""Per-kind drafter configs: each kind's ``config.json`` parses into its own frozen, hashable config class,
round-trips exactly, and an inconsistent value raises ``DrafterConfigError`` naming it — whether it comes
from a file or from ``dataclasses.replace``. Per-kind params: only DSpine's carry its injection and codes."""

from __future__ import annotations

import copy
import dataclasses

import jax
import pytest

from dspine_jax.drafters import params as params_mod
from dspine_jax.drafters.config import (
    DrafterConfig,
    DrafterConfigError,
    config_as_kind,
    drafter_config_from_dict,
    drafter_config_to_dict,
)
from dspine_jax.drafters.dflash2 import DFlash2Config, DFlash2Params
from dspine_jax.drafters.dspine import DSpineConfig, DSpineParams, with_dspine_settings
from dspine_jax.drafters.io import init_drafter
from dspine_jax.train.loop import join_params, split_params

# fmt: off
BACKBONE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    "num_target_layers": 3, "block_size": 4, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]},
}
# z-lab DFlash, SpecForge DSpine (with a key of its own we do not model) and z-lab DFlash2 layouts.
LAYOUTS = {
    "dflash": {**BACKBONE, "architectures": ["DFlashDraftModel"]},
    "dspine": {
        **BACKBONE, "architectures": ["DSpineDraftModel"], "is_causal": True,
        "dspine_config": {"transfer_rank": 12, "message_size": 8, "top_k": 6, "alignment_warmup_steps": 10, "extra": 1},
    },
    "dflash2": {
        **BACKBONE, "architectures": ["DFlash2DraftModel"],
        "dflash_config": {**BACKBONE["dflash_config"], "conv_kernel_size": 3, "conv_group_size": 16,
                          "selector_rank": 8, "selector_top_k": 6},
    },
}
# fmt: on
CLASSES = {"dflash": DrafterConfig, "dspine": DSpineConfig, "dflash2": DFlash2Config}


def _layout(kind: str, edit=None) -> dict:
    cfg = copy.deepcopy(LAYOUTS[kind])
    if edit is not None:
        edit(cfg)
    return cfg


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_each_kind_parses_into_its_own_config_and_round_trips(kind):
    config = drafter_config_from_dict(_layout(kind))
    assert type(config) is CLASSES[kind] and config.kind == kind
    written = drafter_config_to_dict(config)
    again = drafter_config_from_dict(written)
    assert again == config and hash(again) == hash(config) and type(again) is type(config)
    assert drafter_config_to_dict(again) == written  # writing is a fixed point
    # Every key of the file comes back with its value (the writer only adds keys).
    for key, value in _layout(kind).items():
        assert written[key] == value if not isinstance(value, dict) else value.items() <= written[key].items(), key
    # Hashable and comparable by value: one compiled program for equal configs.
    traced = jax.jit(lambda c: c.block_size, static_argnums=0)
    assert traced(config) == traced(again) == 4
    assert {config: 1}[again] == 1


def test_kind_fields_parse_into_their_owners():
    spine = drafter_config_from_dict(_layout("dspine"))
    assert (spine.transfer_rank, spine.message_size, spine.top_k, spine.alignment_warmup_steps) == (12, 8, 6, 10)
    assert spine.layer_causal == (True, True) and spine.ce_weight == 0.1  # SpecForge's default
    assert drafter_config_to_dict(spine)["dspine_config"]["extra"] == 1  # a key we do not model survives
    conv = drafter_config_from_dict(_layout("dflash2"))
    assert (conv.conv_kernel_size, conv.conv_group_size, conv.selector_rank, conv.top_k) == (3, 16, 8, 6)
    plain = drafter_config_from_dict(_layout("dflash"))
    assert plain.top_k == 128 and not hasattr(plain, "transfer_rank") and not hasattr(plain, "conv_kernel_size")


def _dflash_ids(cfg: dict, ids: list[int]) -> None:
    cfg["dflash_config"]["target_layer_ids"] = ids


# (kind, edit of its config.json, what the error says). Shared checks are run on every kind's layout.
# fmt: off
BAD_FILES = [
    *[(kind, edit, message) for kind in sorted(LAYOUTS) for edit, message in [
        (lambda c: c.update(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        (lambda c: c.update(block_size=1), "block_size=1: a block needs an anchor and at least one proposal"),
        (lambda c: _dflash_ids(c, [0, 3]), r"target_layer_ids \[0, 3\] name layers \[3\] outside the 3-layer target"),
        (lambda c: _dflash_ids(c, [-1]), r"name layers \[-1\]"),
        (lambda c: _dflash_ids(c, []), "target_layer_ids is empty"),
        (lambda c: c["dflash_config"].update(mask_token_id=128), r"mask_token_id=128 is outside its vocabulary \[0, 128\)"),
        (lambda c: c.update(intermediate_size=0), "intermediate_size=0 must be >= 1"),
        (lambda c: c.update(num_hidden_layers=0), "num_hidden_layers=0 must be >= 1"),
        (lambda c: c.update(rms_norm_eps=0.0), "rms_norm_eps=0.0 .* must be > 0"),
    ]],
    ("dspine", lambda c: c["dspine_config"].update(transfer_rank=0), r"transfer_rank=0 must be in \[1, min"),
    ("dspine", lambda c: c["dspine_config"].update(transfer_rank=65), r"transfer_rank=65 .* = \[1, 64\]"),
    ("dspine", lambda c: c["dspine_config"].update(message_size=0), "message_size=0 must be >= 1"),
    ("dspine", lambda c: c["dspine_config"].update(top_k=129), r"top_k=129 must be in \[1, vocab_size=128\]"),
    ("dspine", lambda c: c["dspine_config"].update(ce_weight=1.5), r"ce_weight=1.5 must be in \[0, 1\]"),
    ("dspine", lambda c: c["dspine_config"].update(replacement_probability=-0.1), "replacement_probability=-0.1"),
    ("dspine", lambda c: c["dspine_config"].update(replacement_hold_ratio=0.5), "replacement_hold_ratio < replacement_end_ratio"),
    ("dspine", lambda c: c["dspine_config"].update(alignment_warmup_steps=-1), "alignment_warmup_steps=-1"),
    ("dspine", lambda c: c["dspine_config"].update(alignment_warmup_steps=2.5), "'alignment_warmup_steps' must be an integer"),
    ("dspine", lambda c: c["dspine_config"].update(candidate_mass_threshold=1.0), r"candidate_mass_threshold=1.0 must be in \[0, 1\)"),
    ("dspine", lambda c: c["dspine_config"].update(alignment_weight=float("nan")), "'alignment_weight' must be a finite number"),
    ("dspine", lambda c: c.update(draft_vocab_size=4), r"draft_vocab_size=4 must be in \[top_k=6, vocab_size=128\]"),
    ("dflash2", lambda c: c["dflash_config"].update(conv_group_size=24), "conv_group_size=24 must divide hidden_size=64"),
    ("dflash2", lambda c: c["dflash_config"].update(conv_kernel_size=0), "conv_kernel_size=0 must be >= 1"),
    ("dflash2", lambda c: c["dflash_config"].update(selector_rank=0), "selector_rank=0 must be >= 1"),
    ("dflash2", lambda c: c["dflash_config"].update(selector_top_k=0), r"top_k=0 must be in \[1, vocab_size=128\]"),
    ("dflash2", lambda c: c["dflash_config"].pop("selector_rank"), "missing 'selector_rank'"),
]
# fmt: on


@pytest.mark.parametrize("kind,edit,message", BAD_FILES)
def test_an_inconsistent_config_json_names_the_value(kind, edit, message):
    with pytest.raises(DrafterConfigError, match=message):
        drafter_config_from_dict(_layout(kind, edit))


# (kind, dataclasses.replace changes, what the error says): validate runs on every construction.
BAD_REPLACEMENTS = [
    ("dflash", {"num_kv_heads": 3}, "is not a multiple of num_key_value_heads=3"),
    ("dflash", {"block_size": 1}, "block_size=1"),
    ("dflash", {"top_k": 0}, r"top_k=0 must be in \[1, vocab_size=128\]"),
    ("dflash", {"target_layer_ids": [0, 2]}, "target_layer_ids must be a tuple"),
    ("dflash", {"layer_windows": (0,)}, "1 layer windows and 2 causality flags for num_hidden_layers=2"),
    ("dflash", {"block_size": 4.0}, "block_size must be an integer"),
    ("dflash", {"kind": "dspine"}, "a 'dspine' drafter needs a DSpineConfig, got a DrafterConfig"),
    ("dflash", {"kind": "no_such_kind"}, "drafter kind 'no_such_kind' is not registered"),
    ("dspine", {"layer_causal": (False, True)}, "causal in every layer"),
    ("dspine", {"transfer_rank": 0}, "transfer_rank=0"),
    ("dspine", {"message_size": 2.5}, "dspine_config message_size must be an integer"),
    ("dspine", {"kind": "dflash2"}, "a 'dflash2' drafter needs a DFlash2Config, got a DSpineConfig"),
    ("dflash2", {"conv_group_size": 0}, "conv_group_size=0 must divide hidden_size=64"),
    ("dflash2", {"selector_rank": -1}, "selector_rank=-1 must be >= 1"),
]


@pytest.mark.parametrize("kind,changes,message", BAD_REPLACEMENTS)
def test_replace_validates_too(kind, changes, message):
    config = drafter_config_from_dict(_layout(kind))
    with pytest.raises(DrafterConfigError, match=message):
        dataclasses.replace(config, **changes)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_replace_keeps_the_kind_config(kind):
    """What the decoding loop does to a drafter (a shorter block) keeps the class and the kind's fields."""
    config = drafter_config_from_dict(_layout(kind))
    shorter = dataclasses.replace(config, block_size=2)
    assert type(shorter) is type(config) and shorter.block_size == 2
    assert {f.name: getattr(shorter, f.name) for f in dataclasses.fields(config) if f.name != "block_size"} == {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "block_size"
    }


def test_dspine_settings_change_only_training_knobs():
    config = drafter_config_from_dict(_layout("dspine"))
    trained = with_dspine_settings(config, alignment_warmup_steps=3, ce_weight=0.2)
    assert type(trained) is DSpineConfig and (trained.alignment_warmup_steps, trained.ce_weight) == (3, 0.2)
    saved = drafter_config_to_dict(trained)["dspine_config"]
    assert (saved["alignment_warmup_steps"], saved["ce_weight"], saved["transfer_rank"]) == (3, 0.2, 12)
    with pytest.raises(DrafterConfigError, match=r"cannot set dspine_config \['transfer_rank'\]"):
        with_dspine_settings(config, transfer_rank=8)  # fixes tensor shapes
    with pytest.raises(DrafterConfigError, match="cannot set dspine_config"):
        with_dspine_settings(drafter_config_from_dict(_layout("dflash")), alignment_warmup_steps=3)
    with pytest.raises(DrafterConfigError, match="replacement_hold_ratio < replacement_end_ratio"):
        with_dspine_settings(config, replacement_end_ratio=0.1)


def test_config_as_kind_keeps_the_backbone_and_drops_the_old_section():
    spine = drafter_config_from_dict(_layout("dspine"))
    plain = config_as_kind(spine, "dflash", top_k=spine.vocab_size)
    assert type(plain) is DrafterConfig and plain.kind == "dflash" and plain.layer_causal == spine.layer_causal
    written = drafter_config_to_dict(plain)
    assert "dspine_config" not in written and written["architectures"] == ["DFlashDraftModel"]
    assert drafter_config_from_dict(written) == plain
    with pytest.raises(TypeError, match="conv_kernel_size"):  # the fields a kind adds must be given
        config_as_kind(spine, "dflash2")


def test_each_kind_owns_its_params(qwen3_target):
    """DSpine's injection and transfer codes live in ``DSpineParams`` only; training's frozen split follows
    the kind's params class."""
    target, _ = qwen3_target
    assert not {"injection", "transfer_codes"} & {f.name for f in dataclasses.fields(params_mod.DrafterParams)}
    common = {"num_layers": 1, "block_size": 4, "top_k": 4, "target_layer_ids": (0, 1)}
    spine = init_drafter(target, "dspine", transfer_rank=8, message_size=4, **common)
    plain = init_drafter(target, "dflash", **common)
    conv = init_drafter(target, "dflash2", **common)
    assert type(spine.params) is DSpineParams and type(plain.params) is params_mod.DrafterParams
    assert type(conv.params) is DFlash2Params
    trainable, frozen = split_params(spine)
    assert trainable.transfer_codes is None and frozen["transfer_codes"] is spine.params.transfer_codes
    assert join_params(trainable, frozen).transfer_codes is spine.params.transfer_codes
    trainable, frozen = split_params(plain)
    assert "transfer_codes" not in frozen and type(join_params(trainable, frozen)) is params_mod.DrafterParams
    bare = params_mod.with_kind_weights(params_mod.DrafterParams, spine.params)
    assert type(bare) is params_mod.DrafterParams and bare.fc is spine.params.fc
