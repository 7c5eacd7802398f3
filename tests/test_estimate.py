"""Estimates before running: exact bytes per device, collectives from the compiled HLO, a time model, errors."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from multimesh.estimate import (
    PROFILES,
    CalibratedProfile,
    Collective,
    HardwareProfile,
    MemoryLimitError,
    UnknownProfileError,
    calibrate,
    collective_time,
    find_collectives,
    get_profile,
)
from multimesh.estimate.timing import FRESH_MAPPING_BYTES, program_time
from multimesh.jax import build_mesh, estimate, microbatch, parallelize, task, with_sharding_constraint

pytestmark = pytest.mark.devices(8)

_CONFIGS = Path(__file__).resolve().parent.parent / "configs"

B, D, H = 16, 16, 32
TX = optax.adam(1e-2)


def init_state(n_layers: int):
    def init():
        keys = jax.random.split(jax.random.key(0), 2 * n_layers)
        p = {f"s{i}": {"a": jax.random.normal(keys[2 * i], (D, H)), "b": jax.random.normal(keys[2 * i + 1], (H, D))}
             for i in range(n_layers)}
        return {"params": p, "opt_state": TX.init(p)}
    return init


def make_batch():
    return {"x": jax.random.normal(jax.random.key(5), (B, D)), "y": jax.random.normal(jax.random.key(6), (B, D))}


def layer(w, x):
    return x + jnp.tanh(x @ w["a"]) @ w["b"]


def train_step(loss):
    def step(state, b):
        value, grads = jax.value_and_grad(loss)(state["params"], b)
        updates, opt = TX.update(grads, state["opt_state"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}
    return step


def chain(stages):
    def loss(p, b):
        h = b["x"]
        for i, s in enumerate(stages):
            h = s(p[f"s{i}"], h)
        return jnp.mean((h - b["y"]) ** 2)
    return loss


def bytes_held(tree) -> dict[int, int]:
    """Device id -> bytes of the shards the arrays of ``tree`` hold there (what the step actually built)."""
    out: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def assert_held_equals_built(est, state, batch):
    for kind, tree in (("params", state["params"]), ("optimizer", state["opt_state"]), ("batch", batch)):
        built = bytes_held(tree)
        estimated = {d: getattr(m, kind) for d, m in est.memory.items() if getattr(m, kind)}
        assert estimated == built, kind


@pytest.fixture(scope="module")
def fsdp():
    """FSDP on 8 devices: every matrix's first dimension and the batch split over ``fsdp``."""
    fn, init, get_batch = parallelize(
        train_step(chain([layer, layer])), init_params=init_state(2), get_input_batch=make_batch,
        mesh=build_mesh({"fsdp": 8}), rules=[("batch", "fsdp")], param_rules=[(r"/(a|b)$", P("fsdp"))])
    return fn, init(), get_batch()


