"""Models and drafters by hub name (``ORG/NAME[@REVISION]``), offline, from a real HF cache.

The cache is laid out the way huggingface_hub documents and writes it
(``models--ORG--NAME/{blobs/<hash>, refs/main, snapshots/<commit>/<file> -> ../../blobs/<hash>}``), holding a
tiny random target (transformers ``save_pretrained``) with a word-level tokenizer and a tiny drafter
(``init_drafter`` + ``save_drafter``), single-file and sharded. ``HF_HUB_OFFLINE=1`` throughout: nothing
here can reach a hub, and a test that tried would fail with the offline error.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import huggingface_hub
import huggingface_hub.constants  # read by hub.py at call time; patched below
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspine_jax.drafters.io import draft_block_size, init_drafter, load_drafter, save_drafter
from dspine_jax.models import hub
from dspine_jax.models.target import load_target
from dspine_jax.models.tokenizer import load_tokenizer
from dspine_jax.models.weights import load_safetensors_dir

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMIT = hashlib.sha1(b"tiny-llama v1").hexdigest()  # a 40-hex commit id, as the hub's
TARGET, DRAFTER = "acme/tiny-llama", "acme/tiny-dspine"
SHARDED_TARGET, SHARDED_DRAFTER = "acme/tiny-llama-sharded", "acme/tiny-dspine-sharded"
BLOCK = 4


def _tiny_tokenizer(model_dir: pathlib.Path, vocab_size: int = 128) -> None:
    """A word-level tokenizer over the tiny model's vocabulary (``w7 w8`` → two ids), saved beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "[UNK]"]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="[UNK]")
    fast.chat_template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}<|assistant|>"
    fast.save_pretrained(model_dir)


