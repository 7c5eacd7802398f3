"""Collectives over a cluster as it is wired: hand-computed ring, tree and hierarchical times (`estimate.network`)."""

import dataclasses
import math

import pytest

from multimesh.estimate import PROFILES, Collective, HardwareProfile, collective_time
from multimesh.estimate.network import Span, algorithm_times, network_seconds

H100 = PROFILES["h100-sxm"]
A100 = PROFILES["a100-80gb"]
GIB = 1 << 30
MIB = 1 << 20


def test_the_gpu_profiles_say_how_their_nodes_are_wired():
    assert (H100.nics_per_node, H100.inter_node_bandwidth, H100.intra_node_bandwidth) == (8, 50e9, 450e9)
    assert (A100.nics_per_node, A100.inter_node_bandwidth, A100.intra_node_bandwidth) == (8, 25e9, 300e9)
    for p in (H100, A100, PROFILES["h200"]):
        assert any("ConnectX" in n and "https://" in n for n in p.notes)  # each figure's source, cited
        assert any("NVLink" in n for n in p.notes)
    assert H100.network_share == 50e9  # one NIC per GPU
    # a profile that says nothing of its NICs: one link per device
    assert dataclasses.replace(H100, nics_per_node=0).network_share == 50e9
    assert dataclasses.replace(H100, nics_per_node=4).network_share == 25e9  # 4 NICs shared by 8 GPUs
    with pytest.raises(ValueError, match="nics_per_node"):
        dataclasses.replace(H100, nics_per_node=-1)


def test_an_all_gather_over_two_nodes_of_eight_runs_over_all_sixteen_nics():
    """2 nodes x 8 H100s, one all-gather of 1 GiB per device: NCCL's rings leave each node over its 8 NICs,
    8 x 50 GB/s = 400 GB/s (under NVLink's 450), 15 steps at the network's 10 us."""
    ring = 15 * 10e-6 + 15 / 16 * GIB / 400e9
    hierarchical = (1 * 10e-6 + 1 / 2 * (GIB / 8) / 50e9) + (7 * 5e-6 + 7 / 8 * GIB / 450e9)
    times = algorithm_times("all-gather", GIB, Span(16, 2, 8), H100)
    assert times == pytest.approx({"ring": ring, "hierarchical": hierarchical})
    assert network_seconds("all-gather", GIB, Span(16, 2, 8), H100) == pytest.approx(ring)  # 2.67 ms
    # the same read from a program's groups: devices 0-15 on nodes 0 and 1
    c = Collective("all-gather", GIB, 16, ("fsdp",), "ag", devices=(tuple(range(16)),))
    assert collective_time(c, H100) == pytest.approx(ring)
    # as it was priced before: the whole ring through one 50 GB/s link per GPU, 7.5 times slower
    assert 15 * 10e-6 + 15 / 16 * GIB / 50e9 > 7 * collective_time(c, H100)


def test_one_device_per_node_has_only_its_own_nic():
    """8 nodes, one GPU of each (a data axis outside fsdp=8 in the node): each group crosses on one NIC."""
    ring = 14 * 10e-6 + 2 * 7 / 8 * GIB / 50e9
    tree = 2 * (3 * 10e-6 + 0) + 2 * GIB / 50e9
    assert algorithm_times("all-reduce", GIB, Span(8, 8, 1), H100) == pytest.approx({"ring": ring, "tree": tree})
    assert network_seconds("all-reduce", GIB, Span(8, 8, 1), H100) == pytest.approx(ring)  # large: ring
    small = 64 << 10  # 64 KiB: the tree's log2(8) = 3 latency steps win over the ring's 14
    assert network_seconds("all-reduce", small, Span(8, 8, 1), H100) == pytest.approx(6 * 10e-6 + 2 * small / 50e9)


def test_hierarchical_wins_where_the_nics_are_few():
    """A node of 8 GPUs with 4 NICs of 200 Gb/s (25 GB/s each): 12.5 GB/s per GPU, 100 GB/s per node.
    All-reduce of 1 GiB over 2 such nodes: the ring crosses at 100 GB/s; the hierarchical all-reduce moves
    only an eighth over each GPU's share after a reduce-scatter over NVLink."""
    few = dataclasses.replace(H100, name="few-nics", nics_per_node=4, inter_node_bandwidth=25e9)
    ring = 30 * 10e-6 + 2 * 15 / 16 * GIB / 100e9
    tree = 2 * (1 * 10e-6 + 7 * 5e-6) + 2 * GIB / 100e9
    hierarchical = 2 * (7 * 5e-6 + 7 / 8 * GIB / 450e9) + (2 * 10e-6 + 2 * 1 / 2 * (GIB / 8) / 12.5e9)
    times = algorithm_times("all-reduce", GIB, Span(16, 2, 8), few)
    assert times == pytest.approx({"ring": ring, "tree": tree, "hierarchical": hierarchical})
    assert network_seconds("all-reduce", GIB, Span(16, 2, 8), few) == pytest.approx(hierarchical)
    assert hierarchical < ring


