"""The optimizer of a config: AdamW, linear warmup then decay, global-norm clipping."""

from __future__ import annotations

import jax
import optax

from trainers.config import OptimizerConfig

__all__ = ["learning_rate_schedule", "make_optimizer"]


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup (step ``s < warmup_steps`` uses ``lr * (s + 1) / warmup_steps``), then
    ``cfg.decay`` from ``lr`` to ``min_lr`` at ``total_steps`` (constant afterwards)."""
    warmup = min(cfg.warmup_steps, total_steps)
    rest = max(total_steps - warmup, 1)
    if cfg.decay == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, rest, alpha=cfg.min_lr / cfg.lr)
    elif cfg.decay == "linear":
        after = optax.linear_schedule(cfg.lr, cfg.min_lr, rest)
    else:
        after = optax.constant_schedule(cfg.lr)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(cfg.lr / warmup, cfg.lr, warmup - 1), after], [warmup])


def _decay_mask(params):
    """Weight decay on matrices and embeddings, not on norm scales (1-D)."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """``clip_by_global_norm(clip_norm)`` then AdamW on :func:`learning_rate_schedule`."""
    adamw = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
