"""Flax's ImageNet ResNet (``tests/thirdparty/flax_resnet``, vendored unmodified), with its training step
written the example's way, for ``jax.pmap``: ``nn.BatchNorm(axis_name="batch")`` in the model, batch
statistics as mutable state beside the parameters in a ``TrainState``, and ``lax.pmean(..., "batch")`` of
the gradients and statistics in the step.

`parallelize` takes that step as it is: the axis only pmap binds is bound to one device, as one device
running the program would have it (`multimesh.trace.pmap_axes`). Every result is checked against the same
step under ``jax.pmap`` over one device with the whole batch (the one-device program), and against the
example's own way to scale, ``jax.pmap`` over the 8 devices with a slice of the batch each.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax import lax
from jax.sharding import PartitionSpec as P
from vendored import import_or_skip

from multimesh.jax import build_mesh, microbatch, parallelize, register_task

pytestmark = pytest.mark.devices(8)

_spec = importlib.util.spec_from_file_location(
    "thirdparty_flax_resnet_models", Path(__file__).resolve().parent / "thirdparty" / "flax_resnet" / "models.py")
models = importlib.util.module_from_spec(_spec)
import_or_skip("tests/thirdparty/flax_resnet/models.py", lambda: _spec.loader.exec_module(models))

BATCH, SIZE, CLASSES, STEPS = 16, 16, 10, 3
#: ResNet-10-like: two stages of one basic block, 8 filters (the second stage strided, with a projection)
MODEL = models.ResNet(stage_sizes=[1, 1], block_cls=models.ResNetBlock, num_classes=CLASSES, num_filters=8)


class TrainState(train_state.TrainState):
    batch_stats: Any


def init() -> TrainState:
    variables = MODEL.init(jax.random.key(0), jnp.ones((1, SIZE, SIZE, 3)))
    return TrainState.create(apply_fn=MODEL.apply, params=variables["params"], tx=optax.sgd(0.1, momentum=0.9),
                             batch_stats=variables["batch_stats"])


def get_batch(step: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.key(100 + step))
    return {"image": jax.random.normal(k1, (BATCH, SIZE, SIZE, 3)),
            "label": jax.random.randint(k2, (BATCH,), 0, CLASSES)}


def train_step(state: TrainState, batch: dict) -> tuple[jax.Array, TrainState]:
    """As the example writes it for pmap: its loss with weight decay, and the gradients and new batch
    statistics averaged over the pmapped axis ``batch``."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                                 batch["image"], mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        l2 = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(params) if x.ndim > 1)
        return loss + 1e-4 * 0.5 * l2, new_model_state

    (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = lax.pmean(grads, axis_name="batch")
    new_state = state.apply_gradients(grads=grads, batch_stats=lax.pmean(new_model_state["batch_stats"], "batch"))
    return lax.pmean(loss, axis_name="batch"), new_state


def pmapped(devices: int) -> tuple[list[float], TrainState]:
    """The example's way: ``jax.pmap`` over ``devices`` devices, each with its slice of every batch."""
    step = jax.pmap(train_step, axis_name="batch", devices=jax.devices()[:devices])
    state = jax.tree.map(lambda x: np.stack([x] * devices), init())  # a copy per device
    losses = []
    for i in range(STEPS):
        batch = jax.tree.map(lambda x: x.reshape(devices, BATCH // devices, *x.shape[1:]), get_batch(i))
        loss, state = step(state, batch)
        losses.append(float(loss[0]))
    return losses, jax.tree.map(lambda x: np.asarray(x[0]), state)


def run(built) -> tuple[list[float], TrainState]:
    step_fn, init_fn, _ = built
    state, losses = init_fn(), []
    for i in range(STEPS):
        loss, state = step_fn(state, get_batch(i))
        losses.append(float(loss))
    return losses, state


def assert_same(losses, state, reference) -> None:
    ref_losses, ref_state = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for part in ("params", "batch_stats", "opt_state"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-6),
                     getattr(state, part), getattr(ref_state, part))


@pytest.fixture(scope="module")
def one_device():
    return pmapped(1)


def test_the_step_fails_under_plain_jit():
    """What a user bringing this model to jax.jit meets: the pmap axis is unbound."""
    with pytest.raises(NameError, match="unbound axis name: batch"):
        jax.jit(train_step)(init(), get_batch())


def test_the_reference_trains_and_pmap_over_8_devices_agrees(one_device):
    losses, state = one_device
    assert losses[-1] < losses[0]
    assert_same(*pmapped(8), one_device)  # BatchNorm's statistics and the gradients averaged over 8 equal slices


@pytest.mark.parametrize("mesh", [pytest.param({"data": 8}, marks=pytest.mark.slow), {"data": 2, "fsdp": 4}])
def test_parallelize_takes_the_pmap_step_as_it_is(mesh, one_device):
    rules = [("batch", tuple(mesh))]
    built = parallelize(train_step, init_params=init, get_input_batch=get_batch, mesh=mesh, rules=rules)
    losses, state = run(built)
    assert_same(losses, state, one_device)
    image = built[2]()["image"]
    assert image.sharding.spec == P(tuple(mesh)) and len(image.addressable_shards) == 8
    assert {s.data.shape[0] for s in image.addressable_shards} == {BATCH // 8}
    for leaf in jax.tree.leaves((state.params, state.batch_stats)):  # no logical names: replicated
        assert leaf.sharding.is_fully_replicated


def test_auto_layout_searches_it_and_the_choice_trains_like_one_device(one_device):
    built = parallelize(train_step, init_params=init, get_input_batch=get_batch, layout="auto",
                        profile="h100-sxm", rule_sets=("standard",))
    search = built[0].layout_search
    reasons = {c.layout.describe(): c.rejected for c in search.candidates}
    assert "no parameter has logical axis names" in reasons["tensor=8"]  # its parameters name nothing
    # fsdp shards no parameter either: every data x fsdp mesh is data=8 by other names, searched once
    assert [c.layout.describe() for c in search.fitting] == ["data=8"]
    for mesh in ("fsdp=8", "data=2 x fsdp=4", "data=4 x fsdp=2"):
        assert reasons[mesh].endswith("splits only the batch, as data does (no parameter is sharded over data or "
                                      "fsdp): the same layout as data=8"), reasons[mesh]
    assert_same(*run(built), one_device)
    image = built[2]()["image"]  # the batch split over every device of the chosen layout
    assert len({s.device for s in image.addressable_shards}) == 8 and image.addressable_shards[0].data.shape[0] == 2


MICROBATCHES = 2


def pipelined_step(average_statistics: bool):
    """The example's step with its loss microbatched for a pipeline: summed over the microbatches, which is
    right for the loss (normalized by the whole batch) and wrong for BatchNorm's running averages unless
    they are divided by the number of microbatches."""

    def step(state, batch):
        def loss_fn(params, b):
            logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                                     b["image"], mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]).sum() / BATCH
            if average_statistics:
                new_model_state = jax.tree.map(lambda s: s / MICROBATCHES, new_model_state)
            return loss, new_model_state

        microbatched = microbatch(loss_fn, 0, BATCH // MICROBATCHES, argnum=1, schedule="1f1b")
        (loss, new_model_state), grads = jax.value_and_grad(microbatched, has_aux=True)(state.params, batch)
        grads = lax.pmean(grads, axis_name="batch")
        stats = lax.pmean(new_model_state["batch_stats"], "batch")
        return lax.pmean(loss, axis_name="batch"), state.apply_gradients(grads=grads, batch_stats=stats)

    return step


def test_a_two_stage_pipeline_equals_the_same_program_on_one_device(one_device):
    """Two stages of 4 devices (the stem and first block, then the second block and the head), 2 microbatches,
    each normalized by its own statistics: against the same program on one device (its microbatches one after
    the other). `microbatch` sums its function's results, so the step averages the statistics itself."""
    stages = (r"conv_init|bn_init|ResNetBlock_0", r"ResNetBlock_1|Dense_0")
    devices = jax.devices()

    def build(step):
        with contextlib.ExitStack() as registered:
            for s, pattern in enumerate(stages):
                registered.enter_context(register_task(pattern, mesh=build_mesh({"data": 4}, devices[4 * s:4 * s + 4]),
                                                       logical_axes=[("batch", "data")]))
            return parallelize(step, init_params=init, get_input_batch=get_batch)

    built = build(pipelined_step(average_statistics=True))
    assert len(built[0].plan.placements) == 2
    losses, state = run(built)
    step = pipelined_step(average_statistics=True)
    # the reference: no task registered, the microbatches summed one after the other on one device
    mesh = jax.make_mesh((1,), ("batch",), devices=devices[:1])
    reference_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P()))
    reference, ref_losses = init(), []
    for i in range(STEPS):
        loss, reference = reference_step(reference, get_batch(i))
        ref_losses.append(float(loss))
    assert_same(losses, state, (ref_losses, reference))
    assert not np.allclose(np.asarray(state.batch_stats["bn_init"]["mean"]),
                           np.asarray(one_device[1].batch_stats["bn_init"]["mean"]), rtol=1e-3)  # not the whole batch's
    for leaf in jax.tree.leaves(state.params["ResNetBlock_1"]):  # the second stage's parameters on its devices
        assert {d.id for d in leaf.sharding.device_set} == {4, 5, 6, 7}
