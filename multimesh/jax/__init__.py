"""The public API, compatible with NVIDIA's "MultiMesh for JAX":

    from multimesh.jax import parallelize, task, with_sharding_constraint
"""

from .._version import __version__
from ..autolayout import LayoutSearch, ParallelLayout, auto_layout, stage_task
from ..core.meshes import build_mesh, place_mesh, slice_mesh
from ..core.report import ShardingReport
from ..core.rules import PathRules, RuleError, Rules, RuleWarning, named_rules, resolve, standard_rules
from ..estimate import Estimate, HardwareProfile, estimate
from ..parallelize import parallelize  # the front door: on a mesh, or layout="auto" (the search below it)
from ..run.checks import DonatedArrayError, StepInputError
from ..run.initializers import ShardedInitializer
from ..run.mjit import MJitFunction, mjit
from ..run.mpmd import MPMDFunction
from ..run.parallelize import (
    BatchStep,
    ParallelizeResult,
    ShardedFunction,
    StepAndInit,
    StepFunctions,
    StepOnly,
)
from ..schedules import (
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ZeroBubbleH1,
    ZeroBubbleH2,
    get_schedule,
)
from ..trace.constraints import shard_map, with_sharding_constraint
from ..trace.context import Context, MultiMesh, tasks
from ..trace.implicit import (
    MatchedName,
    clear_tasks,
    register_task,
    registered_tasks,
    task_scope,
)
from ..trace.knobs import (
    autoshard,
    context,
    enable_fast_path,
    enable_recomputation,
    enable_task_fusion,
    only_fuse_loop_tasks,
)
from ..trace.lifecycle import custom_partitioning, shutdown
from ..trace.microbatch import MicrobatchMeanWarning, microbatch
from ..trace.scope_mesh import mesh_in_scope, resolve_in_scope
from ..trace.stage_shard_map import StageAxisDropped, StageAxisError
from ..trace.task import ignore_transforms, task
from ..trace.taskspec import Task, TaskMesh, slice_global_mesh

__all__ = [
    "Context",
    "DonatedArrayError",
    "Estimate",
    "GPipe",
    "HardwareProfile",
    "ParallelLayout",
    "LayoutSearch",
    "Interleaved1F1B",
    "BatchStep",
    "ParallelizeResult",
    "MJitFunction",
    "MPMDFunction",
    "MatchedName",
    "MicrobatchMeanWarning",
    "MultiMesh",
    "OneFOneB",
    "PathRules",
    "RuleError",
    "RuleWarning",
    "Rules",
    "Schedule",
    "ShardedFunction",
    "ShardedInitializer",
    "ShardingReport",
    "StepAndInit",
    "StepFunctions",
    "StepOnly",
    "StageAxisDropped",
    "StageAxisError",
    "StepInputError",
    "Task",
    "TaskMesh",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "__version__",
    "auto_layout",
    "autoshard",
    "build_mesh",
    "clear_tasks",
    "context",
    "custom_partitioning",
    "enable_fast_path",
    "enable_recomputation",
    "enable_task_fusion",
    "estimate",
    "get_schedule",
    "ignore_transforms",
    "mesh_in_scope",
    "microbatch",
    "mjit",
    "named_rules",
    "only_fuse_loop_tasks",
    "parallelize",
    "place_mesh",
    "register_task",
    "registered_tasks",
    "resolve",
    "resolve_in_scope",
    "shard_map",
    "shutdown",
    "slice_global_mesh",
    "slice_mesh",
    "stage_task",
    "standard_rules",
    "task",
    "task_scope",
    "tasks",
    "with_sharding_constraint",
]
