"""The training corpus at scale: shard format round trip, balanced batching, packed features, and the
committed SmolLM2 corpus (manifest checksums, held-out disjointness)."""

from __future__ import annotations

import json
import lzma
import re
from pathlib import Path

import numpy as np
import pytest

from dspine_jax.drafters.config import build_target_layer_ids
from dspine_jax.models.target import load_target
from dspine_jax.train import corpus
from dspine_jax.train import data as data_module
from dspine_jax.train.data import (
    PLAN_FILE,
    PackedFeatures,
    build_features,
    load_heldout,
    load_sequences,
    read_plan,
    target_features,
)  # fmt: skip
from dspine_jax.train.prompts import (
    DOMAINS,
    EXTENSIONS,
    _source_lines,
    _source_segment,
    prompt_key,
    stdlib_code_prompts,
)  # fmt: skip

COMMITTED = Path(__file__).resolve().parents[1] / "experiments" / "data" / "smollm2-v2"


def _write_plan(out: Path, records: list[dict]) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    with lzma.open(out / PLAN_FILE, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in ("domain", "source", "messages")}) + "\n")
    return read_plan(out)


def _fake_plan(n: int, rng: np.random.Generator) -> list[dict]:
    return [
        {"domain": DOMAINS[i % 4], "source": f"fake/{i}", "messages": [{"role": "user", "content": f"q{i}"}],
         "prompt_ids": rng.integers(0, 49152, rng.integers(1, 30)).tolist()}
        for i in range(n)
    ]  # fmt: skip


def test_shards_round_trip_through_load_sequences(tmp_path):
    rng = np.random.default_rng(0)
    records = _fake_plan(21, rng)
    plan = _write_plan(tmp_path, records)
    for p, r in zip(plan, records):
        p["prompt_ids"] = r["prompt_ids"]
    (tmp_path / "shards").mkdir()
    batches = corpus.batches(plan, 3)
    expected = []
    for i, rows in enumerate(batches):
        responses = [rng.integers(0, 49152, rng.integers(0, 12)).tolist() for _ in rows]
        finishes = ["stop" if len(x) % 2 else "length" for x in responses]
        corpus.write_shard(tmp_path / "shards" / f"{i:05d}.npz", rows, responses, finishes)
        expected += [(r["key"], r["domain"], r["prompt_ids"], x, f) for r, x, f in zip(rows, responses, finishes)]
    got = [(r["key"], r["domain"], r["prompt_ids"], r["response_ids"], r["finish"]) for r in load_sequences(tmp_path)]
    assert got == expected


def test_batches_are_single_domain_sorted_and_cover_the_plan():
    rng = np.random.default_rng(1)
    plan = _fake_plan(50, rng)
    for i, r in enumerate(plan):
        r["row"] = i
    batches = corpus.batches(plan, 4)
    assert sorted(r["row"] for b in batches for r in b) == list(range(50))
    for b in batches:
        assert len({r["domain"] for r in b}) == 1 and len(b) <= 4
        lengths = [len(r["prompt_ids"]) for r in b]
        assert lengths == sorted(lengths)
    # Any prefix of whole chunks is balanced: each chunk of 4 domains x 4 rows holds 4 of each.
    first_chunk = [r["domain"] for b in batches[:4] for r in b]
    assert all(first_chunk.count(d) == 4 for d in DOMAINS)


def test_packed_features_index_like_a_padded_array():
    rng = np.random.default_rng(2)
    lengths = np.array([3, 1, 5, 4])
    padded = np.zeros((4, 6, 2, 3), np.float16)
    for i, n in enumerate(lengths):
        padded[i, :n] = rng.standard_normal((n, 2, 3))
    flat = np.concatenate([padded[i, :n] for i, n in enumerate(lengths)])
    view = PackedFeatures(flat, lengths, 6)
    assert view.shape == padded.shape and len(view) == 4
    np.testing.assert_array_equal(view[np.array([2, 0, 3])], padded[[2, 0, 3]])
    np.testing.assert_array_equal(view[1], padded[[1]])


