"""The ports a process of a run binds for JAX's cross-host transfers: any free one, or the first free one
of a range a cluster allows (``9100-9163``), held from the moment it is chosen until the process ends."""

from __future__ import annotations

import socket

from .rollcall import StartupError

__all__ = ["HELD", "port_range", "reserve", "reserve_in"]

HELD: list[socket.socket] = []  # the ports this process holds (see `reserve`)


def port_range(spec: int | str, what: str = "transfer_port") -> tuple[int, int]:
    """``9100`` -> ``(9100, 9100)``, ``"9100-9163"`` -> ``(9100, 9163)``; a `ValueError` naming ``what``
    for anything else (ports are 1 to 65535, the range's low end first)."""
    text = str(spec).strip()
    low, sep, high = text.partition("-")
    try:
        first, last = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"{what}={spec!r}: give a port (9100) or a range of ports (9100-9163)") from None
    if isinstance(spec, bool) or not 1 <= first <= last <= 65535:
        raise ValueError(f"{what}={spec!r}: ports run from 1 to 65535, the range's low end first (9100-9163)")
    return first, last


def reserve(host: str = "127.0.0.1", port: int = 0) -> int:
    """A TCP port on ``host`` (``port``, or any free one for 0), bound by this process until it ends, with
    ``SO_REUSEPORT`` and never listening: a server that binds with ``SO_REUSEPORT`` (JAX's transfer server,
    gRPC's coordinator) can still listen on it later, while no other process's automatic bind can take it
    meanwhile."""
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if hasattr(socket, "SO_REUSEPORT"):
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind((host, port))
    HELD.append(reserved)
    return reserved.getsockname()[1]


def reserve_in(host: str, first: int, last: int, what: str = "transfer_port") -> int:
    """The first port of ``first..last`` that no socket on ``host`` holds (another process of the run on this
    host, another program), reserved as `reserve` does; a `StartupError` naming the range when none is free."""
    for port in range(first, last + 1):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.bind((host, port))  # without SO_REUSEPORT: refused while any socket holds the port
        except OSError:
            continue
        finally:
            probe.close()
        try:
            return reserve(host, port)
        except OSError:  # taken between the probe and the reservation
            continue
    raise StartupError(f"{what} {first}-{last}: every port of the range is in use on {host} (by other processes "
                       f"of this run on this host, or other programs); give a range with at least one port per "
                       f"process on each host")
