"""Which implementation the drafter's kernels run: Pallas (Mosaic TPU / Triton GPU), interpreted Pallas, or
the pure-jnp XLA reference.

Mode (``DSPINE_KERNELS`` environment variable, or ``set_mode`` / ``force``; the override wins):

* ``auto`` (default): compiled Pallas where these kernels have a lowering — Mosaic on TPU; Triton on
  CUDA/ROCm GPUs when the installed JAX still ships the Triton backend (deprecated since JAX 0.11) and the
  card is Ampere (sm_80) or newer — and the XLA reference everywhere else (CPU, older GPUs, a JAX without
  Triton). The kernels are written in the blocked ``pallas_call`` style that Mosaic TPU and Triton lower;
  Mosaic GPU (JAX's default GPU lowering of a plain ``pallas_call`` since 0.10, Hopper+ only, and deprecated
  for ``pallas_call`` in favour of ``plgpu.kernel``) rejects them (warpgroup-sized copies, WGMMA tile
  shapes), so the GPU path always passes Triton compiler params explicitly.
* ``pallas``: compiled Pallas, or an error if this platform has no lowering (a forced path must not
  silently fall back).
* ``interpret``: the Pallas kernels run in interpret mode (any platform; what the CPU tests use).
* ``reference``: the XLA reference (the drafter's own jnp code, bit-identical to having no kernels).

``DSPINE_KERNELS_FLAVOR=tpu|gpu`` picks which of the two kernel variants ``interpret`` runs (default: the
TPU variant on TPU, the GPU variant elsewhere).

``lowering_for(platform)`` (a context manager) makes the choice for the platform a program is being lowered
for rather than the machine's (``jax.export`` for TPU/GPU on a CPU, ``python -m dspine_jax.lower``): Mosaic
on ``tpu``, Triton on ``cuda``/``rocm``, in ``pallas`` mode so that a missing lowering is an error.

The choice is made when a kernel is *traced* (it is Python-level), so a function jitted before a mode change
keeps its old choice: ``set_mode``/``force`` call ``jax.clear_caches()`` so that the next call retraces.
Each (kernel, backend) choice is logged once at INFO on the ``dspine_jax.pallas.dispatch`` logger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator

import jax

logger = logging.getLogger(__name__)

ENV_VAR = "DSPINE_KERNELS"
FLAVOR_ENV_VAR = "DSPINE_KERNELS_FLAVOR"
MODES = ("auto", "pallas", "interpret", "reference")
FLAVORS = ("tpu", "gpu")

# Triton's Pallas backend supports Ampere and newer (Pallas quickstart: "The Triton backend supports GPUs
# down to Ampere").
_MIN_TRITON_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved implementation choice.

    name: ``reference`` | ``mosaic_tpu`` | ``triton`` | ``interpret``
    flavor: which kernel variant (``tpu``: grid over KV tiles + scalar prefetch; ``gpu``: in-kernel loop,
        power-of-two padded blocks) — None for the reference.
    interpret: run ``pallas_call(interpret=True)``.
    """

    name: str
    flavor: str | None = None
    interpret: bool = False

    @property
    def is_reference(self) -> bool:
        return self.name == "reference"


REFERENCE = Backend("reference")

_override: str | None = None
# The platform a program is being lowered for (``lowering_for``); None: the default backend's platform.
_lowering_platform: str | None = None
_logged: set[tuple[str, Backend]] = set()


def _check_mode(mode: str) -> str:
    mode = mode.strip().lower()
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r} is not one of {MODES} ({ENV_VAR})")
    return mode


def get_mode() -> str:
    """The requested mode: the ``set_mode``/``force`` override, else ``$DSPINE_KERNELS``, else ``auto``."""
    if _override is not None:
        return _override
    return _check_mode(os.environ.get(ENV_VAR, "auto") or "auto")


def set_mode(mode: str | None) -> None:
    """Override the mode process-wide (``None`` returns to the environment variable). Clears JAX's caches
    so that already-jitted callers retrace with the new choice."""
    global _override
    new = None if mode is None else _check_mode(mode)
    if new != _override:
        _override = new
        jax.clear_caches()


@contextlib.contextmanager
def force(mode: str) -> Iterator[None]:
    """``with force("interpret"): ...`` — the mode inside the block (restored afterwards)."""
    previous = _override
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


def _platform() -> str:
    return _lowering_platform if _lowering_platform is not None else jax.default_backend()


LOWERING_PLATFORMS = ("tpu", "cuda", "rocm", "gpu", "cpu")


@contextlib.contextmanager
def lowering_for(platform: str, mode: str = "pallas") -> Iterator[None]:
    """``with lowering_for("tpu"): jax.export.export(jax.jit(f), platforms=["tpu"])(...)`` — the kernels
    traced inside the block take the backend of ``platform`` (Mosaic TPU on ``tpu``, Triton on
    ``cuda``/``rocm``), not the machine's: ``jax.export`` lowers for platforms this machine does not have,
    and a program exported with the CPU's choice (the XLA reference) would prove nothing about the
    kernels a TPU or GPU run compiles. ``mode`` defaults to ``pallas`` so that a platform without a
    lowering is an error rather than a silent fallback. Clears JAX's caches on entry and exit (the choice
    is made at trace time). The GPU capability check is skipped: the card is not here to ask."""
    global _lowering_platform
    platform = platform.strip().lower()
    if platform not in LOWERING_PLATFORMS:
        raise ValueError(f"lowering platform {platform!r} is not one of {LOWERING_PLATFORMS}")
    previous_platform, previous_mode = _lowering_platform, _override
    _lowering_platform = platform
    set_mode(mode)
    jax.clear_caches()
    try:
        yield
    finally:
        _lowering_platform = previous_platform
        set_mode(previous_mode)
        jax.clear_caches()


