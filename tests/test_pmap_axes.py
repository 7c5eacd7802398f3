"""pmap-style collectives in a step given to `parallelize`: each axis only ``jax.pmap`` binds is bound to one
device (`multimesh.trace.pmap_axes`), so the step means what it means on one device. The Flax ResNet of
``test_thirdparty_resnet.py`` is the model this is for; here the mechanism, on SPMD and MPMD steps."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, train_steps, two_matrices, xy_batch
from jax import lax
from jax.sharding import PartitionSpec as P

from multimesh.jax import build_mesh, microbatch, mjit, parallelize, task
from multimesh.trace.pmap_axes import unbound_axis, with_axes_of_one
from multimesh.trace.task import ignore_transforms

pytestmark = pytest.mark.devices(8)

B, D = 16, 8
TX = optax.sgd(0.1)


def test_the_unbound_name_is_read_from_jaxs_error():
    with pytest.raises(NameError) as caught:
        jax.jit(lambda x: lax.psum(x, "replicas"))(1.0)
    assert unbound_axis(caught.value) == "replicas"
    assert unbound_axis(NameError("name 'undefined' is not defined")) is None
    assert unbound_axis(ValueError("unbound axis name: batch")) is None  # only JAX's NameError


def test_collectives_over_an_axis_of_one_act_as_on_one_device():
    def f(x, *, scale):
        return (lax.pmean(x, "i"), lax.psum(1, "i"), lax.all_gather(x, "i"), lax.pmax(x, "j") * scale)

    g = with_axes_of_one(f, ["i", "j"])
    x = jnp.arange(3.0)
    mean, count, gathered, top = jax.jit(g, static_argnames="scale")(x, scale=2.0)
    np.testing.assert_array_equal(mean, x)
    assert count == 1 and gathered.shape == (1, 3)
    np.testing.assert_array_equal(top, 2 * x)
    assert g.__name__ == "f" and inspect.signature(g) == inspect.signature(f) and g.axes_of_one == ("i", "j")


def init():
    return two_matrices(TX, D)


def get_batch():
    return xy_batch(B, D)


def normalized(w, x):
    """A layer normalizing its activations by batch statistics averaged over pmap's ``batch`` axis (as
    ``nn.BatchNorm(axis_name="batch")`` does) and the feature scale over a second axis ``model``."""
    h = jnp.tanh(x @ w)
    mean = lax.pmean(h.mean(0), "batch")
    var = lax.pmean(((h - mean) ** 2).mean(0), "batch")
    return (h - mean) / jnp.sqrt(var + 1e-5) * lax.psum(1.0, "model")


def pmap_step(loss):
    def step(state, batch):
        value, grads = jax.value_and_grad(loss)(state["params"], batch)
        grads = lax.pmean(grads, "batch")
        updates, opt = TX.update(grads, state["opt"])
        return lax.pmean(value, "batch"), {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return step


def whole_loss(p, b):
    return jnp.mean((normalized(p["b"], normalized(p["a"], b["x"])) - b["y"]) ** 2)


def one_device(step, steps=3):
    """The reference: the step on one device under `jax.shard_map` over a mesh of axes ``batch`` and ``model``
    of size 1 each, which binds both names."""
    mesh = jax.make_mesh((1, 1), ("batch", "model"), devices=jax.devices()[:1])
    stepped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P()))
    state, batch, losses = init(), get_batch(), []
    for _ in range(steps):
        loss, state = stepped(state, batch)
        losses.append(float(loss))
    return losses, state


def run(built, steps=3):
    return train_steps(*built, steps)


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_trees_close(got[1], want[1], rtol=1e-4, atol=1e-6)


def test_an_spmd_step_with_two_pmap_axes_equals_one_device():
    step = pmap_step(whole_loss)
    reference = one_device(step)
    assert reference[0][-1] < reference[0][0]
    built = parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 8}, rules=[("batch", "data")])
    assert built[0].fun.axes_of_one == ("batch", "model")  # in the order the trace met them
    assert repr(built[0]).endswith("params, pmap axes bound to one device: 'batch', 'model')")
    assert_same(run(built), reference)


def test_mjit_takes_a_pmap_step_too():
    """`mjit` (jax.jit-like, tasks included) binds pmap's axes as `parallelize` does: the same step, its batch
    split over 8 devices, equals one device; its estimate compiles the bound program."""
    step = pmap_step(whole_loss)
    fn = mjit(step, mesh=build_mesh({"data": 8}), in_shardings=(P(), P("batch")), rules=[("batch", "data")])
    state, batch, losses = init(), get_batch(), []
    for _ in range(3):
        loss, state = fn(state, batch)
        losses.append(float(loss))
    assert_same((losses, state), one_device(step))
    assert fn.estimate(init(), get_batch(), profile="h100-sxm").flops > 0  # compiled from the bound step
    with pytest.raises(ValueError, match=r"mjit\(<lambda>\) computes a per-device value over pmap's axis 'batch'"):
        mjit(lambda x: x * lax.axis_index("batch"), mesh=build_mesh({"data": 8}))(jnp.ones(8))


def test_a_pipeline_whose_stages_use_a_pmap_axis_equals_one_device():
    """Two stages of 4 devices, 2 microbatches: each microbatch normalized by its own statistics, as the same
    program computes them on one device (microbatches summed one after the other)."""
    devices = np.array(jax.devices())
    stages = [task(normalized, f"stage{i}", mesh=build_mesh({"data": 4}, devices[4 * i:4 * i + 4])) for i in range(2)]

    def loss(p, b):
        return jnp.mean((stages[1](p["b"], stages[0](p["a"], b["x"])) - b["y"]) ** 2)

    built = parallelize(pmap_step(lambda p, b: microbatch(loss, 0, B // 2, argnum=1, schedule="1f1b")(p, b)),
                        init_params=init, get_input_batch=get_batch, rules=[("batch", "data")])
    assert len(built[0].plan.placements) == 2 and repr(built[0]).endswith("one device: 'batch', 'model')")

    def summed(p, b):  # the reference: the microbatches one after the other, tasks as plain calls
        return sum(loss(p, jax.tree.map(lambda x: x[i * B // 2:(i + 1) * B // 2], b)) for i in range(2))

    with ignore_transforms():
        reference = one_device(pmap_step(summed))
    assert_same(run(built), reference)


def test_a_name_error_of_the_steps_own_is_left_as_it_is():
    def step(state, batch):
        return undefined_name, state  # noqa: F821

    with pytest.raises(NameError, match="undefined_name"):
        parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 8}, rules=[("batch", "data")])


def test_a_per_device_index_in_the_results_is_named():
    def step(state, batch):
        key = jax.random.fold_in(jax.random.key(0), lax.axis_index("batch"))
        return jnp.mean(batch["x"] * jax.random.uniform(key, batch["x"].shape)), state

    with pytest.raises(ValueError, match=r"parallelize: step 'step' computes a per-device value over pmap's "
                                         r"axis 'batch'.*lax.axis_index\('batch'\)"):
        parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 8}, rules=[("batch", "data")])
