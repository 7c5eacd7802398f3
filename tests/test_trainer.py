"""The config-driven trainer (trainers/): configs, layouts vs one device, golden shardings,
outputs, checkpoint/resume, sampling, the CLI.

Every layout is compared with the same config run on one device in the same
test session (never with stored numbers). The runs use a small model (the
layout configs' model with ``d_model=32``, short sequences, a small corpus);
the golden sharding tables use the configs exactly as shipped.

Regenerate the golden tables with ``MULTIMESH_UPDATE_GOLDEN=1 pytest tests/test_trainer.py -k golden``:
each test whose table changed rewrites its file and fails; review the diff, then run again without it.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import free_port

from multimesh.jax import MicrobatchMeanWarning

from trainers.config import Config, ConfigError, load_config
from trainers.continuation import saved_decay_steps
from trainers.layout import build_layout, sharding_rows, sharding_table
from trainers.optim import cut_warmup_note
from trainers.step import build_program, program_for
from trainers.train import built_line, train

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE_GOLDEN = os.environ.get("MULTIMESH_UPDATE_GOLDEN") == "1"

LAYOUTS = ["dp", "fsdp", "tp", "dp_tp", "pipeline", "pipeline4"]
CURVE_STEPS = 20
RTOL = 1e-4

#: Shrinks a config for tests (8 heads, so every layout applies; validation only at the end).
SMALL = [
    "model.d_model=32",
    "model.max_len=32",
    "data.seq_len=32",
    "data.batch_size=8",
    "data.max_bytes=200000",
    "train.eval_batches=2",
    "train.eval_every=1000",
    "train.log_every=5",
]
#: SPMD layouts run 2 blocks (tracing time grows with depth); the pipelines keep 4 (one per stage).
SPMD_LAYERS = "model.num_layers=2"
ONE_DEVICE = ["layout.mesh={data: 1}", "layout.pipeline=null"]


def small(name: str, tmp: Path, *overrides: str) -> Config:
    depth = [] if "pipeline" in name else [SPMD_LAYERS]
    return load_config(name, [*SMALL, *depth, f"train.out_dir={tmp}", *overrides])


def curve(cfg: Config, steps: int | None = None) -> list[float]:
    """The train losses of steps 1..``steps`` (default: all of ``train.steps``)."""
    result = train(cfg, quiet=True, stop_after=steps)
    return [result.losses[s] for s in range(1, (steps or cfg.train.steps) + 1)]


def params_of(result) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(result.state["params"]))]


# -- configs ---------------------------------------------------------------------------


def test_default_config_and_variants_load():
    tiny = load_config()
    assert tiny.name == "tiny" and tiny.layout.pipeline is None
    for name in LAYOUTS:
        cfg = load_config(name)
        assert cfg.name == name
        assert cfg.data == tiny.data and cfg.optimizer == tiny.optimizer and cfg.train.steps == tiny.train.steps
        assert cfg.model == tiny.model, name  # one model for every layout: any checkpoint resumes on any
        assert cfg.layout.num_devices == 8, name
    for name in ("gpu_small", "gpu_medium", "gpu_1b"):
        cfg = load_config(name)
        assert cfg.model.dtype == "bfloat16" and cfg.layout.num_devices == 1


def test_inheritance_replaces_the_mesh_and_merges_sections(tmp_path):
    assert load_config("dp").layout.mesh == {"data": 8}  # not merged with tiny's {data: 4, tensor: 2}
    (tmp_path / "child.yaml").write_text("base: tp\ntrain: {steps: 7}\nmodel: {num_layers: 8}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.name == "child"
    assert cfg.train.steps == 7 and cfg.train.eval_every == load_config("tp").train.eval_every
    assert cfg.model.num_layers == 8 and cfg.model.d_model == load_config("tp").model.d_model
    assert cfg.layout == load_config("tp").layout


def test_overrides_parse_yaml_values():
    cfg = load_config("tiny", ["optimizer.lr=1e-3", "layout.mesh={data: 2, tensor: 4}", "train.out_dir=x/y",
                               "layout.pipeline={stages: 2, microbatches: 2}", "model.tie_embeddings=false",
                               "data.paths=[a.py, b.py]", "name=exp"])
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.layout.mesh == {"data": 2, "tensor": 4}
    assert cfg.layout.pipeline.stages == 2 and cfg.layout.pipeline.schedule == "1f1b"
    assert cfg.data.paths == ("a.py", "b.py") and cfg.name == "exp"
    assert load_config("pipeline", ["layout.pipeline=null"]).layout.pipeline is None
    assert load_config("pipeline", ["layout.pipeline.microbatches=8"]).layout.pipeline.microbatches == 8
    # a byte count in exponent notation (PyYAML reads 80e9 as a string) or as a whole float is an int
    for written in ("80e9", "8.0e+10", "80000000000.0"):
        limit = load_config("tiny", [f"layout.memory_limit={written}"]).layout.memory_limit
        assert limit == 80_000_000_000 and isinstance(limit, int), written


@pytest.mark.parametrize("overrides, message", [
    (["model.d_modle=3"], r"model\.d_modle.*did you mean 'd_model'"),
    (["trian.steps=3"], r"trian\.steps.*did you mean 'train'"),
    (["train.steps=abc"], r"train\.steps: expected int, got 'abc'"),
    (["train.steps=2.5"], r"train\.steps: expected int, got 2\.5"),
    (["layout.memory_limit=1.5e0"], r"layout\.memory_limit: expected int or null, got '1\.5e0'"),
    (["optimizer.lr=fast"], r"optimizer\.lr: expected float"),
    (["train.steps=0"], r"train: steps must be >= 1"),
    (["optimizer.decay=step"], r"optimizer: decay='step'"),
    (["layout.rules=[[batch, model]]"],
     r"layout: rule \('batch', 'model'\) names mesh axis 'model', but the mesh has axes \{'data': 4, 'tensor': 2\}"),
    (["layout.rules=[[batch]]"], r"layout: rule #0 is \['batch'\]; each rule must be a pair"),
    (["layout.rules=megatron"], r"layout: rules='megatron'"),
    (["layout.pipeline.stages=2"], r"layout\.pipeline: missing key layout\.pipeline\.microbatches"),
    (["data.seq_len=512"], r"data\.seq_len=512 exceeds model\.max_len"),
    (["model.num_heads=3"], r"model: d_model=128 is not divisible by num_heads=3"),
    (["train.steps"], r"not of the form key\.sub=value"),
    (["layout.mesh.data.x=1"], r"layout\.mesh\.data is 4, not a mapping"),
    (["layout.mesh={data:3}"],
     r"layout\.mesh=\{data:3\}: YAML read 'data:3' as one key .*space after the colon: layout\.mesh=\{data: 3\}"),
    (["optimizer.decay_steps=0"], r"optimizer: decay_steps must be >= 1 or null"),
    (["layout.pipeline={stages: 2, microbatches: 4, schedule: zb-h3}"],
     r"layout\.pipeline: schedule='zb-h3': use one of \['1f1b', 'gpipe', 'interleaved', 'zb-h1', 'zb-h2'\]"),
    (["layout.pipeline={stages: 2, microbatches: 4, interleave: 2}"],
     r"layout\.pipeline: interleave=2 .* only schedule 'interleaved' .*set layout\.pipeline\.schedule=interleaved"),
    (["layout.pipeline={stages: 2, microbatches: 3, schedule: interleaved}"],
     r"layout\.pipeline: .*stages=2 must divide microbatches=3"),
    (["model.tie_embeddings=false", "layout.pipeline={stages: 2, microbatches: 4, schedule: interleaved}",
      "model.num_layers=6"],
     r"2 equal groups of blocks \(layout\.pipeline\.interleave=2\), so 4 must divide model\.num_layers=6"),
    (["model.tie_embeddings=false", "model.scan_layers=true",
      "layout.pipeline={stages: 2, microbatches: 4, schedule: interleaved}"],
     r"model\.scan_layers=true cannot run schedule 'interleaved'"),
])
def test_bad_keys_and_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found.*tiny"):
        load_config("no_such_config")
    (tmp_path / "a.yaml").write_text("base: b\n")
    (tmp_path / "b.yaml").write_text("base: a\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "bad.yaml").write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "extra.yaml").write_text("base: tiny\nmodell: {}\n")
    with pytest.raises(ConfigError, match="unknown key 'modell'.*did you mean 'model'"):
        load_config(tmp_path / "extra.yaml")


def test_config_round_trips_through_its_dict():
    from trainers.config import config_from_dict

    for name in ["tiny", *LAYOUTS]:
        cfg = load_config(name)
        assert config_from_dict(cfg.to_dict()) == cfg


# -- layouts vs one device ----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_curve(tmp_path_factory):
    """The loss curve of a config run on one device without pipeline (computed once per config)."""
    cache: dict = {}

    def get(cfg: Config, steps: int | None = None) -> list[float]:
        one = cfg.replace(name="one_device", layout={"mesh": {"data": 1}, "pipeline": None},
                          train={"out_dir": None})
        key = (repr(one.to_dict()), steps)
        if key not in cache:
            assert one.layout.num_devices == 1
            out = str(tmp_path_factory.mktemp("one_device"))
            cache[key] = curve(one.replace(train={"out_dir": out}), steps)
        return cache[key]

    return get


# dp, fsdp, pipeline, pipeline4 with -m slow (10 to 35 s each). In the default suite the fsdp and pipeline
# configs meet one device in test_stage_reports (trained on fsdp, resumed on the pipeline), the pipeline with
# its other schedules below; dp's data axis in dp_tp
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n.startswith("pipeline") or n in ("dp", "fsdp") else n for n in LAYOUTS])
def test_layout_matches_one_device(name, tmp_path, reference_curve):
    cfg = small(name, tmp_path, f"train.steps={CURVE_STEPS}")
    assert cfg.layout.num_devices == 8
    got = curve(cfg)
    want = reference_curve(cfg)
    np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"{name}: loss curve differs from one device")
    assert want[-1] < want[0] - 1.0  # it learns, so the comparison means something


@pytest.mark.slow  # one of the longest checks: the default suite's time
def test_sequence_rules_split_the_sequence_and_train_like_one_device(tmp_path, reference_curve):
    """``layout.rules: sequence`` (Megatron's sequence parallelism, a rule set the layout search tries):
    the residual stream's sequence is split over the tensor axis, so the step gathers it there, which
    the standard rules never do; the loss curve is still one device's."""
    from collections import Counter

    cfg = small("dp_tp", tmp_path, f"train.steps={CURVE_STEPS}", "layout.rules=sequence")

    def tensor_gathers(c: Config) -> int:
        est = program_for(c).step.estimate()
        kinds = Counter(x.kind for p in est.programs for x in p.collectives if x.axes == ("tensor",))
        return kinds["all-gather"]

    assert tensor_gathers(cfg) > 0 and tensor_gathers(cfg.replace(layout={"rules": "standard"})) == 0
    assert build_layout(cfg.layout).describe() == "SPMD on 8 devices, mesh data=4xtensor=2 (sequence rules)"
    np.testing.assert_allclose(curve(cfg), reference_curve(cfg), rtol=RTOL)


@pytest.mark.slow  # ~5 min: the configs' full-size model, 6 layouts and 2 one-device references
@pytest.mark.parametrize("name", LAYOUTS)
def test_shipped_layout_config_matches_one_device(name, tmp_path, reference_curve):
    """The config exactly as shipped (model, data, schedule), its first 20 steps."""
    cfg = load_config(name, [f"train.out_dir={tmp_path}"])
    got = curve(cfg, CURVE_STEPS)
    want = reference_curve(cfg, CURVE_STEPS)
    np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"{name}: loss curve differs from one device")
    assert want[-1] < want[0] - 0.5