@pytest.mark.slow
def test_build_features_packed_equals_target_forward(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPINE_JAX_CACHE", str(tmp_path / "cache"))
    model_dir = tiny_models["llama"][0]
    rng = np.random.default_rng(3)
    records = _fake_plan(6, rng)
    for r in records:
        r["prompt_ids"] = rng.integers(3, 128, rng.integers(2, 9)).tolist()
    data = tmp_path / "corpus"
    plan = _write_plan(data, records)
    for p, r in zip(plan, records):
        p["prompt_ids"] = r["prompt_ids"]
    (data / "shards").mkdir()
    responses = [rng.integers(3, 128, n).tolist() for n in (4, 9, 1, 6, 12, 3)]
    corpus.write_shard(data / "shards" / "00000.npz", plan, responses, ["stop"] * 6)
    taps = (0, 2)
    tokens, mask, feats = build_features(str(model_dir), data, taps, max_len=16, chunk=4, progress=False)
    assert not any(data.rglob("*.f16")), "features must live in the user cache, not beside the corpus"
    want = target_features(load_target(model_dir), tokens, taps)
    got = feats[np.arange(6)].astype(np.float32)
    for i, r in enumerate(load_sequences(data)):
        n = min(len(r["prompt_ids"]) + len(r["response_ids"]), 16)
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=2e-2, rtol=2e-2)  # float16 storage
        assert not got[i, n:].any()
        assert mask[i].sum() == n - len(r["prompt_ids"])

    # Fewer taps (or none: an MTP head reads the final hidden alone) come from the wider store, not a new pass.
    def recomputed(*args, **kwargs):
        raise RuntimeError("features recomputed")

    monkeypatch.setattr(data_module, "_compute_row_features", recomputed)
    for subset, columns in (((2,), [1, 2]), ((), [2])):
        _, _, narrow = build_features(str(model_dir), data, subset, max_len=16, chunk=4, progress=False)
        assert narrow.shape == (6, 16, len(subset) + 1, feats.shape[-1])
        np.testing.assert_array_equal(narrow[np.arange(6)], feats[np.arange(6)][:, :, columns])
    with pytest.raises(RuntimeError, match="features recomputed"):  # a tap the store lacks: a pass of its own
        build_features(str(model_dir), data, (1,), max_len=16, chunk=4, progress=False)


# ----------------------------------------------------------------------------------------------
# The committed corpus


def _committed() -> Path:
    if not (COMMITTED / "manifest.json").exists():
        pytest.fail(f"the committed corpus is missing: {COMMITTED}")
    return COMMITTED


def test_committed_corpus_matches_its_manifest():
    import hashlib

    root = _committed()
    manifest = json.loads((root / "manifest.json").read_text())
    shards = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((root / "shards").glob("*.npz"))}
    assert shards == manifest["shards"]
    assert hashlib.sha256((root / PLAN_FILE).read_bytes()).hexdigest() == manifest["plan_sha256"]
    rows = load_sequences(root)
    assert len(rows) == manifest["sequences"]
    assert sum(len(r["response_ids"]) for r in rows) == manifest["response_tokens"]
    for d in DOMAINS:
        assert sum(r["domain"] == d for r in rows) == manifest["per_domain"][d]["sequences"]
    assert all(0 <= t < 49152 for r in rows[:200] for t in r["prompt_ids"] + r["response_ids"])


def test_committed_corpus_is_disjoint_from_heldout():
    root = _committed()
    held = load_heldout(root)  # raises if a held-out key is among the regenerated rows
    assert set(held) == set(DOMAINS) and all(len(v) >= 8 for v in held.values())
    plan = read_plan(root)
    held_keys = {r["key"] for rs in held.values() for r in rs}
    assert not held_keys & {r["key"] for r in plan}
    held_tasks = {r["source"].split("/", 1)[1] for r in held["code"]}
    assert not {r["source"].split("/", 1)[1] for r in plan if r["source"].startswith("humaneval")} & held_tasks
    spans = [r["source"].split("/")[1:] for r in held["prose"]]
    for r in plan:
        if r["source"].startswith("gutenberg/"):
            _, stem, span = r["source"].split("/")
            start, length = map(int, re.fullmatch(r"(\d+)\+(\d+)", span).groups())
            for held_stem, held_start in spans:
                if held_stem == stem:
                    assert start + length <= int(held_start) or int(held_start) + 60 <= start, r["source"]


