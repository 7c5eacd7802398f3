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
    (lambda t: t.replace("kind: a100-80gb", "kind: v100-32gb"),
     r"row 0 \(megatron-1\.7b\): devices.kind='v100-32gb' is no hardware profile; known: a100-40gb, a100-80gb, b200, "
     r"h100-sxm, h200, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e"),
])
def test_a_malformed_row_is_named_with_its_field(tmp_path, edit, message):
    good = (REPO / "benchmarks" / "published_runs.yaml").read_text().split("\n  - name:")[1]
    path = tmp_path / "runs.yaml"
    path.write_text("runs:\n  - name:" + good)
    assert [r.name for r in vp.load_runs(path)] == ["megatron-1.7b"]  # unedited, the row loads
    path.write_text("runs:\n  - name:" + edit(good))
    with pytest.raises(Exception, match=message):
        vp.load_runs(path)


@pytest.mark.parametrize("kind", ["a100-40gb", "b200", "tpu-v4", "tpu-v6e"])
def test_a_row_on_each_profiles_devices_loads_and_is_read_against_its_peak(tmp_path, kind):
    """A runs file may name any profile's devices: the row loads, its published MFU is over that profile's
    bfloat16 peak, and its table row names the kind."""
    from multimesh.estimate import PROFILES

    good = (REPO / "benchmarks" / "published_runs.yaml").read_text().split("\n  - name:")[1]
    path = tmp_path / "runs.yaml"
    path.write_text("runs:\n  - name:" + good.replace("kind: a100-80gb", f"kind: {kind}"))
    (r,) = vp.load_runs(path)
    assert r.devices["kind"] == kind and vp.as_fleet_run(r).profile == kind
    assert vp.published_mfu(r) == pytest.approx(r.published["tflops_per_device"] * 1e12
                                                / PROFILES[kind].peak_flops["bfloat16"])
    assert vp.format_row(r, None, "not built here").startswith(f"| megatron-1.7b | 32 {kind} |")


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


TINY_MOE = """runs:
  - name: tiny-moe-0.001b
    split: mine
    source: a tiny Mixture of Experts row written for this test, no source
    model: {layers: 2, d_model: 64, heads: 4, kv_heads: 4, head_dim: 16, ffn_kind: swiglu, vocab: 256, tied: true,
            experts: 8, top_k: 2, expert_ffn: 128}
    devices: {kind: h100-sxm, count: 8, per_node: 8}
    layout: {data: 2, fsdp: 1, tensor: 1, pipeline: 1, context: 1, expert: 4}
    global_batch: 16
    seq_len: 32
    precision: BF16
    remat: false
    published: {tflops_per_device: 100, tokens_per_s_per_device: 1000}
    flop_count: megatron_bridge
"""


def test_the_moe_rows_parse_and_price_from_their_own_figures():
    """The MoE rows: experts, top-k and the experts' width in place of ffn, an expert axis in the layout that
    splits the batch, the source's FLOP count per token from its TFLOP/s and tokens/s (so the published step is
    the tokens over the published tokens/s), and every parameter of every expert counted."""
    moe = [r for r in vp.load_runs() if r.split == "unseen_moe"]
    assert len(moe) >= 2 and all(r.is_moe for r in moe)
    for r in moe:
        assert vp.published_step(r) == pytest.approx(
            r.global_batch * r.seq_len / (r.device_count * r.published["tokens_per_s_per_device"]))
        run = vp.as_fleet_run(r)
        assert run.num_experts == r.model["experts"] and run.experts_per_token == r.model["top_k"]
        assert run.d_ff == r.model["expert_ffn"] and run.mesh["expert"] == r.layout["expert"]
    qwen = next(r for r in moe if r.name == "mbridge-qwen3-30b-a3b-h100x16-ep16")
    assert qwen.replicas == 16 and qwen.grad_accum == 1024 // 16  # micro batch 1 on each of 16 batch shards
    assert vp.parameter_count(qwen) == pytest.approx(30.5e9, rel=0.01)  # Qwen3-30B-A3B's model card: 30.5B


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("expert_ffn: 128}", "expert_ffn: 128, capacity_factor: 1.0}"),
     r"tiny-moe.*model has unknown field\(s\) \['capacity_factor'\].*optionally \['shared_experts'\]"),
    (lambda t: t.replace("expert: 4}", "experts: 4}"), r"layout has unknown field\(s\) \['experts'\]"),
    (lambda t: t.replace(", expert_ffn: 128}", "}"), r"model has missing field\(s\) \['expert_ffn'\]"),
    (lambda t: t.replace("top_k: 2", "top_k: 9"), r"model.top_k=9 exceeds model.experts=8"),
    (lambda t: t.replace("data: 2,", "data: 1,").replace("expert: 4}", "expert: 8}")
     .replace("experts: 8", "experts: 12"), r"model.experts=12 do not split evenly over layout.expert=8"),
    (lambda t: t.replace("flop_count: megatron_bridge", "flop_count: maxtext"),
     r"flop_count=maxtext counts a dense model's parameters"),
    (lambda t: t.replace(", tokens_per_s_per_device: 1000", ""), r"published.tokens_per_s_per_device, which the row"),
])
def test_a_malformed_moe_row_is_refused_with_its_field_named(tmp_path, edit, message):
    path = tmp_path / "runs.yaml"
    path.write_text(TINY_MOE)
    assert [r.name for r in vp.load_runs(path)] == ["tiny-moe-0.001b"]  # unedited, the row loads
    path.write_text(edit(TINY_MOE))
    with pytest.raises(vp.RunsFileError, match=message):
        vp.load_runs(path)


