"""`microbatch` sums its microbatches (as MultiMesh does); ``reduce="mean"`` averages them, and a loss that is
plainly a mean over its microbatch, summed, is a `MicrobatchMeanWarning`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multimesh.jax import MicrobatchMeanWarning, microbatch, parallelize, register_task

pytestmark = pytest.mark.devices(8)

W = jnp.linspace(-1.0, 1.0, 16 * 16).reshape(16, 16)
BATCH = {"x": jnp.linspace(0.0, 1.0, 32 * 16).reshape(32, 16), "y": jnp.zeros((32, 16))}


def mean_loss(w, b):
    return jnp.mean((b["x"] @ w - b["y"]) ** 2)


def global_loss(w, b):  # divided by the global batch: the sum over microbatches is the mean
    return jnp.sum((b["x"] @ w - b["y"]) ** 2) / (32 * 16)


def test_a_mean_summed_over_microbatches_warns_and_is_n_times_the_mean():
    with pytest.warns(MicrobatchMeanWarning, match=r"microbatch\(mean_loss\): its result is divided by the "
                                                   r"microbatch's size \(8 along dimension 0.*4x the mean.*"
                                                   r"reduce='mean'"):
        value, grad = jax.jit(jax.value_and_grad(microbatch(mean_loss, 0, 8, argnum=1)))(W, BATCH)
    want, want_grad = jax.value_and_grad(mean_loss)(W, BATCH)
    np.testing.assert_allclose(value, 4 * want, rtol=1e-5)
    np.testing.assert_allclose(grad, 4 * want_grad, rtol=1e-5)


@pytest.mark.parametrize("loss, reduce", [(mean_loss, "mean"), (global_loss, "sum")], ids=["mean", "global-sum"])
def test_reduce_mean_and_a_loss_over_the_global_batch_equal_one_batch_without_a_warning(loss, reduce):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicrobatchMeanWarning)
        value, grad = jax.jit(jax.value_and_grad(microbatch(loss, 0, 8, argnum=1, reduce=reduce)))(W, BATCH)
    want, want_grad = jax.value_and_grad(mean_loss)(W, BATCH)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


def test_reduce_mean_in_a_pipeline_equals_one_batch():
    """Two stages (``register_task`` by parameter path), 4 microbatches, reduce='mean': one batch's mean."""
    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["a"]) @ p["b"] - b["y"]) ** 2)

    params = {"a": W, "b": W.T}
    step = jax.value_and_grad(microbatch(loss, 0, 8, argnum=1, reduce="mean"))
    devices = jax.devices()
    with register_task(params=r"^a$", devices=devices[:4]), register_task(params=r"^b$", devices=devices[4:]):
        fn, init = parallelize(step, init_params=lambda: params, initial_batch=BATCH)
    value, grad = fn(init(), BATCH)
    want, want_grad = jax.value_and_grad(loss)(params, BATCH)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(grad[k]), want_grad[k], rtol=1e-4, atol=1e-6)


def test_reduce_is_checked():
    with pytest.raises(ValueError, match=r"reduce must be 'sum' .* or 'mean'.*got 'avg'"):
        microbatch(mean_loss, 0, 8, reduce="avg")