@pytest.fixture(scope="module")
def pipeline():
    """Two stages of 4 devices (data 2 x model 2), matrices split over ``model``, 1F1B over 4 microbatches."""
    devices = np.array(jax.devices())
    meshes = [build_mesh({"data": 2, "model": 2}, devices[:4]), build_mesh({"data": 2, "model": 2}, devices[4:])]

    def tp_layer(w, x):
        h = with_sharding_constraint(jnp.tanh(x @ w["a"]), P("data", "model"))
        return x + h @ w["b"]

    stages = [task(tp_layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    loss = chain(stages)

    def step(state, b):
        value, grads = jax.value_and_grad(microbatch(loss, 0, B // 4, argnum=1, schedule="1f1b"))(
            state["params"], b)
        updates, opt = TX.update(grads, state["opt_state"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}

    fn, init, get_batch = parallelize(step, init_params=init_state(2), get_input_batch=make_batch,
                                      rules=[("batch", "data")],
                                      param_rules=[(r"/a$", P(None, "model")), (r"/b$", P("model", None))])
    return fn, init(), get_batch()


def test_fsdp_bytes_per_device_equal_the_built_shards(fsdp):
    fn, state, batch = fsdp
    before = len(jax.live_arrays())
    est = fn.estimate()
    assert len(jax.live_arrays()) == before  # compiled from abstract inputs: nothing allocated
    assert_held_equals_built(est, state, batch)
    # each device holds 1/8 of every matrix: the layout is what was asked, not everything replicated
    assert est.memory[0].params == 2 * 2 * D * H * 4 // 8
    # XLA's own count of the program's arguments agrees with the layouts
    (program,) = est.programs
    assert program.argument_bytes == est.memory[0].held
    assert est.memory[0].peak == program.peak_bytes


def test_pipeline_bytes_per_device_equal_the_built_shards(pipeline):
    fn, state, batch = pipeline
    before = len(jax.live_arrays())
    est = estimate(fn)
    assert len(jax.live_arrays()) == before
    assert_held_equals_built(est, state, batch)
    assert est.memory[0].params == 2 * D * H * 4 // 2  # stage 0's two matrices, split over model=2
    assert {d: m.stage for d, m in est.memory.items()} == {**dict.fromkeys(range(4), "stage0"),
                                                           **dict.fromkeys(range(4, 8), "stage1")}
    # every program of the runtime was compiled, each on its stage's four devices
    assert len(est.programs) == len(fn.runtime.programs)
    assert all(len(p.devices) == 4 and p.executions >= 1 for p in est.programs)
    assert sum(p.executions for p in est.programs) == len(fn.plan.segments)
    # 1F1B: stage 0 holds two microbatches' activations at its peak, stage 1 one
    assert fn.plan.schedule.peak_live_activations == {0: 2, 1: 1}
    assert 0 < est.memory[4].stashed < est.memory[0].stashed
    assert sum(t[3] for t in est.transfers) == sum(t[4] for t in fn.plan.transfers()) > 0


def tensor_parallel_step(rules):
    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["s0"]["a"]) @ p["s0"]["b"] - b["y"]) ** 2)
    return parallelize(train_step(loss), init_params=init_state(1), get_input_batch=make_batch,
                       mesh=build_mesh({"data": 2, "model": 4}), param_rules=rules)[0]


def test_tensor_parallel_matmul_reduces_over_its_axis_and_a_replicated_step_has_no_collective():
    tp = tensor_parallel_step([(r"/a$", P(None, "model")), (r"/b$", P("model", None))]).estimate()
    kinds = {kind for kind, _ in tp.collectives()}
    assert kinds & {"all-reduce", "reduce-scatter"}
    assert all(axes == "model" for _, axes in tp.collectives())
    with pytest.warns(UserWarning, match="replicated"):
        replicated = tensor_parallel_step(None)
    assert replicated.estimate().collectives() == {}


def test_estimates_are_deterministic(fsdp, pipeline):
    for fn, _, _ in (fsdp, pipeline):
        a, b = fn.estimate("h100-sxm"), fn.estimate("h100-sxm")
        assert a.memory == b.memory and a.programs == b.programs and a.time == b.time
        assert str(a) == str(b) and repr(a) == repr(b)


def test_time_and_fit_on_a_profile(fsdp):
    fn, _, _ = fsdp
    est = fn.estimate("h100-sxm")
    assert est.time is not None and est.time.total > 0 and 0 < est.time.hfu < 1
    assert est.time.mfu is None  # no model flops given: the compiled flops are HFU, not MFU
    assert est.time.dtype == "float32"
    assert est.fits() and est.fits(est.peak_bytes) and not est.fits(est.peak_bytes - 1)
    assert est.overflow(est.peak_bytes - 1) == {d: 1 for d, m in est.memory.items() if m.peak == est.peak_bytes}
    text = str(est)
    assert "h100-sxm" in text and "peak" in text and "all-gather over fsdp" in text
    with pytest.raises(MemoryLimitError, match="memory_bytes="):
        fn.estimate().fits()
    with pytest.raises(TypeError, match=r"memory_bytes must be a number of bytes per device.*got '80GB'"):
        est.fits("80GB")
    with pytest.raises(ValueError, match=r"memory_bytes must be a positive number of bytes per device, got -1"):
        est.fits(-1)


def test_profiles_and_step_times_have_short_reprs(fsdp, pipeline):
    assert repr(get_profile("h100-sxm")) == ("HardwareProfile('h100-sxm': 989.5 Tflop/s bfloat16, 3350 GB/s memory, "
                                             "74.5 GiB, 450 GB/s links in nodes of 8)")
    spmd, piped = fsdp[0].estimate("h100-sxm").time, pipeline[0].estimate("h100-sxm").time
    assert repr(spmd).startswith(f"StepTime({spmd.total * 1e3:.4g} ms, HFU ") and "1 program)" in repr(spmd)
    assert "pipeline " in repr(piped) and "copies " in repr(piped) and len(repr(piped)) < 150


def test_an_unknown_profile_is_a_clear_error(fsdp):
    fn, _, _ = fsdp
    with pytest.raises(UnknownProfileError, match=r"'h100-pcie'.*a100-40gb, a100-80gb, b200, h100-sxm, h200"):
        fn.estimate("h100-pcie")
    assert get_profile("H200") is PROFILES["h200"]
    with pytest.raises(TypeError, match="profile must be a name or a HardwareProfile"):
        get_profile(80)


def test_collectives_are_read_in_every_group_form():
    hlo = "\n".join([
        "  %ar = f32[16,16]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, "
        "use_global_device_ids=true, to_apply=%add",
        "  %ag = bf16[8,32]{1,0} all-gather(%y), channel_id=2, replica_groups=[2,4]<=[8], dimensions={1}",
        "  %rs = f32[4]{0} reduce-scatter(%z), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}",
        "  %a2a = f32[2,2]{1,0} all-to-all(%w), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}",
        "  %cp-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%v), "
        "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
        "  %cp-done = f32[8]{0} collective-permute-done(%cp-start)",
        "  %all = f32[3]{0} all-reduce(%u), replica_groups={}, to_apply=%add",
        "  %odd = f32[3]{0} all-reduce(%u), replica_groups={{0,3},{1,2},{4,7},{5,6}}, to_apply=%add",
        "  %fusion = f32[16,16]{1,0} fusion(%ar), kind=kLoop",
    ])
    found = find_collectives(hlo, ["data", "model"], [2, 4])  # device id = data * 4 + model
    assert [(c.kind, c.bytes, c.group_size, c.axes) for c in found] == [
        ("all-reduce", 16 * 16 * 4, 2, ("data",)),
        ("all-gather", 8 * 32 * 2, 4, ("model",)),
        ("reduce-scatter", 4 * 4, 2, ("data",)),
        ("all-to-all", 2 * 2 * 4, 4, ("model",)),
        ("collective-permute", 8 * 4, 2, ("model",)),
        ("all-reduce", 3 * 4, 8, ("data", "model")),
        ("all-reduce", 3 * 4, 2, None),
    ]
    assert found[-1].axes_label == "unknown axes"


def test_a_collective_in_a_loop_counts_once_per_iteration():
    hlo = "\n".join([
        "HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}",
        "%add (a: f32[], b: f32[]) -> f32[] {",
        "  ROOT %s = f32[] add(%a, %b)",
        "}",
        "%inner (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add",
        "}",
        "%outer (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %ag = f32[8]{0} all-gather(%y), replica_groups={{0,1}}, dimensions={0}",
        '  %w2 = (s32[], f32[8]) while(%t), condition=%cond, body=%inner, '
        'backend_config={"known_trip_count":{"n":"3"}}',
        "}",
        "%cond (p: (s32[], f32[8])) -> pred[] {",
        "  ROOT %lt = pred[] compare(%i, %n), direction=LT",
        "}",
        "%unknown (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %cp = f32[8]{0} collective-permute(%z), source_target_pairs={{0,1},{1,0}}",
        "}",
        "ENTRY %main (x: f32[8]) -> f32[8] {",
        "  %top = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add",
        '  %w1 = (s32[], f32[8]) while(%t0), condition=%cond, body=%outer, '
        'backend_config={"known_trip_count":{"n":"4"}}',
        "  %w3 = (s32[], f32[8]) while(%t1), condition=%cond, body=%unknown",
        "}",
    ])
    found = {c.name: c.count for c in find_collectives(hlo, ["data"], [2])}
    # the outer loop runs 4 times, the inner 3 times per outer iteration; a loop of unknown length counts once
    assert found == {"ar": 12, "ag": 4, "cp": 1, "top": 1}


def stack_estimates(layers: int) -> dict:
    """The estimates of the gradient of a ``layers``-deep stack, scanned and unrolled, FSDP over 8 devices."""

    def init():
        k = jax.random.split(jax.random.key(0), 2)
        return {"a": jax.random.normal(k[0], (layers, D, H)), "b": jax.random.normal(k[1], (layers, H, D))}

    def scanned(p, b):
        h, _ = jax.lax.scan(lambda x, w: (layer(w, x), None), b["x"], p)
        return jnp.mean(h ** 2)

    def unrolled(p, b):
        h = b["x"]
        for i in range(layers):
            h = layer(jax.tree.map(lambda a, i=i: a[i], p), h)
        return jnp.mean(h ** 2)

    estimates = {}
    for name, loss in (("scanned", scanned), ("unrolled", unrolled)):
        fn, _, _ = parallelize(lambda p, b, loss=loss: jax.grad(loss)(p, b), init_params=init,
                               get_input_batch=make_batch, mesh=build_mesh({"fsdp": 8}), rules=[("batch", "fsdp")],
                               param_rules=[(r"/(a|b)$", P(None, "fsdp"))])
        estimates[name] = fn.estimate("h100-sxm")
    return estimates


def test_a_scanned_stack_moves_the_bytes_of_the_same_stack_unrolled():
    """XLA reduces a scanned stack's gradients once per iteration, the unrolled stack's at once: the bytes
    per step agree only when a loop body's collectives count once per iteration."""
    layers = 4
    estimates = stack_estimates(layers)
    moved = {name: sum(b for _, b in est.collectives().values()) for name, est in estimates.items()}
    assert any(c.count == layers for p in estimates["scanned"].programs for c in p.collectives)
    assert moved["scanned"] == moved["unrolled"] > 0


def test_a_scanned_stacks_bytes_count_every_layer():
    """XLA's cost analysis counts a while loop's body once: a scanned stack's bytes would not grow with its
    depth. Read per kernel, a loop body's kernels count once per iteration, as the unrolled stack's do."""
    (scanned4,), (unrolled4,) = (e.programs for e in stack_estimates(4).values())
    (scanned8,), (unrolled8,) = (e.programs for e in stack_estimates(8).values())
    grows = scanned8.bytes_accessed / scanned4.bytes_accessed
    assert grows == pytest.approx(unrolled8.bytes_accessed / unrolled4.bytes_accessed, rel=0.05)
    assert grows == pytest.approx(2.0, rel=0.05)
    # the scan also slices its layers out and writes its residuals into stacks: more bytes, not fewer
    assert unrolled4.bytes_accessed <= scanned4.bytes_accessed <= 2 * unrolled4.bytes_accessed


def test_collective_time_is_the_ring_model():
    h100 = PROFILES["h100-sxm"]
    one_mib = 1 << 20
    ar = collective_time(Collective("all-reduce", one_mib, 4, ("model",), "ar"), h100)
    assert ar == pytest.approx(6 * h100.intra_node_latency + 1.5 * one_mib / h100.intra_node_bandwidth)
    across = collective_time(Collective("all-gather", one_mib, 16, ("data",), "ag"), h100)
    assert across == pytest.approx(15 * h100.inter_node_latency + 15 / 16 * one_mib / h100.inter_node_bandwidth)
    assert collective_time(Collective("all-reduce", one_mib, 1, (), "none"), h100) == 0.0


@pytest.mark.parametrize("config, overrides", [
    ("fsdp", []),
    # a scanned stack split over two stages: about 30 s here, so with the long checks
    pytest.param("pipeline", ["model.scan_layers=true"], marks=pytest.mark.slow),
], ids=["fsdp", "pipeline-split-stack"])
def test_the_example_transformer_bytes_per_device_equal_the_built_shards(config, overrides):
    from trainers.config import load_config
    from trainers.step import program_for, zeros_batch

    cfg = load_config(str(_CONFIGS / f"{config}.yaml"),
                      ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "data.seq_len=16",
                       "model.max_len=16", *overrides])
    program = program_for(cfg)
    batch = zeros_batch(cfg)
    est = program.step.estimate()
    state = program.init()
    placed = jax.device_put(batch, program.step.batch_shardings)
    assert_held_equals_built(est, {"params": state["params"], "opt_state": state["opt"]}, placed)
    assert est.memory[0].optimizer > est.memory[0].params > 0  # the trainer's {"params", "opt"} told apart


