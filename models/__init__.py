"""Example models written with logical axis names (see ``models.transformer``)."""

from .transformer import (
    Attention,
    Block,
    Embed,
    Head,
    MlpBlock,
    RMSNorm,
    Transformer,
    TransformerConfig,
    count_params,
    cross_entropy,
    init_params,
    logical_specs,
    next_token_loss,
    rotary_embedding,
    tied_logits,
)

__all__ = [
    "Attention",
    "Block",
    "Embed",
    "Head",
    "MlpBlock",
    "RMSNorm",
    "Transformer",
    "TransformerConfig",
    "count_params",
    "cross_entropy",
    "init_params",
    "logical_specs",
    "next_token_loss",
    "rotary_embedding",
    "tied_logits",
]
