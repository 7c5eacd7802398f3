"""jax-llm-examples' Qwen3-MoE (plain JAX, explicit sharding, experts in a `shard_map`), unmodified, through
multimesh's public API.

``tests/thirdparty/qwen3_jax/`` holds the model as its repository has it. Its
MoE layer routes each token to k of E experts and computes them inside a
``jax.shard_map`` over the model's own mesh (``cfg.mesh``, Explicit axes
``x`` batch, ``y`` tensor, ``z`` expert), with ``jax.lax.ragged_dot`` for the
grouped products and a ``psum`` over the expert and tensor axes; its
initializer makes every parameter in a `jax.jit` whose ``out_shardings`` are
its logical axes resolved on that mesh (the experts' weights over ``z``).
Trained as a user would, with the model's mesh and its rule for the batch:

a. SPMD on the model's mesh;
b. a 2-stage 1F1B pipeline by ``register_task(params=...)`` (the model opens
   no scope per layer): the embedding and layer 0 on devices 0-3, layer 1,
   the final norm and the logits on devices 4-7, each stage a ``{'x': 1,
   'y': 2, 'z': 2}`` submesh, the experts sharded over the stage's ``z``: the
   model's `shard_map` runs on each stage's submesh;
c. an SPMD checkpoint restored onto that pipeline, trained on.

Each is compared with the same step on one device (plain `jax.jit` on a
1-device mesh): losses, parameters and optimizer state after each of four
steps (two after the restore), each to the larger of 1e-4 and twice the model's
own jit's largest difference from one device after that step or an earlier
one (its RMS norm rounds activations to bfloat16).
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from llm_examples import Training, leaf_differences, train, two_stage_meshes

from multimesh.checkpoint import CheckpointManager

pytestmark = [pytest.mark.devices(8),   # the model imports Pallas kernels JAX has deprecated
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

THIRDPARTY = Path(__file__).resolve().parent / "thirdparty" / "qwen3_jax"
BATCH, LENGTH, VOCAB, LAYERS, EXPERTS = 16, 8, 32, 2, 4
MICROBATCHES = 4
SAVE_AT, STEPS = 2, 4
TX = optax.sgd(0.1, momentum=0.9)
EXPLICIT = (AxisType.Explicit,) * 3
#: by the parameters' paths (the model opens no scope per layer)
STAGES = (r"embedding|layers\.0", r"layers\.1|gamma_final|lm_head")
EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")


@functools.cache
def qwen3() -> types.ModuleType:
    """``qwen3_jax.model`` (it imports ``from . import ragged_attention``), with its folder on the path."""
    sys.path.insert(0, str(THIRDPARTY))
    try:
        return importlib.import_module("qwen3_jax.model")
    finally:
        sys.path.remove(str(THIRDPARTY))


def config(mesh: jax.sharding.Mesh) -> Any:
    """A tiny Qwen3-MoE: two MoE layers of 4 experts, 2 per token, float32, no quantization, the einsum
    attention."""
    return qwen3().Config(
        embed=16, q_heads=4, kv_heads=2, num_layers=LAYERS, head_dim=8, vocab_size=VOCAB, max_seq_len=LENGTH,
        causal=True, moe_ffw_size=16, moe_experts_per_tok=2, moe_num_experts=EXPERTS, dtype=jnp.float32,
        mesh=mesh, quant_cache=False)


TRAINING = Training(qwen3, TX, BATCH, LENGTH, VOCAB, low=1)
program, make_step, get_batch = TRAINING.program, TRAINING.make_step, TRAINING.get_batch


def model_mesh(devices: list | None = None, shape: tuple[int, int, int] = (2, 2, 2)) -> jax.sharding.Mesh:
    """A mesh as the model's own code expects: axes x (batch), y (tensor) and z (expert), Explicit."""
    return jax.make_mesh(shape, ("x", "y", "z"), axis_types=EXPLICIT, devices=devices or jax.devices())


# ----------------------------------------------------------------- the references
@functools.cache
def reference() -> tuple[list[float], list[Any]]:
    """The one-device run: losses and host states after each step (plain jax.jit on a 1-device mesh)."""
    one = model_mesh(jax.devices()[:1], (1, 1, 1))
    init, loss = program(config(one))
    with jax.set_mesh(one):
        return train(jax.jit(make_step(loss)), jax.jit(init)(), get_batch(), STEPS)


@functools.cache
def tolerances() -> list[tuple[float, float]]:
    """Per step, (loss's relative, state's absolute) tolerance: the larger of 1e-5 (1e-4) and twice the model's
    own jit's largest difference from one device after that step or an earlier one (its 8-device mesh under
    jax.set_mesh, as its code runs). Its RMS norm rounds to bfloat16, and the rounding grows with the steps: a
    step where the jit lands closer than before is chance, which another sum order need not share."""
    mesh = model_mesh()
    init, loss = program(config(mesh))
    with jax.set_mesh(mesh):
        losses, states = train(jax.jit(make_step(loss)), init(), get_batch(), STEPS)
    ref_losses, ref_states = reference()
    out, loss_diff, state_diff = [], 0.0, 0.0
    for got, want, state, ref_state in zip(losses, ref_losses, states, ref_states):
        loss_diff = max(loss_diff, abs(got - want) / abs(want))
        state_diff = max(state_diff, *leaf_differences(state, ref_state))
        out.append((max(1e-5, 2 * loss_diff), max(1e-4, 2 * state_diff)))
    return out