def test_bfloat16_compute_keeps_float32_parameters(tmp_path, reference_curve):
    """Mixed precision on a parallel layout: bfloat16 compute, float32 parameters and optimizer state,
    a loss curve close to (not equal to) the float32 one."""
    cfg = small("dp_tp", tmp_path, "train.steps=4", "model.dtype=bfloat16")
    result = train(cfg, quiet=True)
    dtypes = {x.dtype for x in jax.tree.leaves(result.state) if x.ndim > 0}
    assert dtypes == {np.dtype("float32")}
    f32 = reference_curve(cfg.replace(model={"dtype": "float32"}))
    got = [result.losses[s] for s in range(1, 5)]
    np.testing.assert_allclose(got, f32, rtol=2e-2)
    assert got != f32  # the compute did run in bfloat16


def test_pipeline_layout_runs_on_the_devices_it_is_given(tmp_path):
    """Stages go on the layout's own devices (register_task is handed them), not on a prefix of jax.devices()."""
    cfg = small("pipeline", tmp_path, "layout.mesh={data: 2}")
    devices = jax.devices()[::-1]
    layout = build_layout(cfg.layout, devices)
    assert layout.devices == tuple(devices[:4])
    batch = {"tokens": np.zeros((cfg.data.batch_size, cfg.data.seq_len + 1), np.int32)}
    with layout.tasks(cfg.model.num_layers):
        program = build_program(cfg, layout, batch, batch)
    rows = {path: dev for path, _, _, _, dev in sharding_rows(program.step)}
    assert rows["params/params/embed/embedding"] == "6-7" and rows["params/params/head/final_norm/scale"] == "4-5"
    assert {rows[f"params/params/layers_{i}/mlp/wo/kernel"] for i in range(4)} == {"6-7", "4-5"}


