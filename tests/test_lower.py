"""``python -m dspine_jax.lower``: every program a run compiles lowers for TPU (Mosaic) and GPU (Triton) on
this CPU, with abstract weights, the Pallas kernels in it and no host callback — and the check fails when a
kernel cannot lower or a program calls back to the host."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import pytest
from conftest import make_tiny_hf_model, require
from dspine_jax.pallas import dispatch
from dspine_jax.pallas import draft_attention as DA

from dspine_jax import lower
from dspine_jax.decoding import adaptive
from dspine_jax.models import presets

require("torch")  # the tiny checkpoints are written by transformers; the presets' names come from it too

TINY_PROGRAMS = {"prefill", "prefill_chunk", "ar_decode", "peek", "step_peek",
                 *(f"round_T{t}" for t in (1, 2, 4, 8)), *(f"step_T{t}" for t in (1, 2, 4, 8))}


def _check_rows(rows: list[lower.Row], platforms: tuple[str, ...], programs: set[str] | None = None,
                drafting_kernels: int = 2) -> None:  # fmt: skip
    """Every row lowered cleanly; drafting programs hold at least ``drafting_kernels`` of the platform's kernels
    (0: none, a sequential head's), the others none."""
    assert rows
    bad = [lower.format_row(r) for r in rows if not r.ok]
    assert not bad, "\n".join(bad)
    if programs is not None:
        assert {r.program for r in rows} == programs
    assert {r.platform for r in rows} == set(platforms)
    for r in rows:
        drafts = r.program == "peek" or r.program == "step_peek" or (
            r.program.startswith(("round_T", "step_T")) and not r.program.endswith("_T1"))
        kernels = r.mosaic_kernels if r.platform == "tpu" else r.triton_kernels
        other = r.triton_kernels if r.platform == "tpu" else r.mosaic_kernels
        assert other == 0, lower.format_row(r)
        if drafts and drafting_kernels:  # attention per drafter layer + the DSpine transition kernel
            assert kernels >= drafting_kernels, lower.format_row(r)
        else:
            assert kernels == 0, lower.format_row(r)
        assert r.host_callbacks == []


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    model_dir, _ = make_tiny_hf_model("llama", tmp_path_factory.mktemp("lower") / "llama", hidden_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return model_dir


def test_dispatcher_picks_the_platform_being_lowered_for():
    before = dispatch.get_mode()
    assert dispatch.resolve("auto")[0].is_reference  # this CPU: the XLA reference
    with dispatch.lowering_for("tpu"):
        assert dispatch.select("draft_attention") == dispatch.Backend("mosaic_tpu", flavor="tpu")
        assert dispatch.resolve("auto")[0] == dispatch.Backend("mosaic_tpu", flavor="tpu")
    with dispatch.lowering_for("cuda"):
        assert dispatch.select("draft_attention") == dispatch.Backend("triton", flavor="gpu")
    assert dispatch.get_mode() == before and dispatch.resolve("auto")[0].is_reference  # restored
    with pytest.raises(ValueError, match="lowering platform"), dispatch.lowering_for("tpuv9"):
        pass


def test_abstract_weights_take_no_memory_and_match_the_loader(tiny_llama):
    from dspine_jax.models.target import load_target

    abstract = lower.abstract_target(str(tiny_llama), "float32")
    real = load_target(tiny_llama, "float32")
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract.params))
    same = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), abstract.params, real.params)
    assert all(jax.tree.leaves(same))
    qwen = lower.abstract_target("qwen3-8b")
    assert qwen.config.num_layers == 36 and qwen.params.lm_head.shape == (4096, 151936)
    assert qwen.params.embed.dtype == jnp.bfloat16
    n_params = sum(x.size for x in jax.tree.leaves(qwen.params))
    assert 8.1e9 < n_params < 8.3e9  # Qwen3-8B: 8.19B parameters with its untied head
    drafter = lower.abstract_drafter("init:dspine-b16", qwen)
    assert drafter.config.block_size == 16 and drafter.config.kind == "dspine"
    assert lower.abstract_drafter("init:dspine:16", qwen).config == drafter.config
    with pytest.raises(ValueError, match="init:KIND-bBLOCK"):
        lower.normalise_draft("init:nosuch-b16")


def test_tiny_llama_and_fresh_dspine_lower_for_tpu_and_cuda(tiny_llama):
    target = lower.abstract_target(str(tiny_llama), "float32")
    drafter = lower.abstract_drafter("init:dspine-b8", target)
    setup = lower.Setup(context=256, prompt=32)
    rows = lower.lower_all(target, drafter, ("tpu", "cuda"), (2,), setup)
    _check_rows(rows, ("tpu", "cuda"), TINY_PROGRAMS)
    costs = {r.program: (r.flops, r.bytes_accessed) for r in rows}
    for name, (flops, moved) in costs.items():
        assert flops and flops > 0 and moved and moved > 0, name
    # Verifying 8 tokens costs more FLOPs than 1; twice the rows, more again.
    assert costs["round_T8"][0] > costs["round_T1"][0]
    (one_row,) = lower.build_programs(target, drafter, dataclasses.replace(setup, batch=1), only=["round_T8"])
    assert costs["round_T8"][0] > lower.program_cost(one_row)[0]


