"""The planner benchmark (`benchmarks/planner.py`) still runs end to end: a few candidates and the 2-process row.

Its numbers are not checked here (speed is measured, not asserted); what is checked is that every part of
the script runs and prints its summary lines, so that a change elsewhere cannot break it silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_the_planner_benchmark_runs_a_few_candidates_and_the_two_process_row():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "benchmarks/planner.py", "--sizes", "small", "--limit", "3", "--rounds", "2",
                           "--steps", "1", "--rule-sets", "standard", "sequence", "--multiprocess",
                           "--mp-schedules", "1f1b"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "small: 3 layouts measured, 0 refused" in out and "tensor=8 (sequence rules)" in out
    assert "multiprocess: 1 layouts measured, 0 refused" in out
    assert out.count("Spearman rank correlation (predicted vs measured)") == 2
    assert "the measurements' own rounds, ranked against each other" in out
    assert "time_top=" in out and "(the layouts predicted within 10% of the best, timed one after another)" in out
