"""MultiMesh compatibility of `task`, `parallelize` and `ignore_transforms`.

Numbers are checked against the same function run on one device.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.jax import (
    Task,
    TaskMesh,
    ignore_transforms,
    parallelize,
    task,
    with_sharding_constraint,
)

pytestmark = pytest.mark.devices(8)


# -- 5: ignore_transforms(ignore=True) -----------------------------------------------


def test_ignore_transforms_takes_ignore():
    f = task(lambda x: x * 2, "double", devices=jax.devices()[4:])
    x = jnp.arange(8.0)
    with ignore_transforms(True):
        assert f(x).sharding.device_set == {jax.devices()[0]}  # ran as plain JAX
        with ignore_transforms(False):
            assert f(x).sharding.device_set == set(jax.devices()[4:])
    with ignore_transforms(ignore=False):
        assert f(x).sharding.device_set == set(jax.devices()[4:])


# -- 6: task(SomePlainClass) ------------------------------------------------------------


class Affine:
    """A plain class: an instance's ``__call__`` is the task."""

    def __init__(self, scale):
        self.scale = scale

    def __call__(self, x, y):
        return jnp.tanh(x * self.scale) + y


def test_a_plain_class_runs_as_a_task_eagerly_and_under_jit_and_grad():
    devs = jax.devices()
    Placed = task(Affine, "affine", devices=[4, 5, 6, 7])
    obj = Placed(3.0)
    assert isinstance(obj, Affine) and Placed.__name__ == "Affine"
    x, y = jnp.linspace(-1, 1, 8), jnp.ones(8)
    got = obj(x, y)
    np.testing.assert_allclose(got, Affine(3.0)(x, y), rtol=1e-6)
    assert got.sharding.device_set == set(devs[4:])

    def loss(x):
        return jnp.sum(obj(x, y) ** 2)

    g = jax.jit(jax.grad(loss))(x)
    with ignore_transforms():
        want = jax.jit(jax.grad(loss))(x)
    np.testing.assert_allclose(g, want, rtol=1e-6)
    fn, get = parallelize(lambda b: loss(b["x"]), get_input_batch=lambda: {"x": x})
    assert fn.plan.placements[0].name == "affine"
    np.testing.assert_allclose(fn(get()), loss(x), rtol=1e-6)


def test_a_class_without_call_or_a_linen_module_is_refused():
    class NoCall:
        pass

    with pytest.raises(TypeError, match=r"task\(NoCall\): the class has no __call__"):
        task(NoCall)
    import flax.linen as nn

    with pytest.raises(TypeError, match=r"task\(Dense\): a Flax Linen Module class runs as a task through "
                                        r"multimesh.jax.flax.task"):
        task(nn.Dense)


# -- 4: parallelize without init_params -------------------------------------------------------


def test_parallelize_without_init_params_calls_fun_of_the_batch():
    w = jnp.arange(32.0).reshape(8, 4) / 10

    def f(batch):
        return jnp.tanh(batch["x"] @ w).sum(axis=1)

    def get():
        return {"x": jnp.arange(64.0).reshape(16, 4).T.reshape(16, 4) / 50}

    fn, get_b = parallelize(lambda b: f({"x": b["x"] @ w.T}), get_input_batch=get,
                            mesh={"data": 8}, rules=[("batch", "data")])
    b = get_b()
    assert b["x"].sharding.spec == P("data") and b["x"].sharding.device_set == set(jax.devices())
    np.testing.assert_allclose(fn(b), f({"x": get()["x"] @ w.T}), rtol=1e-6)
    assert fn.batch_shardings["x"].spec == P("data")
    (fn2,) = parallelize(f, initial_batch={"x": np.ones((16, 8), np.float32)}, mesh={"data": 8},
                         rules=[("batch", "data")])
    np.testing.assert_allclose(fn2({"x": np.ones((16, 8), np.float32)}), f({"x": jnp.ones((16, 8))}), rtol=1e-6)