def test_multimesh_estimate_is_the_package_and_the_function(fsdp):
    import multimesh
    import multimesh.estimate as package

    fn, _, _ = fsdp
    assert package.calibrate is calibrate and package.HardwareProfile is HardwareProfile
    assert multimesh.estimate(fn, "h100-sxm").time == fn.estimate("h100-sxm").time
    assert "profile" in inspect.signature(multimesh.estimate).parameters


@pytest.mark.parametrize("field, value", [
    ("intra_node_bandwidth", 0.0), ("memory_bandwidth", -1.0), ("memory_bytes", 0), ("devices_per_node", 0),
    ("inter_node_latency", float("nan")), ("peak_flops", {}), ("peak_flops", {"bfloat16": 0.0}),
    ("launch_overhead", -1e-6), ("memory_bytes", "80GB"),
])
def test_a_profile_with_a_figure_that_cannot_be_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"HardwareProfile 'h100-sxm': {field}=.* must be"):
        dataclasses.replace(get_profile("h100-sxm"), **{field: value})


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="estimate needs a step built by parallelize.*function"):
        estimate(lambda params, batch: 0.0)

    def scaled(params, b, scale):
        return jnp.sum(b["x"] @ params["w"]) * scale

    fn = parallelize(scaled, init_params=lambda: {"w": jnp.ones((D, D))}, get_input_batch=make_batch,
                     mesh=build_mesh({"data": 8}), rules=[("batch", "data")], param_rules=[("w", P("data"))])[0]
    with pytest.raises(TypeError, match=r"step 'scaled' takes more arguments.*args=\(\.\.\.\)"):
        fn.estimate()
    est = fn.estimate(args=(jax.ShapeDtypeStruct((), jnp.float32),))
    assert est.memory[0].params == D * D * 4 // 8
    with pytest.raises(ValueError, match="profile 'a100-80gb' has no peak for dtype 'float8'"):
        fn.estimate("a100-80gb", args=(1.0,), dtype="float8")
    with pytest.raises(ValueError, match=r"optimizer_paths='\(\[' is not a regular expression"):
        fn.estimate(args=(1.0,), optimizer_paths="([")


