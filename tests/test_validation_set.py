"""The validation set of published runs (``benchmarks/published_runs.yaml``) and its comparison script
(``benchmarks/validate_planner.py``): every row well-formed, the split honest, and the script running on the
smallest row and saying why it does not build one it cannot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import fleet  # noqa: E402
import validate_planner as vp  # noqa: E402


def test_every_row_has_a_source_a_split_and_sizes():
    runs = vp.load_runs()
    assert len(runs) >= 8
    for r in runs:
        assert r.split in vp.SPLITS and len(r.source) > 80, r.name
        assert r.device_count > 0 and r.global_batch > 0 and r.seq_len > 0, r.name
        assert vp.source_flops(r) > 0 and vp.published_step(r) > 0, r.name
    held_out = [r for r in runs if r.split == "held_out"]
    buildable = [r for r in held_out if vp.why_not_compiled(r, vp.DEFAULT_MAX_DEVICES) is None]
    assert len(held_out) >= 8 and len(buildable) >= 5


def test_the_rows_looked_at_before_are_dev():
    """fleet.py's runs were seen while the planner's model was chosen: they, and only they, are dev."""
    assert {r.name for r in vp.load_runs() if r.split == "dev"} == set(fleet.RUNS)


def test_fleet_runs_are_the_dev_rows():
    """fleet.py prices the dev rows on its own: the same model, batch, layout and published figure as here."""
    for r in vp.load_runs():
        if r.split != "dev":
            continue
        ours, theirs = vp.as_fleet_run(r), fleet.RUNS[r.name]
        fields = ("devices", "mesh", "d_model", "num_layers", "num_heads", "head_dim", "d_ff", "vocab", "seq_len",
                  "global_batch", "tie_embeddings", "remat", "published_tflops")
        assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}, r.name
        assert theirs.source_flops(theirs) == pytest.approx(vp.source_flops(r), rel=2e-3), r.name


def test_the_sizes_agree_with_the_names_the_sources_give():
    """A typo in a shape shows as a parameter count far from the size the source names the model by
    (Megatron's 1.7B counts learned positions and biases the shape here omits: within 5%; LLM Foundry's rows
    are named by their NumParams column, not the table's size names)."""
    for r in vp.load_runs():
        nominal = float(re.search(r"(\d+(?:\.\d+)?)b", r.name).group(1)) * 1e9
        assert vp.parameter_count(r) == pytest.approx(nominal, rel=0.05), r.name


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("split: dev", "split: 2 dev"),
     r"megatron-1\.7b.*split='2 dev' must be a name.*'dev', 'held_out'"),
    (lambda t: t.replace("split: dev", "split: dev\n    grad_accum: 2"),
     r"megatron-1\.7b.*unknown field\(s\) \['grad_accum'\]"),
    (lambda t: re.sub(r"    source: &megatron >-\n(      .*\n)+", "", t), r"missing field\(s\) \['source'\]"),
    (lambda t: t.replace("data: 32, fsdp: 1", "data: 16, fsdp: 1"), r"covers 16 devices, not devices.count=32"),
    (lambda t: t.replace("heads: 24, kv_heads: 24", "heads: 24, kv_heads: 0"), r"positive integers.*model.kv_heads"),
    (lambda t: t.replace("kind: a100-80gb", "kind: a100-40gb"), r"a100-40gb"),
])
def test_a_malformed_row_is_named_with_its_field(tmp_path, edit, message):
    good = (REPO / "benchmarks" / "published_runs.yaml").read_text().split("\n  - name:")[1]
    path = tmp_path / "runs.yaml"
    path.write_text("runs:\n  - name:" + good)
    assert [r.name for r in vp.load_runs(path)] == ["megatron-1.7b"]  # unedited, the row loads
    path.write_text("runs:\n  - name:" + edit(good))
    with pytest.raises(Exception, match=message):
        vp.load_runs(path)


