"""The train and eval steps of a config, written for one device and parallelized by the layout.

The model is the config's ``model.api``: the Linen :class:`models.transformer.Transformer`
or the NNX one behind :class:`models.nnx_transformer.FunctionalModel` (both
``init(key, tokens)`` and ``apply(params, tokens)``; the NNX parameters are an
``nnx.State`` created by a ``rngs -> module`` factory, so sharded at birth).
The train state is ``{"params": the model's parameters, "opt": optax state}``; the
step returns ``({"loss", "grad_norm", "nonfinite_params", "moe_aux_loss"}, new_state)`` (the third:
how many updated parameter values are NaN or infinite, see ``trainers.nonfinite``). The loss is the sum
of the next-token cross-entropies divided by the *global* token count, so that it
is the mean whether or not a pipeline splits the batch into microbatches. A Mixture-of-Experts model
(``model.num_experts > 0``) also trains on ``model.moe_aux_loss_coef`` times its load-balancing loss
(summed over its MoE layers, :mod:`models.moe`): ``moe_aux_loss`` reports it (0 for a dense model), and
``loss`` stays the cross-entropy. Under microbatches each microbatch's load-balancing loss (a mean over
its sequences) counts by its share of the tokens, so a pipeline trains on the whole batch's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.moe import sown_aux_loss
from models.nnx_transformer import FunctionalModel
from models.transformer import Transformer, TransformerConfig, next_token_loss
from trainers.config import Config
from trainers.grad_accum import accumulated_value_and_grad
from trainers.layout import RunLayout, build_layout
from trainers.mixed_precision import cast_for_compute
from trainers.nonfinite import count_nonfinite
from trainers.optim import learning_rate_schedule, make_optimizer, schedule_length

__all__ = ["Model", "Program", "TrainFunctions", "build_model", "build_program", "initializers", "logits_and_aux_loss",
           "loss_sum_over", "train_functions", "training_loss"]

#: What ``model.api`` builds; both have ``init(key, tokens)`` and ``apply(params, tokens)``.
Model = Transformer | FunctionalModel


def build_model(config: TransformerConfig) -> Model:
    """The model of ``config.api``: Linen ``Transformer`` or the NNX ``FunctionalModel``."""
    return FunctionalModel(config) if config.api == "nnx" else Transformer(config)


def logits_and_aux_loss(model: Model, params: Any, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The model's logits for ``tokens`` and the sum of its MoE layers' load-balancing losses (0: none)."""
    sown: Any
    if isinstance(model, FunctionalModel):
        logits, sown = model.apply_with_intermediates(params, tokens)
    else:
        logits, sown = model.apply(params, tokens, mutable=["intermediates"])
    return logits, sown_aux_loss(sown)


def loss_sum_over(model: Model, params: Any, batch: dict, n_tokens: int) -> jax.Array:
    """Next-token cross-entropy summed over ``batch["tokens"]`` [B, T+1], divided by ``n_tokens``; the
    parameter matrices cast to the compute dtype first (`trainers.mixed_precision`)."""
    tokens = batch["tokens"]
    logits = model.apply(cast_for_compute(params, model.config.compute_dtype), tokens[:, :-1])
    return next_token_loss(logits, tokens, reduction="sum") / n_tokens


