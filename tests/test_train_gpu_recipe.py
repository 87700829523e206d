"""The GPU training recipe (experiments/train_gpu.py) end to end on CPU at a tiny size: a tiny random
Llama with SmolLM2's vocabulary and tokenizer stands in for the target, the committed corpus plan for
the prompts."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from conftest import make_tiny_hf_model

from dspine_jax.models.hub import resolve_model_dir
from dspine_jax.train.data import load_sequences
from dspine_jax.train.prompts import DOMAINS

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "experiments" / "data" / "smollm2-v2"


def _recipe():
    spec = importlib.util.spec_from_file_location("train_gpu", REPO / "experiments" / "train_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspine", "eagle3"])
def test_recipe_regenerates_trains_and_measures_tau(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("DSPINE_JAX_CACHE", str(tmp_path / "cache"))
    smollm2 = resolve_model_dir("smollm2-135m-instruct", cache_dir=Path.home() / ".cache" / "dspine_jax")
    target_dir, _ = make_tiny_hf_model("llama", tmp_path / "target", vocab_size=49152, max_position_embeddings=1024,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, target_dir / name)
    source = tmp_path / "source"
    source.mkdir()
    for name in ("plan.jsonl.xz", "prompts_heldout.json"):
        shutil.copy(COMMITTED / name, source / name)

    out = tmp_path / "run"
    argv = ["--out", str(out), "--target", str(target_dir), "--corpus", str(source), "--tokens", "24",
            "--regen-batch", "2", "--max-new-tokens", "12", "--max-len", "96", "--steps", "2", "--batch-size", "2",
            "--anchors", "2", "--layers", "1", "--block-size", "4", "--eval-prompts", "1", "--eval-tokens", "6",
            "--kind", kind]  # fmt: skip
    log = _recipe().main(argv)

    rows = load_sequences(out / "corpus")
    assert log["corpus"]["response_tokens"] == sum(len(r["response_ids"]) for r in rows) >= 24
    assert not any(source.glob("shards/*")), "the source corpus is copied, never modified"
    assert (out / "run" / "export" / "model.safetensors").exists()
    config = json.loads((out / "run" / "export" / "config.json").read_text())
    if kind == "eagle3":  # speculators' layout: 3 tokens drafted per round (verify 4)
        assert config["speculators_model_type"] == "eagle3"
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    else:
        assert config["block_size"] == 4 and config["num_hidden_layers"] == 1
    tau = json.loads((out / "tau.json").read_text())
    for mode in ("greedy", "T=1"):
        assert set(tau[mode]) == set(DOMAINS)
        assert all(1.0 <= t <= 4.0 for t in tau[mode].values())  # one bonus token up to a full block of 4
    assert set(log) == {"corpus", "train", "tau"} and all(v["seconds"] > 0 for v in log.values())
