"""The decoder-only transformer of :mod:`models.transformer`, written with Flax NNX.

The same architecture, the same parameter tree (names, shapes, logical axis
names: ``nnx.with_partitioning`` on every initializer) and the same activation
constraints, so the two are interchangeable: :func:`from_linen` and
:func:`to_linen` convert parameters one way and the other, and the trainer
picks one with ``model.api: linen | nnx``.

NNX modules open no ``jax.named_scope`` of their own, and this model opens
none either: while ``parallelize`` traces a step with tasks registered,
multimesh runs each submodule under a scope named by its attribute path
(``embed``, ``layers_3``, ``layers_3.mlp``, ``head``; `multimesh.trace.nnx_scopes`),
so ``register_task(r"embed|head|layers_(\\d+)", ...)`` places the NNX model's
stages exactly as it places the Linen model's (attribute names = Linen names).

Parameters are created sharded when the module is built by a ``rngs -> module``
factory inside ``parallelize`` (evaluated abstractly, then compiled with the
shardings the metadata and the rules give). :class:`FunctionalModel` is that
factory with a Linen-style face (``init(key, tokens)``, ``apply(params,
tokens)``), which is what the trainer's step uses::

    model = FunctionalModel(config)
    params = model.init(jax.random.key(0))        # nnx.State of nnx.Param
    logits = model.apply(params, tokens)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import causal_attention
from .moe import NnxMoeBlock
from .transformer import (
    ACT_EMBED,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_MLP,
    ACT_VOCAB,
    TransformerConfig,
    _kernel_init,
    constrain,
    rotary_embedding,
    tied_logits,
)

__all__ = [
    "Attention",
    "Block",
    "Embed",
    "FunctionalModel",
    "Head",
    "MlpBlock",
    "RMSNorm",
    "Transformer",
    "from_linen",
    "to_linen",
]

Array = jax.Array


def _dense(cfg: TransformerConfig, in_features: int | tuple[int, ...], out_features: int | tuple[int, ...],
           names: tuple[str, ...], rngs: nnx.Rngs, axis: int | tuple[int, ...] = -1) -> nnx.LinearGeneral:
    return nnx.LinearGeneral(
        in_features, out_features, axis=axis, use_bias=False, dtype=cfg.compute_dtype,
        param_dtype=cfg.params_dtype, kernel_init=nnx.with_partitioning(_kernel_init(), names), rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned ``scale`` (logical axis ``norm``); computes in float32."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        self.config = cfg
        init = nnx.with_partitioning(nnx.initializers.ones, ("norm",))
        self.scale = nnx.Param(init(rngs.params(), (cfg.d_model,), cfg.params_dtype))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.norm_eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.config.compute_dtype)


class Embed(nnx.Module):
    """Token embedding table ``embedding`` [vocab, embed] with logical names ('vocab', 'embed')."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        self.config = cfg
        init = nnx.with_partitioning(nnx.initializers.normal(stddev=1.0), ("vocab", "embed"))
        self.embedding = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.params_dtype))

    def __call__(self, tokens: Array) -> Array:
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.config.compute_dtype)
        return constrain(x, ACT_EMBED)


class Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE and grouped-query attention."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        self.config = cfg
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.query = _dense(cfg, cfg.d_model, (h, d), ("embed", "heads", "kv"), rngs)
        self.key = _dense(cfg, cfg.d_model, (kvh, d), ("embed", "kv_heads", "kv"), rngs)
        self.value = _dense(cfg, cfg.d_model, (kvh, d), ("embed", "kv_heads", "kv"), rngs)
        self.out = _dense(cfg, (h, d), cfg.d_model, ("heads", "kv", "embed"), rngs, axis=(-2, -1))

    def __call__(self, x: Array, positions: Array | None = None) -> Array:
        cfg = self.config
        if positions is None:
            positions = jnp.arange(x.shape[1])
        q = constrain(rotary_embedding(self.query(x), positions, cfg.rope_base), ACT_HEADS)
        k = constrain(rotary_embedding(self.key(x), positions, cfg.rope_base), ACT_KV_HEADS)
        v = constrain(self.value(x), ACT_KV_HEADS)
        # Query head j*g + i attends with kv head j (as in the Linen model).
        out = constrain(causal_attention(q, k, v, cfg.attention), ACT_HEADS)
        return constrain(self.out(out), ACT_EMBED)


