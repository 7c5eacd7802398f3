"""MultiMesh's `microbatch` keywords (``unrolling``, ``arg_shardings``, ``custom_schedule``) and
``register_task(matcher=...)``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from multimesh.jax import MultiMesh, clear_tasks, microbatch, register_task

pytestmark = pytest.mark.devices(8)


def test_arg_shardings_constrain_the_argument_before_slicing():
    f = microbatch(lambda x: jnp.sum(x ** 2, axis=0), 0, 4, arg_shardings=P("data"), unrolling=2)
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    with MultiMesh(axis_sizes=(8,), axis_names=("data",)):
        jaxpr = jax.make_jaxpr(f)(x)
        out = jax.jit(lambda x: f(x))(x)
    first = jaxpr.jaxpr.eqns[0]
    assert first.primitive.name == "sharding_constraint" and first.params["sharding"].spec == P("data")
    np.testing.assert_allclose(out, (x ** 2).sum(axis=0))


def test_custom_schedule_and_bad_unrolling_are_refused():
    with pytest.raises(NotImplementedError, match=r"custom_schedule=\.\.\.\) is not supported: .*pass it as schedule="):
        microbatch(lambda x: x, 0, 2, custom_schedule=[["a", "a"]])
    with pytest.raises(ValueError, match=r"unrolling must be a positive integer, got 0"):
        microbatch(lambda x: x, 0, 2, unrolling=0)


def test_register_task_takes_matcher():
    try:
        reg = register_task(matcher=r"layers_\d", devices=[0, 1])
        assert reg.pattern.pattern == r"layers_\d"
        with pytest.raises(TypeError, match=r"register_task needs the name pattern"):
            register_task(devices=[0])
    finally:
        clear_tasks()


def test_a_rule_for_an_axis_the_mesh_lacks_warns_until_an_array_uses_it():
    """MultiMesh's microbatch test gives rules ``("model", "y")`` on a mesh with only ``x``, and no array
    names ``model``: a warning naming the rule, and the step runs; an array that names ``model`` is a
    RuleError naming the rule and the array."""
    from multimesh.jax import RuleError, RuleWarning, parallelize

    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    loss = microbatch(lambda w, b: jnp.sum(b @ w), 0, 4, argnum=1)
    rules = [("batch", "x"), ("model", "y")]
    with MultiMesh(axis_sizes=(8,), axis_names=("x",)), pytest.warns(RuleWarning, match=r"rule \('model', 'y'\) "
                                                                   r"names mesh axis 'y'.*\{'x': 8\}"):
        step, init = parallelize(loss, init_params=lambda: jnp.ones((2, 3)), initial_batch=x, rules=rules)
        out = step(init(), x)
    np.testing.assert_allclose(out, np.sum(x @ np.ones((2, 3), np.float32)), rtol=1e-6)
    with MultiMesh(axis_sizes=(8,), axis_names=("x",)), pytest.raises(RuleError, match=r"rule \('model', 'y'\) "
                                                                      r"names mesh axis 'y'.*names 'model'"):
        parallelize(loss, init_params=lambda: jnp.ones((2, 3)), initial_batch=x, rules=rules,
                    param_rules=[("", ("model", None))])
