"""A relay between this process's JAX coordination client and process 0's coordination service, which
never closes the client's side: process 0's death is then multimesh's `ProcessLostError`, never JAX's abort.

JAX's coordination service runs inside process 0. When process 0 is killed, its kernel closes the
service's connections at once; the client in every other process sees "Stream removed (Socket closed)"
on its error-polling call within a second and aborts its whole process from C++ ("Terminating process
because the JAX distributed service detected fatal errors", SIGABRT), long before multimesh's presence
connection (`multimesh.core.presence`) can name the loss. The client takes an error callback
(``missed_heartbeat_callback`` of jaxlib's ``get_distributed_runtime_client``) that would replace the
abort, but jaxlib 0.12 cannot call it from Python (it fails converting its status argument and aborts
all the same), and ``jax.distributed.initialize`` passes none.

So every process but process 0 gives JAX the address of a local relay instead of the coordinator's: the
relay copies bytes both ways, and when process 0's side closes (or cannot be reached) it keeps the
client's side open and silent. JAX's client then learns of the loss only from its heartbeat timeout,
while presence has named the lost process within a third of it. The client still closes its own side
as it would (a normal shutdown, a connection it gives up), and the relay follows it.

Only a connection on which the service has answered is held: gRPC's server opens every connection with
an HTTP/2 SETTINGS frame. A connection refused or closed before that (process 0 not listening yet, or
another program on the same port: the roll call's port is shared with ``SO_REUSEPORT``) is closed on
the client's side as well, so that JAX's client connects again as it would without the relay; once a
service has answered in this process, a refused connection means process 0 is gone, and it is held.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["relay_to"]

_HELD: list[socket.socket] = []  # the client's connections kept open after process 0's side closed
_ANSWERED = threading.Event()  # the coordination service has answered on a connection of this process

#: the type of an HTTP/2 SETTINGS frame, the 4th byte of the first frame a gRPC server sends
_HTTP2_SETTINGS = 0x04


def relay_to(coordinator_address: str) -> str:
    """Start a relay to ``coordinator_address`` (``"HOST:PORT"``) in this process; the local
    ``"127.0.0.1:PORT"`` to give JAX's coordination client instead."""
    host, _, port = coordinator_address.rpartition(":")
    upstream = (host.strip("[]"), int(port))
    server = socket.create_server(("127.0.0.1", 0), backlog=16)
    threading.Thread(target=_accept, args=(server, upstream), daemon=True, name="multimesh-coordinator-relay").start()
    return f"127.0.0.1:{server.getsockname()[1]}"


def _accept(server: socket.socket, upstream: tuple[str, int]) -> None:
    while True:
        try:
            client, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=_connect, args=(client, upstream), daemon=True,
                         name="multimesh-coordinator-relay-conn").start()


def _connect(client: socket.socket, upstream: tuple[str, int]) -> None:
    try:
        service = socket.create_connection(upstream, timeout=10.0)
    except OSError:  # process 0 is gone (the client waits on, until its timeout or presence ends us), or
        _hold_or_close(client)  # not listening yet (the client connects again)
        return
    service.settimeout(None)
    for sock in (client, service):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client_closed = threading.Event()
    threading.Thread(target=_copy, args=(client, service, client_closed), daemon=True,
                     name="multimesh-coordinator-relay-up").start()
    answered = _copy(service, client, None)
    if client_closed.is_set() or not answered:
        client.close()
    else:
        _HELD.append(client)


def _hold_or_close(client: socket.socket) -> None:
    if _ANSWERED.is_set():
        _HELD.append(client)
    else:
        client.close()


def _copy(source: socket.socket, target: socket.socket, closed: threading.Event | None) -> bool:
    """Copy ``source`` to ``target`` until either closes. The client closing (``closed`` given): the
    service is told. The service closing, or failing to take what the client sends: the client is not
    (see the module's docstring). Whether the source spoke gRPC's server first frame (service -> client)."""
    answered = False
    while True:
        try:
            data = source.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            break
        if closed is None and not answered:
            answered = len(data) > 3 and data[3] == _HTTP2_SETTINGS
            if answered:
                _ANSWERED.set()
        try:
            target.sendall(data)
        except OSError:
            return answered  # the service is gone (client -> service) or the client is (service -> client)
    if closed is None:
        return answered
    closed.set()
    try:
        target.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return answered
