"""The trainer's guards: a run that diverges, and a run that is preempted.

* Non-finite: ``optimizer.lr=1e3`` makes the tiny model diverge within a few
  steps. With ``train.on_nonfinite=stop`` (the default) the CLI exits 3 naming
  the first bad step and the last checkpoint, every checkpoint on disk is
  finite, and the JSON outputs are strict; with ``warn`` the run goes on, and
  restoring the non-finite checkpoint it leaves warns naming the leaves.
* Preemption: SIGTERM sent from outside to a running ``multimesh-train``
  makes it checkpoint the current step and exit 143; resuming ends bit for
  bit where an uninterrupted run ends. SIGINT does the same with 130 (in this
  process, which also checks the previous handlers come back), and a second
  signal ends the process at once.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import free_port
from test_trainer import RTOL, SMALL, params_of

from multimesh.checkpoint import CheckpointManager, NonFiniteCheckpointWarning
from trainers.cli import main
from trainers.config import ConfigError, load_config
from trainers.feed import Feed
from trainers.metrics import read_metrics
from trainers.nonfinite import NonFiniteWarning
from trainers.train import train

REPO = Path(__file__).resolve().parent.parent

#: SMALL with one block: the cheapest model every guard needs.
GUARDED = [*SMALL, "model.num_layers=1"]
#: Diverges within ~6 steps (no warmup to soften it).
DIVERGE = ["optimizer.lr=1e3", "optimizer.warmup_steps=0"]


def _strict_lines(path: Path) -> list[dict]:
    """The JSON objects of a file (of each line of a .jsonl), refusing the non-standard NaN/Infinity."""

    def refuse(name: str):
        raise AssertionError(f"{path.name} holds a bare {name}: not JSON")

    text = path.read_text()
    if path.suffix == ".json":
        return [json.loads(text, parse_constant=refuse)]
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def _committed_steps(run: Path) -> list[int]:
    with CheckpointManager(run / "checkpoints", read_only=True) as mgr:
        return mgr.all_steps()


# -- non-finite -----------------------------------------------------------------------------


def test_on_nonfinite_is_validated():
    assert load_config("tiny").train.on_nonfinite == "stop"
    assert load_config("tiny", ["train.on_nonfinite=warn"]).train.on_nonfinite == "warn"
    with pytest.raises(ConfigError, match=r"train: on_nonfinite='ignore': use one of \['stop', 'warn'\]"):
        load_config("tiny", ["train.on_nonfinite=ignore"])


@pytest.fixture(scope="module")
def diverged_with_warn(tmp_path_factory):
    """The diverging config under ``warn``, a metrics line per step: the oracle for the first bad step."""
    out = tmp_path_factory.mktemp("warn")
    cfg = load_config("tiny", [*GUARDED, *DIVERGE, "train.steps=10", "train.log_every=1",
                               "train.checkpoint_every=5", "train.on_nonfinite=warn", f"train.out_dir={out}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(cfg, quiet=True)
    return result, [w for w in caught if issubclass(w.category, NonFiniteWarning)]


# every step is a checkpoint step (each must be checked before it is saved, though the loop would
# otherwise wait only every 4 steps); or every 3rd, where one wait fetches several steps' metrics
@pytest.mark.parametrize("checkpoint_every", [1, 3])
def test_nonfinite_stops_at_the_first_bad_step_and_saves_nothing_nonfinite(tmp_path, capsys, diverged_with_warn,
                                                                           checkpoint_every):
    """``multimesh-train tiny optimizer.lr=1e3``: exit 3, the message names the first step whose loss or
    gradient norm is not finite and the last checkpoint; every checkpoint on disk restores finite."""
    records = _strict_lines(diverged_with_warn[0].out_dir / "metrics.jsonl")
    first_bad = min(r["step"] for r in records if r["loss"] is None or r["grad_norm"] is None)
    args = ["tiny", *GUARDED, *DIVERGE, "train.steps=10", "train.log_every=5",
            f"train.checkpoint_every={checkpoint_every}", f"train.out_dir={tmp_path}", "-q"]
    t0 = time.monotonic()
    assert main(args) == 3
    assert time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    saved = _committed_steps(tmp_path)
    assert saved and max(saved) < first_bad, (saved, first_bad)  # the check comes before each save
    assert f"non-finite values at step {first_bad} " in err, err
    assert f"the last checkpoint, step {max(saved)} ({tmp_path / 'checkpoints' / str(max(saved))})" in err, err
    assert "Lower optimizer.lr (now 1000) and run again to resume from it" in err and "Traceback" not in err
    assert "train.on_nonfinite=warn" in err
    assert not (tmp_path / "summary.json").exists()
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if not p.name.isdigit()]  # no partial save
    lines = _strict_lines(tmp_path / "metrics.jsonl")
    assert lines[-1]["step"] >= first_bad  # the bad losses are logged (as null), not dropped
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteCheckpointWarning)
        from trainers.sample import load_checkpoint

        for step in saved:
            params = load_checkpoint(tmp_path, step).params
            assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_nonfinite_parameters_stop_the_run_though_loss_and_gradient_are_finite(tmp_path, capsys):
    """``optimizer.lr=inf``: the first update makes the parameters non-finite while that step's loss and
    gradient norm, computed before it, are finite. The run stops at step 1, on the parameters alone (a
    check of the loss and gradient only would go on to step 2), and saves nothing."""
    args = ["tiny", *GUARDED, "optimizer.lr=inf", "optimizer.warmup_steps=0", "train.steps=2", "train.log_every=1",
            "train.checkpoint_every=1", f"train.out_dir={tmp_path}", "-q"]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "non-finite values at step 1 (" in err and "parameter value(s) NaN or infinite after the update" in err, err
    assert "loss" not in err.split("non-finite values at step 1 (")[1].split(")")[0], err  # the parameters alone
    assert "no checkpoint had been saved yet" in err and not _committed_steps(tmp_path)
    (first,) = _strict_lines(tmp_path / "metrics.jsonl")  # step 1 logged; its loss and gradient finite
    assert first["step"] == 1 and np.isfinite(first["loss"]) and np.isfinite(first["grad_norm"]), first


def test_warn_goes_on_writes_strict_json_and_its_checkpoint_warns_on_restore(diverged_with_warn):
    result, caught = diverged_with_warn
    assert result.step == 10 and len(caught) == 1 and "non-finite values at step" in str(caught[0].message)
    assert not math.isfinite(result.val_loss)
    (summary,) = _strict_lines(result.out_dir / "summary.json")  # indented, but one JSON object
    assert summary["val_loss"] is None and summary["step"] == 10
    records = _strict_lines(result.out_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 11)) and records[-1]["val_loss"] is None
    from trainers.sample import load_checkpoint

    with pytest.warns(NonFiniteCheckpointWarning, match=r"checkpoint step 10 \(.*/checkpoints/10\) holds NaN or "
                                                        r"infinite values in \d+ leaf/leaves: .*params/embed/embedding"
                                                        r".* and \d+ more; .*restore an earlier step"):
        load_checkpoint(result.out_dir, 10)


def test_restore_warns_naming_the_nonfinite_leaves_only(tmp_path):
    """``CheckpointManager.restore`` of a state with a NaN and an inf (sharded, and in bfloat16)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    w = np.ones((8, 4), np.float32)
    w[5, 3] = np.nan  # in one shard of eight
    state = {"ok": jax.device_put(np.ones((8, 4), np.float32), sharded),
             "w": jax.device_put(w, sharded),
             "h": jnp.array([1.0, np.inf], jnp.bfloat16),
             "step": jnp.array(3, jnp.int32)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        mgr.save(2, {**state, "w": state["ok"], "h": jnp.ones(2, jnp.bfloat16)})
        mgr.wait_until_finished()
        with pytest.warns(NonFiniteCheckpointWarning) as caught:
            mgr.restore(1, target=state)
        message = str(caught[0].message)
        assert "checkpoint step 1" in message and "in 2 leaf/leaves: h, w;" in message and "ok" not in message
        with warnings.catch_warnings():
            warnings.simplefilter("error", NonFiniteCheckpointWarning)
            mgr.restore(2, target=state)


# -- preemption -------------------------------------------------------------------------------

#: A CLI run whose steps after the third are slowed (by its input feed) so that a signal sent
#: from outside lands mid-run; the numbers are those of the plain CLI.
_SLOW_CLI = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from trainers.feed import Feed
    plain = Feed.__next__
    def slowed(self):
        if self.dataset.step >= 3:
            time.sleep(0.4)
        return plain(self)
    Feed.__next__ = slowed
    from trainers.cli import main
    sys.exit(main({args!r}))
""")

PREEMPT = ["train.steps=12", "train.log_every=1", "train.checkpoint_every=5", "train.eval_every=1000"]


def test_sigterm_checkpoints_the_current_step_exits_143_and_resumes_bit_for_bit(tmp_path):
    run = tmp_path / "preempted"
    args = ["tiny", *GUARDED, *PREEMPT, f"train.out_dir={run}", "-q"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CLI.format(repo=str(REPO), args=args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(run / "metrics.jsonl")) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step 3 within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert took < 30, took
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    stopped = int(lines[0].split("stopped after step ")[1].split()[0])
    assert 3 <= stopped < 12
    assert lines[0] == (f"multimesh-train: SIGTERM received: stopped after step {stopped} and saved checkpoint "
                        f"{run / 'checkpoints' / str(stopped)}; run the same command to resume from it")
    assert max(_committed_steps(run)) == stopped and not (run / "summary.json").exists()

    cfg = load_config("tiny", [*GUARDED, *PREEMPT, f"train.out_dir={run}"])
    resumed = train(cfg, quiet=True)
    whole = train(cfg.replace(train={"out_dir": str(tmp_path / "whole")}), quiet=True)
    assert resumed.start_step == stopped and resumed.step == 12
    logged = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}
    assert [logged[s] for s in range(1, 13)] == [whole.losses[s] for s in range(1, 13)]
    assert [resumed.losses[s] for s in range(stopped + 1, 13)] == [whole.losses[s] for s in range(stopped + 1, 13)]
    for a, b in zip(params_of(resumed), params_of(whole), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed.val_loss == whole.val_loss


@pytest.mark.parametrize("stop_at", [3, 5])  # between checkpoints; at a scheduled one (checkpoint_every=5)
def test_sigint_checkpoints_the_step_it_came_in_exits_130_and_restores_the_handlers(tmp_path, capsys,
                                                                                     monkeypatch, stop_at):
    """In this process: SIGINT arrives while the batch of step ``stop_at`` is read; that step is finished
    and saved (once), and nothing after it is."""
    plain = Feed.__next__

    def interrupted(self):
        if self.dataset.step == stop_at - 1:
            os.kill(os.getpid(), signal.SIGINT)
        return plain(self)

    monkeypatch.setattr(Feed, "__next__", interrupted)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert main(["tiny", *GUARDED, *PREEMPT, f"train.out_dir={tmp_path}", "-q"]) == 130
    assert {s: signal.getsignal(s) for s in before} == before
    err = capsys.readouterr().err
    assert err.strip() == (f"multimesh-train: SIGINT received: stopped after step {stop_at} and saved checkpoint "
                           f"{tmp_path / 'checkpoints' / str(stop_at)}; run the same command to resume from it")
    assert _committed_steps(tmp_path) == [stop_at]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, stop_at + 1))


_TWO_SIGNALS = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})
    from trainers.preemption import StopSignals
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("first:", signals.received, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        print("not reached", flush=True)
""")