def test_a_profile_calibrated_here_prices_a_step(fsdp):
    fn, _, _ = fsdp
    here = calibrate(matmul_size=128, copy_bytes=1 << 18, collective_bytes=1 << 18, repeats=3)
    assert here.name == "calibrated-cpu" and here.devices_per_node == jax.device_count()
    for value in (here.peak_flops["float32"], here.memory_bandwidth, here.memory_bytes,
                  here.intra_node_bandwidth, here.intra_node_latency):
        assert np.isfinite(value) and value > 0
    assert isinstance(here, CalibratedProfile) and here.launch_overhead > 0 and here.copy_latency > 0
    # 8 simulated devices share this host's cores: one computing alone is faster than with all 8 busy
    assert 1 < here.alone_speedup <= jax.device_count()
    assert [k for k, _ in here.busy_speedup] == [1, 2, 4, 8] and dict(here.busy_speedup)[8] == 1.0
    # glibc's malloc (this process keeps its defaults) maps the 48 MiB outputs afresh on every call
    assert (here.fresh_memory_rate > 0) is (platform.libc_ver()[0] == "glibc")
    est = fn.estimate(here)
    assert est.profile is here and est.time.total > 0 and est.time.dtype == "float32"
    assert all(t.launch == here.launch_overhead for t in est.time.programs.values())


