"""SPMD `parallelize` against the one-device reference.

For a small MLP and a small attention block, under data parallelism, FSDP,
Megatron tensor parallelism and 2-D data x model: the loss, the gradients and
the whole train state (params and adamw's mu/nu) after 3 steps equal plain
`jax.jit` on one device, and every array of the step's *outputs* sits exactly
where the rules say (spec, mesh, devices, shard shape).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    MLP,
    Attention,
    assert_trees_close,
    attention_batch,
    boxed_leaves,
    check_placement,
    expected_spec,
    leaves_by_path,
    make_init,
    make_train_step,
    mlp_batch,
    norm_spec,
    run_reference,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.jax import parallelize

pytestmark = pytest.mark.devices(8)

STEPS = 3
TX = optax.adamw(1e-2)


@dataclass(frozen=True)
class Config:
    mesh: dict
    rules: list
    devices: tuple | None = None  # indices into jax.devices(); None: all
    literal: dict = field(default_factory=dict)  # model -> {param path: expected spec}, written out by hand

    @property
    def axes(self) -> dict:
        return dict(self.rules)

    def device_set(self) -> set:
        devs = jax.devices()
        return set(devs) if self.devices is None else {devs[i] for i in self.devices}


K0, B0, K1, B1 = (f"params/params/{p}" for p in ("Dense_0/kernel", "Dense_0/bias", "Dense_1/kernel", "Dense_1/bias"))
Q, QB, KK, O, OB, LN = (
    f"params/params/{p}" for p in ("query/kernel", "query/bias", "key/kernel", "out/kernel", "out/bias", "LayerNorm_0/scale")
)

CONFIGS = {
    "dp": Config(
        {"data": 8},
        [("batch", "data")],
        literal={"mlp": {K0: (), B0: (), K1: (), B1: ()}, "attention": {Q: (), QB: (), O: (), LN: ()}},
    ),
    "fsdp": Config(
        {"fsdp": 8},
        [("batch", "fsdp"), ("embed", "fsdp")],
        literal={
            "mlp": {K0: ("fsdp",), B0: (), K1: (None, "fsdp"), B1: ("fsdp",)},
            "attention": {Q: ("fsdp",), KK: ("fsdp",), QB: (), O: (None, None, "fsdp"), OB: ("fsdp",), LN: ("fsdp",)},
        },
    ),
    "tp": Config(
        {"model": 8},
        [("mlp", "model"), ("heads", "model")],
        literal={
            "mlp": {K0: (None, "model"), B0: ("model",), K1: ("model",), B1: ()},
            "attention": {Q: (None, "model"), KK: (None, "model"), QB: ("model",), O: ("model",), OB: (), LN: ()},
        },
    ),
    "dp_tp": Config(
        {"data": 4, "model": 2},
        [("batch", "data"), ("mlp", "model"), ("heads", "model")],
        literal={
            "mlp": {K0: (None, "model"), B0: ("model",), K1: ("model",), B1: ()},
            "attention": {Q: (None, "model"), QB: ("model",), O: ("model",), OB: (), LN: ()},
        },
    ),
    # data parallel on the last four devices only
    "dp_devices_4to7": Config({"data": 4}, [("batch", "data")], devices=(4, 5, 6, 7), literal={"mlp": {K0: (), K1: ()}}),
}

MODELS = {
    "mlp": lambda: (MLP(), mlp_batch()),
    "attention": lambda: (Attention(), attention_batch()),
}

CASES = [(m, c) for m in MODELS for c in CONFIGS if not (m == "attention" and c == "dp_devices_4to7")]


@functools.cache
def reference(model_name: str):
    model, batch = MODELS[model_name]()
    init = make_init(model, TX, batch["x"][:2])
    ref = run_reference(make_train_step(model, TX, with_grads=True), init, batch, STEPS)
    return SimpleNamespace(model=model, batch=batch, init=init, state0=ref["init"], outputs=ref["outputs"])


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{c}" for m, c in CASES])
def run(request):
    model_name, config_name = request.param
    cfg = CONFIGS[config_name]
    ref = reference(model_name)
    step = make_train_step(ref.model, TX, with_grads=True)
    devices = None if cfg.devices is None else [jax.devices()[i] for i in cfg.devices]
    fun, init = parallelize(
        step, init_params=ref.init, initial_batch=ref.batch, mesh=cfg.mesh, rules=cfg.rules, devices=devices
    )
    state0 = init()
    outputs, state = [], state0
    for _ in range(STEPS):
        out = fun(state, ref.batch)
        jax.block_until_ready(out)
        outputs.append(out)
        state = out[1]
    return SimpleNamespace(name=f"{model_name}-{config_name}", model=model_name, cfg=cfg, fun=fun, init=init,
                           state0=state0, outputs=outputs, ref=ref)


def test_initial_state_matches_reference(run):
    assert_trees_close(run.state0, run.ref.state0, rtol=1e-6, atol=1e-7, what=f"{run.name} init")


def test_loss_and_grads_match_reference(run):
    for i, (out, ref_out) in enumerate(zip(run.outputs, run.ref.outputs)):
        np.testing.assert_allclose(float(out[0]), float(ref_out[0]), rtol=1e-5, atol=1e-6, err_msg=f"loss of step {i}")
        assert_trees_close(out[2], ref_out[2], what=f"{run.name} grads of step {i}")


def test_state_after_three_steps_matches_reference(run):
    assert_trees_close(run.outputs[-1][1], run.ref.outputs[-1][1], what=f"{run.name} state after {STEPS} steps")
    # the run really trained: params moved away from their initial values
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), run.outputs[-1][1]["params"], run.state0["params"])
    assert min(jax.tree.leaves(moved)) > 1e-4


def _check_tree_placement(tree, cfg: Config, what: str) -> int:
    """Every array where its logical names say; returns how many were checked."""
    leaves = boxed_leaves(tree)
    for path, arr, names in leaves:
        check_placement(arr, expected_spec(names, cfg.axes), cfg.device_set(), cfg.mesh, what=f"{what} {path}")
    return len(leaves)


def test_output_state_shardings_follow_rules(run):
    """Params and adamw's mu/nu, as returned by the step (the mirror), and as born."""
    final = run.outputs[-1][1]
    n = _check_tree_placement(final, run.cfg, f"{run.name} output state")
    assert n == 3 * len(jax.tree.leaves(final["params"])) + 1  # params, mu, nu, count
    adam = final["opt"][0]
    assert isinstance(adam, optax.ScaleByAdamState)
    for moment in (adam.mu, adam.nu):
        assert jax.tree.structure(moment) == jax.tree.structure(final["params"])
        _check_tree_placement(moment, run.cfg, f"{run.name} moment")
    check_placement(adam.count, (), run.cfg.device_set(), run.cfg.mesh, "adam count")
    _check_tree_placement(run.state0, run.cfg, f"{run.name} initial state")


