"""Gradient accumulation in the example trainer: k micro-steps give the one-pass loss and gradient, and the
planner prices the program as XLA compiles it (the micro-step loop's work k times)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from trainers.config import load_config
from trainers.errors import ConfigError
from trainers.grad_accum import accumulated_value_and_grad
from trainers.step import build_model, loss_sum_over


def test_four_micro_steps_give_the_one_pass_loss_and_gradient():
    cfg = load_config("tiny", ["model.num_layers=2"])
    model = build_model(cfg.model)
    tokens = jax.random.randint(jax.random.key(1), (8, cfg.data.seq_len + 1), 0, cfg.model.vocab_size)
    params = model.init(jax.random.key(0), tokens[:2, :-1])

    def loss(p, batch):
        return loss_sum_over(model, p, batch, tokens[:, 1:].size)  # normalised by the global batch's tokens

    want, want_grads = jax.jit(jax.value_and_grad(loss))(params, {"tokens": tokens})
    got, got_grads = jax.jit(accumulated_value_and_grad(loss, 4))(params, {"tokens": tokens})
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def test_grad_accum_must_divide_the_batch_and_is_not_a_pipelines():
    with pytest.raises(ConfigError, match=r"train.grad_accum=3 does not divide data.batch_size"):
        load_config("tiny", ["train.grad_accum=3"])
    with pytest.raises(ConfigError, match=r"train.grad_accum=2 with a pipeline.*layout.pipeline.microbatches"):
        load_config("pipeline", ["train.grad_accum=2"])
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        load_config("tiny", ["train.grad_accum=0"])


@pytest.mark.devices(8)
def test_an_fsdp_step_with_accumulation_is_priced_as_it_compiles():
    """XLA hoists the parameter gathers out of the micro-step loop (the parameters do not change in it): the
    same gathers as one pass; the gradients are reduced in every micro-step: twice the bytes with two."""
    from trainers.plan_estimate import estimate_config

    one, two = (estimate_config(load_config("fsdp", ["model.num_layers=2", f"train.grad_accum={k}"]), "h100-sxm")
                for k in (1, 2))

    def moved(est, kind):
        return sum(nbytes for (k, _), (_, nbytes) in est.collectives().items() if k == kind)

    assert moved(two, "all-gather") == moved(one, "all-gather")
    assert moved(two, "all-reduce") == pytest.approx(2 * moved(one, "all-reduce"), rel=0.01)
    assert two.flops == pytest.approx(one.flops, rel=0.05)  # the same work in two halves
    assert two.peak_bytes < one.peak_bytes  # half the activations alive at a time
