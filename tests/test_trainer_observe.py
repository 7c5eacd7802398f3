"""Watching a run: the trainer's TensorBoard scalars (read back by TensorBoard's own reader), its
``jax.profiler`` trace of the steps asked for, and the process count in its header and summary."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainers.config import ConfigError, load_config
from trainers.observe import TAGS, Scalars, model_flops_utilisation
from trainers.train import train

#: a tiny model, 6 steps, a metrics line every 2, validation at 3 and 6
SHORT = ["model.d_model=32", "model.num_layers=1", "model.max_len=32", "data.seq_len=32", "data.batch_size=8",
         "data.max_bytes=200000", "train.eval_batches=1", "train.eval_every=3", "train.log_every=2",
         "train.steps=6", "train.checkpoint_every=0"]


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of ``directory`` as TensorBoard loads it: tag -> [(step, value)]."""
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """tiny, 6 steps on 8 devices, priced on an H100 for MFU, steps 3 and 4 traced; what it printed."""
    out = tmp_path_factory.mktemp("watched")
    cfg = load_config("tiny", [*SHORT, f"train.out_dir={out}", "train.profile_steps=[3, 4]",
                               "layout.profile=h100-sxm"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = train(cfg)
    result.printed = printed.getvalue()
    return result


def test_the_metrics_are_tensorboard_scalars_that_tensorboard_reads(watched):
    out = watched.out_dir
    series = scalars(out / "tensorboard")
    assert set(series) == set(TAGS.values())
    logged = records(out)
    assert [r["step"] for r in logged] == [2, 3, 4, 6]  # every log_every, and each validation
    for key, tag in TAGS.items():
        expected = [(r["step"], r[key]) for r in logged if r.get(key) is not None]
        assert [s for s, _ in series[tag]] == [s for s, _ in expected], tag
        assert [v for _, v in series[tag]] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    assert [s for s, _ in series["val/loss"]] == [3, 6]
    assert series["val/loss"][-1][1] == pytest.approx(watched.val_loss, rel=1e-6)
    losses = watched.losses
    assert series["train/loss"][0][1] == pytest.approx((losses[1] + losses[2]) / 2, rel=1e-6)


def test_step_time_and_mfu_follow_from_the_rate_and_the_profile(watched):
    from multimesh.estimate import get_profile
    from trainers.plan_estimate import model_flops_of

    cfg = watched.config
    peak = get_profile("h100-sxm").flops_rate("float32")
    for r in records(watched.out_dir):
        assert r["step_time_s"] == pytest.approx(cfg.data.batch_size * cfg.data.seq_len / r["tokens_per_s"],
                                                 rel=1e-3)
        assert r["mfu"] == pytest.approx(model_flops_of(cfg) / (r["step_time_s"] * peak * 8), rel=1e-3)
    assert model_flops_utilisation(1e12, 0.0, 1e12, 8) is None  # no time, no rate


def test_the_profile_holds_the_steps_asked_for(watched):
    (trace,) = (watched.out_dir / "profile" / "plugins" / "profile").iterdir()
    assert list(trace.glob("*.xplane.pb")), "no XPlane file for TensorBoard's profile plugin"
    events = json.load(gzip.open(trace / "perfetto_trace.json.gz"))["traceEvents"]
    assert {e["args"]["step_num"] for e in events if e.get("name") == "train"} == {"3", "4"}


def test_the_summary_and_header_name_the_processes(watched):
    summary = json.loads((watched.out_dir / "summary.json").read_text())
    assert (summary["num_processes"], summary["process_id"], summary["num_devices"]) == (1, 0, 8)
    assert "processes: 1 (process 0); 8 cpu devices" in watched.printed
    assert f"profile of steps 3..4: {watched.out_dir / 'profile'}" in watched.printed


def test_a_fresh_run_in_an_old_directory_drops_the_old_points(tmp_path):
    with Scalars(tmp_path) as old:
        for step in (1, 2, 3):
            old.write({"step": step, "loss": 9.0})
    with Scalars(tmp_path) as new:
        new.write({"step": 1, "loss": 1.0})
    assert scalars(tmp_path)["train/loss"] == [(1, 1.0)]


def test_a_run_resumed_within_the_same_second_keeps_the_earlier_points(tmp_path, monkeypatch):
    """tensorboardX names an event file by its second and host, and opens it afresh: the resumed run's
    file must neither take the earlier one's name (emptying it) nor sort before it."""
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.25)  # every writer opens in this second
    with Scalars(tmp_path) as first:
        for step in (1, 2, 3):
            first.write({"step": step, "loss": 9.0})
    with Scalars(tmp_path, resume_at=2) as resumed:
        resumed.write({"step": 3, "loss": 1.0})
    monkeypatch.undo()
    assert len(list(tmp_path.glob("events.out.tfevents.1800000000.*"))) == 2
    assert scalars(tmp_path)["train/loss"] == [(1, 9.0), (2, 9.0), (3, 1.0)]


def test_scalars_not_written_write_nothing(tmp_path):
    """``train.tensorboard: false``, or a process other than the first."""
    with Scalars(tmp_path / "tb", write=False) as off:
        off.write({"step": 1, "loss": 1.0})
    assert not (tmp_path / "tb").exists()


def test_a_resumed_run_drops_the_points_after_its_checkpoint(tmp_path):
    """Killed after step 5 was logged (its checkpoint at 4), then resumed: each step appears once, from the
    run that counts, as in metrics.jsonl."""
    cfg = load_config("tiny", [*SHORT, "train.steps=8", "train.checkpoint_every=4", "train.log_every=1",
                               f"train.out_dir={tmp_path}"])
    train(cfg, quiet=True, stop_after=6)
    assert [s for s, _ in scalars(tmp_path / "tensorboard")["train/loss"]] == [1, 2, 3, 4, 5]
    resumed = train(cfg, quiet=True)
    series = scalars(tmp_path / "tensorboard")["train/loss"]
    assert [s for s, _ in series] == [r["step"] for r in records(tmp_path)] == list(range(1, 9))
    assert [v for _, v in series[4:]] == pytest.approx([resumed.losses[s] for s in range(5, 9)], rel=1e-6)


@pytest.mark.slow  # about 15 s: a pipeline's programs
def test_a_pipeline_traces_with_its_schedule_beside(tmp_path):
    cfg = load_config("pipeline", [*SHORT, "model.num_layers=2", "layout.pipeline.stages=2", "train.steps=2",
                                   "train.profile_steps=[2, 2]", f"train.out_dir={tmp_path}"])
    train(cfg, quiet=True)
    profile = tmp_path / "profile"
    assert (profile / "schedule.png").read_bytes()[:4] == b"\x89PNG"
    assert "stage" in (profile / "schedule.txt").read_text().lower()
    (trace,) = (profile / "plugins" / "profile").iterdir()
    assert list(trace.glob("*.xplane.pb"))


@pytest.mark.parametrize("steps, words", [("[0, 2]", "1 <= first <= last"), ("[3, 2]", "1 <= first <= last"),
                                          ("[2]", "[first, last]"), ("[5, 9]", "ends after the run's last step")])
def test_bad_profile_steps_name_the_key(steps, words):
    with pytest.raises(ConfigError, match=r"train: profile_steps=.*" + words.replace("[", r"\[").replace("]", r"\]")):
        load_config("tiny", [*SHORT, f"train.profile_steps={steps}"])
