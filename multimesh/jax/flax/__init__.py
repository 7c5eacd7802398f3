"""Flax adapters: logical-name initializers, metadata readers, and `parallelize_step`.

Flax Linen (`nn.with_partitioning`, `nn.with_logical_partitioning`,
`LogicallyPartitioned`) and Flax NNX (`nnx.with_partitioning`, variable
metadata ``out_sharding`` / ``sharding_names`` / ``sharding``) annotations
are read by the same rule engine as everything else. `functional_step` turns an
NNX step that updates ``(model, optimizer)`` in place into `parallelize`'s form.
"""

from ...core.metadata import Annotation, is_box, read_box
from ...flax.nnx_bridge import functional_step
from ...flax.step import parallelize_step, shard_axes
from ...flax.task import linen_task as task
from ...trace.constraints import with_sharding_constraint

__all__ = ["Annotation", "functional_step", "is_box", "parallelize_step", "read_box", "shard_axes", "task",
           "with_sharding_constraint"]
