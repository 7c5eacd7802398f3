"""Flax NNX objects in `parallelize`'s functional form: ``(state, batch) -> (out, new_state)``.

`parallelize` compiles a function of its state and a batch that returns the
new state. The NNX idiom is a step that updates a model and an
`nnx.Optimizer` in place: ``train_step(model, optimizer, batch) -> loss``.
`functional_step` is the one bridge between the two: NNX modules and
optimizers are pytrees, so the state is the tuple ``(model, optimizer)``
itself (or, with ``graphdef=``, the `nnx.State` of ``nnx.split((model,
optimizer))``), and the step returns it after the in-place updates.

`nnx_model_parts` does the same for `parallelize_step`'s NNX models (an
instance or an ``rngs -> module`` factory), checking the factory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

__all__ = ["functional_step", "nnx_model_parts"]


def functional_step(train_step: Callable, graphdef: Any = None) -> Callable[[Any, Any], tuple[Any, Any]]:
    """``train_step(*objects, batch) -> out``, updating NNX objects in place, as ``step(state, batch) -> (out, state)``.

    ``state`` is the tuple of NNX objects the step updates, e.g. ``(model, optimizer)``
    (NNX modules and optimizers are pytrees: `parallelize`'s ``init_params`` returns
    the tuple, created sharded); with ``graphdef`` (from ``nnx.split((model, optimizer))``)
    it is their `nnx.State`, merged before and split after each step. ``out`` is whatever
    ``train_step`` returns (the loss, say).

        step = functional_step(train_step)
        step_fn, init_fn, batch_fn = parallelize(step, init_params=lambda: make_model_and_optimizer(), ...)
        loss, state = step_fn(init_fn(), batch_fn())     # state: (model, optimizer), sharded
    """
    if not callable(train_step):
        raise TypeError(f"functional_step needs the in-place step train_step(model, optimizer, batch), "
                        f"got {type(train_step).__name__}")
    name = getattr(train_step, "__name__", "train_step")

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        objects = nnx.merge(graphdef, state) if graphdef is not None else state
        if not isinstance(objects, (tuple, list)):
            raise TypeError(
                f"functional_step({name}): the state must be the tuple of NNX objects {name} updates, "
                f"e.g. (model, optimizer), got {type(objects).__name__}; have init_params return "
                f"(model, optimizer){' and split that tuple' if graphdef is not None else ''}")
        out = train_step(*objects, batch)
        return out, (nnx.state(tuple(objects)) if graphdef is not None else tuple(objects))

    step.__name__ = step.__qualname__ = name  # messages name the user's step (no __wrapped__: its signature differs)
    return step


def _factory_call(factory: Any) -> Callable[[nnx.Rngs], Any]:
    """How to call an NNX factory with its rngs (positionally, else as ``rngs=``), or a TypeError."""
    what = f"the NNX model factory {getattr(factory, '__qualname__', factory)!r}"
    try:
        if isinstance(factory, type):  # NNX's metaclass hides the class's own signature: read __init__'s
            init = inspect.signature(getattr(factory, "__init__"))  # the class's function, not a bound method
            sig = init.replace(parameters=list(init.parameters.values())[1:])
        else:
            sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return factory
    probe = object()
    for call, bind in ((lambda rngs: factory(rngs), lambda: sig.bind(probe)),
                       (lambda rngs: factory(rngs=rngs), lambda: sig.bind(rngs=probe))):
        try:
            bind()
        except TypeError:
            continue
        return call
    raise TypeError(
        f"parallelize_step: {what}{sig} must take one argument, the nnx.Rngs (positionally or as rngs=), "
        f"and return the module; wrap it, e.g. model=lambda rngs: MyModel(config, rngs=rngs)")


def _checked_module(made: Any, factory: Any) -> nnx.Module:
    what = f"the NNX model factory {getattr(factory, '__qualname__', factory)!r}"
    if made is None:
        raise TypeError(f"parallelize_step: {what} returned None (a missing return?); it must return the nnx.Module")
    if isinstance(made, nn.Module):
        raise TypeError(f"parallelize_step: {what} returned a Flax Linen module ({type(made).__name__}); pass "
                        f"the Linen module itself as model=, or make the factory return an nnx.Module")
    if not isinstance(made, nnx.Module):
        raise TypeError(f"parallelize_step: {what} returned a {type(made).__name__}, not an nnx.Module; "
                        f"it must build and return the module, e.g. lambda rngs: MyModel(rngs=rngs)")
    return made


def nnx_model_parts(model: Any, seed: int) -> tuple[Callable[[], Any], Callable]:
    """For an NNX module, or an ``rngs -> module`` factory: the params builder and ``apply(params, batch)``."""
    if isinstance(model, nnx.Module):
        graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
        make = lambda: params
    else:
        if not callable(model):
            raise TypeError(f"parallelize_step: model must be a Flax Linen module, an nnx.Module or a factory "
                            f"rngs -> nnx.Module, got {type(model).__name__}")
        call = _factory_call(model)
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: _checked_module(call(nnx.Rngs(seed)), model))
            graphdef, _, *rest = nnx.split(abstract, nnx.Param, ...)

        def make():
            return nnx.split(call(nnx.Rngs(seed)), nnx.Param, ...)[1]

    if any(len(jax.tree.leaves(r)) for r in rest):
        kinds = sorted({type(v).__name__ for r in rest
                        for v in jax.tree.leaves(r, is_leaf=lambda x: isinstance(x, nnx.Variable))})
        raise ValueError(
            f"parallelize_step trains nnx.Param variables only; the model also holds {kinds}. "
            f"Keep such state outside the module, or use parallelize() with functional_step")

    def apply(params: Any, batch: Any) -> Any:
        return nnx.merge(graphdef, params, *rest)(batch)

    return make, apply
