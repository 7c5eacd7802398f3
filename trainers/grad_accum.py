"""Gradient accumulation: one optimizer step's gradient summed over ``k`` micro-steps of ``batch / k`` rows.

``train.grad_accum = k`` runs the loss and its gradient on ``k`` micro-batches in a
``jax.lax.scan`` (one compiled loop body, whatever ``k``) and sums them: the loss
is normalised by the *global* batch's tokens (`trainers.step.loss_sum_over`), so
the sum is the step's mean loss and gradient, as one pass over the whole batch
gives, with a micro-batch's activations alive at a time. Micro-batch ``j``
takes rows ``j, j + k, j + 2k, ...``: each device's rows of the batch stay on
it (a device holds a contiguous block of rows, and every micro-batch takes
``1 / k`` of each block), so splitting the batch moves nothing. The planner
prices the program this makes: a loop body (its products, its kernels' bytes
and its collectives) once per micro-step, the optimizer update once. Under
FSDP, XLA hoists the parameter gathers out of the loop (the parameters do not
change in it: gathered once, held gathered across the micro-steps) and
reduces the gradients in every micro-step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from multimesh.jax import with_sharding_constraint

__all__ = ["accumulated_value_and_grad"]


def _micro_batches(batch: dict, k: int) -> dict:
    """``batch``'s arrays [B, ...] as [k, B / k, ...]: micro-batch ``j`` the rows ``j, j + k, ...``, each device's
    rows kept where they are (logical ``batch`` on the second dimension)."""

    def split(x: jax.Array) -> jax.Array:
        rows = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        rows = with_sharding_constraint(rows, P("batch", *([None] * (rows.ndim - 1))))
        return jnp.swapaxes(rows, 0, 1)

    return jax.tree.map(split, batch)


def accumulated_value_and_grad(loss_fn: Callable[[Any, dict], jax.Array], k: int) -> Callable:
    """``(params, batch) -> (loss, grads)``: ``jax.value_and_grad(loss_fn)`` summed over ``k`` micro-batches of
    ``batch`` (``k = 1``: one pass). ``loss_fn`` must sum over its rows (normalised by the global batch)."""
    grad_fn = jax.value_and_grad(loss_fn)
    if k == 1:
        return grad_fn

    def accumulated(params: Any, batch: dict) -> tuple[jax.Array, Any]:
        def micro_step(carry, micro):
            loss, grads = carry
            value, g = grad_fn(params, micro)
            return (loss + value, jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)), params)
        (loss, grads), _ = jax.lax.scan(micro_step, (jnp.zeros((), jnp.float32), zeros), _micro_batches(batch, k))
        return loss, grads

    return accumulated
