"""Place a target and a drafter on a ``data`` × ``model`` mesh (tensor + data parallel decoding).

    mesh = make_mesh(tp=4, dp=2)                     # dspine_jax/mesh.py
    target, drafter = shard_target(target, mesh), shard_drafter(drafter, mesh)
    with use_mesh(mesh):
        result = speculative_generate(target, drafter, prompts, 64)

Weights get ``NamedSharding``s from their logical axes (``mesh.RULES``): Megatron-style, every
projection *into* heads / MLP width is split by columns (heads, KV heads, MLP width on ``model``) and
every projection back to the residual stream by rows, so each layer needs one all-reduce, which XLA
inserts. The LM head is split over the vocabulary. Norms, embeddings, the drafter's fc and DSpine
injection (all small) are replicated. Caches are created under ``use_mesh`` already laid out (batch on
``data``, KV heads on ``model``; dspine_jax/cache.py). A dimension that does not divide evenly by its
mesh axis stays replicated, so any model runs on any mesh; ``describe`` shows what was split.

Fused projections (a dense layer's q|k|v and gate|up, a Gated-DeltaNet layer's q|k|v conv channels) are
re-stored group-major first, one group of whole heads per model shard (``target.regroup``,
``gdn.regroup``), so a shard's columns are its own heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspine_jax import gdn, hybrid
from dspine_jax.config import HybridConfig
from dspine_jax.drafter import Drafter, DrafterLayer
from dspine_jax.mesh import MODEL, Axes, logical_spec
from dspine_jax.target import DenseLayer, Target, regroup

COLUMNS_HEADS, ROWS_HEADS = (None, "heads"), ("heads", None)
COLUMNS_KV = (None, "kv_heads")
COLUMNS_MLP, ROWS_MLP = (None, "mlp"), ("mlp", None)


def _place(node: Any, mesh: Mesh, **axes: Axes) -> Any:
    """``node`` (a params dataclass) with each array field put on ``mesh`` by its logical axes (fields not
    named are replicated). Nested dataclasses are left alone."""
    mesh_shape = dict(mesh.shape)
    updates = {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if not isinstance(value, jax.Array):
            continue
        field_axes = axes.get(field.name, (None,) * value.ndim)
        updates[field.name] = jax.device_put(value, NamedSharding(mesh, logical_spec(value.shape, field_axes, mesh_shape)))
    return node.replace(**updates)


def _replicate(tree: Any, mesh: Mesh) -> Any:
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def _when(split: bool, **axes: Axes) -> dict[str, Axes]:
    """``axes`` if this group of weights is split, else nothing (replicated): a layer's heads are split
    all together or not at all."""
    return axes if split else {}


def _splits(count: int, mesh: Mesh) -> bool:
    """Whether ``count`` heads split evenly over the model axis (a layer's heads are split all or none)."""
    return count % mesh.shape[MODEL] == 0


def _dense_layer(lp: DenseLayer, target: Target, mesh: Mesh) -> DenseLayer:
    c, tp = target.config, mesh.shape[MODEL]
    attn = tp > 1 and _splits(c.num_heads, mesh) and _splits(c.num_kv_heads, mesh)
    mlp = tp > 1 and c.intermediate_size % tp == 0
    lp = regroup(lp, c, tp if attn else 1, tp if mlp else 1)  # one device group per model shard
    return _place(
        lp, mesh,
        **_when(attn, qkv=COLUMNS_HEADS, qkv_bias=("heads",), o=ROWS_HEADS),
        **_when(mlp, gate_up=COLUMNS_MLP, gate_up_bias=("mlp",), down=ROWS_MLP),
    )  # fmt: skip


def _hybrid_layer(lp: hybrid.HybridLayer, config: HybridConfig, mesh: Mesh) -> hybrid.HybridLayer:
    mixer = lp.mixer
    if isinstance(mixer, gdn.GdnParams):
        split = mesh.shape[MODEL] > 1 and _splits(config.linear_num_key_heads, mesh) and _splits(config.linear_num_value_heads, mesh)
        if split:  # conv channels regrouped so each model shard holds its own q, k and v heads
            mixer = gdn.regroup(mixer, config.linear_num_key_heads, mesh.shape[MODEL])
        mixer = _place(mixer, mesh, **_when(
            split, qkv=COLUMNS_HEADS, conv=("heads", None), z=COLUMNS_HEADS, b=COLUMNS_HEADS, a=COLUMNS_HEADS,
            dt_bias=("heads",), a_log=("heads",), out=ROWS_HEADS,
        ))  # fmt: skip
    else:
        split = _splits(config.num_heads, mesh) and _splits(config.num_kv_heads, mesh)
        mixer = _place(mixer, mesh, **_when(split, q=COLUMNS_HEADS, k=COLUMNS_KV, v=COLUMNS_KV, o=ROWS_HEADS))
    return _place(lp.replace(mixer=mixer), mesh, gate=COLUMNS_MLP, up=COLUMNS_MLP, down=ROWS_MLP)


def shard_target(target: Target, mesh: Mesh) -> Target:
    """``target`` with its weights laid out on ``mesh`` (dense fused columns regrouped per model shard)."""
    params = target.params
    if isinstance(target.config, HybridConfig):
        layers = tuple(_hybrid_layer(lp, target.config, mesh) for lp in params.layers)
    else:
        layers = tuple(_dense_layer(lp, target, mesh) for lp in params.layers)
    params = _place(params.replace(layers=layers), mesh, lm_head=(None, "vocab"))
    return target.replace(params=params)


def _drafter_layer(lp: DrafterLayer, drafter: Drafter, mesh: Mesh) -> DrafterLayer:
    c = drafter.config
    split = _splits(c.num_heads, mesh) and _splits(c.num_kv_heads, mesh)
    return _place(
        lp, mesh, **_when(split, q=COLUMNS_HEADS, k=COLUMNS_KV, v=COLUMNS_KV, o=ROWS_HEADS),
        gate=COLUMNS_MLP, up=COLUMNS_MLP, down=ROWS_MLP,
    )  # fmt: skip


def shard_drafter(drafter: Drafter, mesh: Mesh) -> Drafter:
    """``drafter`` with its layers split like the target's; fc, norms and the DSpine injection replicated."""
    params = drafter.params
    layers = tuple(_drafter_layer(lp, drafter, mesh) for lp in params.layers)
    rest = _replicate(params.replace(layers=()), mesh)
    return drafter.replace(params=rest.replace(layers=layers))


def describe(tree: Any) -> dict[str, str]:
    """``{leaf path: partition spec}`` of every array in ``tree`` (what ``shard_*`` actually split)."""
    return {
        jax.tree_util.keystr(path): str(leaf.sharding.spec) if isinstance(leaf.sharding, NamedSharding) else "single device"
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }
