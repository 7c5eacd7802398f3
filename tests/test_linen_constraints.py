"""Flax Linen's `nn.with_logical_constraint` hints resolved by multimesh (SPMD, in tasks, deferred).

The reference for the constraints is Flax's own: the same step under
``jax.jit`` with a mesh and Flax's rules in context. The reference for the
values is the step on one device.
"""

from __future__ import annotations

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import partitioning as nn_partitioning
from helpers import check_mpmd_against_reference, norm_spec

from multimesh.core.placement import use_placement
from multimesh.jax import build_mesh, parallelize, register_task, task
from multimesh.plan.programs import run_program
from multimesh.trace.constraints import resolve_deferred
from multimesh.trace.linen_constraints import routing_linen_constraints

pytestmark = pytest.mark.devices(8)

MESH = {"data": 4, "model": 2}
RULES = [("batch", "data"), ("mlp", "model"), ("length", None), ("embed", None)]
BATCH, LENGTH, EMBED, MLP = 8, 4, 16, 32
HINTS_PER_BLOCK = 3


def _kernel(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    """A MaxText-style block: activations hinted with logical names, the model unchanged by multimesh."""

    @nn.compact
    def __call__(self, x):
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = nn.relu(nn.Dense(MLP, use_bias=False, kernel_init=_kernel(("embed", "mlp")))(x))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        y = nn.Dense(EMBED, use_bias=False, kernel_init=_kernel(("mlp", "embed")))(h)
        return nn.with_logical_constraint(x + y, ("batch", "length", "embed"))


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = Block(name=f"layers_{i}")(x)
        return x


model = Model()
tx = optax.sgd(0.1)
X = np.random.RandomState(0).randn(BATCH, LENGTH, EMBED).astype(np.float32)


def init():
    return model.init(jax.random.key(0), X)


def get_batch():
    return {"x": jnp.asarray(X)}


def loss_fn(params, batch):
    return jnp.mean(model.apply(params, batch["x"]) ** 2)


def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return loss, grads, optax.apply_updates(params, tx.update(grads, tx.init(params))[0])


_CONSTRAINT = re.compile(r"sdy\.sharding_constraint .*<@\w+, (\[.*\])> : tensor<(\d+x\d+x\d+)xf32>")


def activation_constraints(text: str) -> collections.Counter:
    """(shape, sharding) of every constraint on an activation (rank 3) in lowered text."""
    return collections.Counter((m.group(2), m.group(1)) for m in map(_CONSTRAINT.search, text.splitlines()) if m)


def flax_own_constraints() -> collections.Counter:
    """What Flax itself imposes: the step under `jax.jit` with a mesh and its rules in context."""
    with jax.set_mesh(build_mesh(MESH)), nn_partitioning.axis_rules(RULES):
        return activation_constraints(jax.jit(step).lower(init(), get_batch()).as_text())


def test_hints_become_the_constraints_flax_itself_imposes():
    want = flax_own_constraints()
    # 2 blocks x 3 hints, forward and backward, less the backward of the hint on the batch (not differentiated)
    assert sum(want.values()) == 2 * 2 * HINTS_PER_BLOCK - 1 and ("8x4x32", '[{"data"}, {}, {"model"}]') in want
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=MESH, rules=RULES)
    assert activation_constraints(fn.lower(init_p(), get_b()).as_text()) == want
    check_mpmd_against_reference(step, init, get_batch, mesh=MESH, rules=RULES)


def test_an_activation_gets_the_sharding_its_hint_names():
    fn, init_p = parallelize(lambda p, b: model.apply(p, b["x"]), init_params=init, initial_batch=get_batch(),
                             mesh=MESH, rules=[("batch", "data"), ("embed", "model")])
    out = fn(init_p(), get_batch())
    assert norm_spec(out.sharding.spec) == ("data", None, "model")
    assert out.addressable_shards[0].data.shape == (BATCH // 4, LENGTH, EMBED // 2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(model.apply)(init(), X)), rtol=1e-5, atol=1e-6)


def test_flax_rules_context_around_parallelize_gives_its_rules():
    with nn_partitioning.axis_rules(RULES):
        fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=MESH)
    assert activation_constraints(fn.lower(init_p(), get_b()).as_text()) == flax_own_constraints()
    kernel = fn.param_layout.by_path()["params/layers_0/Dense_0/kernel"]
    assert norm_spec(kernel.spec) == (None, "model")


def test_flax_rules_context_inside_the_step_resolves_its_hints():
    def in_context(params, batch):
        with nn_partitioning.axis_rules(RULES):
            return step(params, batch)

    with pytest.warns(UserWarning, match="no rules="):
        fn, init_p, get_b = parallelize(in_context, init_params=init, get_input_batch=get_batch, mesh=MESH)
    assert activation_constraints(fn.lower(init_p(), get_b()).as_text()) == flax_own_constraints()


def test_without_rules_anywhere_a_hint_does_nothing_as_in_flax():
    with pytest.warns(UserWarning, match="no rules="):
        fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=MESH)
    assert activation_constraints(fn.lower(init_p(), get_b()).as_text()) == {}


def test_fallback_no_constraint_and_raise_error_keep_flax_meaning():
    def hinted(fallback):
        def f(p, b):
            return jnp.sum(nn.with_logical_constraint(b["x"] * p["w"], ("batch", "unknown", None), fallback=fallback))
        return f

    options = dict(init_params=lambda: {"w": jnp.ones(())}, initial_batch=get_batch(), mesh=MESH, rules=RULES)
    fn, init_p = parallelize(hinted(nn_partitioning.RulesFallback.NO_CONSTRAINT), **options)
    assert activation_constraints(fn.lower(init_p(), get_batch()).as_text()) == {}
    fn, init_p = parallelize(hinted(nn_partitioning.RulesFallback.AXIS_IS_UNSHARDED), **options)
    assert set(activation_constraints(fn.lower(init_p(), get_batch()).as_text())) == {
        ("8x4x16", '[{"data"}, {}, {}]')}
    fn, init_p = parallelize(hinted(nn_partitioning.RulesFallback.RAISE_ERROR), **options)
    with pytest.raises(ValueError, match=r"'unknown'.*no rule"):
        fn.lower(init_p(), get_batch())


