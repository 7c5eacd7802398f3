"""`with_sharding_constraint` with logical names, and `shard_map` in both signatures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import norm_spec
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.jax import build_mesh, parallelize, shard_map, with_sharding_constraint

pytestmark = pytest.mark.devices(8)

MESH = {"data": 4, "model": 2}
RULES = [("batch", "data"), ("mlp", "model")]

def _x(shape, seed=0):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


# ----------------------------------------------------------------------------
# with_sharding_constraint inside parallelize
# ----------------------------------------------------------------------------


def _activations(p, b):
    h = with_sharding_constraint(b["x"] @ p["w"], P("batch", "mlp"))  # (32, 64): resolves to ('data', 'model')
    odd = with_sharding_constraint(b["x"] @ p["w3"], P("batch", "mlp"))  # (32, 3): 'model' does not divide 3
    tree = with_sharding_constraint({"a": h, "b": odd}, {"a": P(None, "mlp"), "b": P("batch")})
    return jnp.sum(h) + jnp.sum(odd), h, odd, tree


@pytest.fixture(scope="module")
def activations():
    params = {"w": _x((16, 64), 1), "w3": _x((16, 3), 2)}
    batch = {"x": _x((32, 16), 3)}
    fun, init = parallelize(
        _activations, init_params=lambda: {k: jnp.asarray(v) for k, v in params.items()}, initial_batch=batch,
        mesh=MESH, rules=RULES,
    )
    return fun, init(), batch, params


def test_logical_constraint_shards_activation(activations):
    fun, p, batch, params = activations
    loss, h, odd, tree = fun(p, batch)
    assert norm_spec(h.sharding.spec) == ("data", "model")
    assert h.addressable_shards[0].data.shape == (8, 32)
    # a mesh axis that does not divide the dimension is skipped (non-strict)
    assert norm_spec(odd.sharding.spec) == ("data",)
    # a pytree of specs
    assert norm_spec(tree["a"].sharding.spec) == (None, "model")
    assert norm_spec(tree["b"].sharding.spec) == ("data",)
    # same values as the plain computation
    want = _activations(params, batch)
    np.testing.assert_allclose(float(loss), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(h), np.asarray(want[1]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(odd), np.asarray(want[2]), rtol=1e-5, atol=1e-6)


def test_logical_constraint_in_lowered_text(activations):
    fun, p, batch, _ = activations
    text = fun.lower(p, batch).as_text()
    constraints = [line for line in text.splitlines() if "sharding_constraint" in line or "@Sharding" in line]
    assert any('[{"data"}, {"model"}]' in line and "32x64" in line for line in constraints), constraints
    assert any('[{"data"}, {}]' in line and "32x3" in line for line in constraints), constraints
    # logical names never reach the compiler
    assert "batch" not in "\n".join(constraints) and "mlp" not in "\n".join(constraints)


def _constrained_params(p, b):
    w = with_sharding_constraint(p["w"], P("embed", "mlp"))  # embed has no rule: (None, 'model')
    v = jax.checkpoint(lambda v: with_sharding_constraint(v, P("mlp", None)))(p["v"])  # inside a nested call
    return jnp.sum((b["x"] @ w) @ v)


def test_constraint_on_param_input_determines_its_sharding():
    params = {"w": _x((16, 64), 1), "v": _x((64, 8), 2), "free": _x((8, 8), 3)}
    batch = {"x": _x((32, 16), 4)}
    fun, init = parallelize(
        _constrained_params, init_params=lambda: {k: jnp.asarray(v) for k, v in params.items()},
        initial_batch=batch, mesh=MESH, rules=RULES,
    )
    specs = {k: norm_spec(s.spec) for k, s in fun.param_shardings.items()}
    assert specs == {"w": (None, "model"), "v": ("model",), "free": ()}
    p = init()
    assert norm_spec(p["w"].sharding.spec) == (None, "model")
    assert p["w"].addressable_shards[0].data.shape == (16, 32)
    assert norm_spec(p["v"].sharding.spec) == ("model",)
    np.testing.assert_allclose(float(fun(p, batch)), float(_constrained_params(params, batch)), rtol=1e-5)


def test_constraint_on_batch_input_determines_batch_sharding():
    def fun(p, b):
        x = with_sharding_constraint(b["x"], P(None, "mlp"))  # overrides the default ("batch",)
        return jnp.sum(x @ p["w"])

    fun_, _ = parallelize(
        fun, init_params=lambda: {"w": jnp.ones((16, 4))}, initial_batch={"x": np.ones((8, 16), np.float32)},
        mesh=MESH, rules=RULES,
    )
    assert norm_spec(fun_.batch_shardings["x"].spec) == (None, "model")


def test_output_constraint_not_overridden_by_param_of_same_shape():
    def fun(p, b):
        h = with_sharding_constraint(b["x"] @ p["w"], P("batch", None))  # (16, 16), like w
        return jnp.sum(h), h

    fun_, init = parallelize(
        fun, init_params=lambda: {"w": jnp.ones((16, 16))}, initial_batch={"x": np.ones((16, 16), np.float32)},
        mesh=MESH, rules=RULES, param_rules={"w": P(None, "model")},
    )
    params = init()
    _, h = fun_(params, {"x": np.ones((16, 16), np.float32)})
    assert norm_spec(params["w"].sharding.spec) == (None, "model")
    assert norm_spec(h.sharding.spec) == ("data",)


def test_lone_param_tree_output_keeps_its_sharding():
    """A step whose params are one array still gets the new array back in the param's sharding."""
    fun_, init = parallelize(
        lambda w, b: jnp.zeros((16, 16)) + jnp.mean(b["x"]), init_params=lambda: jnp.ones((16, 16)),
        initial_batch={"x": np.ones((16, 16), np.float32)}, mesh=MESH, rules=RULES,
        param_rules={"": P(None, "model")},
    )
    w = init()
    new = fun_(w, {"x": np.ones((16, 16), np.float32)})
    assert norm_spec(w.sharding.spec) == (None, "model")
    assert new.sharding == w.sharding


