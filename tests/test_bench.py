"""The benchmark CLI end to end on the real model, with a tiny budget (numbers are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspine_jax.bench import repeat_order

pytestmark = pytest.mark.slow


def test_bench_writes_side_by_side_report(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "dspine_jax.bench", "--dtypes", "float32", "--max-new-tokens", "4", "--repeats", "1",
         "--prompts", str(prompts), "--draft", "init:dspine", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    systems = {r["system"] for r in report["results"]}
    assert systems == {"ours", "hf", "ours+draft"}
    assert all(r["tokens_per_second_median"] > 0 for r in report["results"])
    assert set(report["speedups"]) == {"ours/hf", "ours+draft/hf", "ours+draft/ours"}
    tau = next(r for r in report["results"] if r["system"] == "ours+draft")["mean_acceptance_median"]
    assert 1.0 <= tau <= 16.0
    assert "ours+draft" in proc.stdout


def test_each_repeat_round_starts_with_the_next_system():
    """The plain bench (``--prompts``) and the report rotate the systems' order every repeat round: no system always
    runs right after the same other one."""
    orders = [repeat_order(["ours", "hf", "ours+draft"], r) for r in range(4)]
    assert orders == [["ours", "hf", "ours+draft"], ["hf", "ours+draft", "ours"], ["ours+draft", "ours", "hf"],
                      ["ours", "hf", "ours+draft"]]  # fmt: skip
