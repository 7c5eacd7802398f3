"""Start-up mistakes of a multi-process run, and processes that disagree.

The roll call (`multimesh.startup.rollcall`) is plain sockets: its cases run here as threads, in a second
each. The end-to-end cases start real processes (`multimesh.distributed.initialize`, the trainer CLI)
on a free port, bound their time and end only the processes they started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import free_port

from multimesh.startup.agreement import differences, source_digest
from multimesh.startup.rollcall import StartupError, roll_call

REPO = Path(__file__).resolve().parent.parent


def _roll_call_all(port: int, calls: list[tuple], timeout: float = 5, every: float = 0.5,
                   stagger: float = 0.0) -> tuple[dict[int, BaseException | None], list[str]]:
    """``roll_call`` in one thread per ``(process_id, num_processes)`` (or ``(process_id, num_processes,
    run_id)``); each one's error (None: it went on) and everything they said while waiting."""
    results: dict[int, BaseException | None] = {}
    said: list[str] = []

    def one(i: int, pid: int, n: int, run_id: str = "") -> None:
        try:
            roll_call(f"127.0.0.1:{port}", n, pid, timeout=timeout, every=every, say=said.append, run_id=run_id)
            results[i] = None
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, *call), daemon=True) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(timeout + 15)
    assert not any(t.is_alive() for t in threads), "a roll call did not end"
    return results, said


def test_roll_call_lets_all_go_when_every_process_joined():
    results, _ = _roll_call_all(free_port(), [(0, 3), (2, 3), (1, 3)])
    assert results == {0: None, 1: None, 2: None}


def test_process_0_ignores_a_stray_connection():
    """A port scanner or a stray client (it connects, sends something else, stays) changes nothing."""
    port = free_port()

    def stray() -> None:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            time.sleep(3)

    threading.Thread(target=stray, daemon=True).start()
    start = time.monotonic()
    results, _ = _roll_call_all(port, [(0, 2), (1, 2)], stagger=0.5)
    assert results == {0: None, 1: None} and time.monotonic() - start < 3


def test_a_missing_process_is_named_while_waiting_and_at_the_timeout():
    port = free_port()
    start = time.monotonic()
    results, said = _roll_call_all(port, [(0, 3), (1, 3)], timeout=2)
    assert time.monotonic() - start < 10
    for e in results.values():  # both processes that came: the same error, naming the missing one
        assert isinstance(e, StartupError)
        assert "process(es) [2] of 3 did not join" in str(e) and f"127.0.0.1:{port}" in str(e)
        assert "2 s" in str(e)
    assert any(f"waiting for process(es) [2] at 127.0.0.1:{port}" in s and "of 2 s" in s for s in said), said
    assert any(s.startswith("process 1: process 0 is waiting for process(es) [2]") for s in said), said


def test_process_0_that_never_comes_is_named_with_the_address():
    port = free_port()
    results, said = _roll_call_all(port, [(1, 2)], timeout=1.5)
    assert isinstance(results[0], StartupError)
    assert f"could not reach process 0 (the coordinator) at 127.0.0.1:{port}" in str(results[0])
    assert "Connection refused" in str(results[0])
    assert any("waiting for process 0 (the coordinator)" in s for s in said), said


def test_a_duplicate_process_id_stops_everyone_naming_both():
    results, _ = _roll_call_all(free_port(), [(0, 3), (1, 3), (1, 3)], stagger=0.2)
    for e in results.values():
        assert isinstance(e, StartupError) and "two processes were given process id 1" in str(e), e
        assert str(e).count(f"pid {os.getpid()}") == 2  # both claimants, by host and pid


@pytest.mark.parametrize("counts", [(2, 3), (3, 2)])
def test_different_process_counts_stop_everyone_naming_both(counts):
    results, _ = _roll_call_all(free_port(), [(0, counts[0]), (1, counts[1])], stagger=0.2)
    for e in results.values():
        assert isinstance(e, StartupError), e
        assert f"process 0 num_processes={counts[0]}" in str(e) and f"num_processes={counts[1]}" in str(e)


def test_a_port_held_by_another_program_is_named_on_process_0():
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        results, _ = _roll_call_all(port, [(0, 2)], timeout=2)
    assert isinstance(results[0], StartupError)
    assert f"port {port} is already in use" in str(results[0]) and "another free port" in str(results[0])


