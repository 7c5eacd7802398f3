"""The cross-host transfer port of a run's processes: any free port, or one of a fixed range that a cluster
opens between hosts (``--transfer-port``, ``train.transfer_port``, ``initialize(transfer_port=...)``)."""

from __future__ import annotations

import socket

import pytest

from multimesh import distributed
from multimesh.distributed import Launch, StartupError
from multimesh.startup import ports
from trainers import cli
from trainers.config import ConfigError, load_config


@pytest.fixture
def held():
    """Sockets this test binds, closed after it (ours only), and the reservations it made."""
    mine: list[socket.socket] = []
    before = len(ports.HELD)
    yield mine
    for s in mine:
        s.close()
    while len(ports.HELD) > before:
        ports.HELD.pop().close()


def _taken(held: list[socket.socket]) -> int:
    """A port some other socket holds (plainly bound, as another program's would be)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    held.append(s)
    return s.getsockname()[1]


@pytest.mark.parametrize("spec, expected", [(9100, (9100, 9100)), ("9100", (9100, 9100)),
                                            ("9100-9163", (9100, 9163)), (" 9100 - 9101 ", (9100, 9101))])
def test_a_port_or_a_range(spec, expected):
    assert ports.port_range(spec) == expected


@pytest.mark.parametrize("spec", ["ninety", "9163-9100", "0", "70000", "9100-", True, "1-2-3"])
def test_bad_ports_are_named(spec):
    with pytest.raises(ValueError, match=r"transfer_port="):
        ports.port_range(spec)


def test_the_first_free_port_of_the_range_is_taken_and_held(held):
    busy = _taken(held)
    port = ports.reserve_in("127.0.0.1", busy, min(busy + 20, 65535))
    assert busy < port <= busy + 20
    with socket.socket() as other, pytest.raises(OSError):  # held until the process ends
        other.bind(("127.0.0.1", port))
    address = distributed._free_address("127.0.0.1", 9, (busy, min(busy + 20, 65535)))
    assert busy < int(address.rsplit(":", 1)[1]) <= busy + 20 and address.rsplit(":", 1)[1] != str(port)


def test_a_range_with_no_free_port_is_a_startup_error_naming_it(held):
    busy = _taken(held)
    with pytest.raises(StartupError, match=rf"transfer_port {busy}-{busy}: every port of the range is in use"):
        ports.reserve_in("127.0.0.1", busy, busy)


def test_initialize_takes_an_address_or_a_port_not_both():
    with pytest.raises(ValueError, match="names its port already"):
        distributed.initialize("127.0.0.1:1", 2, 0, transfer_address="127.0.0.1:9100", transfer_port=9101,
                               initialization_timeout=1)


def test_the_flag_wins_over_the_config_key(monkeypatch):
    given: list[object] = []
    monkeypatch.setattr(distributed, "initialize", lambda *a, **kw: given.append(kw["transfer_port"]))
    monkeypatch.setattr(distributed, "agree", lambda *a, **kw: None)
    cfg = load_config("tiny", ["train.transfer_port=9100-9163"])
    launch = Launch("127.0.0.1:1", 2, 0)
    cli._start_processes(launch, cfg, 10, None)
    cli._start_processes(launch, cfg, 10, None, "9200")
    cli._start_processes(launch, load_config("tiny"), 10, None)
    assert given == ["9100-9163", "9200", None]


def test_bad_flag_and_key_are_named(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["tiny", "--transfer-port", "91OO"])
    assert stopped.value.code == 2
    assert "--transfer-port='91OO': give a port (9100) or a range of ports (9100-9163)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"train: transfer_port='9163-9100'"):
        load_config("tiny", ["train.transfer_port=9163-9100"])
