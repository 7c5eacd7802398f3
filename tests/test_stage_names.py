"""A `register_task` stage without ``name=`` is named by what its pattern matches (``stem+block.0-1``), not
by the pattern's text, in plans, run stats and schedules; ``name=`` still wins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import StemNet

from multimesh.jax import clear_tasks, microbatch, parallelize, register_task
from multimesh.trace.stage_names import readable_name

pytestmark = pytest.mark.devices(8)


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


@pytest.mark.parametrize("pattern, name", [
    (r"stem|block\.[01]", "stem+block.0-1"),
    (r"blocks\.[0-3]\.mlp", "blocks.0-3.mlp"),
    (r"layers_(0|1|5)", "layers_0-1,5"),
    (r"(encoder|decoder)_[01]", "encoder_0-1+decoder_0-1"),
    (r"block\.0", "block.0"),
    ("layers_3", "layers_3"),
    (r"h_0[0-2]", "h_00+h_01+h_02"),  # a leading zero is not a range
    (r"h_0\d", "h_0*"),  # \\d: any Unicode digit
    (r"layers_(\d+)", "layers_*"),
    (r"stem|layers_\d+", "stem+layers_*"),
    (r".*attn.*", "*attn*"),
])
def test_a_pattern_is_named_by_the_names_it_matches(pattern, name):
    assert readable_name(pattern) == name


def _pipeline(second_name: str | None):
    model, devices = StemNet(), jax.devices()
    init = lambda: model.init(jax.random.key(0), jnp.ones((2, 8)))  # noqa: E731
    loss = microbatch(lambda p, b: jnp.sum(model.apply(p, b["x"]) ** 2), 0, 2, argnum=1, schedule="1f1b")
    with register_task(r"stem|block_[01]", devices=devices[:4]), \
            register_task(r"block_[2-3]", devices=devices[4:], name=second_name):
        fn, init_fn, batch_fn = parallelize(jax.grad(loss), init_params=init,
                                            get_input_batch=lambda: {"x": jnp.ones((8, 8))})
    fn(init_fn(), batch_fn())
    return fn


def test_plans_and_run_stats_name_stages_by_what_they_match():
    fn = _pipeline(None)
    assert [p.name for p in fn.plan.placements] == ["stem+block_0-1", "block_2-3"]
    text = str(fn.plan)
    assert "submesh stem+block_0-1 on" in text and "submesh block_2-3 on" in text, text
    assert "stage 0: stem+block_0-1, stage 1: block_2-3" in text, text
    assert "[" not in repr(fn.plan).split("on [", 1)[1].split("]", 1)[0], repr(fn.plan)  # no class brackets
    stages = {label.split(":", 1)[0] for label in fn.stats.executed}
    assert {"stem+block_0-1", "block_2-3"} <= stages, stages
    assert not any("|" in s or "\\" in s or "[" in s for s in stages), stages
    assert fn.plan.stage_names() == ["stem+block_0-1", "block_2-3"]
    rows = fn.plan.schedule.render(stage_names=fn.plan.stage_names()).splitlines()
    assert rows[1].startswith("stage 1 block_2-3 ") and rows[1].index("|") == rows[0].index("|"), rows


def test_a_given_name_wins():
    fn = _pipeline("tail")
    assert [p.name for p in fn.plan.placements] == ["stem+block_0-1", "tail"]
    assert any(label.startswith("tail:") for label in fn.stats.executed)


def test_a_schedule_drawing_takes_one_name_per_stage():
    fn = _pipeline(None)
    with pytest.raises(ValueError, match=r"stage_names gives 1 names for a schedule of 2 stages"):
        fn.plan.schedule.render(stage_names=["only"])
