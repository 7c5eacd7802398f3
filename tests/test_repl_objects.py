"""What a user sees at a REPL: named results, one-line reprs, stats on every step, initializers that say
where they come from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from multimesh.jax import (
    BatchStep,
    ShardedFunction,
    StepAndInit,
    StepFunctions,
    build_mesh,
    parallelize,
    task,
)

pytestmark = [pytest.mark.devices(8), pytest.mark.filterwarnings("ignore:parallelize. no rules=")]


def make_params():
    """The parameters of the test step."""
    return {"w": jnp.ones((8, 8))}


def make_batch():
    return {"x": jnp.ones((8, 8))}


def step(p, b):
    return jnp.sum(b["x"] @ p["w"])


def test_parallelize_returns_named_tuples_that_unpack_as_before():
    made = parallelize(step, init_params=make_params, get_input_batch=make_batch, mesh={"data": 8})
    assert isinstance(made, StepFunctions) and made._fields == ("step", "init_params", "get_input_batch")
    step_fn, init_fn, batch_fn = made
    assert made.step is step_fn and made.init_params is init_fn and made.get_input_batch is batch_fn
    assert isinstance(step_fn, ShardedFunction)
    two = parallelize(step, init_params=make_params, initial_batch=make_batch(), mesh={"data": 8})
    assert isinstance(two, StepAndInit) and len(two) == 2
    batch_only = parallelize(lambda b: jnp.sum(b["x"]), get_input_batch=make_batch, mesh={"data": 8})
    assert isinstance(batch_only, BatchStep) and float(batch_only.step(batch_only.get_input_batch())) == 64.0


def test_initializers_say_where_they_come_from():
    _, init_fn, batch_fn = parallelize(step, init_params=make_params, get_input_batch=make_batch, mesh={"data": 8})
    assert init_fn.__name__ == "make_params" and init_fn.__doc__ == make_params.__doc__
    assert init_fn.__wrapped__ is make_params and batch_fn.__qualname__ == "make_batch"
    shown = repr(init_fn)
    assert f"{__name__}.make_params at {__file__}:" in shown and "1 arrays" in shown


def test_plans_print_in_one_line_and_every_step_has_stats():
    spmd, init_fn, batch_fn = parallelize(step, init_params=make_params, get_input_batch=make_batch,
                                          mesh={"data": 8})
    assert spmd.stats.executions == 0
    spmd(init_fn(), batch_fn())
    assert spmd.stats.executions == 1 and spmd.stats.executed == ["step"] and spmd.stats.transfers == 0
    first = task(lambda w, x: x @ w, "first", mesh=build_mesh({"data": 4}, jax.devices()[:4]))
    second = task(lambda w, x: x @ w, "second", mesh=build_mesh({"data": 4}, jax.devices()[4:]))
    mpmd, init_fn, batch_fn = parallelize(lambda p, b: jnp.sum(second(p["w"], first(p["w"], b["x"]))),
                                          init_params=make_params, get_input_batch=make_batch)
    for plan in (spmd.plan, mpmd.plan):
        text = repr(plan)
        assert "\n" not in text and len(text) < 200 and text.startswith("Plan(")
    assert "on [first, second]" in repr(mpmd.plan) and "MPMD plan: 2 segments" in str(mpmd.plan)
    assert "lives" in ShardedFunction.report.__doc__ and "warnings" in ShardedFunction.report.__doc__