# ----------------------------------------------------------------------------
# with_sharding_constraint outside parallelize
# ----------------------------------------------------------------------------


def test_no_scope_no_mesh_leaves_array_unchanged():
    x = jnp.arange(32.0).reshape(8, 4)
    assert with_sharding_constraint(x, P("batch", "mlp")) is x
    tree = {"a": x, "b": x + 1}
    out = with_sharding_constraint(tree, {"a": P("batch"), "b": P(None, "mlp")})
    assert out["a"] is x and out["b"] is tree["b"]
    # under a plain jit (the one-device reference): same values, one device
    y = jax.jit(lambda x: with_sharding_constraint(x * 2, P("batch", "mlp")))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x * 2))
    assert len(y.sharding.device_set) == 1


def test_named_sharding_behaves_as_lax():
    mesh = build_mesh(MESH)
    x = jnp.asarray(_x((16, 8)))
    ns = NamedSharding(mesh, P("data", "model"))
    # eager
    got, want = with_sharding_constraint(x, ns), jax.lax.with_sharding_constraint(x, ns)
    assert got.sharding == want.sharding == ns
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # under jit
    got = jax.jit(lambda x: with_sharding_constraint(x * 2, ns))(x)
    want = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, ns))(x)
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # inside parallelize a NamedSharding is used as is, not resolved by the rules
    other = NamedSharding(mesh, P("model", "data"))
    fun, init = parallelize(
        lambda p, b: (jnp.sum(b["x"]), with_sharding_constraint(b["x"] * p["s"], other)),
        init_params=lambda: {"s": jnp.ones(())}, initial_batch={"x": np.asarray(x)}, mesh=mesh, rules=RULES,
    )
    _, h = fun(init(), {"x": np.asarray(x)})
    assert norm_spec(h.sharding.spec) == ("model", "data")


def test_mesh_in_context_without_rules_behaves_as_lax():
    mesh = build_mesh(MESH)
    x = jnp.asarray(_x((16, 8)))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda x: with_sharding_constraint(x + 1, P("data", "model")))(x)
        want = jax.jit(lambda x: jax.lax.with_sharding_constraint(x + 1, P("data", "model")))(x)
    assert norm_spec(got.sharding.spec) == norm_spec(want.sharding.spec) == ("data", "model")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------
