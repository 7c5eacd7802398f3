"""`calibrate` across processes: every process ends with the same profile, each figure its slowest process's.

The test starts its processes (tests/mp_calibrate_worker.py) on a free port, bounds their time, and ends only
the processes it started.
"""

from __future__ import annotations

from pathlib import Path

from helpers import free_port, run_workers

WORKER = str(Path(__file__).with_name("mp_calibrate_worker.py"))


def test_processes_calibrate_one_profile_from_their_slowest_figures():
    port, n = free_port(), 2
    reports = run_workers([[WORKER, str(i), str(n), str(port), "2"] for i in range(n)], timeout=240)
    # each process timed its own calls: without agreeing, no two measured figures would be equal
    assert reports[0]["profile"] == reports[1]["profile"]
    profile = reports[0]["profile"]
    assert profile["peak_flops"]["float32"] > 0 and profile["memory_bandwidth"] > 0
    assert profile["intra_node_bandwidth"] > 0 and profile["launch_overhead"] > 0
    assert profile["devices_per_node"] == 4 and profile["alone_speedup"] == 1.0
    # process p made up p + 1 of everything: rates the least (process 0's), costs the most (process 1's), and
    # the fresh-memory rate the one process that saw it
    for r in reports:
        got = r["agreed"]
        assert got["flops"] == got["memory_bandwidth"] == got["link"] == 1.0
        assert got["memory_bytes"] == float(1 << 30)
        assert got["launch"] == got["latency"] == got["copy_latency"] == 2.0
        assert got["fresh_memory_rate"] == 5.0
