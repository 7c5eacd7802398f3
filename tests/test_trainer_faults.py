"""The trainer when its ``out_dir`` is shared or its disk fills.

* One run per ``out_dir``: a second run exits 2 naming the first (host, pid,
  lock file) before it writes anything; a lock left by a killed run is taken
  over with a message.
* A checkpoint that cannot be written (a real full disk: a small tmpfs in a
  user namespace) stops the run with ``CheckpointSaveError`` at a step, not at
  the next save; the partial step is gone, the previous checkpoint intact,
  and resuming from it once there is space ends bit for bit as a run that
  never failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import in_a_small_tmpfs

from multimesh.checkpoint.dirlock import DirectoryInUseError, DirectoryLock
from trainers.config import load_config
from trainers.run_lock import RUN_LOCK
from trainers.train import train

REPO = Path(__file__).resolve().parent.parent
#: the tiny config shrunk to one block: seconds to build and run
TINY = ["model.d_model=32", "model.max_len=32", "model.num_layers=1", "data.seq_len=32", "data.batch_size=8",
        "data.max_bytes=200000", "train.eval_batches=2", "train.eval_every=1000", "train.log_every=1"]
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

_HOLDER = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from trainers.run_lock import out_dir_lock
    out = Path({out!r})
    out.mkdir(parents=True, exist_ok=True)
    lock = out_dir_lock(out)
    lock.acquire()  # what a run does at its start
    print("HOLDING", flush=True)
    if {die!r}:
        os.kill(os.getpid(), signal.SIGKILL)  # ends without releasing it
    time.sleep(300)
""")


