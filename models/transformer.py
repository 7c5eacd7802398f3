"""A decoder-only transformer language model in Flax Linen, with logical axis names.

Architecture: token embedding -> ``num_layers`` pre-norm blocks (RMSNorm, causal
multi-head attention with rotary position embedding and optional grouped-query
attention, RMSNorm, SwiGLU MLP) -> final RMSNorm -> output projection (tied to the
embedding or a separate kernel).

Every parameter is created through ``nn.with_logical_partitioning`` and so carries
logical axis names; key activations are constrained with logical
``PartitionSpec``s through :func:`multimesh.jax.with_sharding_constraint`. The
logical names used:

=============  ==============================================================
``vocab``      vocabulary dimension (embedding rows, output columns, logits)
``embed``      model (residual stream) dimension
``heads``      query heads
``kv_heads``   key/value heads (equal to ``heads`` without grouped-query attn)
``kv``         per-head feature dimension (``head_dim``)
``mlp``        MLP hidden dimension
``norm``       RMSNorm scales
``batch``      batch dimension (activations only)
``length``     sequence dimension (activations only)
=============  ==============================================================

Parameter tree (``params`` collection), with ``L = num_layers``::

    embed/embedding               [vocab, embed]           ('vocab', 'embed')
    layers_{i}/attn_norm/scale    [embed]                  ('norm',)
    layers_{i}/attn/query/kernel  [embed, heads, kv]       ('embed', 'heads', 'kv')
    layers_{i}/attn/key/kernel    [embed, kv_heads, kv]    ('embed', 'kv_heads', 'kv')
    layers_{i}/attn/value/kernel  [embed, kv_heads, kv]    ('embed', 'kv_heads', 'kv')
    layers_{i}/attn/out/kernel    [heads, kv, embed]       ('heads', 'kv', 'embed')
    layers_{i}/mlp_norm/scale     [embed]                  ('norm',)
    layers_{i}/mlp/wi_0/kernel    [embed, mlp]             ('embed', 'mlp')   (gate)
    layers_{i}/mlp/wi_1/kernel    [embed, mlp]             ('embed', 'mlp')   (up)
    layers_{i}/mlp/wo/kernel      [mlp, embed]             ('mlp', 'embed')
    head/final_norm/scale         [embed]                  ('norm',)
    head/output/kernel            [embed, vocab]           ('embed', 'vocab') (untied only)

The blocks are separate submodules named ``layers_0``, ``layers_1``, ... so that
``register_task(r"layers_[0-1]")`` can place them. With ``scan_layers`` they are
one ``nn.scan`` module ``layers`` instead: ``layers/attn/query/kernel`` is
``[L, embed, heads, kv]`` with logical names ``('layers', 'embed', 'heads', 'kv')``,
and ``register_task(r"layers", split=...)`` splits the stack over stages. Staged execution (e.g. for a
pipeline) uses the methods :meth:`Transformer.embed_tokens`,
:meth:`Transformer.run_blocks` and :meth:`Transformer.compute_logits` through
``model.apply(params, ..., method=...)``, or the modules :class:`Embed`,
:class:`Block` and :class:`Head` on their own parameter subtrees.

Mixed precision: parameters are stored in ``param_dtype`` (float32); matmuls run
in ``dtype`` (e.g. bfloat16); norms, softmax, logits and the loss are float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from multimesh.jax import with_sharding_constraint

from .attention import IMPLEMENTATIONS, causal_attention
from .moe import MoeBlock

__all__ = [
    "TransformerConfig",
    "RMSNorm",
    "Embed",
    "Attention",
    "MlpBlock",
    "Block",
    "ScannedBlock",
    "Head",
    "Transformer",
    "rotary_embedding",
    "tied_logits",
    "cross_entropy",
    "next_token_loss",
    "count_params",
    "init_params",
    "logical_specs",
]

Array = jax.Array

# Logical specs of the activations, in one place.
ACT_EMBED = P("batch", "length", "embed")
ACT_HEADS = P("batch", "length", "heads", "kv")
ACT_KV_HEADS = P("batch", "length", "kv_heads", "kv")
ACT_MLP = P("batch", "length", "mlp")
ACT_VOCAB = P("batch", "length", "vocab")


def constrain(x: Array, spec: P) -> Array:
    """Constrain activation ``x`` to the logical ``spec`` (resolved by the rules in scope)."""
    return with_sharding_constraint(x, spec)


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


def _kernel_init() -> nn.initializers.Initializer:
    # DenseGeneral calls this on the kernel flattened to [fan_in, fan_out].
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _dense(
    config: TransformerConfig,
    features: int | tuple[int, ...],
    names: tuple[str, ...],
    *,
    axis: int | tuple[int, ...] = -1,
    name: str | None = None,
) -> nn.DenseGeneral:
    return nn.DenseGeneral(
        features=features,
        axis=axis,
        use_bias=False,
        dtype=config.compute_dtype,
        param_dtype=config.params_dtype,
        kernel_init=nn.with_logical_partitioning(_kernel_init(), names),
        name=name,
    )


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (logical axis ``norm``); computes in float32."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x.shape[-1],),
            cfg.params_dtype,
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
        return (y * scale.astype(jnp.float32)).astype(cfg.compute_dtype)


def rotary_embedding(x: Array, positions: Array, base: float = 10_000.0) -> Array:
    """Apply rotary position embedding to ``x`` [batch, length, heads, head_dim].

    ``positions`` is [length] or [batch, length]. Rotation is computed in float32
    (half-split convention: feature ``i`` pairs with ``i + head_dim // 2``).
    """
    d = x.shape[-1]
    half = d // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [half]
    pos = jnp.asarray(positions, jnp.float32)
    if pos.ndim == 1:
        pos = pos[None, :]
    angles = pos[..., None] * freq  # [batch|1, length, half]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def tied_logits(x: Array, embedding: Array, config: TransformerConfig) -> Array:
    """Tied output projection ``x @ embedding.T / sqrt(d_model)`` in float32 [..., vocab]."""
    emb = jnp.asarray(embedding).astype(config.compute_dtype)
    logits = jnp.einsum("...e,ve->...v", x.astype(config.compute_dtype), emb,
                        preferred_element_type=jnp.float32)
    return logits * (config.d_model ** -0.5)


class Embed(nn.Module):
    """Token embedding table ``embedding`` [vocab, embed] with logical names ('vocab', 'embed')."""

    config: TransformerConfig

    def setup(self) -> None:
        cfg = self.config
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
            (cfg.vocab_size, cfg.d_model),
            cfg.params_dtype,
        )

    def __call__(self, tokens: Array) -> Array:
        """Look up ``tokens`` [batch, length] -> activations [batch, length, embed] in compute dtype."""
        x = jnp.take(self.embedding, tokens, axis=0).astype(self.config.compute_dtype)
        return constrain(x, ACT_EMBED)

    def attend(self, x: Array) -> Array:
        """Tied output projection: ``x`` [..., embed] -> float32 logits [..., vocab].

        Scaled by ``1/sqrt(d_model)`` so that logits start at unit scale.
        """
        return tied_logits(x, self.embedding, self.config)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE and grouped-query attention."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array | None = None) -> Array:
        cfg = self.config
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if positions is None:
            positions = jnp.arange(x.shape[1])

        q = _dense(cfg, (h, d), ("embed", "heads", "kv"), name="query")(x)
        k = _dense(cfg, (kvh, d), ("embed", "kv_heads", "kv"), name="key")(x)
        v = _dense(cfg, (kvh, d), ("embed", "kv_heads", "kv"), name="value")(x)
        q = constrain(rotary_embedding(q, positions, cfg.rope_base), ACT_HEADS)
        k = constrain(rotary_embedding(k, positions, cfg.rope_base), ACT_KV_HEADS)
        v = constrain(v, ACT_KV_HEADS)

        # Query head j*g + i attends with kv head j.
        out = constrain(causal_attention(q, k, v, cfg.attention), ACT_HEADS)
        y = _dense(cfg, cfg.d_model, ("heads", "kv", "embed"), axis=(-2, -1), name="out")(out)
        return constrain(y, ACT_EMBED)


class MlpBlock(nn.Module):
    """SwiGLU MLP: ``wo(silu(wi_0 x) * wi_1 x)``."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        gate = _dense(cfg, cfg.d_ff, ("embed", "mlp"), name="wi_0")(x)
        up = _dense(cfg, cfg.d_ff, ("embed", "mlp"), name="wi_1")(x)
        hidden = constrain(nn.silu(gate) * up, ACT_MLP)
        y = _dense(cfg, cfg.d_model, ("mlp", "embed"), name="wo")(hidden)
        return constrain(y, ACT_EMBED)


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; with ``moe``
    the MLP is a Mixture of Experts (:class:`models.moe.MoeBlock`)."""

    config: TransformerConfig
    moe: bool = False

    @nn.compact
    def __call__(self, x: Array, positions: Array | None = None) -> Array:
        cfg = self.config
        x = x.astype(cfg.compute_dtype)
        x = x + Attention(cfg, name="attn")(RMSNorm(cfg, name="attn_norm")(x), positions)
        mlp = MoeBlock(cfg, name="mlp") if self.moe else MlpBlock(cfg, name="mlp")
        x = x + mlp(RMSNorm(cfg, name="mlp_norm")(x))
        return constrain(x, ACT_EMBED)


class ScannedBlock(Block):
    """A :class:`Block` as the body of ``nn.scan``: ``(x, _) -> (block(x), None)``."""

    def __call__(self, x: Array, _: Any = None) -> tuple[Array, None]:  # type: ignore[override]
        return Block.__call__(self, x), None


class _OutputProjection(nn.Module):
    """Untied output kernel [embed, vocab]; float32 logits."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(_kernel_init(), ("embed", "vocab")),
            (cfg.d_model, cfg.vocab_size),
            cfg.params_dtype,
        )
        return jnp.einsum("...e,ev->...v", x.astype(cfg.compute_dtype),
                          kernel.astype(cfg.compute_dtype), preferred_element_type=jnp.float32)


