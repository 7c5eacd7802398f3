"""Every script in examples/ runs to the end in a fresh process.

Each example checks itself against the same program on one device (losses and
final state) and asserts the shardings it claims, so a wrong result fails here.
"""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: The last line each example prints once all its checks passed.
FINAL_LINES = {
    "spmd_flax.py": "5 sharded steps equal the one-device run",
    "pipeline_tasks.py": "3 pipelined steps equal the one-device run",
    "flax_register_task.py": "2 pipelined steps of the unmodified model equal the one-device run",
    "checkpoint_relayout.py": "restored runs continue exactly as the uninterrupted one",
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(FINAL_LINES)


#: Examples that take a quarter of a minute or more: they run with the long checks (``-m slow``, in CI too).
LONG = {"checkpoint_relayout.py", "flax_register_task.py"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in LONG else s
                                    for s in sorted(FINAL_LINES)])
def test_example_runs(script, tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert done.stdout.strip().splitlines()[-1] == FINAL_LINES[script]