def test_parallelize_without_any_batch_is_a_clear_error():
    with pytest.raises(TypeError, match=r"parallelize needs get_input_batch= .* or initial_batch= .*, and "
                                        r"init_params= when fun takes parameters"):
        parallelize(lambda b: b)


# -- 10 and 8: the v0.2 forms: task=Task(...), mesh=TaskMesh(...), out_shardings, configure ------------


def test_task_takes_a_task_mesh_and_out_shardings():
    devs = jax.devices()
    mesh = TaskMesh(devices=(4, 5, 6, 7), axis_sizes=(2, 2), axis_names=("x", "y"))

    def f(a):
        return a * 2, a + 1

    t = task(f, mesh=mesh, logical_axes=[("rows", "x"), ("cols", "y")], out_shardings=(P("rows", "cols"), P()))
    a = jnp.arange(32.0).reshape(8, 4)
    u, v = t(a)
    np.testing.assert_allclose(u, a * 2)
    assert u.sharding.spec == P("x", "y") and u.sharding.device_set == set(devs[4:])
    assert v.sharding.spec == P() and v.sharding.device_set == set(devs[4:])
    assert t.placement.name == "f" and dict(t.placement.mesh.shape) == {"x": 2, "y": 2}
    same = task(f, task=Task(mesh=mesh, logical_axes=[("rows", "x")], name="g"))
    assert same.placement.name == "g" and same.placement.devices == frozenset(devs[4:])
    named = task(f, out_shardings=NamedSharding(t.placement.mesh, P(None, "y")), mesh=mesh)
    assert named(a)[0].sharding.spec == P(None, "y")


def test_a_task_with_no_mesh_spans_all_devices_on_axis_x():
    t = task(lambda a: with_sharding_constraint(a, P("x")), task=Task())
    assert t.placement.mesh.axis_names == ("x",) and t.placement.mesh.size == 8
    assert t(jnp.arange(16.0)).sharding.spec == P("x")


def test_configure_is_entered_while_the_task_runs():
    seen = []

    @contextlib.contextmanager
    def precision(level, note=""):
        seen.append(("enter", level, note))
        with jax.default_matmul_precision(level):
            yield
        seen.append(("exit", level, note))

    t = task(lambda a: a @ a, devices=[0, 1], configure=precision, configure_args={"level": "float32", "note": "n"})
    a = jnp.eye(4)
    np.testing.assert_allclose(t(a), a)
    assert seen == [("enter", "float32", "n"), ("exit", "float32", "n")]
    t2 = task(lambda a: a + 1, devices=[0], configure=precision, configure_args=("highest",))
    t2(a)
    assert seen[-1] == ("exit", "highest", "")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"task": Task(), "devices": [0]}, ValueError, r"task= says where the task runs; give it alone"),
    ({"mesh": TaskMesh(devices=(0, 1)), "devices": [0, 1]}, ValueError, r"devices=/device_axes= do not combine"),
    ({"configure_args": 1}, ValueError, r"configure_args= without configure="),
    ({"configure": 3}, TypeError, r"configure must be a function returning a context manager"),
    ({"task": "stage0"}, TypeError, r"task= must be a multimesh Task"),
])
def test_task_misuse(kwargs, error, message):
    with pytest.raises(error, match=message):
        task(lambda a: a, "t", **kwargs)


def test_out_shardings_that_do_not_fit_the_outputs():
    t = task(lambda a: (a, a), devices=[0, 1], out_shardings=(P(), P(), P()))
    with pytest.raises(ValueError, match=r"task '<lambda>': out_shardings must be a prefix of the outputs' tree"):
        t(jnp.ones(4))