def test_where_the_allocator_reuses_large_buffers_no_fresh_memory_is_priced(monkeypatch):
    """No page faults counted over the fresh-output passes (another allocator, or one told to keep freed
    memory): the calibrated profile prices no first touch."""
    monkeypatch.setattr(importlib.import_module("multimesh.estimate.calibrate"), "_minor_faults", lambda: 0)
    here = calibrate(matmul_size=64, copy_bytes=1 << 16, collective_bytes=1 << 16, repeats=2)
    assert here.fresh_memory_rate == 0.0


def test_a_temporary_buffer_mapped_afresh_costs_its_first_touch(fsdp):
    """On a host whose allocator maps large temporaries afresh (``fresh_memory_rate`` > 0), one above
    `FRESH_MAPPING_BYTES` costs its bytes at that rate every execution; smaller ones, and other profiles, not."""
    program = fsdp[0].estimate().programs[0]
    rate = 1e8
    host = measured_like("h100-sxm", platform=program.platform, fresh_memory_rate=rate)
    big = dataclasses.replace(program, temp_bytes=FRESH_MAPPING_BYTES + (1 << 20))
    t = program_time(big, host, "float32")
    assert t.fresh_memory == pytest.approx(big.temp_bytes / rate)
    assert t.total == pytest.approx(program_time(big, dataclasses.replace(host, fresh_memory_rate=0.0),
                                                 "float32").total + big.temp_bytes / rate)
    small = dataclasses.replace(program, temp_bytes=FRESH_MAPPING_BYTES)
    assert program_time(small, host, "float32").fresh_memory == 0.0
    # a datasheet profile (0: reused), and a program compiled for another platform than the profile's
    assert program_time(big, PROFILES["h100-sxm"], "float32").fresh_memory == 0.0
    assert program_time(big, dataclasses.replace(host, platform="gpu"), "float32").fresh_memory == 0.0