@pytest.mark.parametrize("draft", ["init:eagle3-b4", "init:mtp-b4", "init:dspark-b4"])
def test_every_drafter_kind_lowers(tiny_llama, draft):
    """The sequential heads (EAGLE-3, MTP: proposers of their own) and DSpark, whose drafted rounds hold a branch
    per length its confidence may cut them to, lower for TPU and CUDA like the block drafters."""
    target = lower.abstract_target(str(tiny_llama), "float32")
    drafter = lower.abstract_drafter(draft, target)
    rows = lower.lower_all(target, drafter, ("tpu", "cuda"), (2,), lower.Setup(context=128, prompt=16), cost=False,
                           only=["round_T", "step_T"])  # fmt: skip
    dspark = draft == "init:dspark-b4"
    limit = 5 if dspark else 4  # (an anchored DSpark block of 4 drafts 4: verify 5)
    _check_rows(rows, ("tpu", "cuda"), {f"{kind}_T{t}" for kind in ("round", "step") for t in adaptive.candidate_lengths(limit)},
                drafting_kernels=1 if dspark else 0)  # fmt: skip


def test_tiny_hybrid_lowers(tmp_path):
    from test_hybrid import make_tiny_hybrid

    model_dir, _ = make_tiny_hybrid("qwen3_5_text", tmp_path / "hybrid", hidden_size=128, head_dim=32,
                                    linear_key_head_dim=32, linear_value_head_dim=32)
    target = lower.abstract_target(str(model_dir), "float32")
    assert target.config.model_type == "qwen3_5"
    drafter = lower.abstract_drafter("init:dspine-b4", target)
    rows = lower.lower_all(target, drafter, ("tpu", "cuda"), (2,), lower.Setup(context=128, prompt=16), cost=False)
    names = {"prefill", "prefill_chunk", "ar_decode", "peek", "step_peek",
             *(f"round_T{t}" for t in (1, 2, 4)), *(f"step_T{t}" for t in (1, 2, 4))}
    _check_rows(rows, ("tpu", "cuda"), names)


def test_hybrid_preset_is_the_published_config():
    cfg = presets.preset_config("qwen3.5-27b")
    target = lower.abstract_target("qwen3.5-27b")
    c = target.config
    assert c.model_type == "qwen3_5" and c.num_layers == 64 and c.hidden_size == 5120
    assert c.layer_kinds.count("full_attention") == 16 and c.layer_kinds[3] == "full_attention"
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, 48) and c.rotary_dim == 64
    assert cfg["vocab_size"] == target.params.embed.shape[0] == 248320
    assert presets.preset_config("nosuch") is None


QWEN_SMOKE = ("ar_decode", "round_T16", "step_peek")


