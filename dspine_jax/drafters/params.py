"""The drafter pytree: its weights (``DrafterLayer``, ``DrafterParams``, a kind's subclass of it) and the
``Drafter`` that carries them with its static config into ``jax.jit``. Below the context ring (``ring.py``)
and the backbone (``drafter.py``), which both take a ``Drafter``. Letters as in drafter.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

import jax.numpy as jnp
from flax import struct
from jax import Array

from dspine_jax.drafters.config import DrafterConfig, drafter_kind
from dspine_jax.models import panels, quant
from dspine_jax.parallel.mesh import weight

# ----------------------------------------------------------------------------------------------
# Parameters


@struct.dataclass
class DrafterLayer:
    """One backbone layer's weights. Layers are kept as a tuple, not stacked: the layer loop is unrolled
    and each layer reads its own buffers (slicing a stacked weight makes XLA:CPU copy it)."""

    input_norm: Array  # [H]
    q: Array = weight(None, "heads", group="attention")  # [H, N*D]
    k: Array = weight(None, "kv_heads", group="attention")  # [H, K*D]
    v: Array = weight(None, "kv_heads", group="attention")  # [H, K*D]
    o: Array = weight("heads", None, group="attention")  # [N*D, H]
    q_norm: Array = weight()  # [D]
    k_norm: Array = weight()  # [D]
    post_norm: Array = weight()  # [H]
    gate: Array = weight(None, "mlp")  # [H, F]
    up: Array = weight(None, "mlp")  # [H, F]
    down: Array = weight("mlp", None)  # [F, H]

    def for_mesh(self, config: DrafterConfig, model_shards: int) -> tuple[DrafterLayer, dict[str, bool]]:
        """Heads split over ``model_shards`` only when query and KV heads both divide (all or none)."""
        split = config.num_heads % model_shards == 0 and config.num_kv_heads % model_shards == 0
        return self, {"attention": split}


@struct.dataclass
class DrafterParams:
    """The weights every kind shares: the backbone and a draft vocabulary's. A kind with weights of its own
    subclasses this (``dspine.DSpineParams``, ``dflash2.DFlash2Params``; ``with_kind_weights`` builds one)."""

    fc: Array  # [n_taps*H, H]
    hidden_norm: Array  # [H]
    layers: tuple[DrafterLayer, ...]  # L layers
    norm: Array  # [H]
    # Draft vocabulary (config.draft_vocab_size > 0): its target ids [Vd] int32, ascending, and the target LM
    # head's columns for them [H, Vd] (derived from the target at load, like the codes; never trained or saved).
    draft_ids: Array | None = None
    draft_head: Any = None  # Array or quant.Int8Weight, as the target's head


P = TypeVar("P", bound=DrafterParams)


def with_kind_weights(params_class: type[P], backbone: DrafterParams, **weights: Any) -> P:
    """``backbone``'s shared weights (``DrafterParams``' fields) as a kind's ``params_class`` with that kind's
    own ``weights``; ``with_kind_weights(DrafterParams, params)`` drops a kind's weights (its bare backbone)."""
    shared = {f.name: getattr(backbone, f.name) for f in dataclasses.fields(DrafterParams)}
    return params_class(**shared, **weights)


@struct.dataclass
class Drafter:
    """A drafter: params (pytree) + static config. Pass it straight into ``jax.jit``."""

    params: DrafterParams
    config: DrafterConfig = struct.field(pytree_node=False)

    @property
    def kind(self) -> Any:
        """The registered kind (``config.kind``) whose methods run this drafter."""
        return drafter_kind(self.config.kind)

    @property
    def dtype(self) -> jnp.dtype:
        return self.params.fc.dtype


# ``attend(layer, q [B, T', N, D], k [B, T', K, D], v [B, T', K, D]) → [B, T', N, D]``: the block's queries
# against whatever context the caller keeps (the ring cache at inference, the whole sequence in training)
# and against the block's own keys. T' = A·T when A blocks run side by side.
Attend = Callable[[int, Array, Array, Array], Array]


# ----------------------------------------------------------------------------------------------
# Weight forms (every proposer pytree with ``params`` named like these: block drafters, the EAGLE-3 head)

DrafterLike = TypeVar("DrafterLike")  # a pytree with ``params`` and ``replace`` (``Drafter``, ``Eagle3Proposer``)

# The drafter's linear weights ``[in, out]`` (fc and every layer's projections); norms, DSpine's injection and
# DFlash2's convolutions / selector stay in float (small, and read as vectors or rows).
DRAFTER_MATRICES = ("fc", "q", "k", "v", "o", "gate", "up", "down")


def pack_drafter(drafter: DrafterLike, target: Any) -> DrafterLike:
    """``drafter`` with its linear weights and draft head packed for the CPU panel kernel where ``target``'s are
    (``models/panels.py``): its block forward, context append and unary logits then run like the target's
    products. An int8 drafter, or a target on XLA's products, leaves it unchanged."""
    if not panels.is_packed(target.params) or quant.is_quantized(drafter.params):
        return drafter
    return drafter.replace(params=panels.pack_params(drafter.params, (*DRAFTER_MATRICES, "draft_head")))


def quantize_drafter(drafter: DrafterLike, quantize: str = "none") -> DrafterLike:
    """``drafter`` with weight-only int8 linear weights (``quant.Int8Weight``, per output channel; ``"none"``:
    unchanged). Its proposals change only by the rounding; verification keeps the output exact."""
    if quantize not in quant.QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {quant.QUANTIZE_CHOICES}, got {quantize!r}")
    if quantize == "none":
        return drafter
    return drafter.replace(params=quant.quantize_params(drafter.params, DRAFTER_MATRICES))