def _holder(out: Path, die: bool) -> subprocess.Popen:
    """A process holding ``out`` as a run does (and dying at once if ``die``)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER.format(repo=str(REPO), out=str(out), die=die)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    line = proc.stdout.readline()  # bounded: the child prints it or ends
    assert line.strip() == "HOLDING", line + proc.stderr.read()[-3000:]
    return proc


def test_directory_lock_excludes_a_second_holder_and_reports_a_dead_one(tmp_path):
    first = DirectoryLock(tmp_path, what="job A", name="x.lock", fix="Do this.")
    assert first.acquire() is None and first.held
    second = DirectoryLock(tmp_path, what="job B", name="x.lock", fix="Do this.")
    with pytest.raises(DirectoryInUseError) as err:
        second.acquire()
    assert err.value.holder.pid == os.getpid() and err.value.lock_path == str(tmp_path / "x.lock")
    assert str(err.value).startswith(f"{tmp_path} is in use by job A on host {socket.gethostname()}, "
                                      f"pid {os.getpid()} (this process)")
    assert str(err.value).endswith(f"lock file {tmp_path / 'x.lock'}. Do this.")
    first.release()
    assert not (tmp_path / "x.lock").exists()
    assert second.acquire() is None  # released cleanly: nothing stale to report
    second.release()

    dead = _holder(tmp_path, die=True)
    assert dead.wait(timeout=60) == -signal.SIGKILL
    third = DirectoryLock(tmp_path, what="job C", name=RUN_LOCK, fix="")
    stale = third.acquire()
    assert stale is not None and (stale.what, stale.host, stale.pid) == (
        "multimesh-train", socket.gethostname(), dead.pid)
    third.release()


def test_a_second_run_on_one_out_dir_exits_2_naming_the_first(tmp_path):
    out = tmp_path / "run"
    holder = _holder(out, die=False)
    try:
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "trainers", "tiny", *TINY, "train.steps=2",
                                 f"train.out_dir={out}", "-q"], cwd=REPO, env=ENV, capture_output=True,
                                text=True, timeout=120, check=False)
        took = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode == 2, second.stderr[-3000:]
    for name in (f"{out} is in use by multimesh-train on host {socket.gethostname()}, pid {holder.pid}",
                 f"lock file {out / RUN_LOCK}", "give this run another train.out_dir"):
        assert name in second.stderr, second.stderr[-3000:]
    assert "Traceback" not in second.stderr, second.stderr[-3000:]
    assert took < 60, f"refused after {took:.0f} s"
    assert sorted(os.listdir(out)) == [RUN_LOCK]  # the second run wrote nothing


def test_a_run_takes_over_the_out_dir_of_a_killed_run(tmp_path, capfd):
    out = tmp_path / "run"
    dead = _holder(out, die=True)
    assert dead.wait(timeout=60) == -signal.SIGKILL and (out / RUN_LOCK).exists()
    result = train(load_config("tiny", [*TINY, "train.steps=2", "train.checkpoint_every=0",
                                        f"train.out_dir={out}"]), quiet=True)
    assert result.step == 2
    err = capfd.readouterr().err
    assert (f"multimesh-train: taking over {out} from multimesh-train on host {socket.gethostname()}, "
            f"pid {dead.pid}") in err, err
    assert not (out / RUN_LOCK).exists()  # released at the end


@pytest.mark.slow  # ~40 s: two real runs at once
def test_two_cli_runs_on_one_out_dir(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "trainers", "tiny", *TINY, "train.steps=60", "train.checkpoint_every=1",
            f"train.out_dir={out}", "-q"]
    first = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "1").is_dir():
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run(args, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120, check=False)
        assert second.returncode == 2 and f"pid {first.pid}" in second.stderr, second.stderr[-3000:]
        assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
    finally:
        first.kill()
        first.wait()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 61))  # one writer: every step once, in order


# --------------------------------------------------------------- full disk
_FULL_DISK_RUN = textwrap.dedent("""
    import json, os, sys, traceback
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    import numpy as np, jax
    from multimesh.checkpoint import CheckpointSaveError
    from multimesh.checkpoint import CheckpointManager
    from trainers.config import load_config
    from trainers.train import train
    polls = []  # the trainer polls its checkpoint manager once a step: count them
    def counted(self, poll=CheckpointManager.poll):
        polls.append(1)
        return poll(self)
    CheckpointManager.poll = counted
    mount, out = Path({mount!r}), Path({mount!r}) / "run"
    cfg = load_config("tiny", [*{tiny!r}, "train.steps=120", "train.checkpoint_every=40",
                                 "train.log_every=1000", f"train.out_dir={{out}}"])  # no metrics write meanwhile
    report = {{}}
    train(cfg, quiet=True, stop_after=41)  # checkpoint 40 committed
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    with open(mount / "filler", "wb") as f:  # leave 96 KiB: the metrics fit, a checkpoint does not
        os.posix_fallocate(f.fileno(), 0, free - 96 * 1024)
    polls.clear()
    try:
        train(cfg, quiet=True)
    except CheckpointSaveError as e:
        report.update(message=str(e), step=e.step, raised_in=[f.name for f in traceback.extract_tb(e.__traceback__)],
                      at_step=40 + len(polls))
    report["after_failure"] = sorted(os.listdir(out / "checkpoints"))
    os.remove(mount / "filler")
    resumed = train(cfg, quiet=True)  # from checkpoint 40, now that there is space
    whole = train(cfg.replace(train={{"out_dir": str(mount / "whole"), "checkpoint_every": 0}}), quiet=True)
    report["start"] = resumed.start_step
    report["same_losses"] = all(resumed.losses[s] == whole.losses[s] for s in range(41, 121))
    report["same_params"] = all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(jax.device_get(resumed.state)), jax.tree.leaves(jax.device_get(whole.state))))
    report["same_val_loss"] = resumed.val_loss == whole.val_loss
    print("REPORT", json.dumps(report), flush=True)
