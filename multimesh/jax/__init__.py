"""The public API, compatible with NVIDIA's "MultiMesh for JAX":

    from multimesh.jax import parallelize, task, with_sharding_constraint
"""

from ..constraints import shard_map, with_sharding_constraint
from ..meshes import build_mesh, place_mesh, slice_mesh
from ..mpmd import (
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    clear_tasks,
    get_schedule,
    ignore_transforms,
    microbatch,
    register_task,
    registered_tasks,
    task,
    task_scope,
)
from ..mpmd.function import MPMDFunction
from ..parallelize import ShardedFunction, parallelize
from ..report import ShardingReport
from ..rules import PathRules, RuleError, Rules, resolve, standard_rules

__all__ = [
    "parallelize",
    "task",
    "microbatch",
    "register_task",
    "clear_tasks",
    "task_scope",
    "registered_tasks",
    "ignore_transforms",
    "with_sharding_constraint",
    "shard_map",
    "Rules",
    "PathRules",
    "RuleError",
    "resolve",
    "standard_rules",
    "build_mesh",
    "slice_mesh",
    "place_mesh",
    "Schedule",
    "GPipe",
    "OneFOneB",
    "Interleaved1F1B",
    "get_schedule",
    "ShardedFunction",
    "MPMDFunction",
    "ShardingReport",
]
