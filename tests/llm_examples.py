"""Training a jax-llm-examples model (Llama 3, Qwen3-MoE, DeepSeek-R1/V3: one API, ``Weights.init`` and
``forward(tokens, segment_ids, weights, cfg)``) as a user would, shared by their vendored-model tests: the
state, the next-token loss, the step (optionally microbatched under 1F1B), the batch, the step `parallelize`d
on the model's mesh or as a pipeline of tasks, and a training loop."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from multimesh.jax import microbatch, parallelize, register_task

__all__ = ["Training", "leaf_differences", "model_rules", "train", "two_stage_meshes"]


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

    def spmd(self, cfg: Any) -> tuple:
        """``parallelize``'s ``(step, init, get_batch)`` on the model's mesh, with the model's rule for the batch."""
        init, loss = self.program(cfg)
        return parallelize(self.make_step(loss), init_params=init, get_input_batch=self.get_batch, mesh=cfg.mesh,
                           rules=model_rules(cfg))

    def pipeline(self, cfg: Any, stages: Sequence[tuple[str, jax.sharding.Mesh]], microbatches: int, *,
                 by_params: bool = True) -> tuple:
        """``parallelize``'s ``(step, init, get_batch)`` for the loss microbatched under 1F1B over one task per
        ``(pattern, mesh)`` of ``stages`` (named ``stage0``, ``stage1``...): ``pattern`` matches the parameters'
        paths (`register_task(params=...)`), or with ``by_params=False`` the scopes the model's code opens."""
        init, loss = self.program(cfg)
        with contextlib.ExitStack() as registrations:
            for i, (pattern, mesh) in enumerate(stages):
                where = {"params": pattern} if by_params else {"regex": pattern}
                registrations.enter_context(register_task(**where, mesh=mesh, name=f"stage{i}",
                                                          logical_axes=model_rules(cfg)))
            return parallelize(self.make_step(loss, microbatches), init_params=init, get_input_batch=self.get_batch,
                               mesh=cfg.mesh, rules=model_rules(cfg))


def two_stage_meshes(model_mesh: Callable[..., jax.sharding.Mesh]) -> list[jax.sharding.Mesh]:
    """Devices 0-3 and 4-7, each as the model's mesh of shape (1, 2, 2)."""
    devices = jax.devices()
    return [model_mesh(devices[:4], (1, 2, 2)), model_mesh(devices[4:], (1, 2, 2))]


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


def leaf_differences(state: Any, ref_state: Any) -> list[float]:
    """Each leaf's largest absolute difference from the reference's, in leaf order."""
    return [float(np.max(np.abs(np.asarray(a, np.float64) - b), initial=0.0))
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state))]
