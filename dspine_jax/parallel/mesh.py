"""The device mesh: ``data`` × ``model`` axes, logical-axis rules, and the two primitives the model code uses.

Everything runs on JAX's own SPMD machinery (GSPMD): weights are placed with ``NamedSharding``s (see
``sharding.py``), caches are created under ``constrain``, and XLA propagates the layout through the jitted
programs, inserting the collectives (one all-reduce after each row-parallel projection, Megatron-style).
With no mesh active both primitives are the identity, so single-device code pays nothing.

Logical axes (the names the model code speaks) map to mesh axes through ``RULES``. A dimension is only
split when it divides evenly by the mesh axis; otherwise it is replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import struct
from jax import Array
from jax.sharding import AxisType, Mesh, PartitionSpec

from dspine_jax.parallel import distributed

DATA, MODEL = "data", "model"

# Logical axis → mesh axis. Heads, KV heads, MLP width and the LM-head vocabulary are split over ``model``
# (tensor parallelism); the batch over ``data`` (data parallelism). Unlisted names are replicated.
RULES: dict[str, str] = {
    "batch": DATA,
    "heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
}

Axes = Sequence[str | None]  # one logical name (or None = replicated) per array dimension


def weight(*axes: str | None, group: str | None = None, default: Any = dataclasses.MISSING) -> Any:
    """A params-dataclass field that declares its array's logical ``axes`` (one per dimension) next to the
    shape comment, so ``sharding.place`` needs no list of field names.

    ``group`` names weights that split together or not at all (a layer's heads: q, k, v and o); the
    layer's ``for_mesh(config, model_shards)`` (see ``sharding.py``) says which groups split on a given mesh. Weights
    without a group split whenever their dimensions divide (``logical_spec``)."""
    metadata = {"axes": tuple(axes), "group": group}
    return struct.field(metadata=metadata, default=default)


def make_mesh(tp: int = 1, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data=dp, model=tp)`` mesh over the first ``dp·tp`` devices (all of them by default order).

    For several hosts, call ``jax.distributed.initialize()`` first; ``jax.devices()`` then lists every
    host's devices and the same mesh spans them (put ``model`` within a host: it carries the all-reduces).
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"--tp and --dp must be >= 1 (got tp={tp}, dp={dp})")
    devices = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devices):
        raise ValueError(
            f"a {dp}x{tp} (data x model) mesh needs {tp * dp} devices, but only {len(devices)} "
            f"{devices[0].platform.upper()} device(s) are visible"
        )
    return jax.make_mesh(
        (dp, tp), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[: tp * dp]
    )


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Trace and run under ``mesh`` (``None``: a no-op). The mesh is part of the trace context, so a
    function jitted without a mesh is re-traced (not reused) under one. Thread-local, like JAX's config."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def _active_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def logical_spec(shape: Sequence[int], axes: Axes, mesh_shape: dict[str, int]) -> PartitionSpec:
    """``PartitionSpec`` for an array of ``shape`` whose dimensions have logical ``axes``: each named dim goes
    to its mesh axis if that axis has >1 device and divides the dim, else it is replicated."""
    if len(axes) != len(shape):
        raise ValueError(f"{len(axes)} logical axes {tuple(axes)} for an array of shape {tuple(shape)}")
    entries = []
    for size, name in zip(shape, axes):
        mesh_axis = RULES.get(name) if name else None
        splits = mesh_shape.get(mesh_axis, 1) if mesh_axis else 1
        entries.append(mesh_axis if splits > 1 and size % splits == 0 else None)
    return PartitionSpec(*entries)


def constrain(x: Array, axes: Axes) -> Array:
    """Pin ``x``'s layout to its logical ``axes`` under the active mesh (identity without one)."""
    mesh = _active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(x.shape, axes, dict(mesh.shape)))


def per_device(fn: Callable[..., Array], in_axes: Sequence[Axes | None], out_axes: Axes) -> Callable[..., Array]:
    """Run ``fn`` (a Pallas kernel: a per-device program) on each device's shard via ``jax.shard_map``.

    ``in_axes``: logical axes per positional argument (``None``: a replicated pytree, e.g. weights).
    A mesh axis is used only if every input dimension mapped to it divides evenly, so related operands
    are split together or not at all; output dimensions follow their inputs'. Without an active mesh,
    ``fn`` itself.
    """

    def wrapped(*args: Any) -> Array:
        mesh = _active_mesh()
        if mesh is None:
            return fn(*args)
        mesh_shape = dict(mesh.shape)
        # A mesh axis is used only if every input dimension mapped to it divides evenly: query heads and
        # the KV heads they read are split together or not at all.
        blocked = {
            RULES[name]
            for arg, axes in zip(args, in_axes)
            if axes is not None
            for size, name in zip(arg.shape, axes)
            if name in RULES and size % mesh_shape[RULES[name]]
        }

        def spec(axes: Axes) -> PartitionSpec:
            return PartitionSpec(*(
                RULES[name] if name in RULES and RULES[name] not in blocked and mesh_shape[RULES[name]] > 1 else None
                for name in axes
            ))  # fmt: skip

        in_specs = tuple(PartitionSpec() if axes is None else spec(axes) for axes in in_axes)
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec(out_axes), check_vma=False)(*args)

    return wrapped


def make_run_mesh(tp: int, dp: int) -> Mesh | None:
    """The ``data`` × ``model`` mesh of ``--tp`` / ``--dp`` (None: one device). With several processes it must
    cover every process's devices: a process with no device in the mesh could not take part."""
    if not distributed.multiprocess():
        return make_mesh(tp=tp, dp=dp) if (tp, dp) != (1, 1) else None
    if tp * dp != jax.device_count():
        raise ValueError(f"{jax.process_count()} processes hold {jax.device_count()} devices "
                         f"({jax.local_device_count()} each): --tp {tp} x --dp {dp} must use all of them")  # fmt: skip
    return make_mesh(tp=tp, dp=dp)