def test_the_build_line_gives_the_time_and_a_pipelines_program_calls(tmp_path):
    """What a user waits for before the first step: building (tracing, planning) and, for a pipeline, its
    program calls a step: at least each of the 2 stages' forward and backward of each of 4 microbatches."""
    batch = {"tokens": np.zeros((8, 33), np.int32)}
    for name, over, shape in [("pipeline", ["layout.pipeline.microbatches=4"], r" \((\d+) program calls a step\)"),
                              ("tiny", [], "")]:
        cfg = small(name, tmp_path, *over)
        layout = build_layout(cfg.layout)
        with layout.tasks(cfg.model.num_layers):
            program = build_program(cfg, layout, batch, batch)
        line = built_line(program, 2.34)
        found = re.fullmatch(r"step built in 2\.3 s" + shape + "; its programs compile in the first step", line)
        assert found, line
        if shape:
            assert int(found.group(1)) >= 2 * 2 * 4, line


# interleaved (20 s) and zb-h1 (15 s) with -m slow; they meet one device across processes in test_multiprocess
@pytest.mark.parametrize("schedule", [pytest.param(s, marks=pytest.mark.slow) for s in ("interleaved", "zb-h1")]
                         + ["zb-h2"])
def test_pipeline_schedule_matches_one_device(schedule, tmp_path, reference_curve):
    """The library's other schedules in the trainer, 2 steps on 2 stages of one device each, 2 microbatches,
    against the one-device curve of the pipeline layouts' model (shared with test_layout_matches_one_device);
    interleaved deals the 4 blocks round-robin, one per group (blocks 0, 2 on stage 0; 1, 3 on stage 1)."""
    cfg = small("pipeline", tmp_path, f"train.steps={CURVE_STEPS}", "layout.mesh={data: 1}",
                "layout.pipeline.microbatches=2", f"layout.pipeline.schedule={schedule}")
    assert cfg.layout.pipeline.chunks == (2 if schedule == "interleaved" else 1)
    result = train(cfg, quiet=True, stop_after=2)
    got = [result.losses[s] for s in (1, 2)]
    np.testing.assert_allclose(got, reference_curve(cfg)[:2], rtol=RTOL, err_msg=f"{schedule}: differs from one device")
    kernels = {jax.tree_util.keystr(path): leaf for path, leaf in
               jax.tree_util.tree_leaves_with_path(result.state["params"]) if "'wo'" in jax.tree_util.keystr(path)}
    stage_of = [next(sorted(d.id for d in leaf.sharding.device_set) for key, leaf in kernels.items()
                     if f"'layers_{i}'" in key) for i in range(4)]
    assert stage_of == ([[0], [1], [0], [1]] if schedule == "interleaved" else [[0], [0], [1], [1]])


