"""The public API, compatible with NVIDIA's "MultiMesh for JAX":

    from multimesh.jax import parallelize, task, with_sharding_constraint
"""

from ..constraints import shard_map, with_sharding_constraint
from ..meshes import build_mesh, place_mesh, slice_mesh
from ..parallelize import ShardedFunction, parallelize
from ..report import ShardingReport
from ..rules import PathRules, RuleError, Rules, resolve, standard_rules

__all__ = [
    "parallelize",
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
    "ShardedFunction",
    "ShardingReport",
]
