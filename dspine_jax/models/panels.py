"""The target's weight products on the CPU: weights packed in panels once at load time, multiplied by one kernel.

A decode step multiplies one token's activations by every weight matrix; a verify multiplies ``T`` of them.
XLA:CPU streams a matrix near the memory bandwidth for one row but packs it again on every call for two or
more, so a verify of 4 tokens cost ~1.3–1.5× a one-token step (``experiments/adaptive/RESULTS.md``). Here a
matrix ``W [K, N]`` is stored as ``PanelWeight``: panels of 16 columns, ``[N / 16, K, 16]``, each one
contiguous stream, and ``kernels/cpu/panel_matmul.cc`` (an XLA FFI custom call, both cores) reads each panel
once per group of rows (8 with AVX-512, 6 with AVX2), so a verify's products cost little more than a one-token
step's.

Exactness: the kernel sums every output over ``k`` in the same order whatever the number of rows, so a row's
products are the same bits in a one-token step and in any verify block (``test_panels.py``): greedy
speculative output no longer rests on XLA's one-row and many-row matmuls rounding alike.

A matrix whose float32 values are all bfloat16 values (a checkpoint stored in bfloat16 and loaded as float32, e.g.
the shipped DSpine drafter) is packed in bfloat16: the kernel widens each value back to the same float32 before
the same multiply-adds, so its products are the same bits from half the bytes (a memory-bound step reads them all).

``PanelWeight`` stands in for the array it replaces (``x @ w``, ``quant.matmul_f32``, ``quant.take_columns``,
``quant.dequantize``), like ``quant.Int8Weight``. Prefill runs through the kernel too: every row group rereads a
block of panels from cache, and a 512-token prefill of SmolLM2 took 841 ms against XLA's 892 ms on a 2-core
AVX-512 Xeon (XLA's matmul on the unpacked view, which copies every matrix per call, took 1009 ms), 1300 against
1325 ms on a 2-core AVX2 EPYC.

``pack_params(params, "auto")`` packs on a CPU the kernel was tuned for (x86-64 with AVX2 and FMA, AVX-512 or
not), float32 weights, one device, when the kernel builds
(``g++`` at first use, cached under the cache root); anything else keeps XLA's products (``"xla"``). The
kernel's reference is ``x @ w.unpacked()``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import Array

from dspine_jax.models import hub

PANEL = 16  # columns per panel (the kernel's vector width)
PRODUCTS = ("auto", "panels", "xla")
FFI_TARGETS = {jnp.dtype(jnp.float32): ("dspine_panel_matmul", "DspinePanelMatmul"),
               jnp.dtype(jnp.bfloat16): ("dspine_panel_matmul_bf16", "DspinePanelMatmulBf16")}  # fmt: skip
_log = logging.getLogger("dspine_jax")


@struct.dataclass
class PanelWeight:
    """``W [K, N]`` (float32) stored as ``panels [N / PANEL, K, PANEL]``: float32, or bfloat16 where every value
    of ``W`` is one (``pack``)."""

    panels: Array

    @property
    def shape(self) -> tuple[int, int]:
        p, k, c = self.panels.shape
        return (k, p * c)

    @property
    def dtype(self) -> jnp.dtype:
        """float32: the dtype of the matrix it stands for (and of its products), whatever the panels hold."""
        return jnp.dtype(jnp.float32)

    @property
    def ndim(self) -> int:
        return 2

    def unpacked(self) -> Array:
        """``W [K, N]`` (a copy: the kernel's reference, and the matrix for code that needs one)."""
        p, k, c = self.panels.shape
        return self.panels.transpose(1, 0, 2).reshape(k, p * c).astype(jnp.float32)

    def __rmatmul__(self, x: Array) -> Array:
        return panel_matmul(x, self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """``np.asarray(w)``: the unpacked matrix (inside jitted code, use ``quant.dequantize``)."""
        return np.asarray(self.unpacked(), dtype=dtype)


def pack(w: Array | np.ndarray) -> PanelWeight:
    """``w [K, N]`` float32 (N a multiple of ``PANEL``) in panels; in bfloat16 when that holds every value
    exactly (the low 16 bits of each float32 are zero), else in float32."""
    k, n = w.shape
    if n % PANEL:
        raise ValueError(f"a packed matrix needs a multiple of {PANEL} columns, got {n}")
    bits = np.ascontiguousarray(w, np.float32).view(np.uint32)
    if not np.any(bits & 0xFFFF):
        values = (bits >> 16).astype(np.uint16).view(jnp.bfloat16)
    else:
        values = bits.view(np.float32)
    return PanelWeight(jnp.asarray(values.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)))


def panel_matmul(x: Array, w: PanelWeight) -> Array:
    """``x [..., K] @ W → [..., N]`` in float32, by the kernel."""
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last axis is {x.shape[-1]}, W has {k} rows")
    if not kernel_available():
        raise RuntimeError("the CPU panel kernel is not built (no C++ compiler?): load with products='xla'")
    x = x.astype(jnp.float32)
    if x.size == 0:
        return jnp.zeros((*x.shape[:-1], n), jnp.float32)
    target = FFI_TARGETS[jnp.dtype(w.panels.dtype)][0]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32), vmap_method="expand_dims")
    return call(x, w.panels)


