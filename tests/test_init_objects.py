"""Initializers that build objects inside.

Ordinary training code builds its whole train state in ``init_params``: a
Flax ``TrainState`` holding ``apply_fn`` and an optimizer (here
``optax.MultiSteps(optax.adam(...), 2)``), objects that are made anew, and
compare unequal, every time the initializer runs. Each parallel result is
compared with the same program on one device.
"""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from helpers import ATOL, RTOL, logical
from jax.sharding import PartitionSpec as P

from multimesh.jax import StepInputError, ignore_transforms, parallelize, register_task

STEPS = 3
RULES = [("batch", "data"), ("mlp", "model")]


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
        return x + nn.Dense(16, kernel_init=logical(nn.initializers.lecun_normal(), ("mlp", "embed")))(nn.relu(h))


class TwoBlocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Block(name="second")(Block(name="first")(x))


def _parts():
    model = TwoBlocks()

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((4, 16)))["params"]
        tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def get_batch():
        x = jax.random.normal(jax.random.key(1), (16, 16))
        return {"x": x, "y": jnp.sin(x)}

    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return loss, state.apply_gradients(grads=grads)

    return init, get_batch, step


def _reference(init, get_batch, step):
    with ignore_transforms():
        state, batch = jax.jit(init)(), get_batch()
        losses = []
        for _ in range(STEPS):
            loss, state = jax.jit(step)(state, batch)
            losses.append(float(loss))
    return losses, state


def _train_like(step_fn, state, batch, want_losses, want_state):
    """``STEPS`` calls of ``step_fn``; their losses and the final state equal the one-device run's."""
    losses = []
    for _ in range(STEPS):
        loss, state = step_fn(state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)
    return state


def _build(pipelined: bool):
    """The step built by `parallelize`; pipelined: each block a stage of 4 devices (data=2 x model=2)."""
    init, get_batch, step = _parts()
    with contextlib.ExitStack() as registered:
        if pipelined:
            devices = np.asarray(jax.devices())
            for name, part in (("first", devices[:4]), ("second", devices[4:])):
                registered.enter_context(register_task(name, devices=part, dims=(2, 2),
                                                       device_axes=("data", "model"), logical_axes=RULES))
        built = parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 4, "model": 2},
                            rules=RULES)
    if pipelined:
        assert len(built[0].plan.placements) == 2
    return (init, get_batch, step), built


@pytest.mark.parametrize("pipelined", [pytest.param(False, marks=pytest.mark.slow), True], ids=["spmd", "pipeline"])
def test_a_train_state_built_inside_init_params_initialises_and_trains_like_one_device(pipelined):
    parts, (step_fn, init_fn, batch_fn) = _build(pipelined)
    state, batch = init_fn(), batch_fn()
    assert isinstance(state, TrainState) and isinstance(state.tx, optax.MultiSteps)
    kernel = state.params["first"]["Dense_0"]["kernel"].value
    if pipelined:  # the first block lives on stage 0 only, its 'mlp' dimension over that stage's model axis
        assert {d.id for d in kernel.sharding.device_set} == {0, 1, 2, 3}
    else:
        assert len(kernel.sharding.device_set) == 8
    assert kernel.addressable_shards[0].data.shape == (16, 16)  # (16, 32) split over model=2
    want_losses, want_state = _reference(*parts)
    state = _train_like(step_fn, state, batch, want_losses, want_state)
    assert state.step == STEPS


def test_an_spmd_step_called_with_a_state_made_again_is_traced_again_like_jax_jit():
    parts, (step_fn, init_fn, batch_fn) = _build(False)
    init, _, _ = parts
    fresh = jax.jit(init)()  # new tx and apply_fn objects, unequal to the ones the step was built with
    shardings = jax.tree.unflatten(jax.tree.structure(fresh), jax.tree.leaves(step_fn.param_shardings))
    fresh = jax.device_put(fresh, shardings)
    assert jax.tree.structure(fresh) != jax.tree.structure(init_fn())
    loss, state = step_fn(fresh, batch_fn())
    want_losses, _ = _reference(*parts)
    np.testing.assert_allclose(float(loss), want_losses[0], rtol=RTOL)
    assert state.tx is fresh.tx  # the new objects are kept, as jax.jit keeps them
    kernel = state.params["first"]["Dense_0"]["kernel"].value
    assert kernel.sharding == step_fn.param_shardings.params["first"]["Dense_0"]["kernel"].value


def test_a_pipelined_step_called_with_a_state_made_again_names_the_field_and_the_fix():
    parts, (step_fn, init_fn, batch_fn) = _build(True)
    init, _, _ = parts
    with ignore_transforms():
        fresh = jax.jit(init)()
    with pytest.raises(StepInputError) as info:
        step_fn(fresh, batch_fn())
    message = str(info.value)
    assert "'apply_fn'" in message or "'tx'" in message
    assert "TrainState" in message and "parallelize again" in message
    assert len(message) < 700 and "PyTreeDef" not in message  # one short sentence, never a tree dump


def test_a_state_from_the_sharded_initializer_keeps_the_objects_the_step_was_traced_with():
    _, (step_fn, init_fn, batch_fn) = _build(True)
    a, b = init_fn(), init_fn()
    assert a.tx is b.tx and jax.tree.structure(a) == jax.tree.structure(b)
    loss, state = step_fn(a, batch_fn())
    assert jax.tree.structure(state) == jax.tree.structure(a)


def test_an_initializer_that_builds_a_different_tree_when_compiled_is_named():
    calls = []

    def init():
        calls.append(1)
        extra = {"b": jnp.zeros(2)} if len(calls) > 1 else {}
        return {"w": jnp.ones((8, 4)), **extra}

    step_fn, init_fn = parallelize(lambda p, b: (jnp.sum(p["w"]) * b.sum(), p), init_params=init,
                                   initial_batch=np.ones((8,), np.float32), mesh={"data": 8},
                                   rules=[("batch", "data")])
    with pytest.raises(ValueError, match=r"'init' returned 2 arrays when compiled, but 1 when evaluated abstractly"):
        init_fn()


def test_an_nnx_train_state_holding_graphdef_apply_initialises_and_trains_like_one_device():
    class Model(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(16, 32, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
            self.down = nnx.Linear(32, 16, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")))

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    def init():
        graphdef, params = nnx.split(Model(nnx.Rngs(0)))
        return TrainState.create(apply_fn=graphdef.apply, params=params, tx=optax.adam(1e-2))

    _, get_batch, _ = _parts()

    def step(state, batch):
        def loss_fn(params):
            out, _ = state.apply_fn(params)(batch["x"])
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return loss, state.apply_gradients(grads=grads)

    step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch,
                                             mesh={"data": 4, "model": 2}, rules=RULES)
    state, batch = init_fn(), batch_fn()
    assert state.params["up"]["kernel"][...].sharding.spec == P(None, "model")
    with nnx.use_eager_sharding(False):  # one device: no mesh for the names
        want_losses, want_state = _reference(init, get_batch, step)
    state = _train_like(step_fn, state, batch, want_losses, want_state)
