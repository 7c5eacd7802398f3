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