@pytest.mark.slow
def test_regeneration_resumes_by_row_with_another_batch_size(tiny_models, tmp_path, monkeypatch):
    from dspine_jax.decoding.autoregressive import generate

    monkeypatch.setenv("DSPINE_JAX_CACHE", str(tmp_path / "cache"))
    target = load_target(tiny_models["llama"][0])
    rng = np.random.default_rng(4)
    records = _fake_plan(14, rng)
    for r in records:
        r["prompt_ids"] = rng.integers(3, 128, rng.integers(2, 9)).tolist()
    plan = _write_plan(tmp_path, records)
    for p, r in zip(plan, records):
        p["prompt_ids"] = r["prompt_ids"]
    corpus.regenerate_rows(target, plan, tmp_path, tokens=20, batch_size=2, max_new_tokens=5, progress=False)
    first = load_sequences(tmp_path)
    assert 20 <= sum(len(r["response_ids"]) for r in first) < 20 + 2 * 5  # stops at the first batch past the target
    corpus.regenerate_rows(target, plan, tmp_path, tokens=10**6, batch_size=3, max_new_tokens=5, progress=False)
    rows = load_sequences(tmp_path)
    assert sorted(r["key"] for r in rows) == sorted(p["key"] for p in plan)  # every prompt exactly once
    assert rows[: len(first)] == first  # the first run's shards are kept as they were
    by_key = {r["key"]: r for r in rows}
    want = generate(target, [p["prompt_ids"] for p in plan], max_new_tokens=5)
    for p, ids in zip(plan, want.token_ids):
        assert by_key[p["key"]]["response_ids"] == ids
    # Features were captured while regenerating: building them runs no forward pass.
    monkeypatch.setattr("dspine_jax.train.data._compute_row_features", None)
    taps = build_target_layer_ids(target.config.num_layers, 5)  # regenerate_rows' default
    _, _, feats = build_features(str(tiny_models["llama"][0]), tmp_path, taps, max_len=16, progress=False)
    assert len(feats) == len(rows)


@pytest.mark.slow
def test_captured_features_and_tokens_equal_generate_and_the_forward_pass(tiny_models, tmp_path, monkeypatch):
    """The capturing regeneration decodes exactly what ``generate`` decodes (tokens, stops, finish
    reasons) and keeps the features a separate forward pass over prompt+response computes."""
    from dspine_jax.decoding.autoregressive import generate

    monkeypatch.setenv("DSPINE_JAX_CACHE", str(tmp_path / "cache"))
    target = load_target(tiny_models["llama"][0])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 128, n).tolist() for n in (3, 7, 5, 1)]
    free = generate(target, prompts, max_new_tokens=9, stop_ids=[])
    row0 = free.token_ids[0]
    k = next(i for i in range(1, len(row0)) if row0[i] not in row0[:i])
    stop = row0[k]  # row 0 stops at its (k+1)-th token, others wherever that id appears
    want = generate(target, prompts, max_new_tokens=9, stop_ids=[stop])
    taps = (0, 2)
    responses, finishes, features = corpus.regenerate_batch(target, prompts, 9, taps, stop_ids=[stop])
    assert responses == want.token_ids and finishes == want.finish_reasons
    assert len(responses[0]) == k + 1 and finishes[0] == "stop" and "length" in finishes
    for p, r, f in zip(prompts, responses, features):
        seq = p + r
        assert f.shape == (len(seq), len(taps) + 1, target.config.hidden_size) and f.dtype == np.float16
        ref = target_features(target, np.asarray([seq]), taps)[0]
        np.testing.assert_allclose(f.astype(np.float32), ref, atol=2e-2, rtol=2e-2)  # float16 storage


def test_stdlib_prompts_are_humaneval_style_stubs_and_real_source():
    import ast

    prompts = stdlib_code_prompts()
    assert len(prompts) > 2000 and prompts == stdlib_code_prompts()  # deterministic
    assert len({p["source"] for p in prompts}) == len(prompts)
    fence = re.compile(r"```python\n(.*)```", re.S)
    for p in prompts[:400]:
        text = p["messages"][0]["content"]
        code = fence.search(text).group(1)
        tree = ast.parse(code)  # every prompt is valid Python
        node = tree.body[0]
        if p["source"].startswith("stdlib-explain/"):
            assert text.startswith("Explain what this Python code does")
            assert isinstance(node, ast.FunctionDef) and len(node.body) >= 2  # the real body is there
        else:
            assert text.startswith("Complete this Python function.")
            func = node.body[0] if isinstance(node, ast.ClassDef) else node
            assert isinstance(func, ast.FunctionDef) and len(func.body) == 1  # signature + docstring only
            assert ast.get_docstring(func) and p["source"].endswith("." + func.name)