class MlpBlock(nnx.Module):
    """SwiGLU MLP: ``wo(silu(wi_0 x) * wi_1 x)``."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        self.wi_0 = _dense(cfg, cfg.d_model, cfg.d_ff, ("embed", "mlp"), rngs)
        self.wi_1 = _dense(cfg, cfg.d_model, cfg.d_ff, ("embed", "mlp"), rngs)
        self.wo = _dense(cfg, cfg.d_ff, cfg.d_model, ("mlp", "embed"), rngs)

    def __call__(self, x: Array) -> Array:
        hidden = constrain(nnx.silu(self.wi_0(x)) * self.wi_1(x), ACT_MLP)
        return constrain(self.wo(hidden), ACT_EMBED)


class Block(nnx.Module):
    """One pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; with ``moe`` the MLP is a
    Mixture of Experts (:class:`models.moe.NnxMoeBlock`)."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, moe: bool = False):
        self.config = cfg
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg, rngs)
        self.mlp: MlpBlock | NnxMoeBlock = NnxMoeBlock(cfg, rngs) if moe else MlpBlock(cfg, rngs)

    def __call__(self, x: Array, positions: Array | None = None) -> Array:
        x = x.astype(self.config.compute_dtype)
        x = x + self.attn(self.attn_norm(x), positions)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ACT_EMBED)


class _OutputProjection(nnx.Module):
    """Untied output ``kernel`` [embed, vocab]; float32 logits."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        self.config = cfg
        init = nnx.with_partitioning(_kernel_init(), ("embed", "vocab"))
        self.kernel = nnx.Param(init(rngs.params(), (cfg.d_model, cfg.vocab_size), cfg.params_dtype))

    def __call__(self, x: Array) -> Array:
        dt = self.config.compute_dtype
        return jnp.einsum("...e,ev->...v", x.astype(dt), self.kernel[...].astype(dt),
                          preferred_element_type=jnp.float32)


class Head(nnx.Module):
    """Final RMSNorm and output projection (tied: the embedding passed in; untied: ``output/kernel``)."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.final_norm = RMSNorm(cfg, rngs)
        self.output = None if cfg.tie_embeddings else _OutputProjection(cfg, rngs)

    def __call__(self, x: Array, embedding: Array | None = None) -> Array:
        x = self.final_norm(x)
        if self.output is None:
            if embedding is None:
                raise ValueError("Head with tie_embeddings=True needs the embedding table")
            logits = tied_logits(x, embedding, self.config)
        else:
            logits = self.output(x)
        return constrain(logits.astype(jnp.float32), ACT_VOCAB)