def test_task_mesh_and_task_validation():
    with pytest.raises(ValueError, match=r"axis_sizes=\(2, 2\) multiply to 4, but devices=\(0, 1, 2\) holds 3"):
        TaskMesh(devices=(0, 1, 2), axis_sizes=(2, 2), axis_names=("x", "y"))
    with pytest.raises(ValueError, match=r"axis_names=\('x',\) names 1 axes but axis_sizes=\(2, 2\) has 2"):
        TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("x",))
    with pytest.raises(ValueError, match=r"device numbers \[1\] appear more than once"):
        TaskMesh(devices=(1, 1))
    with pytest.raises(TypeError, match=r"a TaskMesh takes device numbers"):
        TaskMesh(devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"device numbers \[8, 9\] are out of range; jax.devices\(\) has 8"):
        TaskMesh(devices=(8, 9)).mesh()
    with pytest.raises(ValueError, match=r"give mesh= or mesh_slice=/loop_dependent_mesh_slice=, not both"):
        Task(mesh=TaskMesh(devices=(0,)), mesh_slice={"stage": 0})
    with pytest.raises(ValueError, match=r"split_backprop must be two distinct names"):
        Task(split_backprop=("b", "b"))
    with pytest.raises(ValueError, match=r"mesh_slice= slices the global mesh, and none is in force"):
        Task(mesh_slice={"stage": 0}).placement()
    m = TaskMesh(devices=(0, 1, 2, 3), axis_sizes=(2, 2), axis_names=("x", "y"))
    moved = m.place((4, 5, 6, 7))
    assert moved.devices == (4, 5, 6, 7) and moved.axis_names == ("x", "y") and moved.axis_sizes == (2, 2)
    assert m.abstract_mesh == jax.sharding.AbstractMesh((2, 2), ("x", "y"))
    assert TaskMesh(devices=(0, 1), abstract=m.abstract_mesh.update(axis_sizes=(1, 2))).shape == {"x": 1, "y": 2}


def test_flax_task_takes_the_v02_forms():
    import flax.linen as nn

    from multimesh.jax import flax as mmflax

    mesh = TaskMesh(devices=(4, 5, 6, 7), axis_sizes=(2, 2), axis_names=("x", "y"))
    Dense = mmflax.task(nn.Dense, task=Task(mesh=mesh, name="head"))
    assert Dense.placement.name == "head" and Dense.placement.devices == frozenset(jax.devices()[4:])
    Same = mmflax.task(nn.Dense, mesh=mesh, logical_axes=[("embed", "y")])
    assert Same.placement.spec(("embed",), (8,)) == P("y")
    assert mmflax.with_sharding_constraint is with_sharding_constraint
    with pytest.raises(ValueError, match=r"flax.task\(Dense\): task= says where the module runs; give it alone"):
        mmflax.task(nn.Dense, task=Task(mesh=mesh), devices=[0])


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")  # the reference's own form
def test_the_reference_docstring_examples():
    """`with_sharding_constraint`'s: arange(16) constrained to P("x") in a task on a 4-device mesh, run
    under ``with mesh, autoshard(True)``; `task`'s: a square with logical constraints on a 2x2 submesh."""
    from jax.sharding import Mesh

    from multimesh.jax import autoshard

    mesh = Mesh(np.asarray(jax.devices()[:4]), ("x",))

    def f():
        return with_sharding_constraint(jnp.arange(16), P("x"))

    with mesh, autoshard(True):
        out = jax.jit(task(f, mesh=mesh))()
    assert out.sharding.spec == P("x")
    assert sorted(s.data.tolist() for s in out.addressable_shards) == [list(range(4 * i, 4 * i + 4)) for i in range(4)]

    def square(x):
        x = with_sharding_constraint(x, P("batch", "model"))
        return with_sharding_constraint(x * x, P("batch", "model"))

    sq = task(square, devices=np.asarray(jax.devices()[:4]).reshape(2, 2), device_axes=("x", "y"),
              logical_axes=(("batch", "x"), ("model", "y")))
    x = jnp.arange(16.0).reshape(4, 4)
    got = jax.jit(sq)(x)
    np.testing.assert_allclose(got, x * x)
    assert got.sharding.spec == P("x", "y") and got.addressable_shards[0].data.shape == (2, 2)
