"""One process of the multi-process calibration test (started by tests/test_estimate_processes.py).

    python tests/mp_calibrate_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR_PORT DEVICES_PER_PROCESS

Calibrates every device of every process at small sizes, then agrees made-up figures that differ by
process (process ``p`` measured ``p + 1`` of each; only the last process saw fresh memory) and prints
one JSON line: the calibrated profile's fields and the agreed figures.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys

PID, NPROC, PORT, PER = (int(a) for a in sys.argv[1:5])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={PER}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
from jax.sharding import Mesh

import multimesh.distributed
from multimesh.estimate import calibrate

multimesh.distributed.initialize(f"127.0.0.1:{PORT}", NPROC, PID, heartbeat_timeout_seconds=10)
here = calibrate(matmul_size=64, copy_bytes=1 << 16, collective_bytes=1 << 16, fresh_bytes=0, repeats=2)
profile = {f.name: getattr(here, f.name) for f in dataclasses.fields(here)}
calibration = importlib.import_module("multimesh.estimate.calibrate")  # the module: its name is the function's
made_up = {k: float(PID + 1) for k in (*calibration._RATES, *calibration._COSTS)}
made_up["memory_bytes"] = float((PID + 1) << 30)
made_up["fresh_memory_rate"] = 5.0 if PID == NPROC - 1 else 0.0
agreed = calibration._slowest(made_up, Mesh(np.array(jax.devices()), ("d",)))
print(json.dumps({"process": PID, "profile": profile, "agreed": agreed}, default=repr), flush=True)
jax.distributed.shutdown()