def _stacked_blocks(cfg: TransformerConfig, rngs: nnx.Rngs) -> Block:
    """``num_layers`` blocks as one, each parameter stacked along a leading axis named ``layers`` (the
    Linen ``nn.scan`` model's tree: ``layers/attn/query/kernel`` of shape ``(L, ...)``)."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs, moe=cfg.num_experts > 0)

    return make(rngs)


def _scan_blocks(stack: Block, x: Array, remat: bool) -> Array:
    """Run the stacked blocks one after the other with ``nnx.scan`` (each rematerialised if ``remat``)."""

    def one(y: Array, block: Block) -> Array:
        return nnx.remat(lambda b, z: b(z))(block, y) if remat else block(y)

    run = nnx.scan(one, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                   transform_metadata={nnx.PARTITION_NAME: "layers"})
    return run(x, stack)


class Transformer(nnx.Module):
    """Decoder-only LM: ``Transformer(config, rngs=nnx.Rngs(0))(tokens) -> float32 logits``.

    Submodules ``embed``, ``layers_0`` .. ``layers_{L-1}`` and ``head`` (the
    Linen model's names), which are also their attribute paths. With
    ``config.scan_layers`` the blocks are one module ``layers`` made by
    ``nnx.vmap`` and run by ``nnx.scan``, as the Linen model's ``nn.scan``.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embed(config, rngs)
        if config.scan_layers:  # one module `layers`, every parameter stacked along a leading layer axis
            self.layers = _stacked_blocks(config, rngs)
        else:
            for i in range(config.num_layers):
                setattr(self, f"layers_{i}", Block(config, rngs, moe=config.is_moe_layer(i)))  # the Linen names
        self.head = Head(config, rngs)

    def block(self, i: int) -> Block:
        return getattr(self, f"layers_{i}")

    def embed_tokens(self, tokens: Array) -> Array:
        """Stage 0: int tokens [batch, length] -> activations [batch, length, embed]."""
        if tokens.shape[-1] > self.config.max_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds max_len={self.config.max_len}")
        return self.embed(tokens)

    def run_blocks(self, x: Array, start: int = 0, stop: int | None = None) -> Array:
        """Run blocks ``start .. stop-1`` on activations [batch, length, embed]."""
        stop = self.config.num_layers if stop is None else stop
        if not 0 <= start <= stop <= self.config.num_layers:
            raise ValueError(f"bad block range [{start}, {stop}) for {self.config.num_layers} layers")
        if self.config.scan_layers:
            if (start, stop) != (0, self.config.num_layers):
                raise NotImplementedError(f"run_blocks({start}, {stop}): a scanned stack (scan_layers=True) runs "
                                          f"all {self.config.num_layers} blocks at once; split it over stages with "
                                          f"register_task('layers', split=...)")
            return _scan_blocks(self.layers, x, self.config.remat)
        for i in range(start, stop):
            if self.config.remat:  # the copy nnx.remat makes keeps the block's path (layers_i)
                x = nnx.remat(lambda blk, y: blk(y))(self.block(i), x)
            else:
                x = self.block(i)(x)
        return x

    def compute_logits(self, x: Array) -> Array:
        """Last stage: activations -> float32 logits [batch, length, vocab]."""
        emb = self.embed.embedding[...] if self.config.tie_embeddings else None
        return self.head(x, emb)

    def __call__(self, tokens: Array) -> Array:
        return self.compute_logits(self.run_blocks(self.embed_tokens(tokens)))


class FunctionalModel:
    """The NNX :class:`Transformer` as pure functions, with the Linen model's signatures.

    ``init(key, tokens=None)`` builds the module from ``nnx.Rngs(params=key)``
    (a ``rngs -> module`` factory: inside ``parallelize`` the parameters are
    created sharded) and returns its ``nnx.State`` of ``nnx.Param`` (the
    variables keep their sharding metadata); ``apply(params, tokens)`` merges
    them into the module and runs it. ``tokens`` in ``init`` is ignored (NNX
    knows its shapes from the config); it is there so both models are called
    the same way.
    """

    def __init__(self, config: TransformerConfig):
        self.config = config
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
        self.graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError(f"the NNX Transformer holds state besides nnx.Param: {rest}")

    def module(self, key: jax.Array | int = 0) -> Transformer:
        """A fresh module (parameters from ``key``)."""
        return Transformer(self.config, rngs=nnx.Rngs(params=key))

    def init(self, key: jax.Array | int, tokens: Any = None) -> nnx.State:
        # Shardings are applied by whoever compiles this (``parallelize``), from the metadata and
        # the rules; NNX's eager sharding would read the logical names as mesh axes.
        with nnx.use_eager_sharding(False):
            return nnx.state(self.module(key), nnx.Param)

    def apply(self, params: nnx.State, tokens: Array) -> Array:
        return nnx.merge(self.graphdef, params)(tokens)

    def apply_with_intermediates(self, params: nnx.State, tokens: Array) -> tuple[Array, dict[str, Any]]:
        """``(logits, intermediates)``: what the modules sowed (``nnx.Intermediate``, e.g. the MoE layers'
        ``moe_aux_loss``) as a pure dict, as Linen's ``apply(..., mutable=["intermediates"])`` gives it."""
        model = nnx.merge(self.graphdef, params)
        if hasattr(nnx, "capture"):  # Flax's new form of collecting what was sown
            logits, sown = nnx.capture(model, nnx.Intermediate)(tokens)
        else:
            logits = model(tokens)
            sown = nnx.pop(model, nnx.Intermediate)
        return logits, nnx.to_pure_dict(sown)

    def __repr__(self) -> str:
        return f"FunctionalModel(nnx Transformer, {self.config})"


def to_linen(params: nnx.State) -> dict[str, Any]:
    """The NNX parameters as the Linen model's variables ``{"params": {...}}`` (plain arrays)."""
    return {"params": nnx.to_pure_dict(params)}


def from_linen(variables: Any, like: nnx.State) -> nnx.State:
    """The Linen model's ``variables`` (boxed or not) as an ``nnx.State`` shaped as ``like``.

    ``like`` gives the structure and the variables' metadata (e.g.
    ``FunctionalModel(config).init(key)``, or its ``jax.eval_shape``); every
    leaf is replaced. A path present in one and not the other is an error.
    """
    import flax.linen as nn

    pure = nn.meta.unbox(variables)
    pure = pure.get("params", pure) if isinstance(pure, dict) else pure
    want = {"/".join(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(like))}
    have = {"/".join(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(pure)}
    if want != have:
        raise ValueError(f"Linen and NNX parameter trees differ: only in Linen {sorted(have - want)}, "
                         f"only in NNX {sorted(want - have)}")
    out = jax.tree.map(lambda x: x, like)  # a copy: replace_by_pure_dict works in place
    nnx.replace_by_pure_dict(out, pure)
    return out
