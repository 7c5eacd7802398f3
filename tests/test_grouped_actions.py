"""A stage's consecutive actions of one program run as one host call: same results, fewer calls, same memory."""

import jax
import numpy as np
import pytest
from test_mpmd_pipeline import (
    B,
    chain_loss,
    check_against_reference,
    init_layers,
    layer,
    make_batch,
    pipeline_actions,
    stage_meshes,
    train_step,
    two_by_two,
)
from test_multiprocess import check_runs, run_processes

from multimesh.jax import parallelize, task
from multimesh.run.grouping import GROUP_ACTIONS_VARIABLE, SUGGESTED_GROUP_SIZE, default_group_size

pytestmark = pytest.mark.devices(8)

N_MB = 8


def _step(schedule, n_stages=2):
    if n_stages == 2:
        groups = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(stage_meshes([4, 4], two_by_two))]
    else:
        meshes = stage_meshes([2] * n_stages, lambda n: {"data": 1, "model": 2})
        groups = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    kwargs = {}
    stages = groups
    if schedule == "interleaved":  # logical stage l runs on group l % 2
        stages, kwargs = [groups[0], groups[1], groups[0], groups[1]], {"interleave": 2}
    return train_step(chain_loss(stages), B // N_MB, schedule, **kwargs), init_layers(len(stages))


def _run(monkeypatch, schedule, group, steps=3, n_stages=2):
    """``steps`` steps with at most ``group`` actions per host call: the built step and each step's outputs."""
    monkeypatch.setenv(GROUP_ACTIONS_VARIABLE, str(group))
    step, init = _step(schedule, n_stages)
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=make_batch)
    state, batch, outs = init_p(), get_b(), []
    for _ in range(steps):
        loss, grads, state = fn(state, batch)
        outs.append((loss, grads, state))
    return fn, outs


def _per_stage(labels, sched):
    """The executed actions per device group, and the schedule's."""
    executed: dict[str, list[str]] = {}
    for label in labels:
        executed.setdefault(label.split(":")[0], []).append(label.split(":", 1)[1])
    names = sorted(executed)
    planned = {names[g]: [str(a) for a in acts] for g, acts in sched.per_stage_order.items()}
    return {k: [a for a in v if a[0] in "FBW"] for k, v in executed.items()}, planned


# (schedule, stages, the host calls a step makes grouped, ungrouped: one per segment). 8 microbatches:
# - GPipe, 2 stages: 32 actions and one glue segment per stage; per stage, F0..F7 in one call, B0 alone (the
#   first backward starts the gradient sum: another program), B1..B7 in one call: 2 x (3 + 1) calls;
# - 1F1B, 4 stages: stage s's S - s warm-up forwards in one call (3 + 2 + 1 calls fewer); its cool-down
#   backwards each wait for the next stage's, which runs between them;
# - interleaved, 2 stages of 2 chunks: the warm-up forwards of each chunk on each stage by twos (3 fewer), the
#   last two backwards of chunk 0 on each stage (2 fewer).
CASES = [("gpipe", 2, 8, 34), ("1f1b", 4, 62, 68), ("interleaved", 2, 61, 66)]


@pytest.mark.parametrize("schedule,n_stages,grouped_calls,calls", CASES)
def test_grouped_actions_are_bit_equal_fewer_calls_same_memory(monkeypatch, schedule, n_stages, grouped_calls,
                                                               calls):
    alone, want = _run(monkeypatch, schedule, 1, n_stages=n_stages)
    grouped, got = _run(monkeypatch, schedule, SUGGESTED_GROUP_SIZE, n_stages=n_stages)
    for step, (g, w) in enumerate(zip(got, want)):  # outputs, gradients, optimizer states: the very same bits
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {step}")
    assert alone.stats.dispatches == alone.stats.executions == calls
    assert grouped.stats.executions == calls and grouped.stats.dispatches == grouped_calls
    assert len(grouped.runtime.calls) == grouped_calls
    sched = grouped.plan.schedule
    # each stage runs its actions in the schedule's order and holds as many activations at once
    executed, planned = _per_stage(grouped.stats.executed, sched)
    assert executed == planned
    assert pipeline_actions(alone) == [str(a) for a in sched.order]
    assert grouped.stats.peak_live_activations == alone.stats.peak_live_activations == sched.peak_live_activations