# -- golden sharding tables -------------------------------------------------------------------


@functools.cache
def traced_program(name: str):
    """Config ``name`` as shipped, built (traced, not run)."""
    return program_for(load_config(name))


def golden_table(name: str) -> str:
    """The parameters' sharding table of config ``name``."""
    program = traced_program(name)
    return f"# {name}: {program.layout.describe()}\n" + sharding_table(program.step)


@pytest.mark.parametrize("name", ["tiny", *LAYOUTS])
def test_golden_sharding_table(name):
    """The table equals its golden file. With MULTIMESH_UPDATE_GOLDEN=1 a table that differs is written
    to the file and the test still fails (so that no run passes on a golden file it has just written)."""
    check_golden(name, GOLDEN / f"sharding_{name}.txt", UPDATE_GOLDEN)


@pytest.mark.parametrize("name", ["pipeline", "moe_pipeline"])
def test_a_pipelined_config_is_not_taken_for_a_mean_over_its_microbatch(name):
    """The step's loss is divided by the step's tokens; its MoE term, weighted by the microbatch's share of
    them, must not read as a mean over the microbatch (a product with 1/4 did, with 4 microbatches)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicrobatchMeanWarning)
        traced_program(name)


def check_golden(name: str, path: Path, update: bool) -> None:
    table = golden_table(name)
    old = path.read_text() if path.exists() else None
    if table == old:
        return
    diff = "".join(difflib.unified_diff((old or "").splitlines(keepends=True), table.splitlines(keepends=True),
                                        f"{path.name} (golden)", f"{path.name} (now)"))
    if update:
        path.parent.mkdir(exist_ok=True)
        path.write_text(table)
        pytest.fail(f"MULTIMESH_UPDATE_GOLDEN=1: {'rewrote' if old is not None else 'wrote'} {path}; review the "
                    f"change (git diff) and run again without MULTIMESH_UPDATE_GOLDEN\n{diff}")
    assert old is not None, f"no golden file {path}; write it with MULTIMESH_UPDATE_GOLDEN=1"
    pytest.fail(f"the sharding of config {name!r} changed; if intended, regenerate with MULTIMESH_UPDATE_GOLDEN=1\n"
                f"{diff}")


def test_golden_update_mode_rewrites_and_still_fails(tmp_path):
    """Update mode passes only on an unchanged file; a changed or missing one is written and the test fails."""
    table = golden_table("tiny")
    path = tmp_path / "sharding_tiny.txt"
    with pytest.raises(pytest.fail.Exception, match="MULTIMESH_UPDATE_GOLDEN=1: wrote"):
        check_golden("tiny", path, update=True)
    assert path.read_text() == table
    check_golden("tiny", path, update=True)  # unchanged: nothing to do
    check_golden("tiny", path, update=False)
    path.write_text(table.replace("P(", "Q(", 1))
    with pytest.raises(pytest.fail.Exception, match=r"(?sm)config 'tiny' changed.*^-.*Q\(.*^\+.*P\("):
        check_golden("tiny", path, update=False)
    with pytest.raises(pytest.fail.Exception, match=r"MULTIMESH_UPDATE_GOLDEN=1: rewrote .*run again without"):
        check_golden("tiny", path, update=True)
    assert path.read_text() == table


def test_golden_tables_make_sense():
    """Spot checks, independent of the golden files, of what each layout must do."""
    specs = {name: {path: spec for path, _, spec, _, _ in sharding_rows(traced_program(name).step)}
             for name in ("dp", "fsdp", "tp", "pipeline4")}
    wi, query = "params/params/layers_0/mlp/wi_0/kernel", "params/params/layers_0/attn/query/kernel"
    assert specs["fsdp"][wi] == "P('data', None)"  # embed over data
    assert specs["fsdp"]["params/params/embed/embedding"] == "P(None, 'data')"
    assert specs["tp"][wi] == "P(None, 'tensor')"  # mlp over tensor
    assert specs["tp"][query] == "P(None, 'tensor', None)"  # heads over tensor
    assert all("'" not in spec for spec in specs["dp"].values())  # replicated
    devices = {path: dev for path, _, _, _, dev in sharding_rows(traced_program("pipeline4").step)}
    assert [devices[f"params/params/layers_{i}/mlp/wo/kernel"] for i in range(4)] == ["0-1", "2-3", "4-5", "6-7"]
    assert devices["params/params/embed/embedding"] == "0-1" and devices["params/params/head/final_norm/scale"] == "6-7"


# -- outputs, checkpoints, resume ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The default config, shrunk: 12 steps, a checkpoint every 4, validation every 6."""
    out = tmp_path_factory.mktemp("tiny")
    cfg = small("tiny", out, "train.steps=12", "train.checkpoint_every=4", "train.eval_every=6",
                "train.log_every=3", "train.keep=2")
    return train(cfg, quiet=True)


