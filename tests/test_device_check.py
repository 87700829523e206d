"""``experiments/device_check.py --tiny``: the script a lent GPU/TPU runs, dry-run on CPU (tiny random models,
kernels interpreted), so that the first device run does not die on a typo. Checks the JSON it writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from conftest import require

REPO = Path(__file__).resolve().parents[1]

require("torch")  # the tiny target's tensor names come from transformers' meta-device model


def _script():
    spec = importlib.util.spec_from_file_location("device_check", REPO / "experiments" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_device_check_writes_a_passing_report(tmp_path):
    out = tmp_path / "check.json"
    report = _script().main(["--tiny", "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["ok"] is True and report["ok"] is True, json.dumps(on_disk, indent=1)[:4000]
    assert set(on_disk) >= {"environment", "kernels", "decode", "verify_cost", "training", "seconds"}
    env = on_disk["environment"]
    assert env["tiny"] is True and env["platform"] == "cpu"

    kernels = on_disk["kernels"]
    assert kernels["backend"] == "interpret" and kernels["compiled"] is False  # never claimed compiled on CPU
    assert {(r["kernel"], r["dtype"]) for r in kernels["rows"]} == {
        (k, d) for k in ("draft_attention", "transition_cache") for d in ("float32", "bfloat16")}
    assert all(r["rel_err"] <= 2e-2 and r["poison_ok"] for r in kernels["rows"])

    decode = on_disk["decode"]
    for dtype in ("float32", "bfloat16"):
        entry = decode[dtype]
        assert entry["ar_tok_s"] > 0
        for key in ("spec@auto", "spec@4"):
            assert entry[key]["greedy_equal_ar"] is True and entry[key]["tok_s"] > 0 and entry[key]["tau"] >= 1

    costs = on_disk["verify_cost"]["seconds_per_round"]
    assert set(costs) == {"1", "2", "4"} and all(v > 0 for v in costs.values())
    assert on_disk["verify_cost"]["relative_to_ar_step"]["1"] == 1.0

    training = on_disk["training"]
    assert training["steps"] == 2 and training["losses"] and training["seconds_per_step"] > 0
    assert training["last_metrics"]["step"] == 2
    assert on_disk["seconds"] < 150
