"""A `register_task` pattern's alternative that matches no scope of the step is named, with the closest
scope names: the other alternatives still make the step a pipeline, and the misspelt part would run
elsewhere without a word."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import StemNet

from multimesh.jax import parallelize, register_task
from multimesh.trace.pattern_alternatives import alternatives, unmatched_alternatives

pytestmark = pytest.mark.devices(8)


def _build(first: str) -> list[str]:
    model, devices = StemNet(), jax.devices()
    init = lambda: model.init(jax.random.key(0), jnp.ones((2, 8)))  # noqa: E731
    step = jax.grad(lambda p, b: jnp.sum(model.apply(p, b["x"]) ** 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with register_task(first, devices=devices[:4]), register_task(r"block_[23]", devices=devices[4:]):
            parallelize(step, init_params=init, initial_batch={"x": jnp.ones((8, 8))})
    return [str(w.message) for w in caught if "alternative" in str(w.message)]


def test_a_misspelt_alternative_is_named_with_the_closest_scope_names():
    (message,) = _build(r"stme|block_[01]")
    assert "alternative 'stme' of register_task('stme|block_[01]') matches no" in message, message
    assert "the closest scope names are 'stem'" in message, message


def test_every_alternative_matching_warns_nothing():
    assert _build(r"stem|block_[01]") == []


@pytest.mark.parametrize("pattern, parts", [(r"stem|block\.[01]", ["stem", r"block\.[01]"]),
                                            (r"(a|b)c", [r"(a|b)c"]), (r"[|x]|y", ["[|x]", "y"]),
                                            (r"a\|b|c", [r"a\|b", "c"]), ("one", ["one"])])
def test_top_level_alternatives(pattern, parts):
    assert alternatives(pattern) == parts


def test_unmatched_alternatives_leaves_a_pattern_matching_nothing_to_its_own_warning():
    names = ["stem", "block.0", "block.1", "embed.attend"]
    assert unmatched_alternatives(r"stme|block\.[01]", names) == [("stme", ["stem"])]
    assert unmatched_alternatives(r"embed|block\.0", names) == []  # a module's method matches its module
    assert unmatched_alternatives(r"x|y", names) == []  # nothing matches at all: parallelize says so itself
