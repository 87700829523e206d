"""Dynamic verification CLI: measures, writes an sps table, and speculative_generate uses it."""

from __future__ import annotations

import json

from dspine_jax.decoding.decoder import load_sps_table, verify_length_for_batch
from dspine_jax.decoding.speculative import speculative_generate
from dspine_jax.drafters.io import init_drafter, load_drafter, save_drafter
from dspine_jax.models.target import load_target
from dspine_jax.tune import expected_acceptance, main


def test_expected_acceptance_truncates_at_the_verify_length():
    assert expected_acceptance([0, 3, 1, 3], 2) == 1.75  # min(a, 1) + 1
    assert expected_acceptance([0, 3, 1, 3], 4) == 2.75


def test_verify_length_lookup():
    table = load_sps_table({"verify_length": {"1": 8, "4": 5, "16": 3}})
    assert [verify_length_for_batch(table, b) for b in (1, 3, 4, 15, 16, 64)] == [8, 8, 5, 5, 3, 3]


def test_tune_cli_writes_a_table_speculative_generate_uses(tiny_models, tmp_path):
    model_dir, _ = tiny_models["qwen3"]
    target = load_target(model_dir)
    save_drafter(init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=8), tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    ids = [list(range(3, 3 + n)) for n in (4, 9)]
    prompts.write_text("\n".join(json.dumps({"ids": row}) for row in ids) + "\n")
    out = tmp_path / "sps.json"
    argv = ["--model", str(model_dir), "--draft", str(tmp_path / "draft"), "--prompts", str(prompts),
            "--out", str(out), "--batch-sizes", "1", "--verify-lengths", "2,4", "--max-new-tokens", "8"]
    assert main(argv) == 0
    table = json.loads(out.read_text())
    assert set(table["round_seconds"]["1"]) == {"2", "4"}
    # The length kept is the one of highest expected throughput τ(T) / seconds per round, from the table's own cells.
    rate = {t: table["acceptance"][str(t)] / table["round_seconds"]["1"][str(t)] for t in (2, 4)}
    assert table["verify_length"]["1"] == max(rate, key=rate.get)
    # τ(T) recomputed from our own full-block runs of the same drafter and prompts (batch 1, stop ids on).
    drafter = load_drafter(tmp_path / "draft", target)
    runs = [speculative_generate(target, drafter, [row], 8, block_size=4) for row in ids]
    accepted = [a for run in runs for a in run.accepted_proposals[0]]
    assert table["acceptance_steps"] == len(accepted)
    assert table["acceptance"] == {str(t): expected_acceptance(accepted, t) for t in (2, 4)}
    result = speculative_generate(target, init_drafter(target, "dspine", num_layers=1, block_size=4, top_k=8),
                                  [[5, 6, 7]], 8, sps_table=out)
    assert result.verify_length == table["verify_length"]["1"]