def assert_matches_reference(losses: list[float], states: list[Any], first: int = 0) -> None:
    """Losses and states of steps ``first..`` equal the one-device run's, each to its step's tolerance; after a
    first step the momentum is that step's gradient, so the gradients are compared too."""
    ref_losses, ref_states = reference()
    for i, (loss, state) in enumerate(zip(losses, states)):
        loss_rtol, state_atol = tolerances()[first + i]
        np.testing.assert_allclose(loss, ref_losses[first + i], rtol=loss_rtol)
        got, want = jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(ref_states[first + i])
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=state_atol)


@pytest.mark.slow
def test_the_tolerances_are_small():
    """The model's own jit stays close to one device: the tolerances say float rounding, not a wrong result
    (after one step, the gradients within a few bfloat16 roundings)."""
    for step, (loss_rtol, state_atol) in enumerate(tolerances()):
        print(f"tolerances after step {step + 1}: losses rtol {loss_rtol:.2g}, state atol {state_atol:.2g}")
    first_rtol, first_atol = tolerances()[0]
    assert first_rtol < 1e-4 and first_atol < 1e-2


# ----------------------------------------------------------------- the layouts, built once
@functools.cache
def spmd():
    return TRAINING.spmd(config(model_mesh()))


def stage_meshes() -> list[jax.sharding.Mesh]:
    return two_stage_meshes(model_mesh)


@functools.cache
def pipeline():
    return TRAINING.pipeline(config(model_mesh()), list(zip(STAGES, stage_meshes())), MICROBATCHES)


def check_experts(tree: Any, devices_of: Callable[[int], set]) -> None:
    """Each layer's expert weights on its devices, the experts split over ``z`` (and their hidden dimension
    over ``y``, as the model's rules say): each device holds EXPERTS / 2 experts."""
    for i, layer in enumerate(tree.layers):
        for name in EXPERT_WEIGHTS:
            array = getattr(layer.ffw, name)
            assert array.sharding.device_set == devices_of(i), (i, name)
            assert array.sharding.spec[0] == "z", (i, name, array.sharding.spec)
            assert {s.data.shape[0] for s in array.addressable_shards} == {EXPERTS // 2}, (i, name)


# ----------------------------------------------------------------- SPMD
def test_spmd_equals_one_device():
    step_fn, init_fn, batch_fn = spmd()
    state = init_fn()
    losses, states = train(step_fn, state, batch_fn(), STEPS)
    assert_matches_reference(losses, states)
    check_experts(state["params"], lambda i: set(jax.devices()))


# ----------------------------------------------------------------- the pipeline
def check_stages(state: dict) -> None:
    """Layer 0 (and the embedding) on devices 0-3, layer 1 (and the head) on 4-7, experts over each stage's z."""
    devices = jax.devices()
    on_stage = [set(devices[:4]), set(devices[4:])]
    for tree in (state["params"], state["opt"][0].trace):
        check_experts(tree, lambda i: on_stage[i])
        for i, layer in enumerate(tree.layers):
            for path, array in jax.tree_util.tree_leaves_with_path(layer):
                assert array.sharding.device_set == on_stage[i], (i, jax.tree_util.keystr(path))
        assert tree.embedding.sharding.device_set == on_stage[0]
        assert tree.lm_head.sharding.device_set == on_stage[1]


def test_pipeline_equals_one_device():
    step_fn, init_fn, batch_fn = pipeline()
    assert step_fn.plan.schedule.num_stages == 2
    assert step_fn.plan.schedule.num_microbatches == MICROBATCHES
    state = init_fn()
    losses, states = train(step_fn, state, batch_fn(), STEPS)
    assert_matches_reference(losses, states)
    _, state = step_fn(state, batch_fn())   # the arrays themselves (train keeps host copies)
    check_stages(state)


def test_spmd_checkpoint_restores_onto_the_pipeline(tmp_path):
    """Saved from SPMD after SAVE_AT steps, restored onto the pipeline's layout bit for bit, trained on: the
    run ends where the one-device run does."""
    step_fn, init_fn, batch_fn = spmd()
    state, batch = init_fn(), batch_fn()
    for _ in range(SAVE_AT):
        _, state = step_fn(state, batch)
    saved = jax.device_get(state)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(SAVE_AT, state)
    pipe_fn, _, pipe_batch = pipeline()
    with CheckpointManager(tmp_path / "ckpt", read_only=True) as mgr:
        restored = mgr.restore(SAVE_AT, target=pipe_fn).state
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        assert np.array_equal(np.asarray(a), b)
    check_stages(restored)
    losses, states = train(pipe_fn, restored, pipe_batch(), STEPS - SAVE_AT)
    assert_matches_reference(losses, states, first=SAVE_AT)



def test_the_experts_are_a_shard_map_over_the_models_mesh():
    """The premise: the model computes its experts in a shard_map over its own 8-device mesh, whose specs
    split the experts over ``z``."""
    cfg = config(model_mesh())
    init, loss = program(cfg)
    with jax.set_mesh(cfg.mesh):
        closed = jax.make_jaxpr(loss)(init()["params"], get_batch())
    calls = [e.params for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    assert len(calls) == LAYERS and all(c["mesh"] == cfg.mesh for c in calls)
    assert all(P("z", None, "y") in c["in_specs"] for c in calls)
