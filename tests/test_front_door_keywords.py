"""The front door's keywords: a misspelt `parallelize` keyword is named with the parameter meant, and a
step's ``estimate`` takes `multimesh.estimate`'s options by name (a misspelt one a TypeError naming it)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.core.keyword_hints import keyword_hints
from multimesh.estimate import estimate, estimate_mjit
from multimesh.jax import mjit, parallelize
from multimesh.run.mjit import MJitFunction
from multimesh.run.spmd import Parallelized

pytestmark = pytest.mark.devices(8)


def init():
    return {"params": {"w": jnp.ones((16, 8))}, "opt_state": {"m": jnp.zeros((16, 8))}}


def step(state, x):
    return jnp.sum(x @ state["params"]["w"]), state


def get_batch():
    return jnp.ones((8, 16))


@pytest.mark.parametrize("given, meant", [("mseh", "'mesh'"), ("rule", "'rules'"), ("donnate", "'donate'"),
                                          ("get_input_batches", "'get_input_batch'")])
def test_a_misspelt_parallelize_keyword_names_the_one_meant(given, meant):
    kwargs = {"init_params": init, "get_input_batch": get_batch, given: None}
    kwargs.pop(meant.strip("'"), None)
    with pytest.raises(TypeError, match=rf"parallelize\(\) got an unexpected keyword argument '{given}'; "
                                        rf"did you mean {meant}"):
        parallelize(step, **kwargs)


def test_a_keyword_like_none_lists_the_keywords_taken():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'; it takes fun, init_params, "):
        parallelize(step, init_params=init, get_input_batch=get_batch, zzz=1)


def test_the_hint_keeps_the_signature_and_passes_other_binding_errors_on():
    assert "mesh" in inspect.signature(parallelize).parameters and parallelize.__name__ == "parallelize"

    @keyword_hints
    def f(a, *, b=1):
        return a + b
    assert f(1, b=2) == 3
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'a'"):
        f(b=2)
    assert keyword_hints(lambda **kw: kw)(x=1) == {"x": 1}  # one that takes any keyword is left alone


def _keywords(fn) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize("method, entry", [(Parallelized.estimate, estimate), (MJitFunction.estimate, estimate_mjit)])
def test_a_step_estimate_takes_the_options_of_the_estimate_entry_point(method, entry):
    parameters = inspect.signature(method).parameters.values()
    assert not any(p.kind is p.VAR_KEYWORD for p in parameters), "options by name, not **options"
    mine, theirs = _keywords(method), _keywords(entry)
    mine.pop("profile", None)
    assert set(mine) == set(theirs) and "profile" in inspect.signature(method).parameters
    for name, p in mine.items():
        assert p.annotation is not inspect.Parameter.empty, name


def test_a_misspelt_estimate_option_is_a_type_error_naming_it():
    fn, _, _ = parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 8},
                           rules=[("batch", "data")])
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'model_flop'; did you mean 'model_flops'"):
        fn.estimate(model_flop=1.0)
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("x", "y"))
    a = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'profle'; did you mean 'profile'"):
        mjit(lambda a: jnp.sum(a), mesh=mesh).estimate(a, profle="h100-sxm")


def test_estimate_options_reach_the_estimate():
    fn, _, _ = parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 8},
                           rules=[("batch", "data")])
    default, none_optimizer = fn.estimate(), fn.estimate(optimizer_paths=r"^nothing$")
    assert default.memory[0].optimizer == 16 * 8 * 4 and default.memory[0].params == 16 * 8 * 4
    assert none_optimizer.memory[0].optimizer == 0 and none_optimizer.memory[0].params == 2 * 16 * 8 * 4
    assert fn.estimate(model_flops=1e6).flops == default.flops
