"""A process's place in a multi-process run: from its arguments, else from what its launcher set.

``srun`` (SLURM), ``mpirun`` (Open MPI), a Kubernetes indexed Job and a Cloud TPU pod tell each process
its id, the process count and where process 0 is, in environment variables (or a metadata server).
`resolve_launch` takes the values given and fills the others in from there, as `jax.distributed.initialize`
would: from ``JAX_COORDINATOR_ADDRESS`` / ``JAX_LOCAL_DEVICE_IDS`` where set, then from JAX's own
detection (`multimesh._compat.clusters`), or from a Kubernetes indexed Job's variables
(``JOB_COMPLETION_INDEX``, with ``MULTIMESH_NUM_PROCESSES`` and ``JAX_COORDINATOR_ADDRESS`` set in its
pod template; JAX's own Kubernetes detection needs ``jax[k8s]`` and the right to read the pod's Job).

JAX reads the launchers' variables with bare ``int()`` and string slicing, so a variable that is
present but wrong (a rank outside the count, a node list that names no host) would fail with a bare
``ValueError`` or a coordinator address such as ``":63001"``; they are checked here first, and each
mistake is a `StartupError` naming the variable and its value.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .rollcall import StartupError, split_address

__all__ = ["INDEXED_JOB_COUNT", "Launch", "resolve_launch"]

#: the process count of a Kubernetes indexed Job (its ``parallelism``), set in the pod template
INDEXED_JOB_COUNT = "MULTIMESH_NUM_PROCESSES"


@dataclass(frozen=True)
class Launch:
    """Where this process stands: the values `jax.distributed.initialize` takes, the launcher they came
    from (None: all given as arguments), for each value where it came from (for error messages), and
    the launcher's id of this job (``job_id``: the same in all its processes, another in another job's;
    None where the launcher sets none)."""

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: list[int] | None = None
    launcher: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    job_id: str | None = None


@dataclass(frozen=True)
class _Launcher:
    """A launcher JAX detects: its name for users and the variables each value is read from."""

    name: str
    coordinator: str
    count: str
    index: str


def resolve_launch(coordinator_address: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None, local_device_ids: Sequence[int] | None = None, *,
                   method: str | None = None, timeout: int = 300) -> Launch | None:
    """The values given, with the missing ones from the environment; None where nothing was given and
    no launcher is found (a single process).

    Raises:
      StartupError: a launcher's variables are present but wrong (naming the variable and its value);
        JAX's detection failed; some values were given, and the others are found nowhere.
      ValueError: ``process_id`` given outside ``0 .. num_processes - 1`` (both given).
    """
    env = os.environ  # where JAX's detection reads them too
    sources = {k: "argument" for k, v in (("coordinator_address", coordinator_address),
                                         ("num_processes", num_processes), ("process_id", process_id),
                                         ("local_device_ids", local_device_ids)) if v is not None}
    if coordinator_address is None and env.get("JAX_COORDINATOR_ADDRESS"):
        coordinator_address = env["JAX_COORDINATOR_ADDRESS"]
        sources["coordinator_address"] = f"JAX_COORDINATOR_ADDRESS={coordinator_address!r}"
        _check_address(coordinator_address, "JAX_COORDINATOR_ADDRESS")
    if local_device_ids is None and env.get("JAX_LOCAL_DEVICE_IDS"):
        local_device_ids = _int_list(env, "JAX_LOCAL_DEVICE_IDS")
        sources["local_device_ids"] = f"JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']!r}"
    launcher = None
    if None in (coordinator_address, num_processes, process_id):
        if method is None and _indexed_job_present(env):
            launcher = "Kubernetes indexed Job"
            coordinator_address, num_processes, process_id = _from_indexed_job(
                env, coordinator_address, num_processes, process_id, sources)
        else:
            found = _detect(env, coordinator_address, num_processes, process_id, local_device_ids, method,
                            timeout, sources)
            if found is not None:
                launcher, coordinator_address, num_processes, process_id, local_device_ids = found
            else:
                _check_no_launcher_half_set(env, coordinator_address, num_processes)
    if coordinator_address is None and num_processes is None and process_id is None:
        return None
    _check_complete(coordinator_address, num_processes, process_id, sources)
    assert coordinator_address is not None and num_processes is not None and process_id is not None
    _check_place(num_processes, process_id, sources)
    if launcher is not None:  # a pod's DNS name appears only once that pod runs: wait for index 0's
        _check_resolves(coordinator_address, sources["coordinator_address"], launcher,
                        wait=timeout if launcher == "Kubernetes indexed Job" else 0)
    return Launch(coordinator_address, num_processes, process_id,
                  None if local_device_ids is None else list(local_device_ids), launcher, dict(sources),
                  job_id=launcher_job_id(env))


#: the variables in which launchers name the job (and, for SLURM, the job step) a process belongs to
JOB_ID_VARIABLES = (("SLURM_JOB_ID", "SLURM_STEP_ID"), ("PMIX_NAMESPACE",), ("OMPI_MCA_ess_base_jobid",),
                    ("JOBSET_NAME", "JOB_NAME"))


def launcher_job_id(env: Mapping[str, str]) -> str | None:
    """The launcher's name for this process's job (``srun``: ``SLURM_JOB_ID.SLURM_STEP_ID``; Open MPI's
    ``mpirun``: its PMIx namespace or job id; a JobSet: its name and job), else None."""
    for names in JOB_ID_VARIABLES:
        if env.get(names[0]):
            return ".".join(f"{name}={env[name]}" for name in names if env.get(name))
    return None


# -- JAX's detection -----------------------------------------------------------------------------------


def _detect(env: Mapping[str, str], coordinator_address: str | None, num_processes: int | None,
            process_id: int | None, local_device_ids: Sequence[int] | None, method: str | None, timeout: int,
            sources: dict[str, str]) -> tuple[str, str | None, int | None, int | None, list[int] | None] | None:
    """JAX's detection, after checking the variables it will read; fills ``sources`` in."""
    for present, check in _CHECKS:
        if present(env):
            check(env)
    from .._compat.clusters import detect

    try:
        found = detect(coordinator_address, num_processes, process_id, local_device_ids, method=method,
                       timeout=timeout)
    except Exception as e:  # noqa: BLE001 -- JAX's detection raises RuntimeError, ValueError, KeyError...
        raise StartupError(f"JAX's cluster detection failed: {type(e).__name__}: {e}; pass coordinator_address, "
                           f"num_processes and process_id (the trainer: --coordinator, --num-processes, "
                           f"--process-id) to start without it") from e
    if found is None:
        return None
    kind, coordinator, count, index, local = found
    launcher = _LAUNCHERS.get(kind, _Launcher(kind, f"JAX's {kind}", f"JAX's {kind}", f"JAX's {kind}"))
    port = f" and JAX_COORDINATOR_PORT={env['JAX_COORDINATOR_PORT']!r}" if env.get("JAX_COORDINATOR_PORT") else ""
    for key, what in (("coordinator_address", launcher.coordinator + port), ("num_processes", launcher.count),
                      ("process_id", launcher.index)):
        sources.setdefault(key, f"{launcher.name}: {_show(env, what)}")
    if local_device_ids is None and local is not None:
        sources["local_device_ids"] = f"{launcher.name}: the local process id"
    return launcher.name, coordinator, count, index, local