def test_output_grads_mirror_param_shardings(run):
    _check_tree_placement(run.outputs[0][2], run.cfg, f"{run.name} grads")


def test_specs_written_out_by_hand(run):
    table = run.cfg.literal[run.model]
    assert table
    got = {path: norm_spec(arr.sharding.spec) for path, arr, _ in boxed_leaves(run.outputs[-1][1])}
    derived = {path: norm_spec(s.spec) for path, s, _ in boxed_leaves(run.fun.param_shardings)}
    for path, want in table.items():
        assert got[path] == want, (path, got[path])
        assert derived[path] == want, (path, derived[path])  # the attribute agrees with the arrays


def test_param_shardings_attribute_matches_arrays(run):
    shardings = [s for _, s, _ in boxed_leaves(run.fun.param_shardings)]
    arrays = [a for _, a, _ in boxed_leaves(run.outputs[-1][1])]
    assert len(shardings) == len(arrays)
    for s, a in zip(shardings, arrays):
        assert isinstance(s, NamedSharding)
        assert s.mesh == a.sharding.mesh
        assert norm_spec(s.spec) == norm_spec(a.sharding.spec)


def test_batch_shardings(run):
    want = norm_spec((run.cfg.axes.get("batch"),))
    for name, s in run.fun.batch_shardings.items():
        assert norm_spec(s.spec) == want, name
        assert set(s.mesh.devices.flat) == run.cfg.device_set()


