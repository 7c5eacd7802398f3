"""MultiMesh compatibility: every annotation name is logical.

`nn.with_partitioning(init, ("data", "model"))` names logical axes when the
mesh in force has no such axes: the rules in force (a task's ``logical_axes``)
resolve them. A name that is neither a mesh axis nor covered by a rule is
still an error.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import check_mpmd_against_reference
from jax.sharding import PartitionSpec as P

from multimesh.jax import RuleError, clear_tasks, parallelize, register_task

pytestmark = pytest.mark.devices(8)

RULES = (("data", "x"), ("model", "y"))


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


class Block(nn.Module):
    names: tuple = ("data", "model")

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_partitioning(nn.initializers.lecun_normal(), self.names), (16, 16))
        return x + jnp.tanh(x @ w)


class Net(nn.Module):
    names: tuple = ("data", "model")

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = Block(self.names, name=f"layers_{i}")(x)
        return x


def problem(model):
    tx = optax.sgd(0.1)

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((8, 16)))
        return {"p": params, "o": tx.init(params)}

    def batch():
        return {"x": jax.random.normal(jax.random.key(1), (8, 16)), "y": jax.random.normal(jax.random.key(2), (8, 16))}

    def step(state, b):
        def loss(p):
            return jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state["p"])
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return init, batch, step


def test_with_partitioning_names_resolve_through_the_task_rules():
    devs = jax.devices()
    init, batch, step = problem(Net())
    register_task(r"layers_0", devices=[0, 1, 2, 3], dims=[2, 2], device_axes=("x", "y"), logical_axes=RULES)
    register_task(r"layers_1", devices=devs[4:], dims=(2, 2), device_axes=("x", "y"), logical_axes=RULES)
    _fn, state = check_mpmd_against_reference(step, init, batch)
    w0 = state["p"]["params"]["layers_0"]["w"].value
    w1 = state["p"]["params"]["layers_1"]["w"].value
    assert w0.sharding.spec == P("x", "y") and w0.sharding.device_set == set(devs[:4])
    assert w1.sharding.spec == P("x", "y") and w1.sharding.device_set == set(devs[4:])
    assert w0.addressable_shards[0].data.shape == (8, 8)


def test_mesh_axis_names_still_work_and_mix_with_logical_ones():
    devs = jax.devices()
    init, batch, step = problem(Net(names=("x", "model")))
    register_task(r"layers_(\d+)", callback=lambda name, bp: ((0, 4), "a") if name.endswith("0") else ((4, 8), "b"),
                  dims=(2, 2), device_axes=("x", "y"), logical_axes=RULES)
    _fn, state = check_mpmd_against_reference(step, init, batch, steps=1)
    w1 = state["p"]["params"]["layers_1"]["w"].value
    assert w1.sharding.spec == P("x", "y") and w1.sharding.device_set == set(devs[4:])


def test_a_name_no_rule_covers_is_still_an_error():
    init, batch, step = problem(Net(names=("data", "hidden")))
    register_task(r"layers_(\d+)", devices=jax.devices()[:4], dims=(2, 2), device_axes=("x", "y"), logical_axes=RULES)
    with pytest.raises(RuleError, match=r"names mesh axis 'hidden', but the mesh has axes \{'x': 2, 'y': 2\} and "
                                        r"no rule maps 'hidden'"):
        parallelize(step, init_params=init, get_input_batch=batch)
