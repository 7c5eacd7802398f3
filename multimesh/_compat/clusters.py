"""JAX's own cluster detection: which launcher started this process, and what it says.

`jax.distributed.initialize()` with no arguments finds the coordinator, the process count, the process
id and the local devices on SLURM, Open MPI, Kubernetes (with ``jax[k8s]``), Cloud TPU and mpi4py by
itself, but offers no public way to read them before it starts; multimesh needs them earlier (its roll
call listens on the coordinator's port before JAX does). So this module asks JAX's private
``jax._src.clusters.ClusterEnv``, and nothing else in multimesh does.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax._src.clusters import ClusterEnv

__all__ = ["detect"]


def detect(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
           local_device_ids: Sequence[int] | None, *, method: str | None,
           timeout: int) -> tuple[str, str | None, int | None, int | None, list[int] | None] | None:
    """``(environment, coordinator_address, num_processes, process_id, local_device_ids)`` where JAX
    detects a cluster environment (``method``: JAX's ``cluster_detection_method``, e.g. ``"mpi4py"``;
    None: the environments JAX looks for by default), with the values given kept as JAX keeps them;
    None where it detects none. ``environment`` is JAX's name for it (``"SlurmCluster"``, ...)."""
    kinds = [k for k in ClusterEnv._cluster_types
             if (k.name == method if method is not None else not k.opt_in_only_method)]
    found = next((k for k in kinds if k.is_env_present()), None)
    if found is None:
        return None
    coordinator, count, index, local = ClusterEnv.auto_detect_unset_distributed_params(
        coordinator_address, num_processes, process_id, local_device_ids, method, timeout)
    return found.__name__, coordinator, count, index, None if local is None else list(local)
