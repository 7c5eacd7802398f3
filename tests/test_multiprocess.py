"""Pipelines across processes (jax.distributed on localhost): every process's view against one device.

Each test starts its processes (tests/mp_worker.py) on a free port, bounds their time, and ends only
the processes it started. Every process checks the loss of each step (readable everywhere) and the
parameter shards it holds against the same step run on one of its devices, and that the schedule's
order and activation bound held.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import free_port, run_workers

WORKER = Path(__file__).with_name("mp_worker.py")
REPO = WORKER.parent.parent


def run_processes(scenario: str, n: int, per: int, *, schedule: str | Sequence[str] = "1f1b",
                  save_to: Path | None = None, restore_from: Path | None = None, plain_jax_init: bool = False,
                  timeout: float = 420) -> list[dict]:
    """Start ``n`` workers with ``per`` CPU devices each, running ``schedule`` (several: one after the
    other in the same processes), saving their final state to ``save_to``, starting from the checkpoint
    in ``restore_from``; their JSON reports, in process order."""
    env = {"MP_SCHEDULE": schedule if isinstance(schedule, str) else ",".join(schedule)}
    if restore_from is not None:
        env["MP_RESTORE"] = str(restore_from)
    if plain_jax_init:
        env["MP_PLAIN_JAX_INIT"] = "1"
    port = free_port()
    out = [str(save_to)] if save_to is not None else []
    return run_workers([[str(WORKER), scenario, str(i), str(n), str(port), str(per), *out] for i in range(n)],
                       timeout=timeout, extra_env=env)


def check(reports: list[dict], n_stages: int) -> list[dict]:
    """The processes' reports agree (losses equal to one device's: checked in the worker); each process's
    report of its only schedule's run."""
    runs = [r["runs"] for r in reports]
    assert [len(r) for r in runs] == [1] * len(reports)
    check_runs([r[0] for r in runs], n_stages)
    return [r[0] for r in runs]


def check_runs(runs: list[dict], n_stages: int) -> None:
    """One schedule's run as each process saw it."""
    for r in runs:  # the same losses everywhere, equal to one device's (checked in the worker too)
        assert r["losses"] == runs[0]["losses"] and len(r["losses"]) == 3
        assert r["shards_checked"] > 0
        assert r["peak_live"] == r["bound"]  # the worker compared them; both reported
    assert len(runs[0]["leaf_processes"]) == 2 * n_stages


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]


@pytest.mark.slow  # about 10 s: two processes; the default suite keeps shorter ones
def test_every_schedule_two_stages_one_per_process():
    """Every schedule (interleaved: 2 chunks per stage) in one pair of processes, one schedule after the
    other: each process checks each schedule's losses and the parameter shards it holds after 3 steps
    against one device, its executed order against the schedule's and its peak live activations
    against the schedule's bound."""
    reports = run_processes("one_stage_per_process", 2, 1, schedule=SCHEDULES)
    assert [r["process"] for r in reports] == [0, 1]
    for i, schedule in enumerate(SCHEDULES):
        runs = [r["runs"][i] for r in reports]
        assert all(r["schedule"] == schedule for r in runs), (schedule, [r["schedule"] for r in runs])
        chunks = 2 if schedule == "interleaved" else 1
        check_runs(runs, 2 * chunks)
        # each process holds exactly its stages' parameters (a and b), and no shard of the others'
        held = [[0, 1], [2, 3]] if chunks == 1 else [[0, 1, 4, 5], [2, 3, 6, 7]]
        assert [r["held_param_leaves"] for r in runs] == held, schedule
        assert all(runs[0]["leaf_processes"][str(leaf)] == [p] for p in (0, 1) for leaf in held[p])
        assert runs[0]["actions"] > 0


def test_stages_spanning_both_processes():
    """Two stages of 2 + 2 devices each: every stage is one SPMD program across both processes."""
    runs = check(run_processes("stages_span_processes", 2, 4, schedule="zb-h1"), 2)
    assert all(procs == [0, 1] for procs in runs[0]["leaf_processes"].values())
    assert runs[0]["schedule"] == "zb-h1"


