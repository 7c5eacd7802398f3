"""The mesh that model code runs on where it is called: what a `shard_map` without ``mesh=`` uses."""

from __future__ import annotations

from jax.sharding import Mesh, PartitionSpec

from ..core.placement import Placement, current_placement
from .implicit import placement_in_scope
from .taskspec import current_global_mesh

__all__ = ["mesh_in_scope", "resolve_in_scope"]


def mesh_in_scope() -> Mesh | None:
    """The mesh in force where it is called, as `shard_map` without ``mesh=`` finds it.

    Inside the scope of a registered task (a Flax module, a named scope or an NNX path that
    `register_task` matches): that task's submesh. Else, while `parallelize` or a task traces
    the code: its mesh. Else the `MultiMesh` in force, or JAX's mesh in context
    (``jax.set_mesh``). None when there is none: the code runs on one device, as a reference.

    Model code reads it to choose a parallel path, e.g. an expert-parallel layer that
    dispatches tokens with an all-to-all over the mesh's ``expert`` axis, or computes every
    expert locally when the mesh has no such axis::

        mesh = mesh_in_scope()
        if mesh is not None and mesh.shape.get("expert", 1) > 1:
            ...  # shard_map(..., in_specs=..., out_specs=...) with jax.lax.all_to_all over "expert"
    """
    placement = _placement_here()
    if placement is not None:
        return placement.mesh
    return current_global_mesh()


def resolve_in_scope(spec: PartitionSpec) -> PartitionSpec:
    """The mesh axes that the rules in force where it is called give the logical ``spec``: what a
    `shard_map` without ``mesh=`` resolves its specs to there (a registered task's rules inside its
    scope, else the step's). Without rules in force (one device, a plain JAX mesh), ``spec`` itself.

    Model code that runs a `shard_map` of logical specs reads it to name the mesh axes of its
    collectives, e.g. those a tensor-parallel layer sums its partial outputs over::

        axes = resolve_in_scope(PartitionSpec("mlp"))[0]  # 'tensor' under standard_rules; None: unsplit
        ...  # inside the shard_map: jax.lax.psum(partial, axes)
    """
    placement = _placement_here()
    return spec if placement is None else placement.spec(tuple(spec))


def _placement_here() -> Placement | None:
    """The placement in force where the code is traced: a registered task's inside its scope."""
    placement = current_placement()
    if placement is None or placement.defer:
        placement = placement_in_scope() or placement
    return placement
