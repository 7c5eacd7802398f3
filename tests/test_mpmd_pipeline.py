"""Microbatch pipelines over tasks: schedules honoured, activations bounded, results equal one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, check_mpmd_against_reference
from jax.sharding import PartitionSpec as P

from multimesh.schedules import get_schedule
from multimesh.jax import (
    build_mesh,
    clear_tasks,
    ignore_transforms,
    microbatch,
    parallelize,
    register_task,
    registered_tasks,
    task,
    task_scope,
    with_sharding_constraint,
)
from multimesh.jax import flax as mmflax

pytestmark = pytest.mark.devices(8)

B, D, H = 16, 16, 32
TX = optax.adam(1e-2)


def layer(w, x):
    h = with_sharding_constraint(jnp.tanh(x @ w["a"]), P("data", "model"))
    return x + h @ w["b"]


def stage_meshes(sizes, shape_of):
    devs, start, out = np.array(jax.devices()), 0, []
    for n in sizes:
        out.append(build_mesh(shape_of(n), devs[start:start + n]))
        start += n
    return out


def two_by_two(n):
    return {"data": 2, "model": n // 2}


def init_layers(n):
    def init():
        keys = jax.random.split(jax.random.key(0), 2 * n)
        p = {f"s{i}": {"a": jax.random.normal(keys[2 * i], (D, H)) * .2,
                       "b": jax.random.normal(keys[2 * i + 1], (H, D)) * .2} for i in range(n)}
        return {"p": p, "o": TX.init(p)}
    return init


def make_batch():
    return {"x": jax.random.normal(jax.random.key(5), (B, D)), "y": jax.random.normal(jax.random.key(6), (B, D))}


def train_step(loss, mb_size, schedule, *, grad_inside=False, **mb_kwargs):
    def step(state, b):
        if grad_inside:  # microbatch(value_and_grad(loss)): sums (loss, grads)
            value, grads = microbatch(jax.value_and_grad(loss), 0, mb_size, argnum=1, schedule=schedule,
                                      **mb_kwargs)(state["p"], b)
        else:
            value, grads = jax.value_and_grad(microbatch(loss, 0, mb_size, argnum=1, schedule=schedule,
                                                         **mb_kwargs))(state["p"], b)
        updates, opt = TX.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}
    return step


def check_against_reference(step, init, batch=make_batch, steps=3, **options):
    return check_mpmd_against_reference(step, init, batch, steps=steps, grad_rtol=2e-5, **options)


def pipeline_actions(fn):
    return [label.split(":", 1)[1] for label in fn.stats.executed if any(f":{k}[" in label for k in "FBW")]


def chain_loss(stages):
    def loss(p, b):
        h = b["x"]
        for i, s in enumerate(stages):
            h = s(p[f"s{i}"], h)
        return jnp.sum((h - b["y"]) ** 2) / (B * D)  # normalised by the global batch: the sum is the mean
    return loss


# -- schedules over explicit tasks --------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n_mb", [2, 4, 8])
def test_two_stage_pipeline_follows_schedule(schedule, n_mb):
    meshes = stage_meshes([4, 4], two_by_two)
    stages = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    fn, state = check_against_reference(train_step(chain_loss(stages), B // n_mb, schedule), init_layers(2))
    sched = fn.plan.schedule
    assert sched.name == schedule and sched.num_microbatches == n_mb and sched.num_stages == 2
    assert pipeline_actions(fn) == [str(a) for a in sched.order]
    assert fn.stats.peak_live_activations == sched.peak_live_activations
    if schedule == "1f1b":  # stage s never holds more than min(S - s, M) microbatches
        assert fn.stats.peak_live_activations == {0: min(2, n_mb), 1: 1}
    else:
        assert fn.stats.peak_live_activations == {0: n_mb, 1: n_mb}
    for i, m in enumerate(meshes):
        for leaf in jax.tree.leaves(state["p"][f"s{i}"]) + jax.tree.leaves(state["o"][0].mu[f"s{i}"]):
            assert leaf.sharding.device_set == set(m.devices.flat)


_LOWERINGS: list[int] = []  # counts programs lowered for XLA while a test listens


def _on_event_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and _LOWERINGS:
        _LOWERINGS[-1] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


def programs_compiled(fn, *args):
    """The number of programs JAX lowers (then compiles, or loads from the cache) while ``fn(*args)`` runs."""
    _LOWERINGS.append(0)
    try:
        jax.block_until_ready(fn(*args))
    finally:
        count = _LOWERINGS.pop()
    return count


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_stage_programs_compile_once_whatever_the_microbatch_count(schedule):
    compiled, executions = {}, {}
    for n_mb in (2, 4, 8):
        meshes = stage_meshes([4, 4], two_by_two)
        stages = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
        fn, init, get_batch = parallelize(train_step(chain_loss(stages), B // n_mb, schedule),
                                          init_params=init_layers(2), get_input_batch=make_batch)
        state, batch = init(), get_batch()
        compiled[n_mb] = programs_compiled(fn, state, batch)
        executions[n_mb] = fn.stats.executions
        assert len(fn.runtime.programs) == compiled[n_mb]
        # every microbatch's forward (backward) on a stage is one program, called n_mb times
        for stage in ("stage0", "stage1"):
            for kind in ("F", "B"):
                progs = {p.index for p in fn.runtime.programs for k in p.segments
                         if fn.plan.segments[k].label.startswith(f"{stage}:{kind}[")}
                calls = sum(fn.plan.segments[k].label.startswith(f"{stage}:{kind}[")
                            for p in fn.runtime.programs for k in p.segments)
                assert calls == n_mb and len(progs) <= 2, (stage, kind, progs)  # the first backward has no sum
    assert compiled[2] == compiled[4] == compiled[8], compiled
    assert executions[2] < executions[4] < executions[8]


def test_four_stage_1f1b_bounds_live_activations():
    meshes = stage_meshes([2, 2, 2, 2], lambda n: {"data": 1, "model": 2})
    stages = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    fn, _ = check_against_reference(train_step(chain_loss(stages), 4, "1f1b"), init_layers(4))
    assert pipeline_actions(fn) == [str(a) for a in fn.plan.schedule.order]
    assert fn.stats.peak_live_activations == {0: 4, 1: 3, 2: 2, 3: 1}  # min(S - s, M), S = M = 4
    assert "OneFOneB" in str(fn.plan) and "stage 3 |" in str(fn.plan)  # the plan prints its schedule


@pytest.mark.parametrize("schedule", ["zb-h1", "zero-bubble-h2"])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_zero_bubble_splits_the_backward_and_matches_one_device(schedule, n_stages):
    if n_stages == 2:
        meshes = stage_meshes([4, 4], two_by_two)
    else:
        meshes = stage_meshes([2, 2, 2, 2], lambda n: {"data": 1, "model": 2})
    stages = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    fn, _ = check_against_reference(train_step(chain_loss(stages), 4, schedule), init_layers(n_stages))
    sched = fn.plan.schedule
    assert sched.split_backward and sched.num_stages == n_stages and sched.num_microbatches == 4
    executed = pipeline_actions(fn)
    # the schedule's order exactly; stage 0 sends no input gradient, so it runs W alone (no B)
    assert executed == [str(a) for a in sched.order if not (a.kind == "B" and a.stage == 0)]
    assert sum(a.startswith("W[") for a in executed) == n_stages * 4
    assert fn.stats.peak_live_activations == sched.peak_live_activations
    assert sched.bubble_fraction < get_schedule("1f1b", n_stages, 4).bubble_fraction
    # B and W are each one program per stage however many microbatches (the first W adds no sum)
    kinds = {}
    for p in fn.runtime.programs:
        for k in p.segments:
            label = fn.plan.segments[k].label
            if ":B[" in label or ":W[" in label:
                kinds.setdefault(label.split("[")[0] + label.split(":")[1][0], set()).add(p.index)
    assert all(len(progs) <= 2 for progs in kinds.values()), kinds


def test_microbatch_of_value_and_grad_sums_both():
    meshes = stage_meshes([4, 4], two_by_two)
    stages = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    fn, _ = check_against_reference(train_step(chain_loss(stages), 4, "1f1b", grad_inside=True), init_layers(2))
    assert pipeline_actions(fn) == [str(a) for a in fn.plan.schedule.order]


def test_interleaved_schedule_with_two_chunks_per_stage():
    meshes = stage_meshes([4, 4], two_by_two)
    groups = [task(layer, f"group{i}", mesh=m) for i, m in enumerate(meshes)]
    stages = [groups[0], groups[1], groups[0], groups[1]]  # logical stage l runs on group l % 2
    fn, _ = check_against_reference(
        train_step(chain_loss(stages), 4, "interleaved", interleave=2), init_layers(4))
    sched = fn.plan.schedule
    assert sched.num_chunks == 2 and sched.num_stages == 2
    assert pipeline_actions(fn) == [str(a) for a in sched.order]
    assert fn.stats.peak_live_activations == sched.peak_live_activations


# -- heterogeneous stages, glue, dtypes, donation ------------------------------------------


def test_heterogeneous_stages_glue_mixed_dtypes_and_donation():
    small, large = stage_meshes([2, 6], lambda n: {"data": n})

    def first(w, x):  # returns a pytree of mixed dtypes to the next stage
        h = jnp.tanh(x @ w["a"])
        return {"h": h.astype(jnp.bfloat16), "res": x, "count": jnp.sum(h > 0, axis=1).astype(jnp.int32)}

    def second(w, carry):
        h = carry["h"].astype(jnp.float32) @ w["b"]
        return carry["res"] + h * (1.0 + carry["count"][:, None].astype(jnp.float32) / H)

    t1 = task(first, "small", mesh=small)
    t2 = task(second, "large", mesh=large)

    def loss(p, b):
        out = t1(p["s0"], b["x"])
        out = {**out, "res": out["res"] * 0.5 + 1.0}  # glue between tasks, outside any task
        y = t2(p["s1"], out)
        return jnp.sum((y - b["y"]) ** 2) / (B * D)

    def init():
        keys = jax.random.split(jax.random.key(1), 2)
        p = {"s0": {"a": jax.random.normal(keys[0], (D, H)) * .2}, "s1": {"b": jax.random.normal(keys[1], (H, D)) * .2}}
        return {"p": p, "o": TX.init(p)}

    def batch():  # 12 rows: divisible by both stages' data axes after splitting in 2 microbatches of 6
        return {"x": jax.random.normal(jax.random.key(5), (12, D)), "y": jax.random.normal(jax.random.key(6), (12, D))}

    def step(state, b):
        value, grads = jax.value_and_grad(microbatch(loss, 0, 6, argnum=1, schedule="1f1b"))(state["p"], b)
        updates, opt = TX.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    # bfloat16 crossing the stages: compare with a looser tolerance via the reference itself
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=batch, donate=True)
    state, b = init_p(), get_b()
    old = jax.tree.leaves(state)
    ref = jax.jit(lambda *a: _ignoring(step, *a))
    ref_state, ref_b = init(), batch()
    for _ in range(3):
        loss_v, _, state = fn(state, b)
        ref_loss, _, ref_state = ref(ref_state, ref_b)
        np.testing.assert_allclose(loss_v, ref_loss, rtol=1e-5)
    assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6, what="state")
    assert all(x.is_deleted() for x in old), "donate=True: the old state's buffers are reused"
    assert state["p"]["s0"]["a"].sharding.device_set == set(small.devices.flat)
    assert state["p"]["s1"]["b"].sharding.device_set == set(large.devices.flat)
    crossing = {str(aval.dtype) for _, _, _, aval, _ in fn.plan.transfers()}
    assert {"bfloat16", "int32", "float32"} <= crossing


def _ignoring(step, *a):
    with ignore_transforms():
        return step(*a)


# -- Flax: explicit flax.task and implicit register_task -------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(H, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        h = with_sharding_constraint(jnp.tanh(h), P("batch", "mlp"))
        return x + nn.Dense(D, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h)


class Net(nn.Module):
    block: type = Block

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="embed")(x)
        for i in range(4):
            x = self.block(name=f"layers_{i}")(x)
        return nn.Dense(4, name="head")(x)


RULES = [("batch", "data"), ("mlp", "model")]


def flax_problem(model):
    def init():
        p = model.init(jax.random.key(0), jnp.zeros((1, 8)))
        return {"p": p, "o": TX.init(p)}

    def batch():
        return {"x": jax.random.normal(jax.random.key(5), (B, 8)), "y": jax.random.normal(jax.random.key(6), (B, 4))}

    def loss(p, b):
        return jnp.sum((model.apply(p, b["x"]) - b["y"]) ** 2) / (B * 4)

    return init, batch, train_step(loss, 4, "1f1b")


def test_flax_task_pipeline():
    first, second = stage_meshes([4, 4], two_by_two)
    stage0 = mmflax.task(Block, "stage0", mesh=first, logical_axes=RULES)
    stage1 = mmflax.task(Block, "stage1", mesh=second, logical_axes=RULES)

    class Staged(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(D, name="embed")(x)
            for i in range(4):
                x = (stage0 if i < 2 else stage1)(name=f"layers_{i}")(x)
            return nn.Dense(4, name="head")(x)

    init, batch, step = flax_problem(Staged())
    # the same parameters as the unstaged model
    assert jax.tree.structure(jax.eval_shape(init)) == jax.tree.structure(jax.eval_shape(flax_problem(Net())[0]))
    fn, state = check_against_reference(step, init, batch)
    assert pipeline_actions(fn) == [str(a) for a in fn.plan.schedule.order]
    params = nn.unbox(state["p"]["params"])
    assert params["layers_1"]["Dense_0"]["kernel"].sharding.device_set == set(first.devices.flat)
    assert params["layers_2"]["Dense_0"]["kernel"].sharding.device_set == set(second.devices.flat)
    assert params["layers_3"]["Dense_0"]["kernel"].sharding.spec == P(None, "model")


def test_register_task_pipelines_an_unmodified_linen_model():
    calls = []

    def where(match, backprop):
        calls.append((match.group(0), backprop))
        return ((0, 4), "first") if int(match.group(1)) < 2 else ((4, 8), "second")

    init, batch, step = flax_problem(Net())
    with register_task(r"layers_(\d+)", callback=where, dims=(2, 2), device_axes=("data", "model"),
                       logical_axes=RULES):
        fn, state = check_against_reference(step, init, batch)
    assert registered_tasks() == []
    assert {c for c in calls} >= {("layers_0", False), ("layers_3", False), ("layers_0", True), ("layers_3", True)}
    assert [p.name for p in fn.plan.placements[:2]] == ["first", "second"]
    assert pipeline_actions(fn) == [str(a) for a in fn.plan.schedule.order]
    assert fn.stats.peak_live_activations == {0: 2, 1: 1}
    params = nn.unbox(state["p"]["params"])
    devs = jax.devices()
    assert params["layers_0"]["Dense_0"]["kernel"].sharding.device_set == set(devs[:4])
    assert params["layers_3"]["Dense_1"]["kernel"].sharding.device_set == set(devs[4:])
    assert params["layers_3"]["Dense_1"]["kernel"].sharding.spec == P("model", None)
    # glue with no task of its own runs where it is needed: embed on the first stage, head on the last
    assert params["embed"]["kernel"].sharding.device_set == set(devs[:4])
    assert params["head"]["kernel"].sharding.device_set == set(devs[4:])


def test_register_task_by_named_scope_and_registry_scoping():
    def loss(p, b):
        with jax.named_scope("encoder"):
            h = jnp.tanh(b["x"] @ p["s0"]["a"]) @ p["s0"]["b"]
        with jax.named_scope("decoder"):
            h = jnp.tanh(h @ p["s1"]["a"]) @ p["s1"]["b"]
        return jnp.sum((h - b["y"]) ** 2) / (B * D)

    def step(state, b):
        value, grads = jax.value_and_grad(loss)(state["p"], b)
        updates, opt = TX.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    devs = jax.devices()
    with task_scope():
        register_task("encoder", devices=devs[:4])
        register_task("decoder", devices=devs[4:])
        assert len(registered_tasks()) == 2
        fn, state = check_against_reference(step, init_layers(2))
    assert registered_tasks() == []
    assert state["p"]["s0"]["a"].sharding.device_set == set(devs[:4])
    assert state["p"]["s1"]["a"].sharding.device_set == set(devs[4:])
    assert {p.name for p in fn.plan.placements} == {"encoder", "decoder"}
    register_task("decoder", devices=devs[4:])
    clear_tasks()
    assert registered_tasks() == []


# -- errors -----------------------------------------------------------------------------


def _two_stages():
    meshes = stage_meshes([4, 4], two_by_two)
    return [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]


def test_microbatch_size_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"dimension 0 has size 16, which microbatches of size 5 do not divide"):
        parallelize(train_step(chain_loss(_two_stages()), 5, "1f1b"), init_params=init_layers(2),
                    get_input_batch=make_batch)


def test_num_microbatches_is_the_other_way_to_say_it():
    """The third argument is the microbatch size (16 examples in microbatches of 4: four of them);
    ``num_microbatches=`` gives their number instead (two microbatches of 8)."""
    by_size, _ = check_against_reference(train_step(chain_loss(_two_stages()), 4, "1f1b"), init_layers(2))
    by_count, _ = check_against_reference(train_step(chain_loss(_two_stages()), None, "1f1b", num_microbatches=2),
                                          init_layers(2))
    assert by_size.plan.schedule.num_microbatches == 4
    assert by_count.plan.schedule.num_microbatches == 2


def test_microbatch_takes_exactly_one_of_size_and_num_microbatches():
    for kwargs, given in (({}, "neither"), ({"size": 4, "num_microbatches": 4}, "size=4 and num_microbatches=4")):
        with pytest.raises(TypeError, match=rf"microbatch needs exactly one of size \(the third argument: how many "
                                            rf"examples each microbatch holds along dim\) and num_microbatches=.*got "
                                            rf"{given}"):
            microbatch(lambda p, b: 0.0, 0, argnum=1, **kwargs)
    with pytest.raises(ValueError, match=r"num_microbatches must be a positive integer, got 0"):
        microbatch(lambda p, b: 0.0, 0, num_microbatches=0)
    with pytest.raises(ValueError, match=r"dimension 0 has size 16, which num_microbatches=3 does not divide"):
        parallelize(train_step(chain_loss(_two_stages()), None, "1f1b", num_microbatches=3),
                    init_params=init_layers(2), get_input_batch=make_batch)


def test_unknown_schedule():
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'zigzag'; known schedules"):
        microbatch(lambda p, b: 0.0, 0, 4, schedule="zigzag")


def test_schedule_stage_count_mismatch_names_the_tasks():
    with pytest.raises(ValueError, match=r"num_stages=4, but the function's tasks form 2 stages"):
        parallelize(train_step(chain_loss(_two_stages()), 4, "1f1b", num_stages=4), init_params=init_layers(2),
                    get_input_batch=make_batch)


def test_repeated_stages_need_the_interleaved_schedule():
    s = _two_stages()
    with pytest.raises(ValueError, match=r"stage0 -> stage1 -> stage0 -> stage1 visits each of 2 submeshes 2 times; "
                                         r"use schedule='interleaved' with interleave=2"):
        parallelize(train_step(chain_loss([s[0], s[1], s[0], s[1]]), 4, "1f1b"), init_params=init_layers(4),
                    get_input_batch=make_batch)


def test_register_task_bad_callback():
    init, batch, step = flax_problem(Net())
    with register_task(r"layers_(\d+)", callback=lambda m, bp: ((0, 3), "x"), dims=(2, 2)):
        with pytest.raises(ValueError, match=r"dims=\(2, 2\) needs 4 devices, but the callback gave 'layers_0'"):
            parallelize(step, init_params=init, get_input_batch=batch)
    with pytest.raises(ValueError, match="give callback= or mesh=/devices=, not both"):
        register_task("x", callback=lambda m, bp: None, devices=jax.devices()[:2])


def test_ignore_transforms_makes_microbatch_a_plain_call():
    seen = []

    def f(p, b):
        seen.append(b.shape)
        return jnp.sum(b)

    mb = microbatch(f, 0, 2, argnum=1)
    with ignore_transforms():
        assert float(mb(None, jnp.ones((8, 3)))) == 24.0
    assert seen == [(8, 3)]
    assert float(mb(None, jnp.ones((8, 3)))) == 24.0 and seen[1:] == [(2, 3)] * 4  # eagerly: once per microbatch
    # traced: f is traced once, for a microbatch of 2 rows, and that trace serves all 4 microbatches
    assert float(jax.jit(mb)(None, jnp.ones((8, 3)))) == 24.0 and seen[5:] == [(2, 3)]


# -- parallelize_step with explicit and implicit tasks --------------------------------------


class LossNet(nn.Module):
    """``apply(params, batch) -> loss``, the form parallelize_step takes; stages by flax.task or by name."""

    stages: tuple = (None, None)

    @nn.compact
    def __call__(self, batch):
        x = nn.Dense(D, name="embed")(batch["x"])
        for i in range(4):
            x = (self.stages[i // 2] or Block)(name=f"layers_{i}")(x)
        return jnp.mean((nn.Dense(4, name="head")(x) - batch["y"]) ** 2)


def _step_pair(model):
    batch = {"x": np.asarray(jax.random.normal(jax.random.key(5), (B, 8))),
             "y": np.asarray(jax.random.normal(jax.random.key(6), (B, 4)))}
    step, state, _ = mmflax.parallelize_step(model, optax.adam(1e-2), build_mesh({"data": 8}), global_batch=batch)
    with ignore_transforms():
        one_device = build_mesh({"data": 1}, jax.devices()[:1])
        ref_step, ref_state, _ = mmflax.parallelize_step(model, optax.adam(1e-2), one_device, global_batch=batch)
        for _ in range(3):
            ref_loss, ref_state = ref_step(ref_state, batch)
            loss, state = step(state, batch)
            np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(state.params, ref_state.params, rtol=2e-5, atol=1e-6, what="params")
    return step, nn.unbox(state.params)["params"]


def test_parallelize_step_with_flax_tasks():
    first, second = stage_meshes([4, 4], two_by_two)
    stages = (mmflax.task(Block, "first", mesh=first, logical_axes=RULES),
              mmflax.task(Block, "second", mesh=second, logical_axes=RULES))
    step, params = _step_pair(LossNet(stages))
    assert [p.name for p in step.plan.placements] == ["first", "second"]
    assert params["layers_0"]["Dense_0"]["kernel"].sharding.device_set == set(first.devices.flat)
    assert params["layers_3"]["Dense_0"]["kernel"].sharding.device_set == set(second.devices.flat)


def test_parallelize_step_with_registered_tasks():
    devs = jax.devices()
    with register_task(r"layers_[01]", name="first", devices=devs[:4]), \
            register_task(r"layers_[23]", name="second", devices=devs[4:]):
        step, params = _step_pair(LossNet())
    assert [p.name for p in step.plan.placements] == ["first", "second"]
    assert params["layers_1"]["Dense_1"]["kernel"].sharding.device_set == set(devs[:4])
    assert params["layers_2"]["Dense_1"]["kernel"].sharding.device_set == set(devs[4:])


def test_a_value_that_cannot_be_moved_names_the_task(monkeypatch):
    from multimesh.run import runtime

    stages = _two_stages()
    fn, init_p, get_b = parallelize(train_step(chain_loss(stages), 8, "gpipe"), init_params=init_layers(2),
                                    get_input_batch=make_batch)
    state, b = init_p(), get_b()

    def refuse(x, *a, **k):
        raise RuntimeError("device_put across processes is not supported")

    monkeypatch.setattr(runtime, "move", refuse)
    with pytest.raises(runtime.ReshardError,
                       match=r"cannot move float32\[8,16\] from segment \[\d+\] stage0:F\[s0,m0\] .* to task "
                             r"'stage1' .*device_put across processes is not supported"):
        fn(state, b)


# -- submesh helpers, and a batch placed over all devices -------------------------------------


def test_slice_mesh_and_place_mesh():
    from multimesh.jax import place_mesh, slice_mesh

    whole = build_mesh({"stage": 2, "data": 2, "model": 2})
    first, second = slice_mesh(whole, "stage")
    assert dict(first.shape) == dict(second.shape) == {"data": 2, "model": 2}
    assert [d.id for d in first.devices.flat] == [0, 1, 2, 3]
    assert [d.id for d in second.devices.flat] == [4, 5, 6, 7]
    moved = place_mesh(dict(first.shape), jax.devices()[4:])
    assert moved.axis_names == ("data", "model") and moved.devices.shape == (2, 2)
    assert set(moved.devices.flat) == set(second.devices.flat)
    with pytest.raises(ValueError, match="no axis 'pipe'"):
        slice_mesh(whole, "pipe")
    with pytest.raises(ValueError, match=r"3 devices do not fit mesh shape \{.data.: 2, .model.: 2\}, which needs 4"):
        place_mesh((2, 2), jax.devices()[:3], ("data", "model"))


def test_stages_from_slice_mesh_accept_a_batch_sharded_over_all_devices():
    from multimesh.jax import slice_mesh

    meshes = slice_mesh(build_mesh({"stage": 2, "data": 2, "model": 2}), "stage")
    stages = [task(layer, f"stage{i}", mesh=m) for i, m in enumerate(meshes)]
    step = train_step(chain_loss(stages), 4, "1f1b")
    fn, init_p = parallelize(step, init_params=init_layers(2), initial_batch=make_batch())
    everywhere = jax.sharding.NamedSharding(build_mesh({"data": 8}), P("data"))
    b = jax.device_put(make_batch(), everywhere)
    loss, _, state = fn(init_p(), b)
    with ignore_transforms():
        ref_loss, _, _ = jax.jit(step)(init_layers(2)(), make_batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert fn.stats.transfers > 0 and b["x"].sharding == everywhere  # moved, the caller's batch untouched


def test_glue_constraints_resolve_with_the_consuming_tasks_rules():
    first, second = stage_meshes([4, 4], lambda n: {"rows": 2, "cols": 2})
    t1 = task(lambda w, x: jnp.tanh(x @ w), "first", mesh=first, logical_axes=[("batch", "rows")])
    t2 = task(lambda w, x: x @ w, "second", mesh=second, logical_axes=[("batch", "rows"), ("feat", "cols")])

    def fun(p, b):
        g = with_sharding_constraint(t1(p["a"], b["x"]) * 2.0, P("batch", "feat"))  # glue, consumed by t2
        return jnp.sum(t2(p["b"], g)), g

    def init():
        return {"a": jnp.ones((D, H)) * .1, "b": jnp.ones((H, D)) * .1}

    fn, init_p = parallelize(fun, init_params=init, initial_batch=make_batch())
    loss, g = fn(init_p(), make_batch())
    with ignore_transforms():
        ref_loss, ref_g = jax.jit(fun)(init(), make_batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(g, ref_g, rtol=1e-5)
    assert g.sharding.device_set == set(second.devices.flat)
    assert g.sharding.spec == P("rows", "cols")  # the rules of "second", where the glue runs