def test_stages_of_different_sizes_across_processes():
    """2 devices on one process, 1 on the other: values cross as whole copies. The processes start with
    plain jax.distributed.initialize and the two documented flags."""
    check(run_processes("uneven_stages", 2, 2, plain_jax_init=True), 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_four_processes(schedule):
    runs = check(run_processes("one_stage_per_process", 4, 1, schedule=schedule), 8 if schedule == "interleaved" else 4)
    assert [r["held_param_leaves"] for r in runs][:2] == ([[0, 1], [2, 3]] if schedule == "1f1b" else
                                                             [[0, 1, 8, 9], [2, 3, 10, 11]])


# -- checkpoints across process counts -------------------------------------------------------


def _pipeline_on_this_process():
    """The workers' 2-stage step, in this process on two 4-device submeshes: a restore target."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from multimesh.jax import microbatch, parallelize, task

    tx, devices = optax.adam(1e-2), np.array(jax.devices()[:8])
    meshes = [Mesh(devices[:4], ("model",)), Mesh(devices[4:], ("model",))]
    stages = [task(lambda w, x: x + jnp.tanh(x @ w["a"]) @ w["b"], f"stage{i}", mesh=m) for i, m in enumerate(meshes)]

    def init():
        keys = jax.random.split(jax.random.key(0), 4)
        p = {f"s{i}": {"a": jax.random.normal(keys[2 * i], (16, 32)) * .2,
                       "b": jax.random.normal(keys[2 * i + 1], (32, 16)) * .2} for i in range(2)}
        return {"p": p, "o": tx.init(p)}

    def loss(p, b):
        h = b["x"]
        for i, s in enumerate(stages):
            h = s(p[f"s{i}"], h)
        return jnp.mean((h - b["y"]) ** 2)

    def step(state, b):
        value, grads = jax.value_and_grad(microbatch(loss, 0, 4, argnum=1))(state["p"], b)
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    batch = {"x": np.zeros((16, 16), np.float32), "y": np.zeros((16, 16), np.float32)}
    fn, _ = parallelize(step, init_params=init, initial_batch=batch)
    return fn, init, meshes


@pytest.mark.slow  # about 10 s: two processes; the default suite keeps shorter ones
def test_a_checkpoint_of_two_processes_restores_in_one_and_back(tmp_path):
    """2-process pipeline -> 1 process (one device, and a pipeline) ; 1 process -> 2-process pipeline."""
    import jax
    import numpy as np

    import multimesh.checkpoint as ckpt

    run_processes("one_stage_per_process", 2, 2, save_to=tmp_path / "two")
    saved = np.load(tmp_path / "two" / "reference.npz")  # the one-device state after the same 3 steps
    # (the restore itself is bit for bit: the manager verifies every leaf's checksum)
    want = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    fn, init, meshes = _pipeline_on_this_process()
    one_device = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0])), jax.eval_shape(init))
    with ckpt.CheckpointManager(tmp_path / "two") as mgr:
        assert mgr.info().process_count == 2
        on_one = mgr.restore(target=one_device).state
        on_pipeline = mgr.restore(target=fn.abstract_params).state
    for restored in (on_one, on_pipeline):
        for got, w in zip(jax.tree.leaves(restored), want):
            np.testing.assert_allclose(np.asarray(got), w, rtol=2e-5, atol=1e-6)  # against the 1-device run
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(on_one))
    for i, mesh in enumerate(meshes):  # each stage's parameters on its own submesh of this process
        for leaf in jax.tree.leaves(on_pipeline["p"][f"s{i}"]):
            assert leaf.sharding.device_set == set(mesh.devices.flat)

    # and back: a state saved by one process resumes on the 2-process pipeline
    state = jax.jit(init)()
    with ckpt.CheckpointManager(tmp_path / "one") as mgr:
        mgr.save(0, state)
    np.savez(tmp_path / "one" / "reference.npz", *[np.asarray(x) for x in jax.tree.leaves(state)])
    reports = run_processes("one_stage_per_process", 2, 2, restore_from=tmp_path / "one")
    check(reports, 2)


def _worker_env() -> dict[str, str]:
    """This environment for a worker, without the caller's XLA flags, importing this checkout's multimesh."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _kill_mid_run(victim: int) -> tuple[subprocess.Popen, str, float]:
    """Run a long 2-process pipeline, SIGKILL process ``victim`` after its 5th step; the survivor, its
    stderr and how long it took to exit after the kill."""
    env = _worker_env()
    env["MP_STEPS"] = "1000000"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "one_stage_per_process", str(i), "2", str(port), "2"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    survivor = procs[1 - victim]
    try:
        deadline = time.monotonic() + 300
        while not procs[victim].stdout.readline().startswith("step 5"):
            assert time.monotonic() < deadline and procs[victim].poll() is None, "the run did not reach step 5"
        procs[victim].kill()
        killed = time.monotonic()
        _, err = survivor.communicate(timeout=120)
        return survivor, err, time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


#: what JAX's coordination service prints when it aborts a process from C++ (SIGABRT, status 134)
JAX_ABORT = re.compile(r"detected fatal errors|another task died|Terminating process")


@pytest.mark.slow  # about 10 s: two processes; the default suite keeps shorter ones
def test_a_killed_process_stops_the_other_with_an_error_naming_it():
    """Process 1 killed mid-run: process 0 ends with multimesh's ProcessLostError naming it (the step's
    error, or presence after its grace), within seconds; never by JAX's abort."""
    survivor, err, seconds = _kill_mid_run(victim=1)
    assert survivor.returncode == 1 and seconds < 40, (survivor.returncode, seconds, err[-3000:])
    assert "ProcessLostError" in err and "process(es) [1] stopped" in err, err[-3000:]
    assert not JAX_ABORT.search(err), err[-3000:]


@pytest.mark.slow  # about 10 s a try: two processes
def test_killing_the_coordinator_stops_the_other_with_process_lost_error_every_time():
    """Process 0, which holds JAX's coordination service, killed mid-run: process 1 ends with
    ProcessLostError naming process 0, every try, never JAX's C++ abort (which JAX's client delivers
    within a second of the service's socket closing, where it connects to it directly)."""
    for attempt in range(3):
        survivor, err, seconds = _kill_mid_run(victim=0)
        assert survivor.returncode == 1 and seconds < 40, (attempt, survivor.returncode, seconds, err[-3000:])
        assert "ProcessLostError" in err and "process 0 (the coordinator) stopped" in err, (attempt, err[-3000:])
        assert not JAX_ABORT.search(err), (attempt, err[-3000:])


@pytest.mark.slow  # about 10 s a try: two processes that only join
def test_killing_the_coordinator_while_the_other_waits_in_jax_ends_it_with_process_lost_error():
    """Process 1 blocked in a JAX call (a key-value read) when process 0 is killed: it ends with
    ProcessLostError naming process 0 within the presence grace, every try. (JAX's client, connected to
    the coordination service directly, aborts it from C++ within a second of the service's socket
    closing.)"""
    env = _worker_env()
    worker = WORKER.with_name("mp_waiting_worker.py")
    for attempt in range(3):
        port = free_port()
        procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port)], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        try:
            assert procs[1].stdout.readline().strip() == "up", procs[1].stderr.read()[-3000:]
            procs[0].kill()
            killed = time.monotonic()
            _, err = procs[1].communicate(timeout=60)
            seconds = time.monotonic() - killed
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        assert procs[1].returncode == 1 and seconds < 20, (attempt, procs[1].returncode, seconds, err[-3000:])
        assert "ProcessLostError" in err and "process 0 (the coordinator) stopped" in err, (attempt, err[-3000:])
        assert not JAX_ABORT.search(err), (attempt, err[-3000:])