# shard_map
# ----------------------------------------------------------------------------


def test_shard_map_new_signature_takes_scope_mesh_and_logical_specs():
    def fun(p, b):
        def local(x, w):
            rows = x @ w  # this device's rows
            return rows, jax.lax.psum(jnp.sum(rows), "data")

        rows, total = shard_map(local, in_specs=(P("batch"), P()), out_specs=(P("batch"), P()))(b["x"], p["w"])
        return total, rows

    params = {"w": _x((16, 4), 1)}
    batch = {"x": _x((32, 16), 2)}
    sharded, init = parallelize(
        fun, init_params=lambda: {"w": jnp.asarray(params["w"])}, initial_batch=batch, mesh=MESH, rules=RULES
    )
    total, rows = sharded(init(), batch)
    want = batch["x"] @ params["w"]
    np.testing.assert_allclose(np.asarray(rows), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(total), want.sum(), rtol=1e-5, atol=1e-4)
    assert norm_spec(rows.sharding.spec) == ("data",)


def test_shard_map_new_signature_under_set_mesh():
    mesh = build_mesh(MESH)
    x = _x((16, 8))

    @jax.jit
    def f(x):
        return shard_map(lambda a: a * jax.lax.axis_index("model"), in_specs=P("data", "model"),
                         out_specs=P("data", "model"))(x)

    with jax.set_mesh(mesh):
        got = f(x)
    want = x * np.repeat(np.arange(2), 4)[None, :]
    np.testing.assert_allclose(np.asarray(got), want)


def test_shard_map_old_signature_check_rep():
    mesh = build_mesh(MESH)
    x = _x((16, 8))

    def local(a):
        return jax.lax.psum(a.sum(axis=0, keepdims=True), ("data", "model"))

    f = shard_map(local, mesh, P("data", "model"), P(), check_rep=True)
    np.testing.assert_allclose(np.asarray(f(x)), np.full((1, 4), 0.0) + x.reshape(16, 2, 4).sum(axis=(0, 1)),
                               rtol=1e-5, atol=1e-5)
    g = shard_map(lambda a: a * 2, mesh, P("data"), P("data"), check_rep=False)
    np.testing.assert_allclose(np.asarray(g(x)), x * 2)


def test_shard_map_old_signature_auto():
    mesh = build_mesh(MESH)
    x, w = _x((16, 8), 1), _x((8, 6), 2)

    def local(a, w):  # manual over 'data' only; 'model' is left to the compiler
        y = a @ w
        return y, jax.lax.psum(jnp.sum(y), "data")

    f = jax.jit(shard_map(local, mesh, (P("data"), P()), (P("data"), P()), check_rep=False,
                          auto=frozenset({"model"})))
    y, total = f(x, w)
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(total), float((x @ w).sum()), rtol=1e-5, atol=1e-4)


def test_constraint_inside_partial_shard_map_drops_manual_axes():
    def fun(p, b):
        def local(x, w):
            h = with_sharding_constraint(x @ w, P("batch", "mlp"))  # 'data' is manual here: only 'mlp'
            return h

        return shard_map(local, in_specs=(P("batch"), P()), out_specs=P("batch"), axis_names={"data"})(b["x"], p["w"])

    params = {"w": _x((16, 8), 1)}
    batch = {"x": _x((32, 16), 2)}
    sharded, init = parallelize(
        fun, init_params=lambda: {"w": jnp.asarray(params["w"])}, initial_batch=batch, mesh=MESH, rules=RULES
    )
    out = sharded(init(), batch)
    np.testing.assert_allclose(np.asarray(out), batch["x"] @ params["w"], rtol=1e-5, atol=1e-5)
    text = sharded.lower(init(), batch).as_text()
    assert '{"model"}' in text