def test_extend_plan_appends_without_moving_rows(tmp_path, monkeypatch):
    from dspine_jax.models.tokenizer import load_tokenizer

    rng = np.random.default_rng(5)
    base = _write_plan(tmp_path, _fake_plan(9, rng))
    held = {"heldout": {d: [] for d in DOMAINS}, "train": {}}
    held["heldout"]["code"] = [{"messages": [{"role": "user", "content": "held"}], "source": "humaneval/HumanEval/0",
                                "key": "k", "prompt_ids": [1]}]  # fmt: skip
    held["heldout"]["code"][0]["key"] = prompt_key(held["heldout"]["code"][0])
    (tmp_path / corpus.HELDOUT_FILE).write_text(json.dumps(held))
    new = [{"messages": [{"role": "user", "content": c}], "source": f"ext/{i}"}
           for i, c in enumerate(["a", "held", "q3", "b", "a", "x " * 400])]  # fmt: skip
    monkeypatch.setitem(EXTENSIONS, "ext", ("math", lambda: [dict(r) for r in new]))
    tok = load_tokenizer("smollm2-135m-instruct")
    # kept: "a" and "b"; dropped: held-out "held", planned "q3", the repeated "a", the over-long prompt
    assert corpus.extend_plan(tok, tmp_path, "ext", max_prompt_tokens=64) == 2
    assert corpus.extend_plan(tok, tmp_path, "ext", max_prompt_tokens=64) == 0  # idempotent
    plan = read_plan(tmp_path)
    assert [r["key"] for r in plan[: len(base)]] == [r["key"] for r in base]  # shards still name their rows
    assert [(r["source"], r["domain"]) for r in plan[len(base) :]] == [("ext/0", "math"), ("ext/3", "math")]
    with pytest.raises(ValueError, match="unknown plan extension"):
        corpus.extend_plan(tok, tmp_path, "nope", 64)


def test_batches_split_a_one_domain_stretch_at_the_batch_size():
    rng = np.random.default_rng(6)
    plan = _fake_plan(8, rng) + [dict(r, domain="code") for r in _fake_plan(11, rng)]
    for i, r in enumerate(plan):
        r["row"] = i
    got = corpus.batches(plan, 2)
    assert all(1 <= len(b) <= 2 and len({r["domain"] for r in b}) == 1 for b in got)
    assert sorted(r["row"] for b in got for r in b) == list(range(len(plan)))


def test_regenerate_rows_only_takes_the_named_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPINE_JAX_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(7)
    records = _fake_plan(10, rng)
    for i, r in enumerate(records):
        r["source"] = f"{'ext' if i % 3 == 0 else 'fake'}/{i}"
    plan = _write_plan(tmp_path / "c", records)
    for p, r in zip(plan, records):
        p["prompt_ids"] = r["prompt_ids"]

    def fake_batch(target, prompts, max_new_tokens, taps):
        return [[5, 6]] * len(prompts), ["stop"] * len(prompts), [np.zeros((len(p) + 2, 2, 4)) for p in prompts]

    monkeypatch.setattr(corpus, "regenerate_batch", fake_batch)
    target = type("T", (), {"model_dir": "tiny"})()
    corpus.regenerate_rows(target, plan, tmp_path / "c", 10**6, 2, 2, progress=False, taps=(0,), only=("ext",))
    assert sorted(r["source"] for r in load_sequences(tmp_path / "c")) == sorted(r["source"] for r in records if r["source"].startswith("ext/"))


def test_source_segment_equals_ast_get_source_segment():
    """The stdlib prompts cut each function's source from the file's lines split once; it must be what
    ``ast.get_source_segment`` returns, with CRLF / CR line ends, non-ASCII text and one-line bodies."""
    import ast

    text = ('x = "é"\r\ndef f(a):\r\n    """Ünïcode doc."""\r\n    return a  # ü\r\n'
            "class C:\r    def g(self): return 1\r\n"
            "def h():\n    pass\n    return 'ß'")  # fmt: skip
    tree = ast.parse(text)
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Return, ast.Constant))]
    lines = _source_lines(text)
    assert "".join(lines) == text
    assert len(nodes) > 6 and all(_source_segment(lines, n) == ast.get_source_segment(text, n) for n in nodes)
