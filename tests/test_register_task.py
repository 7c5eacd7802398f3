"""`register_task` placement callbacks: ``((start, stop), name)`` and ``(devices, name)``.

The callbacks are asked directly through the registration (no tracing), and
once end to end: a Linen model whose blocks a callback places on given devices.
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import check_mpmd_against_reference

from multimesh.jax import clear_tasks, parallelize, register_task
from multimesh.trace.implicit import implicit_placement

pytestmark = pytest.mark.devices(8)

REGEX = r"layers_(\d+)"


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


def place(reg, name: str, backprop: bool = False):
    return reg.placement_for(reg.pattern.fullmatch(name), backprop)


def test_index_range_runs_on_those_of_jax_devices():
    devs = jax.devices()
    reg = register_task(r"layers_(\d+)", callback=lambda m, bp: ((4, 8), f"s{m.group(1)}"), dims=(2, 2),
                        device_axes=("data", "model"))
    p = place(reg, "layers_1")
    assert p.name == "s1" and dict(p.mesh.shape) == {"data": 2, "model": 2}
    assert p.mesh.devices.tolist() == [[devs[4], devs[5]], [devs[6], devs[7]]]
    assert place(reg, "layers_1") is p  # asked once per match and direction
    # numpy integers and other 2-sequences of ints are ranges too
    reg2 = register_task(r"x", callback=lambda m, bp: (np.array([2, 4]), "x"))
    assert list(place(reg2, "x").mesh.devices) == devs[2:4]


def test_devices_form_lists_and_arrays():
    devs = jax.devices()
    mine = devs[::-1]  # not a prefix of jax.devices(): a range could not say this
    reg = register_task(r"layers_(\d+)", callback=lambda m, bp: (mine[2 * int(m.group(1)):2 * int(m.group(1)) + 2], "stage"))
    p = place(reg, "layers_1")
    assert p.mesh.devices.tolist() == [devs[5], devs[4]] and p.mesh.axis_names == ("devices",)
    # reshaped to dims=
    reg = register_task(r"a", callback=lambda m, bp: (tuple(mine[:4]), "a"), dims=(2, 2), device_axes=("x", "y"))
    assert place(reg, "a").mesh.devices.tolist() == [[devs[7], devs[6]], [devs[5], devs[4]]]
    # an array keeps its shape without dims=
    grid = np.array(devs[4:], dtype=object).reshape(2, 2)
    reg = register_task(r"b", callback=lambda m, bp: (grid, "b"), device_axes=("x", "y"))
    assert place(reg, "b").mesh.devices.tolist() == grid.tolist()
    # equal callbacks give one placement (one stage), whichever form names the devices
    r1 = register_task(r"c", callback=lambda m, bp: (devs[:2], "same"))
    r2 = register_task(r"d", callback=lambda m, bp: ((0, 2), "same"))
    assert place(r1, "c") is place(r2, "d")


@pytest.mark.parametrize("got, message", [
    ((["cpu:0", "cpu:1"], "s"), (r"callback for 'layers_3' returned \['cpu:0', 'cpu:1'\] where a \(start, stop\) "
                                 r"pair of device indices or a non-empty sequence/array of jax devices belongs: "
                                 r"'cpu:0' is a str, not a jax device")),
    (([], "s"), re.escape(f"register_task({REGEX!r}): callback for 'layers_3' returned [] where")),
    ((0, "s"), r"callback for 'layers_3' returned 0 where"),
    ((1, 2, 3), (r"callback must return a Task, \(\(start, stop\), name\), \(devices, name\) or None, "
                 r"got \(1, 2, 3\) for 'layers_3'")),
    (((0, 99), "s"), r"placed 'layers_3' on devices 0..98, but only 8 devices exist"),
])
def test_bad_callback_results_name_the_regex_and_the_match(got, message):
    reg = register_task(REGEX, callback=lambda m, bp: got)
    with pytest.raises(ValueError, match=message):
        place(reg, "layers_3")


def test_devices_form_errors():
    devs = jax.devices()
    reg = register_task(r"layers_(\d+)", callback=lambda m, bp: ([devs[0], devs[0]], "s"))
    with pytest.raises(ValueError, match=r"'layers_0' returned devices \[0, 0\], which name a device more than once"):
        place(reg, "layers_0")
    reg = register_task(r"h", callback=lambda m, bp: (devs[5:8], "s"), dims=(2, 2))
    with pytest.raises(ValueError, match=r"register_task\('h'\): dims=\(2, 2\) needs 4 devices, but the callback "
                                         r"gave 'h' devices 5-7 \(3\)"):
        place(reg, "h")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(32)(x)))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = Block(name=f"layers_{i}")(x)
        return x


def test_devices_from_a_callback_end_to_end():
    """Blocks 0-1 on the last four devices, 2-3 on the first four (reversed), as the callback says."""
    model, tx = Net(), optax.adam(1e-2)
    devs = jax.devices()
    first, second = devs[7:3:-1], devs[3::-1]

    def where(match, backprop):
        return (first, "first") if int(match.group(1)) < 2 else (np.array(second, dtype=object), "second")

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

    with register_task(r"layers_(\d+)", callback=where, dims=(2, 2), device_axes=("data", "model")):
        fn, state = check_mpmd_against_reference(step, init, batch)
    assert [p.name for p in fn.plan.placements[:2]] == ["first", "second"]
    assert fn.plan.placements[0].mesh.devices.tolist() == [[devs[7], devs[6]], [devs[5], devs[4]]]
    params = state["p"]["params"]
    assert params["layers_1"]["Dense_0"]["kernel"].sharding.device_set == set(first)
    assert params["layers_2"]["Dense_1"]["kernel"].sharding.device_set == set(second)


def test_an_inner_registration_an_outer_match_overrides_is_warned_about_once():
    devs = jax.devices()
    outer = register_task(r"decoder", devices=devs[:4])
    inner = register_task(r"layers_(\d+)", devices=devs[4:])
    with pytest.warns(UserWarning) as caught:
        got = implicit_placement("decoder/layers_1/Dense_0")
        implicit_placement("decoder/layers_2/Dense_0")  # the same pair again: no second warning
    assert got is outer.placement  # the outermost match wins
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "register_task('layers_(\\\\d+)') matches 'layers_1', inside 'decoder', which register_task('decoder') " \
           "already places on" in message
    assert "devices [0-3]" in message and "does not run on" in message and "devices [4-7]" in message
    # outside the outer match the inner registration places its names
    assert implicit_placement("layers_1/Dense_0") is inner.placement


def test_no_warning_when_the_inner_match_would_place_it_alike_or_nowhere():
    devs = jax.devices()
    register_task(r"decoder", devices=devs[:4])
    register_task(r"layers_0", callback=lambda m, bp: None)  # not a task
    register_task(r"layers_1", callback=lambda m, bp: (devs[:4], "decoder"))  # a placement equal to decoder's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        implicit_placement("decoder/layers_0/Dense_0")
        implicit_placement("decoder/layers_1/Dense_0")


def test_two_registrations_of_one_name_warn_that_the_first_wins():
    devs = jax.devices()
    first = register_task(r"embed|head", devices=devs[:4])
    register_task(r"embed", devices=devs[4:])
    with pytest.warns(UserWarning, match=r"register_task\('embed'\) matches 'embed', but register_task\('embed\|head'\)"):
        assert implicit_placement("embed") is first.placement


def test_a_registration_overridden_in_a_traced_model_is_warned_about():
    """End to end: `parallelize` of a model whose block a registration of its parent overrides."""
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Net(name="decoder")(x)

    model = Outer()
    devs = jax.devices()
    with register_task(r"decoder", devices=devs[:4]), register_task(r"layers_3", devices=devs[4:]):
        with pytest.warns(UserWarning, match=r"register_task\('layers_3'\) matches 'layers_3', inside 'decoder'"):
            parallelize(lambda p, b: jnp.sum(model.apply(p, b)), init_params=lambda: model.init(jax.random.key(0), jnp.zeros((8, 16))),
                        initial_batch=jnp.ones((8, 16)))


def test_the_overridden_check_does_not_raise_a_callback_error_for_a_name_it_never_places():
    devs = jax.devices()
    register_task(r"decoder", devices=devs[:4])

    def strict_callback(match, backprop):
        raise ValueError(f"unexpected {match}")

    register_task(r"layers_(\d+)", callback=strict_callback)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert implicit_placement("decoder/layers_1/Dense_0") is not None
