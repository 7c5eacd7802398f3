"""Roll call before a multi-process run starts: every process reports to process 0, which checks them.

JAX's own start-up (``jax.distributed.initialize``) reports none of the usual mistakes: a process that
never arrives means minutes of silence, then an abort; processes given different process counts run as
a job of process 0's count; a duplicate process id or a coordinator port held by another program aborts
or crashes the process; two jobs given one port join each other's processes. So before JAX starts,
process 0 listens on the coordinator's port itself and every other process connects and says who it is
(its id, the process count it was given, its run id, its host and pid). Process 0 answers each with the
processes still missing, names them while it waits, and lets everyone go on (and then starts JAX's
coordination service on that port) only when all have joined and agree; any mistake ends every process
that joined with a `StartupError` naming the address, ids and counts. A process of another run (another
run id: two runs given one port) is refused alone, with a `StartupError` naming both run ids, and process
0 waits on for its own. The exchange is one JSON object per line.
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

__all__ = ["StartupError", "roll_call", "split_address"]

PROTOCOL = "multimesh-rollcall/1"
ANSWER_SECONDS = 5.0  # how long a connected process waits for process 0's first answer


class StartupError(RuntimeError):
    """A multi-process run could not start: a missing or duplicate process, a wrong address or port,
    or processes given different process counts."""


def split_address(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` as ``(host, port)``; a `ValueError` for anything else."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator_address must be 'HOST:PORT' with a port in 1..65535, got {address!r}")
    return host.strip("[]"), int(port)


def roll_call(coordinator_address: str, num_processes: int, process_id: int, *, timeout: float,
              every: float = 10.0, say: Callable[[str], None] | None = None, run_id: str = "",
              go: dict | None = None) -> dict:
    """Return once all ``num_processes`` processes have reported to process 0 at ``coordinator_address``
    and agree on the count; raise `StartupError` otherwise, within ``timeout`` seconds. While waiting,
    ``say`` (default: print to stderr) hears every ``every`` seconds who is still missing. Only processes
    given process 0's ``run_id`` join it; one of another run gets a `StartupError` naming both ids.
    Process 0 sends ``go`` (more keys of its "go" answer) to every process; each returns that answer."""
    say = say or _to_stderr
    host, port = split_address(coordinator_address)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise StartupError(f"process {process_id}: the coordinator host {host!r} (of {coordinator_address}) "
                           f"does not resolve ({e.strerror}); give every process the address of process 0's "
                           f"host as HOST:PORT") from None
    if num_processes == 1:
        return {"status": "go", **(go or {})}
    if process_id == 0:
        _Gathering(host, port, num_processes, timeout, every, say, run_id).run(go or {})
        return {"status": "go", **(go or {})}
    return _report_in(host, port, num_processes, process_id, timeout, every, say, run_id)


def _to_stderr(message: str) -> None:
    print(f"multimesh: {message}", file=sys.stderr, flush=True)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass  # that process is gone; process 0 notices when reading


# -- process 0 ---------------------------------------------------------------------------------------


def _run_name(run_id: str) -> str:
    return repr(run_id) if run_id else "none"


@dataclass
class _Member:
    process_id: int
    host: str
    pid: int
    run_id: str = ""

    def __str__(self) -> str:
        return f"process {self.process_id} (host {self.host}, pid {self.pid})"


class _Gathering:
    """Process 0's side: wait on the coordinator port until every process has reported in."""

    def __init__(self, host: str, port: int, n: int, timeout: float, every: float, say: Callable[[str], None],
                 run_id: str = ""):
        self.address, self.port, self.n, self.run_id = f"{host}:{port}", port, n, run_id
        self.timeout, self.every, self.say = timeout, every, say
        self.members: dict[socket.socket, _Member] = {}
        self.buffers: dict[socket.socket, bytes] = {}
        self.refused: list[_Member] = []  # processes of other runs, named at the timeout

    def missing(self) -> list[int]:
        return sorted(set(range(1, self.n)) - {m.process_id for m in self.members.values()})

    def run(self, go: dict) -> None:
        server = self._listen()
        sel = selectors.DefaultSelector()
        sel.register(server, selectors.EVENT_READ)
        start = time.monotonic()
        next_note = start + self.every
        try:
            while self.missing():
                now = time.monotonic()
                if now - start >= self.timeout:
                    refused = "".join(f"; {m} came with run id {_run_name(m.run_id)} and was refused"
                                      for m in self.refused)
                    self._fail(f"process 0: process(es) {self.missing()} of {self.n} did not join at "
                               f"{self.address} within the start-up timeout of {self.timeout:g} s{refused}; start "
                               f"them (each with the same coordinator address, num_processes={self.n}, run id "
                               f"{_run_name(self.run_id)} and its own process id), check that they reach "
                               f"{self.address}, or raise the timeout")
                if now >= next_note:
                    note = f"waiting for process(es) {self.missing()} at {self.address}, {now - start:.0f} s of " \
                           f"{self.timeout:g} s"
                    self.say(f"process 0: {note}")
                    for conn in self.members:
                        _send(conn, {"status": "waiting", "note": note})
                    next_note += self.every
                for key, _ in sel.select(timeout=min(0.5, max(0.0, next_note - now))):
                    if key.fileobj is server:
                        conn, _ = server.accept()
                        conn.setblocking(False)
                        self.buffers[conn] = b""
                        sel.register(conn, selectors.EVENT_READ)
                    else:
                        self._read(_socket_of(key), sel)
            for conn in self.members:
                _send(conn, {**go, "status": "go"})
            self._wait_for_close(sel, server)
        finally:
            for conn in list(self.buffers):
                conn.close()
            sel.close()
            server.close()

    def _listen(self) -> socket.socket:
        """Listen on the coordinator port (all addresses, as JAX's service does). Bound with
        ``SO_REUSEPORT`` like JAX's service, so a port merely reserved (`reserve_port`) can be used; so
        another listener there (another run's coordinator) is looked for by connecting before listening."""
        dual = socket.has_dualstack_ipv6()
        server = socket.socket(socket.AF_INET6 if dual else socket.AF_INET, socket.SOCK_STREAM)
        try:
            if dual:
                server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("", self.port))
            if _someone_listens(self.port):
                raise OSError(errno.EADDRINUSE, "in use")
            server.listen()
        except OSError as e:
            server.close()
            if e.errno != errno.EADDRINUSE:
                raise StartupError(f"process 0 cannot serve the coordinator at {self.address}: {e.strerror}") from None
            raise StartupError(f"process 0 cannot serve the coordinator at {self.address}: port {self.port} is "
                               f"already in use{_holder(self.port)} (another run on the same port?); stop that "
                               f"program or give every process another free port") from None
        return server

    def _read(self, conn: socket.socket, sel: selectors.BaseSelector) -> None:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:  # a process that reported in and then stopped is missing again
            gone = self.members.pop(conn, None)
            if gone is not None:
                self.say(f"process 0: {gone} left before every process had joined")
            del self.buffers[conn]
            sel.unregister(conn)
            conn.close()
            return
        self.buffers[conn] += data
        if conn not in self.members and len(self.buffers[conn]) > 65536:
            self.buffers[conn] = b"?\n"  # no hello is that long: a stray client's
        if b"\n" in self.buffers[conn] and conn not in self.members:
            line = self.buffers[conn].split(b"\n", 1)[0]
            try:
                hello = json.loads(line)
                if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL:
                    raise ValueError("not a hello")
                member = _Member(int(hello["process_id"]), str(hello["host"]), int(hello["pid"]),
                                 str(hello.get("run_id", "")))
                n = int(hello["num_processes"])
            except (ValueError, KeyError, TypeError):
                sel.unregister(conn)  # not one of ours (a port scanner, a stray client): ignore it
                del self.buffers[conn]
                conn.close()
                return
            if member.run_id != self.run_id:  # another run's process: refuse it alone, wait on for ours
                self._refuse(conn, member)
                sel.unregister(conn)
                del self.buffers[conn]
                conn.close()
                return
            self._admit(conn, member, n)

    def _refuse(self, conn: socket.socket, member: _Member) -> None:
        message = (f"{member} has run id {_run_name(member.run_id)}, but process 0 (the coordinator) at "
                   f"{self.address} runs run id {_run_name(self.run_id)}: two runs were given one coordinator "
                   f"port, or the processes of one run different run ids; give each run its own port, and every "
                   f"process of a run the same run id")
        self.say(f"process 0: refused {member}: {message}")
        self.refused.append(member)
        _send(conn, {"status": "error", "message": message})

    def _admit(self, conn: socket.socket, member: _Member, n: int) -> None:
        if n != self.n:
            self.members[conn] = member
            self._fail(f"the processes were given different process counts: process 0 num_processes={self.n}, "
                       f"{member} num_processes={n}; give every process the same count")
        same = [m for m in self.members.values() if m.process_id == member.process_id]
        if member.process_id == 0 or same:
            self.members[conn] = member
            first = "process 0 (the coordinator)" if member.process_id == 0 else str(same[0])
            self._fail(f"two processes were given process id {member.process_id}: {first} and {member}; "
                       f"give each process its own id in 0..{self.n - 1}")
        self.members[conn] = member
        _send(conn, {"status": "joined", "missing": self.missing()})

    def _fail(self, message: str) -> None:
        for conn in self.members:
            _send(conn, {"status": "error", "message": message})
        raise StartupError(message)

    def _wait_for_close(self, sel: selectors.BaseSelector, server: socket.socket) -> None:
        """Let every process close first (so the port is not left in TIME_WAIT here, where JAX's
        coordination service binds it next), for at most a few seconds."""
        sel.unregister(server)
        deadline = time.monotonic() + ANSWER_SECONDS
        while any(conn in self.members for conn in self.buffers) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.2):
                conn = _socket_of(key)
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(conn)
                    del self.buffers[conn]
                    conn.close()