def test_a_port_that_answers_otherwise_is_refused_by_the_others():
    """Another program (here one that answers nonsense), or a run already started, holds the port."""
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]

        def answer() -> None:
            conn, _ = other.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"\x00\x00\x12\x04 not json\n")

        threading.Thread(target=answer, daemon=True).start()
        results, _ = _roll_call_all(port, [(1, 2)], timeout=3)
    assert isinstance(results[0], StartupError)
    message = str(results[0])
    assert f"127.0.0.1:{port} accepted the connection but did not answer as process 0 of a multimesh run" in message
    assert "an answer in another protocol" in message


def test_a_process_of_another_run_is_refused_and_the_run_goes_on_with_its_own():
    """Run B's process 1 reaches run A's process 0 first: it is refused, naming both run ids; A's own
    process 1, coming later, joins, and run A starts with its own processes only."""
    results, said = _roll_call_all(free_port(), [(0, 2, "run-a"), (1, 2, "run-b"), (1, 2, "run-a")], stagger=0.3)
    assert results[0] is None and results[2] is None, results
    assert isinstance(results[1], StartupError), results[1]
    message = str(results[1])
    assert "has run id 'run-b'" in message and "runs run id 'run-a'" in message, message
    assert "two runs were given one coordinator port" in message and "its own port" in message, message
    assert any("process 0: refused process 1" in s for s in said), said


def test_a_refused_process_is_named_when_its_run_times_out():
    results, _ = _roll_call_all(free_port(), [(0, 2, "run-a"), (1, 2, "")], timeout=2, stagger=0.2)
    assert "has run id none" in str(results[1]), results[1]
    assert "process(es) [1] of 2 did not join" in str(results[0]), results[0]
    assert "came with run id none and was refused" in str(results[0]) and "run id 'run-a'" in str(results[0])


def test_differences_name_each_key_and_the_processes():
    got = differences({0: {"optimizer.lr": 0.001, "steps": 4}, 1: {"optimizer.lr": 0.01, "steps": 4},
                       2: {"optimizer.lr": 0.001}})
    assert got == ["optimizer.lr: 0.001 on processes [0, 2], 0.01 on process 1",
                   'steps: 4 on processes [0, 1], "<unset>" on process 2']
    # a key only a non-zero process has (process 0 lacks it) is named too
    got = differences({0: {"lr": 0.1}, 1: {"lr": 0.1, "seed": 3}, 2: {"lr": 0.1}})
    assert got == ['seed: "<unset>" on processes [0, 2], 3 on process 1']
    assert differences({0: {"lr": 0.1}, 1: {"lr": 0.1}}) == []


