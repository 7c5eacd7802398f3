"""The public API, compatible with NVIDIA's "MultiMesh for JAX":

    from multimesh.jax import parallelize, task, with_sharding_constraint
"""

from ..core.meshes import build_mesh, place_mesh, slice_mesh
from ..core.report import ShardingReport
from ..core.rules import PathRules, RuleError, Rules, resolve, standard_rules
from ..core.schedules import (
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ZeroBubbleH1,
    ZeroBubbleH2,
    get_schedule,
)
from ..run.mpmd import MPMDFunction
from ..run.parallelize import ShardedFunction, parallelize
from ..trace.constraints import shard_map, with_sharding_constraint
from ..trace.implicit import (
    MatchedName,
    clear_tasks,
    register_task,
    registered_tasks,
    task_scope,
)
from ..trace.microbatch import microbatch
from ..trace.task import ignore_transforms, task
from ..trace.taskspec import Task, TaskMesh, slice_global_mesh

__all__ = [
    "GPipe",
    "Interleaved1F1B",
    "MPMDFunction",
    "MatchedName",
    "OneFOneB",
    "PathRules",
    "RuleError",
    "Rules",
    "Schedule",
    "ShardedFunction",
    "ShardingReport",
    "Task",
    "TaskMesh",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
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
    "slice_global_mesh",
    "slice_mesh",
    "standard_rules",
    "task",
    "task_scope",
    "with_sharding_constraint",
]
