"""MultiMesh compatibility: `MultiMesh` / `Context` and the compiler contexts.

The reference-style example: a Linen pipeline whose blocks a `MultiMesh`
places on slices of its global mesh (``Task(mesh_slice={"stage": i})``),
annotated with `nn.with_partitioning` names that the tasks' logical axes
resolve, against the same step on one device.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import check_mpmd_against_reference
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from multimesh.jax import (
    Context,
    MultiMesh,
    Task,
    autoshard,
    clear_tasks,
    context,
    enable_fast_path,
    enable_recomputation,
    enable_task_fusion,
    ignore_transforms,
    only_fuse_loop_tasks,
    register_task,
    registered_tasks,
    slice_global_mesh,
    with_sharding_constraint,
)
from multimesh.trace.knobs import current_knobs
from multimesh.trace.task import transforms_ignored

pytestmark = pytest.mark.devices(8)


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")), (16, 32))
        v = self.param("v", nn.with_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")), (32, 16))
        return x + jnp.tanh(x @ w) @ v


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = Block(name=f"layers_{i}")(x)
        return x


def problem():
    model, tx = Net(), optax.adam(1e-2)

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

    return init, batch, step


def stage_of(name, backprop):
    """MultiMesh's tutorial style: parse the matched name, return a Task on a slice of the global mesh."""
    layer = int(name.split("_")[1])
    return Task(name=f"stage{layer // 2}", mesh_slice={"stage": layer // 2},
                logical_axes=[("batch", "data"), ("mlp", "model"), ("embed", None)])


def test_a_multimesh_slices_its_global_mesh_per_stage():
    mm = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    mm.register_task(r"layers_\d+", callback=stage_of)
    assert registered_tasks() == []  # in force only inside `with mm:`
    init, batch, step = problem()
    with mm:
        assert len(registered_tasks()) == 1
        fn, state = check_mpmd_against_reference(step, init, batch)
    assert registered_tasks() == []
    devs = np.asarray(jax.devices(), dtype=object).reshape(2, 2, 2)
    assert [p.name for p in fn.plan.placements[:2]] == ["stage0", "stage1"]
    stage1 = fn.plan.placements[1].mesh
    assert dict(stage1.shape) == {"stage": 1, "data": 2, "model": 2}  # the sliced axis is kept, size 1
    assert set(stage1.devices.flat) == set(devs[1].flat)
    w0 = state["p"]["params"]["layers_0"]["w"].value
    w3 = state["p"]["params"]["layers_3"]["w"].value
    assert w0.sharding.device_set == set(devs[0].flat) and w3.sharding.device_set == set(devs[1].flat)
    assert w3.sharding.spec == P(None, "model") and w3.addressable_shards[0].data.shape == (16, 16)


def test_register_task_inside_the_block_belongs_to_it():
    mm = MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    with mm:
        reg = register_task(r"layers_0", task=Task(mesh_slice={"stage": 1}))
        assert reg in mm.registrations and reg in registered_tasks()
        p = reg.placement_for(reg.pattern.fullmatch("layers_0"), False)
        assert set(p.mesh.devices.flat) == set(jax.devices()[4:])
        assert slice_global_mesh(stage=1).devices == (4, 5, 6, 7)
    assert registered_tasks() == []
    with mm, mm:  # re-entrant; the registration comes back with the block
        assert registered_tasks() == [reg]
    assert registered_tasks() == []
    ctx = Context()
    with ctx:
        inner = register_task(r"x", devices=[0, 1])
    assert ctx.registrations == [inner] and registered_tasks() == []


def test_multimesh_is_a_mesh_and_slices_like_the_reference():
    mm = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"), devices=list(range(8)))
    assert mm.shape == {"stage": 2, "data": 2, "model": 2} and mm.axis_names == ("stage", "data", "model")
    assert mm.size == 8 and isinstance(mm.mesh, Mesh)
    s = mm.slice(stage=1)
    assert dict(s.shape) == {"stage": 1, "data": 2, "model": 2} and [d.id for d in s.devices.flat] == [4, 5, 6, 7]
    assert mm.single_slice_ids() == [0, 1, 2, 3]
    assert [d.id for d in mm.single_slice_devices("model")] == [0, 2, 4, 6]
    assert MultiMesh(global_mesh=s).mesh is s


def test_multimesh_misuse():
    with pytest.raises(ValueError, match=r"axis_sizes=\(2, 2\) multiply to 4, but there are 8 devices"):
        MultiMesh(axis_sizes=(2, 2), axis_names=("a", "b"))
    with pytest.raises(ValueError, match=r"give global_mesh= or axis_sizes=/axis_names=/devices=, not both"):
        MultiMesh(axis_sizes=(8,), global_mesh=MultiMesh().mesh)
    with pytest.raises(ValueError, match=r"MultiMesh.slice=\{'stage': 2\}: index 2 along 'stage' is out of range 0..1"):
        MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data")).slice(stage=2)
    register_task(r"a", task=Task(mesh_slice={"stage": 0})).remove()  # accepted: sliced where a step is traced
    with pytest.raises(ValueError, match=r"slice_global_mesh\(\) needs a global mesh"):
        slice_global_mesh(stage=0)


def test_logical_constraints_resolve_on_the_global_mesh_inside_the_block():
    mm = MultiMesh(axis_sizes=(4, 2), axis_names=("data", "model"))

    @jax.jit
    def f(x):
        return with_sharding_constraint(x * 2, P("data", None))

    with mm:
        y = f(jnp.ones((8, 4)))
    assert tuple(y.sharding.spec)[:1] == ("data",) and y.sharding.mesh.shape == mm.mesh.shape
    assert y.addressable_shards[0].data.shape == (2, 4)


def test_find_matching_slice_in_scope():
    mm = MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    mm.register_task(r"layers_(\d+)", callback=lambda name, bp: Task(mesh_slice={"stage": int(name.group(1))}))
    found = []
    with mm, jax.named_scope("layers_1"):
        found.append(mm.find_matching_slice_in_scope())
    with mm, jax.named_scope("other"):
        found.append(mm.find_matching_slice_in_scope())
    assert found == [{"stage": 1}, None]


def test_compiler_contexts():
    assert current_knobs().enable_recomputation and current_knobs().autoshard is None
    with context(enable_recomputation=False, enable_task_fusion=False, ignore_transforms=True) as k:
        assert not k.enable_recomputation and not current_knobs().enable_task_fusion and transforms_ignored()
        with context(enable_fast_path=None):  # None leaves everything as is
            assert current_knobs() == k
    assert current_knobs().enable_recomputation and not transforms_ignored()
    for knob, field in ((enable_fast_path, "enable_fast_path"), (enable_recomputation, "enable_recomputation"),
                        (enable_task_fusion, "enable_task_fusion"), (only_fuse_loop_tasks, "only_fuse_loop_tasks")):
        with knob(True):
            assert getattr(current_knobs(), field) is True
        with knob(False):
            assert getattr(current_knobs(), field) is False
    with pytest.raises(TypeError, match=r"enable_recomputation must be True, False or None"), \
            enable_recomputation("yes"):
        pass
    with ignore_transforms(), context(ignore_transforms=False):
        assert not transforms_ignored()


def test_autoshard_off_makes_constraints_jax_own():
    mm = MultiMesh(axis_sizes=(8,), axis_names=("data",))

    def f(x):
        return with_sharding_constraint(x, P("batch"))

    # (a fresh function per jit: JAX caches traces by function, and the knob is not part of its key)
    with mm:  # logical: a name with no rule is replicated
        assert jax.jit(lambda x: f(x))(jnp.ones(8)).sharding.is_fully_replicated
        with autoshard(True):
            assert jax.jit(lambda x: f(x))(jnp.ones(8)).sharding.is_fully_replicated
        with autoshard(False), pytest.raises(RuntimeError, match="non-empty mesh in context"):  # JAX's own: needs a mesh in context
            jax.jit(lambda x: f(x))(jnp.ones(8))


def _sliced_stages():
    """A 2 x 4 MultiMesh whose ``stage_i`` scopes run on stage slice i, and a per-shard function recording
    the shard shapes it sees."""
    mm = MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    mm.register_task(r"stage_(\d)", callback=lambda name, bp: Task(
        name=name, mesh_slice={"stage": int(name.group(1))}, logical_axes=[("batch", "data")]))
    seen = []

    def per_shard(a):
        seen.append(a.shape)
        return a * 2

    return mm, seen, per_shard


def test_shard_map_inside_a_sliced_scope_runs_on_the_slice():
    from multimesh.jax import mjit, shard_map

    mm, seen, per_shard = _sliced_stages()

    def f(x):
        with jax.named_scope("stage_0"):
            h = x + 1
        with jax.named_scope("stage_1"):  # no mesh given: the slice of this scope, as in MultiMesh
            return shard_map(per_shard, mesh=mm, in_specs=P("batch"), out_specs=P("batch"))(h)

    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    with mm:
        fn = mjit(f)
        out = fn(x)
    np.testing.assert_allclose(out, (x + 1) * 2)
    assert seen == [(2, 2)]  # 8 rows over the slice's 4 data devices
    assert out.sharding.device_set == set(mm.slice(stage=1).devices.flat)
    assert [p.name for p in fn.plan.placements] == ["stage_0", "stage_1"]


def test_parallelize_inside_a_multimesh_uses_its_mesh():
    from multimesh.jax import parallelize

    mm = MultiMesh(axis_sizes=(4, 2), axis_names=("data", "model"))
    with mm:
        fn, init = parallelize(lambda p, b: jnp.sum(b["x"] @ p), init_params=lambda: jnp.ones((4, 2)),
                               initial_batch={"x": np.ones((8, 4), np.float32)}, rules=[("batch", "data")])
    assert fn.mesh == mm.mesh
    b = {"x": np.ones((8, 4), np.float32)}
    assert float(fn(init(), b)) == 64.0
    assert fn.batch_shardings["x"].spec == P("data") and fn.batch_shardings["x"].mesh == mm.mesh


def test_a_microbatch_body_sees_the_registered_scope_around_the_microbatch_call():
    """`microbatch` traces its function once inside a `jax.jit`, whose trace starts with an empty name
    stack; a shard_map there without a mesh still finds the registered scope around the call (its slice)."""
    from multimesh.jax import microbatch, mjit, shard_map

    mm, seen, per_shard = _sliced_stages()

    def body(x):
        return shard_map(per_shard, in_specs=P("batch"), out_specs=P("batch"))(x + 1)

    def f(x):
        with jax.named_scope("stage_1"):
            return microbatch(body, 0, 4)(x)  # 2 microbatches of 4 rows, summed

    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    with mm:
        fn = mjit(f)
        out = fn(x)
    np.testing.assert_allclose(out, (x[:4] + 1) * 2 + (x[4:] + 1) * 2)
    assert seen == [(1, 2)]  # traced once: 4 rows over the slice's 4 data devices
    assert out.sharding.device_set == set(mm.slice(stage=1).devices.flat)
    assert [p.name for p in fn.plan.placements] == ["stage_1"]