def test_source_digest_of_a_namespace_package_names_it(tmp_path, monkeypatch):
    (tmp_path / "loose_modules").mkdir()  # no __init__.py: a namespace package, without a __file__
    (tmp_path / "loose_modules" / "one.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"source_digest\('loose_modules'\): the package has no __init__.py"):
        source_digest("loose_modules")
    assert len(source_digest("multimesh")) == 16


# -- real processes ------------------------------------------------------------------------------------

_ENV = {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")},
        "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}

_INIT = """
import sys, multimesh.distributed as d
d.initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), initialization_timeout=int(sys.argv[4]))
print("joined", flush=True)
"""


def _start(argvs: list[list[str]]) -> list[subprocess.Popen]:
    return [subprocess.Popen(argv, cwd=REPO, env=_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for argv in argvs]


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Each process's exit status and stderr; those still running after ``timeout`` s in all are killed."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[1]
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_initialize_with_different_process_counts_fails_in_both_processes():
    """JAX alone runs processes told 2 and 3 as a 2-process job; every process must stop instead."""
    port = str(free_port())
    start = time.monotonic()
    done = _wait(_start([[sys.executable, "-c", _INIT, f"127.0.0.1:{port}", n, i, "20"]
                         for n, i in (("2", "0"), ("3", "1"))]), timeout=60)
    assert time.monotonic() - start < 30
    for code, err in done:
        assert code == 1 and "StartupError" in err, err[-2000:]
        assert "process 0 num_processes=2" in err and "num_processes=3" in err, err[-2000:]


_TWICE = _INIT + """
try:
    d.initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), initialization_timeout=int(sys.argv[4]))
except d.StartupError as e:
    print("second:", e, flush=True)
"""


def test_initialize_called_twice_says_it_is_already_initialized():
    """The second call used to find the coordinator port held by the process itself (process 0) or by a
    run already started (the others)."""
    port = str(free_port())
    procs = _start([[sys.executable, "-c", _TWICE, f"127.0.0.1:{port}", "2", str(i), "20"] for i in range(2)])
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        second = out.split("second: ", 1)[-1]
        assert "joined" in out and "initialize was already called in this process" in second, out + err[-2000:]
        assert f"pid {p.pid}" in second and f"coordinator_address='127.0.0.1:{port}'" in second, second


@pytest.mark.slow  # one of the longest checks: the default suite's time
def test_processes_of_two_runs_on_one_port_never_join(tmp_path):
    """Two 2-process runs given one port, with their own run ids (``MULTIMESH_RUN_ID``): none of run B's
    processes joins run A, which starts with its own two; B's stop with a StartupError."""
    port = str(free_port())
    hold = _INIT + "sys.stdin.readline()\n"

    def start(i: int, run: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", hold, f"127.0.0.1:{port}", "2", str(i), "10"], cwd=REPO,
                                env={**_ENV, "MULTIMESH_RUN_ID": run}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [start(0, "a")]
    try:
        time.sleep(1.0)  # run A's process 0 gathers first; run B's process 1 reaches it before A's own
        procs.append(start(1, "b"))
        time.sleep(1.5)
        procs += [start(1, "a"), start(0, "b")]
        for p in procs:  # every process that joined leaves together (JAX's shutdown waits for all)
            try:
                p.stdin.write("\n")
                p.stdin.flush()
            except OSError:
                pass  # it stopped already
        outs = {p.pid: p.communicate(timeout=60) for p in procs}
        outs = {p.pid: (p.returncode, *outs[p.pid]) for p in procs}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    (a0, a0_out, a0_err), (b1, _, b1_err), (a1, a1_out, a1_err), (b0, _, b0_err) = (outs[p.pid] for p in procs)
    assert (a0, a1) == (0, 0) and "joined" in a0_out and "joined" in a1_out, a0_err[-2000:] + a1_err[-2000:]
    assert b1 == 1 and "StartupError" in b1_err and "has run id 'b'" in b1_err and "runs run id 'a'" in b1_err, \
        b1_err[-2000:]
    assert b0 == 1 and "StartupError" in b0_err, b0_err[-2000:]


def _cli(port: int, n: int, i: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "trainers", "tiny", "train.steps=2", "model.num_layers=1", "model.d_model=32",
            *args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i), "-q"]


def test_trainer_processes_given_different_configs_stop_before_compiling(tmp_path):
    """Different learning rates and out_dirs: both exit 2 within 30 s naming each key; an earlier run's
    files in the out_dir are left as they were, and nothing is written."""
    (tmp_path / "a" / "checkpoints" / "2").mkdir(parents=True)
    (tmp_path / "a" / "checkpoints" / "2" / "state").write_bytes(b"an earlier run's step 2")
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _snapshot(tmp_path)
    port = free_port()
    start = time.monotonic()
    done = _wait(_start([_cli(port, 2, i, f"optimizer.lr={lr}", f"train.out_dir={tmp_path / d}")
                         for i, (lr, d) in enumerate([("0.001", "a"), ("0.01", "b")])]), timeout=90)
    assert time.monotonic() - start < 30, time.monotonic() - start
    for code, err in done:
        assert code == 2, err[-3000:]
        assert "DisagreementError" in err and "optimizer.lr: 0.001 on process 0, 0.01 on process 1" in err, err
        assert f'train.out_dir: "{tmp_path / "a"}" on process 0, "{tmp_path / "b"}" on process 1' in err, err
    assert _snapshot(tmp_path) == before and not (tmp_path / "b").exists()


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root``: its modification time and contents."""
    return {str(f.relative_to(root)): (f.stat().st_mtime_ns, f.read_bytes()) for f in root.rglob("*") if f.is_file()}


def test_trainer_names_a_missing_process_at_its_startup_timeout(tmp_path):
    port = free_port()
    start = time.monotonic()
    [(code, err)] = _wait(_start([_cli(port, 2, 0, f"train.out_dir={tmp_path}", "--startup-timeout", "3")]),
                          timeout=60)
    took = time.monotonic() - start
    assert code == 2 and 3 <= took < 30, (code, took, err[-2000:])
    assert "StartupError" in err and f"process(es) [1] of 2 did not join at 127.0.0.1:{port}" in err, err[-2000:]
    assert "start-up timeout of 3 s" in err and "Traceback" not in err, err[-2000:]


def test_trainer_processes_of_another_run_id_are_refused(tmp_path):
    """``--run-id``: process 1 of run 'b' reaching run 'a''s process 0 exits 2 naming both ids; process 0,
    whose own process 1 never comes, names the refused one at its start-up timeout."""
    port = free_port()
    start = time.monotonic()
    done = _wait(_start([_cli(port, 2, i, f"train.out_dir={tmp_path}", "--run-id", run, "--startup-timeout", "4")
                         for i, run in ((0, "a"), (1, "b"))]), timeout=60)
    assert time.monotonic() - start < 30
    (code0, err0), (code1, err1) = done
    assert code1 == 2 and "has run id 'b'" in err1 and "runs run id 'a'" in err1, err1[-2000:]
    assert code0 == 2 and "came with run id 'b' and was refused" in err0, err0[-2000:]


@pytest.mark.slow  # ~15 s: the first progress line comes after 10 s
def test_trainer_says_whom_it_waits_for_while_waiting(tmp_path):
    port = free_port()
    [(code, err)] = _wait(_start([_cli(port, 2, 0, f"train.out_dir={tmp_path}", "--startup-timeout", "12")]),
                          timeout=60)
    assert code == 2 and f"process 0: waiting for process(es) [1] at 127.0.0.1:{port}, 10 s of 12 s" in err, \
        err[-2000:]


def test_processes_running_different_multimesh_code_are_stopped(tmp_path):
    """Process 1 imports an edited copy of multimesh (the same version number): both stop at start-up."""
    import shutil

    shutil.copytree(REPO / "multimesh", tmp_path / "multimesh", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "multimesh" / "distributed.py", "a") as f:
        f.write("\n# edited on one host only\n")
    port = str(free_port())
    (tmp_path / "cwd").mkdir()  # ``python -c`` imports from its working directory first: neither copy
    argv = [[sys.executable, "-c", _INIT, f"127.0.0.1:{port}", "2", str(i), "20"] for i in range(2)]
    procs = [subprocess.Popen(a, cwd=tmp_path / "cwd", env={**_ENV, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a, root in zip(argv, (REPO, tmp_path))]
    start = time.monotonic()
    done = _wait(procs, timeout=60)
    assert time.monotonic() - start < 30
    for code, err in done:
        assert code == 1 and "DisagreementError" in err, err[-2000:]
        assert "multimesh source (sha256 of its .py files): " in err and "on process 0" in err, err[-2000:]
        assert "multimesh installation (1 key(s) differ)" in err  # the same version: only the source differs


def test_a_second_run_on_a_running_runs_port_is_refused_and_the_first_goes_on():
    """Two runs given one port: today the second's processes join the first's. Now the second's process 0
    finds the port held (by the first's process 0, named by pid where visible), its process 1 finds no
    roll call there, both stop; the first run finishes normally."""
    port = str(free_port())
    hold = _INIT + "sys.stdin.readline()\n"  # stay in the run until the test says so
    first = [subprocess.Popen([sys.executable, "-c", hold, f"127.0.0.1:{port}", "2", str(i), "20"], cwd=REPO, env=_ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        for p in first:
            assert p.stdout.readline().strip() == "joined", p.stderr.read()[-2000:] if p.poll() is not None else ""
        start = time.monotonic()
        second = _wait(_start([[sys.executable, "-c", _INIT, f"127.0.0.1:{port}", "2", str(i), "10"]
                               for i in range(2)]), timeout=60)
        assert time.monotonic() - start < 30
        for p in first:
            p.stdin.write("\n")
            p.stdin.flush()
        assert [p.wait(timeout=60) for p in first] == [0, 0]
    finally:
        for p in first:
            if p.poll() is None:
                p.kill()
                p.wait()
    (code0, err0), (code1, err1) = second
    import importlib.util

    holder = f" by pid {first[0].pid}" if importlib.util.find_spec("psutil") else ""  # psutil names it
    assert code0 == 1 and "StartupError" in err0 and f"port {port} is already in use{holder}" in err0, err0[-2000:]
    assert code1 == 1 and f"127.0.0.1:{port} accepted the connection but did not answer as process 0" in err1, \
        err1[-2000:]
