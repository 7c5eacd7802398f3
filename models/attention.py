"""Causal self-attention of the example models, by ``jax.nn.dot_product_attention``.

One function both models call (:mod:`models.transformer`, :mod:`models.nnx_transformer`):
queries ``[batch, length, heads, head_dim]`` against keys and values
``[batch, length, kv_heads, head_dim]`` (grouped-query attention: query head
``j * g + i`` attends with key/value head ``j``, ``g = heads // kv_heads``), scores
and softmax in float32, the probabilities cast back to the inputs' dtype before
they weight the values.

``implementation``:

- ``'xla'``: JAX's XLA implementation (two batched products around a masked
  softmax; XLA fuses what it can, the score matrix is materialised).
- ``'cudnn'``: cuDNN's fused flash-attention kernel (GPU only; 16-bit inputs,
  ``head_dim`` a multiple of 8 up to 128); an error where it cannot run.
- ``'auto'`` (the default): cuDNN where it can run (a GPU backend and inputs it
  takes), else XLA. ``jax.nn.dot_product_attention(implementation=None)`` always
  means XLA in the JAX versions this is tested on, so the choice is made here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["IMPLEMENTATIONS", "causal_attention", "pick_implementation"]

Array = jax.Array

#: The values ``TransformerConfig.attention`` may take.
IMPLEMENTATIONS = ("auto", "xla", "cudnn")

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def cudnn_can_run(query: Array, key: Array) -> bool:
    """Whether cuDNN's flash kernel takes these inputs here: a GPU backend, 16-bit inputs of one dtype,
    ``head_dim`` a multiple of 8 no larger than 128, query heads a multiple of key heads."""
    head_dim = query.shape[-1]
    return (jax.default_backend() == "gpu" and query.dtype in _CUDNN_DTYPES and key.dtype == query.dtype
            and head_dim % 8 == 0 and head_dim <= 128 and query.shape[-2] % key.shape[-2] == 0)


def pick_implementation(implementation: str, query: Array, key: Array) -> str | None:
    """What ``implementation`` (one of `IMPLEMENTATIONS`) passes to ``jax.nn.dot_product_attention`` for these
    inputs: ``'cudnn'``, ``'xla'``, or None (JAX's default, XLA) where ``'auto'`` finds cuDNN unable to run."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r} is unknown; use one of "
                         f"{', '.join(map(repr, IMPLEMENTATIONS))}")
    if implementation == "auto":
        return "cudnn" if cudnn_can_run(query, key) else None
    return implementation


def causal_attention(query: Array, key: Array, value: Array, implementation: str = "auto") -> Array:
    """Causal attention of ``query`` [b, t, heads, d] over ``key``/``value`` [b, t, kv_heads, d], scaled by
    ``1/sqrt(d)``; the result [b, t, heads, d] in the inputs' dtype."""
    chosen = pick_implementation(implementation, query, key)
    return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation=chosen)