def test_the_script_prices_a_file_of_rows_and_says_why_it_skips_one(tmp_path):
    """``--runs FILE --json OUT``: any file in the schema; the table, the medians beside the constant-MFU rule
    of thumb's, and per row its name, published and predicted step and their ratio in the JSON."""
    import json

    import yaml

    runs = vp.load_runs()
    smallest = min(runs, key=lambda r: (r.device_count, vp.parameter_count(r)))
    too_big = next(r for r in runs if r.device_count // r.layout["pipeline"] > vp.DEFAULT_MAX_DEVICES)
    raw = yaml.safe_load(vp.RUNS_FILE.read_text())["runs"]
    mine = tmp_path / "mine.yaml"
    mine.write_text(yaml.safe_dump({"runs": [x for x in raw if x["name"] in (smallest.name, too_big.name)]}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "validate_planner.py"), "--runs", str(mine),
                          "--json", str(tmp_path / "out.json")], env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith(f"| {smallest.name} |"))
    predicted, published, ratio = (c.strip() for c in row.split("|")[4:7])
    step = float(predicted.removesuffix(" s"))
    assert step > 0 and float(published.removesuffix(" s")) == pytest.approx(vp.published_step(smallest), abs=1e-3)
    assert float(ratio) == pytest.approx(step / vp.published_step(smallest), abs=0.01)
    skipped = next(line for line in out.splitlines() if line.startswith(f"| {too_big.name} |"))
    assert "not compiled" in skipped and f"exceed --max-devices {vp.DEFAULT_MAX_DEVICES}" in skipped
    assert re.search(rf"{smallest.split}: median \|predicted / published step - 1\| = \d+% \(rule of thumb at "
                     rf"[\d.]+% MFU: \d+%\) over 1 compiled row", out)
    got = json.loads((tmp_path / "out.json").read_text())
    by_name = {x["name"]: x for x in got["rows"]}
    assert by_name[smallest.name]["predicted_step_s"] == pytest.approx(step, abs=1e-3)
    assert by_name[smallest.name]["ratio"] == pytest.approx(float(ratio), abs=0.01)
    assert by_name[smallest.name]["published_step_s"] == pytest.approx(vp.published_step(smallest))
    assert by_name[too_big.name]["ratio"] is None and "max-devices" in by_name[too_big.name]["not_compiled"]
    # the rule of thumb: every run at the median published MFU of the project's dev rows
    thumb = vp.rule_of_thumb_mfu()
    assert thumb == pytest.approx(sorted(vp.published_mfu(r) for r in runs if r.split == "dev")[2])
    assert by_name[smallest.name]["rule_of_thumb_ratio"] == pytest.approx(vp.published_mfu(smallest) / thumb)
    # a row with a field the schema does not have is refused, the field named
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"runs": [{**raw[0], "tokens_per_second": 1}]}))
    refused = subprocess.run([sys.executable, str(REPO / "benchmarks" / "validate_planner.py"), "--runs", str(bad)],
                             env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "unknown field(s) ['tokens_per_second']" in refused.stderr


def test_a_pipelined_run_is_one_stage_through_the_1f1b_schedule():
    r = next(r for r in vp.load_runs() if r.name == "megatron-39.1b")
    stage = vp.as_fleet_run(r)
    assert (stage.devices, stage.num_layers, stage.mesh, stage.global_batch) == (256, 24, {"data": 32, "tensor": 8},
                                                                                 1536)
    assert vp.source_flops(r) == pytest.approx(fleet.megatron_flops(vp.as_fleet_run(r, whole=True)))
    assert vp.as_fleet_run(r, whole=True).num_layers == 48
    one = fleet.Prediction(stage, "a100-80gb", compute=4.8, memory=1.0, communication=0.0, peak_bytes=0,
                           compile_seconds=0)
    p = vp.pipelined(r, one)
    m, stages = 1536 // 32, 2
    assert p.microbatches == m and p.compute == 4.8  # the stage's parts are shown
    # 1F1B: (m + p - 1) microbatch slots of forward and backward, plus the sends on the critical path (at most
    # one each way per slot: with two stages of equal costs, each slot waits on the other stage's send)
    from multimesh.estimate import get_profile
    from multimesh.estimate.timing import transfer_time
    send = transfer_time(2048 * 8192 * 2 // 8, get_profile("a100-80gb"), inside_node=False)
    bubble = 4.8 * (m + stages - 1) / m
    assert bubble < p.step_time <= bubble + 2 * (m + stages - 1) * send + 1e-9
