"""Place a target and a drafter on a ``data`` × ``model`` mesh (tensor + data parallel decoding).

    mesh = make_mesh(tp=4, dp=2)                     # dspine_jax/parallel/mesh.py
    target, drafter = shard_target(target, mesh), shard_drafter(drafter, mesh)
    with use_mesh(mesh):
        result = speculative_generate(target, drafter, prompts, 64)

Weights get ``NamedSharding``s from their logical axes (``mesh.RULES``): Megatron-style, every
projection *into* heads / MLP width is split by columns (heads, KV heads, MLP width on ``model``) and
every projection back to the residual stream by rows, so each layer needs one all-reduce, which XLA
inserts. The LM head is split over the vocabulary. Norms, embeddings, the drafter's fc and DSpine
injection (all small) are replicated. Caches are created under ``use_mesh`` already laid out (batch on
``data``, KV heads on ``model``; dspine_jax/models/cache.py). A dimension that does not divide evenly by its
mesh axis stays replicated, so any model runs on any mesh; ``describe`` shows what was split.

Each weight declares its logical axes where it is defined (``mesh.weight`` on the params dataclass
field, next to its shape), so this module walks any params pytree without knowing its family. Weights
that must split together (a layer's heads) name a group; the layer's ``for_mesh(config, shards)`` says
which of its groups split on this mesh and may re-store fused projections first (a dense layer's q|k|v
and gate|up, a Gated-DeltaNet layer's q|k|v conv channels: one group of whole heads per model shard,
``dense.regroup``, ``gdn.regroup``), so a shard's columns are its own heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from dspine_jax.drafters.params import Drafter
from dspine_jax.models import panels, quant
from dspine_jax.models.target import Target
from dspine_jax.parallel.distributed import put
from dspine_jax.parallel.mesh import MODEL, logical_spec


def _put(value: Any, axes: tuple[str | None, ...] | None, mesh: Mesh) -> Any:
    """An array (or a tuple of arrays, e.g. per-layer weights) placed by its logical axes; None stays None."""
    if isinstance(value, tuple):
        return tuple(_put(v, axes, mesh) for v in value)
    if not isinstance(value, jax.Array):
        return value
    spec = logical_spec(value.shape, axes or (None,) * value.ndim, dict(mesh.shape))
    return put(value, NamedSharding(mesh, spec))  # (each process transfers only its own shards)


def place(node: Any, config: Any, mesh: Mesh, splits: dict[str, bool] | None = None) -> Any:
    """``node`` (a params pytree of ``struct.dataclass``es and tuples) with every array on ``mesh`` by the
    axes its field declares (``mesh.weight``); undeclared arrays are replicated. A node with a
    ``for_mesh(config, model_shards)`` method is first re-laid out by it and decides which of its weight
    groups split (a group that does not split is replicated as a whole)."""
    if isinstance(node, tuple):
        return tuple(place(child, config, mesh, splits) for child in node)
    if not dataclasses.is_dataclass(node):
        return _put(node, None, mesh)
    splits = dict(splits or {})
    if hasattr(node, "for_mesh"):
        node, own = node.for_mesh(config, mesh.shape[MODEL])
        splits.update(own)
    updates = {}
    for field in dataclasses.fields(node):
        if not field.metadata.get("pytree_node", True):
            continue
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value) or (isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0])):
            updates[field.name] = place(value, config, mesh, splits)
            continue
        axes, group = field.metadata.get("axes"), field.metadata.get("group")
        updates[field.name] = _put(value, None if group is not None and not splits.get(group) else axes, mesh)
    return node.replace(**updates)


def shard_target(target: Target, mesh: Mesh) -> Target:
    """``target`` with its weights laid out on ``mesh`` (fused columns regrouped per model shard)."""
    if quant.is_quantized(target.params):
        raise ValueError("int8-quantised targets cannot be laid out on a device mesh yet; run them on one device")
    # A mesh runs XLA's products (the CPU panel kernel multiplies on one device).
    return target.replace(params=place(panels.unpack_params(target.params), target.config, mesh))


def shard_drafter(drafter: Drafter, mesh: Mesh) -> Drafter:
    """``drafter`` with its layers split like the target's; fc, norms and the DSpine injection replicated."""
    return drafter.replace(params=place(panels.unpack_params(drafter.params), drafter.config, mesh))


def describe(tree: Any) -> dict[str, str]:
    """``{leaf path: partition spec}`` of every array in ``tree`` (what ``shard_*`` actually split)."""
    return {
        jax.tree_util.keystr(path): str(leaf.sharding.spec) if isinstance(leaf.sharding, NamedSharding) else "single device"
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }
