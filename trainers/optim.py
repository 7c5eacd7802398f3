"""The optimizer of a config: AdamW, linear warmup then decay, global-norm clipping."""

from __future__ import annotations

import jax
import optax

from trainers.config import OptimizerConfig

__all__ = ["cut_warmup_note", "learning_rate_schedule", "make_optimizer", "schedule_length"]


def schedule_length(cfg: OptimizerConfig, train_steps: int) -> int:
    """The schedule's length: ``decay_steps``, or (``null``) ``train_steps``, the length of a fresh run.

    A resumed run's config has it from its checkpoint (``trainers.continuation``).
    """
    return train_steps if cfg.decay_steps is None else cfg.decay_steps


def cut_warmup_note(cfg: OptimizerConfig, decay_steps: int) -> str | None:
    """A line saying that the warmup is cut to the schedule's length, or None when it fits."""
    if cfg.warmup_steps <= decay_steps:
        return None
    return (f"optimizer.warmup_steps={cfg.warmup_steps} is longer than the schedule (optimizer.decay_steps="
            f"{decay_steps}): the warmup is cut to {decay_steps} steps; set optimizer.warmup_steps or "
            f"optimizer.decay_steps to keep it")


def learning_rate_schedule(cfg: OptimizerConfig, decay_steps: int) -> optax.Schedule:
    """Linear warmup (step ``s < warmup_steps`` uses ``lr * (s + 1) / warmup_steps``), then
    ``cfg.decay`` from ``lr`` to ``min_lr`` at ``decay_steps`` (constant afterwards).

    A warmup longer than ``decay_steps`` is cut to it (:func:`cut_warmup_note` says so).
    """
    warmup = min(cfg.warmup_steps, decay_steps)
    rest = max(decay_steps - warmup, 1)
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


def make_optimizer(cfg: OptimizerConfig, decay_steps: int) -> optax.GradientTransformation:
    """``clip_by_global_norm(clip_norm)`` then AdamW on :func:`learning_rate_schedule`."""
    adamw = optax.adamw(learning_rate_schedule(cfg, decay_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