def triton_available() -> bool:
    """Whether this JAX still ships Pallas's Triton lowering (deprecated in JAX 0.11, to be removed)."""
    try:
        from jax.experimental.pallas import triton as plt  # noqa: F401

        return hasattr(plt, "CompilerParams")
    except Exception:  # ImportError, or a removal shim raising something else
        return False


def _gpu_capability() -> tuple[int, int] | None:
    if _lowering_platform is not None:  # lowering for a GPU this machine does not have
        return None
    try:
        cap = getattr(jax.devices()[0], "compute_capability", None)
        if cap is None:
            return None
        major, minor = str(cap).split(".")[:2]
        return int(major), int(minor)
    except Exception:
        return None


def _gpu_backend(forced: bool) -> tuple[Backend, str]:
    """The compiled GPU backend (Triton), or the reference with the reason."""
    if not triton_available():
        reason = f"jax {jax.__version__} has no Pallas Triton backend"
        if forced:
            raise RuntimeError(f"{ENV_VAR}=pallas on GPU, but {reason}; use interpret or reference")
        return REFERENCE, reason
    cap = _gpu_capability()
    if cap is not None and cap < _MIN_TRITON_CAPABILITY:
        reason = f"compute capability {cap[0]}.{cap[1]} < 8.0 (the Triton backend needs Ampere+)"
        if forced:
            raise RuntimeError(f"{ENV_VAR}=pallas: {reason}")
        return REFERENCE, reason
    return Backend("triton", flavor="gpu"), "Triton lowering"


def resolve(mode: str | None = None, platform: str | None = None) -> tuple[Backend, str]:
    """Mode + platform → (backend, why). Pure apart from reading the environment; does not log."""
    mode = get_mode() if mode is None else _check_mode(mode)
    platform = _platform() if platform is None else platform
    if mode == "reference":
        return REFERENCE, f"{ENV_VAR}=reference"
    if mode == "interpret":
        flavor = (os.environ.get(FLAVOR_ENV_VAR) or ("tpu" if platform == "tpu" else "gpu")).strip().lower()
        if flavor not in FLAVORS:
            raise ValueError(f"{FLAVOR_ENV_VAR}={flavor!r}: expected one of {FLAVORS}")
        return Backend("interpret", flavor=flavor, interpret=True), "interpret mode requested"
    forced = mode == "pallas"
    if platform == "tpu":
        return Backend("mosaic_tpu", flavor="tpu"), "Mosaic TPU lowering"
    if platform in ("gpu", "cuda", "rocm"):
        return _gpu_backend(forced)
    if forced:
        raise RuntimeError(
            f"{ENV_VAR}=pallas but platform {platform!r} has no Pallas lowering; use interpret or reference"
        )
    return REFERENCE, f"no Pallas lowering on {platform!r}"


def select(kernel: str, mode: str | None = None) -> Backend:
    """Resolve the backend for ``kernel`` (a name, for the log) at trace time; log each choice once."""
    backend, why = resolve(mode)
    key = (kernel, backend)
    if key not in _logged:
        _logged.add(key)
        logger.info("dspine kernel %s: %s (flavor=%s; %s)", kernel, backend.name, backend.flavor, why)
    return backend


def as_backend(backend: Backend | str | None, kernel: str) -> Backend:
    """Accept a Backend, a mode string, or None (= the dispatcher's current choice)."""
    if isinstance(backend, Backend):
        return backend
    return select(kernel, backend)


def compiler_params(backend: Backend, num_warps: int = 4, **tpu_kwargs: object) -> object | None:
    """Backend-specific ``pallas_call`` compiler params (None in interpret mode).

    Triton must be asked for explicitly: since JAX 0.10 ``pallas_call`` on CUDA lowers to Mosaic GPU unless
    given Triton compiler params (``jax_pallas_use_mosaic_gpu`` defaults to True).
    """
    if backend.interpret:
        return None
    if backend.name == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu

        semantics = tpu_kwargs.get("dimension_semantics")
        if semantics is not None:  # the enum constants where this JAX has them (strings are the older spelling)
            names = {"parallel": "PARALLEL", "arbitrary": "ARBITRARY"}
            enums = tuple(getattr(pltpu, names[x], x) for x in semantics)  # type: ignore[union-attr]
            tpu_kwargs["dimension_semantics"] = enums
        return pltpu.CompilerParams(**tpu_kwargs)  # type: ignore[arg-type]
    if backend.name == "triton":
        from jax.experimental.pallas import triton as plt

        return plt.CompilerParams(num_warps=num_warps, num_stages=2)
    return None
