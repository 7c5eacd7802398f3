"""MultiMesh's process-level calls that have nothing to do on stock JAX."""

from __future__ import annotations

from jax.experimental.custom_partitioning import custom_partitioning

__all__ = ["custom_partitioning", "shutdown"]


def shutdown() -> None:
    """MultiMesh shuts its Realm runtime down; multimesh runs on JAX's own runtime, so this does nothing."""
