"""Training a jax-llm-examples model (Llama 3, Qwen3-MoE, DeepSeek-R1/V3: one API, ``Weights.init`` and
``forward(tokens, segment_ids, weights, cfg)``) as a user would, shared by their vendored-model tests: the
state, the next-token loss, the step (optionally microbatched under 1F1B), the batch and a training loop."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from multimesh.jax import microbatch

__all__ = ["Training", "model_rules", "train"]


@dataclass(frozen=True)
class Training:
    """One model's training set-up: ``load()`` gives its module, ``tx`` the optimizer; batches of ``batch``
    sequences of ``length`` tokens drawn from ``[low, vocab)``."""

    load: Callable[[], types.ModuleType]
    tx: optax.GradientTransformation
    batch: int
    length: int
    vocab: int
    low: int = 1

    def program(self, cfg: Any) -> tuple[Callable[[], dict], Callable]:
        """``init()`` (the model's own initializer and the optimizer's state) and ``loss(weights, batch)``."""
        model = self.load()

        def init() -> dict:
            weights = model.Weights.init(jax.random.key(0), cfg)
            return {"params": weights, "opt": self.tx.init(weights)}

        def loss(weights: Any, batch: dict) -> jax.Array:
            """Next-token cross entropy, summed and divided by the global token count (microbatches add up);
            one-hot, as an integer gather has no unambiguous output sharding on an Explicit mesh."""
            tokens = batch["inputs"]
            logits, _ = model.forward(tokens, jnp.ones_like(tokens), weights, cfg)
            log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
            return -jnp.sum(jax.nn.one_hot(tokens[:, 1:], self.vocab) * log_probs) / (self.batch * (self.length - 1))
        return init, loss

    def make_step(self, loss: Callable, microbatches: int | None = None) -> Callable:
        """The train step; with ``microbatches``, the loss ``microbatch``ed under 1F1B."""
        def step(state, batch):
            fn = loss if microbatches is None else microbatch(
                loss, 0, self.batch // microbatches, argnum=1, schedule="1f1b")
            value, grads = jax.value_and_grad(fn)(state["params"], batch)
            updates, opt = self.tx.update(grads, state["opt"], state["params"])
            return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}
        return step

    def get_batch(self) -> dict[str, jax.Array]:
        return {"inputs": jax.random.randint(jax.random.key(1), (self.batch, self.length), self.low, self.vocab)}


def model_rules(cfg: Any) -> list[tuple[str, Any]]:
    """The model's own rule for the batch (``ShardingRules.batch``): the rest of its layout is its code's."""
    return [("batch", cfg.rules.batch)]


def train(step: Callable, state: Any, batch: Any, steps: int) -> tuple[list[float], list[Any]]:
    """``steps`` steps: the losses and the host states after each."""
    losses, states = [], []
    for _ in range(steps):
        loss, state = step(state, batch)
        losses.append(float(loss))
        states.append(jax.device_get(state))
    return losses, states