def _shard(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Copy ``src`` to ``dst`` with ``model.safetensors`` split into two shards + ``model.safetensors.index.json``
    (transformers' names and index format)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        shard = f"model-{i:05d}-of-{len(halves):05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = int(sum(t.nbytes for t in tensors.values()))
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _add_to_hf_cache(cache: pathlib.Path, repo_id: str, src: pathlib.Path, commit: str = COMMIT) -> pathlib.Path:
    """Put ``src``'s files into ``cache`` as huggingface_hub stores a downloaded model repo → snapshot dir."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()  # LFS files are named by sha256 (others by git sha1)
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # no trailing newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def sources(tiny_models, tmp_path_factory) -> dict[str, pathlib.Path]:
    """Local directories (tokenizer-carrying target, drafter, both sharded) and an HF cache holding them."""
    root = tmp_path_factory.mktemp("hub_names")
    target_dir = root / "target"
    shutil.copytree(tiny_models["llama"][0], target_dir)
    _tiny_tokenizer(target_dir)
    drafter = init_drafter(load_target(target_dir), "dspine", num_layers=2, block_size=BLOCK, top_k=4, seed=3)
    drafter_dir = root / "drafter"
    save_drafter(drafter, drafter_dir)
    _shard(target_dir, root / "target-sharded")
    _shard(drafter_dir, root / "drafter-sharded")
    cache = root / "hf" / "hub"
    for repo_id, src in ((TARGET, target_dir), (DRAFTER, drafter_dir), (SHARDED_TARGET, root / "target-sharded"),
                         (SHARDED_DRAFTER, root / "drafter-sharded")):
        _add_to_hf_cache(cache, repo_id, src)
    return {"target": target_dir, "drafter": drafter_dir, "target-sharded": root / "target-sharded",
            "drafter-sharded": root / "drafter-sharded", "cache": cache}


def _offline_env(cache: pathlib.Path) -> dict[str, str]:
    return {"HF_HOME": str(cache.parent), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def offline_cache(sources, monkeypatch) -> pathlib.Path:
    """The HF cache of ``sources`` as this process's cache, offline. huggingface_hub reads these variables
    once, at import, into ``huggingface_hub.constants``: both are patched."""
    cache = sources["cache"]
    for key, value in _offline_env(cache).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(cache.parent))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def _assert_trees_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _must_not_be_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("the hub was consulted for something that is not a hub repo id")


# --------------------------------------------------------------------------------------------------------
# What counts as a hub name, and what never reaches the hub


@pytest.mark.parametrize("spec, expected", [
    ("Qwen/Qwen3-8B", ("Qwen/Qwen3-8B", None)),
    ("tencent/Qwen3-8B-DSpine-b16@main", ("tencent/Qwen3-8B-DSpine-b16", "main")),
    (f"acme/tiny-llama@{COMMIT}", ("acme/tiny-llama", COMMIT)),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    ("./foo", None), ("../foo/bar", None), ("/abs/path", None), ("~/models/x", None), ("a/b/c", None),
    ("smollm2-135m", None), ("org/", None), ("/name", None), ("org/name@", None), ("a--b/c", None),
    ("org/na..me", None), ("org/name.git", None), ("org/name@has space", None), ("org/.hidden", None),
])
def test_repo_id_syntax(spec: str, expected: tuple[str, str | None] | None) -> None:
    assert hub.parse_repo_id(spec) == expected


@pytest.mark.parametrize("spec", ["./foo", "../models/qwen", "/no/such/model", "a/b/c", "no-such-alias"])
def test_typo_is_a_clear_error_without_a_hub_call(spec: str, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", _must_not_be_called)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as ei:
        hub.resolve_model_dir(spec, cache_dir=tmp_path / "dspine")
    msg = str(ei.value)
    assert spec in msg and "hub repo id" in msg and "smollm2-135m-instruct" in msg
    with pytest.raises(FileNotFoundError, match="neither a drafter checkpoint directory nor a hub repo id"):
        hub.resolve_drafter_dir(spec)
    with pytest.raises(FileNotFoundError, match=r"not a directory .*hub repo id.*init:dspine"):
        draft_block_size(spec)


def test_local_directory_wins_over_a_hub_name(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """``org/name`` that exists here is that directory (even without config.json: then an error), never a download."""
    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", _must_not_be_called)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "model").mkdir(parents=True)
    (tmp_path / "acme" / "model" / "config.json").write_text("{}")
    (tmp_path / "acme" / "empty").mkdir()
    assert hub.resolve_model_dir("acme/model") == (tmp_path / "acme" / "model").resolve()
    assert hub.resolve_drafter_dir("acme/empty") == pathlib.Path("acme/empty")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hub.resolve_model_dir("acme/empty")


def test_allow_patterns_fetch_what_the_loaders_read() -> None:
    """A typical repo listing, filtered by huggingface_hub's own matcher with our patterns."""
    from huggingface_hub.utils import filter_repo_objects

    listing = ["config.json", "generation_config.json", "model.safetensors.index.json",
               "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
               "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja",
               "README.md", ".gitattributes",
               "pytorch_model.bin", "original/consolidated.safetensors", "original/model-00001.safetensors",
               "model.Q4_K_M.gguf", "LICENSE", "modeling_dspine.py"]
    got = set(filter_repo_objects(listing, allow_patterns=list(hub.HUB_ALLOW_PATTERNS)))
    assert got == set(listing[:10])


# --------------------------------------------------------------------------------------------------------
# Loading by name from the cache, offline


def test_cache_layout_is_what_huggingface_hub_reads(offline_cache: pathlib.Path) -> None:
    """Guard on the fixture itself: huggingface_hub's cache scanner sees four model repos, one revision each."""
    info = huggingface_hub.scan_cache_dir(offline_cache)
    assert not info.warnings, info.warnings
    assert {r.repo_id for r in info.repos} == {TARGET, DRAFTER, SHARDED_TARGET, SHARDED_DRAFTER}
    assert all([rev.commit_hash for rev in r.revisions] == [COMMIT] for r in info.repos)


@pytest.mark.parametrize("name", [TARGET, f"{TARGET}@{COMMIT}", f"{TARGET}@main"])
def test_target_and_tokenizer_by_name_equal_the_directory(sources, offline_cache: pathlib.Path, name: str) -> None:
    resolved = hub.resolve_model_dir(name)
    assert resolved == offline_cache / "models--acme--tiny-llama" / "snapshots" / COMMIT
    by_name, by_dir = load_target(name), load_target(sources["target"])
    assert by_name.config == by_dir.config
    _assert_trees_equal(by_name.params, by_dir.params)
    assert pathlib.Path(by_name.model_dir) == resolved
    tok_name, tok_dir = load_tokenizer(name), load_tokenizer(sources["target"])
    text = "w7 w8 w9 w100"
    assert tok_name.encode(text) == tok_dir.encode(text) == [7, 8, 9, 100]
    assert tok_name.chat_template == tok_dir.chat_template is not None


@pytest.mark.parametrize("name", [DRAFTER, f"{DRAFTER}@{COMMIT}"])
def test_drafter_by_name_equals_the_directory(sources, offline_cache: pathlib.Path, name: str) -> None:
    target = load_target(sources["target"])
    by_name, by_dir = load_drafter(name, target), load_drafter(sources["drafter"], target)
    assert by_name.config == by_dir.config
    _assert_trees_equal(by_name.params, by_dir.params)
    assert draft_block_size(name) == BLOCK


def test_sharded_checkpoints_load_identically(sources, offline_cache: pathlib.Path) -> None:
    for kind in ("target", "drafter"):
        sharded = sources[f"{kind}-sharded"]
        assert not (sharded / "model.safetensors").exists()
        assert len(list(sharded.glob("model-0000?-of-00002.safetensors"))) == 2
        single, split = load_safetensors_dir(sources[kind]), load_safetensors_dir(sharded)
        assert single.keys() == split.keys()
        for name in single:
            np.testing.assert_array_equal(single[name], split[name])
    target = load_target(sources["target"])
    for spec in (sources["target-sharded"], SHARDED_TARGET):
        _assert_trees_equal(load_target(spec).params, target.params)
    drafter = load_drafter(sources["drafter"], target)
    for spec in (sources["drafter-sharded"], SHARDED_DRAFTER):
        _assert_trees_equal(load_drafter(spec, target).params, drafter.params)


# --------------------------------------------------------------------------------------------------------
# Not cached and unreachable: one clear line


@pytest.mark.parametrize("name, download", [
    ("acme/not-downloaded", "hf download acme/not-downloaded"),
    (f"{TARGET}@v2", f"hf download {TARGET} --revision v2"),  # a revision this cache has no ref for
])
def test_not_cached_offline_is_one_clear_line(offline_cache: pathlib.Path, name: str, download: str) -> None:
    for resolve in (hub.resolve_model_dir, hub.resolve_drafter_dir):
        with pytest.raises(hub.HubModelError) as ei:
            resolve(name)
        msg = str(ei.value)
        assert "\n" not in msg
        assert name.partition("@")[0] in msg and "not in the HF cache" in msg and str(offline_cache) in msg
        assert "HF_HUB_OFFLINE=1" in msg and f"`{download}`" in msg and "pass a local directory" in msg
    with pytest.raises(FileNotFoundError, match="not in the HF cache"):  # what the CLIs catch
        load_target(name)


def _hub_error(cls: type[BaseException], message: str = "boom\nsecond line") -> BaseException:
    """An instance of huggingface_hub's HTTP error ``cls`` without a real HTTP response."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


@pytest.mark.parametrize("error, expected", [
    ("GatedRepoError", r"acme/x is gated: .*HF_TOKEN"),
    ("RepositoryNotFoundError", r"acme/x does not exist on the hub \(or is private: set HF_TOKEN\)"),
    ("RevisionNotFoundError", r"acme/x@v9 has no revision 'v9'"),
    ("HfHubHTTPError", r"acme/x@v9 could not be fetched: HfHubHTTPError: boom second line"),
])
def test_hub_failures_are_one_line(monkeypatch: pytest.MonkeyPatch, error: str, expected: str) -> None:
    """The online failures (mocked: no hub is reachable here) each become one HubModelError line."""
    cls = getattr(huggingface_hub.errors, error)

    def fail(*args: object, **kwargs: object) -> None:
        raise _hub_error(cls)

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", fail)
    spec = "acme/x" if error in ("GatedRepoError", "RepositoryNotFoundError") else "acme/x@v9"
    with pytest.raises(hub.HubModelError, match=expected) as ei:
        hub.resolve_model_dir(spec)
    assert "\n" not in str(ei.value)


def test_unreachable_hub_names_the_network_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*args: object, **kwargs: object) -> None:
        try:
            raise ConnectionError("[Errno 101] Network is unreachable")
        except ConnectionError as cause:
            raise huggingface_hub.errors.LocalEntryNotFoundError("cannot find\nthe snapshot") from cause

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(hub.HubModelError, match=r"cannot be reached \(ConnectionError: \[Errno 101\] Network is "
                                                r"unreachable\); run `hf download acme/x`") as ei:
        hub.resolve_drafter_dir("acme/x")
    assert "\n" not in str(ei.value)


def test_snapshot_download_is_asked_for_the_loader_files(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: pathlib.Path) -> None:
    """The online call: repo, revision and allow-patterns; cache, token and offline mode are left to huggingface_hub."""
    calls = []

    def fake(repo_id: str, **kwargs: object) -> str:
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", fake)
    (tmp_path / "config.json").write_text("{}")
    assert hub.resolve_model_dir("Qwen/Qwen3-8B@abc123") == tmp_path
    [(repo_id, kwargs)] = calls
    assert repo_id == "Qwen/Qwen3-8B"
    assert kwargs == {"revision": "abc123", "allow_patterns": list(hub.HUB_ALLOW_PATTERNS)}
    (tmp_path / "config.json").unlink()
    with pytest.raises(hub.HubModelError, match="has no config.json"):
        hub.resolve_drafter_dir("acme/not-a-model")


@pytest.mark.parametrize("offline", [False, True])
def test_shards_the_patterns_miss_are_fetched_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                                      offline: bool) -> None:
    """An index naming shards outside the patterns (``weights-a.safetensors``): online a second call fetches
    exactly those; offline nothing more is asked (the weight loader then names the missing shard)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "weights-a.safetensors", "b": "model-00001-of-00001.safetensors"}}))
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"")
    calls = []

    def fake(repo_id: str, **kwargs: object) -> str:
        calls.append(kwargs["allow_patterns"])
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", fake)
    assert hub.resolve_drafter_dir("acme/odd-shards") == tmp_path
    assert calls == [list(hub.HUB_ALLOW_PATTERNS)] + ([] if offline else [["weights-a.safetensors"]])