class Head(nn.Module):
    """Final RMSNorm and output projection to float32 logits [batch, length, vocab].

    With ``config.tie_embeddings`` the projection is the transposed embedding,
    which must be passed as ``embedding``; otherwise the head owns
    ``output/kernel`` [embed, vocab] with logical names ('embed', 'vocab').
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, embedding: Array | None = None) -> Array:
        cfg = self.config
        x = RMSNorm(cfg, name="final_norm")(x)
        if cfg.tie_embeddings:
            if embedding is None:
                raise ValueError("Head with tie_embeddings=True needs the embedding table")
            logits = tied_logits(x, embedding, cfg)
        else:
            logits = _OutputProjection(cfg, name="output")(x)
        return constrain(logits.astype(jnp.float32), ACT_VOCAB)


class Transformer(nn.Module):
    """Decoder-only LM: ``Transformer(config).apply(params, tokens) -> float32 logits``.

    Submodules: ``embed`` (:class:`Embed`), ``layers_0`` .. ``layers_{L-1}``
    (:class:`Block`, wrapped in ``nn.remat`` when ``config.remat``), ``head``
    (:class:`Head`). Staged use::

        x = model.apply(params, tokens, method=Transformer.embed_tokens)
        x = model.apply(params, x, 0, 2, method=Transformer.run_blocks)
        logits = model.apply(params, x, method=Transformer.compute_logits)
    """

    config: TransformerConfig

    def setup(self) -> None:
        cfg = self.config
        self.embed = Embed(cfg)
        if cfg.scan_layers:  # one module `layers`, every parameter stacked along a leading layer axis
            body = nn.remat(ScannedBlock) if cfg.remat else ScannedBlock
            self.layers = nn.scan(body, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                                  length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})(
                cfg, moe=cfg.num_experts > 0)
        else:
            block_cls = nn.remat(Block) if cfg.remat else Block
            self.layers = [block_cls(cfg, moe=cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]  # layers_0, ...
        self.head = Head(cfg)

    def embed_tokens(self, tokens: Array) -> Array:
        """Stage 0: int tokens [batch, length] -> activations [batch, length, embed]."""
        if tokens.shape[-1] > self.config.max_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds max_len={self.config.max_len}")
        return self.embed(tokens)

    def run_blocks(self, x: Array, start: int = 0, stop: int | None = None) -> Array:
        """Run blocks ``start .. stop-1`` (Python ints) on activations [batch, length, embed]."""
        stop = self.config.num_layers if stop is None else stop
        if not 0 <= start <= stop <= self.config.num_layers:
            raise ValueError(f"bad block range [{start}, {stop}) for {self.config.num_layers} layers")
        if self.config.scan_layers:
            if (start, stop) != (0, self.config.num_layers):
                raise NotImplementedError(f"run_blocks({start}, {stop}): a scanned stack (scan_layers=True) runs "
                                          f"all {self.config.num_layers} blocks at once; split it over stages with "
                                          f"register_task('layers', split=...)")
            return self.layers(x, None)[0]
        for layer in self.layers[start:stop]:
            x = layer(x)
        return x

    def compute_logits(self, x: Array) -> Array:
        """Last stage: activations -> float32 logits [batch, length, vocab]."""
        emb = self.embed.embedding if self.config.tie_embeddings else None
        return self.head(x, emb)

    def __call__(self, tokens: Array) -> Array:
        """Full forward pass: int tokens [batch, length] -> float32 logits [batch, length, vocab]."""
        return self.compute_logits(self.run_blocks(self.embed_tokens(tokens)))


def cross_entropy(logits: Array, targets: Array, mask: Array | None = None,
                  reduction: str = "mean") -> Array:
    """Float32 softmax cross-entropy of ``logits`` [..., vocab] against int ``targets`` [...].

    ``mask`` (same shape as ``targets``, bool or float weights) selects the
    positions that count. ``reduction``: ``'mean'`` (over counted positions),
    ``'sum'``, or ``'none'`` (per-position losses, masked positions zero).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"unknown reduction {reduction!r}; use 'mean', 'sum' or 'none'")
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    losses = logz - picked
    weights = jnp.ones_like(losses) if mask is None else jnp.asarray(mask, jnp.float32)
    losses = losses * weights
    if reduction == "none":
        return losses
    if reduction == "sum":
        return jnp.sum(losses)
    return jnp.sum(losses) / jnp.maximum(jnp.sum(weights), 1.0)


