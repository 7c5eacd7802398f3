"""Python's cyclic collector is held off while a step is built, and left as it was found after."""

import gc

import jax
import jax.numpy as jnp
import pytest

from multimesh.core.gc_pause import gc_paused, without_gc
from multimesh.core.placement import Placement
from multimesh.plan.partition import make_plan


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_held_off_inside_and_back_on_after(collector_on):
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_back_on_after_an_error(collector_on):
    @without_gc
    def fails():
        assert not gc.isenabled()
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        fails()
    assert gc.isenabled()


def test_left_off_when_it_was_off(collector_on):
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_planning_leaves_the_collector_on(collector_on):
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(4))
    plan = make_plan(closed, Placement(mesh))
    assert len(plan.segments) == 1
    assert gc.isenabled()


def test_parallelize_holds_it_off_from_the_first_trace_to_the_runtime_and_leaves_it_on(collector_on):
    from multimesh.jax import parallelize

    seen = []

    def init():
        seen.append(("init", gc.isenabled()))
        return {"w": jnp.ones((4,))}

    def step(params, batch):
        seen.append(("step", gc.isenabled()))
        return jnp.sum(params["w"] * batch)

    fn, init_fn = parallelize(step, init_params=init, initial_batch=jnp.ones((4,)),
                                 devices=jax.devices()[:1], rules=[])
    assert seen and all(not on for _, on in seen), seen
    assert gc.isenabled()
    assert float(fn(init_fn(), jnp.ones((4,)))) == 4.0


def test_mjit_holds_it_off_from_the_trace_to_the_plan_and_leaves_it_on(collector_on, monkeypatch):
    import multimesh.run.mjit as mjit_module
    from multimesh.jax import mjit

    seen = []
    plan = mjit_module.make_plan

    def recorded(*args, **kwargs):  # called between the trace and the runtime's set-up
        seen.append(gc.isenabled())
        return plan(*args, **kwargs)

    monkeypatch.setattr(mjit_module, "make_plan", recorded)
    fn = mjit(lambda x: jnp.sum(x * 2), devices=jax.devices()[:1])
    assert float(fn(jnp.ones((4,)))) == 8.0
    assert seen == [False]
    assert gc.isenabled()
