"""benchmarks/gpu_run.py, the prepared GPU measurement, run on the CPU in its dry-run mode, and the configs
it measures."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import jax
import numpy as np

from trainers.config import load_config
from trainers.step import build_model, initializers

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "benchmarks" / "gpu_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_1b_config_has_a_billion_parameters_in_bfloat16():
    cfg = load_config("gpu_1b")
    init_params, _ = initializers(cfg, build_model(cfg.model), None)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(init_params)))
    assert 1.0e9 <= count <= 1.3e9, count
    assert cfg.model.dtype == "bfloat16" and cfg.layout.num_devices == 1
    assert cfg.model.head_dim % 8 == 0 and cfg.model.head_dim <= 128  # a head cuDNN's fused kernel takes


def test_dry_run_measures_step_time_and_mfu_against_the_prediction():
    script = _script()
    row = script.measure("gpu_1b", steps=1, rounds=1, dry_run=True)  # what each of its processes runs
    assert row["dry_run"] and row["config"] == "gpu_1b" and row["attention"] == "xla"  # no GPU here
    assert row["params"] < 1e6  # shrunk
    tokens = 2 * 32
    assert row["model_flops"] > 6 * row["params"] * tokens  # 6ND plus attention
    for key in ("step_s", "predicted_s", "mfu", "predicted_mfu", "loss"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert math.isclose(row["mfu"], row["model_flops"] / (row["step_s"] * row["peak_flops"]))
    line = script.table_row(row)
    assert line.startswith("| gpu_1b (bfloat16) |") and line.count("|") == script.HEADER.splitlines()[0].count("|")