def test_a_second_signal_ends_the_process_at_once():
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _TWO_SIGNALS.format(repo=str(REPO))], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stderr[-2000:])
    assert done.stdout == f"first: {int(signal.SIGTERM)}\n" and time.monotonic() - t0 < 20


@pytest.mark.slow  # ~1-2 min: two fresh processes joined by jax.distributed, then two runs here
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path):
    """SIGTERM reaches process 1 only: both processes stop after the same step, both exit 143 naming it and
    the process that received it, and the checkpoint they committed resumes (in one process) on course."""
    run = tmp_path / "two"
    args = ["tiny", *GUARDED, *PREEMPT, f"train.out_dir={run}", "-q"]
    # without the suite's compilation cache, as every multi-process test (two processes loading one cached
    # executable hang at their first step on XLA:CPU)
    env = {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")},
           "PYTHONPATH": str(REPO)}
    port = free_port("localhost")
    procs = [subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI.format(repo=str(REPO), args=[
            *args, "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)])],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while len(read_metrics(run / "metrics.jsonl")) < 3:
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
            assert time.monotonic() < deadline, "no step 3 within 240 s"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [143, 143], [e[-2000:] for e in errs]
    stops = set()
    for err in errs:
        (line,) = [line for line in err.splitlines() if "SIGTERM" in line]
        assert line.startswith("multimesh-train: SIGTERM received by process 1 of 2: stopped after step "), line
        stops.add(int(line.split("stopped after step ")[1].split()[0]))
    (stopped,) = stops
    assert 3 <= stopped < 12 and max(_committed_steps(run)) == stopped

    cfg = load_config("tiny", [*GUARDED, *PREEMPT, f"train.out_dir={run}"])
    resumed = train(cfg, quiet=True)
    whole = train(cfg.replace(train={"out_dir": str(tmp_path / "whole")}), quiet=True)
    assert resumed.start_step == stopped
    np.testing.assert_allclose([resumed.losses[s] for s in range(stopped + 1, 13)],
                               [whole.losses[s] for s in range(stopped + 1, 13)], rtol=RTOL)
