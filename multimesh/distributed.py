"""Start one process of a multi-process run (multi-controller JAX).

Every process runs the same program; call `initialize` in each, before any
other JAX call. It wraps `jax.distributed.initialize` and sets what
multimesh's runtime needs:

* CPU collectives across processes (gloo), so an SPMD program (a stage) may
  span processes; GPUs keep JAX's defaults; gloo's connection notices, which
  it prints on stdout from every process, are filtered out
  (`multimesh.core.gloo_notices`), so they neither cut a progress bar nor
  fill the terminal;
* JAX's cross-host device transfers (``jax_cross_host_transfer_socket_address``),
  so pipeline stages may sit on different processes and hosts: each process
  listens on a free port of the address other processes reach it at;
* a roll call before JAX starts (`multimesh.core.rollcall`): process 0 waits on the coordinator port
  for the others, naming the missing ones every 10 s, and every start-up mistake (a process that does
  not arrive within ``initialization_timeout``, a duplicate id, different process counts, a port held
  by another program, an unresolvable or unreachable coordinator) ends every process with a
  `StartupError` naming the address, ids or counts; then all processes check that they run the same
  multimesh (`agree`: version and a digest of its source);
* failure handling: when a process dies, the others stop within about
  ``heartbeat_timeout_seconds`` with an error naming it, instead of waiting
  forever for its transfers; and an uncaught exception ends its process at
  once (``exit_on_error``) rather than letting it wait at JAX's shutdown
  barrier while the others wait for it.

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

import jax

from ._version import __version__
from .core.agreement import DisagreementError, agree, source_digest
from .core.gloo_notices import drop_gloo_notices
from .core.processes import ProcessLostError, exception_chain, heartbeat_timeout, lost_process_error
from .core.rollcall import StartupError, roll_call, split_address

__all__ = ["DisagreementError", "ProcessLostError", "StartupError", "agree", "initialize", "is_initialized",
           "reserve_port"]

_started = False


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               local_device_ids: int | list[int] | None = None, transfer_address: str | None = None,
               heartbeat_timeout_seconds: int = 30, initialization_timeout: int = 300,
               exit_on_error: bool = True) -> None:
    """Join the run of ``num_processes`` processes coordinated by process 0 at ``coordinator_address``.

    Args:
      coordinator_address: ``"HOST:PORT"`` where process 0 serves the coordination service.
      num_processes: how many processes take part.
      process_id: this process, in ``0 .. num_processes - 1``.
      local_device_ids: restrict this process to some of its local devices (as in JAX).
      transfer_address: ``"HOST:PORT"`` this process receives cross-host transfers on (default:
        the address it reaches the coordinator from, on a free port).
      heartbeat_timeout_seconds: how long the others wait for a process that stopped answering.
      initialization_timeout: how long to wait for every process to join (seconds); while waiting, each
        process prints every 10 s which processes it waits for, then raises `StartupError` naming them.
      exit_on_error: an uncaught exception prints its traceback and ends the process at once (exit
        status 1), so the others learn within ``heartbeat_timeout_seconds`` that it is gone.

    Raises:
      StartupError: a process did not join within ``initialization_timeout``, two were given one id or
        different ``num_processes``, the coordinator's host does not resolve or cannot be reached, or
        its port is held by another program (on process 0).
      DisagreementError: the processes run different multimesh versions or sources.
    """
    global _started
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id}")
    host, port = split_address(coordinator_address)
    roll_call(coordinator_address, num_processes, process_id, timeout=initialization_timeout)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    drop_gloo_notices()  # its "[Gloo] Rank r is connected to n peer ranks" lines, from every process, on stdout
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address or _free_address(host, port))
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids, initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    _started = True
    heartbeat_timeout(heartbeat_timeout_seconds)
    if exit_on_error:
        sys.excepthook = _exit_on_uncaught
    agree("multimesh installation", {"multimesh.__version__": __version__,
                                     "multimesh source (sha256 of its .py files)": source_digest(__package__)})


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
    return _started


def _free_address(coordinator_host: str, coordinator_port: int) -> str:
    """``"IP:PORT"``: this host's address on the route to the coordinator, and a port reserved for JAX.

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
    return f"{ip}:{reserve_port(ip)}"


def reserve_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host``, bound by this process until it ends, with ``SO_REUSEPORT`` and never
    listening: a server that binds with ``SO_REUSEPORT`` (JAX's transfer server, gRPC's coordinator) can
    still listen on it later, while no other process's automatic bind can take it meanwhile."""
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if hasattr(socket, "SO_REUSEPORT"):
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind((host, 0))
    _RESERVED.append(reserved)
    return reserved.getsockname()[1]


_RESERVED: list[socket.socket] = []  # the ports this process holds (see `reserve_port`)
