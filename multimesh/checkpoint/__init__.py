"""Sharded, asynchronous, atomic checkpoints over orbax-checkpoint 0.12.

    from multimesh.checkpoint import CheckpointManager, abstract_target

    with CheckpointManager("ckpts", max_to_keep=3) as mgr:
        mgr.save(step, state, metadata={"model": cfg}, data_position=batch_index)
        ...
        target = abstract_target(jax.eval_shape(init), new_shardings)
        restored = mgr.restore(target=target)   # latest step, onto the new layout
        state, pos = restored.state, restored.data_position

Restoring never reuses the saved layout: the target says where every leaf goes
(any mesh, device count or set of submeshes). ``python -m
multimesh.checkpoint.inspect DIR [STEP]`` (or ``multimesh-ckpt``) lists and
describes checkpoints.
"""

from .errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointMismatchError,
)
from .jsonsafe import to_json_safe
from .manager import CheckpointInfo, CheckpointManager, Restored
from .tree import LeafRecord, MeshRecord, abstract_target

__all__ = [
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "LeafRecord",
    "MeshRecord",
    "Restored",
    "abstract_target",
    "to_json_safe",
]