def _show(env: Mapping[str, str], names: str) -> str:
    """``"A='1', B='2'"`` for the variables named in ``names`` (words in capitals) that are set."""
    shown = [f"{n}={env[n]!r}" for n in re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", names) if n in env]
    return ", ".join(shown) or names


def _slurm_present(env: Mapping[str, str]) -> bool:
    """JAX's test for srun: all the variables it reads are set."""
    return all(v in env for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                                  "SLURM_LOCALID"))


#: what JAX's SLURM detection reads, all set by srun in each task of a job step
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
#: variables srun sets only in a job step's tasks (a batch script or an salloc shell has none of them)
SLURM_STEP_MARKERS = ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")


def _check_slurm(env: Mapping[str, str]) -> None:
    count = _int(env, "SLURM_NTASKS", 1)
    _int(env, "SLURM_PROCID", 0, count - 1, f"the process ids of the SLURM_NTASKS={count} tasks")
    _int(env, "SLURM_LOCALID", 0, count - 1, f"the SLURM_NTASKS={count} tasks")
    if not env.get("JAX_COORDINATOR_PORT"):
        _int(env, "SLURM_JOB_ID", 0, what="a job id (JAX derives the coordinator port from it)")
    else:
        _port(env, "JAX_COORDINATOR_PORT")
    nodes = env["SLURM_STEP_NODELIST"]
    if _first_slurm_host(nodes) is None:
        raise StartupError(f"SLURM_STEP_NODELIST={nodes!r} names no host: the coordinator (process 0) is the first "
                           f"node of the step's node list, as srun sets it (e.g. 'node01' or 'node[01-04]')")


def _first_slurm_host(nodes: str) -> str | None:
    """The first host of a SLURM node list (``node[001-004,007],gpu2`` -> ``node001``), None if it names none."""
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[(\d+)[^\]]*\])?(?:,.*)?", nodes.strip())
    return None if m is None else f"{m[1]}{m[2] or ''}"


def _ompi_present(env: Mapping[str, str]) -> bool:
    """JAX's test for mpirun of Open MPI 4 (ORTE); Open MPI 5 goes through mpi4py in JAX."""
    return "OMPI_MCA_orte_hnp_uri" in env


