"""Generate text from a run's checkpoint (restored onto one device, whatever layout trained it)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh.checkpoint import CheckpointManager
from trainers.config import Config, ConfigError, config_from_dict
from trainers.data import DOC_SEPARATOR, decode, encode
from trainers.optim import make_optimizer
from trainers.step import Model, build_model, initializers

__all__ = ["Checkpointed", "generate", "load_checkpoint", "sample_text"]


@dataclasses.dataclass
class Checkpointed:
    """A run's model and (unboxed) parameters, restored from ``step`` onto one device."""

    config: Config
    model: Model
    params: Any = dataclasses.field(repr=False)
    step: int = 0


def load_checkpoint(run_dir: str | os.PathLike, step: int | None = None, device: Any = None) -> Checkpointed:
    """Restore the train state of ``run_dir/checkpoints`` (latest ``step`` by default) on ``device``."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} has no checkpoints/ directory: is it a train.out_dir?")
    with CheckpointManager(ckpt_dir, read_only=True) as mgr:
        info = mgr.info(step)
        meta = info.metadata if isinstance(info.metadata, dict) else {}
        if "config" not in meta:
            raise ConfigError(f"checkpoint {info.path} has no config in its metadata")
        cfg = config_from_dict(meta["config"])
        model = build_model(cfg.model)
        _, init_state = initializers(cfg, model, make_optimizer(cfg.optimizer, cfg.train.steps))
        mesh = Mesh(np.asarray([device or jax.devices()[0]]), ("devices",))
        replicated = NamedSharding(mesh, PartitionSpec())
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                              jax.eval_shape(init_state))
        restored = mgr.restore(info.step, target=target["params"], path="params")  # not the optimizer state
    return Checkpointed(cfg, model, nn.meta.unbox(restored.state), info.step)


def generate(model: Model, params: Any, prompt: np.ndarray, num_tokens: int, *, window: int,
             temperature: float = 0.8, top_k: int | None = 40, seed: int = 0) -> np.ndarray:
    """Sample ``num_tokens`` tokens after ``prompt`` (1-D int), the model seeing the last ``window``."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    tokens = [int(t) for t in prompt] or [DOC_SEPARATOR]

    @jax.jit
    def next_token(params, buf, pos, key):
        logits = model.apply(params, buf[None, :])[0, pos].astype(jnp.float32)
        if top_k is not None and top_k < logits.shape[-1]:
            kth = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if temperature == 0:
            return jnp.argmax(logits)
        return jax.random.categorical(key, logits / temperature)

    key = jax.random.key(seed)
    out = []
    for _ in range(num_tokens):
        ctx = tokens[-window:]
        buf = np.zeros(window, np.int32)
        buf[: len(ctx)] = ctx
        key, sub = jax.random.split(key)
        tok = int(next_token(params, buf, len(ctx) - 1, sub))
        tokens.append(tok)
        out.append(tok)
    return np.asarray(out, np.uint8)


def sample_text(run_dir: str | os.PathLike, prompt: str = "", num_tokens: int = 200, *, step: int | None = None,
                temperature: float = 0.8, top_k: int | None = 40, seed: int = 0) -> tuple[str, Checkpointed]:
    """``(generated text after prompt, the checkpoint used)``."""
    ck = load_checkpoint(run_dir, step)
    window = min(ck.config.data.seq_len, ck.config.model.max_len)
    out = generate(ck.model, ck.params, encode(prompt), num_tokens, window=window, temperature=temperature,
                   top_k=top_k, seed=seed)
    return decode(out), ck
