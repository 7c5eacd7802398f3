"""Models written in JAX's explicit-sharding style, unmodified, under `parallelize`.

`jax.make_mesh` makes Explicit axes. Code written for them passes
``out_sharding=`` to ops, calls `jax.sharding.reshard` and reads
``jax.typeof(x).sharding``: it needs its mesh in JAX's context, which
`parallelize` provides. Every result is compared with the same functions run
on one device (a 1x1 mesh of the same axis names in context).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from helpers import ATOL, RTOL
from multimesh.jax import (Task, ignore_transforms, microbatch, mjit, parallelize, register_task, task,
                           with_sharding_constraint)

STEPS = 3
TX = optax.adam(1e-2)


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (16, 32), out_sharding=P(None, "model")) * 0.2,
              "w2": jax.random.normal(k2, (32, 16), out_sharding=P("model", None)) * 0.2}
    return {"params": params, "opt": TX.init(params)}


def get_batch():
    x = jax.random.normal(jax.random.key(1), (16, 16))
    return {"x": x, "y": jnp.tanh(x)}


def model(p, x):
    h = jnp.dot(x, p["w1"], out_sharding=P("data", "model"))
    assert jax.typeof(h).sharding.spec == P("data", "model"), jax.typeof(h)
    out = jnp.dot(jax.nn.relu(h), p["w2"], out_sharding=P("data", None))
    return jax.sharding.reshard(out, P("data", None))


def step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((model(p, batch["x"]) - batch["y"]) ** 2))(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def one_device(step_fun=step, init_fun=init, axis_types=(AxisType.Explicit, AxisType.Explicit)):
    """Losses and final state of the same functions on device 0 (a 1x1 mesh with the same axis names)."""
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=axis_types, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        state, batch = jax.jit(init_fun)(), jax.jit(get_batch)()
        losses = []
        for _ in range(STEPS):
            loss, state = jax.jit(step_fun)(state, batch)
            losses.append(float(loss))
    return losses, state


def train(step_fn, state, batch):
    losses = []
    for _ in range(STEPS):
        loss, state = step_fn(state, batch)
        losses.append(float(loss))
    return losses, state


def assert_same(got, want):
    losses, state = got
    want_losses, want_state = want
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_an_explicit_sharding_model_runs_under_parallelize_and_keeps_its_own_shardings():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=mesh,
                                             rules=[("batch", "data")])
    state, batch = init_fn(), batch_fn()
    # the shardings the model's code gave its parameters, without restating them in param_rules
    assert state["params"]["w1"].sharding.spec == P(None, "model")
    assert state["params"]["w2"].sharding.spec == P("model", None)
    assert state["params"]["w1"].addressable_shards[0].data.shape == (16, 16)
    assert state["opt"][0].mu["w1"].sharding.spec == P(None, "model")  # the optimizer state follows
    assert batch["x"].sharding.spec == P("data") and batch["x"].addressable_shards[0].data.shape == (4, 16)
    sources = {leaf.path: leaf.source for leaf in step_fn.param_layout.leaves}
    assert sources["params/w1"] == "its own sharding"
    got = train(step_fn, state, batch)
    assert got[1]["params"]["w1"].sharding == state["params"]["w1"].sharding
    assert_same(got, one_device())


def test_logical_rules_and_explicit_shardings_mix_in_one_model():
    def init_mixed():
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {"w1": jax.random.normal(k1, (16, 32), out_sharding=P(None, "model")) * 0.2,
                  "w2": jax.random.normal(k2, (32, 16)) * 0.2}  # no sharding of its own: a path rule gives it
        return {"params": params, "opt": TX.init(params)}

    def step_mixed(state, batch, constrain=with_sharding_constraint):
        def loss_fn(p):
            h = jax.nn.relu(jnp.dot(batch["x"], p["w1"], out_sharding=P("data", "model")))
            h = constrain(h, P("batch", "hidden"))  # logical names, resolved by the rules
            assert jax.typeof(h).sharding.spec == P("data", "model")
            return jnp.mean((jnp.dot(h, p["w2"], out_sharding=P("data", None)) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    step_fn, init_fn, batch_fn = parallelize(step_mixed, init_params=init_mixed, get_input_batch=get_batch,
                                             mesh=mesh, rules=[("batch", "data"), ("hidden", "model")],
                                             param_rules={r"w2": ("hidden", None)})
    state = init_fn()
    assert state["params"]["w1"].sharding.spec == P(None, "model")
    assert state["params"]["w2"].sharding.spec == P("model", None)
    # the reference has no rules for the logical names: there the layout hint is left out (it changes no value)
    reference = functools.partial(step_mixed, constrain=lambda h, spec: h)
    assert_same(train(step_fn, state, batch_fn()), one_device(reference, init_mixed))


def test_a_mesh_of_mixed_axis_types_keeps_them():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))

    def init_auto_model():
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {"w1": jax.random.normal(k1, (16, 32)) * 0.2, "w2": jax.random.normal(k2, (32, 16)) * 0.2}
        return {"params": params, "opt": TX.init(params)}

    def step_mixed(state, batch, constrain=with_sharding_constraint):
        def loss_fn(p):
            h = jax.nn.relu(batch["x"] @ p["w1"])
            assert jax.typeof(h).sharding.spec == P(sharded, None)  # Explicit 'data' is in the type
            h = constrain(h, P("batch", "hidden"))  # Auto 'model' goes to the compiler
            return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    sharded = "data"
    step_fn, init_fn, batch_fn = parallelize(step_mixed, init_params=init_auto_model, get_input_batch=get_batch,
                                             mesh=mesh, rules=[("batch", "data"), ("hidden", "model")],
                                             param_rules={r"w1": (None, "hidden"), r"w2": ("hidden", None)})
    assert step_fn.mesh.axis_types == (AxisType.Explicit, AxisType.Auto)
    state = init_fn()
    assert state["params"]["w1"].sharding.spec == P(None, "model")
    got = train(step_fn, state, batch_fn())
    sharded = None  # on one device nothing is sharded, and there are no rules for the logical names
    reference = functools.partial(step_mixed, constrain=lambda h, spec: h)
    assert_same(got, one_device(reference, init_auto_model, axis_types=(AxisType.Explicit, AxisType.Auto)))


def test_a_mesh_shape_takes_the_axis_types_of_the_mesh_in_context():
    def mean_step(state, batch):
        assert jax.typeof(batch["x"]).sharding.spec == (P("data", None) if explicit else P(None, None))
        return jnp.mean(batch["x"]), state

    explicit = True
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):  # Explicit 'data'
        step_fn, _, batch_fn = parallelize(mean_step, init_params=dict, get_input_batch=get_batch,
                                           mesh={"data": 4, "model": 2}, rules=[("batch", "data")])
    assert step_fn.mesh.axis_types == (AxisType.Explicit, AxisType.Auto)
    batch = batch_fn()
    np.testing.assert_allclose(step_fn({}, batch)[0], np.mean(get_batch()["x"]), rtol=RTOL)
    explicit = False
    step_fn, _, batch_fn = parallelize(mean_step, init_params=dict, get_input_batch=get_batch,
                                       mesh={"data": 4, "model": 2}, rules=[("batch", "data")])
    assert step_fn.mesh.axis_types == (AxisType.Auto, AxisType.Auto)  # nothing in context: Auto, as before
    np.testing.assert_allclose(step_fn({}, batch_fn())[0], np.mean(get_batch()["x"]), rtol=RTOL)


def test_the_built_functions_run_under_a_mesh_the_caller_has_set():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=mesh,
                                             rules=[("batch", "data")])
    with jax.set_mesh(jax.make_mesh((8,), ("other",))):  # a different mesh in context
        state, batch = init_fn(), batch_fn()
        got = train(step_fn, state, batch)
    assert_same(got, one_device())


def test_a_pipeline_runs_under_a_mesh_the_caller_has_set():
    """Stage programs run on their submeshes, whatever mesh (over all devices) the caller put in context."""
    devices = np.asarray(jax.devices())

    def init_two():
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {"first": jax.random.normal(k1, (16, 16)) * 0.3, "second": jax.random.normal(k2, (16, 16)) * 0.3}
        return {"params": params, "opt": TX.init(params)}

    def step_two(state, batch):
        def loss_fn(p):
            with jax.named_scope("first"):
                h = jnp.tanh(batch["x"] @ p["first"])
            with jax.named_scope("second"):
                out = h @ p["second"]
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    with register_task("first", devices=devices[:4]), register_task("second", devices=devices[4:]):
        step_fn, init_fn, batch_fn = parallelize(step_two, init_params=init_two, get_input_batch=get_batch,
                                                 mesh={"data": 8}, rules=[("batch", "data")])
    assert len(step_fn.plan.placements) == 2
    user_mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(user_mesh):
        state, batch = init_fn(), batch_fn()
        got = train(step_fn, state, batch)
    assert {d.id for d in got[1]["params"]["first"].sharding.device_set} == {0, 1, 2, 3}
    assert {d.id for d in got[1]["params"]["second"].sharding.device_set} == {4, 5, 6, 7}
    assert_same(got, one_device(step_two, init_two, axis_types=(AxisType.Auto, AxisType.Auto)))


@pytest.mark.parametrize("how", [pytest.param("register_task", marks=pytest.mark.slow), "task", "microbatch"])
def test_an_explicit_sharding_model_as_a_two_stage_pipeline(how):
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
    stages = [jax.sharding.Mesh(mesh.devices[i], ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
              for i in range(2)]

    def init_two():
        k = jax.random.split(jax.random.key(0), 2)
        params = {f"l{i}": {"w1": jax.random.normal(k[i], (16, 32), out_sharding=P(None, "model")) * 0.2,
                            "w2": jax.random.normal(k[i], (32, 16), out_sharding=P("model", None)) * 0.2}
                  for i in range(2)}
        return {"params": params, "opt": TX.init(params)}

    def loss_fn(p, batch):
        if how == "task":
            h = task(model, "l0", mesh=stages[0])(p["l0"], batch["x"])
            out = task(model, "l1", mesh=stages[1])(p["l1"], h)
        else:
            with jax.named_scope("l0"):
                h = model(p["l0"], batch["x"])
            with jax.named_scope("l1"):
                out = model(p["l1"], h)
        return jnp.sum((out - batch["y"]) ** 2) / batch_size

    batch_size = get_batch()["x"].size

    def step_two(state, batch):
        loss = microbatch(loss_fn, 0, 8, argnum=1, schedule="1f1b") if how == "microbatch" else loss_fn
        loss, grads = jax.value_and_grad(loss)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    with register_task("l0", mesh=stages[0]), register_task("l1", mesh=stages[1]):
        step_fn, init_fn, batch_fn = parallelize(step_two, init_params=init_two, get_input_batch=get_batch,
                                                 mesh=mesh, rules=[("batch", "data")])
    assert len(step_fn.plan.placements) == 2
    state = init_fn()
    for i in range(2):
        w1 = state["params"][f"l{i}"]["w1"]
        assert w1.sharding.device_set == set(stages[i].devices.flat) and w1.sharding.spec == P(None, "model")
        assert w1.addressable_shards[0].data.shape == (16, 16)
    got = train(step_fn, state, batch_fn())
    for i in range(2):
        assert got[1]["params"][f"l{i}"]["w1"].sharding.device_set == set(stages[i].devices.flat)
    with ignore_transforms():
        want = one_device(step_two, init_two)
    assert_same(got, want)


def test_an_explicit_pipeline_needs_stages_of_one_shape():
    mesh = jax.make_mesh((8,), ("data",))
    devices = jax.devices()

    def step_two(params, batch):
        with jax.named_scope("a"):
            h = batch["x"] @ params["a"]
        with jax.named_scope("b"):
            return jnp.sum(h @ params["b"]), params

    with register_task("a", mesh=jax.make_mesh((4,), ("data",), devices=devices[:4])), \
            register_task("b", mesh=jax.make_mesh((2,), ("data",), devices=devices[4:6])):
        with pytest.raises(NotImplementedError, match=r"Explicit axes .* needs stages of one shape.*a: \{'data': 4\}.*refuses to combine values typed "
                                                 r"on different meshes"):
            parallelize(step_two, init_params=lambda: {"a": jnp.ones((16, 16)), "b": jnp.ones((16, 16))},
                        get_input_batch=get_batch, mesh=mesh, rules=[("batch", "data")])


def test_tasks_on_slices_of_an_explicit_mesh_with_logical_constraints_inside():
    """`Task(mesh_slice=...)` stages of the mesh in context (``jax.set_mesh``), each constraining its values
    with logical names: the constraints apply on the stages' mesh, where the step is traced again."""
    mesh = jax.make_mesh((2, 4), ("stage", "data"))

    def layer(w, x):
        h = with_sharding_constraint(jnp.tanh(jnp.dot(x, w, out_sharding=P("data", None))), P("batch", None))
        assert jax.typeof(h).sharding.spec == P("data", None)
        return h

    stages = [task(layer, task=Task(name=f"stage{i}", mesh_slice={"stage": i}, logical_axes=[("batch", "data")]))
              for i in range(2)]

    def init_two():
        k = jax.random.split(jax.random.key(0), 2)
        params = [jax.random.normal(k[i], (16, 16)) * 0.3 for i in range(2)]
        return {"params": params, "opt": TX.init(params)}

    def step_two(state, batch, run=lambda i, w, h: stages[i](w, h)):
        def loss_fn(p):
            h = batch["x"]
            for i in range(2):
                h = run(i, p[i], h)
            return jnp.mean((h - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    with jax.set_mesh(mesh):
        step_fn, init_fn, batch_fn = parallelize(step_two, init_params=init_two, get_input_batch=get_batch,
                                                 rules=[("batch", "data")])
        got = train(step_fn, init_fn(), batch_fn())
    assert [p.name for p in step_fn.plan.placements] == ["stage0", "stage1"]
    for i in range(2):
        assert got[1]["params"][i].sharding.device_set == set(mesh.devices[i].flat)

    def reference(state, batch):  # one device: no stages and no rules for the logical names
        with ignore_transforms():
            return step_two(state, batch, run=lambda i, w, h: jnp.tanh(jnp.dot(h, w, out_sharding=P("data", None))))

    assert_same(got, one_device(reference, init_two, axis_types=(AxisType.Explicit, AxisType.Explicit)))


def init_unplaced():
    """`init` without shardings of its own: the step's code alone names mesh axes."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.2, "w2": jax.random.normal(k2, (32, 16)) * 0.2}
    return {"params": params, "opt": TX.init(params)}


@pytest.mark.parametrize("init, refused", [(init, "not under a mesh context"),  # the initializer's out_sharding
                                           (init_unplaced, "of type Auto")])    # the step's out_sharding
def test_a_mesh_shape_with_explicit_sharding_code_says_to_pass_a_mesh_of_explicit_axes(init, refused):
    """``mesh={axis: size}`` makes Auto axes; this code needs Explicit ones: JAX's refusal becomes an error
    naming the mesh and the one to pass, and that one works."""
    with pytest.raises(ValueError, match=r"the mesh \{'data': 2, 'model': 4\} was made from an \{axis: size\} "
                                         r"shape, which gives Auto axes.*Pass a mesh of Explicit axes instead: "
                                         r"mesh=jax\.make_mesh\(\(2, 4\), \('data', 'model'\), "
                                         r"axis_types=\(AxisType\.Explicit,\) \* 2\)") as info:
        parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 2, "model": 4},
                    rules=[("batch", "data")])
    assert refused in str(info.value.__cause__)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=mesh,
                                             rules=[("batch", "data")])
    assert_same(train(step_fn, init_fn(), batch_fn()), one_device(init_fun=init))


@pytest.mark.parametrize("init", [init, init_unplaced])
def test_a_pipeline_without_a_mesh_names_the_default_mesh_and_says_to_pass_one(init):
    """The step is traced on the whole mesh before it is split over the stages: without ``mesh=`` that is the
    default 1-D ``{'data': 8}``, which lacks the axis 'model' the code names."""
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
    stages = [jax.sharding.Mesh(mesh.devices[i], ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
              for i in range(2)]

    def two_layers(state, batch):
        def loss_fn(p):
            with jax.named_scope("l0"):
                h = model(p, batch["x"])
            with jax.named_scope("l1"):
                return jnp.mean((model(p, h) - batch["y"]) ** 2)
        return jax.value_and_grad(loss_fn)(state["params"])

    with register_task("l0", mesh=stages[0]), register_task("l1", mesh=stages[1]):
        with pytest.raises(ValueError, match=r"the code names mesh axis 'model' \(P\(.*'model'\)\), "
                                             r"but the step is traced on parallelize's default mesh \{'data': 8\} "
                                             r"\(1-D over devices 0-7: no mesh= was given and no MultiMesh is in "
                                             r"force\).*Pass mesh= a mesh over those 8 devices with the axes the "
                                             r"code names \(.*'model'\)"):
            parallelize(two_layers, init_params=init, get_input_batch=get_batch, rules=[("batch", "data")])


def test_mjit_explains_a_mesh_axis_its_default_mesh_lacks():
    """mjit without a mesh traces on ``{'x': 8}``: code naming other axes gets the explanation parallelize gives,
    naming mjit and its default mesh; with a mesh of those axes it runs there, an argument made on one device
    included."""
    from jax.sharding import NamedSharding

    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, P("model"))

    x = jnp.arange(16.0)
    with pytest.raises(ValueError, match=r"mjit\(f\): the code names mesh axis 'model' .*traced on mjit\(f\)'s "
                                         r"default mesh \{'x': 8\} \(1-D over devices 0-7: no mesh= was given") as info:
        mjit(f)(x)
    assert "model" in str(info.value.__cause__)
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    for arg in (x, jax.device_put(x, NamedSharding(mesh, P()))):  # not committed to devices, and placed
        out = mjit(f, mesh=mesh)(arg)
        np.testing.assert_array_equal(out, 2 * np.arange(16.0))
        # as jax.jit under jax.set_mesh(mesh): the constraint's layout, not the one device x was made on
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 1), out.sharding
