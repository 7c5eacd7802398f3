"""One of two processes saving checkpoints (started by tests/test_multiprocess.py).

    python tests/mp_lost_save_worker.py PROCESS_ID COORDINATOR_PORT CHECKPOINT_DIR CHECKSUMS [during]

Both processes save step 0 of an array sharded over their two devices; then
process 1 leaves and process 0 saves step 1 alone, which must fail naming
process 1. Process 0 prints one JSON line: the error's type and message, how long
it took, and the steps its manager lists afterwards. With ``during``, both start
saving step 1 and process 1, once its save is under way, prints "saving" and waits
to be killed (SIGKILL, by the test).
"""

from __future__ import annotations

import json
import os
import sys
import time

PID, PORT, DIRECTORY, CHECKSUMS = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
DURING = sys.argv[5:] == ["during"]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.checkpoint as ckpt
import multimesh.distributed

multimesh.distributed.initialize(f"127.0.0.1:{PORT}", 2, PID, heartbeat_timeout_seconds=10)
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.make_array_from_callback((4,), NamedSharding(mesh, P("x")), lambda i: np.arange(4.0)[i])
mgr = ckpt.CheckpointManager(DIRECTORY, checksums=CHECKSUMS)
mgr.save(0, {"x": x})
mgr.wait_until_finished()
if PID == 1 and DURING:
    mgr.save(1, {"x": x})  # asynchronous: the writing goes on in the background
    print("saving", flush=True)
    time.sleep(600)
if PID == 1:
    os._exit(0)  # gone without a word: as a killed process is
started = time.monotonic()
try:
    mgr.save(1, {"x": x})
    mgr.wait_until_finished()
    error = None
except Exception as e:  # what the test checks
    error = e
print(json.dumps({"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started,
                  "steps": mgr.all_steps()}), flush=True)
os._exit(0)  # JAX's shutdown would wait for process 1