def training_loss(model: Model, aux_coef: float, params: Any, batch: dict,
                  n_tokens: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(objective, parts)`` of ``batch``: the cross-entropy summed and divided by ``n_tokens`` plus
    ``aux_coef`` times the load-balancing loss weighted by the batch's share of the ``n_tokens``; ``parts``
    holds both terms, each as it is summed over microbatches (``loss``, ``moe_aux_loss``)."""
    tokens = batch["tokens"]
    logits, aux = logits_and_aux_loss(model, cast_for_compute(params, model.config.compute_dtype), tokens[:, :-1])
    ce = next_token_loss(logits, tokens, reduction="sum") / n_tokens
    # weighted by the microbatch's tokens, then divided by the step's: a product with their ratio alone (1/4
    # with 4 microbatches) reads as a mean over the microbatch to `microbatch`'s MicrobatchMeanWarning
    aux = aux * (tokens.shape[0] * (tokens.shape[1] - 1)) / n_tokens
    return ce + aux_coef * aux, {"loss": ce, "moe_aux_loss": aux}


def initializers(cfg: Config, model: Model, tx: optax.GradientTransformation) -> tuple[Callable, Callable]:
    """``(init_params, init_state)``: zero-argument initializers of the parameters (from
    ``train.seed``) and of the train state ``{"params", "opt"}``."""

    def init_params():
        return model.init(jax.random.key(cfg.train.seed), jnp.zeros((1, cfg.data.seq_len), jnp.int32))

    def init_state():
        params = init_params()
        return {"params": params, "opt": tx.init(params)}

    return init_params, init_state


@dataclasses.dataclass
class Program:
    """A config's model, optimizer and parallel steps on a layout.

    ``step(state, batch) -> (metrics, state)``, ``init() -> state`` (born
    sharded), ``evaluate(params, batch) -> loss``; ``step.abstract_params`` is
    the state's restore target.
    """

    config: Config
    layout: RunLayout
    model: Model
    optimizer: optax.GradientTransformation
    lr_schedule: optax.Schedule
    step: Any
    init: Any
    evaluate: Any

    @property
    def abstract_state(self) -> Any:
        """The train state as ``ShapeDtypeStruct``s with this layout's shardings (a restore target)."""
        return self.step.abstract_params

    def __repr__(self) -> str:
        return f"Program({self.config.name!r}, {self.layout.describe()})"


@dataclasses.dataclass(frozen=True)
class TrainFunctions:
    """A config's one-device functions, before any layout: the model, optimizer and its learning-rate
    schedule, the initializers, and ``train_step(state, batch)``, ``eval_step(params, batch)``."""

    model: Model
    optimizer: optax.GradientTransformation
    lr_schedule: optax.Schedule
    init_params: Callable[[], Any]
    init_state: Callable[[], Any]
    train_step: Callable
    eval_step: Callable


def train_functions(cfg: Config, loss_for_grad: Callable[[Callable, int], Callable],
                   global_tokens: int) -> TrainFunctions:
    """The config's functions; ``loss_for_grad(loss_fn, batch_size)`` is the loss the step differentiates
    (a layout's :meth:`RunLayout.loss_for_grad`: microbatched in a pipeline), ``global_tokens`` the
    predicted tokens of one training batch (the loss is normalised by them)."""
    model = build_model(cfg.model)
    decay_steps = schedule_length(cfg.optimizer, cfg.train.steps)
    schedule = learning_rate_schedule(cfg.optimizer, decay_steps)
    tx = make_optimizer(cfg.optimizer, decay_steps)

    init_params, init_state = initializers(cfg, model, tx)
    loss_fn = functools.partial(training_loss, model, cfg.model.moe_aux_loss_coef, n_tokens=global_tokens)
    k = cfg.train.grad_accum
    grad_fn = accumulated_value_and_grad(loss_for_grad(loss_fn, cfg.data.batch_size // k), k, has_aux=True)

    def train_step(state, batch):
        (_, parts), grads = grad_fn(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**parts, "grad_norm": optax.tree.norm(grads), "nonfinite_params": count_nonfinite(params)}
        return metrics, {"params": params, "opt": opt}

    def eval_step(params, batch):
        b, t1 = batch["tokens"].shape
        return loss_sum_over(model, params, batch, b * (t1 - 1))

    return TrainFunctions(model, tx, schedule, init_params, init_state, train_step, eval_step)


def build_program(cfg: Config, layout: RunLayout, train_batch: dict[str, np.ndarray],
                  val_batch: dict[str, np.ndarray]) -> Program:
    """Build and parallelize the steps (for a pipeline: inside ``layout.tasks(...)``)."""
    global_tokens = int(np.prod(train_batch["tokens"].shape)) - train_batch["tokens"].shape[0]
    f = train_functions(cfg, layout.loss_for_grad, global_tokens)
    step, init = layout.parallelize(f.train_step, f.init_state, train_batch, donate=True)
    evaluate, _ = layout.parallelize(f.eval_step, f.init_params, val_batch, donate=False)
    return Program(cfg, layout, f.model, f.optimizer, f.lr_schedule, step, init, evaluate)


def zeros_batch(cfg: Config) -> dict[str, np.ndarray]:
    """A batch of the config's shape (token 0 everywhere): enough to trace and plan a step."""
    return {"tokens": np.zeros((cfg.data.batch_size, cfg.data.seq_len + 1), np.int32)}


def program_for(cfg: Config, devices: Any = None, batch: dict[str, np.ndarray] | None = None) -> Program:
    """``cfg``'s program on its layout over ``devices`` (default: all), traced for ``batch`` (default:
    `zeros_batch`) as its train and its eval batch; nothing is run: for planning, benchmarks and tests."""
    layout = build_layout(cfg.layout, devices)
    batch = zeros_batch(cfg) if batch is None else batch
    with layout.tasks(cfg.model.num_layers, cfg.model.scan_layers):
        return build_program(cfg, layout, batch, batch)
