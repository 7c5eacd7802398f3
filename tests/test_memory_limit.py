"""``MULTIMESH_MEMORY_LIMIT``: the memory a state is checked against, read as a size of at least one byte."""

from __future__ import annotations

import pytest

from multimesh.estimate.memory import memory_limit, parse_bytes


@pytest.mark.parametrize("text, size", [("1", 1), ("10GiB", 10 * 2**30), ("512 MB", 512 * 10**6), ("1.5k", 1536),
                                        (" 2 B ", 2)])
def test_sizes_are_read_with_their_units(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["0", "0 B", "0.5 B", "0.4", "0.0001k", "ten gigs", "-1", "5 parsecs", ""])
def test_nothing_or_less_than_a_byte_is_refused_alike(text):
    """"0.5 B" is no more a memory than "0": each names the variable and says what to give."""
    with pytest.raises(ValueError, match=r"MULTIMESH_MEMORY_LIMIT=.*give the memory in bytes \(at least 1\)"):
        parse_bytes(text)


def test_the_variable_sets_the_limit(monkeypatch):
    monkeypatch.setenv("MULTIMESH_MEMORY_LIMIT", "3 MiB")
    limit = memory_limit()
    assert limit.bytes == 3 * 2**20 and limit.source == "$MULTIMESH_MEMORY_LIMIT"
    monkeypatch.setenv("MULTIMESH_MEMORY_LIMIT", "0.5 B")
    with pytest.raises(ValueError, match=r"MULTIMESH_MEMORY_LIMIT='0.5 B'"):
        memory_limit()


class _Estimate:
    """An estimate whose devices 0 and 1 peak at 3 MiB and 5 MiB."""

    peaks = {0: 3 * 2**20, 1: 5 * 2**20}

    def overflow(self, limit: int) -> dict[int, int]:
        return {d: p - limit for d, p in self.peaks.items() if p > limit}


def test_plan_checks_the_estimate_against_the_variable_and_says_so(monkeypatch):
    """``--plan --profile NAME`` with ``MULTIMESH_MEMORY_LIMIT`` set: the estimate's peak is checked against
    it and the line says so; unset, the line says it could be set; a bad value is a config error."""
    from trainers.config import ConfigError
    from trainers.plan_estimate import _against_memory_limit

    monkeypatch.setenv("MULTIMESH_MEMORY_LIMIT", "4 MiB")
    line = _against_memory_limit(_Estimate())
    assert line.startswith("MULTIMESH_MEMORY_LIMIT='4 MiB': the peak per device does NOT fit in 4.0 MiB: devices [1]")
    monkeypatch.setenv("MULTIMESH_MEMORY_LIMIT", "8MiB")
    assert "fits in 8.0 MiB" in _against_memory_limit(_Estimate())
    monkeypatch.setenv("MULTIMESH_MEMORY_LIMIT", "0.5 B")
    with pytest.raises(ConfigError, match=r"MULTIMESH_MEMORY_LIMIT='0.5 B'"):
        _against_memory_limit(_Estimate())
    monkeypatch.delenv("MULTIMESH_MEMORY_LIMIT")
    assert "set MULTIMESH_MEMORY_LIMIT" in _against_memory_limit(_Estimate())
