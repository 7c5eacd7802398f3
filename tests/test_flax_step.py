"""`multimesh.jax.flax.parallelize_step` for Linen and NNX models against plain optax on one device."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from helpers import (
    LinenLossModel,
    NNXLossModel,
    assert_trees_close,
    check_placement,
    leaves_by_path,
    loss_batch,
    nnx_reference_parts,
    norm_spec,
    optax_loop,
)

from multimesh.jax import build_mesh, parallelize
from multimesh.jax.flax import parallelize_step, shard_axes

pytestmark = pytest.mark.devices(8)

STEPS = 3
TX = optax.adamw(1e-2)
MESH_SHAPE = {"data": 4, "tensor": 2}
# standard rules on {data, tensor}: batch -> data, mlp -> tensor (embed has no fsdp axis: replicated)
EXPECTED = {"kernel_in": (None, "tensor"), "bias_in": ("tensor",), "kernel_out": ("tensor",), "bias_out": ()}


def _reference(kind: str, batch):
    if kind == "linen":
        model = LinenLossModel()
        variables = model.init(jax.random.key(42), batch)
        return optax_loop(model.apply, variables, TX, batch, STEPS)
    params, loss = nnx_reference_parts(NNXLossModel, seed=42)
    return optax_loop(loss, params, TX, batch, STEPS)


def _model(kind: str):
    return {
        "linen": LinenLossModel(),
        "nnx_class": NNXLossModel,
        "nnx_factory": lambda rngs: NNXLossModel(rngs),
    }[kind]


def _param_roles(params) -> dict[str, jax.Array]:
    """kernel_in / bias_in / kernel_out / bias_out -> array, for the Linen and the NNX model."""
    by_path = leaves_by_path(params)
    roles = {}
    for path, arr in by_path.items():
        first = "Dense_0" in path or path.startswith("a/") or "/a/" in path
        kind = "kernel" if "kernel" in path else "bias"
        roles[f"{kind}_{'in' if first else 'out'}"] = arr
    assert set(roles) == set(EXPECTED), by_path.keys()
    return roles


CASES = [
    ("linen", "global", True),
    ("linen", "local", False),
    ("nnx_class", "global", False),
    ("nnx_factory", "local", True),
]


@pytest.mark.parametrize("kind,form,replicate", CASES, ids=[f"{k}-{f}-{'repl' if r else 'shard'}" for k, f, r in CASES])
def test_parallelize_step_matches_optax_reference(kind, form, replicate):
    batch = loss_batch()
    mesh = build_mesh(MESH_SHAPE)
    if form == "global":
        out = parallelize_step(_model(kind), TX, mesh, global_batch=batch, replicate_inputs=replicate)
        assert len(out) == 3
        step, state, got_mesh = out
        placed = batch
    else:
        out = parallelize_step(_model(kind), TX, mesh, local_batch=batch, replicate_inputs=replicate)
        assert len(out) == 4
        step, state, got_mesh, prepare = out
        placed = prepare(batch)
        want = () if replicate else ("data",)
        for k in batch:
            np.testing.assert_array_equal(np.asarray(placed[k]), batch[k])
            check_placement(placed[k], want, set(mesh.devices.flat), MESH_SHAPE, f"prepared batch {k}")
    assert got_mesh is mesh
    assert isinstance(state, TrainState)
    for k, s in step.batch_shardings.items():
        assert norm_spec(s.spec) == (() if replicate else ("data",)), k

    ref_losses, ref_params = _reference(kind, batch)
    losses = []
    for i in range(STEPS):
        old = state
        loss, state = step(state, placed)
        losses.append(float(loss))
        if i == 0:  # donated by default
            assert all(a.is_deleted() for a in jax.tree.leaves(old.params))
    # the loss is computed before each update: the first equals the loss at the initial params
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert int(state.step) == STEPS
    assert jax.tree.structure(state.params) == jax.tree.structure(ref_params)
    assert_trees_close(state.params, ref_params, what=f"{kind} params after {STEPS} steps")

    devices = set(mesh.devices.flat)
    for role, arr in _param_roles(state.params).items():
        check_placement(arr, EXPECTED[role], devices, MESH_SHAPE, f"{kind} {role}")
    adam = state.opt_state[0]
    for moment in (adam.mu, adam.nu):
        for role, arr in _param_roles(moment).items():
            check_placement(arr, EXPECTED[role], devices, MESH_SHAPE, f"{kind} moment {role}")


def test_parallelize_step_shards_the_batch_by_default_and_takes_a_mesh_shape():
    """Data parallel unless told otherwise (MultiMesh replicates): the batch over ``data`` of a ``data x tensor``
    mesh given as a shape, the losses those of one device."""
    batch = loss_batch()
    step, state, mesh = parallelize_step(LinenLossModel(), TX, MESH_SHAPE, global_batch=batch)
    assert isinstance(mesh, jax.sharding.Mesh) and dict(mesh.shape) == MESH_SHAPE
    for k, s in step.batch_shardings.items():
        assert norm_spec(s.spec) == ("data",), k
    ref_losses, _ = _reference("linen", batch)
    losses = []
    for _ in range(STEPS):
        loss, state = step(state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh or an \{axis: size\} dict, got list"):
        parallelize_step(LinenLossModel(), TX, [4, 2], global_batch=batch)


def test_shard_axes_attaches_logical_names():
    init = shard_axes("embed", "mlp")
    box = init(jax.random.key(0), (4, 6))
    assert isinstance(box, nn.LogicallyPartitioned)
    assert tuple(box.names) == ("embed", "mlp")
    assert box.value.shape == (4, 6)
    # outside a module's field: xavier-normal (MultiMesh's default)
    ref = nn.initializers.xavier_normal()(jax.random.key(0), (4, 6))
    np.testing.assert_array_equal(np.asarray(box.value), np.asarray(ref))


def test_shard_axes_keeps_the_initializer_of_the_module_it_is_given_to():
    """Naming the axes changes nothing else: nn.Dense's kernel stays LeCun normal (std 1/sqrt(fan_in)), its
    bias zeros, nn.Embed's table its own; ``init=`` still wins."""
    x, tokens, key = np.ones((2, 512), np.float32), np.ones((2,), np.int32), jax.random.key(0)
    named = nn.Dense(1024, kernel_init=shard_axes("embed", "mlp"), bias_init=shard_axes("mlp")).init(key, x)
    plain = nn.Dense(1024).init(key, x)
    kernel = named["params"]["kernel"]
    assert tuple(kernel.names) == ("embed", "mlp")
    np.testing.assert_array_equal(np.asarray(kernel.value), np.asarray(plain["params"]["kernel"]))
    np.testing.assert_allclose(float(kernel.value.std()), 1 / np.sqrt(512), rtol=0.05)
    np.testing.assert_array_equal(np.asarray(named["params"]["bias"].value), np.zeros(1024))
    table = nn.Embed(64, 16, embedding_init=shard_axes("vocab", "embed")).init(key, tokens)["params"]["embedding"]
    np.testing.assert_array_equal(np.asarray(table.value),
                                  np.asarray(nn.Embed(64, 16).init(key, tokens)["params"]["embedding"]))
    given = nn.Dense(4, kernel_init=shard_axes("embed", "mlp", init=nn.initializers.ones)).init(key, x)
    np.testing.assert_array_equal(np.asarray(given["params"]["kernel"].value), np.ones((512, 4)))