def test_mesh_shape_and_device_order(run):
    mesh = run.fun.mesh
    assert dict(mesh.shape) == run.cfg.mesh
    devs = jax.devices() if run.cfg.devices is None else [jax.devices()[i] for i in run.cfg.devices]
    assert list(mesh.devices.flat) == list(devs)


# ----------------------------------------------------------------------------
# Seed-API forms of parallelize
# ----------------------------------------------------------------------------

DP = CONFIGS["dp"]


def test_get_input_batch_form_returns_three():
    ref = reference("mlp")
    batch = ref.batch
    out = parallelize(
        make_train_step(ref.model, TX, with_grads=True),
        init_params=ref.init,
        get_input_batch=lambda: {k: jnp.asarray(v) for k, v in batch.items()},
        mesh=DP.mesh,
        rules=DP.rules,
    )
    assert len(out) == 3
    fun, init, get_batch = out
    b = get_batch()
    for k in batch:
        np.testing.assert_array_equal(np.asarray(b[k]), batch[k])
        assert b[k].sharding == fun.batch_shardings[k]
        assert norm_spec(b[k].sharding.spec) == ("data",)
        assert b[k].addressable_shards[0].data.shape == (batch[k].shape[0] // 8, *batch[k].shape[1:])
    state = init()
    for i in range(STEPS):
        loss, state, _grads = fun(state, b)
        np.testing.assert_allclose(float(loss), float(ref.outputs[i][0]), rtol=1e-5, atol=1e-6)
    assert_trees_close(state, ref.outputs[-1][1], what="get_input_batch state")


def test_an_spmd_step_is_the_plan_with_one_placement():
    ref = reference("mlp")
    fun, _ = parallelize(make_train_step(ref.model, TX), init_params=ref.init, initial_batch=ref.batch,
                         mesh=DP.mesh, rules=DP.rules)
    plan = fun.plan
    assert plan.placements == [fun.placement] and len(plan.segments) == 1 and plan.schedule is None
    assert plan.transfers() == []
    assert fun.placement.mesh == fun.mesh and not fun.placement.defer
    # every input the step reads lives on that one placement; the whole step is its one segment
    assert set(plan.input_placement.values()) == {fun.placement}
    assert len(plan.segments[0].eqns) == len(plan.jaxpr.eqns) > 0


def _batch_forms():
    return ["numpy", "jax_on_device_5", "jax_on_other_mesh"]


@pytest.mark.parametrize("form", _batch_forms())
def test_initial_batch_form_returns_two(form):
    ref = reference("mlp")
    if form == "numpy":
        batch = ref.batch
    elif form == "jax_on_device_5":
        batch = jax.device_put(ref.batch, jax.devices()[5])
    else:
        other = Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("a", "b"))
        batch = jax.device_put(ref.batch, NamedSharding(other, P(None, "b")))
    out = parallelize(
        make_train_step(ref.model, TX), init_params=ref.init, initial_batch=batch, mesh=DP.mesh, rules=DP.rules
    )
    assert len(out) == 2
    fun, init = out
    state = init()
    for i in range(2):
        loss, state = fun(state, batch)
        np.testing.assert_allclose(float(loss), float(ref.outputs[i][0]), rtol=1e-5, atol=1e-6)
    assert_trees_close(state, ref.outputs[1][1], what=f"initial_batch={form}")
    for _, arr, names in boxed_leaves(state):
        assert set(arr.sharding.device_set) == set(jax.devices())


# ----------------------------------------------------------------------------
# Donation
# ----------------------------------------------------------------------------


