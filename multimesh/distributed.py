"""Start one process of a multi-process run (multi-controller JAX).

Every process runs the same program; call `initialize` in each, before any
other JAX call. Under a launcher (``srun``, ``mpirun``, a Kubernetes indexed
Job, a Cloud TPU pod) ``initialize()`` needs no arguments: the coordinator,
the process count and id come from the launcher's variables, read by JAX's
own detection (`multimesh.startup.launch`); arguments given win. It wraps
`jax.distributed.initialize` and sets what multimesh's runtime needs:

* CPU collectives across processes (gloo), so an SPMD program (a stage) may
  span processes; GPUs keep JAX's defaults; gloo's connection notices, which
  it prints on stdout from every process, are filtered out
  (`multimesh.startup.gloo_notices`), so they neither cut a progress bar nor
  fill the terminal;
* JAX's cross-host device transfers (``jax_cross_host_transfer_socket_address``),
  so pipeline stages may sit on different processes and hosts: each process
  listens on a free port of the address other processes reach it at;
* a roll call before JAX starts (`multimesh.startup.rollcall`): process 0 waits on the coordinator port
  for the others, naming the missing ones every 10 s, and every start-up mistake (a process that does
  not arrive within ``initialization_timeout``, a duplicate id, different process counts, a port held
  by another program, an unresolvable or unreachable coordinator) ends every process with a
  `StartupError` naming the address, ids or counts; a process of another run (another ``run_id``) is
  refused, so two runs given one port never join; then all processes check that they run the same
  multimesh (`agree`: version and a digest of its source);
* failure handling: every process holds a connection to process 0 for the
  run (`multimesh.core.presence`), so when a process dies the others know at
  once and stop within seconds with a `ProcessLostError` naming it (before
  JAX's coordination service would abort them at ``heartbeat_timeout_seconds``),
  instead of waiting forever for its transfers; and an uncaught exception ends
  its process at once (``exit_on_error``) rather than letting it wait at JAX's
  shutdown barrier while the others wait for it.

Plain `jax.distributed.initialize` works too when these flags are set before
it: ``jax.config.update("jax_cpu_collectives_implementation", "gloo")`` and
``jax.config.update("jax_cross_host_transfer_socket_address", "HOST:PORT")``
with a port free on each process's host, and kept from other processes until
JAX binds it (a fixed port, or `reserve_port()`).
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from types import TracebackType
from typing import Any

import jax

from ._version import __version__
from .core import presence
from .core.processes import ProcessLostError, exception_chain, heartbeat_timeout, lost_process_error
from .startup import ports
from .startup.agreement import DisagreementError, agree, source_digest
from .startup.coordinator_relay import relay_to
from .startup.gloo_notices import drop_gloo_notices
from .startup.launch import Launch, resolve_launch
from .startup.rollcall import StartupError, roll_call, split_address

__all__ = ["DisagreementError", "Launch", "ProcessLostError", "StartupError", "agree", "find_launch", "initialize",
           "is_initialized", "reserve_port"]

_started: dict[str, Any] | None = None  # the arguments this process joined its run with

RUN_ID_VARIABLE = "MULTIMESH_RUN_ID"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: int | list[int] | None = None,
               transfer_address: str | None = None, transfer_port: int | str | None = None,
               heartbeat_timeout_seconds: int = 30,
               initialization_timeout: int = 300, exit_on_error: bool = True,
               cluster_detection_method: str | None = None, run_id: str | None = None) -> None:
    """Join the run of ``num_processes`` processes coordinated by process 0 at ``coordinator_address``.

    Args:
      coordinator_address: ``"HOST:PORT"`` where process 0 serves the coordination service (default:
        ``JAX_COORDINATOR_ADDRESS``, else the launcher's: see `find_launch`).
      num_processes: how many processes take part (default: the launcher's).
      process_id: this process, in ``0 .. num_processes - 1`` (default: the launcher's).
      local_device_ids: restrict this process to some of its local devices (as in JAX; default
        ``JAX_LOCAL_DEVICE_IDS``, else JAX's choice: under srun and mpirun one GPU per process, the
        process's local rank).
      transfer_address: ``"HOST:PORT"`` this process receives cross-host transfers on (default:
        the address it reaches the coordinator from, on ``transfer_port``).
      transfer_port: the port of that default address: a port (``9100``) or a range (``"9100-9163"``, for
        clusters that open a fixed range between hosts), this process taking the first port of it that no
        other socket on its host holds; default: any free port.
      heartbeat_timeout_seconds: how long the others wait for a process that stopped answering.
      initialization_timeout: how long to wait for every process to join (seconds); while waiting, each
        process prints every 10 s which processes it waits for, then raises `StartupError` naming them.
      exit_on_error: an uncaught exception prints its traceback and ends the process at once (exit
        status 1), so the others learn at once that it is gone.
      cluster_detection_method: JAX's name of the launcher to detect (``"mpi4py"``, which JAX tries only
        when asked; default: every other one JAX knows).
      run_id: names this run, the same in every one of its processes (default: the environment
        variable ``MULTIMESH_RUN_ID``, else the launcher's job id, e.g. ``SLURM_JOB_ID`` and
        ``SLURM_STEP_ID`` or Open MPI's job, else none): process 0 refuses a process given another one,
        so two runs given one coordinator port never join each other's processes.

    Raises:
      StartupError: a process did not join within ``initialization_timeout``, two were given one id or
        different ``num_processes``, a process of another run id came, the coordinator's host does not
        resolve or cannot be reached, or its port is held by another program (on process 0); a value not
        given and no launcher found; a launcher's variables that do not fit together (naming the variable
        and its value); this process already joined a run (`initialize` is called once per process); every
        port of ``transfer_port`` in use on this host.
      DisagreementError: the processes run different multimesh versions or sources.
    """
    global _started
    _check_not_started(coordinator_address, num_processes, process_id)
    if isinstance(local_device_ids, int):
        local_device_ids = [local_device_ids]
    launch = find_launch(coordinator_address, num_processes, process_id, local_device_ids,
                         cluster_detection_method=cluster_detection_method, timeout=initialization_timeout)
    if launch is None:
        raise StartupError("no coordinator_address, num_processes or process_id given, and no launcher found "
                           "that sets them (srun, mpirun, a Kubernetes indexed Job, a Cloud TPU pod): give all "
                           "three, e.g. initialize('host0:5000', num_processes=2, process_id=0)")
    coordinator_address, num_processes, process_id = (launch.coordinator_address, launch.num_processes,
                                                      launch.process_id)
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id}")
    host, port = split_address(coordinator_address)
    transfer_ports = None if transfer_port is None else ports.port_range(transfer_port)
    if transfer_ports is not None and transfer_address is not None:
        raise ValueError(f"initialize: transfer_address={transfer_address!r} names its port already; give it or "
                         f"transfer_port={transfer_port!r}, not both")
    if transfer_ports is not None:  # held from now on, so that no other process's bind takes it meanwhile
        transfer_address = _free_address(host, port, transfer_ports)
    if run_id is None:  # two jobs of one launcher differ in its job id, even on one coordinator port
        run_id = os.environ.get(RUN_ID_VARIABLE) or launch.job_id or ""
    grace = _grace_seconds(heartbeat_timeout_seconds)
    server, go = None, {}
    if process_id == 0 and num_processes > 1:
        server, presence_port = presence.serve(num_processes)
        go = {"presence": presence_port}
    try:
        answer = roll_call(coordinator_address, num_processes, process_id, timeout=initialization_timeout,
                           run_id=run_id, go=go)
    except BaseException:
        if server is not None:
            server.close()
        raise
    _watch_each_other(server, answer, host, num_processes, process_id, grace)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    drop_gloo_notices()  # its "[Gloo] Rank r is connected to n peer ranks" lines, from every process, on stdout
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address or _free_address(host, port))
    # the others reach process 0's coordination service through a relay that never closes JAX's side:
    # process 0's death is then presence's ProcessLostError, not JAX's abort (`startup.coordinator_relay`)
    client_address = coordinator_address if process_id == 0 else relay_to(coordinator_address)
    jax.distributed.initialize(client_address, num_processes=num_processes, process_id=process_id,
                               local_device_ids=launch.local_device_ids,
                               initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    _started = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                "process_id": process_id}
    heartbeat_timeout(heartbeat_timeout_seconds)
    if exit_on_error:
        sys.excepthook = _exit_on_uncaught
    agree("multimesh installation", {"multimesh.__version__": __version__,
                                     "multimesh source (sha256 of its .py files)": source_digest(__package__)})


def find_launch(coordinator_address: str | None = None, num_processes: int | None = None,
                process_id: int | None = None, local_device_ids: list[int] | None = None, *,
                cluster_detection_method: str | None = None, timeout: int = 300) -> Launch | None:
    """What `initialize` would start with, without starting: the values given, the others from the
    launcher (``srun``: ``SLURM_NTASKS``, ``SLURM_PROCID``, the first host of ``SLURM_STEP_NODELIST``;
    ``mpirun`` of Open MPI: ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``; a Kubernetes indexed
    Job: ``JOB_COMPLETION_INDEX`` with ``MULTIMESH_NUM_PROCESSES`` and ``JAX_COORDINATOR_ADDRESS``; Cloud
    TPU and mpi4py as JAX finds them); None where nothing is given and no launcher found. Touches no
    JAX backend, so a program may size its devices (``XLA_FLAGS``) by the process count first.

    Raises:
      StartupError: as `initialize`, for the values and variables.
    """
    return resolve_launch(coordinator_address, num_processes, process_id, local_device_ids,
                          method=cluster_detection_method, timeout=timeout)


def _grace_seconds(heartbeat_timeout_seconds: float) -> float:
    """How long a process waits to stop by itself after another was lost (`multimesh.core.presence`):
    well within the heartbeat timeout, at which JAX's coordination service would abort it."""
    return max(0.5, min(5.0, heartbeat_timeout_seconds / 3))


def _watch_each_other(server: socket.socket | None, answer: dict, host: str, n: int, me: int,
                      grace: float) -> None:
    """The run's presence connections (`multimesh.core.presence`); where one cannot be made, that process's
    loss is left to JAX's heartbeat (said on stderr)."""
    if n == 1:
        return
    if me == 0:
        assert server is not None  # process 0 of several serves presence
        missing = presence.accept(server, n, grace, timeout=30)
        if missing:
            print(f"multimesh: process 0: process(es) {missing} did not connect to the presence port; their loss "
                  f"is noticed by JAX's heartbeat only", file=sys.stderr, flush=True)
        return
    if "presence" not in answer:
        return
    try:
        presence.join(f"{host}:{int(answer['presence'])}", me, n, grace)
    except (OSError, ValueError) as e:
        print(f"multimesh: process {me}: cannot connect to process 0's presence port {host}:{answer['presence']} "
              f"({e}); the loss of process 0 is noticed by JAX's heartbeat only", file=sys.stderr, flush=True)


def _check_not_started(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """A `StartupError` when this process already joined a run (here, or by ``jax.distributed.initialize``):
    a second roll call would find the coordinator port held by this very process."""
    if _started is not None:
        first = ", ".join(f"{k}={v!r}" for k, v in _started.items())
        raise StartupError(f"multimesh.distributed.initialize was already called in this process (pid "
                           f"{os.getpid()}, {first}); call it once per process, before any other JAX call "
                           f"(is_initialized() tells whether it ran)")
    if jax.distributed.is_initialized():
        raise StartupError(f"jax.distributed is already initialized in this process (pid {os.getpid()}, "
                           f"process {jax.process_index()} of {jax.process_count()}), so "
                           f"multimesh.distributed.initialize({coordinator_address!r}, {num_processes}, "
                           f"{process_id}) cannot start it again; call one of them, once per process")


def _exit_on_uncaught(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """Print the error and leave now: JAX's shutdown would wait for processes that wait for this one."""
    traceback.print_exception(kind, error, tb)
    if not any(isinstance(x, ProcessLostError) for x in exception_chain(error)):  # not named yet: who stopped?
        lost = lost_process_error(error, "this process's work")
        if isinstance(lost, ProcessLostError):
            print(f"multimesh: {type(lost).__name__}: {lost}", file=sys.stderr)
    print(f"multimesh: process {jax.process_index()} of {jax.process_count()} stops on this error; "
          f"the other processes stop when they miss its heartbeat", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def is_initialized() -> bool:
    """Whether this process joined a multi-process run through `initialize`."""
    return _started is not None


def _free_address(coordinator_host: str, coordinator_port: int, within: tuple[int, int] | None = None) -> str:
    """``"IP:PORT"``: this host's address on the route to the coordinator, and a port reserved for JAX (the
    first free one of ``within``, a range of ports, when given).

    JAX binds its transfer server lazily, at the first cross-host transfer (after the first step is
    traced and compiled), so a port merely free now could meanwhile be taken by another process's
    automatic bind (a transfer listener, gloo): JAX's bind then fails ("Address already in use"), or,
    where the other socket is a transfer server too (they bind with ``SO_REUSEPORT``), both listen and
    the kernel hands connections to either process. So the port stays bound here, with
    ``SO_REUSEPORT``, for the life of the process: JAX's server may still bind it beside this socket,
    which never listens, while no automatic bind elsewhere can pick it.
    """
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((coordinator_host, coordinator_port))  # UDP: picks the route, sends nothing
        ip = probe.getsockname()[0]
    except OSError:
        ip = "127.0.0.1"
    finally:
        probe.close()
    return f"{ip}:{reserve_port(ip) if within is None else ports.reserve_in(ip, *within)}"


def reserve_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host``, bound by this process until it ends, with ``SO_REUSEPORT`` and never
    listening: a server that binds with ``SO_REUSEPORT`` (JAX's transfer server, gRPC's coordinator) can
    still listen on it later, while no other process's automatic bind can take it meanwhile."""
    return ports.reserve(host)


_RESERVED = ports.HELD  # the ports this process holds (see `reserve_port`)
