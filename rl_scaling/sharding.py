"""Meshes and the one table that maps logical axis names to mesh axes.

This is the only module that names physical mesh axes. Model code annotates its
parameters and activations with logical names ("embed", "mlp", "heads", ...);
`LOGICAL_RULES` says which mesh axis each one is split over. A mesh axis of size 1
costs nothing, so the same rules serve a laptop (1 device) and a pod.

Mesh axes:
  data    - pure data parallelism (replicated parameters)
  fsdp    - data parallelism with parameters and optimizer state sharded (ZeRO-3)
  tensor  - tensor (model) parallelism over heads and the MLP hidden dimension
  expert  - expert parallelism: each device holds a slice of the routed experts
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axis (or a tuple of mesh axes, or None for replicated).
LOGICAL_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("cache_length", None),
    # Dense weights are split over `expert` too: there it is one more data-parallel axis for them.
    ("embed", ("fsdp", "expert")),
    ("expert_embed", "fsdp"),  # the D axis of the routed experts, already split over `expert`
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("norm", None),
)


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with the project's axis names.

    `shape` maps axis names to sizes; missing axes get size 1, and one axis may be -1
    to absorb the remaining devices. With no shape, every device goes to `fsdp`.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = dict(shape or {"fsdp": -1})
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axis {sorted(unknown)}; valid axes are {MESH_AXES}")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {shape}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices do not divide into {shape}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh: shape {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
            f"have {len(devices)}"
        )
    device_array = np.asarray(devices).reshape(sizes)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
    spec = nn.logical_to_mesh_axes(tuple(logical_axes), LOGICAL_RULES)
    return NamedSharding(mesh, spec)


def tree_shardings(mesh: Mesh, logical_spec_tree):
    """Map a pytree of logical PartitionSpecs (from nn.get_partition_spec) to NamedShardings."""
    return nn.logical_to_mesh_sharding(logical_spec_tree, mesh, LOGICAL_RULES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading axis over the data-parallel axes, the rest replicated."""
    return logical_sharding(mesh, ("batch",) + (None,) * (ndim - 1))


def constrain(x, logical_axes: Sequence[str | None]):
    """Constrain `x` by logical axis names when a mesh is in context (inside `jit_step`, the
    dry run, `jax.set_mesh`); a no-op otherwise, so model code runs unchanged without one."""
    return nn.with_logical_constraint(x, tuple(logical_axes), rules=LOGICAL_RULES)


def tracing_mesh(mesh: Mesh | None):
    """Context for tracing a jitted function over `mesh`: `constrain` and the MoE layer's
    shard_map read it. A no-op context without a mesh."""
    if mesh is None:
        import contextlib

        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def constrain_batch(x, mesh: Mesh | None, axis: int = 0):
    """Keep `x` split over the data axes along `axis` (inside jit); no-op without a mesh."""
    if mesh is None:
        return x
    spec = [None] * x.ndim
    spec[axis] = nn.logical_to_mesh_axes(("batch",), LOGICAL_RULES)[0]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))
