"""Errors say what is wrong, where, and how to fix it; a call with no rules warns.

All of these fail while shardings are derived, before anything is compiled.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    MLP,
    leaves_by_path,
    make_init,
    make_train_step,
    mlp_batch,
    norm_spec,
)
from jax.sharding import PartitionSpec as P

from multimesh.jax import RuleError, build_mesh, parallelize
from multimesh.jax.flax import parallelize_step

pytestmark = pytest.mark.devices(8)

MESH = {"data": 4, "model": 2}


class Tiny(nn.Module):
    """One Dense layer whose kernel carries the given annotation."""

    features: int = 8
    names: tuple = ("embed", "mlp")
    physical: bool = False

    @nn.compact
    def __call__(self, x):
        wrap = nn.with_partitioning if self.physical else nn.with_logical_partitioning
        return nn.Dense(self.features, kernel_init=wrap(nn.initializers.lecun_normal(), self.names))(x)


def _build(model=None, *, batch=None, **kw):
    model = model or Tiny()
    batch = batch if batch is not None else {"x": np.ones((16, 16), np.float32)}

    def fun(p, b):
        return jnp.sum(model.apply(p, b["x"]))

    return parallelize(fun, init_params=lambda: model.init(jax.random.key(0), jnp.ones((2, 16))),
                       initial_batch=batch, **kw)


# ----------------------------------------------------------------------------
# Rules and specs
# ----------------------------------------------------------------------------


def test_unknown_mesh_axis_in_rule():
    with pytest.raises(RuleError, match=r"rule \('mlp', 'modle'\) names mesh axis 'modle', but the mesh has axes "
                                        r"\{'data': 4, 'model': 2\}"):
        _build(mesh=MESH, rules=[("batch", "data"), ("mlp", "modle")])


def test_unknown_mesh_axis_in_flax_partitioning():
    with pytest.raises(RuleError, match=r"Dense_0/kernel.*names mesh axis 'tensor'"):
        _build(Tiny(names=("tensor", None), physical=True), mesh=MESH, rules=[("batch", "data")])


def test_logical_names_in_a_physical_path_rule_suggest_a_tuple():
    with pytest.raises(RuleError, match=r"names mesh axis 'hidden'.*give a tuple of logical names, e\.g\. "
                                        r"\(.hidden.,\)"):
        _build(mesh=MESH, rules=[("hidden", "model")], param_rules={"bias": P("hidden")})


def test_mesh_axis_used_twice_in_one_spec():
    with pytest.raises(RuleError, match=r"Dense_0/kernel.*uses mesh axis 'data' twice"):
        _build(Tiny(names=("data", "data"), physical=True), mesh=MESH, rules=[("batch", "data")])


def test_two_logical_names_on_one_mesh_axis_is_not_an_error():
    # resolution, not a user error: the first rule takes 'data', the second is skipped
    fun, _ = _build(mesh=MESH, rules=[("embed", "data"), ("mlp", "data"), ("batch", "data")])
    assert norm_spec(fun.param_shardings["params"]["Dense_0"]["kernel"].value.spec) == ("data",)


def test_indivisible_dimension_in_strict_mode():
    with pytest.raises(
        RuleError,
        match=r"dimension 1 \('mlp', size 12\) of the array of .*params/Dense_0/kernel.* with shape \(16, 12\) "
        r"is not divisible by mesh axes \('data',\) \(total size 8\)",
    ):
        _build(Tiny(features=12), mesh={"data": 8}, rules=[("embed", None), ("mlp", "data"), ("batch", "data")],
               strict=True)


def test_indivisible_dimension_is_replicated_when_not_strict():
    fun, _ = _build(Tiny(features=12), mesh={"data": 8}, rules=[("embed", None), ("mlp", "data"), ("batch", "data")])
    assert norm_spec(fun.param_shardings["params"]["Dense_0"]["kernel"].value.spec) == ()


def test_unknown_logical_name_in_strict_mode():
    params = {"w": jnp.ones((16, 8))}
    with pytest.raises(RuleError, match=r"strict rules: logical name 'hidden' of the array .*'w'.* has no rule"):
        parallelize(lambda p, b: jnp.sum(b["x"] @ p["w"]), init_params=lambda: params,
                    initial_batch={"x": np.ones((8, 16), np.float32)}, mesh=MESH,
                    rules=[("batch", "data"), ("embed", None)], param_rules={"w": ("embed", "hidden")}, strict=True)


def test_flax_linen_metadata_without_rule_in_strict_mode():
    with pytest.raises(RuleError, match=r"logical name 'embed' of the array .*Dense_0/kernel.* has no rule; add "
                                        r"\('embed', <mesh axes>\) or \('embed', None\)"):
        _build(mesh=MESH, rules=[("batch", "data"), ("mlp", "model")], strict=True)
    # a None rule says "replicated on purpose"
    fun, _ = _build(mesh=MESH, rules=[("batch", "data"), ("mlp", "model"), ("embed", None)], strict=True)
    assert norm_spec(fun.param_shardings["params"]["Dense_0"]["kernel"].value.spec) == (None, "model")


class _NNXTiny(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(16, 8, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                     ("embed", "vocab")), rngs=rngs)

    def __call__(self, batch):
        return jnp.mean(self.a(batch["x"]) ** 2)


def test_flax_nnx_metadata_without_rule_in_strict_mode():
    def init():
        return nnx.split(_NNXTiny(nnx.Rngs(0)), nnx.Param, ...)[1]

    with pytest.raises(RuleError, match=r"logical name 'vocab' of the array .*a/kernel.* has no rule"):
        parallelize(lambda p, b: jnp.sum(b["x"]), init_params=init, initial_batch={"x": np.ones((8, 16), np.float32)},
                    mesh=MESH, rules=[("batch", "data"), ("embed", None)], strict=True)


def test_logical_spec_longer_than_rank():
    with pytest.raises(RuleError, match=r"logical spec \('embed', 'mlp', 'extra'\) of rank 3 is longer than the "
                                        r"rank 2 of the array .*Dense_0/kernel.* with shape \(16, 8\)"):
        _build(Tiny(names=("embed", "mlp", "extra")), mesh=MESH, rules=[("batch", "data")])


def test_physical_spec_longer_than_rank():
    with pytest.raises(RuleError, match=r"longer than the rank 2 of the array .*'w'"):
        parallelize(lambda p, b: jnp.sum(p["w"]), init_params=lambda: {"w": jnp.ones((16, 8))},
                    initial_batch={"x": np.ones((8, 16), np.float32)}, mesh=MESH, rules=[("batch", "data")],
                    param_rules={"w": P("data", None, "model")})


@pytest.mark.parametrize("spec", [P(None), P(None, None), (None,)], ids=["P(None)", "P(None,None)", "(None,)"])
def test_a_spec_sharding_nothing_replicates_a_scalar(spec):
    """``param_rules=[(".*", P(None))]`` reaches an optimizer's step count (a scalar): a spec that shards
    nothing means replicated, whatever its length; the matrix keeps its (replicated) spec."""
    def init():
        params = {"w": jnp.ones((16, 8))}
        return {"params": params, "opt": optax.adam(1e-3).init(params)}

    step, init_fn = parallelize(lambda s, b: jnp.sum(b["x"] @ s["params"]["w"]), init_params=init,
                                   initial_batch={"x": np.ones((8, 16), np.float32)}, mesh=MESH,
                                   rules=[("batch", "data")], param_rules=[(r".*", spec)])
    shardings = leaves_by_path(step.param_shardings)
    assert shardings["opt/0/count"].spec == P() and shardings["opt/0/count"].is_fully_replicated
    assert shardings["params/w"].is_fully_replicated
    assert step(init_fn(), {"x": np.ones((8, 16), np.float32)}).shape == ()


def test_a_spec_sharding_a_scalar_says_what_fits():
    with pytest.raises(RuleError, match=r"P\('data',\) is longer than the rank 0 .*'n'.*e\.g\. \(\)"):
        parallelize(lambda p, b: jnp.sum(b["x"]) * p["n"], init_params=lambda: {"n": jnp.ones(())},
                    initial_batch={"x": np.ones((8, 16), np.float32)}, mesh=MESH, rules=[("batch", "data")],
                    param_rules=[("n", P("data"))])


def test_malformed_rule():
    with pytest.raises(RuleError, match=r"rule #1 .*must be a pair"):
        _build(mesh=MESH, rules=[("batch", "data"), ("mlp",)])


# ----------------------------------------------------------------------------
# Devices, batches, arguments
# ----------------------------------------------------------------------------


def test_devices_do_not_fit_mesh_shape():
    with pytest.raises(ValueError, match=r"6 devices do not fit mesh shape \{'data': 4, 'model': 2\}, which needs 8"):
        _build(mesh=MESH, devices=jax.devices()[:6], rules=[("batch", "data")])
    with pytest.raises(ValueError, match=r"do not fit mesh shape"):
        build_mesh({"data": 3, "model": -1})


def test_a_mesh_larger_than_one_cpu_says_how_to_simulate_devices():
    """With JAX's one default CPU device, the error says how to simulate more (XLA_FLAGS)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = "from multimesh.jax import build_mesh; build_mesh({'data': 4, 'model': 2})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "1 devices do not fit mesh shape {'data': 4, 'model': 2}, which needs 8" in last
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts" in last