def measured_like(base: str, **figures) -> CalibratedProfile:
    """A datasheet profile's figures with a calibrated profile's extra ones."""
    fields = {f.name: getattr(PROFILES[base], f.name) for f in dataclasses.fields(PROFILES[base])}
    return CalibratedProfile(**{**fields, **figures})


def busy_by_stage(est) -> dict[frozenset, int]:
    runs: dict[frozenset, int] = {}
    for p in est.programs:
        runs[p.devices] = runs.get(p.devices, 0) + p.executions
    return runs


def test_every_program_execution_pays_the_launch_overhead(fsdp, pipeline):
    launch = 1e-3  # far above the h100's time for these tiny programs: it dominates
    slow = measured_like("h100-sxm", launch_overhead=launch)
    spmd, plain = fsdp[0].estimate(slow), fsdp[0].estimate("h100-sxm")
    assert spmd.time.total == pytest.approx(plain.time.total + launch)
    est = pipeline[0].estimate(slow)
    for name, t in est.time.programs.items():
        assert t.launch == launch and t.total == pytest.approx(t.work + launch)
    # each stage runs its programs one after another, each paying the overhead
    assert est.time.total >= launch * max(busy_by_stage(est).values())
    # a datasheet profile has no such overhead
    assert all(t.launch == 0 for t in pipeline[0].estimate("h100-sxm").time.programs.values())


def host_sum(est, speedup) -> float:
    """Every program execution (at ``speedup(k)`` for its ``k`` devices) and every copy, one after another."""
    t = est.time.programs
    return est.time.transfers + sum(p.executions * (t[p.name].launch + t[p.name].work / speedup(len(p.devices)))
                                    for p in est.programs)


def test_stages_sharing_a_host_are_timed_by_the_hosts_work(pipeline):
    fn = pipeline[0]
    own = fn.estimate(measured_like("h100-sxm", alone_speedup=1.0))
    assert own.time == fn.estimate("h100-sxm").time  # each device its own compute: the plain schedule
    # a slow memory: the programs' work, not the links' latencies, sets the step's time
    slow = {"memory_bandwidth": 1e6, "launch_overhead": 1e-6}
    own = fn.estimate(measured_like("h100-sxm", alone_speedup=1.0, **slow))
    shared = fn.estimate(measured_like("h100-sxm", alone_speedup=8.0, **slow))
    # the host runs one program at a time: the step is every execution and copy in turn, a stage of k of
    # the 8 devices at 8 / k times the all-busy rate (the host's throughput shared)
    assert {len(p.devices) for p in shared.programs} == {4}
    assert shared.time.total == pytest.approx(host_sum(shared, lambda k: 8 / k))
    # no bubble on a shared host: the idle stage's cores run the busy one, so it takes less than on own cores
    assert shared.time.total < own.time.total
    even = fn.estimate(measured_like("h100-sxm", alone_speedup=8.0, busy_speedup=((4, 2.0), (8, 1.0)), **slow))
    assert even.time == shared.time  # 4 devices at twice the all-busy rate: the host's throughput shared
    # measured on matrix products, 4 busy devices of 8 may compute 3x faster than with all 8 busy, more than
    # their share: a whole program does not gain that, so the step is priced at the share (2x)
    more = fn.estimate(measured_like("h100-sxm", alone_speedup=8.0, busy_speedup=((4, 3.0), (8, 1.0)), **slow))
    assert more.time == even.time
    # one measured below the share counts as measured
    less = fn.estimate(measured_like("h100-sxm", alone_speedup=8.0, busy_speedup=((4, 1.5), (8, 1.0)), **slow))
    assert less.time.total == pytest.approx(host_sum(less, lambda k: 1.5))
    assert less.time.total > even.time.total


