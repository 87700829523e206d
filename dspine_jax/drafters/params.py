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