def program_constraints(fn) -> list[tuple[frozenset, tuple, tuple]]:
    """(devices, shape, spec) of each activation constraint the MPMD programs impose, deferred ones resolved."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "sharding_constraint" and len(eqn.invars[0].aval.shape) == 3:
                s = eqn.params["sharding"]
                found.append((frozenset(d.id for d in s.mesh.devices.flat), eqn.invars[0].aval.shape,
                              norm_spec(s.spec)))
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    walk(inner)

    for program in fn.runtime.programs:
        literals = [jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
                    for v in program.literal_values(program.segments[0])]
        with use_placement(program.placement):
            walk(jax.make_jaxpr(run_program(program, resolve_deferred))(*program.jaxpr.in_avals, *literals).jaxpr)
    return found


def _submeshes():
    devices = jax.devices()
    return build_mesh({"data": 2, "model": 2}, devices[:4]), build_mesh({"data": 2, "model": 2}, devices[4:])


def test_hints_in_registered_tasks_resolve_on_each_stage_submesh():
    first, second = _submeshes()
    with register_task("layers_0", mesh=first, logical_axes=RULES), \
            register_task("layers_1", mesh=second, logical_axes=RULES):
        fn, _ = check_mpmd_against_reference(step, init, get_batch)
    found = program_constraints(fn)
    # each block's 3 hints forward and backward on its stage, less the backward of the hint on the batch
    for devices, on_embed in (({0, 1, 2, 3}, 3), ({4, 5, 6, 7}, 4)):
        here = collections.Counter((shape, spec) for d, shape, spec in found if d == devices)
        assert here == {((BATCH, LENGTH, EMBED), ("data",)): on_embed, ((BATCH, LENGTH, MLP), ("data", None, "model")): 2}


def test_hints_in_an_explicit_task_use_its_rules():
    first, second = _submeshes()

    def two_stages(params, batch):
        p = params["params"]
        h = task(lambda q, x: Block().apply({"params": q}, x), "first", mesh=first,
                 logical_axes=[("batch", "model"), ("mlp", "data")])(p["layers_0"], batch["x"])
        out = task(lambda q, x: Block().apply({"params": q}, x), "second", mesh=second,
                   logical_axes=RULES)(p["layers_1"], h)
        return jnp.mean(out ** 2)

    def two_stage_step(params, batch):
        loss, grads = jax.value_and_grad(two_stages)(params, batch)
        return loss, grads, optax.apply_updates(params, tx.update(grads, tx.init(params))[0])

    fn, _ = check_mpmd_against_reference(two_stage_step, init, get_batch)
    specs = {(d, shape, spec) for d, shape, spec in program_constraints(fn)}
    assert (frozenset({0, 1, 2, 3}), (BATCH, LENGTH, MLP), ("model", None, "data")) in specs
    assert (frozenset({4, 5, 6, 7}), (BATCH, LENGTH, MLP), ("data", None, "model")) in specs


def test_the_routing_is_restored_and_flax_unchanged_outside():
    from flax.linen import spmd

    before = (spmd.get_logical_axis_rules, spmd._with_sharding_constraint_one_fallback)
    with routing_linen_constraints(), routing_linen_constraints():
        assert spmd.get_logical_axis_rules is not before[0]
        # no placement in force here: Flax's own behaviour (no mesh, so no constraint)
        assert float(nn.with_logical_constraint(jnp.ones(()), ())) == 1.0
        assert spmd.get_logical_axis_rules() == ()
    assert (spmd.get_logical_axis_rules, spmd._with_sharding_constraint_one_fallback) == before


class LossModel(nn.Module):
    """`parallelize_step`'s form: the module's call is the loss."""

    @nn.compact
    def __call__(self, batch):
        return jnp.mean(Model(name="model")(batch["x"]) ** 2)


def test_parallelize_step_takes_the_flax_rules_context():
    from multimesh.jax.flax import parallelize_step

    mesh = build_mesh(MESH)
    with nn_partitioning.axis_rules([("embed", "model"), ("mlp", "data")]):  # not standard_rules' choice
        step_fn, state, _ = parallelize_step(LossModel(), tx, mesh, global_batch=get_batch())
    kernel = state.params["params"]["model"]["layers_0"]["Dense_0"]["kernel"]
    kernel = getattr(kernel, "value", kernel)
    assert norm_spec(kernel.sharding.spec) == ("model", "data")
    loss, _ = step_fn(state, get_batch())
    params = LossModel().init(jax.random.key(42), get_batch())
    np.testing.assert_allclose(float(loss), float(jax.jit(LossModel().apply)(params, get_batch())), rtol=1e-5)


def test_flax_rules_naming_an_axis_the_mesh_lacks_are_a_clear_error():
    def in_context(params, batch):
        with nn_partitioning.axis_rules([("batch", "fsdp")]):
            return loss_fn(params, batch)

    with pytest.warns(UserWarning, match="no rules="):
        fn, init_p, get_b = parallelize(in_context, init_params=init, get_input_batch=get_batch, mesh=MESH)
    with pytest.raises(ValueError, match=r"names mesh axis 'fsdp'.*Flax's rules in force.*"
                                         r"nn.with_logical_constraint\(x, \('batch', 'length', 'embed'\)\)"):
        fn.lower(init_p(), get_b())