class _NNXSpellings(nnx.Module):
    """One parameter per NNX metadata spelling (no compile needed: shardings only)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.new = nnx.Param(init(rngs.params(), (8, 16)), out_sharding=("embed", "mlp"))
        with warnings.catch_warnings():  # the older spellings are deprecated (Flax remaps them)
            warnings.simplefilter("ignore", DeprecationWarning)
            self.old_names = nnx.Param(init(rngs.params(), (8, 16)), sharding_names=("embed", "mlp"))
            self.old = nnx.Param(init(rngs.params(), (8, 16)), sharding=("embed", "mlp"))
        self.via_init = nnx.Linear(
            8, 16, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), use_bias=False, rngs=rngs
        )

    def __call__(self, x):
        return (x @ self.new[...]).sum() + self.via_init(x).sum()


def test_nnx_metadata_is_read():
    def init():
        with nnx.use_eager_sharding(False):
            return nnx.split(_NNXSpellings(nnx.Rngs(0)), nnx.Param, ...)[1]

    fun, _ = parallelize(
        lambda p, b: p["new"][...].sum(),
        init_params=init,
        initial_batch=np.zeros((8, 8), np.float32),
        mesh={"data": 2, "model": 4},
        rules=[("batch", "data"), ("embed", "data"), ("mlp", "model")],
    )
    specs = {path: norm_spec(s.spec) for path, s in leaves_by_path(fun.param_shardings).items()}
    assert len(specs) == 4, specs
    for path, spec in specs.items():
        assert spec == ("data", "model"), (path, spec)