def test_gpipe_groups_a_stages_forwards_and_backwards_up_to_the_bound(monkeypatch):
    fn, _ = _run(monkeypatch, "gpipe", 3, steps=1)
    sizes = [len(c.steps) for c in fn.runtime.calls]
    assert max(sizes) == 3
    forwards = [[s.label for s in c.steps] for c in fn.runtime.calls if ":F[" in c.steps[0].label]
    assert forwards[0] == [f"stage0:F[s0,m{m}]" for m in range(3)]
    # a backward passes its gradient sum to the next one inside the call: only the last one's comes back
    backward = next(c for c in fn.runtime.calls if len(c.steps) > 1 and ":B[" in c.steps[0].label)
    assert len(backward.outs) < sum(len(s.outs) for s in backward.steps)


def test_grouped_gpipe_matches_one_device(monkeypatch):
    monkeypatch.setenv(GROUP_ACTIONS_VARIABLE, str(SUGGESTED_GROUP_SIZE))
    step, init = _step("gpipe")
    fn, _ = check_against_reference(step, init)
    assert fn.stats.dispatches < fn.stats.executions


def test_grouping_is_off_unless_asked_and_a_bad_bound_is_named(monkeypatch):
    monkeypatch.delenv(GROUP_ACTIONS_VARIABLE, raising=False)
    assert default_group_size() == 1
    step, init = _step("gpipe")
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=make_batch)
    fn(init_p(), get_b())
    assert fn.runtime.group_actions == 1 and fn.stats.dispatches == fn.stats.executions
    assert pipeline_actions(fn) == [str(a) for a in fn.plan.schedule.order]
    monkeypatch.setenv(GROUP_ACTIONS_VARIABLE, "4")
    assert default_group_size() == 4
    for bad in ("0", "four"):
        monkeypatch.setenv(GROUP_ACTIONS_VARIABLE, bad)
        with pytest.raises(ValueError, match=rf"{GROUP_ACTIONS_VARIABLE}='{bad}'.*positive int.*1 runs each"):
            default_group_size()


@pytest.mark.slow  # a minute or more: two processes, each schedule compiled
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_grouped_actions_across_processes(monkeypatch, schedule):
    """One stage per process: every process makes the same grouped calls (a group on the other process's
    stage returns placeholders here); each checks its losses and shards against one device, its stages'
    orders and its live activations (tests/mp_worker.py)."""
    monkeypatch.setenv(GROUP_ACTIONS_VARIABLE, str(SUGGESTED_GROUP_SIZE))
    reports = run_processes("one_stage_per_process", 2, 1, schedule=schedule)
    runs = [r["runs"][0] for r in reports]
    check_runs(runs, 4 if schedule == "interleaved" else 2)
    assert all(r["dispatches"] < r["executions"] for r in runs), [(r["dispatches"], r["executions"]) for r in runs]


@pytest.mark.slow  # two trainer builds: about two minutes
def test_grouped_trainer_step_with_donated_state_is_bit_equal(monkeypatch):
    """The trainer's pipeline (embedding, blocks, tied head, AdamW, donated state) by GPipe: grouped calls
    give the same metrics and state as one call per action."""
    from trainers.config import load_config
    from trainers.layout import build_layout
    from trainers.step import build_program

    results, stats = {}, {}
    for group in (1, SUGGESTED_GROUP_SIZE):
        monkeypatch.setenv(GROUP_ACTIONS_VARIABLE, str(group))
        cfg = load_config("pipeline", ["data.batch_size=16", "data.seq_len=8", "layout.pipeline.microbatches=8",
                                       "layout.pipeline.schedule=gpipe"])
        tokens = np.random.default_rng(0).integers(0, 256, (16, cfg.data.seq_len + 1), dtype=np.int32)
        layout = build_layout(cfg.layout)
        with layout.tasks(cfg.model.num_layers):
            program = build_program(cfg, layout, {"tokens": tokens}, {"tokens": tokens[:8]})
            state, outs = program.init(), []
            for _ in range(3):
                metrics, state = program.step(state, {"tokens": tokens})
                outs.append(jax.tree.map(np.asarray, metrics))
        results[group] = outs + [jax.tree.map(np.asarray, state)]
        stats[group] = program.step.stats
    for a, b in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[SUGGESTED_GROUP_SIZE]), strict=True):
        np.testing.assert_array_equal(a, b)
    alone, grouped = stats[1], stats[SUGGESTED_GROUP_SIZE]
    assert alone.dispatches == alone.executions == grouped.executions > grouped.dispatches
    assert grouped.peak_live_activations == alone.peak_live_activations == {0: 8, 1: 8}