#: what JAX's Open MPI detection reads besides the launcher's address (OMPI_MCA_orte_hnp_uri, Open MPI 4)
OMPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


def _check_ompi(env: Mapping[str, str]) -> None:
    _require(env, OMPI_VARIABLES, "Open MPI's mpirun (OMPI_MCA_orte_hnp_uri is set)")
    count = _int(env, "OMPI_COMM_WORLD_SIZE", 1)
    _int(env, "OMPI_COMM_WORLD_RANK", 0, count - 1, f"the ranks of the OMPI_COMM_WORLD_SIZE={count} processes")
    _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, count - 1, f"the OMPI_COMM_WORLD_SIZE={count} processes")
    uri = env["OMPI_MCA_orte_hnp_uri"]
    if not re.match(r"\d+(\.\d+)?;.*(tcp://[^,:;]+|tcp6://\[[^,\]]+)", uri):
        raise StartupError(f"OMPI_MCA_orte_hnp_uri={uri!r} names no launcher address ('JOBID.0;tcp://IP:PORT', "
                           f"as mpirun sets it): JAX takes the coordinator's host from it")
    if env.get("JAX_COORDINATOR_PORT"):
        _port(env, "JAX_COORDINATOR_PORT")


#: the variables JAX reads for each launcher, checked before it reads them
_CHECKS = [(_slurm_present, _check_slurm), (_ompi_present, _check_ompi)]

#: JAX's cluster environments, by class name
_LAUNCHERS = {
    "SlurmCluster": _Launcher("SLURM", "the first host of SLURM_STEP_NODELIST, a port from SLURM_JOB_ID",
                              "SLURM_NTASKS", "SLURM_PROCID"),
    "OmpiCluster": _Launcher("Open MPI", "the launcher's host in OMPI_MCA_orte_hnp_uri, a port from its job id",
                             "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    "GkeTpuCluster": _Launcher("Cloud TPU (GKE)", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"),
    "GceTpuCluster": _Launcher("Cloud TPU", "the TPU VM's metadata", "the TPU VM's metadata",
                               "the TPU VM's metadata"),
    "K8sCluster": _Launcher("Kubernetes", "the Job's headless service", "the Job's parallelism",
                            "JOB_COMPLETION_INDEX"),
    "Mpi4pyCluster": _Launcher("MPI (mpi4py)", "rank 0's host name", "MPI_COMM_WORLD's size",
                               "MPI_COMM_WORLD's rank"),
}


def _require(env: Mapping[str, str], names: Sequence[str], launcher: str) -> None:
    """A `StartupError` naming those of ``names`` that are not set, where ``launcher`` set the others."""
    missing = [n for n in names if n not in env]
    if missing:
        seen = ", ".join(f"{n}={env[n]!r}" for n in names if n in env)
        raise StartupError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, though "
                           f"{launcher} started this process ({seen or 'none of the others'}): JAX reads "
                           f"{', '.join(names)} for its place; set {'it' if len(missing) == 1 else 'them'} as "
                           f"the launcher does, or give coordinator_address, num_processes and process_id (the "
                           f"trainer: --coordinator, --num-processes, --process-id)")


def _check_no_launcher_half_set(env: Mapping[str, str], coordinator_address: str | None,
                                num_processes: int | None) -> None:
    """JAX found no launcher: a `StartupError` where a launcher's variables are there, but not all of them
    (else the run would go on as one process, or say only that no launcher was found)."""
    step = [n for n in SLURM_STEP_MARKERS if n in env]
    if step and "SLURM_JOB_ID" in env:
        _require(env, SLURM_VARIABLES, f"srun (in a job step: {', '.join(step)} set)")
    pmix = [n for n in env if n.startswith("PMIX_")]
    if pmix:
        seen = ", ".join(f"{n}={env[n]!r}" for n in sorted(pmix)[:4] + [n for n in OMPI_VARIABLES if n in env])
        missing = " and ".join(n for n in OMPI_VARIABLES if n not in env)
        raise StartupError(f"a PMIx launcher (Open MPI 5's mpirun or prterun) started this process ({seen}), but "
                           f"{missing} {'is' if ' and ' not in missing else 'are'} not set, so JAX detects no "
                           f"Open MPI run; JAX reads an Open MPI 5 or PMIx run's place through mpi4py: install "
                           f"mpi4py and pass cluster_detection_method='mpi4py', or give coordinator_address, "
                           f"num_processes and process_id (the trainer: --coordinator, --num-processes, "
                           f"--process-id)")
    if "JOB_COMPLETION_INDEX" in env and num_processes is None and coordinator_address is not None:
        raise StartupError(f"a Kubernetes indexed Job's pod (JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']!r}) "
                           f"with a coordinator ({coordinator_address!r}) but no process count: "
                           f"{INDEXED_JOB_COUNT} is not set; set it in the pod template to the "
                           f"Job's parallelism (its number of pods), or give num_processes (the trainer: "
                           f"--num-processes)")


