"""A step whose code names mesh axes in a bare `PartitionSpec` (``jax.lax.with_sharding_constraint(y,
P("data", "model"))``), as code written for ``jax.jit`` under ``jax.set_mesh`` does: `parallelize` and `mjit`
trace it with its mesh (a task's submesh, inside the task) in JAX's context, and it means what it means on one
device. Flax's NNX guide "Scale up on multiple devices" (``test_thirdparty_nnx_guides.py``) is the model this
is for; here the mechanism, on SPMD and MPMD steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, train_steps, two_matrices, xy_batch
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from multimesh.jax import build_mesh, mjit, parallelize, task
from multimesh.trace.step_context import needs_mesh_in_context
from multimesh.trace.task import ignore_transforms

pytestmark = pytest.mark.devices(8)

B, D = 16, 8
TX = optax.adam(1e-2)
RULES = [("batch", "data")]


def init():
    return two_matrices(TX, D)


def get_batch():
    return xy_batch(B, D)


def layer(w, x):
    """A layer that puts its activations where the mesh in context says, by the names of its axes."""
    return jax.lax.with_sharding_constraint(jnp.tanh(x @ w), P("data", "model"))


def make_step(forward):
    def step(state, batch):
        def loss(p):
            h = forward(p, batch["x"])
            return jnp.mean((h - batch["y"]) ** 2), h

        (value, h), grads = jax.value_and_grad(loss, has_aux=True)(state["params"])
        updates, opt = TX.update(grads, state["opt"])
        return (value, h), {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return step


def whole(p, x):
    return layer(p["b"], layer(p["a"], x))


def one_device(step, steps=3):
    """The reference: the step under `jax.jit` with a 1 x 1 mesh of the same axis names in context."""
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1], axis_types=(AxisType.Auto,) * 2)
    state, batch, losses = init(), get_batch(), []
    with jax.set_mesh(mesh):
        stepped = jax.jit(step)
        for _ in range(steps):
            (loss, _), state = stepped(state, batch)
            losses.append(float(loss))
    return losses, state


def losses_only(step_fn):
    def run(state, batch):
        (loss, h), state = step_fn(state, batch)
        run.h = h
        return loss, state
    return run


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_trees_close(got[1], want[1], rtol=1e-4, atol=1e-6)


def test_jax_refuses_a_bare_spec_with_no_mesh_in_context():
    """What such code meets under plain `jax.jit`, and the errors `needs_mesh_in_context` recognizes."""
    with pytest.raises(RuntimeError) as constraint:
        jax.jit(lambda x: jax.lax.with_sharding_constraint(x, P("data")))(jnp.ones(8))
    with pytest.raises(ValueError) as reshard:
        jax.jit(lambda x: jax.sharding.reshard(x, P("data")))(jnp.ones(8))
    assert needs_mesh_in_context(constraint.value) and needs_mesh_in_context(reshard.value)
    assert not needs_mesh_in_context(ValueError("shapes differ")) and not needs_mesh_in_context(NameError("x"))


def test_an_spmd_step_with_a_bare_spec_equals_one_device():
    step = make_step(whole)
    reference = one_device(step)
    assert reference[0][-1] < reference[0][0]
    mesh = build_mesh({"data": 2, "model": 4})
    built = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=mesh, rules=RULES)
    assert repr(built[0]).endswith("params, its mesh in context)")
    run = losses_only(built[0])
    assert_same(train_steps(run, built[1], built[2], 3), reference)
    assert run.h.sharding.spec == P("data", "model")  # the step's own constraint, on the step's mesh


def test_a_step_without_one_runs_as_written():
    built = parallelize(make_step(lambda p, x: jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"])), init_params=init,
                        get_input_batch=get_batch, mesh={"data": 2, "model": 4}, rules=RULES)
    assert not hasattr(built[0].fun, "mesh_in_context") and repr(built[0]).endswith("params)")


def test_mjit_takes_the_step_too():
    step = make_step(whole)
    fn = mjit(step, mesh=build_mesh({"data": 2, "model": 4}), in_shardings=(P(), P("batch")), rules=RULES)
    state, batch, losses = init(), get_batch(), []
    for _ in range(3):
        (loss, h), state = fn(state, batch)
        losses.append(float(loss))
    assert_same((losses, state), one_device(step))
    assert h.sharding.spec == P("data", "model")


def test_each_task_sees_its_own_submesh():
    """Two stages of 2 x 2 devices: the constraint inside each task names its submesh's axes, and one
    between them (in no task) is placed on whichever stage the plan runs it."""
    devices = np.array(jax.devices())
    stages = [task(layer, f"stage{i}", mesh=build_mesh({"data": 2, "model": 2}, devices[4 * i:4 * i + 4]))
              for i in range(2)]

    def forward(p, x):
        h = jax.lax.with_sharding_constraint(stages[0](p["a"], x), P("data", None))
        return stages[1](p["b"], h)

    step = make_step(forward)
    built = parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 4, "model": 2},
                        rules=RULES)
    assert len(built[0].plan.placements) == 2 and repr(built[0]).endswith(", its mesh in context)")
    with ignore_transforms():
        reference = one_device(step)
    run = losses_only(built[0])
    assert_same(train_steps(run, built[1], built[2], 3), reference)
    assert {d.id for d in run.h.sharding.device_set} == {4, 5, 6, 7}
    assert run.h.sharding.shard_shape(run.h.shape) == (B // 2, D // 2)  # over the stage's data and model
