"""Small Flax Linen modules with logical axis names, for library tests.

* :class:`MLP`: ``Dense(embed -> mlp)``, activation, ``Dense(mlp -> embed)``;
  kernels ('embed', 'mlp') and ('mlp', 'embed'), biases ('mlp',) and ('embed',).
* :class:`AttentionBlock`: pre-norm residual self-attention; q/k/v kernels
  ('embed', 'heads', 'kv'), out kernel ('heads', 'kv', 'embed'), norm scale ('norm',).

With ``constrain=True`` the hidden activations are also constrained to logical
specs (``('batch', ..., 'mlp')`` / ``('batch', 'length', 'heads', 'kv')``) through
:func:`multimesh.jax.with_sharding_constraint`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .transformer import with_sharding_constraint

__all__ = ["MLP", "AttentionBlock"]

Array = jax.Array

_ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu, "silu": nn.silu}


def _logical(init: Any, names: tuple[str, ...]) -> Any:
    return nn.with_logical_partitioning(init, names)


class MLP(nn.Module):
    """Two-layer MLP on the last axis: ``[..., embed] -> [..., mlp] -> [..., embed]``.

    ``features`` defaults to the input width (output has the input's width).
    """

    hidden: int = 32
    features: int | None = None
    activation: str = "relu"
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    constrain: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; one of {sorted(_ACTIVATIONS)}")
        out = x.shape[-1] if self.features is None else self.features
        h = nn.Dense(
            self.hidden,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_logical(nn.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=_logical(nn.initializers.zeros, ("mlp",)),
            name="wi",
        )(x)
        h = _ACTIVATIONS[self.activation](h)
        if self.constrain:
            h = with_sharding_constraint(h, P("batch", *([None] * (h.ndim - 2)), "mlp"))
        return nn.Dense(
            out,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_logical(nn.initializers.lecun_normal(), ("mlp", "embed")),
            bias_init=_logical(nn.initializers.zeros, ("embed",)),
            name="wo",
        )(h)


class AttentionBlock(nn.Module):
    """Pre-norm residual self-attention on ``x`` [batch, length, embed] (causal by default)."""

    num_heads: int = 4
    head_dim: int = 8
    causal: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    constrain: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        b, t, e = x.shape
        h, d = self.num_heads, self.head_dim

        def dense(features: Any, names: tuple[str, ...], name: str, axis: Any = -1) -> nn.DenseGeneral:
            return nn.DenseGeneral(
                features, axis=axis, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_init=_logical(nn.initializers.lecun_normal(), names), name=name,
            )

        scale = self.param("norm_scale", _logical(nn.initializers.ones, ("norm",)), (e,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * scale
        y = y.astype(self.dtype)
        q = dense((h, d), ("embed", "heads", "kv"), "query")(y)
        k = dense((h, d), ("embed", "heads", "kv"), "key")(y)
        v = dense((h, d), ("embed", "heads", "kv"), "value")(y)
        if self.constrain:
            spec = P("batch", "length", "heads", "kv")
            q, k, v = (with_sharding_constraint(a, spec) for a in (q, k, v))
        s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * d ** -0.5
        if self.causal:
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, axis=-1).astype(self.dtype)
        o = jnp.einsum("bhts,bshd->bthd", p, v)
        return x + dense(e, ("heads", "kv", "embed"), "out", axis=(-2, -1))(o).astype(x.dtype)