def test_shard_map_argument_errors():
    mesh = build_mesh(MESH)
    with pytest.raises(TypeError, match="out_specs"):
        shard_map(lambda a: a, mesh, P("data"))
    with pytest.raises(TypeError, match="check_vma or its former name check_rep"):
        shard_map(lambda a: a, mesh, P("data"), P("data"), check_rep=True, check_vma=True)
    with pytest.raises(TypeError, match="axis_names, or the axes left to the compiler as auto"):
        shard_map(lambda a: a, mesh, P("data"), P("data"), auto={"model"}, axis_names={"data"})
    with pytest.raises(ValueError, match="needs a mesh"):
        shard_map(lambda a: a, None, P("data"), P("data"), auto={"model"})(jnp.ones(8))


# -- one traced body, several tasks ----------------------------------------------------------


def _shared_block(w, x):
    """Used by both stages below: JAX traces a ``jax.checkpoint``/``lax.scan`` body once per function."""
    return x + jnp.tanh(with_sharding_constraint(x @ w["a"], P("batch", "mlp"))) @ w["b"]


@pytest.mark.parametrize("nest", ["checkpoint", "scan"])
def test_a_body_shared_by_two_stages_is_constrained_on_each_stage(nest):
    """The body's constraint, traced for the first stage, is resolved on each stage's own submesh (the
    backward's recomputation included), so both stages compile and train as on one device."""
    import optax
    from helpers import check_mpmd_against_reference

    from multimesh.jax import microbatch, slice_mesh, task

    def stage(w, x):
        if nest == "checkpoint":
            return jax.checkpoint(_shared_block)(w, x)
        return jax.lax.scan(lambda h, wi: (_shared_block(wi, h), None), x, w)[0]  # layers stacked on axis 0

    mesh0, mesh1 = slice_mesh(build_mesh({"stage": 2, "data": 2, "model": 2}), "stage")
    stages = [task(stage, f"s{i}", mesh=m, logical_axes=RULES) for i, m in enumerate((mesh0, mesh1))]
    tx = optax.adam(1e-2)
    lead = (2,) if nest == "scan" else ()

    def init():
        k = jax.random.split(jax.random.key(0), 4)
        p = [{"a": jax.random.normal(k[2 * i], (*lead, 8, 16)) * .3, "b": jax.random.normal(k[2 * i + 1], (*lead, 16, 8)) * .3}
             for i in range(2)]
        return {"p": p, "o": tx.init(p)}

    def batch():
        return {"x": jax.random.normal(jax.random.key(1), (16, 8)), "y": jax.random.normal(jax.random.key(2), (16, 8))}

    def loss(p, b):
        return jnp.sum((stages[1](p[1], stages[0](p[0], b["x"])) - b["y"]) ** 2) / (16 * 8)  # the global size

    def step(state, b):
        value, grads = jax.value_and_grad(microbatch(loss, 0, 4, argnum=1))(state["p"], b)
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    fn, state = check_mpmd_against_reference(step, init, batch, steps=2)
    for i, m in enumerate((mesh0, mesh1)):
        assert state["p"][i]["a"].sharding.device_set == set(m.devices.flat)


def test_a_vmapped_logical_constraint_between_tasks_runs_as_on_one_device():
    """Glue between tasks is traced with its constraints deferred; one under ``jax.vmap`` batches (the
    mapped dimension left to the compiler), its loss and gradients those of the one-device step."""
    from helpers import check_mpmd_against_reference

    from multimesh.jax import task

    devs = np.array(jax.devices())
    rules = [("batch", "data")]
    first = task(lambda p, x: jnp.tanh(x @ p), "first", devices=devs[:4], device_axes=("data",), logical_axes=rules)
    second = task(lambda p, x: jnp.sum(jnp.sin(x @ p)), "second", devices=devs[4:], device_axes=("data",),
                  logical_axes=rules)

    def loss(params, batch):
        h = first(params["a"], batch)
        h = jax.vmap(lambda row: with_sharding_constraint(row, P("embed")))(h)
        return second(params["b"], h)

    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, grads, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    check_mpmd_against_reference(step, lambda: {"a": _x((4, 4), 1), "b": _x((4, 4), 2)}, lambda: _x((8, 4), 3),
                                 steps=2, rules=rules)
