"""`Task(split_backprop=...)` with the ``"zero-bubble-h2"`` schedule.

Two stages on slices of a `MultiMesh` (reference style), each task naming the
halves of its backward pass; the zero-bubble schedule runs them apart. The
step equals one device; the halves carry the names; a schedule that does not
split warns.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import check_mpmd_against_reference
from jax.sharding import PartitionSpec as P

from multimesh.jax import MultiMesh, Task, microbatch, task, with_sharding_constraint

pytestmark = pytest.mark.devices(8)

B, D, H = 16, 16, 32
TX = optax.adam(1e-2)


def layer(w, x):
    h = with_sharding_constraint(jnp.tanh(x @ w["a"]), P("batch", "hidden"))
    return x + h @ w["b"]


def init():
    keys = jax.random.split(jax.random.key(0), 4)
    p = {f"s{i}": {"a": jax.random.normal(keys[2 * i], (D, H)) * .2,
                   "b": jax.random.normal(keys[2 * i + 1], (H, D)) * .2} for i in range(2)}
    return {"p": p, "o": TX.init(p)}


def batch():
    return {"x": jax.random.normal(jax.random.key(5), (B, D)), "y": jax.random.normal(jax.random.key(6), (B, D))}


def step_for(schedule):
    stages = [task(layer, task=Task(name=f"stage{i}", mesh_slice={"stage": i}, split_backprop=("act", "wgrad"),
                                    logical_axes=[("batch", "data"), ("hidden", "model")])) for i in range(2)]

    def loss(p, b):
        h = b["x"]
        for i, s in enumerate(stages):
            h = s(p[f"s{i}"], h)
        return jnp.sum((h - b["y"]) ** 2) / (B * D)

    def step(state, b):
        value, grads = jax.value_and_grad(microbatch(loss, 0, 4, argnum=1, schedule=schedule))(state["p"], b)
        updates, opt = TX.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return step


def test_split_backprop_names_the_halves_of_a_zero_bubble_h2_pipeline():
    mm = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    with mm:
        fn, state = check_mpmd_against_reference(step_for("zero-bubble-h2"), init, batch, grad_rtol=2e-5)
    sched = fn.plan.schedule
    assert sched.split_backward and sched.num_stages == 2 and sched.num_microbatches == 4
    executed = [label for label in fn.stats.executed if ":" in label and label.split(":")[1][:2] in ("F[", "B[", "W[")]
    assert sum(label.startswith("stage1/act:B[") for label in executed) == 4
    assert sum(label.startswith("stage0/wgrad:W[") for label in executed) == 4
    assert sum(label.startswith("stage1/wgrad:W[") for label in executed) == 4
    assert all(label.startswith(("stage0:F[", "stage1:F[")) for label in executed if ":F[" in label)
    assert state["p"]["s1"]["a"].sharding.device_set == set(mm.slice(stage=1).devices.flat)


def test_split_backprop_without_a_splitting_schedule_warns():
    mm = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    with mm, pytest.warns(UserWarning, match=r"tasks \['stage0', 'stage1'\] ask for split_backprop, but the "
                                             r"schedule .* does not split backward passes; use .*zero-bubble-h2"):
        check_mpmd_against_reference(step_for("1f1b"), init, batch, steps=1, grad_rtol=2e-5)
