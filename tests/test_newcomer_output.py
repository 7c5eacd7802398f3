"""A run of two processes draws one progress bar, and nothing the processes print cuts it.

Both processes are started as a user starts them in one terminal (``multimesh-train ... --process-id i``,
no ``-q``), each with its stdout and stderr in one stream, as a terminal shows them, unbuffered as on a
terminal. The bar (tqdm's ``\\r``-redrawn line) may be interrupted only by our own messages, which tqdm
writes after clearing it; a line that mixes the bar with other text, or any output of process 1, would
break or interleave with it on a shared terminal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

from multimesh.startup.gloo_notices import NoticeFilter

REPO = Path(__file__).resolve().parent.parent
CONFIG = "dp_tp"
STEPS = 6
OVERRIDES = ["model.d_model=32", "model.num_layers=1", "model.max_len=32", "data.seq_len=32", "data.batch_size=8",
             "data.max_bytes=200000", "train.eval_batches=1", "train.eval_every=1000", "train.log_every=2",
             "train.checkpoint_every=3", f"train.steps={STEPS}"]
TIMEOUT_S = 240

#: one drawing of the bar: "dp_tp:  50%|#####     | 3/6 [00:01<00:01, ...]"
BAR = re.compile(rf"^{CONFIG}: +\d+%\|.*\| *\d+/{STEPS} \[.*\]$")
#: what the trainer itself says, each through tqdm.write (the bar cleared first)
OURS = re.compile(r"^(config |data: |writing to |resumed from |step \d+: |final validation loss )")


def _run_two(out: Path) -> list[str]:
    """``multimesh-train`` as processes 0 and 1 of one run; each one's output (stdout and stderr as one)."""
    # without the suite's compilation cache, as every multi-process test: two processes loading one cached
    # executable hang at their first step on XLA:CPU
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    port = free_port("localhost")
    procs = [subprocess.Popen([sys.executable, "-m", "trainers", CONFIG, *OVERRIDES, f"train.out_dir={out}",
                               "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # only ours, by their handles
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{text[-4000:]}"
    return outputs


def _is_bar(piece: str) -> bool:
    return bool(BAR.match(piece.strip()))


def stray_lines(text: str) -> list[str]:
    """Lines of ``text`` that break the bar, read as a terminal shows them (``\r`` returns to the line's
    start; tqdm clears the bar with blanks before a message): a piece that holds the bar and other text,
    text written over a bar not cleared first, and, from the bar's first drawing to its last, a line that
    is neither the bar nor one of the trainer's messages."""
    lines = text.split("\n")
    with_bar = [i for i, line in enumerate(lines) if any(_is_bar(p) for p in line.split("\r"))]
    assert with_bar, f"no progress bar in:\n{text[-3000:]}"
    stray = []
    for i, line in enumerate(lines):
        bar_shown = False  # drawn and not cleared since
        for piece in line.split("\r"):
            words = piece.strip()
            if not words:
                bar_shown = False
            elif _is_bar(piece):
                bar_shown = True
            elif bar_shown or "%|" in words or (with_bar[0] <= i <= with_bar[-1] and not OURS.match(words)):
                stray.append(line)
                break
    return stray


def test_the_stray_line_check_can_fail():
    bar = f"{CONFIG}:  50%|#####     | 3/{STEPS} [00:01<00:01, 3.00step/s]"
    clear = "\r" + " " * len(bar) + "\r"
    clean = f"config x\n\r{bar}{clear}step 3: val 1.0\n\r{bar}\n"
    assert stray_lines(clean) == []
    glued = clean.replace(f"{clear}step 3", f"I1126 gloo: connected\n{clear}step 3")
    assert stray_lines(glued) == [f"\r{bar}I1126 gloo: connected"]
    over = clean.replace(f"{clear}step 3", "\rW1126 heartbeat\n\rstep 3")
    assert stray_lines(over) == [f"\r{bar}\rW1126 heartbeat"]
    between = clean.replace(f"\n\r{bar}\n", f"\nE1126 coordination_service_agent.cc:1 error\n\r{bar}\n")
    assert stray_lines(between) == ["E1126 coordination_service_agent.cc:1 error"]


@pytest.mark.slow  # about 10 s: two processes
def test_two_processes_show_one_bar_that_nothing_cuts(tmp_path):
    first, second = _run_two(tmp_path / "run")
    assert stray_lines(first) == [], first
    assert any(_is_bar(p) and f"{STEPS}/{STEPS}" in p for line in first.split("\n") for p in line.split("\r"))
    assert second.strip() == "", f"process 1 printed:\n{second[-3000:]}"  # on a shared terminal it would cut the bar
    assert "processes: 2 (this is process 0); 8 cpu devices, 4 on this process" in first  # the header says how many
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["num_processes"], summary["process_id"], summary["num_devices"]) == (2, 0, 8)


NOTICE = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
DRAWN = "\rdp_tp:  17%|#5        | 1/6 [00:14<01:13, 14.61s/step]".encode()
#: two threads' notices as gloo wrote them at once, seen on process 1 (both newlines after both texts)
INTERLEAVED = (b"[Gloo] Rank [Gloo] Rank 32 is connected to  is connected to 33 peer ranks.  peer ranks. "
               b"Expected number of connected peer ranks is : Expected number of connected peer ranks is : 33\n\n")


@pytest.mark.parametrize("stream, shown", [
    (NOTICE * 3 + b"ok\n", b"ok\n"),
    (DRAWN + NOTICE + DRAWN, DRAWN + DRAWN),  # the bar stays on its line
    (b"a\n" + INTERLEAVED + b"\nb\n", b"a\n\nb\n"),  # the notices' own newlines go; the program's empty line stays
    # seen on a CI run: one notice's last count came after the other's newline, a line of its own
    (b"a\n" + INTERLEAVED[:-4] + b"3\n3\nb\n12\n", b"a\nb\n12\n"),
    (NOTICE[:44] + NOTICE.replace(b"Rank 0", b"Rank 1")[:44] + NOTICE[44:] * 2, b""),  # a tail on a line of its own
    (NOTICE.replace(b"to 1 peer", b"to 0 peer"), None),  # the counts differ: kept
    (b"[Gloo] another message\n[x] Rank 3\n12\n", None),
])
def test_gloo_notices_are_dropped_wherever_the_stream_is_cut(stream, shown):
    """Every split of the stream into two chunks (as the pipe may deliver it) gives the same output."""
    for cut in range(len(stream) + 1):
        notices = NoticeFilter()
        out = notices.feed(stream[:cut]) + notices.feed(stream[cut:]) + notices.flush()
        assert out == (stream if shown is None else shown), cut


_PROGRAM = """
import ctypes, os, sys
from multimesh.startup.gloo_notices import drop_gloo_notices
drop_gloo_notices()
libc = ctypes.CDLL(None)
libc.printf(b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\nC line\\n")
os.write(1, b"[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1\\n")
print("python line", flush=True)
"""


def test_a_process_filtering_notices_keeps_everything_else():
    """The plumbing: C's buffered stdout (flushed only at exit, as ``std::cout``'s may be), writes to
    descriptor 1 and Python's ``print`` all arrive; only the notice whose counts agree is gone."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # C's stdout buffered, as usual
    done = subprocess.run([sys.executable, "-c", _PROGRAM], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted([
        "C line", "python line",
        "[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1"])
