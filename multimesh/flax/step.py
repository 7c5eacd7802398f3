"""`shard_axes` and `parallelize_step` for Flax Linen and NNX models."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding

from .._compat.flax import running_linen_module
from ..core.meshes import build_mesh
from ..core.rules import MeshAxes, Rules, standard_rules
from ..run.parallelize import StepFunctions, parallelize_on_mesh
from ..trace.linen_constraints import flax_context_rules
from .nnx_bridge import nnx_model_parts

__all__ = ["FALLBACK_INIT", "parallelize_step", "shard_axes"]


#: What `shard_axes` initialises with when neither ``init=`` nor the module it is given to says (MultiMesh's).
FALLBACK_INIT = nn.initializers.xavier_normal()


def shard_axes(*names: str | None, init: Callable | None = None) -> Callable:
    """An initializer that attaches logical axis names to the parameter it creates.

    ``nn.Dense(4, kernel_init=shard_axes("embed", "mlp"))`` or
    ``self.param("w", shard_axes("embed", "mlp"), (d, f))``.

    It initialises as ``init`` when given; else as the module it is given to
    would by default (``nn.Dense``'s ``kernel_init``: LeCun normal;
    ``bias_init``: zeros; ``nn.Embed``'s ``embedding_init``), so that naming
    the axes changes nothing else; else (``self.param`` of a module without
    such a field) with `FALLBACK_INIT`, Xavier normal as in MultiMesh.
    """
    if init is not None:
        return nn.with_logical_partitioning(init, names)

    def own(key: jax.Array, shape: Any, dtype: Any = jax.numpy.float32) -> jax.Array:
        return _module_default(own)(key, shape, dtype)

    return nn.with_logical_partitioning(own, names)


def _module_default(initializer: Callable) -> Callable:
    """The class default of the field of the running Linen module that holds ``initializer`` (e.g. the
    ``kernel_init`` of an ``nn.Dense(kernel_init=shard_axes(...))``); `FALLBACK_INIT` when there is none."""
    module = running_linen_module()
    fields = getattr(type(module), "__dataclass_fields__", {})
    for name, field in fields.items():
        value = getattr(module, name, None)
        if callable(field.default) and _wraps(value, initializer):
            return field.default
    return FALLBACK_INIT


def _wraps(value: Any, initializer: Callable) -> bool:
    """Whether ``value`` is the boxed initializer `shard_axes` returned around ``initializer``."""
    inner = getattr(value, "__wrapped__", None) or getattr(value, "fn", None)
    closure = getattr(value, "__closure__", None) or ()
    return inner is initializer or any(c.cell_contents is initializer for c in closure)


def _is_linen(model: Any) -> bool:
    """A Linen module, or an object with Linen's ``init``/``apply``; everything else goes the NNX way."""
    if isinstance(model, nn.Module):
        return True
    return not isinstance(model, (nnx.Module, type)) and hasattr(model, "init") and hasattr(model, "apply")


def parallelize_step(
    model: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh | Mapping[str, int],
    global_batch: Any = None,
    local_batch: Any = None,
    replicate_inputs: bool = False,
    *,
    rules: Iterable[tuple[str, MeshAxes]] | Rules | None = None,
    seed: int = 42,
    rng: jax.Array | None = None,
    donate: bool = True,
    strict: bool = False,
) -> tuple:
    """A sharded training step for a model whose ``apply(params, batch)`` is the loss.

    ``model`` is a Flax Linen module (``model.apply(params, batch) -> loss``,
    initialised with ``model.init(jax.random.key(seed), batch)``), or a Flax
    NNX module whose ``__call__(batch)`` is the loss: an instance, or a
    function ``rngs -> module`` so that parameters are created sharded.

    The state is a `flax.training.train_state.TrainState`; the step is
    ``step(state, batch) -> (loss, new_state)``, the loss computed before the
    update. The batch's leading dimension is sharded over the data axes (rule
    ``"batch"``: data parallelism); ``replicate_inputs=True`` places it whole
    on every device instead (MultiMesh's default). ``mesh`` is a `Mesh` or an
    ``{axis: size}`` shape (`build_mesh`). ``rules`` default to those of Flax's ``nn.logical_axis_rules``
    context in force, else `standard_rules` for the mesh's axes.
    ``strict=True`` makes indivisible dimensions, logical names without a
    rule and `register_task` patterns that match nothing errors (as
    `parallelize`'s ``strict``).

    An NNX factory is called with an `nnx.Rngs` of ``seed`` (positionally,
    else as ``rngs=``) and must return the `nnx.Module`: anything else is a
    TypeError naming the factory. For an NNX step that updates a model and an
    `nnx.Optimizer` in place, use `parallelize` with `functional_step`.

    Returns ``(step, state, mesh)`` with ``global_batch``, or
    ``(step, state, mesh, prepare_batch)`` with ``local_batch`` (this
    process's part), where ``prepare_batch(host_arrays)`` assembles the global
    batch from every process's local part.
    """
    if (global_batch is None) == (local_batch is None):
        raise TypeError("parallelize_step needs exactly one of global_batch= or local_batch=")
    if isinstance(mesh, Mapping):
        mesh = build_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or an {{axis: size}} dict, got {type(mesh).__name__}")
    if rules is None:
        rules = flax_context_rules(mesh) or standard_rules(mesh.axis_names)
    key = jax.random.key(seed) if rng is None else rng

    if local_batch is not None:
        n = jax.process_count()
        example = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] * n, *np.shape(x)[1:]), np.asarray(x).dtype), local_batch
        )
    else:
        example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), global_batch)

    if not _is_linen(model):
        make_params, apply_fn = nnx_model_parts(model, seed)
    else:
        apply_fn = model.apply
        make_params = lambda: model.init(key, jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), example))

    def init_state() -> TrainState:
        return TrainState.create(apply_fn=apply_fn, params=make_params(), tx=optimizer)

    def train_step(state: TrainState, batch: Any) -> tuple[jax.Array, TrainState]:
        loss, grads = jax.value_and_grad(lambda p: state.apply_fn(p, batch))(state.params)
        return loss, state.apply_gradients(grads=grads)

    batch_spec = (None,) if replicate_inputs else ("batch",)
    made = parallelize_on_mesh(
        train_step,
        init_params=init_state,
        get_input_batch=lambda: jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), example),
        mesh=mesh,
        rules=rules,
        batch_spec=batch_spec,
        donate=donate,
        strict=strict,
    )
    if not isinstance(made, StepFunctions):  # given init_params= and get_input_batch=, it returns all three
        raise AssertionError(f"parallelize_step: parallelize returned {type(made).__name__}, not StepFunctions")
    step, sharded_init = made.step, made.init_params
    state = sharded_init()
    if global_batch is not None:
        return step, state, mesh

    def prepare_batch(host_arrays: Any) -> Any:
        """This process's part of the batch -> the global batch, sharded."""
        return jax.tree.map(
            lambda x, s, ex: jax.make_array_from_process_local_data(s, np.asarray(x), ex.shape),
            host_arrays,
            step.batch_shardings,
            example,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )

    return step, state, mesh, prepare_batch