def test_tiny_default_writes_metrics_plot_and_checkpoints(tiny_run):
    result, out = tiny_run, tiny_run.out_dir
    assert result.step == 12 and sorted(result.losses) == list(range(1, 13))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6, 9, 12]
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "wall_time", "grad_norm"} <= set(r)
    assert records[0]["loss"] == pytest.approx(np.mean([result.losses[s] for s in (1, 2, 3)]))
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    assert records[-1]["val_loss"] == pytest.approx(result.val_loss)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [8, 12]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 12 and summary["val_loss"] == pytest.approx(result.val_loss)
    assert load_config(out / "config.yaml").model == result.config.model
    assert "params/params/embed/embedding" in (out / "sharding.txt").read_text()
    assert "final validation loss" in result.summary()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """dp_tp, 12 steps with a checkpoint every 4, run in one go."""
    return train(small("dp_tp", tmp_path_factory.mktemp("whole"), *RESUME), quiet=True)


RESUME = ("train.steps=12", "train.checkpoint_every=4")


def test_interrupted_run_resumes_bit_for_bit_and_onto_another_layout(tmp_path, uninterrupted):
    whole = uninterrupted
    first = train(small("dp_tp", tmp_path / "cut", *RESUME), quiet=True, stop_after=6)  # dies after step 6
    assert first.step == 6 and (tmp_path / "cut" / "checkpoints" / "4").is_dir()
    shutil.copytree(tmp_path / "cut", tmp_path / "moved")

    second = train(small("dp_tp", tmp_path / "cut", *RESUME), quiet=True)  # same layout: bit for bit
    assert second.start_step == 4 and second.step == 12
    assert [second.losses[s] for s in range(5, 13)] == [whole.losses[s] for s in range(5, 13)]
    for a, b in zip(params_of(second), params_of(whole)):
        np.testing.assert_array_equal(a, b)
    assert second.val_loss == whole.val_loss
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 10, 12]  # the dead run's line for step 5 was replaced, not duplicated

    moved = train(small("fsdp", tmp_path / "moved", *RESUME), quiet=True)  # another layout: same numbers
    assert moved.start_step == 4
    np.testing.assert_allclose([moved.losses[s] for s in range(5, 13)], [whole.losses[s] for s in range(5, 13)],
                               rtol=RTOL)


