"""The example transformer's hyper-parameters (`TransformerConfig`), shared by the Linen and NNX models and the
Mixture-of-Experts layers (`models.moe`), which import it from here rather than from `models.transformer`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from .attention import IMPLEMENTATIONS

__all__ = ["FLOAT_DTYPES", "TransformerConfig"]

#: The dtypes ``dtype`` and ``param_dtype`` may name (float64 would need JAX's x64 mode).
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of :class:`Transformer` (hashable, so usable as a module field).

    ``num_kv_heads`` defaults to ``num_heads`` (plain multi-head attention),
    ``head_dim`` to ``d_model // num_heads`` and ``d_ff`` to ``4 * d_model``.
    ``dtype`` is the compute dtype (``'float32'`` or ``'bfloat16'``),
    ``param_dtype`` the storage dtype of parameters. ``scan_layers`` stacks the
    blocks with ``nn.scan`` (``nnx.scan`` in NNX; one module ``layers`` whose parameters have a
    leading layer axis, logical name ``layers``), as production models do to
    compile once per stack instead of once per block. ``api`` says which
    implementation a trainer builds from the config: ``'linen'`` (this
    module's :class:`Transformer`) or ``'nnx'`` (:mod:`models.nnx_transformer`,
    the same model and parameter tree in Flax NNX). ``attention`` picks the attention kernel
    (:mod:`models.attention`: ``'auto'``, cuDNN's fused kernel on a GPU where it runs, else XLA).

    Mixture of Experts (:mod:`models.moe`): ``num_experts > 0`` replaces the MLP of every
    ``moe_every``-th block (blocks ``moe_every - 1``, ``2 * moe_every - 1``, ...) by ``num_experts``
    SwiGLU experts of hidden size ``d_ff``, each token routed to ``experts_per_token`` of them;
    ``moe_aux_loss_coef`` weighs their load-balancing loss in the training loss;
    ``moe_capacity_factor`` (None: dropless) caps each expert's copies per group of tokens at
    ``ceil(factor * tokens * experts_per_token / num_experts)`` and drops the rest (:mod:`models.moe`).
    """

    vocab_size: int = 256
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    max_len: int = 256
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    scan_layers: bool = False
    rope_base: float = 10_000.0
    norm_eps: float = 1e-6
    api: str = "linen"
    num_experts: int = 0
    experts_per_token: int = 2
    moe_aux_loss_coef: float = 0.01
    moe_every: int = 1
    moe_capacity_factor: float | None = None
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.api not in ("linen", "nnx"):
            raise ValueError(f"api={self.api!r}: use 'linen' (flax.linen) or 'nnx' (flax.nnx)")
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention={self.attention!r}: use one of {', '.join(map(repr, IMPLEMENTATIONS))} "
                             "(models.attention)")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                    "give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for field in ("vocab_size", "num_layers", "d_model", "num_heads", "max_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        self._check_experts()
        for field in ("dtype", "param_dtype"):  # validated early: JAX refuses others deep in a traceback
            name = getattr(self, field)
            try:
                known = jnp.dtype(name).name
            except TypeError:
                known = None
            if known not in FLOAT_DTYPES:
                raise ValueError(f"{field}={name!r} is not a floating-point dtype this model runs in; use one of "
                                 f"{', '.join(map(repr, FLOAT_DTYPES))}")

    def _check_experts(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0: a dense MLP in every block), got {self.num_experts}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} (the top-k) must be between 1 and "
                             f"num_experts={self.num_experts}: a token cannot go to more experts than there are")
        if self.moe_every < 1:
            raise ValueError(f"moe_every must be >= 1 (1: MoE in every block), got {self.moe_every}")
        if self.moe_aux_loss_coef < 0:
            raise ValueError(f"moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor} must be > 0: each expert takes at most "
                             f"ceil(factor x tokens x experts_per_token / num_experts) token copies (1.0: a balanced "
                             f"load, 1.25 a common choice); leave it unset (null) to drop none")
        if self.num_experts and self.scan_layers and self.moe_every != 1:
            raise ValueError(f"scan_layers stacks identical blocks, so moe_every={self.moe_every} cannot alternate "
                             f"MoE and dense blocks; use moe_every=1 or scan_layers=false")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has a Mixture-of-Experts feed-forward (:mod:`models.moe`)."""
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The compute dtype as a numpy dtype."""
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        """The parameter storage dtype as a numpy dtype."""
        return jnp.dtype(self.param_dtype)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        """Build a config from a mapping (e.g. a YAML section); unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TransformerConfig keys: {unknown}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (resolved defaults included)."""
        return dataclasses.asdict(self)