# --------------------------------------------------------------------------------------------------------
# The command lines


def _run_cli(args: list[str], cache: pathlib.Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, **_offline_env(cache), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_generate_cli_by_hub_name_offline(sources) -> None:
    """``--model ORG/NAME --draft ORG/NAME`` from the cache, in a fresh process: greedy speculative output
    equals greedy autoregressive decoding of the same directory here."""
    from dspine_jax import generate

    proc = _run_cli(["-m", "dspine_jax.generate", "--model", TARGET, "--draft", DRAFTER, "--verify", str(BLOCK),
                     "--prompt", "w7 w8 w9", "--max-new-tokens", "6", "--json"], sources["cache"])
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    prompt = load_tokenizer(sources["target"]).encode("w7 w8 w9")
    expected = generate(load_target(sources["target"]), [prompt], max_new_tokens=6).token_ids[0]
    assert record["token_ids"] == expected and expected
    assert "acceptance_lengths" in record


def test_generate_cli_not_cached_is_one_line(sources) -> None:
    proc = _run_cli(["-m", "dspine_jax.generate", "--model", "acme/not-downloaded", "--prompt", "w7"], sources["cache"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "acme/not-downloaded" in errors[0] and "HF_HUB_OFFLINE=1" in errors[0]
    assert "`hf download acme/not-downloaded`" in errors[0]


def test_generate_cli_rejects_an_uncached_drafter_before_loading(offline_cache: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import importlib

    import dspine_jax.models.target

    cli = importlib.import_module("dspine_jax.generate")  # the module: dspine_jax.generate is also a function
    monkeypatch.setattr(dspine_jax.models.target, "load_target", _must_not_be_called)
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)  # keep this process's JAX config
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", TARGET, "--prompt", "w7", "--draft", "acme/no-drafter"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "--draft: " in err and "acme/no-drafter" in err and "HF_HUB_OFFLINE=1" in err


def test_server_startup_not_cached_is_one_line(offline_cache: pathlib.Path) -> None:
    """The server's loader turns the same failure into its one-line ``StartupError``."""
    from dspine_jax.serve.__main__ import build_parser, load_engine
    from dspine_jax.serve.scheduler import StartupError

    args = build_parser().parse_args(["--model", "acme/not-downloaded"])
    with pytest.raises(StartupError) as ei:
        load_engine(args, None, lambda msg: None)
    assert "\n" not in str(ei.value) and "acme/not-downloaded" in str(ei.value) and "HF_HUB_OFFLINE=1" in str(ei.value)