@pytest.mark.slow  # ~60 s: two pipeline programs
def test_pipeline_checkpoint_resumes_on_another_pipeline_and_one_device(tmp_path, reference_curve):
    """Saved from 2 stages (leaves on two submeshes), resumed on 4 stages and on one device."""
    over = ("train.steps=8", "train.checkpoint_every=4")
    cut = small("pipeline", tmp_path / "run", *over)
    train(cut, quiet=True, stop_after=6)
    shutil.copytree(tmp_path / "run", tmp_path / "one")
    on_four = train(small("pipeline4", tmp_path / "run", *over), quiet=True)
    on_one = train(cut.replace(layout={"mesh": {"data": 1}, "pipeline": None},
                               train={"out_dir": str(tmp_path / "one")}), quiet=True)
    assert on_four.start_step == on_one.start_step == 4
    want = reference_curve(small("pipeline", tmp_path / "ref", *over))
    np.testing.assert_allclose([on_four.losses[s] for s in range(5, 9)], want[4:], rtol=RTOL)
    np.testing.assert_allclose([on_one.losses[s] for s in range(5, 9)], want[4:], rtol=RTOL)


def test_resume_refuses_another_model_naming_the_fields(tiny_run):
    with pytest.raises(ConfigError) as e:
        train(tiny_run.config.replace(model={"num_layers": 3, "tie_embeddings": False}), quiet=True)
    message = str(e.value)
    assert "checkpoints/12" in message
    assert "model.num_layers: 2 -> 3, model.tie_embeddings: true -> false (saved -> now)" in message
    assert "model.num_layers=2 model.tie_embeddings=true" in message  # the overrides that resume it
    assert "TransformerConfig(" not in message and "d_model" not in message  # not two whole configs
    with pytest.raises(ConfigError, match="train.resume is false"):
        train(tiny_run.config.replace(train={"resume": False}), quiet=True)


