"""Mixed-precision FSDP in the example trainer: float32 master parameters gathered in bfloat16, read from the
compiled program's all-gathers; the loss the same as the model's own casts give, the gradients to bfloat16's
rounding (a tied embedding sums its two uses' gradients in bfloat16)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multimesh.core.meshes import mesh_context
from multimesh.estimate.collectives import find_collectives
from multimesh.estimate.hlo import parse_module
from multimesh.estimate.programs import _abstract
from trainers.config import load_config
from trainers.mixed_precision import cast_for_compute
from trainers.step import build_model, loss_sum_over, program_for

MIXED = ["model.dtype=bfloat16", "model.param_dtype=float32", "model.num_layers=2"]


def _parameter_gathers(cfg) -> list[tuple[str, int, int]]:
    """(element type in the compiled text, elements, bytes as the estimate counts them) of every floating
    all-gather of the compiled train step."""
    step = program_for(cfg).step
    batch = _abstract(step._abstract_batch, step.batch_shardings)
    with mesh_context(step.mesh):
        text = step.trace(step.abstract_params, batch).lower().compile().as_text()
    found = find_collectives(text, list(step.mesh.axis_names), list(step.mesh.devices.shape))
    module = parse_module(text)
    out = []
    for c in found:
        shape = module.shape(c.name)
        m = re.match(r"(\w+)\[([\d,]*)\]", shape)
        if c.kind == "all-gather" and m and m.group(1).startswith(("f", "bf")):
            out.append((m.group(1), math.prod(int(d) for d in m.group(2).split(",")), c.bytes))
    return out


@pytest.mark.devices(8)
def test_fsdp_gathers_float32_master_parameters_in_bfloat16():
    """The cast runs on each device's shard, before the gather. XLA:CPU has no bfloat16 collectives and
    widens them to float32 around the gather (convert, gather, convert back); the estimate reads through
    that widening and counts the bytes a GPU sends: 2 per element."""
    cfg = load_config("fsdp", MIXED)
    assert cfg.layout.mesh == {"data": 8}
    mixed = _parameter_gathers(cfg)
    assert len(mixed) >= 7 and all(nbytes == 2 * n for _, n, nbytes in mixed), mixed
    # the same layout with the parameters used in float32 gathers float32: 4 bytes per element
    plain = _parameter_gathers(load_config("fsdp", ["model.num_layers=2"]))
    assert plain and all(t == "f32" and nbytes == 4 * n for t, n, nbytes in plain), plain


def test_the_cast_changes_no_loss_or_gradient():
    cfg = load_config("tiny", MIXED)
    model = build_model(cfg.model)
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.data.seq_len + 1), 0, cfg.model.vocab_size)
    params = model.init(jax.random.key(0), tokens[:, :-1])
    params = jax.tree.map(lambda x: x, params)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    cast = cast_for_compute(params, jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(cast) if x.ndim >= 2} == {jnp.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(cast) if x.ndim < 2} == {jnp.dtype("float32")}  # norm scales

    def as_the_model_casts(p):  # the loss without the cast up front: each matrix cast where it is used
        logits = model.apply(p, tokens[:, :-1])
        from models.transformer import next_token_loss
        return next_token_loss(logits, tokens, reduction="sum") / tokens[:, 1:].size

    def as_trained(p):
        return loss_sum_over(model, p, {"tokens": tokens}, tokens[:, 1:].size)

    (want, want_grads), (got, got_grads) = (jax.value_and_grad(f)(params) for f in (as_the_model_casts, as_trained))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        assert g.dtype == jnp.float32
        scale = float(np.abs(np.asarray(w)).max())
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2 ** -7 * scale)
