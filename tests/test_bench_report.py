"""``python -m dspine_jax.bench --report`` end to end on a tiny random Llama: five systems, per-domain and
overall summaries, greedy exactness against HF AR, JSON + Markdown + PNG; and its input errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_tiny_hf_model

from dspine_jax import bench

N = 8
# Two domains, one prompt each, same length (one compiled prompt bucket); records carry ready token ids
# (the tiny model has no tokenizer). The second code record is beyond --prompts-per-domain 1.
HELD = {
    "code": [{"prompt_ids": np.random.default_rng(0).integers(3, 128, 9).tolist(), "source": "t/code0"},
             {"prompt_ids": [5, 6, 7], "source": "t/code1"}],
    "math": [{"prompt_ids": np.random.default_rng(1).integers(3, 128, 9).tolist(), "source": "t/math0"}],
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    model_dir, _ = make_tiny_hf_model("llama", root / "llama", initializer_range=0.15, tie_word_embeddings=True)
    result = bench.build_report(str(model_dir), N, repeats=1, per_domain=1, held=HELD,
                                drafters={"ours+dflash": "init:dflash:4", "ours+dspine": "init:dspine:4"})
    return result, bench.write_report(result, root / "out" / "report.json")


def test_report_structure(report):
    result, (json_path, md_path, png_path) = report
    data = json.loads(json_path.read_text())
    assert data["systems"] == list(bench.SYSTEMS)
    assert data["max_new_tokens"] == N and data["repeats"] == 1 and data["dtypes"] == ["float32"]
    assert data["torch"]["threads"] >= 1 and "cpu_count" in data["machine"]
    res = data["results"]["float32"]
    assert [p["source"] for p in res["prompts"]] == ["t/code0", "t/math0"]
    assert list(res["summary"]) == ["code", "math", "all"]
    for domain, rows in res["summary"].items():
        assert list(rows) == list(bench.SYSTEMS)
        cells = [p for p in res["prompts"] if domain in ("all", p["domain"])]
        for name, row in rows.items():
            assert row["tokens_per_second"] > 0
            # the pooled median of every repeat of every prompt of the domain, recomputed from the raw cells
            raw = [r for p in cells for r in p["systems"][name]["tokens_per_second"]]
            assert row["tokens_per_second"] == pytest.approx(float(np.median(raw)))
            assert row["speedup_vs_hf"] == pytest.approx(row["tokens_per_second"] / rows["hf"]["tokens_per_second"])
            assert row["speedup_vs_ours"] == pytest.approx(row["tokens_per_second"] / rows["ours"]["tokens_per_second"])
            if domain != "all":  # one prompt, one repeat: the pair is the two runs
                assert row["paired_speedup_vs_ours"] == pytest.approx(row["speedup_vs_ours"])
            if name in ("hf", "ours"):
                assert row["tau"] is None
            else:
                assert 1.0 <= row["tau"] <= 4.0  # block 4 (prompt lookup: 10 candidates, but N=8 tokens total)
        assert rows["hf"]["speedup_vs_hf"] == pytest.approx(1.0)
    for prompt in res["prompts"]:
        assert prompt["prompt_tokens"] == 9
        for name, cell in prompt["systems"].items():
            assert len(cell["tokens_per_second"]) == 1
            assert cell["matches_hf"] is True, name  # greedy: every system emits HF AR's tokens
    spec = res["prompts"][0]["systems"]["ours+dspine"]
    assert spec["accepted_tokens"] == N - 1  # the prefill token is not a verify step's
    assert spec["tau"] == pytest.approx(spec["accepted_tokens"] / spec["verify_steps"])
    lookup = res["prompts"][0]["systems"]["hf_prompt_lookup"]
    assert lookup["accepted_tokens"] == N and 1 <= lookup["verify_steps"] <= N
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000
    md = md_path.read_text()
    assert "| ours+dspine |" in md and "| system | code | math | all |" in md and "Machine:" in md


def test_paired_speedup_is_the_median_of_same_round_ratios():
    """A machine that slows between repeat rounds moves both systems: the paired statistic sees the ratio in each
    round, the pooled medians mix rounds and prompts."""

    def entry(domain, ours, mine):
        cell = {"accepted_tokens": 0, "verify_steps": None, "matches_hf": True}
        return {"domain": domain, "systems": {"ours": {**cell, "tokens_per_second": ours},
                                              "x": {**cell, "tokens_per_second": mine}}}

    entries = [entry("code", [20.0, 10.0], [19.0, 9.5]), entry("code", [12.0, 12.0], [14.4, 14.4])]
    row = bench.summarize(entries)["code"]["x"]
    assert row["paired_speedup_vs_ours"] == pytest.approx(float(np.median([0.95, 0.95, 1.2, 1.2])))
    assert row["speedup_vs_ours"] == pytest.approx(float(np.median([19, 9.5, 14.4, 14.4]) / np.median([20, 10, 12, 12])))
    assert bench.summarize(entries)["all"]["ours"]["paired_speedup_vs_ours"] == 1.0


def test_select_prompts_encodes_messages_and_takes_first_k():
    held = {"prose": [{"messages": [{"role": "user", "content": "ab"}], "source": "p0"}, {"prompt_ids": [1]}],
            "code": [{"prompt_ids": [7, 8], "source": "c0"}]}
    out = bench.select_prompts(held, 1, encode=lambda messages: [len(messages[0]["content"])])
    assert [(p.domain, p.source, p.ids) for p in out] == [("code", "c0", [7, 8]), ("prose", "p0", [2])]
    with pytest.raises(ValueError, match="prompts-per-domain"):
        bench.select_prompts(held, 0)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompts-per-domain", "0"], "--prompts-per-domain must be >= 1"),
        (["--dspine", "/nonexistent/drafter"], "--dspine /nonexistent/drafter: not a drafter checkpoint"),
        (["--dflash", "/nonexistent/drafter"], "--dflash /nonexistent/drafter: not a drafter checkpoint"),
        (["--draft", "init:dspine"], "not --draft/--prompts"),
        (["--torch-threads", "0"], "--torch-threads must be >= 1"),
    ],
)
def test_report_rejects_bad_input(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--report", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_heldout_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m dspine_jax.train.data"):
        bench.load_heldout_prompts("smollm2-135m-instruct", tmp_path)


def test_systems_name_their_drafters(tmp_path):
    """``ours+dspine`` is the report's drafter, ``ours+init:KIND`` a fresh one, ``ours+DIR`` a checkpoint
    directory; anything else is refused by name."""
    drafters = {"ours+dspine": "ckpt/dspine"}
    assert bench.parse_system("ours+dspine@4", drafters) == ("ours+dspine", "ckpt/dspine", 4)
    assert bench.parse_system("ours+init:dflash", drafters) == ("ours+init:dflash", "init:dflash", "auto")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    assert bench.parse_system(f"ours+{tmp_path / 'd'}@2", drafters) == (f"ours+{tmp_path / 'd'}", str(tmp_path / "d"), 2)
    with pytest.raises(ValueError, match="unknown drafter"):
        bench.parse_system(f"ours+{tmp_path / 'missing'}", drafters)
    with pytest.raises(ValueError, match="only speculative systems"):
        bench.parse_system("ours@4", drafters)