def _lr_column(out: Path) -> list[float]:
    return [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # one of the longest checks (7 s): the default suite's time
def test_a_longer_run_continues_the_learning_rate_schedule(tmp_path, capsys):
    """N steps, then resumed with train.steps=2N: the LR of every step (and the loss) is that of one
    2N-step run with optimizer.decay_steps=N, not a schedule stretched to 2N; a resume that changes an
    optimizer setting names it."""
    n = 4
    over = [*ONE_DEVICE, "model.num_layers=1", "optimizer.warmup_steps=2", "train.log_every=1",
            "train.checkpoint_every=0"]
    train(small("tiny", tmp_path / "cut", *over, f"train.steps={n}"), quiet=True)
    resumed = train(small("tiny", tmp_path / "cut", *over, f"train.steps={2 * n}"), quiet=True)
    whole = train(small("tiny", tmp_path / "whole", *over, f"train.steps={2 * n}", f"optimizer.decay_steps={n}"),
                  quiet=True)
    assert resumed.start_step == n and resumed.config.optimizer.decay_steps == n
    lrs = _lr_column(tmp_path / "cut")
    assert len(lrs) == 2 * n and lrs == _lr_column(tmp_path / "whole")
    assert lrs[n:] == [pytest.approx(resumed.config.optimizer.min_lr)] * n  # the decay ended at step n
    assert [resumed.losses[s] for s in range(n + 1, 2 * n + 1)] == [whole.losses[s] for s in range(n + 1, 2 * n + 1)]
    assert "decay_steps: 4" in (tmp_path / "cut" / "config.yaml").read_text()

    capsys.readouterr()
    train(small("tiny", tmp_path / "cut", *over, f"train.steps={2 * n + 1}", "optimizer.lr=1e-3",
                f"optimizer.decay_steps={3 * n}"))
    lines = [line for line in capsys.readouterr().out.splitlines() if "optimizer settings" in line]
    want = ("resumed with other optimizer settings than the checkpoint's: optimizer.lr: 0.003 -> 0.001, "
            f"optimizer.decay_steps: {n} -> {3 * n}")
    assert lines == [want]


def test_schedule_length_of_older_checkpoints_and_cut_warmups():
    """A checkpoint written before decay_steps existed ran its schedule over its train.steps."""
    assert saved_decay_steps({"optimizer": {"lr": 1e-3}, "train": {"steps": 600}}) == 600
    assert saved_decay_steps({"optimizer": {"decay_steps": 50}, "train": {"steps": 600}}) == 50
    assert saved_decay_steps({}) is None
    tiny = load_config("tiny")
    assert cut_warmup_note(tiny.optimizer, 600) is None
    assert cut_warmup_note(tiny.optimizer, 20) == (
        "optimizer.warmup_steps=50 is longer than the schedule (optimizer.decay_steps=20): the warmup is cut to 20 "
        "steps; set optimizer.warmup_steps or optimizer.decay_steps to keep it")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainers", *args]


@pytest.mark.slow  # ~30 s: two fresh processes (the in-process resume test above is in the fast suite)
def test_sigkill_midway_then_restart(tmp_path):
    """The CLI killed by SIGKILL (during training, probably mid-save: it saves every step); the
    restart resumes from the last complete checkpoint and ends exactly where an uninterrupted run does."""
    over = [*SMALL, SPMD_LAYERS, "train.steps=30", "train.checkpoint_every=1"]
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(_cli("dp_tp", *over, f"train.out_dir={run_dir}", "-q"), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "3").is_dir():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (run_dir / "summary.json").exists()
    done = subprocess.run(_cli("dp_tp", *over, f"train.out_dir={run_dir}", "-q"), cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 3 <= summary["start_step"] < 30 and summary["step"] == 30
    whole = train(load_config("dp_tp", [*over, "train.checkpoint_every=0", f"train.out_dir={tmp_path / 'whole'}"]),
                  quiet=True)
    assert summary["val_loss"] == whole.val_loss


# -- sampling and the command line ---------------------------------------------------------


def test_sample_from_checkpoint(tiny_run, capsys, caplog):
    from trainers.cli import main
    from trainers.sample import sample_text

    run = tiny_run.out_dir
    caplog.clear()
    text, ck = sample_text(run, "def ", 24, temperature=0.0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # Orbax's read-only notes
    assert ck.step == 12 and isinstance(text, str) and text
    assert sample_text(run, "def ", 24, temperature=0.0)[0] == text  # greedy decoding is deterministic
    assert sample_text(run, "def ", 8, step=8)[1].step == 8
    assert main(["sample", "--run", str(run), "--prompt", "import ", "--tokens", "16"]) == 0
    assert capsys.readouterr().out.startswith("import ")


def test_cli_help_and_print_config(capsys):
    from trainers.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "multimesh-train" in out and "key=value" in out and "sample" in out
    assert main(["dp", "--print-config", "train.steps=5"]) == 0
    printed = capsys.readouterr().out
    assert "steps: 5" in printed and "data: 8" in printed
    assert main(["tiny", "model.d_modle=3"]) == 2
    assert "model.d_modle" in capsys.readouterr().err


def test_cli_trains(tmp_path, capsys):
    from trainers.cli import main

    args = ["dp", *SMALL, SPMD_LAYERS, "train.steps=2", f"train.out_dir={tmp_path}", "--quiet"]
    assert main(args) == 0
    assert "final validation loss" in capsys.readouterr().out
    assert main([*args, "train.steps=3"]) == 0  # resumes from step 2
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == 2


def test_console_script_help():
    exe = Path(sys.executable).parent / "multimesh-train"
    cmd = [str(exe), "--help"] if exe.exists() else _cli("--help")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0 and "usage: multimesh-train" in done.stdout


# -- several processes ---------------------------------------------------------------------


def _spawn(args: list[str], n: int) -> list[subprocess.Popen]:
    """``multimesh-train ARGS`` as ``n`` processes joined by jax.distributed (8/n CPU devices each)."""
    # without the suite's compilation cache, as every multi-process test: two processes loading one cached
    # executable hang at their first step on XLA:CPU
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    port = free_port("localhost")
    return [subprocess.Popen(_cli(*args, "--coordinator", f"localhost:{port}", "--num-processes", str(n),
                                  "--process-id", str(i), "-q"),
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(n)]


def _finish(procs: list[subprocess.Popen], timeout: float = 400) -> list[str]:
    """Wait for the processes; their stderr."""
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()


def _run_processes(args: list[str], n: int) -> None:
    procs = _spawn(args, n)
    for i, (p, err) in enumerate(zip(procs, _finish(procs))):
        assert p.returncode == 0, f"process {i} failed:\n{err[-4000:]}"


def _two_processes_follow_one_and_resume_in_one(name: str, over: list[str], steps: int, tmp_path: Path) -> None:
    """``name`` for ``steps`` steps in 2 processes and in this one: the same losses; both runs' final
    checkpoints, resumed in this process for 2 more steps, go on the same way."""
    _run_processes([name, *over, f"train.steps={steps}", f"train.out_dir={tmp_path / 'two'}"], 2)
    two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    one = train(load_config(name, [*over, f"train.steps={steps}", f"train.out_dir={tmp_path / 'one'}"]), quiet=True)
    assert [r["step"] for r in two] == list(range(1, steps + 1))
    np.testing.assert_allclose([r["loss"] for r in two], [one.losses[s] for s in range(1, steps + 1)], rtol=RTOL)

    more = [*over, f"train.steps={steps + 2}"]
    from_two = train(load_config(name, [*more, f"train.out_dir={tmp_path / 'two'}"]), quiet=True)
    from_one = train(load_config(name, [*more, f"train.out_dir={tmp_path / 'one'}"]), quiet=True)
    assert from_two.start_step == from_one.start_step == steps
    np.testing.assert_allclose([from_two.losses[s] for s in (steps + 1, steps + 2)],
                               [from_one.losses[s] for s in (steps + 1, steps + 2)], rtol=RTOL)


# -m slow (20 s each; the default suite's 15 minutes): a 2-process trainer run stays in test_newcomer_output
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp_tp", "tp"])  # batch split / replicated
def test_two_processes_follow_one_process_and_resume_in_one(name, tmp_path):
    """Two processes of 4 devices each (data read per process, global arrays, checkpoints written by both)
    give one process's losses, and their checkpoint resumes in one process."""
    over = [*SMALL, SPMD_LAYERS, "train.checkpoint_every=2", "train.log_every=1"]
    _two_processes_follow_one_and_resume_in_one(name, over, 4, tmp_path)


@pytest.mark.slow  # ~4 min: a 20-step pipeline in 2 fresh processes and in this one
@pytest.mark.parametrize("name", ["pipeline", "pipeline4"])
def test_a_pipeline_on_two_processes_follows_one_process_and_resumes_in_one(name, tmp_path):
    """Stages on the processes' devices in order (pipeline: one stage per process; pipeline4: two each):
    the losses of 20 steps equal one process's, and the 2-process checkpoint resumes in one process."""
    over = [*SMALL, "train.checkpoint_every=10", "train.log_every=1"]
    _two_processes_follow_one_and_resume_in_one(name, over, 20, tmp_path)


@pytest.mark.slow  # ~3 min
def test_a_process_killed_mid_pipeline_run_stops_the_other_and_the_last_checkpoint_resumes(tmp_path):
    """SIGKILL process 1 of a 2-process pipeline run after step 6: process 0 stops within a bounded time with
    an error naming it, and the newest committed checkpoint resumes in one process."""
    out = tmp_path / "run"
    over = [*SMALL, "train.steps=1000", "train.checkpoint_every=2", "train.log_every=1", f"train.out_dir={out}"]
    procs = _spawn(["pipeline", *over], 2)
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 400
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 6):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no step 6"
            time.sleep(0.5)
        procs[1].kill()
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        stopped = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode != 0 and stopped < 60, (procs[0].returncode, stopped, err[-3000:])
    # ours (a step or the excepthook asked the coordinator), or JAX's own when its coordination service
    # noticed first, e.g. in a checkpoint's commit barrier: "Task 1 heartbeat timeout", or its error poll:
    # "The following tasks are unhealthy (stopped sending heartbeats):\n1" (as test_multiprocess accepts)
    assert "process(es) [1] stopped" in err or re.search(
        r"[Tt]ask:? ?1\b|stopped sending heartbeats\):\s*1\b", err), err[-3000:]
    resumed = train(load_config("pipeline", [*over, "train.steps=12"]), quiet=True)
    assert 2 <= resumed.start_step < 12 and resumed.start_step % 2 == 0
    assert sorted(resumed.losses) == list(range(resumed.start_step + 1, 13))
