"""MPMD core: tasks on disjoint submeshes against the same program on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import check_mpmd_against_reference
from jax.sharding import PartitionSpec as P

from multimesh.jax import build_mesh, ignore_transforms, parallelize, task, with_sharding_constraint
from multimesh.trace.task import task_call_p

pytestmark = pytest.mark.devices(8)


def layer(w, x):
    h = with_sharding_constraint(jnp.tanh(x @ w["a"]), P("data", "model"))
    return x + h @ w["b"]


def build(n_stages):
    devs = np.array(jax.devices())
    per = 8 // n_stages
    shape = {"data": 2, "model": per // 2} if per > 1 else {"data": 1}
    stages = [task(layer, f"stage{i}", mesh=build_mesh(shape, devs[i * per:(i + 1) * per])) for i in range(n_stages)]
    tx = optax.adam(1e-2)

    def init():
        keys = jax.random.split(jax.random.key(0), 2 * n_stages)
        p = {f"s{i}": {"a": jax.random.normal(keys[2 * i], (16, 32)) * .1,
                       "b": jax.random.normal(keys[2 * i + 1], (32, 16)) * .1} for i in range(n_stages)}
        return {"p": p, "o": tx.init(p)}

    def batch():
        return {"x": jax.random.normal(jax.random.key(5), (8, 16)), "y": jax.random.normal(jax.random.key(6), (8, 16))}

    def step(state, b):
        def loss(p):
            h = b["x"]
            for i, s in enumerate(stages):
                h = s(p[f"s{i}"], h)
            return jnp.mean((h - b["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state["p"])
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return stages, init, batch, step


@pytest.mark.parametrize("n_stages", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 stages: 10 s
def test_pipeline_matches_one_device(n_stages):
    stages, init, batch, step = build(n_stages)
    _, state = check_mpmd_against_reference(step, init, batch)
    # Each stage's parameters and optimizer moments live on that stage's devices.
    for i, s in enumerate(stages):
        stage_devices = set(s.placement.mesh.devices.flat)
        for leaf in jax.tree.leaves(state["p"][f"s{i}"]) + jax.tree.leaves(state["o"][0].mu[f"s{i}"]):
            assert leaf.sharding.device_set == stage_devices


def test_backward_does_not_recompute_forward():
    _, init, batch, step = build(2)
    fn, _, _ = parallelize(step, init_params=init, get_input_batch=batch)
    kinds = {}
    for seg in fn.plan.segments:
        for eqn in seg.eqns:
            if eqn.primitive is task_call_p:
                prims = {e.primitive.name for e in eqn.params["jaxpr"].jaxpr.eqns}
                kinds.setdefault(eqn.params["kind"], []).append(prims)
    assert len(kinds["fwd"]) == 2 and len(kinds["bwd"]) == 2
    assert all("tanh" in p for p in kinds["fwd"])
    assert not any("tanh" in p for p in kinds["bwd"])  # the residuals carry the activations


def test_the_forward_returns_no_copy_of_the_tasks_own_inputs():
    """Residuals that are the task's inputs (its weights, its input activation) are read by the backward
    where they already are: the forward task returns only what it computed, so a pipeline does not keep a
    copy of the stage's weights per microbatch."""
    stages, init, batch, step = build(2)
    fn, _, _ = parallelize(step, init_params=init, get_input_batch=batch)
    for seg in fn.plan.segments:
        for eqn in seg.eqns:
            if eqn.primitive is task_call_p and eqn.params["kind"] == "fwd":
                inner = eqn.params["jaxpr"].jaxpr
                assert not set(inner.invars) & set(inner.outvars), seg.label
                # out: the activation, then tanh(x @ a) and its derivative's factor: all [8, 32] or [8, 16]
                assert all(v.aval.shape in ((8, 16), (8, 32)) for v in eqn.outvars), seg.label
    loss, grads, _ = fn(init(), batch())
    with ignore_transforms():
        want = jax.jit(step)(init(), batch())
    np.testing.assert_allclose(loss, want[0], rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_stages", [2, 4])
def test_plan_structure(n_stages):
    """Segments per submesh in execution order, their device sets, and every value that crosses submeshes."""
    stages, init, batch, step = build(n_stages)
    fn, _, _ = parallelize(step, init_params=init, get_input_batch=batch)
    plan, n, per = fn.plan, n_stages, 8 // n_stages
    devs = jax.devices()

    # One submesh per stage: the task's own mesh (devices, shape, axis names).
    assert [p.name for p in plan.placements] == [f"stage{i}" for i in range(n)]
    for i, p in enumerate(plan.placements):
        assert p.devices == frozenset(devs[i * per:(i + 1) * per])
        assert p.mesh == stages[i].placement.mesh
    # Forward down the stages, the last stage's forward and backward together, backward up the stages;
    # each stage's optimizer update runs in its backward segment (adam's scalars are recomputed per stage).
    labels = ([f"stage{i}:fwd" for i in range(n - 1)] + [f"stage{n - 1}:fwd+bwd"]
              + [f"stage{i}:bwd" for i in reversed(range(n - 1))])
    assert [s.label for s in plan.segments] == labels
    assert [s.index for s in plan.segments] == list(range(len(labels)))
    for s in plan.segments:
        stage = int(s.label.split(":")[0].removeprefix("stage"))
        assert s.placement is plan.placements[stage]
        # a valid execution order: every input is a step input or made by an earlier segment
        assert all(plan.producer.get(v, -1) < s.index for v in s.invars)

    # Transfers: the activations ([8, 16] float32) down the pipeline and their cotangents back up,
    # one segment to the next; and adam's step count (an int32 step input, kept on the last stage with the
    # state's other scalars) to each other stage's first segment that updates parameters (its backward).
    count = next(v for v in plan.jaxpr.invars if v.aval.dtype == np.int32)
    assert plan.input_placement[count] is plan.placements[-1]
    activations = [(k, k + 1, "float32[8,16]") for k in range(2 * n - 2)]
    counts = [(-1, n - 1 + (n - 1 - i), "int32[]") for i in range(n - 1)]  # stage i's bwd segment
    transfers = plan.transfers()
    assert sorted((src, dst, aval.str_short()) for _, src, dst, aval, _ in transfers) == sorted(activations + counts)
    for _, src, dst, aval, nbytes in transfers:
        assert nbytes == int(np.prod(aval.shape)) * 4  # 512 B an activation, 4 B the count
        where = plan.input_placement[count] if src < 0 else plan.segments[src].placement
        assert where.devices.isdisjoint(plan.segments[dst].placement.devices)
    total = 512 * len(activations) + 4 * len(counts)
    assert sum(t[4] for t in transfers) == total

    # The printed plan says the same.
    text = str(plan).splitlines()
    assert text[0] == f"MPMD plan: {len(labels)} segments on {n} submeshes"
    assert text[1:1 + n] == [f"  submesh {p.describe()}" for p in plan.placements]
    assert text[1] == f"  submesh stage0 on {dict(stages[0].placement.mesh.shape)} devices [0-{per - 1}]"
    assert sum("<- reshard float32[8,16]" in line and "(512 B)" in line for line in text) == 2 * n - 2
    assert sum("<- reshard int32[] from input (4 B)" in line for line in text) == n - 1
    assert text[-1] == f"  total resharded per step: {total} B"


def test_overlapping_tasks_are_rejected():
    devs = jax.devices()
    a = task(layer, "a", mesh=build_mesh({"data": 4}, devs[:4]))
    b = task(layer, "b", mesh=build_mesh({"data": 2}, devs[2:4]))

    def step(p, x):
        return jnp.sum(b(p, a(p, x)))

    p = lambda: {"a": jnp.ones((16, 32)), "b": jnp.ones((32, 16))}  # noqa: E731
    with pytest.raises(ValueError, match="share devices"):
        parallelize(step, init_params=p, get_input_batch=lambda: jnp.ones((8, 16)))


def test_task_argument_errors():
    with pytest.raises(ValueError, match="not both"):
        task(layer, mesh=build_mesh({"data": 8}), devices=jax.devices())
    with pytest.raises(ValueError, match="one axis name per dimension"):
        task(layer, devices=np.array(jax.devices()).reshape(2, 4), device_axes=("x",))
    with pytest.raises(ValueError, match="logical_axes"):
        task(layer, logical_axes=[("batch", "devices")])


def test_task_outside_parallelize_runs_on_its_submesh():
    devs = jax.devices()
    t = task(lambda x: x * 2, "double", mesh=build_mesh({"data": 2}, devs[6:]))
    out = t(jnp.arange(4.0))
    np.testing.assert_array_equal(out, np.arange(4.0) * 2)
    assert out.sharding.device_set == set(devs[6:])


def test_a_parameter_constrained_outside_tasks_is_sharded_by_the_consuming_tasks_rules():
    """MultiMesh resolves a constraint on a parameter in glue with the rules of the task that reads it."""
    devs = np.array(jax.devices())
    first = task(lambda w, x: x @ w, "first", devices=devs[:4].reshape(4, 1), device_axes=("x", "y"),
                 logical_axes=[("model", "x")])
    second = task(lambda x: jnp.tanh(x), "second", devices=devs[4:].reshape(4, 1), device_axes=("x", "y"))

    def step(p, b):
        w = with_sharding_constraint(p["w"], P("model", None))  # outside any task: logical names
        return jnp.sum(second(first(w, b["x"])))

    fn, init, get_batch = parallelize(
        step, init_params=lambda: {"w": jnp.arange(64.0).reshape(8, 8) / 64},
        get_input_batch=lambda: {"x": jnp.ones((4, 8))})
    params, batch = init(), get_batch()
    w = params["w"]
    assert w.sharding.device_set == set(devs[:4]) and tuple(w.sharding.spec) == ("x", None)
    assert {s.data.shape for s in w.addressable_shards} == {(2, 8)}  # 4 row blocks
    want = jnp.sum(jnp.tanh(jnp.ones((4, 8)) @ (jnp.arange(64.0).reshape(8, 8) / 64)))
    np.testing.assert_allclose(float(fn(params, batch)), float(want), rtol=1e-6)


def test_move_copies_shard_for_shard_like_device_put():
    """`core.transfer.move`'s direct batched copy (same spec on a mesh of the same shape) gives what
    `jax.device_put` gives: values, sharding, shard shapes, dtype and weak type; other moves and a
    deleted array still go through `jax.device_put` (and its errors)."""
    from jax.sharding import NamedSharding

    from multimesh.core import transfer

    devs = np.array(jax.devices())
    src = build_mesh({"data": 2, "model": 2}, devs[:4])
    dst = build_mesh({"data": 2, "model": 2}, devs[4:])
    xs = [jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(src, P("data", "model"))),
          jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(src, P("model"))),
          jax.device_put(jnp.asarray(2.5), NamedSharding(src, P()))]  # weakly typed scalar
    targets = [NamedSharding(dst, x.sharding.spec) for x in xs]
    assert all(transfer._shard_for_shard(x, t) for x, t in zip(xs, targets))
    moved, expected = transfer.move(xs, targets), jax.device_put(xs, targets)
    for m, e, t in zip(moved, expected, targets):
        assert m.sharding == e.sharding == t and m.aval == e.aval and m.weak_type == e.weak_type
        assert [s.data.shape for s in m.addressable_shards] == [s.data.shape for s in e.addressable_shards]
        assert {s.device for s in m.addressable_shards} == set(devs[4:])
        np.testing.assert_array_equal(np.asarray(m), np.asarray(e))

    other = NamedSharding(build_mesh({"data": 4}, devs[4:]), P("data"))  # a reshard, not shard for shard
    assert not transfer._shard_for_shard(xs[0], other)
    np.testing.assert_array_equal(np.asarray(transfer.move([xs[0]], [other])[0]), np.asarray(xs[0]))
    xs[0].delete()
    assert not transfer._shard_for_shard(xs[0], targets[0])
    with pytest.raises(RuntimeError, match="deleted"):
        transfer.move([xs[0]], [targets[0]])


def test_a_step_hands_back_its_state_in_one_move_each_leaf_in_its_own_sharding(monkeypatch):
    """The stage programs return parameters with an equivalent spec (``P('model')`` for ``P('model', None)``):
    relabelling them all is one batched move, not one per leaf, and each comes back as it went in."""
    import multimesh.run.mpmd as mpmd_module

    _, init, batch, step = build(2)
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=batch)
    state, b = init_p(), get_b()
    given = jax.tree.map(lambda x: x.sharding, state)
    _, _, state = fn(state, b)
    moves, move = [], mpmd_module.move
    monkeypatch.setattr(mpmd_module, "move", lambda xs, targets: moves.append(len(xs)) or move(xs, targets))
    _, _, state = fn(state, b)
    assert len(moves) == 1 and moves[0] > 1, moves
    assert jax.tree.map(lambda x: x.sharding, state) == given
