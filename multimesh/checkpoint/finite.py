"""Restored values that are NaN or infinite: which leaves hold them, and the warning that names them.

A checkpoint saved after training diverged restores without error (its
checksums match: the NaNs were saved faithfully) and would go on producing
NaN. ``CheckpointManager.restore`` therefore looks at the restored
floating-point leaves, shard by shard: a CPU shard in place with NumPy (no
compilation), an accelerator shard by one small reduction on its device, the
answers fetched in one transfer. Each process looks at its own shards (a
replicated shard once), so no process waits for another; each warns about
what it holds.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .tree import PyTree, is_prng_key, leaves_with_paths

__all__ = ["NonFiniteCheckpointWarning", "nonfinite_leaves", "warn_if_nonfinite"]

#: At most this many leaf paths are spelled out in the warning.
_NAMED = 5


class NonFiniteCheckpointWarning(RuntimeWarning):
    """A restored checkpoint holds NaN or infinite values (named by leaf path)."""


@functools.cache
def _any_nonfinite():
    return jax.jit(lambda x: jnp.any(~jnp.isfinite(x)))


def nonfinite_leaves(state: PyTree) -> list[str]:
    """The paths of ``state``'s floating-point ``jax.Array`` leaves that hold a NaN or an infinity
    in a shard this process holds."""
    pending: list[tuple[str, jax.Array | bool]] = []
    for path, x in leaves_with_paths(state):
        if not isinstance(x, jax.Array) or is_prng_key(x.dtype) or not jnp.issubdtype(x.dtype, jnp.inexact):
            continue
        for s in x.addressable_shards:
            if s.replica_id == 0:
                on_host = s.device.platform == "cpu"
                pending.append((path, not np.isfinite(np.asarray(s.data)).all() if on_host
                                else _any_nonfinite()(s.data)))
    flags = jax.device_get([flag for _, flag in pending])
    return list(dict.fromkeys(path for (path, _), bad in zip(pending, flags) if bad))


def warn_if_nonfinite(state: PyTree, step: int, path: str) -> None:
    """Warn (``NonFiniteCheckpointWarning``) naming the leaves of restored ``state`` that hold NaN or inf."""
    bad = nonfinite_leaves(state)
    if not bad:
        return
    named = ", ".join(bad[:_NAMED]) + (f" and {len(bad) - _NAMED} more" if len(bad) > _NAMED else "")
    warnings.warn(
        f"checkpoint step {step} ({path}) holds NaN or infinite values in {len(bad)} leaf/leaves: {named}; "
        f"it was probably saved after training diverged: restore an earlier step (all_steps() lists them)",
        NonFiniteCheckpointWarning, stacklevel=3)