def test_batch_not_divisible_over_data_axes():
    with pytest.raises(RuleError, match=r"dimension 0 \('batch'\) of the batch 'x' has size 10, which does not "
                                        r"divide over mesh axes \('data',\)"):
        _build(batch={"x": np.ones((10, 16), np.float32)}, mesh=MESH, rules=[("batch", "data")])
    # stacked data axes: 12 divides over data (4) but not data x fsdp (8)
    with pytest.raises(RuleError, match=r"batch 'x' has size 12.*\('data', 'fsdp'\)"):
        _build(batch={"x": np.ones((12, 16), np.float32)}, mesh={"data": 4, "fsdp": 2},
               rules=[("batch", "data"), ("batch", "fsdp")])


def test_batch_from_get_input_batch_not_divisible():
    model = Tiny()
    with pytest.raises(RuleError, match=r"batch 'x' has size 6"):
        parallelize(lambda p, b: jnp.sum(model.apply(p, b["x"])),
                    init_params=lambda: model.init(jax.random.key(0), jnp.ones((2, 16))),
                    get_input_batch=lambda: {"x": jnp.ones((6, 16))}, mesh={"data": 8}, rules=[("batch", "data")])


def test_init_params_must_be_zero_argument_function():
    with pytest.raises(TypeError, match=r"init_params must be a zero-argument function.*requires \['key'\]"):
        parallelize(lambda p, b: p, init_params=lambda key: {"w": jnp.ones(3)},
                    initial_batch=np.ones((8, 3), np.float32))
    with pytest.raises(TypeError, match=r"init_params must be a zero-argument function, got dict"):
        parallelize(lambda p, b: p, init_params={"w": jnp.ones(3)}, initial_batch=np.ones((8, 3), np.float32))
    with pytest.raises(TypeError, match=r"get_input_batch must be a zero-argument function"):
        parallelize(lambda p, b: p, init_params=lambda: {"w": jnp.ones(3)}, get_input_batch=lambda n: n)


