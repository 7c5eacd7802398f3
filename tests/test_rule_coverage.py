"""Typos in rules and logical names are warned about, whatever the array's size (`run.rule_coverage`)."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from multimesh.core.rules import RuleError, standard_rules
from multimesh.jax import parallelize, with_sharding_constraint
from multimesh.jax.flax import shard_axes

pytestmark = pytest.mark.devices(8)


class Small(nn.Module):
    """Kernels of 8 KiB: far below the size from which replicated arrays are reported."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64, kernel_init=shard_axes("embed", "mlp"))(x)
        h = with_sharding_constraint(h, P("batch", "mlp"))
        return nn.Dense(16, kernel_init=shard_axes("mlp", "embed"))(h)


MODEL = Small()


def build(rules, mesh=None, **kw):
    def step(p, b):
        return jnp.mean(MODEL.apply(p, b["x"]) ** 2)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn, _, _ = parallelize(step, init_params=lambda: MODEL.init(jax.random.key(0), jnp.zeros((8, 32))),
                               get_input_batch=lambda: {"x": jnp.ones((8, 32))},
                               mesh=mesh or {"data": 4, "model": 2}, rules=rules, **kw)
    return fn, [str(w.message) for w in seen if "rule" in str(w.message)]


def test_a_misspelt_rule_and_the_name_it_missed_are_both_named():
    fn, seen = build([("batch", "data"), ("embed", None), ("mpl", "model")])
    assert len(seen) == 2, seen
    missing, unused = sorted(seen, key=lambda m: "matches nothing" in m)
    assert "logical name 'mlp' has no rule (did you mean 'mpl'?)" in missing
    assert "'params/Dense_0/kernel'" in missing and "a with_sharding_constraint" in missing
    assert "('mlp', None)" in missing
    assert "the rule for logical name 'mpl' matches nothing" in unused and "did you mean 'mlp'?" in unused
    kernel = fn.param_layout.by_path()["params/Dense_0/kernel"]
    assert kernel.spec == P(None, None) and kernel.nbytes < 1 << 20  # small, replicated: still named
    assert [f"parallelize: {w}" for w in fn.report().warnings[:2]] == seen
    assert fn.report(batch=True).warnings[:2] == fn.report().warnings[:2]


def test_correct_rules_are_silent_and_a_none_rule_says_replicated_on_purpose():
    fn, seen = build([("batch", "data"), ("mlp", "model"), ("embed", None)])
    assert seen == [] and fn.report().warnings == []
    assert fn.param_layout.by_path()["params/Dense_0/kernel"].spec == P(None, "model")
    _, seen = build([("batch", "data"), ("mlp", "model")])
    assert len(seen) == 1 and "logical name 'embed' has no rule" in seen[0]


def test_standard_rules_are_generic_defaults_without_a_word():
    """No fsdp axis: embed stays whole on purpose; heads, vocab, ... match nothing in this model: fine."""
    rules = standard_rules(["data", "tensor"])
    assert "embed" in rules.generic and "embed" not in rules.logical_names
    _, seen = build(rules, mesh={"data": 4, "tensor": 2})
    assert seen == []
    _, seen = build(rules + [("extra", "data")], mesh={"data": 4, "tensor": 2})
    assert len(seen) == 1 and "the rule for logical name 'extra' matches nothing" in seen[0]


def test_strict_rules_still_raise_for_a_name_without_a_rule():
    with pytest.raises(RuleError, match=r"strict rules: logical name 'embed' .* has no rule"):
        build([("batch", "data"), ("mlp", "model")], strict=True)


def test_flax_hints_count_as_uses_of_a_rule():
    class Hinted(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.with_logical_constraint(nn.Dense(16)(x), ("batch", "act"))

    model = Hinted()

    def step(p, b):
        return jnp.mean(model.apply(p, b["x"]) ** 2)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        parallelize(step, init_params=lambda: model.init(jax.random.key(0), jnp.zeros((8, 32))),
                    get_input_batch=lambda: {"x": jnp.ones((8, 32))}, mesh={"data": 4, "model": 2},
                    rules=[("batch", "data"), ("act", "model")])
    assert [str(w.message) for w in seen if "rule" in str(w.message)] == []