def _socket_of(key: selectors.SelectorKey) -> socket.socket:
    # the selector types what it holds as any file-like object; process 0 registers only sockets on it
    return cast(socket.socket, key.fileobj)


def _someone_listens(port: int) -> bool:
    """Whether a program on this host already accepts connections on ``port`` (on a loopback address)."""
    for host in ("127.0.0.1", "::1"):
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            continue
    return False


def _holder(port: int) -> str:
    """``" by pid N (command)"`` for the program listening on ``port`` where it can be found (psutil)."""
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                cmd = " ".join(psutil.Process(c.pid).cmdline())[:200]
                return f" by pid {c.pid} ({cmd})"
    except Exception:  # no psutil, or no permission to see other users' sockets
        pass
    return ""


# -- every other process -----------------------------------------------------------------------------


def _report_in(host: str, port: int, n: int, process_id: int, timeout: float, every: float,
               say: Callable[[str], None], run_id: str = "") -> dict:
    address, me = f"{host}:{port}", f"process {process_id}"
    start = time.monotonic()
    deadline, next_note = start + timeout, start + every
    waiting_for = f"process 0 (the coordinator) at {address}"
    conn, why = None, "not tried"
    while conn is None:  # process 0 may start later than this one
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except OSError as e:
            why = e.strerror or type(e).__name__
            if time.monotonic() >= deadline:
                raise StartupError(f"{me}: could not reach {waiting_for} within the start-up timeout of "
                                   f"{timeout:g} s ({why}); start process 0, check that this host reaches "
                                   f"{address}, or raise the timeout") from None
            if time.monotonic() >= next_note:
                say(f"{me}: waiting for {waiting_for} ({why}), {time.monotonic() - start:.0f} s of {timeout:g} s")
                next_note += every
            time.sleep(0.2)
    with conn:
        conn.sendall((json.dumps({"protocol": PROTOCOL, "process_id": process_id, "num_processes": n,
                                  "host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id}) + "\n").encode())
        answers = _Answers(conn)
        first = answers.next(ANSWER_SECONDS)
        if first is None or first.get("status") not in ("joined", "go", "error"):
            raise StartupError(f"{me}: {address} accepted the connection but did not answer as process 0 of a "
                               f"multimesh run gathering its processes ({answers.why or 'another status'}): "
                               f"another program, or a run that has already started (two runs on one port, or "
                               f"this process id given twice?), holds that port, or the address is not process "
                               f"0's; check the address, or give every process of this run another free port")
        answer = first
        while answer.get("status") != "go":
            if answer.get("status") == "error":
                raise StartupError(f"{me}: {answer['message']}")
            if answer.get("status") == "waiting":
                say(f"{me}: process 0 is {answer['note']}")
            left = deadline - time.monotonic()
            got = answers.next(max(left, 0.0) + every + 5)  # process 0's deadline may be later
            if got is None:
                if time.monotonic() < deadline + every:
                    raise StartupError(f"{me}: process 0 (the coordinator) at {address} stopped answering "
                                       f"before every process had joined ({answers.why}; see its output)")
                raise StartupError(f"{me}: not every process joined at {address} within the start-up timeout "
                                   f"of {timeout:g} s; see process 0's output for the missing ones")
            answer = got
        return answer


class _Answers:
    """Process 0's answers on ``conn``, one JSON object per line; ``why`` says what came instead."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buffer, self.why = conn, b"", ""

    def next(self, seconds: float) -> dict | None:
        self.conn.settimeout(max(seconds, 0.1))
        while b"\n" not in self.buffer:
            try:
                data = self.conn.recv(4096)
            except TimeoutError:
                self.why = f"no answer within {seconds:.0f} s"
                return None
            except OSError as e:
                data, self.why = b"", f"the connection failed ({e.strerror or type(e).__name__})"
            if not data:
                self.why = self.why or "the connection was closed without an answer"
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "status" not in answer:
            self.why = f"an answer in another protocol ({line[:40]!r})"
            return None
        return answer