def test_needs_exactly_one_batch_source():
    with pytest.raises(TypeError, match=r"exactly one of get_input_batch=.*or initial_batch="):
        parallelize(lambda p, b: p, init_params=lambda: {"w": jnp.ones(3)})
    with pytest.raises(TypeError, match=r"exactly one of get_input_batch=.*or initial_batch="):
        parallelize(lambda p, b: p, init_params=lambda: {"w": jnp.ones(3)},
                    get_input_batch=lambda: np.ones((8, 3)), initial_batch=np.ones((8, 3)))


def test_parallelize_step_arguments():
    mesh = build_mesh(MESH)
    batch = {"x": np.ones((8, 16), np.float32)}
    with pytest.raises(TypeError, match="exactly one of global_batch= or local_batch="):
        parallelize_step(Tiny(), optax.sgd(0.1), mesh)
    with pytest.raises(TypeError, match="exactly one of global_batch= or local_batch="):
        parallelize_step(Tiny(), optax.sgd(0.1), mesh, global_batch=batch, local_batch=batch)
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh or an \{axis: size\} dict, got tuple"):
        parallelize_step(Tiny(), optax.sgd(0.1), (4, 2), global_batch=batch)


@pytest.fixture(scope="module")
def mlp_step():
    model, tx = MLP(), optax.sgd(0.1)
    batch = mlp_batch()
    init = make_init(model, tx, batch["x"][:2])
    fun, _ = parallelize(make_train_step(model, tx), init_params=init, initial_batch=batch, mesh=MESH,
                         rules=[("batch", "data"), ("mlp", "model")])
    return fun, jax.eval_shape(init), batch


