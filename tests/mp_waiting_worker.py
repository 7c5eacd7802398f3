"""One of two processes that join a run and then wait on JAX's coordination service (started by
tests/test_multiprocess.py).

    python tests/mp_waiting_worker.py PROCESS_ID COORDINATOR_PORT

Each process joins with `multimesh.distributed.initialize`, prints "up", and waits in a blocking read of
a key nobody sets: a process blocked in a JAX call while the test kills the other one (SIGKILL).
"""

from __future__ import annotations

import os
import sys

PID, PORT = int(sys.argv[1]), int(sys.argv[2])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"

import multimesh.distributed
from multimesh._compat.jax import coordination_client

multimesh.distributed.initialize(f"127.0.0.1:{PORT}", 2, PID, heartbeat_timeout_seconds=30)
print("up", flush=True)
coordination_client().blocking_key_value_get("never-set", 120_000)
