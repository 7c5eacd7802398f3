"""A compiler crash while planning is a reported event, not an exit status: the process that planned on
simulated devices names what it was compiling and the signal; a layout search sets the crashing candidate aside,
lists it unpriced and answers with another. The crash is simulated by the journal's test hook (the process kills
itself with SIGFPE where XLA's CPU compiler did)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

from multimesh.autolayout.compile_journal import CRASH_ENV, JOURNAL_ENV, CompileJournal, Crash
from multimesh.jax import auto_layout
from trainers.plan_estimate import crash_message

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.d_model=32", "model.num_layers=1", "model.max_len=32", "data.seq_len=32", "data.batch_size=16",
         "data.max_bytes=200000"]


def _plan(crash_on: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, CRASH_ENV: crash_on}
    env.pop(JOURNAL_ENV, None)
    return subprocess.run([sys.executable, "-m", "trainers", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300, check=False)


def test_the_journal_names_what_a_dead_process_was_compiling(tmp_path):
    code = ("import os\nfrom multimesh.autolayout.compile_journal import compiling\n"
            "with compiling('data=2 x tensor=4', candidate=False):\n    pass\n"
            "with compiling('data=8', candidate=True):\n    os.kill(os.getpid(), 9)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, JOURNAL_ENV: str(tmp_path)}, cwd=REPO,
                          timeout=60, check=False)
    assert done.returncode == -signal.SIGKILL
    journal = CompileJournal(tmp_path)
    assert journal.interrupted(signal.SIGKILL) == Crash("data=8", "SIGKILL", candidate=True)
    assert journal.crashes() == {"data=8": Crash("data=8", "SIGKILL", candidate=True)}
    assert journal.interrupted(signal.SIGKILL) is None  # read once; the compile that finished left nothing
    assert "not while compiling" in crash_message(None, signal.SIGKILL, 4)


TX = optax.adam(1e-2)


def _init():
    params = {"w1": jnp.ones((64, 256)) * 0.05, "w2": jnp.ones((256, 64)) * 0.05}
    return {"params": params, "opt_state": TX.init(params)}


def _batch():
    return {"x": jnp.ones((16, 64)), "y": jnp.zeros((16, 64))}


def _step(state, batch):
    def loss(p):
        return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    return value, {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}


def _search():
    return auto_layout(_step, init_params=_init, get_input_batch=_batch, num_devices=4, axes=("data", "tensor"),
                       profile="h100-sxm", param_rules=[(r"w1$", ("embed", "mlp")), (r"w2$", ("mlp", "embed"))],
                       rule_sets=("standard",), progress=False)


def test_without_a_journal_a_crash_in_a_compile_still_says_so_on_the_real_standard_error():
    """The estimate's compile sends descriptor 2 to a temporary file; a fatal signal there is still reported."""
    code = ("import os, tempfile\nfrom multimesh.autolayout.compile_journal import compiling\n"
            "from multimesh.estimate.compiler_log import _stderr_to\n"
            "with compiling('data=8', candidate=True), tempfile.TemporaryFile() as log, _stderr_to(log):\n"
            "    os.kill(os.getpid(), 8)  # SIGFPE, as XLA's compiler raised it\n")
    env = {k: v for k, v in os.environ.items() if k not in (JOURNAL_ENV, CRASH_ENV)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == -signal.SIGFPE
    assert "Fatal Python error: Floating point exception" in done.stderr


def test_a_layout_recorded_as_crashed_is_not_compiled_and_listed_unpriced(tmp_path, monkeypatch):
    monkeypatch.delenv(JOURNAL_ENV, raising=False)
    best = _search().best.describe()
    (tmp_path / "crashes.json").write_text(json.dumps([{"what": best, "signal": "SIGFPE", "candidate": True}]))
    monkeypatch.setenv(JOURNAL_ENV, str(tmp_path))
    monkeypatch.setenv(CRASH_ENV, best)  # compiling it again would kill this process
    found = _search()
    crashed = next(c for c in found.candidates if c.layout.describe() == best)
    assert crashed.estimate is None and crashed.time is None and crashed.valid
    assert crashed.rejected == "unpriced: compiling it killed XLA's compiler (SIGFPE) in an earlier run of this search"
    assert found.best.describe() != best and found.candidates[-1] is crashed  # the others ranked first
    assert re.search(rf"\n\s+-\s+{re.escape(best)}\s.*unpriced: compiling it killed XLA's compiler \(SIGFPE\)",
                     str(found))


@pytest.mark.slow
def test_a_candidate_whose_compile_kills_the_process_is_listed_unpriced_and_the_search_answers(tmp_path):
    args = ["tiny", *SMALL, "data.batch_size=8", "layout.mesh=auto", "layout.search.axes=[data, tensor]",
            "layout.search.stages=[1]", "layout.search.rules=[standard]", "layout.profile=h100-sxm",
            f"train.out_dir={tmp_path}", "--plan",
            "--num-devices", "4", "--profile", "h100-sxm"]
    first = "data=4"  # a layout that fits: set aside, another answers
    done = _plan(first, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"compiling the layout {first} killed XLA's compiler (SIGFPE) in the planning process (4 simulated "
            f"CPU devices): it is listed unpriced, and the search runs again without it") in done.stderr
    row = next(line for line in done.stdout.splitlines() if re.match(rf"\s*-\s+{re.escape(first)}\s", line))
    assert row.rstrip().endswith("unpriced: compiling it killed XLA's compiler (SIGFPE) in an earlier run of this "
                                 "search"), row
    chosen = re.search(r"chosen layout (.+)", done.stdout)[1]
    assert chosen != first and f"{chosen} " in done.stdout


def test_a_plan_whose_compile_kills_the_process_says_the_signal_the_layout_and_what_to_try(tmp_path):
    what = "tiny's train step, SPMD on 4 devices, mesh data=4"
    done = _plan(what, "tiny", *SMALL, "layout.mesh={data: 4}", f"train.out_dir={tmp_path}", "--plan",
                 "--num-devices", "4", "--profile", "h100-sxm")
    assert done.returncode == 128 + signal.SIGFPE, done.stderr[-3000:]
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"multimesh-train: compiling {what} killed XLA's compiler (SIGFPE) in the planning "
                              f"process (4 simulated CPU devices). Try another layout (layout.mesh=..."), message
    assert "layout.mesh=auto" in message and "requirements/lock.txt" in message and "--xla_dump_to" in message