def test_params_with_different_tree_structure(mlp_step):
    fun, abstract, batch = mlp_step
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    del params["params"]["params"]["Dense_1"]["bias"]
    with pytest.raises(ValueError, match=r"(?s)params has a different tree structure.*missing: params/params/Dense_1/bias"):
        fun(params, batch)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    params["extra"] = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"(?s)different tree structure.*unexpected: extra"):
        fun(params, batch)


def test_batch_with_different_tree_structure(mlp_step):
    fun, abstract, batch = mlp_step
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    with pytest.raises(ValueError, match=r"(?s)batch has a different tree structure.*missing: y.*unexpected: z"):
        fun(params, {"x": batch["x"], "z": batch["y"]})


# ----------------------------------------------------------------------------
# No rules: a warning that everything is replicated
# ----------------------------------------------------------------------------


def test_no_rules_warns_everything_replicated():
    """The batch too, unless the mesh has an axis named ``batch``: the warning names the rule for data
    parallelism over the mesh's own axis."""
    with pytest.warns(UserWarning, match=r"no rules=.*every parameter and the batch are replicated on all 8 "
                                         r"devices: each computes the whole step. Pass rules=\[\('batch', 'data'\)\]"):
        fun, _ = _build()
    assert all(norm_spec(s.spec) == () for s in jax.tree.leaves(fun.param_shardings))
    assert all(norm_spec(s.spec) == () for s in jax.tree.leaves(fun.batch_shardings))
    assert dict(fun.mesh.shape) == {"data": 8}
    with pytest.warns(UserWarning, match=r"no rules=.*every parameter is replicated on all 8 devices; pass"):
        fun, _ = _build(mesh={"batch": 8})
    assert all(norm_spec(s.spec) == ("batch",) for s in jax.tree.leaves(fun.batch_shardings))


def test_no_warning_with_rules_or_mesh_axis_annotations():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _build(mesh=MESH, rules=[("batch", "data"), ("mlp", "model"), ("embed", None)])
        fun, _ = _build(Tiny(names=(None, "model"), physical=True), mesh=MESH, rules=[("batch", "data")])
    specs = {p: norm_spec(s.spec) for p, s in leaves_by_path(fun.param_shardings).items()}
    assert specs["params/Dense_0/kernel/value"] == (None, "model"), specs
    # without the batch's rule, only the batch left replicated is told (the model shards its own parameters)
    with pytest.warns(UserWarning) as caught:
        _build(Tiny(names=(None, "model"), physical=True), mesh=MESH)
    assert [str(w.message)[:61] for w in caught] == ["parallelize: the model shards its own parameters (over 'model"]


# -- tasks and registrations -----------------------------------------------------------


