"""`mjit` steps have estimates too: from arrays or abstract arguments, nothing run, the argument shards'
bytes exact per device, the programs of each submesh, the copy between them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.jax import mjit, task, with_sharding_constraint

pytestmark = pytest.mark.devices(8)


def two_stages():
    devs = np.asarray(jax.devices(), dtype=object)
    first, second = Mesh(devs[:4].reshape(2, 2), ("x", "y")), Mesh(devs[4:].reshape(2, 2), ("x", "y"))
    rules = [("batch", "x"), ("hidden", "y")]
    t1 = task(lambda a, w: with_sharding_constraint(jnp.tanh(a @ w), P("batch", "hidden")), "first", mesh=first,
              logical_axes=rules)
    t2 = task(lambda h, v: jnp.sum((h @ v) ** 2), "second", mesh=second, logical_axes=rules)
    return (lambda a, w, v: t2(t1(a, w), v)), first, second


def abstract(first, second):
    return (jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(first, P("x", None))),
            jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(first, P(None, "y"))),
            jax.ShapeDtypeStruct((32, 4), jnp.float32, sharding=NamedSharding(second, P("y", None))))


def test_an_mpmd_mjit_is_estimated_from_abstract_arguments_without_running():
    f, first, second = two_stages()
    fn = mjit(f)
    est = fn.estimate(*abstract(first, second), profile="h100-sxm")
    assert fn.stats is None  # nothing ran
    a_w = (8 * 16 // 2 + 16 * 32 // 2) * 4  # a split over x, w over y: half of each per device
    v = 32 * 4 // 2 * 4
    assert {d: m.params for d, m in est.memory.items()} == {**{i: a_w for i in range(4)}, **{i: v for i in range(4, 8)}}
    assert {m.stage for m in est.memory.values()} == {"first", "second"}
    assert sum(size for *_, size in est.transfers) == 8 * 32 * 4  # the activation between the submeshes
    assert est.time is not None and est.time.total > 0
    # the same call with arrays: the same estimate, and the call then runs with the plan it built
    arrays = [jax.device_put(np.ones(s.shape, np.float32), s.sharding) for s in abstract(first, second)]
    again = fn.estimate(*arrays, profile="h100-sxm")
    assert again.memory == est.memory and again.time.total == est.time.total
    np.testing.assert_allclose(fn(*arrays), jnp.sum((jnp.tanh(np.ones((8, 16)) @ np.ones((16, 32))) @ np.ones((32, 4))) ** 2),
                               rtol=1e-5)


def test_an_spmd_mjit_counts_its_program_and_arguments():
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("x", "y"))
    fn = mjit(lambda a, w: jnp.sum(jnp.tanh(a @ w)), mesh=mesh)
    a = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "y")))
    est = fn.estimate(a, w)
    assert est.memory[0].params == (64 * 32 // 4 + 32 * 16 // 2) * 4
    (program,) = est.programs
    assert program.flops >= 2 * 64 * 32 * 16 / 8


def test_an_argument_without_a_sharding_is_named():
    f, first, second = two_stages()
    a, w, v = abstract(first, second)
    with pytest.raises(TypeError, match=r"args\[1\] has no sharding.*ShapeDtypeStruct"):
        mjit(f).estimate(a, jax.ShapeDtypeStruct(w.shape, w.dtype), v)
