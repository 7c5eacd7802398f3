"""Mixed precision as FSDP runs it: float32 master parameters, gathered and used in the compute dtype.

With ``model.param_dtype=float32`` and ``model.dtype=bfloat16`` the model keeps
(and the optimizer updates) float32 parameters but multiplies in bfloat16:
each matrix is cast to bfloat16 where it is used. Under a layout that shards
the parameters (FSDP), XLA gathers a parameter before that use, so a cast
inside the model leaves it free to gather the float32 array and cast after.
Casting the parameter matrices once, where the loss starts, puts the cast on
each device's shard: the all-gathers move bfloat16, half the bytes, as a
mixed-precision FSDP implementation does (and the planner then prices the
bytes the program sends). Only leaves of two or more dimensions are cast: the
model casts every one of them to the compute dtype before it uses it (a
kernel, the embedding table), so the loss and gradients are the same to the
bit; the 1-D norm scales, which it uses in float32, are left as they are.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from multimesh.jax import with_sharding_constraint

__all__ = ["cast_for_compute"]


def cast_for_compute(params: Any, compute_dtype: Any) -> Any:
    """``params`` with every floating matrix (2 or more dimensions) not in ``compute_dtype`` cast to it; a
    no-op where the parameters are already stored in it."""
    dtype = jnp.dtype(compute_dtype)

    def needs_cast(x: Any) -> bool:
        return getattr(x, "ndim", 0) >= 2 and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype

    def cast(x: Any) -> Any:
        if isinstance(x, nn.LogicallyPartitioned):
            if not needs_cast(x.value):
                return x
            return x.replace_boxed(with_sharding_constraint(x.value.astype(dtype), P(*x.names)))
        return x.astype(dtype) if needs_cast(x) else x

    return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
