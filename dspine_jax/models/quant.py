"""Weight-only int8 quantisation of a target's matrices (``load_target(..., quantize="int8")``).

``Int8Weight`` stores ``w ≈ q · scale`` with ``q`` int8 in ``[-127, 127]`` and one float scale per
output channel (a linear weight ``[I, O]``: per column, ``scale [1, O]``; the embedding ``[V, H]``: per
row, ``scale [V, 1]``), so the rounding error of every entry is at most ``scale / 2``. It stands in for
the array it replaces: ``x @ w`` (``__rmatmul__``), ``w[ids]`` (embedding rows), ``take_columns`` (the
head rows DSpine reads) and ``matmul_f32`` (logits) all work, so the families' forwards do not change.

The matmul converts ``q`` to the activation dtype and scales the product: on GPU/TPU XLA fuses the
conversion into the matmul's operand load (the weights cross memory as int8); XLA:CPU converts the
whole matrix first, so on CPU int8 weights save memory, not time (``experiments/quantisation``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.models.panels import PANEL, PanelWeight, map_matrices, panel_matmul

QUANTIZE_CHOICES = ("none", "int8")
QMAX = 127  # symmetric: -128 is never used, so negation is exact


@struct.dataclass
class Int8Weight:
    """``q [..., I, O]`` int8 and ``scale`` broadcastable to it (``[1, O]`` per column, ``[V, 1]`` per row)."""

    q: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.scale.dtype  # the compute dtype

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def __rmatmul__(self, x: Array) -> Array:
        return (x @ self.q.astype(x.dtype)) * self.column_scale(x.dtype)

    def __getitem__(self, index: Any) -> Array:
        """Rows (the embedding lookup): needs per-row scales."""
        if self.scale.shape[-1] != 1:
            raise TypeError("indexing an Int8Weight selects rows; this one has per-column scales")
        return self.q[index].astype(self.dtype) * self.scale[index]

    def column_scale(self, dtype: jnp.dtype) -> Array:
        if self.scale.shape[-2] != 1:
            raise TypeError("a matmul needs per-column scales; this Int8Weight has per-row scales")
        return self.scale[..., 0, :].astype(dtype)


def quantize_int8(w: Array, per: str = "column") -> Int8Weight:
    """``w [..., I, O]`` → int8 with one scale per column (``per="column"``: linear weights, ``[I, O]``) or
    per row (``per="row"``: the embedding ``[V, H]``). All-zero channels get scale 1."""
    axis = {"column": -2, "row": -1}[per]
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    q = jnp.clip(jnp.round(w32 / scale), -QMAX, QMAX).astype(jnp.int8)
    return Int8Weight(q=q, scale=scale.astype(w.dtype))


def dequantize(w: Int8Weight | PanelWeight | Array) -> Array:
    """The float matrix ``q · scale`` (a packed matrix unpacked; an array passes through)."""
    if isinstance(w, PanelWeight):
        return w.unpacked()
    return w.q.astype(w.dtype) * w.scale if isinstance(w, Int8Weight) else w


def matmul_f32(x: Array, w: Int8Weight | PanelWeight | Array) -> Array:
    """``x @ w`` accumulated and returned in float32 (the logits)."""
    if isinstance(w, Int8Weight):
        out = jnp.matmul(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
        return out * w.column_scale(jnp.float32)
    if isinstance(w, PanelWeight):
        return panel_matmul(x, w)
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def take_columns(w: Int8Weight | PanelWeight | Array, ids: Array) -> Array:
    """``w[:, ids]`` as floats: ``[I, *ids.shape]`` (DSpine reads the head's rows of its candidates)."""
    if isinstance(w, Int8Weight):
        return jnp.take(w.q, ids, axis=1).astype(w.dtype) * jnp.take(w.column_scale(w.dtype), ids)
    if isinstance(w, PanelWeight):  # column j is panels[j // PANEL, :, j % PANEL]
        rows = w.panels[ids // PANEL, :, ids % PANEL]  # [*ids.shape, I]
        return jnp.moveaxis(rows, -1, 0).astype(w.dtype)
    return jnp.take(w, ids, axis=1)


def is_quantized(params: Any) -> bool:
    return any(isinstance(leaf, Int8Weight) for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int8Weight)))


def quantize_params(params: Any, matrices: tuple[str, ...]) -> Any:
    """The params pytree with every 2-D ``embed`` (per row), ``lm_head`` and field named in ``matrices``
    (per column) quantised; norms, biases, convolution and gate vectors stay in their dtype."""
    return map_matrices(params, ("embed", "lm_head", *matrices),
                        lambda name, w: quantize_int8(w, per="row" if name == "embed" else "column"))  # fmt: skip