#: the trainer's pipeline config, small (as tests/test_launchers.py runs it), saving every 2 steps, no end
TRAINER_PIPELINE = ["-m", "trainers", "pipeline", "model.d_model=32", "model.max_len=32", "data.seq_len=32",
                    "data.batch_size=8", "data.max_bytes=200000", "train.eval_batches=2", "train.log_every=1",
                    "train.steps=100000", "train.checkpoint_every=2", "-q"]


def _trainer_reached(out: Path, moment: str) -> bool:
    """Whether process 0's run in ``out`` reached ``moment``: "start" (it wrote its first file), "step" (a
    metrics line), "save" (a checkpoint step being written)."""
    if moment == "start":
        return out.is_dir() and any(out.iterdir())
    if moment == "step":
        return (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 1
    return (out / "checkpoints").is_dir() and any(p.name[0].isdigit() or p.name.startswith(".")
                                                   for p in (out / "checkpoints").iterdir())


@pytest.mark.slow  # a minute a try: two trainer processes start, compile and train
@pytest.mark.parametrize("moment", ["start", "step", "save"])
def test_killing_process_0_of_the_trainer_ends_process_1_with_process_lost_error(tmp_path, moment):
    """``multimesh-train pipeline`` on 2 processes, process 0 killed (SIGKILL) during start-up (after JAX
    joined), at a step or during a save: process 1 exits 1 with ProcessLostError naming process 0, twice
    in a row, never by JAX's C++ abort (status 134, "detected fatal errors")."""
    for attempt in range(2):
        out, port = tmp_path / f"run{attempt}", free_port()
        procs = [subprocess.Popen([sys.executable, *TRAINER_PIPELINE, f"train.out_dir={out}", "--coordinator",
                                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)], cwd=REPO,
                                  env=_worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        try:
            deadline = time.monotonic() + 300
            while not _trainer_reached(out, moment):
                assert time.monotonic() < deadline and procs[0].poll() is None, (moment, procs[0].poll())
                time.sleep(0.02)
            if moment == "start":
                time.sleep(1.0)  # JAX's start-up, compiling
            procs[0].kill()
            killed = time.monotonic()
            _, err = procs[1].communicate(timeout=120)
            seconds = time.monotonic() - killed
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        assert procs[1].returncode == 1 and seconds < 30, (attempt, procs[1].returncode, seconds, err[-3000:])
        assert "ProcessLostError" in err and "process 0 (the coordinator)" in err, (attempt, err[-3000:])
        assert not JAX_ABORT.search(err), (attempt, err[-3000:])


def test_the_transfer_port_stays_reserved_for_jax():
    """`initialize` picks this process's transfer port and keeps it bound (``SO_REUSEPORT``, never
    listening) until the process ends: JAX's transfer server, which binds it only at the first transfer,
    can still listen on it, while no other bind can take it in between."""
    import errno
    import socket

    from multimesh import distributed

    address = distributed._free_address("127.0.0.1", 9)
    ip, port = address.rsplit(":", 1)
    try:
        with socket.socket() as plain, pytest.raises(OSError) as taken:
            plain.bind((ip, int(port)))
        assert taken.value.errno == errno.EADDRINUSE
        with socket.socket() as server:  # what JAX's transfer server does
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind((ip, int(port)))
            server.listen()
            with socket.create_connection((ip, int(port)), timeout=5):
                conn, _ = server.accept()  # the connection reaches the listener, not the reservation
                conn.close()
    finally:
        distributed._RESERVED.pop().close()


@pytest.mark.slow  # about 12 s: two processes
@pytest.mark.parametrize("checksums", [True, False],
                         ids=["checksums", "no-checksums"])
def test_a_save_that_loses_a_process_names_it_and_keeps_nothing(tmp_path, checksums):
    """Process 1 leaves (without a goodbye, as a killed process) after both saved step 0; process 0's
    save of step 1 fails in an exchange (the checksums' gather, or Orbax's own barrier without checksums)
    with a `ProcessLostError` naming process 1, or, blocked in that exchange, is stopped by presence with
    the same error; within the heartbeat timeout, never by JAX's abort, and step 0 is all there is."""
    env = _worker_env()
    port, worker = free_port(), WORKER.with_name("mp_lost_save_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), str(tmp_path / "ck"), str(int(checksums))],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    started = time.monotonic()
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    kept = [p for p in os.listdir(tmp_path / "ck") if not p.startswith(".")]
    assert not JAX_ABORT.search(err), err[-3000:]
    assert kept == ["0"] and time.monotonic() - started < 60, (kept, err[-3000:])
    if procs[0].returncode == 1:  # blocked in a barrier that waits for process 1: presence named it and stopped
        assert "ProcessLostError" in err and "process(es) [1] stopped" in err, err[-3000:]
        return
    assert procs[0].returncode == 0, (procs[0].returncode, err[-3000:])
    report = json.loads(out.strip().splitlines()[-1])
    assert report["error"] == "ProcessLostError", report
    assert "process(es) [1] stopped" in report["message"] and "Nothing of step 1 was kept" in report["message"]
    assert report["seconds"] < 30, report
    assert report["steps"] == [0]


@pytest.mark.slow  # about 15 s a try: two processes
@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no-checksums"])
def test_a_process_killed_during_a_save_ends_the_other_with_process_lost_error(tmp_path, checksums):
    """Process 1 is killed (SIGKILL) while both save step 1: process 0 ends with multimesh's
    `ProcessLostError` naming process 1, every try, within the heartbeat timeout; never by JAX's abort
    ("another task died", SIGABRT), which its coordination service would deliver at that timeout."""
    env = _worker_env()
    worker = WORKER.with_name("mp_lost_save_worker.py")
    for attempt in range(3):
        port, directory = free_port(), tmp_path / f"ck{attempt}"
        procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), str(directory), str(int(checksums)),
                                   "during"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for i in range(2)]
        try:
            assert procs[1].stdout.readline().strip() == "saving", procs[1].stderr.read()[-3000:]
            procs[1].kill()
            killed = time.monotonic()
            out, err = procs[0].communicate(timeout=120)
            seconds = time.monotonic() - killed
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        assert procs[0].returncode in (0, 1) and seconds < 10, (attempt, procs[0].returncode, seconds, err[-3000:])
        assert "another task died" not in err and "detected fatal errors" not in err, err[-3000:]
        if procs[0].returncode == 0:  # the save raised it, and the worker reported it
            report = json.loads(out.strip().splitlines()[-1])
            assert report["error"] == "ProcessLostError" and "process(es) [1] stopped" in report["message"], report
        else:  # blocked in a barrier that waits for process 1: it printed the error and stopped itself
            assert "ProcessLostError" in err and "process(es) [1] stopped" in err, err[-3000:]
        kept = [p for p in os.listdir(directory) if p.isdigit()]
        assert kept in (["0"], ["0", "1"]), kept  # step 1 only if process 0 committed it whole

