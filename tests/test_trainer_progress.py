"""What a run shows while it trains and leaves behind: the bar's loss is the metrics' mean, wall_time goes on
across a resume, the layouts a run used are recorded and titled."""

from __future__ import annotations

import json
import re

import pytest

from multimesh.checkpoint import CheckpointManager
from trainers.config import load_config
from trainers.metrics import read_metrics
from trainers.train import train

pytestmark = pytest.mark.devices(8)

SMALL = ["model.d_model=32", "model.max_len=32", "data.seq_len=32", "data.batch_size=8", "data.max_bytes=200000",
         "train.eval_batches=1", "train.eval_every=1000", "train.log_every=2", "train.checkpoint_every=2"]
CLOCK_AT_STEP_2 = 100_000.0


def test_a_resumed_run_goes_on_with_its_clock_its_layouts_and_the_bar_shows_the_logged_mean(tmp_path, capsys):
    out = tmp_path / "run"
    train(load_config("tiny", [*SMALL, "train.steps=4", f"train.out_dir={out}"]), stop_after=3)
    first = read_metrics(out / "metrics.jsonl")
    # Step 2's clock is set far beyond any run's length, so that a clock that restarts cannot pass for one going on.
    first[0]["wall_time"] = CLOCK_AT_STEP_2
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    capsys.readouterr()
    resumed = train(load_config("dp", [*SMALL, "train.steps=6", "optimizer.decay_steps=4", f"train.out_dir={out}"]))
    assert resumed.start_step == 2
    records = read_metrics(out / "metrics.jsonl")
    times = [r["wall_time"] for r in records]
    assert [r["step"] for r in records] == [2, 4, 6] and records[0] == first[0]
    # the resumed run's clock starts at step 2's time: its lines are that plus part of its own wall time
    assert CLOCK_AT_STEP_2 < times[1] <= times[2] <= CLOCK_AT_STEP_2 + resumed.wall_time
    with CheckpointManager(out / "checkpoints", read_only=True) as mgr:
        layouts = mgr.info(6).metadata["layouts"]
    assert len(layouts) == 2 and "data=4" in layouts[0] and "data=8" in layouts[1]
    shown = re.findall(r"mean_loss=([0-9.]+)", capsys.readouterr().out)
    assert shown and float(shown[-1]) == pytest.approx(records[-1]["loss"], abs=5e-4)
