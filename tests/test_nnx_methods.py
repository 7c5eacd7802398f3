"""An NNX module's other methods (``embed.attend``) and a tied NNX embedding under `register_task`.

NNX opens no scopes of its own; while a step with tasks is traced, a module's
``__call__`` runs under its attribute path (``embed``) and its other public
methods under ``path.method`` (``embed.attend``), as Linen's do: a pattern for
the module matches them too, a pattern for the whole name takes precedence.
So the two uses of a tied table can run on the two ends of a pipeline, each
equal to the one-device program.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import check_mpmd_against_reference, stages

from multimesh.jax import clear_tasks, microbatch, parallelize, register_task
from multimesh.trace.implicit import implicit_placement, scope_names
from multimesh.trace.nnx_scopes import module_scopes

pytestmark = pytest.mark.devices(8)

VOCAB, EMBED, BATCH, LENGTH = 32, 16, 8, 4


class Scaled(nnx.Module):
    """A module whose ``__call__`` calls another method of its own: one scope for both."""

    def __init__(self, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.full((EMBED,), 0.5))

    def __call__(self, x):
        return self.apply_scale(x)

    def apply_scale(self, x):
        return x * self.scale[...]


class TiedLM(nnx.Module):
    """Embedding lookup, two blocks, logits through the same table (``embed.attend``)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(EMBED, EMBED, rngs=rngs) for _ in range(2)])
        self.norm = Scaled(rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + jnp.tanh(layer(x))
        return self.embed.attend(self.norm(x))


GRAPHDEF, _ = nnx.split(nnx.eval_shape(lambda: TiedLM(nnx.Rngs(0))), nnx.Param)
TOKENS = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, VOCAB)
TX = optax.sgd(0.1)


def init():
    return nnx.state(TiedLM(nnx.Rngs(0)), nnx.Param)


def get_batch():
    return {"tokens": TOKENS}


def loss_fn(params, batch):
    logits = nnx.merge(GRAPHDEF, params)(batch["tokens"])
    return -jnp.sum(jax.nn.log_softmax(logits)[..., 0]) / (BATCH * LENGTH)


def make_step(pipelined: bool):
    def step(params, batch):
        f = microbatch(loss_fn, 0, BATCH // 2, argnum=1, schedule="1f1b") if pipelined else loss_fn
        loss, grads = jax.value_and_grad(f)(params, batch)
        return loss, grads, optax.apply_updates(params, TX.update(grads, TX.init(params))[0])

    return step


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


def test_methods_other_than_call_run_under_path_dot_method():
    model = TiedLM(nnx.Rngs(0))
    with register_task(r"nothing", devices=jax.devices()[:2]), module_scopes():
        jaxpr = jax.make_jaxpr(lambda t: model(t))(TOKENS)
    stacks = {tuple(scope_names(e.source_info.name_stack)) for e in jaxpr.eqns}
    assert ("embed",) in stacks and ("embed.attend",) in stacks and ("layers.1",) in stacks
    assert ("norm",) in stacks  # __call__ calling apply_scale: the first method's scope only
    assert not any("norm.apply_scale" in n for s in stacks for n in s)


def test_a_pattern_for_a_module_matches_its_methods_and_the_whole_name_takes_precedence():
    with stages(r"embed|layers\.0", r"layers\.1|norm") as (first, second):
        assert implicit_placement("embed.attend") is first.placement
    with stages(r"embed|layers\.0", r"layers\.1|norm|embed\.attend") as (first, second):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert implicit_placement("transpose(jvp(embed.attend))") is second.placement
            assert implicit_placement("embed") is first.placement


def test_a_tied_table_read_on_two_stages_of_a_pipeline_matches_one_device():
    with stages(r"embed|layers\.0", r"layers\.1|norm|embed\.attend"):
        fn, state = check_mpmd_against_reference(make_step(True), init, get_batch)
    table = state["embed"]["embedding"][...]
    assert {d.id for d in table.sharding.device_set} == {0, 1, 2, 3}  # it lives on the stage of its lookup
    assert "reshard float32[32,16]" in str(fn.plan)  # copied to the logits' stage, its gradient back
    assert fn.plan.schedule is not None and fn.plan.schedule.num_stages == 2


def test_both_uses_on_one_stage_of_a_pipeline_names_the_nnx_scope_to_register():
    with stages(r"embed|layers\.0", r"layers\.1|norm"):
        with pytest.raises(ValueError, match=r"stage sequence embed\+layers\.0 -> layers\.1\+norm -> "
                                             r"embed\+layers\.0.*'embed\.attend'.*"
                                             r"r'layers\\\.1\|norm\|embed\\\.attend'") as info:
            parallelize(make_step(True), init_params=init, get_input_batch=get_batch)
    assert "Linen" not in str(info.value)


class BothEnds(nnx.Module):
    """One module called through ``__call__`` at both ends: one name for both uses."""

    def __init__(self, rngs: nnx.Rngs):
        self.proj = nnx.Linear(EMBED, EMBED, rngs=rngs)
        self.middle = nnx.Linear(EMBED, EMBED, rngs=rngs)

    def __call__(self, x):
        return self.proj(jnp.tanh(self.middle(self.proj(x))))


def test_a_module_called_at_both_ends_under_one_name_is_told_to_give_one_use_a_name():
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: BothEnds(nnx.Rngs(0))), nnx.Param)
    x = jax.random.normal(jax.random.key(2), (BATCH, EMBED))

    def step(params, batch):
        f = microbatch(lambda p, b: jnp.mean(nnx.merge(graphdef, p)(b) ** 2), 0, BATCH // 2, argnum=1)
        return jax.value_and_grad(f)(params, batch)

    with stages(r"proj", r"middle"):
        with pytest.raises(ValueError, match=r"Stage proj runs again after middle for equations under 'proj', the "
                                             r"names its first visit runs under too: give the second use a name"):
            parallelize(step, init_params=lambda: nnx.state(BothEnds(nnx.Rngs(0)), nnx.Param),
                        get_input_batch=lambda: x)