def test_donation_deletes_old_state_and_matches_reference():
    ref = reference("mlp")
    fun, init = parallelize(
        make_train_step(ref.model, TX, with_grads=True),
        init_params=ref.init,
        initial_batch=ref.batch,
        mesh=CONFIGS["dp_tp"].mesh,
        rules=CONFIGS["dp_tp"].rules,
        donate=True,
    )
    state = init()
    for i in range(STEPS):
        old = state
        loss, state, _grads = fun(state, ref.batch)
        jax.block_until_ready(state)
        assert all(a.is_deleted() for a in jax.tree.leaves(old)), f"step {i}: old state not donated"
        assert not any(a.is_deleted() for a in jax.tree.leaves(state))
        np.testing.assert_allclose(float(loss), float(ref.outputs[i][0]), rtol=1e-5, atol=1e-6)
    assert_trees_close(state, ref.outputs[-1][1], what="donated loop")
    _check_tree_placement(state, CONFIGS["dp_tp"], "donated state")


# ----------------------------------------------------------------------------
# Parameters are born sharded
# ----------------------------------------------------------------------------


class Big(nn.Module):
    w_init: object = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_logical_partitioning(self.w_init, ("embed", None)), (2048, 2048))
        return x @ w


@pytest.mark.parametrize("init_name", ["normal", "zeros"])
def test_params_born_sharded(init_name):
    model = Big(w_init=nn.initializers.normal(0.02) if init_name == "normal" else nn.initializers.zeros)
    whole = 2048 * 2048 * 4

    def init_params():
        return model.init(jax.random.key(3), jnp.ones((8, 2048)))

    _fun, init = parallelize(
        lambda p, b: jnp.sum(model.apply(p, b)),
        init_params=init_params,
        initial_batch=np.ones((8, 2048), np.float32),
        mesh={"data": 8},
        rules=[("embed", "data"), ("batch", "data")],
    )
    stats = init.lower().compile().memory_analysis()
    per_device = stats.output_size_in_bytes + stats.temp_size_in_bytes
    assert stats.output_size_in_bytes == whole // 8
    # the one-device init holds the whole parameter (plus its RNG temporaries)
    one = jax.jit(init_params).lower().compile().memory_analysis()
    assert one.output_size_in_bytes == whole
    assert per_device <= (one.output_size_in_bytes + one.temp_size_in_bytes) / 4
    if init_name == "zeros":
        assert per_device < whole / 4
    else:
        # threefry needs ~3 shard-sized temporaries (4 shards = whole/2 in all): never the whole
        assert per_device < 0.6 * whole

    params = init()
    w = params["params"]["w"].value
    assert w.shape == (2048, 2048)
    assert norm_spec(w.sharding.spec) == ("data",)
    assert len(w.addressable_shards) == 8
    assert {s.device for s in w.addressable_shards} == set(jax.devices())
    assert all(s.data.shape == (256, 2048) for s in w.addressable_shards)
    assert all(s.data.nbytes == whole // 8 for s in w.addressable_shards)
    if init_name == "normal":  # same values as the one-device init
        ref = jax.jit(init_params)()["params"]["w"].value
        np.testing.assert_array_equal(np.asarray(w), np.asarray(ref))


# ----------------------------------------------------------------------------
# Path rules, the report, reprs
# ----------------------------------------------------------------------------


def test_param_rules_shard_plain_dict_and_report():
    shapes = {"encoder": {"w": (16, 64), "b": (64,)}, "head": {"w": (64, 8)}, "big": (1024, 512), "scale": ()}

    def init_params():
        keys = iter(jax.random.split(jax.random.key(0), 8))
        return jax.tree.map(lambda s: jax.random.normal(next(keys), s), shapes, is_leaf=lambda s: isinstance(s, tuple))

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["encoder"]["w"] + p["encoder"]["b"])
        return jnp.mean((h @ p["head"]["w"]) ** 2) * p["scale"] + jnp.sum(p["big"][0])

    fun, init = parallelize(
        loss,
        init_params=init_params,
        initial_batch={"x": np.ones((32, 16), np.float32)},
        mesh={"data": 4, "model": 2},
        rules=[("batch", "data"), ("embed", "data"), ("mlp", "model")],
        # first match wins: encoder/w takes the logical rule, head/w the last one
        param_rules=[(r"encoder/w$", ("embed", "mlp")), (r"/b$", P("model")), (r"w$", P("model", None))],
    )
    want = {"encoder/w": ("data", "model"), "encoder/b": ("model",), "head/w": ("model",), "big": (), "scale": ()}
    assert {k: norm_spec(s.spec) for k, s in leaves_by_path(fun.param_shardings).items()} == want
    params = init()
    devices = set(jax.devices())
    for path, arr in leaves_by_path(params).items():
        check_placement(arr, want[path], devices, {"data": 4, "model": 2}, path)
    ref = jax.jit(init_params)()
    assert_trees_close(params, ref, rtol=1e-6, atol=1e-7, what="path-rule params")

    report = fun.report()
    text = str(report)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("path"))
    for column in ("path", "shape", "dtype", "logical", "PartitionSpec", "mesh", "bytes/device"):
        assert column in header
    row = next(line for line in lines if line.startswith("encoder/w"))
    for cell in ("(16, 64)", "float32", "('embed', 'mlp')", "P('data', 'model')", "data=4xmodel=2", "512 B"):
        assert cell in row, (cell, row)
    assert "P('model',)" in next(line for line in lines if line.startswith("encoder/b"))
    big_row = next(line for line in lines if line.startswith("big"))
    assert "(1024, 512)" in big_row and "2.0 MiB" in big_row and "P()" in big_row
    # totals
    total = (16 * 64 + 64 + 64 * 8 + 1024 * 512 + 1) * 4
    per_device = (16 * 64 // 8 + 64 // 2 + 64 * 8 // 2 + 1024 * 512 + 1) * 4
    assert report.total_bytes == total
    assert report.bytes_per_device() == {d: per_device for d in devices}
    assert any(line.startswith("total") and "5 arrays" in line and "8 devices" in line for line in lines), text
    # one warning: the large replicated tensor that a mesh axis divides (not the small scalar)
    warns = [line for line in lines if line.startswith("warning")]
    assert len(warns) == 1 and "big" in warns[0] and "replicated" in warns[0], warns
    assert report.warnings and "big" in report.warnings[0]

    batch_text = str(fun.report(batch=True))
    assert "('batch',)" in batch_text and "P('data',)" in batch_text and "(32, 16)" in batch_text

    assert repr(fun) == "ShardedFunction(loss, mesh={'data': 4, 'model': 2}, 5 params)"
    assert repr(report).startswith("ShardingReport(5 arrays, ")
    assert "'batch'->'data'" in repr(fun.rules) and "'mlp'->'model'" in repr(fun.rules)
    assert str(fun) == repr(fun) and "loss" in text.splitlines()[0]


def test_outputs_that_mirror_params_keep_their_shardings_even_when_built_fresh():
    """New params and a fresh optimizer state built with no data dependence on the old ones
    (the compiler alone would replicate them) still come back in the params' shardings."""
    ref = reference("mlp")
    cfg = CONFIGS["dp_tp"]

    def reset(state, batch):
        loss = jnp.mean((ref.model.apply(state["params"], batch["x"]) - batch["y"]) ** 2)
        fresh = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype) + loss, state["params"])
        return loss, {"params": fresh, "opt": TX.init(fresh)}

    fun, init = parallelize(reset, init_params=ref.init, initial_batch=ref.batch, mesh=cfg.mesh, rules=cfg.rules)
    loss, state = fun(init(), ref.batch)
    np.testing.assert_allclose(float(loss), float(ref.outputs[0][0]), rtol=1e-5, atol=1e-6)
    _check_tree_placement(state, cfg, "fresh state")
    for arr in jax.tree.leaves(state["params"]):
        np.testing.assert_allclose(np.asarray(arr), float(loss), rtol=1e-6)
    loss2, _ = fun(state, ref.batch)  # fed straight back
    assert np.isfinite(float(loss2))
