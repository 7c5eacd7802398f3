"""A batch left replicated because the rules given have no rule for its logical name is warned about."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import norm_spec
from jax.sharding import PartitionSpec as P

from multimesh.jax import build_mesh, parallelize, register_task, with_sharding_constraint

pytestmark = pytest.mark.devices(8)

MESH = {"data": 4, "model": 2}
BATCH = {"x": np.ones((8, 16), np.float32), "y": np.ones((8,), np.float32)}
IGNORED = r"parallelize: the rule for logical name 'mlp' matches nothing"  # the model names nothing: rules only


def init():
    return {"w": jnp.ones((16, 4))}


def loss(p, b):
    return jnp.sum((b["x"] @ p["w"]).sum(-1) - b["y"])


def build(fun=loss, batch=BATCH, **options):
    return parallelize(fun, init_params=init, initial_batch=batch, **options)


def test_rules_without_a_batch_rule_warn_naming_the_leaves_and_the_rule():
    with pytest.warns(UserWarning) as caught:
        fn, _ = build(mesh=MESH, rules=[("mlp", "model")])
    messages = [str(w.message) for w in caught if "matches nothing" not in str(w.message)]  # ('mlp': unused)
    assert len(messages) == 1, messages
    assert ("the rules have no rule for the batch's logical name 'batch', so batch leaves 'x', 'y' are replicated "
            "on {'data': 4, 'model': 2} devices [0-7]") in messages[0]
    assert "add the rule ('batch', 'data') to shard them over 'data', or ('batch', None)" in messages[0]
    assert all(norm_spec(s.spec) == () for s in jax.tree.leaves(fn.batch_shardings))


def test_the_suggested_axis_divides_the_batch():
    with pytest.warns(UserWarning, match=r"add the rule \('batch', 'fsdp'\)"):
        build(batch={"x": np.ones((2, 16), np.float32), "y": np.ones((2,), np.float32)},
              mesh={"data": 4, "fsdp": 2}, rules=[("embed", None)])


@pytest.mark.parametrize("options", [
    dict(mesh=MESH, rules=[("batch", "data")]),                  # the rule is there
    dict(mesh=MESH, rules=[("batch", None), ("mlp", "model")]),  # replicated on purpose
    dict(mesh=MESH, rules=[("mlp", "model")],                    # no mesh axis divides 3
         batch={"x": np.ones((3, 16), np.float32), "y": np.ones((3,), np.float32)}),
    dict(mesh={"data": 8}, rules=[("mlp", "data")], batch_spec=(None,)),  # the batch spec names nothing
    dict(mesh={"model": 8}, rules=[("mlp", "model")]),           # tensor parallelism: its axis is the model's
])
def test_no_warning_when_nothing_is_missing(options):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=IGNORED)
        build(**options)


def test_no_warning_when_the_step_constrains_the_batch():
    def constrained(p, b):
        return loss(p, {"x": with_sharding_constraint(b["x"], P("data")), "y": with_sharding_constraint(b["y"], P())})

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=IGNORED)
        fn, _ = build(constrained, mesh=MESH, rules=[("mlp", "model")])
    assert norm_spec(fn.batch_shardings["x"].spec) == ("data",)


def test_without_rules_only_the_replicated_parameters_warning():
    with pytest.warns(UserWarning) as caught:
        build(mesh=MESH)
    assert [str(w.message) for w in caught if "no rule for the batch" in str(w.message)] == []


def test_a_stage_whose_rules_lack_the_batch_rule_is_named():
    devs = jax.devices()
    stage = build_mesh({"data": 2, "model": 2}, devs[4:])

    def staged(p, b):
        with jax.named_scope("head"):
            return loss(p, b)

    with register_task("head", mesh=stage, logical_axes=[("mlp", "model")]):
        with pytest.warns(UserWarning, match=r"batch leaves 'x', 'y' are replicated on head on \{'data': 2, "
                                             r"'model': 2\} devices \[4-7\].*\('batch', 'data'\)"):
            build(staged, mesh=MESH, rules=[("batch", "data")])


def init_own_sharding():
    """A model that shards its own parameters: mesh axes in its metadata, no logical names for rules."""
    import flax.linen as nn
    return {"w": nn.Partitioned(jnp.ones((16, 4)), names=(None, "model"))}


def own_loss(p, b):
    return jnp.sum((b["x"] @ p["w"].unbox()).sum(-1) - b["y"])


def test_a_model_that_shards_its_own_parameters_is_told_its_batch_is_replicated():
    with pytest.warns(UserWarning) as caught:
        fn, _ = parallelize(own_loss, init_params=init_own_sharding, initial_batch=BATCH, mesh=MESH)
    messages = [str(w.message) for w in caught if "batch" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert ("the model shards its own parameters (over 'model') and no rule names the batch's logical name "
            "'batch', so batch leaves 'x', 'y' are replicated on {'data': 4, 'model': 2} devices [0-7]") in messages[0]
    assert "pass rules=[('batch', 'data')] to shard them over 'data', or ('batch', None)" in messages[0]
    assert all(norm_spec(s.spec) == () for s in jax.tree.leaves(fn.batch_shardings))
    (w,) = jax.tree.leaves(fn.param_shardings)
    assert norm_spec(w.spec) == (None, "model")


def test_a_model_that_shards_its_own_parameters_with_a_batch_rule_is_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn, _ = parallelize(own_loss, init_params=init_own_sharding, initial_batch=BATCH, mesh=MESH,
                            rules=[("batch", "data")])
    assert norm_spec(fn.batch_shardings["x"].spec) == ("data",)
