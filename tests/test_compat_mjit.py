"""`mjit`: a `jax.jit`-like entry point over tasks on different submeshes.

Arguments come already sharded and keep their shardings (read where they
live, no copy to where they already are), donation included; numbers equal
the same function on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.jax import (
    MultiMesh,
    Task,
    ignore_transforms,
    mjit,
    task,
    with_sharding_constraint,
)

pytestmark = pytest.mark.devices(8)


def meshes():
    devs = np.asarray(jax.devices(), dtype=object)
    return Mesh(devs[:4].reshape(2, 2), ("x", "y")), Mesh(devs[4:].reshape(2, 2), ("x", "y"))


def two_stages():
    first, second = meshes()
    rules = [("batch", "x"), ("hidden", "y")]
    t1 = task(lambda a, w: with_sharding_constraint(jnp.tanh(a @ w), P("batch", "hidden")), "first", mesh=first,
              logical_axes=rules)
    t2 = task(lambda h, v: jnp.sum((h @ v) ** 2), "second", mesh=second, logical_axes=rules)

    def f(a, w, v):
        return t2(t1(a, w), v)

    return f, first, second


def inputs(first, second):
    a = np.linspace(-1, 1, 8 * 16, dtype=np.float32).reshape(8, 16)
    w = np.cos(np.arange(16 * 32, dtype=np.float32)).reshape(16, 32) / 4
    v = np.sin(np.arange(32 * 4, dtype=np.float32)).reshape(32, 4)
    return (jax.device_put(a, NamedSharding(first, P("x", None))), jax.device_put(w, NamedSharding(first, P(None, "y"))),
            jax.device_put(v, NamedSharding(second, P("y", None))), (a, w, v))


def one_device(f, *args):
    with ignore_transforms():
        return jax.jit(f)(*args)


def test_mjit_runs_tasks_on_their_submeshes_keeping_argument_shardings():
    f, first, second = two_stages()
    a, w, v, host = inputs(first, second)
    fn = mjit(f)
    out = fn(a, w, v)
    np.testing.assert_allclose(out, one_device(f, *host), rtol=1e-5)
    assert [p.name for p in fn.plan.placements] == ["first", "second"]
    # every argument is read where it lives: the only transfer is the activation between stages
    assert fn.stats.transfers == 1 and fn.stats.bytes_moved == 8 * 32 * 4
    assert out.sharding.device_set == set(second.devices.flat)
    assert a.sharding.spec == P("x", None) and not a.is_deleted()
    grad = mjit(jax.grad(f, argnums=(1, 2)))(a, w, v)
    want = one_device(jax.grad(f, argnums=(1, 2)), *host)
    for g, r in zip(grad, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    assert grad[0].sharding.device_set == set(first.devices.flat)
    assert grad[1].sharding.device_set == set(second.devices.flat)


def test_mjit_donates_sharded_arguments():
    f, first, second = two_stages()
    a, w, v, host = inputs(first, second)

    def update(w, v, a):
        gw, gv = jax.grad(f, argnums=(1, 2))(a, w, v)
        return w - 0.1 * gw, v - 0.1 * gv

    fn = mjit(update, donate_argnums=(0, 1))
    new_w, new_v = fn(w, v, a)
    assert w.is_deleted() and v.is_deleted() and not a.is_deleted()
    want_w, want_v = one_device(update, host[1], host[2], host[0])
    np.testing.assert_allclose(new_w, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_v, want_v, rtol=1e-5, atol=1e-6)
    assert new_w.sharding.device_set == set(first.devices.flat)
    # a second step reuses the compiled plan
    fn(new_w, new_v, a)
    assert len(fn._cache) == 1


def test_mjit_without_tasks_is_one_jit_that_keeps_shardings():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("data", "model")))
    fn = mjit(lambda x: (x * 2, x.sum()), out_shardings=(P("batch"), None), mesh=mesh, rules=[("batch", "data")])
    y, s = fn(x)
    np.testing.assert_allclose(y, np.asarray(x) * 2)
    assert float(s) == float(np.asarray(x).sum())
    assert y.sharding.spec == P("data") and len(fn.plan.placements) == 1
    donated = mjit(lambda x: x + 1, donate_argnums=0)
    out = donated(x)
    assert x.is_deleted() and out.sharding.spec == P("data", "model")


def test_mjit_in_shardings_and_a_multimesh():
    mm = MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    stage1 = task(lambda a: a * 3, task=Task(name="s1", mesh_slice={"stage": 1}, logical_axes=[("batch", "data")],
                                             ))
    with mm:
        fn = mjit(lambda a: stage1(a + 1) - 1, in_shardings=P("batch"), rules=[("batch", "data")])
        out = fn(np.ones((8, 2), np.float32))
    np.testing.assert_allclose(out, np.full((8, 2), 5.0))
    assert out.sharding.device_set == set(jax.devices()[4:])
    assert {p.name for p in fn.plan.placements} >= {"s1"}


def test_mjit_misuse():
    with pytest.raises(TypeError, match="mjit needs a function"):
        mjit(3)
    with pytest.raises(ValueError, match=r"donate_argnums names argument 2, but the call has 1 positional"):
        mjit(lambda x: x, donate_argnums=2)(jnp.ones(2))
    with pytest.raises(ValueError, match=r"in_shardings must be a prefix of the arguments' tree"):
        mjit(lambda x: x, in_shardings=(P(), P()))(jnp.ones(2))