def test_qwen3_8b_dspine_b16_lowers_at_batch_1_and_8(capsys):
    """The issue's command, on the programs that differ in kind (every length of the round and the step
    is the same code at another static T: the tiny tests lower all of them)."""
    code = lower.main(["--target", "qwen3-8b", "--draft", "init:dspine-b16", "--platforms", "tpu,cuda",
                       "--batch", "1,8", "--programs", ",".join(QWEN_SMOKE), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, [r for r in report["rows"] if not r["ok"]]
    assert report["verify_lengths"] == list(adaptive.candidate_lengths(16)) == [1, 2, 4, 8, 16]
    rows = report["rows"]
    assert len(rows) == len(QWEN_SMOKE) * 2 * 2 and all(r["ok"] for r in rows)
    by = {(r["program"], r["platform"], r["batch"]): r for r in rows}
    assert by[("round_T16", "tpu", 8)]["mosaic_kernels"] >= 6  # 5 drafter layers' attention + transition
    assert by[("round_T16", "cuda", 1)]["triton_kernels"] >= 6
    assert by[("ar_decode", "tpu", 1)]["mosaic_kernels"] == 0
    # One AR step of Qwen3-8B reads at least its ~16.4 GB of bf16 weights (the unfused HLO count is larger:
    # it also counts intermediates a fused kernel keeps on chip, which grow with the rows).
    ar1, ar8 = by[("ar_decode", "tpu", 1)]["bytes_accessed"], by[("ar_decode", "tpu", 8)]["bytes_accessed"]
    assert 1.6e10 < ar1 < ar8
    flops1, flops8 = by[("ar_decode", "tpu", 1)]["flops"], by[("ar_decode", "cuda", 8)]["flops"]
    assert 1.6e10 < flops1 < 2e10  # ≈ 2 × 8.2 B parameters per token (+ attention over the context)
    assert 7.5 < flops8 / flops1 < 8.5
    round16 = by[("round_T16", "tpu", 1)]["flops"]
    assert 15 < round16 / flops1 < 25  # 16 verified tokens + the 1.2 B-parameter drafter over 16 slots


def test_qwen3_8b_on_a_tp4_dp2_mesh():
    assert len(jax.devices("cpu")) >= 8
    args = lower.parse_args(["--target", "qwen3-8b", "--draft", "init:dspine-b16", "--tp", "4", "--dp", "2",
                             "--batch", "8", "--programs", "round_T16,step_peek", "--no-cost"])
    report = lower.run(args)
    assert report["ok"], [r for r in report["rows"] if not r["ok"]]
    assert {(r["program"], r["platform"]) for r in report["rows"]} == {
        (p, q) for p in ("round_T16", "step_peek") for q in ("tpu", "cuda")}
    assert all(r["mosaic_kernels"] + r["triton_kernels"] >= 6 for r in report["rows"])
    # The weights really are split over the mesh in the lowered module (q|k|v by columns on "model", …).
    assert all(r["sharded_values"] >= 36 * 4 for r in report["rows"])


def test_int8_kv_cache_lowers(tiny_llama):
    target = lower.abstract_target(str(tiny_llama), "float32", kv_cache_dtype="int8")
    drafter = lower.abstract_drafter("init:dspine-b4", target)
    programs = [p for p in lower.build_programs(target, drafter, lower.Setup(batch=2, context=128, prompt=16))
                if p.name in ("round_T4", "step_T4", "ar_decode")]
    assert len(programs) == 3
    round4 = next(p for p in programs if p.name == "round_T4")
    cache_leaves = jax.tree.leaves(round4.args[2].cache)
    assert any(x.dtype == jnp.int8 for x in cache_leaves)  # the carry's caches really are int8
    rows = [lower.lower_program(p, platform, 2) for p in programs for platform in ("tpu", "cuda")]
    _check_rows(rows, ("tpu", "cuda"))


def test_an_illegal_tpu_block_shape_is_reported_not_lowered():
    """A kernel tiled against Mosaic's (8, 128) rule fails the check; the same call with its own tiling
    passes — so a passing row means the kernel really lowered."""
    b, t, n, kh, d, s = 1, 16, 8, 2, 128, 1024
    args = (lower.spec((b, t, n, d), jnp.bfloat16), lower.spec((b, kh, s, d), jnp.bfloat16),
            lower.spec((b, kh, s, d), jnp.bfloat16), lower.spec((b, t, kh, d), jnp.bfloat16),
            lower.spec((b, t, kh, d), jnp.bfloat16), lower.spec((b,), jnp.int32))
    backend = dispatch.Backend("mosaic_tpu", flavor="tpu")

    def kernel(block_kv):
        fn = functools.partial(DA.draft_attention_pallas, window=0, causal=True, backend=backend, block_kv=block_kv)
        return lower.Program(f"attention_block{block_kv}", fn, args, drafts=True)

    good = lower.lower_program(kernel(512), "tpu", b)
    assert good.ok and good.mosaic_kernels == 1, lower.format_row(good)
    bad = lower.lower_program(kernel(100), "tpu", b)  # 100 context rows per tile: not a multiple of 8
    assert not bad.lowered and not bad.ok and bad.error, lower.format_row(bad)


def test_a_host_callback_or_a_missing_kernel_fails_the_row():
    def with_callback(x):
        return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    program = lower.Program("callback", with_callback, (lower.spec((4,), jnp.float32),))
    assert not lower.lower_program(program, "tpu", 1).ok  # (a CPU callback cannot even lower for TPU)
    row = lower.lower_program(program, "cpu", 1)  # where it lowers, it is found and named
    assert row.host_callbacks and not row.ok, lower.format_row(row)
    plain = lower.lower_program(lower.Program("plain", jnp.sin, (lower.spec((4,), jnp.float32),), drafts=True), "cuda", 1)
    assert plain.lowered and not plain.ok and "no Pallas kernel" in plain.error


def test_cli_errors_are_one_line(capsys):
    with pytest.raises(SystemExit):
        lower.parse_args(["--target", "qwen3-8b", "--platforms", "tpu,metal"])
    assert "--platforms" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lower.parse_args(["--target", "qwen3-8b", "--batch", "3", "--dp", "2"])
    assert "multiple of --dp" in capsys.readouterr().err
    assert lower.main(["--target", "./no-such-dir", "--platforms", "tpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1


@pytest.mark.slow
def test_smollm2_with_the_shipped_drafter_lowers():
    """The README's model and drafter: the checkpoint's weights (draft vocabulary included) are read as
    safetensors headers, not loaded."""
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-dspine-b8"
    target = lower.abstract_target("smollm2-135m-instruct", "float32")
    drafter = lower.abstract_drafter(str(shipped), target)
    assert drafter.config.block_size == 8 and drafter.params.draft_ids is not None
    programs = lower.build_programs(target, drafter, lower.Setup(batch=1, context=512, prompt=64),
                                    only=["prefill_chunk", "round_T8", "step_peek"])
    rows = [lower.lower_program(p, platform, 1) for p in programs for platform in ("tpu", "cuda")]
    _check_rows(rows, ("tpu", "cuda"), {"prefill_chunk", "round_T8", "step_peek"})
    assert all(r.mosaic_kernels + r.triton_kernels == 3 for r in rows if r.program != "prefill_chunk")  # 2 layers + 1