def test_a_copy_between_stages_costs_the_measured_copy_latency(pipeline):
    fn = pipeline[0]
    plain = fn.estimate("h100-sxm")
    copy = 1e-3  # far above the link's latency (5 us) and these copies' bytes over it
    slow = fn.estimate(measured_like("h100-sxm", copy_latency=copy))
    n = len(slow.transfers)
    assert n > 0
    assert slow.time.transfers == pytest.approx(plain.time.transfers + n * (copy - PROFILES["h100-sxm"].intra_node_latency))
    assert slow.time.total > plain.time.total
    # never below the link's own latency
    assert fn.estimate(measured_like("h100-sxm", copy_latency=1e-9)).time == plain.time


def four_stages():
    """Four stages of 2 devices, each one `layer`: the middle two stages' programs are alike."""
    devices = np.array(jax.devices())
    stages = [task(layer, f"stage{i}", mesh=build_mesh({"data": 2}, devices[2 * i:2 * i + 2])) for i in range(4)]

    def step(state, b):
        value, grads = jax.value_and_grad(microbatch(chain(stages), 0, B // 4, argnum=1, schedule="1f1b"))(
            state["params"], b)
        updates, opt = TX.update(grads, state["opt_state"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}

    fn, _, _ = parallelize(step, init_params=init_state(4), get_input_batch=make_batch, rules=[("batch", "data")])
    return fn


def test_a_stage_like_another_is_compiled_once_and_estimated_the_same(monkeypatch):
    import itertools

    programs_module = importlib.import_module("multimesh.estimate.programs")
    fn = four_stages()
    compiles = []
    compile_ = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: compiles.append(1) or compile_(self, *a, **k))
    shared = fn.estimate("h100-sxm")
    reused = len(compiles)
    # the reference: every program compiled for itself
    unique = itertools.count()
    monkeypatch.setattr(programs_module, "_unnamed", lambda text: f"{text}{next(unique)}")
    alone = fn.estimate("h100-sxm")
    assert len(compiles) - reused == len(alone.programs)
    assert reused < len(shared.programs)  # the two stages' like programs compiled once
    assert shared.programs == alone.programs and shared.time == alone.time and shared.memory == alone.memory


def test_a_step_estimated_again_on_another_profile_compiles_nothing(fsdp, pipeline, monkeypatch):
    compiles, reads = [], []
    compile_ = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: compiles.append(1) or compile_(self, *a, **k))
    programs_module = importlib.import_module("multimesh.estimate.programs")
    parse = programs_module.parse_module
    monkeypatch.setattr(programs_module, "parse_module", lambda text: reads.append(1) or parse(text))
    programs = 0
    for fn in (fsdp[0], pipeline[0]):
        first = fn.estimate("h100-sxm")
        read_first = len(reads)
        again = fn.estimate("a100-80gb")
        assert again.programs == first.programs and again.memory == first.memory
        assert again.time.total != first.time.total  # priced anew on the other profile
        assert len(reads) == read_first  # nor its HLO read again
        programs += len(first.programs)
    # each program compiled and read at most once (earlier tests may have done so already)
    assert len(compiles) <= programs and len(reads) <= programs


def test_a_pipeline_is_timed_through_its_schedule(pipeline):
    fn, _, _ = pipeline
    est = fn.estimate("h100-sxm")
    t = est.time
    busy: dict[frozenset, float] = {}
    for p in est.programs:
        busy[p.devices] = busy.get(p.devices, 0.0) + p.executions * t.programs[p.name].total
    assert t.pipeline > 0 and t.total == pytest.approx(t.pipeline + t.outside)
    assert t.total >= max(busy.values())  # no stage gets through its work faster than doing it
    # its two stages are alike: overlapping them beats running every program and copy one after another
    assert t.total < sum(busy.values()) + t.transfers


def test_programs_compiled_only_to_be_read_skip_code_optimisation_and_read_the_same(fsdp, monkeypatch):
    """Estimates compile XLA:CPU programs without LLVM's optimisation (about half the compile time of a large
    step): the HLO, buffers and so every figure read from them are those of a program compiled as usual."""
    programs_module = importlib.import_module("multimesh.estimate.programs")
    options = []
    compile_ = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, *a, **k: options.append(k.get("compiler_options")) or compile_(self, *a, **k))
    programs_module._COMPILED.clear()
    quick = fsdp[0].estimate("h100-sxm")
    assert options == [programs_module._READ_ONLY_CPU]
    monkeypatch.setattr(programs_module, "_READ_ONLY_CPU", None)
    programs_module._COMPILED.clear()
    usual = fsdp[0].estimate("h100-sxm")
    assert options[-1] is None
    assert usual.programs == quick.programs and usual.memory == quick.memory and usual.time == quick.time
