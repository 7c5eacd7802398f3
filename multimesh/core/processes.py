"""Which processes of a multi-process run are still there, to name the one a failed step lost."""

from __future__ import annotations

import re
import time

import jax

from .._compat.jax import coordination_client
from . import presence

__all__ = ["ProcessLostError", "exception_chain", "heartbeat_timeout", "is_failed_exchange", "lost_process_error"]

_HEARTBEAT = {"seconds": 100.0}  # JAX's default until `multimesh.distributed.initialize` sets it
_PRESENCE_WAIT = 2.0  # seconds a failed exchange waits for a lost process's connection to close


class ProcessLostError(RuntimeError):
    """A step failed because another process of the run stopped."""


def heartbeat_timeout(seconds: float | None = None) -> float:
    """The heartbeat timeout of this run (set it by passing ``seconds``)."""
    if seconds is not None:
        _HEARTBEAT["seconds"] = float(seconds)
    return _HEARTBEAT["seconds"]


# the status codes of a computation or exchange that failed at run time (gloo, NCCL, the coordination
# service); not a storage error's (RESOURCE_EXHAUSTED, PERMISSION_DENIED, NOT_FOUND, ...)
_RUNTIME_STATUS = re.compile(r"^(UNKNOWN|INTERNAL|UNAVAILABLE|ABORTED|CANCELLED|DEADLINE_EXCEEDED): ")


def exception_chain(e: BaseException) -> list[BaseException]:
    """``e`` and what it wraps (its causes and contexts), outermost first."""
    out, seen = [], set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        out.append(x)
        x = x.__cause__ or x.__context__
    return out


def is_failed_exchange(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps) is XLA's runtime reporting a failed computation: a
    ``JaxRuntimeError``, or the ``ValueError`` a jitted call raises for one (a collective whose peer
    left reads "UNKNOWN: Gloo AllGather failed: ... Connection reset by peer")."""
    return any(isinstance(x, jax.errors.JaxRuntimeError)
               or (isinstance(x, ValueError) and _RUNTIME_STATUS.match(str(x))) for x in exception_chain(error))


def lost_process_error(error: BaseException, what: str) -> BaseException:
    """``error`` (raised by ``what`` in a multi-process run) as a `ProcessLostError` naming the processes
    that stopped, when it is a failed exchange (`is_failed_exchange`) and the coordinator reports some
    stopped within the heartbeat timeout; else ``error`` itself."""
    # the coordination client: the only record of who is alive
    client, n, me = coordination_client(), jax.process_count(), jax.process_index()
    if client is None or n == 1 or not is_failed_exchange(error):
        return error
    soon = time.monotonic() + _PRESENCE_WAIT
    while time.monotonic() < soon:  # a killed process's connection closes at once (`presence`)
        if presence.lost():
            return ProcessLostError(f"{what} failed on process {me} of {n}: {presence.lost_message()}; the error "
                                    f"was: {error}")
        time.sleep(0.01)
    deadline = time.monotonic() + heartbeat_timeout() + 5
    while True:
        try:
            live = set(client.get_live_nodes(list(range(n))))
        except jax.errors.JaxRuntimeError:  # the coordinator itself (process 0) is gone
            return ProcessLostError(f"{what} failed on process {me} of {n}: the coordinator (process 0) no longer "
                                    f"answers, so process 0 has stopped; the error was: {error}")
        lost = sorted(set(range(n)) - live)
        if lost:
            return ProcessLostError(f"{what} failed on process {me} of {n}: process(es) {lost} stopped (they no "
                                    f"longer answer the coordinator; see their logs); the error was: {error}")
        if time.monotonic() > deadline:
            return error
        time.sleep(0.01)  # JAX's coordination service may abort this process once it notices too: be first
