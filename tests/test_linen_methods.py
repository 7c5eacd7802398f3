"""A Linen module's other methods (``embed.attend``) and tied weights under `register_task`.

Linen runs ``module.method(...)`` under the scope ``module.method``; a pattern
for the module matches its methods too, and a pattern for the whole
``module.method`` takes precedence. A tied embedding is read on the stage of
its lookup and on the stage of its logits (or one stage for both, outside a
pipeline); either way the result is the one-device program's.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import check_mpmd_against_reference, stages

from multimesh.jax import clear_tasks, microbatch, parallelize
from multimesh.trace.implicit import implicit_placement

pytestmark = pytest.mark.devices(8)

VOCAB, EMBED, BATCH, LENGTH = 32, 16, 8, 4


class TiedLM(nn.Module):
    """Embedding lookup, two blocks, logits through the same table (``embed.attend``)."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, EMBED, name="embed")
        x = embed(tokens)
        for i in range(2):
            x = x + jnp.tanh(nn.Dense(EMBED, name=f"layers_{i}")(x))
        return embed.attend(x)


model, tx = TiedLM(), optax.sgd(0.1)
TOKENS = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, VOCAB)


def init():
    return model.init(jax.random.key(0), TOKENS)


def get_batch():
    return {"tokens": TOKENS}


def loss_fn(params, batch):
    logits = model.apply(params, batch["tokens"])
    return -jnp.sum(jax.nn.log_softmax(logits)[..., 0]) / (BATCH * LENGTH)


def make_step(pipelined: bool):
    def step(params, batch):
        f = microbatch(loss_fn, 0, 2, argnum=1, schedule="1f1b") if pipelined else loss_fn
        loss, grads = jax.value_and_grad(f)(params, batch)
        return loss, grads, optax.apply_updates(params, tx.update(grads, tx.init(params))[0])

    return step


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


def test_a_pattern_for_a_module_matches_its_methods():
    with stages(r"embed|layers_0", r"layers_1") as (first, second):
        assert implicit_placement("TiedLM/embed.attend") is first.placement
        assert implicit_placement("transpose(jvp(TiedLM))/embed.attend") is first.placement
        assert implicit_placement("TiedLM/layers_1") is second.placement
        assert implicit_placement("TiedLM/embedding.attend") is None  # the module part must match whole


def test_a_pattern_for_the_method_takes_precedence_silently():
    with stages(r"embed|layers_0", r"layers_1|embed\.attend") as (first, second):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert implicit_placement("TiedLM/embed.attend") is second.placement
            assert implicit_placement("TiedLM/embed") is first.placement


def test_both_uses_of_a_tied_table_on_one_stage_match_one_device():
    """Lookup and logits on the first stage, the second block between them: three segments of work."""
    with stages(r"embed|layers_0", r"layers_1"):
        fn, state = check_mpmd_against_reference(make_step(False), init, get_batch)
    table = state["params"]["embed"]["embedding"]
    assert {d.id for d in table.sharding.device_set} == {0, 1, 2, 3}
    assert "float32[32,16]" not in str(fn.plan)  # the table never leaves its stage


def test_a_tied_table_read_on_two_stages_of_a_pipeline_matches_one_device():
    with stages(r"embed|layers_0", r"layers_1|embed\.attend"):
        fn, state = check_mpmd_against_reference(make_step(True), init, get_batch)
    table = state["params"]["embed"]["embedding"]
    assert {d.id for d in table.sharding.device_set} == {0, 1, 2, 3}  # it lives on the stage of its lookup
    assert "reshard float32[32,16]" in str(fn.plan)  # copied to the logits' stage, its gradient back
    assert fn.plan.schedule is not None and fn.plan.schedule.num_stages == 2


def test_both_uses_on_one_stage_of_a_pipeline_is_a_clear_error_with_the_fix():
    with stages(r"embed|layers_0", r"layers_1"):
        with pytest.raises(ValueError, match=r"stage sequence embed\+layers_0 -> layers_1 -> embed\+layers_0.*"
                                             r"register its second use with the last stage.*embed\\\.attend"):
            parallelize(make_step(True), init_params=init, get_input_batch=get_batch)
