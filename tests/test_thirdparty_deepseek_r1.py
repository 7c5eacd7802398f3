"""jax-llm-examples' DeepSeek-R1/V3 (plain JAX on a mesh of Auto axes, MLA attention, shared and routed experts in a
`shard_map`), unmodified, through multimesh's public API.

``tests/thirdparty/deepseek_r1_jax/`` holds the model as its repository has it. It differs from Qwen3-MoE
(``tests/test_thirdparty_qwen3_moe.py``) where a pipeline can trip: multi-head latent attention (low-rank
query and key-value projections with their own RMS norms); its first ``first_k_dense`` layers dense MLPs and the
rest MoE layers (a layer list of two pytree types); group-limited sigmoid routing in a `jax.jit` of its own
that constrains the tokens to ``P(('y', 'z'), None)`` of the model's mesh by name; a shared expert beside the
routed ones; and its experts split over the mesh axis ``y`` (tensor ``z``, batch ``x``) inside a
``jax.shard_map`` over the model's own mesh (``cfg.mesh``) with ``axis_index`` of both axes and a ``psum``
over both, its tokens split over the batch axis ``x`` by its specs. Its own tests make that mesh of Auto axes.
Trained as a user would, with the model's mesh and its rule for the batch, adam:

a. SPMD on the model's mesh;
b. a 2-stage 1F1B pipeline by ``register_task(params=...)`` (the model opens no scope per layer): the
   embedding, the dense layer 0 and the MoE layer 1 on devices 0-3, the MoE layer 2, the final norm and the
   logits on devices 4-7, each stage a ``{'x': 1, 'y': 2, 'z': 2}`` submesh, the experts split over the
   stage's ``y``: the model's `shard_map` and its routing's constraint run on each stage's submesh (the
   `shard_map`, traced first for ``x`` of size 2, is traced again on the stages' shape, ``x`` of size 1);
c. an SPMD checkpoint restored onto that pipeline, trained on.

Each is compared with the same step on one device (plain `jax.jit`, the model's mesh a 1-device one): losses, parameters
and adam's state after each of four steps (two after the restore), each leaf to the larger of 1e-5 and twice the
model's own jit's largest difference from one device on that leaf after that step or an earlier one (its RMS
norm rounds activations to bfloat16, `tolerances`).
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
from jax.tree_util import keystr
from llm_examples import Training, leaf_differences, train, two_stage_meshes
from vendored import import_or_skip

from multimesh.checkpoint import CheckpointManager

pytestmark = [pytest.mark.devices(8),   # the model imports Pallas kernels JAX has deprecated
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

THIRDPARTY = Path(__file__).resolve().parent / "thirdparty" / "deepseek_r1_jax"
BATCH, LENGTH, VOCAB, LAYERS, DENSE, EXPERTS = 16, 8, 32, 3, 1, 8
MICROBATCHES = 4
SAVE_AT, STEPS = 2, 4
LR = 1e-2
#: eps above the gradients' bfloat16 rounding (the model's RMS norm): adam divides a gradient by its own size, so
#: a gradient of rounding noise would otherwise move its parameter by a whole step, either way
TX = optax.adam(LR, eps=1e-3)
AUTO = (AxisType.Auto,) * 3
#: by the parameters' paths (the model opens no scope per layer)
STAGES = (r"embedding|layers\.[01]", r"layers\.2|gamma_final|lm_head")
EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")


@functools.cache
def deepseek() -> types.ModuleType:
    """``deepseek_r1_jax.model`` (it imports ``from .decode_ragged_dot import ...``), with its folder on the path."""
    sys.path.insert(0, str(THIRDPARTY))
    try:
        return importlib.import_module("deepseek_r1_jax.model")
    finally:
        sys.path.remove(str(THIRDPARTY))


import_or_skip("deepseek_r1_jax", deepseek)


def config(mesh: jax.sharding.Mesh) -> Any:
    """A tiny DeepSeek-V3: a dense layer then two MoE layers of 8 routed experts in 4 groups (2 groups, then 2
    experts per token) and one shared expert; MLA with rank-8 projections; float32, no quantization, the
    einsum attention and `jax.lax.ragged_dot` rather than the TPU kernels."""
    return deepseek().Config(
        embed=16, q_lora_rank=8, kv_lora_rank=8, num_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, vocab_size=VOCAB, num_layers=LAYERS, max_seq_len=LENGTH, use_decode_ragged_dot_kernel=False,
        dtype=jnp.float32, mesh=mesh, quantize_moe=False, quantize_attn=False, quantize_cache=False,
        ffw_size=16, first_k_dense=DENSE, moe_ffw_size=8, n_routed_experts=EXPERTS, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1)


TRAINING = Training(deepseek, TX, BATCH, LENGTH, VOCAB, low=2)
program, make_step, get_batch = TRAINING.program, TRAINING.make_step, TRAINING.get_batch


def model_mesh(devices: list | None = None, shape: tuple[int, int, int] = (2, 2, 2)) -> jax.sharding.Mesh:
    """A mesh as the model's own tests make it: axes x (batch), y (expert, tensor) and z (tensor), Auto (its
    embedding lookup, a plain gather of a replicated table by batch-sharded tokens, is ambiguous on
    Explicit axes)."""
    return jax.make_mesh(shape, ("x", "y", "z"), axis_types=AUTO, devices=devices or jax.devices())


# ----------------------------------------------------------------- the references
@functools.cache
def reference() -> tuple[list[float], list[Any]]:
    """The one-device run: losses and host states after each step (plain jax.jit on a 1-device mesh)."""
    init, loss = program(config(model_mesh(jax.devices()[:1], (1, 1, 1))))
    return train(jax.jit(make_step(loss)), jax.jit(init)(), get_batch(), STEPS)


@functools.cache
def tolerances() -> list[tuple[float, list[float]]]:
    """Per step, the loss's relative tolerance and each state leaf's absolute one: the larger of 1e-5 and twice
    the model's own jit's largest difference from one device after that step or an earlier one, on that leaf
    (plain `jax.jit` with its 8-device mesh in its config, as its own tests run it). Its RMS norm rounds
    activations, and so their gradients, to bfloat16; adam divides each gradient by its own size (up to
    ``eps``), so a rounding of a small gradient moves its parameter by up to ``lr / eps`` times as much; and a
    routing decided by a near tie after a step may pick another expert. The rounding grows with the steps: a
    step where the jit lands closer than before is chance, which another sum order need not share. Leaf by
    leaf, the rounding of one leaf does not widen the others'."""
    init, loss = program(config(model_mesh()))
    losses, states = train(jax.jit(make_step(loss)), init(), get_batch(), STEPS)
    ref_losses, ref_states = reference()
    out: list[tuple[float, list[float]]] = []
    loss_diff, leaf_diffs = 0.0, [0.0] * len(jax.tree.leaves(ref_states[0]))
    for got, want, state, ref in zip(losses, ref_losses, states, ref_states):
        loss_diff = max(loss_diff, abs(got - want) / abs(want))
        leaf_diffs = [max(a, b) for a, b in zip(leaf_diffs, leaf_differences(state, ref))]
        out.append((max(1e-5, 2 * loss_diff), [max(1e-5, 2 * d) for d in leaf_diffs]))
    return out