def test_an_expert_axis_needs_a_model_with_experts(tmp_path):
    good = (REPO / "benchmarks" / "published_runs.yaml").read_text().split("\n  - name:")[1]
    path = tmp_path / "runs.yaml"
    dense = "data: 32, fsdp: 1, tensor: 1, pipeline: 1, context: 1"
    path.write_text("runs:\n  - name:" + good.replace(dense, dense.replace("32", "16") + ", expert: 2"))
    with pytest.raises(vp.RunsFileError, match=r"megatron-1\.7b.*layout.expert=2 but the model has no experts"):
        vp.load_runs(path)


@pytest.mark.devices(8)
def test_a_tiny_moe_row_is_built_and_priced_with_its_all_to_alls(tmp_path):
    """The row becomes the example's MoE transformer on {data: 2, expert: 4}: tokens go to their experts'
    devices and back by all-to-all over the expert axis, in every block (two each way, forward and backward),
    and each block's grouped expert products are counted: each row of the receive buffer through its one
    expert (not every expert), the buffers sized at capacity factor 1 (the rows' dispatch: validate_planner's
    MOE_CAPACITY_FACTOR): each expert's slots hold the balanced load, 64 tokens x 2 / 8 experts = 16 copies
    from each device, so the buffers hold the k copies of each token once."""
    path = tmp_path / "runs.yaml"
    path.write_text(TINY_MOE)
    (r,) = vp.load_runs(path)
    run = vp.as_fleet_run(r)
    assert run.mesh == {"data": 2, "expert": 4}
    estimates, _ = fleet.compile_depths(run)
    counts = []
    for e in estimates:
        (program,) = e.programs
        a2a = [c for c in program.collectives if c.kind == "all-to-all"]
        assert a2a and all(c.axes == ("expert",) and c.group_size == 4 for c in a2a), program.collectives
        counts.append(sum(c.count for c in a2a))
    assert counts[1] > counts[0] >= 4  # another block, more all-to-alls
    b, s, d, heads, hd, experts_per_layer, f, k = r.global_batch, r.seq_len, 64, 4, 16, 8, 128, 2
    rows = b * s * k  # the receive buffers of 8 devices: 4 sources x 2 experts x 16 slots each
    experts = 3 * 2 * rows * d * f  # gate, up and down of each row
    attention = 2 * b * s * d * hd * 4 * heads + 2 * 2 * b * heads * s * s * hd  # projections; scores and values
    router = 2 * b * s * d * experts_per_layer
    one, two = (sum(dict(e.programs[0].matmul_dtypes).values()) * 8 for e in estimates)
    assert two - one == pytest.approx(3 * (experts + attention + router), rel=0.01)  # forward and two gradients
    p = fleet.predict(run, estimates, "h100-sxm")
    assert p.step_time > 0 and p.communication > 0
