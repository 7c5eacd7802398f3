"""Which processes of a run are still there, known at once: one connection per process, held for the run.

A killed process's sockets are closed by its kernel at once, while JAX's coordination service learns of
it only after its heartbeat timeout, and then aborts every other process from C++ ("another task
died", SIGABRT), racing multimesh's own `ProcessLostError`. So process 0 holds a TCP connection from
every other process for the life of the run. A process ends normally only after saying goodbye on it
(at interpreter exit); one whose connection closes without a goodbye is lost: process 0 tells the
others, `lost()` names it at once (for `lost_process_error`), and a process that has not ended by
itself within ``grace`` seconds (blocked in a barrier or a transfer that waits for the lost one) prints
the `ProcessLostError` and exits with status 1, before the heartbeat timeout: the outcome is always
multimesh's error, never JAX's abort. The exchange is one JSON object per line.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time

__all__ = ["Presence", "accept", "join", "lost", "lost_message", "serve"]

_BYE = b'{"bye": true}\n'


class Presence:
    """This process's end of the run's connections (process 0: one per other process; others: one)."""

    def __init__(self, me: int, n: int, grace: float):
        self.me, self.n, self.grace = me, n, grace
        self.conns: dict[int, socket.socket] = {}
        self.gone: set[int] = set()  # processes lost (without a goodbye)
        self.left: set[int] = set()  # processes that said goodbye
        self.lock = threading.Lock()
        self.closing = False
        self.timer: threading.Timer | None = None

    def _watch(self, peer: int, conn: socket.socket, buffer: bytes = b"") -> None:
        """Read ``peer``'s connection until it closes: a goodbye, lost processes (from process 0), or EOF."""
        while True:
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if message.get("bye"):
                    with self.lock:
                        self.left.add(peer)
                elif isinstance(message.get("lost"), list):
                    self._lose([int(p) for p in message["lost"]])
            try:
                data = conn.recv(4096)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
        with self.lock:
            gone = peer not in self.left and not self.closing
        if gone:
            self._lose([peer])

    def _lose(self, processes: list[int]) -> None:
        with self.lock:
            new = [p for p in processes if p not in self.gone and p != self.me]
            self.gone.update(new)
            if not new or self.closing:
                return
            others = [c for p, c in self.conns.items() if p not in self.gone]
            if self.timer is None:
                self.timer = threading.Timer(self.grace, self._stop)
                self.timer.daemon = True
                self.timer.start()
        if self.me == 0:  # tell the others at once
            for c in others:
                _send(c, {"lost": sorted(self.gone)})

    def message(self) -> str:
        lost = sorted(self.gone)
        who = "process 0 (the coordinator)" if lost == [0] else f"process(es) {lost}"
        return (f"{who} stopped: its connection to this run closed without a goodbye (it was killed or "
                f"crashed; see its log)")

    def _stop(self) -> None:
        """Still running ``grace`` seconds after a process was lost: end now, before JAX's abort. Also while
        exiting: JAX's shutdown would wait for the lost process (and, where it was process 0, for ever)."""
        print(f"multimesh: ProcessLostError: process {self.me} of {self.n} stops: {self.message()}; it did not "
              f"stop by itself within {self.grace:g} s (waiting for the lost process)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def goodbye(self) -> None:
        with self.lock:
            self.closing = True
            conns = list(self.conns.values())
        for c in conns:
            try:
                c.sendall(_BYE)
            except OSError:
                pass


_PRESENCE: Presence | None = None


def lost() -> list[int]:
    """The processes known to have stopped without a goodbye (none outside a run)."""
    if _PRESENCE is None:
        return []
    with _PRESENCE.lock:
        return sorted(_PRESENCE.gone)


def lost_message() -> str | None:
    """What `lost` says, as a sentence, or None when no process is known lost."""
    return _PRESENCE.message() if _PRESENCE is not None and lost() else None


def serve(n: int) -> tuple[socket.socket, int]:
    """Process 0: listen for the other processes' connections (on all addresses, a free port); the
    listening socket and its port, for the roll call's go. `accept` then takes them."""
    dual = socket.has_dualstack_ipv6()  # reached at the coordinator's host, whichever address family it has
    server = socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                  backlog=max(n, 8), dualstack_ipv6=dual)
    return server, server.getsockname()[1]


def accept(server: socket.socket, n: int, grace: float, timeout: float) -> list[int]:
    """Process 0: take a connection from each of the ``n - 1`` others (each says its id), then watch them;
    the ids of those that did not connect within ``timeout`` seconds."""
    presence = Presence(0, n, grace)
    deadline = time.monotonic() + timeout
    try:
        while len(presence.conns) < n - 1 and time.monotonic() < deadline:
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            conn.settimeout(5.0)
            try:
                buffer = b""
                while b"\n" not in buffer:
                    data = conn.recv(4096)
                    if not data:
                        break
                    buffer += data
                line, rest = buffer.split(b"\n", 1)
                peer = int(json.loads(line)["process_id"])
            except (OSError, ValueError, KeyError, TypeError):
                conn.close()
                continue
            conn.settimeout(None)
            presence.conns[peer] = conn
            threading.Thread(target=presence._watch, args=(peer, conn, rest), daemon=True,
                             name=f"multimesh-presence-{peer}").start()
    finally:
        server.close()
    _start(presence)
    return sorted(set(range(1, n)) - set(presence.conns))


def join(address: str, me: int, n: int, grace: float) -> None:
    """Every other process: connect to process 0's ``"HOST:PORT"`` and watch that connection."""
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=10.0)
    conn.settimeout(None)
    conn.sendall((json.dumps({"process_id": me}) + "\n").encode())
    presence = Presence(me, n, grace)
    presence.conns[0] = conn
    threading.Thread(target=presence._watch, args=(0, conn), daemon=True, name="multimesh-presence-0").start()
    _start(presence)


def _start(presence: Presence) -> None:
    global _PRESENCE
    _PRESENCE = presence
    atexit.register(presence.goodbye)  # registered after JAX's shutdown: runs before it


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass
