"""Where each array of a pipeline lives: the stage column of the sharding
report, ``--plan``'s modules and bytes per stage, the plan text, ``sharding.txt``/``--report``, and one
model (tied embedding) for every layout, so that an SPMD checkpoint resumes on a pipeline.

The pipeline here is the ``pipeline`` config shrunk to 2 blocks (one per stage) and traced, not run,
except in the resume test, which compares with one device.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from test_trainer import SMALL, small

from multimesh.core.fmt import device_span
from trainers.cli import main
from trainers.config import load_config
from trainers.stage_plan import stage_plans
from trainers.step import program_for
from trainers.train import sharding_text, train

TWO_BLOCKS = "model.num_layers=2"


def traced(name: str, *overrides: str):
    """Config ``name`` shrunk (2 blocks), its program built (traced, not run)."""
    cfg = load_config(name, [*SMALL, TWO_BLOCKS, *overrides])
    return program_for(cfg)


@pytest.fixture(scope="module")
def pipeline():
    return traced("pipeline")


def _stage_column(report) -> dict[str, str]:
    """path -> the report's ``stage`` cell."""
    at = report.header().index("stage")
    return {row[0]: row[at] for row in report.rows()}


def test_report_names_the_stage_and_devices_of_every_parameter_and_batch_leaf(pipeline):
    step = pipeline.step
    params, batch = step.report(), step.report(batch=True)
    stages = _stage_column(params)
    assert stages["params/params/embed/embedding"] == "stage0 0-3"  # tied: on the first stage, read on both
    assert stages["params/params/layers_1/mlp/wo/kernel"] == "stage1 4-7"
    assert stages["params/params/head/final_norm/scale"] == "stage1 4-7"
    assert stages["opt/1/0/mu/params/layers_0/mlp/wo/kernel"] == "stage0 0-3"  # the optimizer state follows
    for leaf in params.leaves:  # each cell says what the leaf's own sharding says
        ids = sorted(d.id for d in leaf.sharding.device_set)
        assert stages[leaf.path].split(" ")[1] == device_span(ids), leaf.path
    assert re.fullmatch(r"stage[01] (0-3|4-7)", _stage_column(batch)["tokens"])
    text = str(params)
    assert text.splitlines()[1].split() == ["path", "shape", "dtype", "logical", "PartitionSpec", "mesh", "stage",
                                            "bytes/device"]
    per_stage = params.bytes_per_stage()
    assert list(per_stage) == ["stage0", "stage1"] and sum(per_stage.values()) == params.total_bytes
    scalars = {leaf.path: stages[leaf.path] for leaf in params.leaves if leaf.shape == ()}
    assert scalars and set(scalars.values()) == {"stage1 4-7"}, scalars  # the state's scalars, together
    assert re.search(r"^per stage: stage0 \S+ \S+, stage1 \S+ \S+$", text, re.M)


def test_an_spmd_report_has_no_stage_column():
    report = traced("tiny").step.report()
    assert "stage" not in report.header() and "per stage" not in str(report) and report.bytes_per_stage() == {}


def test_plan_prints_each_stages_modules_and_the_bytes_the_step_puts_there(pipeline, capsys, tmp_path):
    """``--plan`` (computed from the config) agrees with the traced step's report, stage by stage."""
    assert main(["pipeline", *SMALL, TWO_BLOCKS, f"train.out_dir={tmp_path}", "--plan"]) == 0
    out = capsys.readouterr().out
    plans = stage_plans(pipeline.config)
    assert {p.name: p.param_bytes for p in plans} == pipeline.step.report().bytes_per_stage("params/")
    assert [(p.name, p.modules) for p in plans] == [("stage0", ["embed", "layers_0"]), ("stage1", ["layers_1", "head"])]
    assert re.search(r"^stage0\s+0-3\s+embed, layers_0\s+\S+ KiB$", out, re.M)
    assert re.search(r"^stage1\s+4-7\s+layers_1, head\s+\S+ KiB$", out, re.M)
    assert "tied embedding: the table lives on stage0" in out and "stage 0 | F0" in out  # and the schedule
    assert "--profile NAME adds memory per device and the predicted step time" in out  # what more it can say


def test_plan_text_groups_repeated_transfers_and_keeps_its_columns(pipeline):
    lines = str(pipeline.step.plan).splitlines()
    segments = [line for line in lines if re.match(r"  \[\d+\]", line)]
    assert len(segments) > 10  # indices of two digits, the case that shifted the columns
    assert len({line.index(" eqns") for line in segments}) == 1
    assert len({re.search(r"\S+:\S+", line).start() for line in segments}) == 1  # the labels too
    per_segment: list[list[str]] = []
    for line in lines:
        if re.match(r"  \[\d+\]", line):
            per_segment.append([])
        elif "<- " in line:
            per_segment[-1].append(line)
    for moves in per_segment:
        assert len(moves) == len(set(moves)), moves  # identical transfers are one line with a count
    grouped = [m for moves in per_segment for m in moves if re.search(r"<- \d+ x reshard", m)]
    assert grouped and all(re.search(r"\(\d+ B each, \d+ B\)$", m) for m in grouped)


def test_report_flag_prints_sharding_before_training_and_spmd_has_no_plan(tmp_path, capsys, monkeypatch):
    """``train(report=True)`` (``--report``) prints ``sharding.txt`` before the first step: here the steps
    never run. An SPMD ``sharding.txt`` holds the parameters and the batch, no MPMD plan."""
    import trainers.train as train_module

    class NoSteps(Exception):
        pass

    def no_steps(*args, **kwargs):
        raise NoSteps

    monkeypatch.setattr(train_module._Loop, "run", no_steps)
    cfg = small("tiny", tmp_path, "train.steps=2")
    with pytest.raises(NoSteps):
        train(cfg, quiet=True, report=True)
    out = capsys.readouterr().out
    written = (tmp_path / "sharding.txt").read_text()
    assert out.strip() == written.strip()
    assert written.startswith("parameters of ") and "\n\nbatch of " in written and "tokens" in written
    assert "MPMD plan" not in written and "glue" not in written


def test_pipeline_sharding_txt_has_stages_and_its_plan(pipeline):
    text = sharding_text(pipeline)
    assert "stage0 0-3" in text.split("batch of")[0] and "MPMD plan: " in text


@pytest.mark.parametrize("first_layout", ["fsdp", pytest.param("tiny", marks=pytest.mark.slow)])
def test_an_spmd_checkpoint_resumes_on_the_pipeline_like_one_device(first_layout, tmp_path):
    """One model for every layout: 2 steps of ``fsdp`` (parameters split over 8 devices; ``tiny``'s data x
    tensor with -m slow), then steps 3-4 on ``pipeline`` in the same ``out_dir`` from its checkpoint,
    against 4 steps on one device."""
    over = [*SMALL, TWO_BLOCKS, "train.steps=4", "train.checkpoint_every=2"]
    first = train(load_config(first_layout, [*over, f"train.out_dir={tmp_path / 'run'}"]), quiet=True, stop_after=3)
    assert first.step == 3  # killed after step 3: its checkpoint is step 2's
    moved = train(load_config("pipeline", [*over, "layout.pipeline.microbatches=2",
                                           f"train.out_dir={tmp_path / 'run'}"]), quiet=True)
    assert moved.start_step == 2 and moved.step == 4
    one = train(load_config("tiny", [*over, "layout.mesh={data: 1}", f"train.out_dir={tmp_path / 'one'}"]),
                quiet=True)
    np.testing.assert_allclose([moved.losses[s] for s in (3, 4)], [one.losses[s] for s in (3, 4)], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(jax.device_get(moved.state["params"])),
                    jax.tree.leaves(jax.device_get(one.state["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_scanned_stack_split_over_stages_is_reported_on_both():
    """``model.scan_layers``: a stacked parameter lives on both stages (half its layers on each); the
    report says so, and counts half of it on each stage, as ``--plan`` does."""
    program = traced("pipeline", "model.scan_layers=true")
    report = program.step.report()
    stages = _stage_column(report)
    assert stages["params/params/layers/mlp/wo/kernel"] == "stage0+stage1 0-7"
    assert stages["params/params/embed/embedding"] == "stage0 0-3"
    plans = stage_plans(program.config)
    assert {p.name: p.param_bytes for p in plans} == report.bytes_per_stage("params/")
    wo = next(leaf for leaf in report.leaves if leaf.path == "params/params/layers/mlp/wo/kernel")
    assert report.bytes_per_stage(wo.path) == {"stage0": wo.nbytes // 2, "stage1": wo.nbytes // 2}
