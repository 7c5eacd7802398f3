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
    "GPipe",
    "Interleaved1F1B",
    "MPMDFunction",
    "OneFOneB",
    "PathRules",
    "RuleError",
    "Rules",
    "Schedule",
    "ShardedFunction",
    "ShardingReport",
    "build_mesh",
    "clear_tasks",
    "get_schedule",
    "ignore_transforms",
    "microbatch",
    "parallelize",
    "place_mesh",
    "register_task",
    "registered_tasks",
    "resolve",
    "shard_map",
    "slice_mesh",
    "standard_rules",
    "task",
    "task_scope",
    "with_sharding_constraint",
]