def test_a_reduce_scatter_across_nodes():
    """reduce-scatter, 16 devices on 2 nodes, 64 MiB result per device (its input is 16 x that)."""
    ring = 15 * 10e-6 + 15 * 64 * MIB / 400e9
    hierarchical = (7 * 5e-6 + 7 * 2 * 64 * MIB / 450e9) + (1 * 10e-6 + 1 * 64 * MIB / 50e9)
    assert algorithm_times("reduce-scatter", 64 * MIB, Span(16, 2, 8), H100) == pytest.approx(
        {"ring": ring, "hierarchical": hierarchical})


def test_inside_a_node_it_is_one_ring_over_nvlink():
    assert network_seconds("all-gather", GIB, Span.inside_one_node(8), H100) == pytest.approx(
        7 * 5e-6 + 7 / 8 * GIB / 450e9)
    assert network_seconds("all-reduce", GIB, Span(1, 1, 1), H100) == 0.0


def test_all_to_all_and_permutes_across_nodes():
    """An all-to-all over 16 devices on 2 nodes sends 8/16 of its bytes off the node (over each GPU's NIC share)
    and 7/16 over NVLink, at once; a permute's pair crossing nodes, one NIC."""
    a2a = network_seconds("all-to-all", GIB, Span(16, 2, 8), H100)
    assert a2a == pytest.approx(15 * 10e-6 + max(7 * GIB / (16 * 450e9), 8 * GIB / (16 * 50e9)))
    pair = Collective("collective-permute", MIB, 2, ("pipe",), "cp", devices=((0, 8),))
    assert collective_time(pair, H100) == pytest.approx(10e-6 + MIB / 50e9)


def test_unknown_devices_are_taken_as_one_per_node_beyond_a_node():
    c = Collective("all-gather", GIB, 16, ("data",), "ag")  # no device ids read
    assert collective_time(c, H100) == pytest.approx(15 * 10e-6 + 15 / 16 * GIB / 50e9)


def test_a_profile_of_your_own_without_nics_keeps_one_link_per_device():
    mine = HardwareProfile(name="mine", peak_flops={"bfloat16": 1e15}, memory_bandwidth=1e12, memory_bytes=10**10,
                           intra_node_bandwidth=100e9, intra_node_latency=0.0, inter_node_bandwidth=10e9,
                           inter_node_latency=0.0, devices_per_node=4)
    # 8 devices, 2 nodes of 4: the group's 4 devices on a node cross on their 4 links, 40 GB/s
    assert network_seconds("all-gather", GIB, Span(8, 2, 4), mine) == pytest.approx(
        min(7 / 8 * GIB / 40e9, 1 / 2 * GIB / 4 / 10e9 + 3 / 4 * GIB / 100e9))
    assert math.isclose(mine.network_share, 10e9)


def test_a_gather_xla_cpu_widened_from_bfloat16_counts_bfloat16_bytes():
    """XLA:CPU has no bfloat16 collectives: it converts to float32, gathers, converts back. Read through the
    widening, the gather moves what a GPU sends: 2 bytes per element; a plain float32 gather keeps 4."""
    from multimesh.estimate import find_collectives

    hlo = """
%widen (p: f32[16,8]) -> f32[16,8] {
  %p = f32[16,8]{1,0} parameter(0)
  %narrow = bf16[16,8]{1,0} convert(%p)
  ROOT %wide = f32[16,8]{1,0} convert(%narrow)
}

ENTRY %main (x: f32[16,8]) -> f32[128,8] {
  %x = f32[16,8]{1,0} parameter(0)
  %w = f32[16,8]{1,0} fusion(%x), kind=kLoop, calls=%widen
  %ag = f32[128,8]{1,0} all-gather(%w), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %plain = f32[128,8]{1,0} all-gather(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""
    sent = {c.name: c.bytes for c in find_collectives(hlo, ["fsdp"], [8])}
    assert sent == {"ag": 128 * 8 * 2, "plain": 128 * 8 * 4}
