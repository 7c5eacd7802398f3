"""A `shard_map` a model calls with its own global mesh, inside a pipeline stage.

A plain-JAX model of two layers; each layer normalises its activations with a
`shard_map` over the model's mesh ``{'x': 2, 'y': 2, 'z': 2}`` whose body
sums squares over its ``z`` shard and ``psum``s them over ``z`` (the way an MoE
layer sums its experts' outputs over the expert axis). Two stages of four
devices split the mesh along ``x``: each stage's submesh is ``{'x': 1, 'y': 2,
'z': 2}``, the same axis names. The `shard_map` runs on the stage's submesh,
its specs unchanged, its ``psum`` over the stage's own ``z`` group.

Every form: Explicit or Auto mesh axes; ``jax.shard_map(mesh=<the mesh>)``,
``jax.experimental.shard_map.shard_map(f, mesh, ...)``,
``multimesh.jax.shard_map(mesh=None)`` or ``jax.shard_map`` with no mesh (JAX's
context mesh, ``jax.set_mesh`` on one device); stages chosen by named scope or by
``register_task(params=...)``; a jit inside the body, a ``jax.checkpoint``
around it; a Flax NNX model by attribute path. Each is a 1F1B pipeline compared
with the same step on one device (a 1x1x1 mesh): losses, parameters and
optimizer state after three steps; an axis the stages split named by the
specs, by scope and by ``params=`` (traced again on the stages' shape). Then
the bad inputs: a stage lacking an axis the specs name; an axis of another
size on stages of two shapes known only after tracing. A stage lacking an
axis of size 1 on the model's mesh drops it, with a warning, and still equals
one device.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import multimesh.jax as mmj
from multimesh.jax import microbatch, parallelize, register_task
from multimesh.trace import stage_shard_map

pytestmark = pytest.mark.devices(8)

BATCH, WIDTH, MICRO, STEPS = 8, 8, 2, 3
TX = optax.sgd(0.1, momentum=0.9)
SPEC = P("y", "z")


def _experimental_shard_map(f, mesh, in_specs, out_specs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.shard_map import shard_map
    return shard_map(f, mesh, in_specs, out_specs)


#: how the model calls shard_map, given its mesh and specs
FORMS: dict[str, Callable] = {
    "jax.shard_map": lambda f, mesh, spec: jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec),
    "experimental": lambda f, mesh, spec: _experimental_shard_map(f, mesh, spec, spec),
    "multimesh": lambda f, mesh, spec: mmj.shard_map(f, in_specs=spec, out_specs=spec),
    "mesh=None": lambda f, mesh, spec: jax.shard_map(f, in_specs=spec, out_specs=spec),   # JAX's context mesh
}


def model_mesh(axis_type: AxisType, shape=(2, 2, 2), names=("x", "y", "z")) -> Mesh:
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def rms_norm(h: jax.Array) -> jax.Array:
    """Inside the shard_map: the row's sum of squares over its ``z`` shards."""
    total = jax.lax.psum(jnp.sum(h * h, axis=-1, keepdims=True), "z")
    return h * jax.lax.rsqrt(total / WIDTH + 1e-6)


@jax.jit
def _sum_of_squares(h: jax.Array) -> jax.Array:
    return jnp.sum(h * h, axis=-1, keepdims=True)


def rms_norm_calling_a_jit(h: jax.Array) -> jax.Array:
    """`rms_norm` with its sum in a jit of its own (as ``jnp`` functions often are)."""
    return h * jax.lax.rsqrt(jax.lax.psum(_sum_of_squares(h), "z") / WIDTH + 1e-6)


#: forms whose body, or what is around the shard_map, holds a call of its own
FORMS["jit in the body"] = lambda f, mesh, spec: jax.shard_map(rms_norm_calling_a_jit, mesh=mesh, in_specs=spec,
                                                               out_specs=spec)
FORMS["remat around"] = lambda f, mesh, spec: jax.checkpoint(jax.shard_map(f, mesh=mesh, in_specs=spec,
                                                                           out_specs=spec))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normed_in_a_jit(h: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """`rms_norm`'s shard_map inside a jit defined once (its trace cached by JAX across calls)."""
    return jax.shard_map(rms_norm, mesh=mesh, in_specs=spec, out_specs=spec)(h)


FORMS["module jit around"] = lambda f, mesh, spec: functools.partial(_normed_in_a_jit, mesh=mesh, spec=spec)


def forward(params: dict, x: jax.Array, mesh: Mesh, form: str, scopes: bool, spec: P = SPEC) -> jax.Array:
    explicit = mesh.axis_types[0] == AxisType.Explicit
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}") if scopes else _nothing():
            h = x @ layer["w"]
            if explicit:   # in JAX's explicit style an input is resharded to the shard_map's in_specs first
                h = jax.sharding.reshard(h, spec)
            x = x + jnp.tanh(FORMS[form](rms_norm, mesh, spec)(h))
    return jnp.sum(x ** 2) / BATCH


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def init() -> dict:
    keys = jax.random.split(jax.random.key(0), 2)
    params = {"layers": [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / 3} for k in keys]}
    return {"params": params, "opt": TX.init(params)}