def _double(x):
    return 2 * x


def test_task_devices_repeated_or_unknown_are_refused():
    from multimesh.jax import task

    d = jax.devices()
    with pytest.raises(ValueError, match=r"task 'rep': devices \[0\] appear more than once in devices=\[0, 0\]"):
        task(_double, "rep", devices=[d[0], d[0]])
    with pytest.raises(ValueError, match=r"task 'ids': device id 99 does not exist; ids are \[0, 1, 2"):
        task(_double, "ids", devices=[0, 99])
    with pytest.raises(TypeError, match=r"task 'bad': devices must be jax devices or integer ids, got 'cpu'"):
        task(_double, "bad", devices=["cpu"])


def test_task_integer_device_ids_run_on_those_devices():
    from multimesh.jax import task

    t = task(_double, "ids", devices=np.array([[4, 5], [6, 7]]), device_axes=("a", "b"))
    assert t.placement.mesh.devices.tolist() == [[jax.devices()[i] for i in (4, 5)], [jax.devices()[i] for i in (6, 7)]]
    out = t(jnp.arange(4.0))
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2.0, 4.0, 6.0])
    assert out.sharding.device_set == set(jax.devices()[4:])


def test_a_task_inside_a_task_on_other_devices_names_both():
    from multimesh.jax import task

    inner = task(_double, "inner", devices=jax.devices()[4:])
    outer = task(lambda x: inner(x) + 1, "outer", devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"task 'inner' \(.*devices \[4-7\]\) is called inside task 'outer' "
                                         r"\(.*devices \[0-3\]\), on other devices"):
        outer(jnp.ones(4))
    same = task(lambda x: task(_double, "again", devices=jax.devices()[:4])(x) + 1, "same", devices=jax.devices()[:4])
    np.testing.assert_array_equal(np.asarray(same(jnp.ones(4))), [3.0] * 4)  # same devices: runs inline


def test_register_task_invalid_regex_names_it():
    from multimesh.jax import register_task

    with pytest.raises(ValueError, match=r"register_task: regex='layers_\(' is not a valid regular expression"):
        register_task("layers_(", devices=jax.devices()[:4])


def test_register_task_matching_nothing_warns_or_raises_under_strict():
    from multimesh.jax import register_task

    model, tx = MLP(), optax.sgd(0.1)
    init = make_init(model, tx, mlp_batch()["x"][:2])
    with register_task(r"no_such_layer_\d+", devices=jax.devices()[:4]):
        with pytest.warns(UserWarning, match=r"register_task patterns \['no_such_layer_\\\\d\+'\] match no Flax "
                                             r"module or jax.named_scope of the step, .*names seen are: .*Dense_0"):
            parallelize(make_train_step(model, tx), init_params=init, initial_batch=mlp_batch(), mesh=MESH,
                        rules=[("batch", "data")])
        with pytest.raises(ValueError, match="match no Flax module"):
            parallelize(make_train_step(model, tx), init_params=init, initial_batch=mlp_batch(), mesh=MESH,
                        rules=[("batch", "data")], strict=True)


def test_a_task_mesh_given_as_a_shape_or_axes_given_as_a_string_is_refused():
    from multimesh.jax import task

    f = lambda x: x  # noqa: E731
    with pytest.raises(TypeError, match=r"task 'f': mesh= must be a jax.sharding.Mesh or a TaskMesh, got dict "
                                        r"\{'data': 4\}; make one with multimesh.jax.build_mesh\(\{'data': 4\}, devices\)"):
        task(f, "f", mesh={"data": 4})
    with pytest.raises(TypeError, match=r"task 'g': device_axes must be a sequence of axis names, got the string "
                                        r"'xy'; write \('xy',\) for one axis"):
        task(f, "g", devices=jax.devices()[:2], device_axes="xy")
    assert task(f, "h", devices=jax.devices()[:2], device_axes=("xy",)).placement.mesh.axis_names == ("xy",)
