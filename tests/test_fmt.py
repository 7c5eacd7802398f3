"""The text helpers of multimesh.fmt: device spans, byte sizes, key paths."""

import jax
import pytest

from multimesh.core.fmt import device_span, format_bytes, keypath_str


def test_device_span():
    assert device_span([0, 1, 2, 3]) == "0-3"
    assert device_span([4, 5]) == "4-5"
    assert device_span([0, 2, 5]) == "0,2,5"
    assert device_span([3]) == "3"
    assert device_span([]) == ""
    assert device_span([], empty="[]") == "[]"
    assert device_span([3, 2, 1]) == "3,2,1"  # in the order given: sort for a set of devices
    assert device_span(iter(range(2, 6))) == "2-5"


def test_format_bytes_picks_a_unit():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.0 KiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(2 << 20) == "2.0 MiB"
    assert format_bytes(3 << 30) == "3.0 GiB"
    assert format_bytes(5 << 50) == "5120.0 TiB"  # TiB at most


def test_format_bytes_fixed_unit():
    """The MPMD plan's sizes: MiB with two decimals from 64 KiB up, whole bytes below."""
    def mib(n):
        return format_bytes(n, unit="MiB", digits=2, exact_below=2**16)

    assert mib(123) == "123 B"
    assert mib(2**16 - 1) == "65535 B"
    assert mib(2**16) == "0.06 MiB"
    assert mib(1_289_748) == "1.23 MiB"
    assert mib(3 << 30) == "3072.00 MiB"
    with pytest.raises(ValueError, match="unknown unit"):
        format_bytes(1, unit="MB")


def test_keypath_str():
    tree = {"params": {"Dense_0": [1, (2,)]}}
    paths = [kp for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [keypath_str(kp) for kp in paths] == ["params/Dense_0/0", "params/Dense_0/1/0"]
    assert keypath_str(()) == ""
    assert keypath_str((), root="<root>") == "<root>"
    assert keypath_str((jax.tree_util.GetAttrKey("mu"), jax.tree_util.FlattenedIndexKey(2))) == "mu/2"
    assert keypath_str(("odd",)) == "odd"
