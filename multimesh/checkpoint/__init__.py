"""Sharded, asynchronous, atomic checkpoints over orbax-checkpoint 0.12.

    from multimesh.checkpoint import CheckpointManager, abstract_target

    with CheckpointManager("ckpts", max_to_keep=3) as mgr:
        mgr.save(step, state, metadata={"model": cfg}, data_position=batch_index)
        ...
        target = abstract_target(jax.eval_shape(init), new_shardings)
        restored = mgr.restore(target=target)   # latest step, onto the new layout
        state, pos = restored.state, restored.data_position

Restoring never reuses the saved layout: the target says where every leaf goes
(any mesh, device count or set of submeshes). With ``parallelize``, the new
step function's ``abstract_params`` is that target, built from our rules on the
new mesh or task layout; the function itself may be passed instead:

    step_fn, init, get_batch = multimesh.parallelize(
        train_step, init_params=init_state, get_input_batch=batch,
        mesh={"data": 8, "model": 1}, rules=rules)      # any new layout, or tasks
    restored = mgr.restore(step, target=step_fn.abstract_params)  # or target=step_fn
    state = restored.state                              # feeds step_fn as is

Every leaf gets a layout-independent checksum (``checksum.py``), computed
while the arrays are written and verified while they are read back, so a
flipped byte in the data is an error, not a silent change (``checksums=False``
turns it off). Chunks are stored uncompressed unless ``compression=True``.
A restored state holding NaN or infinite values warns
(``NonFiniteCheckpointWarning``), naming the leaves.

``python -m multimesh.checkpoint.inspect DIR [STEP]`` (or ``multimesh-ckpt``)
lists and describes checkpoints.
"""

from .errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointSaveError,
)
from .finite import NonFiniteCheckpointWarning
from .jsonsafe import to_json_safe
from .manager import CheckpointInfo, CheckpointManager, Restored
from .tree import LeafRecord, MeshRecord, abstract_target

__all__ = [
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "LeafRecord",
    "MeshRecord",
    "NonFiniteCheckpointWarning",
    "Restored",
    "abstract_target",
    "to_json_safe",
]