# -- a Kubernetes indexed Job, by its variables -----------------------------------------------------------


def _indexed_job_present(env: Mapping[str, str]) -> bool:
    return "JOB_COMPLETION_INDEX" in env and INDEXED_JOB_COUNT in env


def _from_indexed_job(env: Mapping[str, str], coordinator_address: str | None, num_processes: int | None,
                      process_id: int | None, sources: dict[str, str]) -> tuple[str | None, int, int]:
    """A pod of an indexed Job (a JobSet's): its index, the count its template sets, JAX_COORDINATOR_ADDRESS."""
    if num_processes is None:
        num_processes = _int(env, INDEXED_JOB_COUNT, 1, what="the Job's parallelism (its number of pods)")
        sources["num_processes"] = f"{INDEXED_JOB_COUNT}={env[INDEXED_JOB_COUNT]!r}"
    if process_id is None:
        process_id = _int(env, "JOB_COMPLETION_INDEX", 0, num_processes - 1,
                          f"the indexes of the {num_processes} pods ({sources['num_processes']})")
        sources["process_id"] = f"JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']!r}"
    if coordinator_address is None:
        raise StartupError(f"a Kubernetes indexed Job's pod (JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']!r}, "
                           f"{INDEXED_JOB_COUNT}={env[INDEXED_JOB_COUNT]!r}) needs JAX_COORDINATOR_ADDRESS=HOST:PORT "
                           f"in its template: the pod of index 0, e.g. JOBSET-REPLICATEDJOB-0-0.JOBSET:1234 in a "
                           f"JobSet (its headless service names the pods so)")
    return coordinator_address, num_processes, process_id


# -- checks ----------------------------------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str, low: int, high: int | None = None, what: str = "") -> int:
    """Variable ``name`` as an integer in ``low .. high``; else a `StartupError` naming it and its value."""
    text = env.get(name)
    if text is None:
        raise StartupError(f"{name} is not set" + (f" ({what})" if what else "")
                           + ": the launcher's variables are incomplete")
    try:
        value = int(text.strip())
    except ValueError:
        problem = "is not an integer"
    else:
        if low <= value and (high is None or value <= high):
            return value
        problem = f"is outside {low}..{high}" if high is not None else f"is below {low}"
    raise StartupError(f"{name}={text!r} {problem}" + (f" ({what})" if what else "")
                       + ": the launcher's variables do not fit together")


def _port(env: Mapping[str, str], name: str) -> None:
    _int(env, name, 1, 65535, "a TCP port")


def _int_list(env: Mapping[str, str], name: str) -> list[int]:
    try:
        return [int(x) for x in env[name].split(",")]
    except ValueError:
        raise StartupError(f"{name}={env[name]!r} is not a comma-separated list of device ids") from None


def _check_address(address: str, name: str) -> None:
    try:
        split_address(address)
    except ValueError:
        raise StartupError(f"{name}={address!r} is not HOST:PORT (process 0's host, and a port in 1..65535)") from None


def _check_complete(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
                    sources: Mapping[str, str]) -> None:
    missing = [k for k, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                              ("process_id", process_id)) if v is None]
    if missing:
        given = ", ".join(f"{k} ({v})" for k, v in sources.items()) or "nothing"
        raise StartupError(f"{' and '.join(missing)} not given, and no launcher found that sets them (srun, "
                           f"mpirun, a Kubernetes indexed Job, a Cloud TPU pod); given: {given}. Give all three "
                           f"(the trainer: --coordinator HOST:PORT --num-processes N --process-id I)")


def _check_place(num_processes: int, process_id: int, sources: Mapping[str, str]) -> None:
    if num_processes < 1 or not 0 <= process_id < num_processes:
        if sources.get("num_processes") == sources.get("process_id") == "argument":
            raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id}")
        raise StartupError(f"process_id {process_id} ({sources['process_id']}) is outside 0..{num_processes - 1}: "
                           f"num_processes is {num_processes} ({sources['num_processes']})")


def _check_resolves(address: str, source: str, launcher: str, wait: float) -> None:
    """The coordinator's host resolves, within ``wait`` seconds; else a `StartupError` naming its source."""
    host, _ = split_address(address)
    deadline = time.monotonic() + wait
    while True:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return
        except socket.gaierror as e:
            if time.monotonic() >= deadline:
                waited = f" within {wait:g} s" if wait else ""
                raise StartupError(f"{launcher}: the coordinator's host {host!r} (from {source}) does not resolve"
                                   f"{waited} ({e.strerror})") from None
            time.sleep(1.0)