# ----------------------------------------------------------------------------------------------
# Building the kernel (once per machine, compiler and jaxlib) and registering it


def _source() -> Path:
    """``panel_matmul.cc`` (``kernels/cpu/`` in the repository, installed as ``dspine_jax.cpu_kernels``)."""
    return Path(importlib.util.find_spec("dspine_jax.cpu_kernels").origin).parent / "panel_matmul.cc"


def _library_path() -> Path:
    """Where the kernel built for this source, jaxlib and CPU lives (``-march=native``: per CPU model)."""
    cpu = (platform.processor() or platform.machine()) + " ".join(sorted(cpu_flags()))
    identity = _source().read_bytes() + f"|{jax.__version__}|{sys.platform}|{cpu}".encode()
    digest = hashlib.sha256(identity).hexdigest()[:16]
    return hub.default_cache_dir() / "kernels" / f"panel_matmul-{digest}.so"


def _build(path: Path, source: Path | None = None) -> None:
    """Compile ``source`` (default: the package's ``panel_matmul.cc``) into the library ``path``."""
    compiler = os.environ.get("CXX", "g++")
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [compiler, "-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC",
               f"-I{jax.ffi.include_dir()}", str(source or _source()), "-o", str(tmp)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    os.replace(tmp, path)  # atomic: a concurrent build never leaves a torn library


def _register(path: Path, targets: Mapping[Any, tuple[str, str]]) -> None:
    """Register the library ``path``'s handlers for the CPU: ``targets`` maps to (FFI target name, symbol)."""
    library = ctypes.cdll.LoadLibrary(str(path))
    for name, symbol in targets.values():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")


@functools.cache
def kernel_available() -> bool:
    """Whether the panel kernel is built (building it on first use) and registered for the CPU."""
    try:
        path = _library_path()
        if not path.exists():
            _log.info("building the CPU panel kernel (once per machine; cached in %s)", path.parent)
            _build(path)
        _register(path, FFI_TARGETS)
        return True
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", "") or e
        _log.warning("the CPU panel kernel did not build (%s); using XLA's matmuls", str(detail).strip()[:500])
        return False


# ----------------------------------------------------------------------------------------------
# Packing a target's params


def resolve_products(products: str, params: Any) -> str:
    """``"auto"`` → ``"panels"`` on a CPU backend the kernel was tuned for (``tuned_for_this_cpu``) with float32
    weights on one device and the kernel built, else ``"xla"``; ``"panels"`` is checked the same way (an error says
    why not), except for the CPU's kind."""
    if products not in PRODUCTS:
        raise ValueError(f"products must be one of {', '.join(PRODUCTS)}, got {products!r}")
    if products == "xla":
        return "xla"
    leaves = jax.tree.leaves(params)
    reasons = []
    if jax.default_backend() != "cpu":
        reasons.append(f"the backend is {jax.default_backend()}, not cpu")
    if any(getattr(leaf, "dtype", None) not in (jnp.float32, np.float32) for leaf in leaves if getattr(leaf, "ndim", 0) == 2):
        reasons.append("the weights are not all float32")
    if any(len(getattr(getattr(leaf, "sharding", None), "device_set", ())) > 1 for leaf in leaves):
        reasons.append("the weights span several devices")
    if reasons:
        if products == "panels":
            raise ValueError(f"packed products need float32 weights on one CPU device: {'; '.join(reasons)}")
        return "xla"
    if products == "auto" and not tuned_for_this_cpu():
        return "xla"
    if not kernel_available():
        if products == "panels":
            raise RuntimeError("the CPU panel kernel did not build (see the warning above)")
        return "xla"
    return "panels"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def tuned_for_this_cpu() -> bool:
    """Whether the kernel's shapes were tuned and timed on CPUs like this one: x86-64 with AVX2 and FMA (its AVX-512
    and AVX2 shapes). Elsewhere ``"auto"`` keeps XLA's products: built with shapes never timed there, the kernel
    once cost 2× XLA's one-token step (AVX2 with the AVX-512 shapes); ``"panels"`` still packs."""
    return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= cpu_flags()


def map_matrices(params: Any, names: tuple[str, ...], fn) -> Any:
    """``params`` with ``fn(name, value)`` in place of every 2-D array field named in ``names`` (``fn`` returns
    the replacement, or None to keep it), through nested dataclasses and tuples."""

    def visit(node: Any) -> Any:
        if isinstance(node, tuple):
            return tuple(visit(x) for x in node)
        if not hasattr(node, "replace") or not hasattr(node, "__dataclass_fields__"):
            return node
        updates = {}
        for name in node.__dataclass_fields__:
            value = getattr(node, name)
            if isinstance(value, jax.Array) and value.ndim == 2 and name in names:
                new = fn(name, value)
                if new is not None:
                    updates[name] = new
            elif isinstance(value, tuple) or hasattr(value, "__dataclass_fields__"):
                updates[name] = visit(value)
        return node.replace(**updates) if updates else node

    return visit(params)


def pack_params(params: Any, names: tuple[str, ...], products: str = "auto") -> Any:
    """``params`` with every matrix named in ``names`` (and the LM head) packed, where ``products`` resolves to
    ``"panels"`` and the matrix has a multiple of ``PANEL`` columns."""
    if resolve_products(products, params) != "panels":
        return params
    return map_matrices(params, (*names, "lm_head"), lambda _, w: pack(w) if w.shape[1] % PANEL == 0 else None)


def unpack_params(params: Any) -> Any:
    """``params`` with every ``PanelWeight`` back to a plain ``[K, N]`` array (to shard, train or export)."""
    return jax.tree.map(lambda x: x.unpacked() if isinstance(x, PanelWeight) else x, params,
                        is_leaf=lambda x: isinstance(x, PanelWeight))  # fmt: skip


def widen_params(params: Any) -> Any:
    """``params`` with every ``PanelWeight`` held in float32 panels (bfloat16 ones widened): the same matrices and
    the same products from twice the bytes — the packing a bfloat16 matrix had before ``pack`` kept it compact."""
    return jax.tree.map(lambda x: PanelWeight(x.panels.astype(jnp.float32)) if isinstance(x, PanelWeight) else x,
                        params, is_leaf=lambda x: isinstance(x, PanelWeight))  # fmt: skip


def is_packed(params: Any) -> bool:
    return any(isinstance(x, PanelWeight) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, PanelWeight)))