def assert_matches_reference(losses: list[float], states: list[Any], first: int = 0) -> None:
    """Losses and states (parameters, adam's moments and count) of steps ``first..`` equal the one-device run's,
    each to its step's tolerance, leaf path by leaf path."""
    ref_losses, ref_states = reference()
    for i, (loss, state) in enumerate(zip(losses, states)):
        loss_rtol, leaf_atols = tolerances()[first + i]
        np.testing.assert_allclose(loss, ref_losses[first + i], rtol=loss_rtol)
        got = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
        want = jax.tree.leaves(ref_states[first + i])
        assert len(got) == len(want) == len(leaf_atols)
        for (path, a), b, atol in zip(got, want, leaf_atols):
            np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=f"step {first + i + 1} {keystr(path)}")


@pytest.mark.slow
def test_the_tolerances_are_small():
    """The model's own jit stays close to one device: the tolerances say float rounding, not a wrong result.
    After one step the losses agree to 1e-5 and most leaves to 1e-4; no leaf differs by as much as an adam
    step moves a parameter (``lr``)."""
    for step, (loss_rtol, atols) in enumerate(tolerances()):
        print(f"tolerances after step {step + 1}: losses rtol {loss_rtol:.2g}, state atol median "
              f"{np.median(atols):.2g}, max {max(atols):.2g}")
    first_rtol, first_atols = tolerances()[0]
    assert first_rtol <= 1e-5 and max(first_atols) < LR
    assert np.mean(np.array(first_atols) <= 1e-4) > 0.5


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
    """Each MoE layer's routed experts on its devices, split over ``y`` (their hidden dimension over ``z``, as the
    model's rules say): each device holds EXPERTS / 2 experts."""
    for i, layer in enumerate(tree.layers[DENSE:], start=DENSE):
        for name in EXPERT_WEIGHTS:
            array = getattr(layer.mlp, name)
            assert array.sharding.device_set == devices_of(i), (i, name)
            assert array.sharding.spec[0] == "y", (i, name, array.sharding.spec)
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
    """Layers 0 and 1 (and the embedding) on devices 0-3, layer 2 (and the head) on 4-7, experts over each
    stage's y; adam's moments where their parameters are."""
    devices = jax.devices()
    on_stage = [set(devices[:4]), set(devices[4:])]
    stage_of = [0, 0, 1]
    for tree in (state["params"], state["opt"][0].mu, state["opt"][0].nu):
        check_experts(tree, lambda i: on_stage[stage_of[i]])
        for i, layer in enumerate(tree.layers):
            for path, array in jax.tree_util.tree_leaves_with_path(layer):
                assert array.sharding.device_set == on_stage[stage_of[i]], (i, keystr(path))
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


@pytest.mark.slow
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
    """The premise: each MoE layer computes its routed experts in a shard_map over the model's own 8-device
    mesh, whose specs split them over ``y``; its routing constrains the tokens over ``('y', 'z')`` by name."""
    cfg = config(model_mesh())
    init, loss = program(cfg)
    closed = jax.make_jaxpr(loss)(init()["params"], get_batch())
    calls = [e.params for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    assert len(calls) == LAYERS - DENSE and all(c["mesh"] == cfg.mesh for c in calls)
    assert all(P("y", None, "z") in c["in_specs"] for c in calls)
    assert "('y', 'z')" in str(closed)