def next_token_loss(logits: Array, tokens: Array, mask: Array | None = None,
                    reduction: str = "mean") -> Array:
    """Next-token cross-entropy (float32).

    ``logits`` [B, T, V] are the model's output for inputs ``tokens[:, :T]``.
    ``tokens`` is either the data window [B, T+1] (targets ``tokens[:, 1:]``, every
    position counts) or the inputs themselves [B, T] (targets ``tokens[:, 1:]``
    scored by ``logits[:, :-1]``). ``mask`` has the targets' shape; ``reduction``
    as in :func:`cross_entropy` (use ``'sum'`` and divide by the global token count
    when summing over microbatches).
    """
    t = logits.shape[1]
    if tokens.shape[1] == t + 1:
        targets = tokens[:, 1:]
    elif tokens.shape[1] == t:
        logits, targets = logits[:, :-1], tokens[:, 1:]
    else:
        raise ValueError(f"tokens length {tokens.shape[1]} does not match logits length {t} (or +1)")
    return cross_entropy(logits, targets, mask, reduction)


def count_params(params: Any) -> int:
    """Number of scalars in a (possibly boxed) parameter pytree."""
    leaves = jax.tree_util.tree_leaves(nn.meta.unbox(params))
    return int(sum(x.size for x in leaves))


def init_params(config: TransformerConfig, rng: Array, batch_size: int = 1,
                seq_len: int | None = None) -> Any:
    """Initialise the ``{'params': ...}`` variables (boxed with logical metadata)."""
    t = min(config.max_len, 8) if seq_len is None else seq_len
    return Transformer(config).init(rng, jnp.zeros((batch_size, t), jnp.int32))


def logical_specs(config: TransformerConfig) -> Any:
    """Logical ``PartitionSpec`` of every parameter, without materialising anything."""
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return nn.get_partition_spec(abstract)