def get_batch() -> dict:
    return {"x": jax.random.normal(jax.random.key(1), (BATCH, WIDTH))}


def make_step(mesh: Mesh, form: str, scopes: bool, microbatches: int | None, spec: P = SPEC):
    def loss(params, batch):
        return forward(params, batch["x"], mesh, form, scopes, spec)

    def step(state, batch):
        fn = loss if microbatches is None else microbatch(loss, 0, BATCH // microbatches, argnum=1, schedule="1f1b")
        value, grads = jax.value_and_grad(fn)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return step


def stage_meshes(mesh: Mesh) -> list[Mesh]:
    """The mesh split along ``x``: each stage keeps the axis names, ``x`` of size 1."""
    return [Mesh(mesh.devices[i:i + 1], mesh.axis_names, axis_types=mesh.axis_types) for i in range(2)]


def registrations(mesh: Mesh, by: str, stages: list[Mesh] | None = None) -> list:
    stages = stages or stage_meshes(mesh)
    if by == "scope":
        return [register_task(f"layer{i}", mesh=m, name=f"stage{i}") for i, m in enumerate(stages)]
    return [register_task(params=rf"layers\.{i}", mesh=m, name=f"stage{i}") for i, m in enumerate(stages)]


def reference(axis_type: AxisType, form: str, spec: P = SPEC, names=("x", "y", "z")) -> tuple[list, dict]:
    """Losses and the final state of STEPS steps on one device (the model's mesh 1x1x1)."""
    one = model_mesh(axis_type, (1,) * len(names), names)
    step = jax.jit(make_step(one, form, False, None, spec))
    with jax.set_mesh(one):
        state, batch = jax.device_put((init(), get_batch()), jax.sharding.NamedSharding(one, P()))
        losses = []
        for _ in range(STEPS):
            value, state = step(state, batch)
            losses.append(float(value))
    return losses, jax.device_get(state)


def pipelined(axis_type: AxisType, form: str, by: str, spec: P = SPEC,
              stages: list[Mesh] | None = None, mesh: Mesh | None = None) -> tuple[list, dict, dict]:
    mesh = mesh or model_mesh(axis_type)
    regs = registrations(mesh, by, stages)
    with regs[0], regs[1]:
        step_fn, init_fn, batch_fn = parallelize(make_step(mesh, form, by == "scope", BATCH // MICRO, spec),
                                                 init_params=init, get_input_batch=get_batch, mesh=mesh)
    assert step_fn.plan.schedule.num_stages == 2
    state, batch = init_fn(), batch_fn()
    losses = []
    for _ in range(STEPS):
        value, state = step_fn(state, batch)
        losses.append(float(value))
    return losses, state, {i: set(m.devices.flat) for i, m in enumerate(stage_meshes(mesh))}


CASES = [(t, form, by) for t in (AxisType.Explicit, AxisType.Auto) for form in list(FORMS)[:4]
         for by in ("scope", "params")]


@pytest.mark.parametrize("axis_type,form,by", CASES, ids=[f"{t.name}-{f}-{b}" for t, f, b in CASES])
def test_shard_map_in_a_stage_equals_one_device(axis_type, form, by):
    want_losses, want = reference(axis_type, form)
    losses, state, devices = pipelined(axis_type, form, by)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for i, layer in enumerate(state["params"]["layers"]):   # each layer's weights on its stage's devices
        assert layer["w"].sharding.device_set == devices[i]


NESTED = [pytest.param(t, form, id=f"{t.name}-{form}")
          for t in (AxisType.Explicit, AxisType.Auto) for form in ("jit in the body", "remat around")]


@pytest.mark.parametrize("axis_type,form", NESTED)
def test_calls_inside_and_around_the_shard_map(axis_type, form):
    """Stages by ``params=``: a jit inside the body (inlined where the body moves onto a submesh of another
    shape), a ``jax.checkpoint`` around the shard_map (its body traced again on the stage)."""
    want_losses, want = reference(axis_type, form)
    losses, state, _ = pipelined(axis_type, form, "params")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


LACKING = [(AxisType.Explicit, "experimental", "params"), (AxisType.Explicit, "jax.shard_map", "scope"),
           (AxisType.Auto, "experimental", "scope"), (AxisType.Auto, "jax.shard_map", "params")]


@pytest.mark.parametrize("axis_type,form,by", LACKING, ids=[f"{t.name}-{f}-{b}" for t, f, b in LACKING])
def test_a_stage_without_an_axis_no_spec_names_equals_one_device(axis_type, form, by):
    """Stages of axes ``y, z`` only, the specs naming those: the shard_map is manual over the stage's axes
    (the experimental form names every axis of the model's mesh manual), and the result is one device's."""
    mesh = model_mesh(axis_type)
    stages = [Mesh(mesh.devices[i], ("y", "z"), axis_types=mesh.axis_types[1:]) for i in range(2)]
    want_losses, want = reference(axis_type, form)
    losses, state, _ = pipelined(axis_type, form, by, SPEC, stages)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("by", ["scope", "params"])
def test_a_stage_lacking_an_axis_the_specs_name_is_refused(by):
    """Stages of axes ``y, z`` only: specs naming ``x`` are refused, naming the function, the stage and the
    axis, and how to keep it."""
    mesh = model_mesh(AxisType.Auto)
    stages = [Mesh(mesh.devices[i], ("y", "z")) for i in range(2)]
    with pytest.raises(ValueError) as caught:
        pipelined(AxisType.Auto, "jax.shard_map", by, P("x", "z"), stages)
    message = str(caught.value)
    assert "shard_map of 'rms_norm'" in message and "'x'" in message and "mesh_slice" in message, message
    assert re.search(r"stage stage[01] on \{'y': 2, 'z': 2\} devices", message), message


def test_an_axis_the_stages_split_keeps_its_meaning_by_scope():
    """Specs naming ``x``, the axis the stages split (size 1 on each): traced on the stage, the batch is not
    split there, and the result is one device's."""
    spec = P("x", "z")
    want_losses, want = reference(AxisType.Auto, "jax.shard_map", spec)
    losses, state, _ = pipelined(AxisType.Auto, "jax.shard_map", "scope", spec)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", ["jax.shard_map", "module jit around"])
def test_an_axis_the_stages_split_keeps_its_meaning_by_params(form):
    """Specs naming ``x``, the axis the stages split, stages by ``params=`` on Auto axes (known only after the
    first trace, which traced the body for ``x`` of size 2): the step is traced again on the stages' shape,
    the body for ``x`` of size 1 (inside a jit defined once too, whose first trace JAX has cached), and the
    result is one device's."""
    spec = P("x", "z")
    want_losses, want = reference(AxisType.Auto, form, spec)
    losses, state, devices = pipelined(AxisType.Auto, form, "params", spec)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for i, layer in enumerate(state["params"]["layers"]):
        assert layer["w"].sharding.device_set == devices[i]


def test_an_axis_of_another_size_on_stages_of_different_shapes_is_refused():
    """Stages by ``params=`` of two shapes (``{x: 1, y: 2, z: 2}`` and ``{x: 1, y: 4, z: 1}``): the step cannot
    be traced again on one shape, and the body, traced for ``x`` of size 2, cannot run where it has size 1;
    the error says so and names the ways that work."""
    mesh = model_mesh(AxisType.Auto)
    stages = [Mesh(mesh.devices[0:1], mesh.axis_names), Mesh(mesh.devices[1].reshape(1, 4, 1), mesh.axis_names)]
    with pytest.raises(ValueError, match=r"shard_map of 'rms_norm'.*'x': 2 -> 1.*one submesh shape"):
        pipelined(AxisType.Auto, "jax.shard_map", "params", P("x", "z"), stages)


# ----------------------------------------------------------------- Flax NNX: stages by attribute path
class NnxLayer(nnx.Module):
    def __init__(self, mesh: Mesh, rngs: nnx.Rngs):
        self.mesh = mesh
        self.w = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(jax.shard_map(rms_norm, mesh=self.mesh, in_specs=SPEC, out_specs=SPEC)(self.w(x)))


class NnxNet(nnx.Module):
    """layers.0, layers.1: no scope of its own; multimesh names its submodules by attribute path."""

    def __init__(self, mesh: Mesh, rngs: nnx.Rngs):
        self.layers = nnx.List([NnxLayer(mesh, rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def nnx_program(mesh: Mesh, microbatches: int | None) -> tuple[Callable, Callable]:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: NnxNet(mesh, nnx.Rngs(0))), nnx.Param)

    def init():
        params = nnx.state(NnxNet(mesh, nnx.Rngs(0)), nnx.Param)
        return {"params": params, "opt": TX.init(params)}

    def loss(params, batch):
        return jnp.sum(nnx.merge(graphdef, params)(batch["x"]) ** 2) / BATCH

    def step(state, batch):
        fn = loss if microbatches is None else microbatch(loss, 0, BATCH // microbatches, argnum=1, schedule="1f1b")
        value, grads = jax.value_and_grad(fn)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return init, step


def test_shard_map_in_nnx_stages_by_attribute_path_equals_one_device():
    one = model_mesh(AxisType.Auto, (1, 1, 1))
    init, step = nnx_program(one, None)
    state, batch = jax.device_put((init(), get_batch()), jax.devices()[0])
    run, want_losses = jax.jit(step), []
    for _ in range(STEPS):
        value, state = run(state, batch)
        want_losses.append(float(value))
    mesh = model_mesh(AxisType.Auto)
    stages = stage_meshes(mesh)
    init, step = nnx_program(mesh, BATCH // MICRO)
    with register_task(r"layers\.0", mesh=stages[0]), register_task(r"layers\.1", mesh=stages[1]):
        step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=mesh)
    got, batch, losses = init_fn(), batch_fn(), []
    for _ in range(STEPS):
        value, got = step_fn(got, batch)
        losses.append(float(value))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(jax.device_get(state))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for i in range(2):
        assert got["params"]["layers"][i]["w"]["kernel"][...].sharding.device_set == set(stages[i].devices.flat)


def rms_norm_over_e(h: jax.Array) -> jax.Array:
    """`rms_norm` summed over ``z`` and the size-1 axis ``e`` (an expert axis of one expert), adding its
    ``axis_index`` (0)."""
    total = jax.lax.psum(jnp.sum(h * h, axis=-1, keepdims=True), ("z", "e"))
    return h * jax.lax.rsqrt(total / WIDTH + 1e-6) + jax.lax.axis_index("e")


FORMS["over e"] = lambda f, mesh, spec: jax.shard_map(rms_norm_over_e, mesh=mesh, in_specs=spec, out_specs=spec)
NAMES_E, SPEC_E = ("x", "y", "z", "e"), P("y", ("z", "e"))
DROPPED = [(AxisType.Auto, "scope"), (AxisType.Auto, "params")]


@pytest.mark.parametrize("axis_type,by", DROPPED, ids=[f"{t.name}-{b}" for t, b in DROPPED])
def test_a_size_one_axis_the_stage_lacks_is_dropped_with_a_warning(axis_type, by, monkeypatch):
    """The model's mesh ``{x: 2, y: 2, z: 2, e: 1}``, the specs and the psum naming ``e``; stages of ``x, y, z``
    lack it: it is dropped (a psum over a size-1 axis is the identity), warned about once per function and
    stage, and the result is one device's."""
    mesh = model_mesh(axis_type, (2, 2, 2, 1), NAMES_E)
    stages = [Mesh(mesh.devices[i:i + 1, :, :, 0], ("x", "y", "z"), axis_types=mesh.axis_types[:3]) for i in range(2)]
    want_losses, want = reference(axis_type, "over e", SPEC_E, NAMES_E)
    monkeypatch.setattr(stage_shard_map, "_WARNED", set())   # warned once per process: not by an earlier test
    with pytest.warns(mmj.StageAxisDropped) as caught:
        losses, state, _ = pipelined(axis_type, "over e", by, SPEC_E, stages, mesh)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    messages = [str(w.message) for w in caught if w.category is mmj.StageAxisDropped]
    assert all("shard_map of 'rms_norm_over_e'" in m and "axis 'e' of size 1" in m for m in messages), messages
    per_stage = [sum(bool(re.search(rf"stage stage{i} on \{{'x': 1, 'y': 2, 'z': 2\}}", m)) for m in messages)
                 for i in range(2)]
    # once per function and stage: by scope each layer's shard_map runs on its stage; by params= the step is
    # traced again on the stages' one shape (the first stage's submesh), then each program is bound on its stage
    assert per_stage == [1, 1], messages


def test_an_axis_the_stage_lacks_of_size_above_one_is_still_refused():
    """The same model on ``{x: 2, y: 2, z: 1, e: 2}``: ``e`` has size 2, so leaving it out would change the
    sum; it is refused, naming it."""
    mesh = model_mesh(AxisType.Auto, (2, 2, 1, 2), NAMES_E)
    stages = [Mesh(mesh.devices[i:i + 1, :, :, 0], ("x", "y", "z")) for i in range(2)]
    with pytest.raises(mmj.StageAxisError, match=r"shard_map of 'rms_norm_over_e'.*'e' \(size 2 on its own mesh\)"):
        pipelined(AxisType.Auto, "over e", "scope", SPEC_E, stages, mesh)
