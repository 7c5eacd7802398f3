"""`auto_layout` and ``parallelize(layout="auto")``: the search, its rejections and errors, and the trainer's
``layout.mesh: auto`` (``--plan`` prints the search).

A two-layer MLP with Adam, its parameters named by logical axes (``embed``,
``mlp``) so that `standard_rules` shards them; meshes of 4 devices over data and
tensor (3 layouts), so a search compiles at most 3 programs (the MLP names no
``length``: its two ``sequence`` rule layouts are found the same as standard
ones before compiling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from multimesh.autolayout import (
    Candidate,
    LayoutSearch,
    NoLayoutFitsError,
    NoValidLayoutError,
    ParallelLayout,
    enumerate_layouts,
    factorizations,
)
from multimesh.autolayout.building import build_on
from multimesh.core.fmt import format_bytes
from multimesh.estimate import UnknownProfileError, get_profile
from multimesh.jax import auto_layout, build_mesh, microbatch, parallelize, register_task, stage_task, standard_rules

D, H, BATCH = 64, 256, 16
TX = optax.adam(1e-2)
PARAM_RULES = [(r"w1$", ("embed", "mlp")), (r"w2$", ("mlp", "embed"))]
SEARCH = dict(init_params=None, num_devices=4, axes=("data", "tensor"), profile="h100-sxm",
              param_rules=PARAM_RULES, progress=False)
F32 = 4
PARAM_BYTES = 2 * D * H * F32
ADAM_BYTES = 2 * PARAM_BYTES + 4  # mu, nu and the int32 step count
BATCH_ROW_BYTES = 2 * D * F32  # x and y


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (D, H)) * 0.05, "w2": jax.random.normal(k2, (H, D)) * 0.05}
    return {"params": params, "opt_state": TX.init(params)}


def get_batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, D))
    return {"x": x, "y": jnp.sin(x)}


def loss_fn(p, batch):
    with jax.named_scope("layer0"):
        h = jnp.tanh(batch["x"] @ p["w1"])
    with jax.named_scope("layer1"):
        out = h @ p["w2"]
    return jnp.sum((out - batch["y"]) ** 2) / (BATCH * D)  # over the global batch: microbatches sum


def step(state, batch):
    value, grads = jax.value_and_grad(microbatch(loss_fn, 0, BATCH, argnum=1))(state["params"], batch)
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    return value, {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}


@contextlib.contextmanager
def two_layers(stages: int, chunks: int):
    """The pipeline= of the MLP: layer i on stage i * stages // 2."""
    with register_task(r"layer(\d)", callback=lambda m, backprop: stage_task(int(m.group(1)) * stages // 2)):
        yield


def search(**kw):
    return auto_layout(step, **{**SEARCH, "init_params": init, "get_input_batch": get_batch, **kw})


def losses(step_fn, init_fn, batch_fn, steps=3):
    state, batch, out = init_fn(), batch_fn(), []
    for _ in range(steps):
        loss, state = step_fn(state, batch)
        out.append(float(loss))
    return out


def test_factorizations_cover_every_mesh():
    assert sorted(factorizations(8, 2)) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert len(factorizations(8, 3)) == 10 and all(np.prod(f) == 8 for f in factorizations(8, 3))
    layout = ParallelLayout({"data": 2, "tensor": 2}, stages=2, microbatches=4, schedule="1f1b")
    assert layout.describe() == "2 stages of data=2 x tensor=2, 1f1b, 4 microbatches"
    assert layout.whole_mesh == {"pipe": 2, "data": 2, "tensor": 2} and layout.num_devices == 8
    # the sequence rules only where a tensor axis is: without one they are the standard rules
    both = list(enumerate_layouts(4, ("data", "tensor"), (1,), (), (), ("standard", "sequence")))
    assert [layout.describe() for layout in both if layout.rules == "sequence"] == \
        ["tensor=4 (sequence rules)", "data=2 x tensor=2 (sequence rules)"]
    assert len(both) == 5 and ParallelLayout({"tensor": 4}, "sequence").rule_set().rules[-1] == ("length", "tensor")
    with pytest.raises(ValueError, match="rule_sets=.*'megatron'.*'standard', 'sequence'"):
        list(enumerate_layouts(4, ("data",), (1,), (), (), ("megatron",)))


def test_search_ranks_by_time_is_deterministic_and_rejects_what_overflows():
    first = search()
    assert len(first.fitting) == 3 and {c.layout.rules for c in first.fitting} == {"standard"}
    same = [c for c in first.candidates if c.layout.rules == "sequence"]  # the MLP has no sequence to split
    # each set aside uncompiled: where its standard twin is far from the best (PRUNE_RATIO), before building
    assert len(same) == 2 and all(c.estimate is None for c in same)
    assert all((not c.valid and "named 'length'" in c.rejected) or c.rejected.startswith("not compiled: ")
               for c in same)
    assert any("named 'length'" in c.rejected for c in same)
    times = [c.time for c in first.fitting]
    assert times == sorted(times) and first.best == first.candidates[0].layout
    again = search()  # estimates are deterministic: the same peaks and times, in the same order
    assert [(c.layout, c.peak_bytes, c.time) for c in again.candidates] == \
        [(c.layout, c.peak_bytes, c.time) for c in first.candidates]
    assert first.seconds > 0 and "rank" in str(first) and first.best.describe() in str(first)
    assert "share their host's cores" not in str(first)  # a datasheet profile: one device per chip

    # data=4 replicates the parameters and Adam's state: held bytes, exact, from the shapes alone
    held_data4 = PARAM_BYTES + ADAM_BYTES + BATCH // 4 * BATCH_ROW_BYTES
    smallest = min(c.peak_bytes for c in first.fitting)
    assert smallest < held_data4
    limited = search(memory_limit=smallest)
    by_mesh = {tuple(c.layout.mesh.items()): c for c in limited.candidates}
    data4 = by_mesh[(("data", 4),)]
    assert data4.estimate is None  # rejected before compiling: what it holds alone overflows
    assert f"{held_data4:,} B" in data4.rejected and f"{held_data4 - smallest:,} B" in data4.rejected
    for c in limited.candidates:
        if c.estimate is not None and c.peak_bytes > smallest:
            assert c.rejected is not None and f"{c.peak_bytes - smallest:,} B" in c.rejected
    assert limited.best_candidate.peak_bytes == smallest and limited.fitting[0].rejected is None


def test_a_search_on_devices_sharing_a_host_says_which_layouts_are_ties():
    """On a profile whose devices share their host's cores (``alone_speedup`` > 1, as `calibrate` measures
    simulated CPU devices), the table says how many layouts are predicted within 10% of the best."""
    datasheet = get_profile("h100-sxm")
    shared = dataclasses.replace(datasheet, alone_speedup=4.0)
    meshes = [{"data": 4}, {"tensor": 4}, {"data": 2, "tensor": 2}, {"fsdp": 4}]
    times = [1.0, 1.09, 1.11, None]  # the last rejected
    candidates = tuple(Candidate(ParallelLayout(m), time=t, peak_bytes=1, rejected=None if t else "too big")
                       for m, t in zip(meshes, times))

    def table(profile, candidates=candidates):
        return str(LayoutSearch(candidates, profile, 2**30, 4, 0.1))

    assert "time the 2 predicted within 10% of the best" in table(shared)
    assert "share their host's cores" not in table(datasheet)  # a chip of its own per device
    assert "share their host's cores" not in table(shared, candidates[::2])  # nothing near the best


def test_time_top_times_the_best_predicted_and_ranks_them_by_their_measured_step():
    """``time_top=2``: the two layouts predicted fastest are built and timed on these devices, and ranked
    first by their measured step; the others keep their predicted order and no measurement."""
    cpu = dataclasses.replace(get_profile("h100-sxm"), platform="cpu")  # a profile of these devices
    predicted = search(profile=cpu)
    found = search(profile=cpu, time_top=2, time_steps=2)
    timed = [c for c in found.candidates if c.measured is not None]
    assert {c.layout for c in timed} == {c.layout for c in predicted.fitting[:2]}
    assert found.candidates[:2] == tuple(sorted(timed, key=lambda c: c.measured))
    assert all(0 < c.measured < 10 for c in timed) and found.best == timed[0].layout == found.fitting[0].layout
    assert [c.layout for c in found.candidates[2:]] == [c.layout for c in predicted.candidates
                                                         if c.layout not in {t.layout for t in timed}]
    assert [c.time for c in found.fitting] == [next(p.time for p in predicted.fitting if p.layout == c.layout)
                                               for c in found.fitting]  # the predictions are untouched
    header = str(found).splitlines()[1]
    assert header.split() == ["rank", "layout", "peak/device", "predicted", "measured", "MFU", "HFU", "rejected"]
    assert "measured" not in str(predicted)


def test_parallelize_auto_gives_the_losses_of_the_same_layout_by_hand_and_of_one_device():
    step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch, layout="auto",
                                             profile="h100-sxm", num_devices=4, axes=("data", "tensor"),
                                             param_rules=PARAM_RULES, progress=False)
    best = step_fn.layout_search.best
    assert dict(step_fn.placement.mesh.shape) == best.mesh
    auto = losses(step_fn, init_fn, batch_fn)
    mesh = build_mesh(best.mesh, jax.devices()[:4])
    by_hand = losses(*parallelize(step, init_params=init, get_input_batch=get_batch, mesh=mesh,
                                  rules=standard_rules(tuple(best.mesh)), param_rules=PARAM_RULES))
    one = losses(*parallelize(step, init_params=init, get_input_batch=get_batch, devices=jax.devices()[:1],
                              rules=standard_rules(("data",)), param_rules=PARAM_RULES))
    np.testing.assert_allclose(auto, by_hand, rtol=1e-6)
    np.testing.assert_allclose(auto, one, rtol=1e-5)
    assert auto[-1] < auto[0]


def test_pipeline_layouts_run_the_chosen_microbatches():
    found = search(axes=("data",), pipeline=two_layers, stage_counts=(2,), microbatches=(2, 4),
                   schedules=("1f1b",))
    assert {(c.layout.stages, c.layout.microbatches) for c in found.candidates} == {(2, 2), (2, 4)}
    for c in found.candidates:
        assert c.rejected is None and c.estimate.time.pipeline > 0
        forward = [p for p in c.estimate.programs if p.executions == c.layout.microbatches]
        assert forward, f"{c.layout}: no program runs once per microbatch"


@pytest.mark.slow
def test_parallelize_auto_pipeline_matches_one_device():
    step_fn, init_fn, batch_fn = parallelize(
        step, init_params=init, get_input_batch=get_batch, layout="auto", profile="h100-sxm", num_devices=4,
        axes=("data",), pipeline=two_layers, stage_counts=(2,), microbatches=(2, 4), schedules=("1f1b", "gpipe"),
        param_rules=PARAM_RULES, progress=False)
    best = step_fn.layout_search.best
    assert step_fn.plan.schedule.num_microbatches == best.microbatches
    one = losses(*parallelize(step, init_params=init, get_input_batch=get_batch, devices=jax.devices()[:1],
                              rules=standard_rules(("data",)), param_rules=PARAM_RULES))
    np.testing.assert_allclose(losses(step_fn, init_fn, batch_fn), one, rtol=1e-5)


# -- bad inputs: clear errors, before anything is compiled -------------------------------------------------------


def test_unknown_profile_is_named_with_the_known_ones():
    start = time.perf_counter()
    with pytest.raises(UnknownProfileError, match=r"'h100-pcie'.*h100-sxm"):
        search(profile="h100-pcie")
    assert time.perf_counter() - start < 5


def test_a_memory_limit_nothing_fits_names_the_smallest_need():
    start = time.perf_counter()
    with pytest.raises(NoLayoutFitsError) as caught:
        search(memory_limit=1000)
    # tensor=4 holds the least: a quarter of the parameters and Adam's moments, the count, the whole batch
    least = (PARAM_BYTES + ADAM_BYTES - 4) // 4 + 4 + BATCH * BATCH_ROW_BYTES
    message = str(caught.value)
    assert "tensor=4" in message and f"needs more than {format_bytes(least)} ({least:,} B)" in message
    assert f"temporaries (not estimated) come on top. Raise memory_limit= well above {least:,}" in message
    assert all(c.estimate is None for c in caught.value.search.candidates)  # none was compiled
    assert time.perf_counter() - start < 20
    # a limit its held bytes fit: it is compiled, and the advice is its whole peak, which then fits
    with pytest.raises(NoLayoutFitsError) as caught:
        search(memory_limit=least + 1)
    peak = min(c.peak_bytes for c in caught.value.search.candidates if c.estimate is not None)
    assert f"Raise memory_limit= to at least {peak:,}" in str(caught.value)
    assert search(memory_limit=peak).best_candidate.peak_bytes <= peak


def test_a_memory_limit_above_the_devices_memory_is_warned_of():
    with pytest.warns(UserWarning, match=r"memory_limit=1,000,000,000,000 B is above h100-sxm's device memory"):
        search(memory_limit=10**12)


def test_parameters_without_logical_names_are_the_reason_a_tensor_axis_is_idle():
    found = search(param_rules=None)
    reasons = {c.layout.describe(): c.rejected for c in found.candidates}
    assert "no parameter has logical axis names for the rules to map" in reasons["tensor=4"]
    assert "param_rules=" in reasons["tensor=4"] and reasons["data=4"] is None


def test_a_device_count_with_no_valid_mesh_says_why():
    with pytest.raises(NoValidLayoutError) as caught:
        search(num_devices=3)
    message = str(caught.value)
    assert "data=3" in message and "16 rows do not split over data x fsdp = 3" in message
    assert "tensor=3" in message and "shards no parameter or batch array" in message
    assert message.endswith("or other axes=/stage_counts=")
    # a caller that sets the arguments under other names (the trainer's config keys) gets its own words
    worded = caught.value.explain({"axes": "layout.search.axes", "stage_counts": "layout.search.stages"})
    assert worded == message.replace("axes=/stage_counts=", "layout.search.axes=/layout.search.stages=")


def test_a_pipeline_that_builds_no_stages_is_named():
    @contextlib.contextmanager
    def registers_nothing(stages, chunks):
        yield

    with pytest.raises(NoValidLayoutError, match="registered no stage"):
        search(axes=("data",), pipeline=registers_nothing, stage_counts=(2,), microbatches=(2,), schedules=("1f1b",))


@pytest.mark.parametrize("missing", ["microbatches", "schedule"])
def test_a_pipeline_layout_built_without_its_microbatches_or_schedule_names_them(missing):
    layout = dataclasses.replace(ParallelLayout({"data": 2}, stages=2, microbatches=2, schedule="1f1b"),
                                 **{missing: None})
    with pytest.raises(ValueError, match=r"is a pipeline; it needs microbatches= and schedule="):
        build_on(layout, step, jax.devices()[:4], two_layers, init_params=init, get_input_batch=get_batch,
                 param_rules=PARAM_RULES)


@pytest.mark.parametrize("kw, error, words", [
    (dict(axes=("data", "pipe")), ValueError, "'pipe'"),
    (dict(stage_counts=(2,)), ValueError, "pipeline="),
    (dict(num_devices=64), ValueError, "xla_force_host_platform_device_count=64"),
    (dict(mesh={"data": 4}), TypeError, "unexpected keyword argument 'mesh'"),  # the search chooses it
    (dict(memory_limit="80GB"), TypeError, "memory_limit must be a number of bytes per device"),
    (dict(memory_limit=0), ValueError, "memory_limit must be a positive number"),
    (dict(time_top=-1), ValueError, "time_top=-1; give an int >= 0"),
    (dict(time_top=2, time_steps=0), ValueError, "time_steps=0; give an int >= 1"),
    (dict(time_top=2), ValueError, "time_top=2 times layouts on these cpu devices, but the profile 'h100-sxm' is "
                                   "for gpu devices"),
])
def test_bad_search_arguments_are_named(kw, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(".", r"\.")):
        search(**kw)


def test_parallelize_layout_arguments_are_checked():
    with pytest.raises(ValueError, match="layout='manual'"):
        parallelize(step, init_params=init, get_input_batch=get_batch, layout="manual")
    with pytest.raises(TypeError, match="profile= only serve layout='auto'"):
        parallelize(step, init_params=init, get_input_batch=get_batch, profile="h100-sxm")
    with pytest.raises(TypeError, match="time_top= only serve layout='auto'"):
        parallelize(step, init_params=init, get_input_batch=get_batch, time_top=2)
    with pytest.raises(TypeError, match="needs profile="):
        parallelize(step, init_params=init, get_input_batch=get_batch, layout="auto")
    with pytest.raises(TypeError, match="unexpected keyword argument 'profle'"):  # the signature names each one
        parallelize(step, init_params=init, get_input_batch=get_batch, layout="auto", profle="h100-sxm")


def test_the_public_parallelize_warns_at_the_callers_line():
    with pytest.warns(UserWarning, match="no rules=") as caught:
        parallelize(step, init_params=init, get_input_batch=get_batch)
    assert {w.filename for w in caught} == {__file__}


# -- the trainer: layout.mesh: auto ------------------------------------------------------------------------------

AUTO = ["model.num_layers=1", "model.d_model=32", "model.max_len=32", "data.seq_len=32", "data.batch_size=8",
        "data.max_bytes=200000", "layout.mesh=auto", "layout.profile=h100-sxm", "layout.search.axes=[data, tensor]"]


def test_auto_layout_config_is_checked():
    from trainers.config import ConfigError, load_config

    cfg = load_config("tiny", AUTO)
    assert cfg.layout.is_auto and cfg.layout.search.axes == ["data", "tensor"]
    for overrides, words in [(["layout.profile=null"], "layout.profile"),
                             (["layout.pipeline={stages: 2, microbatches: 4}"], "layout.pipeline=null"),
                             (["layout.mesh=automatic"], "auto"),
                             (["layout.profile=h100-pcie"], "h100-sxm"),
                             (["layout.search.schedules=[1f2b]"], "1f2b"),
                             (["layout.search.rules=[megatron]"], "rules=['megatron']: give a list of named rule sets"),
                             (["layout.rules=sequence"], "layout.search.rules"),
                             (["layout.search.time_top=-1"], "time_top=-1: give an int >= 0"),
                             (["layout.search.time_steps=0"], "time_steps=0: give an int >= 1")]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_config("tiny", [*AUTO, *overrides])


def test_plan_prints_the_search_and_the_chosen_layouts_memory(tmp_path, capsys):
    from trainers.cli import main

    # one mesh (data=8): the trainer's step takes seconds to compile here; the library tests search wider
    assert main(["tiny", *AUTO, "layout.search.axes=[data]", f"train.out_dir={tmp_path}", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "auto_layout: 1 layout of 8 devices on h100-sxm" in out and "chosen layout data=8" in out
    assert "memory per device" in out and "predicted step time on h100-sxm" in out


@pytest.mark.slow
def test_plan_of_a_fixed_layout_with_a_profile_prints_its_estimate(tmp_path, capsys):
    from trainers.cli import main

    fixed = [a for a in AUTO if not a.startswith(("layout.mesh", "layout.search"))]
    assert main(["tiny", *fixed, "layout.mesh={data: 2, tensor: 4}", f"train.out_dir={tmp_path}", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "SPMD on 8 devices, mesh data=2xtensor=4" in out and "predicted step time on h100-sxm" in out


def test_plan_shows_the_searchs_progress_unless_quiet(tmp_path, monkeypatch):
    """``--plan`` of ``mesh: auto`` leaves the bar to the search (shown where stderr is a terminal); ``-q``
    turns it off."""
    import trainers.layout_search
    from trainers.cli import main
    from trainers.errors import ConfigError

    asked = []

    def search_layout(cfg, devices=None, progress=None):
        asked.append(progress)
        raise ConfigError("recorded")

    monkeypatch.setattr(trainers.layout_search, "search_layout", search_layout)
    for flags in (["--plan"], ["--plan", "-q"]):
        assert main(["tiny", *AUTO, f"train.out_dir={tmp_path}", *flags]) != 0
    assert asked == [None, False]


def test_plan_when_nothing_fits_names_the_memory_limit(tmp_path, capsys):
    from trainers.cli import main

    start = time.perf_counter()
    assert main(["tiny", *AUTO, "layout.memory_limit=1000", f"train.out_dir={tmp_path}", "--plan"]) == 2
    captured = capsys.readouterr()
    assert "layout.memory_limit: 1000" in captured.err and "Raise layout.memory_limit= well above" in captured.err
    assert "SearchConfig" not in captured.err and "layout.search: {axes: [data, tensor], stages: [1]" in captured.err
    assert "auto_layout: 7 layouts" in captured.out  # the table, every layout rejected (4 meshes; 3 with a
    # tensor axis, also with the sequence rules)
    assert time.perf_counter() - start < 30


def test_trainer_search_keeps_the_sequence_layouts_of_a_model_with_a_sequence():
    """The transformer names ``length`` on its activations: its sequence layouts are real candidates (held
    bytes checked, not set aside as the standard ones), and the chosen config carries the rule set."""
    from trainers.config import ConfigError, load_config
    from trainers.layout_search import chosen_config, search_layout

    cfg = load_config("tiny", [*AUTO, "layout.memory_limit=1000"])  # nothing fits: nothing is compiled
    with pytest.raises(ConfigError) as caught:
        search_layout(cfg, progress=False)
    sequence = [c for c in caught.value.search.candidates if c.layout.rules == "sequence"]
    assert len(sequence) == 3 and all(c.valid and "over the limit" in c.rejected for c in sequence)
    chosen = chosen_config(load_config("tiny", AUTO), sequence[0].layout).layout
    assert chosen.rules == "sequence" and chosen.mesh == sequence[0].layout.mesh


def test_trainer_search_times_its_best_predicted_layouts_on_the_profiles_devices(monkeypatch):
    """``layout.search.time_top``: refused, naming the key, where the devices are not the profile's (here CPU
    devices, an H100 profile); on a profile of these devices the search times that many layouts."""
    from multimesh.estimate import PROFILES
    from trainers.config import ConfigError, load_config
    from trainers.layout_search import search_layout

    one_mesh = [*AUTO, "layout.search.axes=[data]", "layout.search.time_top=1", "layout.search.time_steps=1"]
    with pytest.raises(ConfigError, match=r"layout\.search\.time_top=1: .*profile 'h100-sxm' is for gpu devices"):
        search_layout(load_config("tiny", one_mesh), progress=False)
    monkeypatch.setitem(PROFILES, "h100-sxm", dataclasses.replace(PROFILES["h100-sxm"], platform="cpu"))
    found = search_layout(load_config("tiny", one_mesh), progress=False)
    assert [c.measured > 0 for c in found.candidates] == [True] and "measured" in str(found)


@pytest.mark.slow
def test_trainer_auto_layout_trains_as_the_chosen_layout_by_hand(tmp_path):
    from trainers.config import load_config
    from trainers.layout_search import chosen_config, search_layout
    from trainers.train import train

    over = [*AUTO, "train.steps=3", "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1"]
    auto_cfg = load_config("tiny", [*over, f"train.out_dir={tmp_path / 'auto'}"])
    by_hand = chosen_config(load_config("tiny", [*over, f"train.out_dir={tmp_path / 'hand'}"]),
                            search_layout(auto_cfg, progress=False).best)
    a = train(auto_cfg, quiet=True)
    b = train(by_hand, quiet=True)
    assert a.config.layout.mesh == by_hand.layout.mesh
    np.testing.assert_allclose([a.losses[s] for s in (1, 2, 3)], [b.losses[s] for s in (1, 2, 3)], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("scanned", [False, True], ids=["blocks", "scanned-stack"])
def test_trainer_search_builds_its_pipelines(scanned):
    from trainers.config import load_config
    from trainers.layout_search import chosen_config, search_layout

    cfg = load_config("tiny", [*AUTO, "model.num_layers=2", f"model.scan_layers={str(scanned).lower()}",
                               "layout.search.axes=[data]", "layout.search.stages=[2]",
                               "layout.search.microbatches=[2]", "layout.search.schedules=[1f1b]"])
    found = search_layout(cfg, progress=False)
    (only,) = found.candidates
    assert only.rejected is None and only.layout.describe() == "2 stages of data=4, 1f1b, 2 microbatches"
    chosen = chosen_config(cfg, found.best).layout
    assert chosen.mesh == {"data": 4} and (chosen.pipeline.stages, chosen.pipeline.microbatches) == (2, 2)


def test_a_layout_that_cannot_be_estimated_is_reported_and_the_others_ranked(monkeypatch):
    """An estimate that fails on one layout (say a program XLA cannot compile for it) rejects that layout,
    with the error, and the search ranks the rest."""
    from multimesh.run.spmd import Parallelized

    real = Parallelized.estimate

    def estimate(self, *args, **kwargs):
        if "tensor" in self.placement.mesh.axis_names:
            raise ValueError("no program for this mesh")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Parallelized, "estimate", estimate)
    found = search(rule_sets=("standard",))
    refused = {c.layout.describe(): c.rejected for c in found.candidates if c.rejected}
    assert refused == {d: "invalid: cannot be estimated: ValueError: no program for this mesh"
                       for d in ("data=2 x tensor=2", "tensor=4")}
    assert [c.layout.describe() for c in found.fitting] == ["data=4"]


def test_other_rules_are_compiled_only_for_meshes_whose_standard_rules_come_near_the_best(monkeypatch):
    """A mesh's ``sequence`` rules save memory, not time: where its standard rules are predicted at least
    PRUNE_RATIO times the best (fitting or not), they are set aside uncompiled; near the best, estimated."""
    import multimesh.autolayout.search as search_module

    full = search(rule_sets=("standard", "sequence"), axes=("data", "tensor"))
    best = full.fitting[0].time
    standard = {c.layout.describe(): c for c in full.candidates if c.layout.rules == "standard"}
    for c in full.candidates:
        if c.layout.rules != "sequence":
            continue
        twin = standard[dataclasses.replace(c.layout, rules="standard").describe()]
        if twin.time is not None and twin.time >= search_module.PRUNE_RATIO * best:
            assert c.estimate is None and c.rejected.startswith("not compiled: its standard-rules twin")
        else:
            assert c.rejected is None or c.rejected.startswith("invalid") or c.estimate is not None
    # a ratio every twin meets: no sequence layout compiled; one none meets: every one compiled
    monkeypatch.setattr(search_module, "PRUNE_RATIO", 1.0)
    pruned = search(rule_sets=("standard", "sequence"), axes=("data", "tensor"))
    fitting_twins = {d for d, c in standard.items() if c.rejected is None}
    assert all(c.estimate is None for c in pruned.candidates
               if c.layout.rules == "sequence" and dataclasses.replace(c.layout, rules="standard").describe()
               in fitting_twins)
    monkeypatch.setattr(search_module, "PRUNE_RATIO", float("inf"))
    kept = search(rule_sets=("standard", "sequence"), axes=("data", "tensor"))
    assert not any((c.rejected or "").startswith("not compiled") for c in kept.candidates)