""")


def test_a_full_disk_stops_the_run_at_a_step_and_it_resumes_from_the_last_checkpoint(tmp_path):
    """A real full disk: the run's out_dir on a 16 MiB tmpfs in a user namespace
    (no root needed), filled after the step-40 checkpoint but for 96 KiB. Metrics are logged only at
    the end, so that the checkpoint is the only write that meets the full disk."""
    mount = tmp_path / "disk"
    mount.mkdir()
    child = _FULL_DISK_RUN.format(repo=str(REPO), mount=str(mount), tiny=TINY)
    cmd = in_a_small_tmpfs(str(mount), "16m", [sys.executable, "-c", child])
    if cmd is None:
        pytest.skip("no user namespaces here (unshare -Urm) to mount a small tmpfs")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])
    directory = mount / "run" / "checkpoints"
    assert report["message"].startswith(f"could not save checkpoint step 80 in {directory}: "
                                        f"No space left on device"), report
    assert report["step"] == 80
    # raised by the per-step check, before the run reached its next save (step 120)
    assert "poll" in report["raised_in"] and 80 < report["at_step"] < 120, report
    assert report["after_failure"] == ["40"], report  # the partial step 80 removed, step 40 kept
    assert report["start"] == 40 and report["same_losses"] and report["same_params"] and report["same_val_loss"], \
        report
    assert "RESOURCE_EXHAUSTED" not in proc.stderr, proc.stderr[-3000:]
    shutil.rmtree(mount, ignore_errors=True)


def test_a_first_save_failing_while_its_arrays_are_written_stops_the_run_at_the_next_step(tmp_path, monkeypatch):
    """The first checkpoint (step 4) hits a full disk in its document while its arrays are still being
    written (a test double of the writing layer, `first_save_failing_while_its_state_is_written`): the
    trainer's check before each step raises `CheckpointSaveError` at the first step that begins after the
    failed part ended, without waiting for the arrays (held 6 s), not at the next save nor at the end; no
    step 4 is left that looks complete."""
    from helpers import first_save_failing_while_its_state_is_written

    from multimesh.checkpoint import CheckpointManager, CheckpointSaveError

    run = tmp_path / "run"
    polls: list[float] = []  # when each step's check began
    raised: list[bool] = []  # whether the arrays were written when it raised
    poll = CheckpointManager.poll

    def timed(self):
        polls.append(time.monotonic())
        try:
            return poll(self)
        except CheckpointSaveError:
            raised.append(double.written.is_set())
            raise
    monkeypatch.setattr(CheckpointManager, "poll", timed)
    cfg = load_config("tiny", [*TINY, "train.steps=12", "train.checkpoint_every=4", f"train.out_dir={run}"])
    with first_save_failing_while_its_state_is_written(most_s=6.0) as double, \
            pytest.raises(CheckpointSaveError, match=r"could not save checkpoint step 4 .*No space left on device"):
        train(cfg, quiet=True)
    assert raised == [False], raised  # raised by a step's check, while the arrays were still written
    # the first check after the part failed; a watcher thread takes the failure's time, which a loaded machine
    # may run only after the raising check began: then no check began after it, and the raising one is the last
    first_after = next((i for i, t in enumerate(polls) if t > double.failed_at[0]), len(polls) - 1)
    assert len(polls) - 1 <= first_after, (len(polls), first_after)
    assert len(polls) < 8  # before the next save (step 8)
    assert not any(p.name.startswith("4") for p in (run / "checkpoints").iterdir())  # removed once written


@pytest.mark.parametrize("damage", ["no state item", "unreadable manifest"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(tmp_path, capfd, damage):
    """Step 4's directory lost its ``state`` item (or its manifest is garbage): the resumed run names
    step 4 and its path, resumes from step 2, moves step 4 aside (kept) and saves its own step 4."""
    run = tmp_path / "run"
    steps = ["train.checkpoint_every=2", "train.keep=3", f"train.out_dir={run}"]
    train(load_config("tiny", [*TINY, *steps, "train.steps=4"]), quiet=True)
    step4 = run / "checkpoints" / "4"
    if damage == "no state item":
        shutil.rmtree(step4 / "state")
    else:
        (step4 / "multimesh" / "metadata").write_bytes(b"\x9c\xff" * 64)
    capfd.readouterr()
    result = train(load_config("tiny", [*TINY, *steps, "train.steps=6"]), quiet=True)
    err = capfd.readouterr().err
    assert result.start_step == 2, err
    assert f"checkpoint step 4 is corrupt or unreadable ({step4}" in err, err
    assert "Resuming from step 2, the newest intact one" in err and f"moved to {run / 'checkpoints' / 'corrupt-4'}" \
        in err, err
    assert (run / "checkpoints" / "corrupt-4").is_dir()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4", "6"]


def test_no_intact_checkpoint_raises_the_newest_steps_error_and_moves_nothing(tmp_path):
    run = tmp_path / "run"
    steps = ["train.checkpoint_every=2", f"train.out_dir={run}", "train.steps=2"]
    train(load_config("tiny", [*TINY, *steps]), quiet=True)
    shutil.rmtree(run / "checkpoints" / "2" / "state")
    from multimesh.checkpoint import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError, match=r"step 2 is corrupt .*'state' item \(the arrays\) is missing"):
        train(load_config("tiny", [*TINY, *steps]), quiet=True)
    assert (run / "checkpoints" / "2").is_dir() and not (run / "checkpoints" / "corrupt-2").exists()
