"""`register_task(params=...)`: stages of a plain-JAX model named by the paths of the parameters they read.

The model here is plain JAX: its parameters a dict with a list of layers, its
forward a Python loop over them, no `jax.named_scope` anywhere. Layers 0-1
(and the embedding) on devices 0-3 and layers 2-3 (and the head) on devices
4-7 is a layout only the parameters' paths can say.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from multimesh.jax import microbatch, parallelize, register_task
from multimesh.trace.implicit import implicit_placement, match_path
from multimesh.trace.param_scopes import scope_by_params

pytestmark = pytest.mark.devices(8)

BATCH, WIDTH, LAYERS, STEPS = 8, 16, 4, 3
TX = optax.sgd(0.05, momentum=0.9)
STAGES = (r"embed|layers\.[01]", r"layers\.[23]|head")


def init() -> dict:
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = {
        "embed": jax.random.normal(keys[0], (WIDTH, WIDTH)) / 4,
        "layers": [{"w": jax.random.normal(keys[1 + i], (WIDTH, WIDTH)) / 4, "scale": jnp.ones(WIDTH)}
                   for i in range(LAYERS)],
        "head": jax.random.normal(keys[-1], (WIDTH, 4)) / 4,
    }
    return {"params": params, "opt": TX.init(params)}


def forward(params: dict, x: jax.Array) -> jax.Array:
    x = x @ params["embed"]
    for layer in params["layers"]:   # no scope per layer: only the parameters' paths tell the layers apart
        h = x / jnp.sqrt(jnp.mean(x ** 2, axis=-1, keepdims=True) + 1e-6) * layer["scale"]
        x = x + jnp.tanh(h @ layer["w"])
    return x @ params["head"]


def loss(params: dict, batch: dict) -> jax.Array:
    """Summed over rows and divided by the batch, so that microbatches add up."""
    return jnp.sum((forward(params, batch["x"]) - batch["y"]) ** 2) / BATCH


def make_step(microbatches: int | None = None):
    def step(state, batch):
        fn = loss if microbatches is None else microbatch(loss, 0, BATCH // microbatches, argnum=1,
                                                          schedule="1f1b")   # microbatches of 2 rows
        value, grads = jax.value_and_grad(fn)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return step


def get_batch() -> dict:
    return {"x": jax.random.normal(jax.random.key(1), (BATCH, WIDTH)),
            "y": jax.random.normal(jax.random.key(2), (BATCH, 4))}


def test_match_path_matches_whole_keys():
    layers = re.compile(r"layers\.[01]")
    assert match_path(layers, "params.layers.0.w").group(0) == "layers.0"
    assert match_path(layers, "opt.0.trace.layers.1.scale").group(0) == "layers.1"
    assert match_path(layers, "params.layers.10.w") is None          # not part of a key
    assert match_path(re.compile("layer"), "params.layers.0.w") is None
    assert match_path(re.compile("w"), "params.layers.0.w").group(0) == "w"
    numbered = match_path(re.compile(r"layers\.(\d+)"), "params.layers.3.w")
    assert numbered.group(0) == "layers.3" and numbered.group(1) == "3"


def test_pipeline_by_parameter_paths_equals_one_device():
    devices = jax.devices()
    with register_task(params=STAGES[0], devices=devices[:4]), register_task(params=STAGES[1], devices=devices[4:]):
        step_fn, init_fn, batch_fn = parallelize(make_step(4), init_params=init, get_input_batch=get_batch)
    assert step_fn.plan.schedule.num_stages == 2 and step_fn.plan.schedule.num_microbatches == 4
    one = jax.sharding.SingleDeviceSharding(devices[0])
    ref_step, ref_state = jax.jit(make_step()), jax.device_put(jax.jit(init)(), one)
    same_step, same_state = jax.jit(make_step(4)), ref_state   # the same 4 microbatches, on one device
    ref_batch = jax.device_put(get_batch(), one)
    state, batch = init_fn(), batch_fn()
    for _ in range(STEPS):
        value, state = step_fn(state, batch)
        want, ref_state = ref_step(ref_state, ref_batch)
        _, same_state = same_step(same_state, ref_batch)
        np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
        # the whole batch sums its rows in another order than 4 microbatches: a few ulps apart (the momentum
        # reaches ~35, where float32's ulp is 4e-6); the same microbatches on one device agree to rounding
        for a, b, c in zip(*(jax.tree.leaves(jax.device_get(s)) for s in (state, ref_state, same_state))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)
    first, second = set(devices[:4]), set(devices[4:])
    for tree in (state["params"], state["opt"][0].trace):
        for i, layer in enumerate(tree["layers"]):
            for name, array in layer.items():
                assert array.sharding.device_set == (first if i < 2 else second), (i, name)
        assert tree["embed"].sharding.device_set == first
        assert tree["head"].sharding.device_set == second


def test_a_callback_places_each_match():
    """``callback`` gets the matched keys (``layers.2``), with the pattern's groups."""
    devices = jax.devices()
    params = init()["params"]
    closed = jax.make_jaxpr(forward)(params, get_batch()["x"])
    seen = []

    def where(name, backprop):
        seen.append(str(name))
        return ((0, 4), "early") if int(name.group(1)) < 2 else ((4, 8), "late")
    with register_task(params=r"layers\.(\d+)", callback=where):
        scoped = scope_by_params(closed, (params, get_batch()["x"]), "test")
        placed = [p for e in scoped.jaxpr.eqns if (p := implicit_placement(e.source_info.name_stack)) is not None]
    assert sorted(set(seen)) == [f"layers.{i}" for i in range(LAYERS)]
    assert [p.name for p in dict.fromkeys(placed)] == ["early", "late"]
    assert {d for p in placed if p.name == "late" for d in p.devices} == set(devices[4:])


def test_param_scopes_and_scope_names_are_matched_apart():
    """A ``params=`` pattern places only what reads the parameters; a name pattern only a named scope, even
    one spelt like a parameter path."""
    devices = jax.devices()

    def f(params, x):
        with jax.named_scope("layers.0"):
            x = x * 2
        return x @ params["layers"][0]["w"]
    params = init()["params"]
    closed = jax.make_jaxpr(f)(params, get_batch()["x"])
    with register_task(params=r"layers\.0", devices=devices[:4]), register_task(r"layers\.0", devices=devices[4:]):
        scoped = scope_by_params(closed, (params, get_batch()["x"]), "test")
        double, matmul = scoped.jaxpr.eqns
        assert implicit_placement(double.source_info.name_stack).devices == frozenset(devices[4:])
        assert implicit_placement(matmul.source_info.name_stack).devices == frozenset(devices[:4])


def test_a_pattern_matching_no_parameter_path_names_the_paths():
    with register_task(params=r"blocks\.0", devices=jax.devices()[:4]), \
            pytest.raises(ValueError, match=r"register_task\(params='blocks\\\\.0'\) matches no parameter path.*"
                                            r"params\.layers\.0\.w"):
        parallelize(make_step(), init_params=init, get_input_batch=get_batch)


def test_register_task_takes_one_pattern():
    with pytest.raises(TypeError, match="give exactly one"):
        register_task(r"layers_0", params=r"layers\.0", devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="split= splits a scanned stack"):
        register_task(params=r"layers", split={(0, 2): ((0, 4), "a"), (2, 4): ((4, 8), "b")})
    with pytest.raises(ValueError, match="params=.*not a valid regular expression"):
        register_task(params=r"layers\.(", devices=jax.devices()[:4])
