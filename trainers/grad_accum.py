"""Gradient accumulation: one optimizer step's gradient summed over ``k`` micro-steps of ``batch / k`` rows.

``train.grad_accum = k`` runs the loss and its gradient on ``k`` micro-batches in a
``jax.lax.scan`` (one compiled loop body, whatever ``k``) and sums them: the loss
is normalised by the *global* batch's tokens (`trainers.step.training_loss`), so
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


def accumulated_value_and_grad(loss_fn: Callable[[Any, dict], Any], k: int, has_aux: bool = False) -> Callable:
    """``(params, batch) -> (value, grads)``: ``jax.value_and_grad(loss_fn, has_aux=has_aux)`` summed over ``k``
    micro-batches of ``batch`` (``k = 1``: one pass), the value's auxiliary terms too. ``loss_fn`` must sum over
    its rows (normalised by the global batch)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
    if k == 1:
        return grad_fn

    def accumulated(params: Any, batch: dict) -> Any:
        micro = _micro_batches(batch, k)
        shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def micro_step(total, one):
            return jax.tree.map(jnp.add, total, grad_fn(params, one)), None

        total, _ = jax.lax.scan(micro_step, zeros, micro)
        return total

    return accumulated
