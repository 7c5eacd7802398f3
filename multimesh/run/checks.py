"""What a built step is called with and what it returns: errors that name the leaf, the step and the fix.

Nothing here runs on a step's fast path. Parameter shapes are compared when
JAX traces the step (a new signature: jit's cache misses); donated buffers,
layouts and batch shapes are diagnosed only after a call has failed, and the
original JAX error is chained as the cause. An MPMD step, whose plan is built
for one set of shapes, compares its flat input shapes per call (a tuple
comparison, next to dozens of dispatches).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..core.donation import DonatedArrayError, deleted_paths
from ..core.fmt import device_span, keypath_str
from ..core.nonarrays import is_array, non_arrays

__all__ = [
    "DonatedArrayError",
    "StepInputError",
    "check_arrays",
    "check_in_place_nnx",
    "check_outputs",
    "check_shapes",
    "checked",
    "explain_call_error",
    "fun_name",
    "place_batch",
]


class StepInputError(ValueError):
    """A step was called with a leaf of another shape or layout than it was built for."""


def fun_name(fun: Callable) -> str:
    return getattr(fun, "__name__", None) or type(fun).__name__


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(keypath_str(p, root="(the whole tree)"), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _shape(x: Any) -> tuple | None:
    try:
        return tuple(np.shape(x))
    except (TypeError, ValueError):  # an object that is no array at all: the structure check names it
        return None


def _aval(x: Any) -> str:
    shape = _shape(x)
    dtype = getattr(x, "dtype", None)
    return f"{dtype}{list(shape) if shape is not None else '?'}".replace(" ", "")


def describe_sharding(s: Any) -> str:
    """``P('data', None) on mesh {'data': 4, 'model': 2} (devices 0-7)``; other shardings as JAX prints them."""
    if isinstance(s, NamedSharding):
        ids = [d.id for d in s.mesh.devices.flat]
        return f"{s.spec} on mesh {dict(s.mesh.shape)} (devices {device_span(ids)})"
    return repr(s)


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------


def check_outputs(out: Any, fun: Callable) -> None:
    """Raise `TypeError` naming ``fun`` and the output path of each leaf that is not an array or a number."""
    bad = non_arrays(out, "output")
    if bad:
        raise TypeError(
            f"step {fun_name(fun)!r} returned {bad}; a step runs under jax.jit and may only return arrays and "
            f"numbers (in any pytree). Return other values (strings, objects) from a function around the step, "
            f"or keep them out of the returned tree"
        )


def check_in_place_nnx(fun: Callable, params: Any, required: int) -> None:
    """A step of NNX objects and a batch (``train_step(model, optimizer, batch)``, updating them in place)
    given to `parallelize` as it is: a TypeError naming the bridge."""
    objects = params if isinstance(params, (tuple, list)) else (params,)
    if required == len(objects) + 1 and any(isinstance(o, nnx.Pytree) for o in objects):
        kinds = ", ".join(type(o).__name__ for o in objects)
        raise TypeError(
            f"parallelize calls fun(params, batch), but {fun_name(fun)} takes {required} arguments and the "
            f"parameters are NNX objects ({kinds}): a step that updates them in place goes through "
            f"multimesh.jax.flax.functional_step, parallelize(functional_step({fun_name(fun)}), init_params=...)")


def check_arrays(tree: Any, what: str, leaf: str) -> None:
    """Raise `TypeError` naming ``what`` and each ``leaf`` path of ``tree`` that is not an array or a number."""
    bad = non_arrays(tree, leaf)
    if bad:
        raise TypeError(f"{what} holds {bad}; give arrays (numpy or jax) and numbers, in any pytree")


def checked(make: Callable[[], Any], what: str) -> Callable[[], Any]:
    """``make``, whose result is checked to hold only arrays (for `jax.eval_shape` of an initializer)."""
    def run() -> Any:
        out = make()
        bad = non_arrays(out, "leaf")
        if bad:
            raise TypeError(f"{what} ({fun_name(make)!r}) returned {bad}; it must return arrays (in any pytree)")
        return out

    setattr(run, "__wrapped__", make)  # JAX's messages name the user's function (mypy: no attributes on functions)
    return run


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


def shape_mismatches(built: Any, given: Any, what: str) -> list[str]:
    """``"params leaf 'w': built for float32[16,8], given float32[16,4]"`` per leaf of another shape."""
    out = []
    for (path, a), x in zip(_leaves(built), jax.tree.leaves(given)):
        if _shape(x) is not None and _shape(x) != tuple(a.shape):
            out.append(f"{what} leaf {path!r}: built for {_aval(a)}, given {_aval(x)}")
    return out


def check_shapes(built: Any, given: Any, what: str, fun: Callable) -> None:
    """Raise `StepInputError` when a leaf of ``given`` has another shape than the step was built for."""
    problems = shape_mismatches(built, given, what)
    if problems:
        raise StepInputError(
            f"step {fun_name(fun)!r} was called with {len(problems)} {what} leaf(s) of another shape than it "
            f"was built for: " + "; ".join(problems[:5])
            + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
            + f". Pass the {what} that the sharded initializer (or the step itself) returned, or build the step "
            f"again (parallelize) for these shapes"
        )


def _layout_mismatches(shardings: Any, given: Any, what: str) -> list[str]:
    out = []
    for (path, s), x in zip(_leaves(shardings), jax.tree.leaves(given)):
        have = getattr(x, "sharding", None)
        if not isinstance(x, jax.Array) or have is None or have == s:
            continue
        if isinstance(have, type(s)) and have.is_equivalent_to(s, x.ndim):
            continue
        out.append(f"{what} leaf {path!r} is laid out as {describe_sharding(have)}, the step expects "
                   f"{describe_sharding(s)}")
    return out


def explain_call_error(e: Exception, fun: Callable, *, params: Any, batch: Any, abstract_params: Any,
                       abstract_batch: Any, param_shardings: Any | None, donate: bool) -> Exception | None:
    """A clear error for a failed call of a built step, or None when the inputs show no cause.

    In order: buffers deleted by an earlier donation, parameters of another
    shape, parameters laid out for another mesh (``param_shardings``; None
    when the step moves its inputs itself), a batch of other shapes.
    """
    name = fun_name(fun)
    deleted = deleted_paths(params)
    if deleted:
        why = (f"step {name!r} was built with donate=True, so each call gives the state's buffers to the "
               f"step and frees them: an earlier call of {name!r} was given these arrays"
               if donate else f"step {name!r} does not donate its inputs, so they were deleted or donated "
               f"elsewhere before this call")
        return DonatedArrayError(
            f"{len(deleted)} params leaf(s) have been deleted, e.g. {', '.join(map(repr, deleted[:3]))}: {why}. "
            f"Feed back the state the step returned (loss, state = step(state, batch)) instead of the old one"
            + (", or build the step with donate=False to keep the old state alive" if donate else "")
        )
    deleted = deleted_paths(batch)
    if deleted:
        return DonatedArrayError(f"batch leaf(s) {', '.join(map(repr, deleted[:3]))} have been deleted before "
                                 f"this call of step {name!r}; build a new batch")
    problems = shape_mismatches(abstract_params, params, "params")
    if problems:
        return StepInputError(f"step {name!r} was called with params of another shape than it was built for: "
                              + "; ".join(problems[:5]) + f" ({type(e).__name__}: {_first_line(e)})")
    if param_shardings is not None:
        problems = _layout_mismatches(param_shardings, params, "params")
        if problems:
            return StepInputError(
                f"step {name!r} was called with params laid out for another mesh or sharding: "
                + "; ".join(problems[:3]) + (f"; ... ({len(problems)} in all)" if len(problems) > 3 else "")
                + ". Move them with jax.device_put(params, step.param_shardings), or restore a checkpoint "
                "onto step.abstract_params"
            )
    problems = shape_mismatches(abstract_batch, batch, "batch")
    if problems:
        return StepInputError(f"step {name!r} failed for a batch of other shapes than it was built for ("
                              + "; ".join(problems[:5]) + f"): {type(e).__name__}: {_first_line(e)}")
    return None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _indivisible(shape: Sequence[int], s: NamedSharding) -> str | None:
    """Why ``s`` cannot hold an array of ``shape`` (rank or a dimension that does not divide), or None."""
    if len(s.spec) > len(shape):
        return f"its sharding {s.spec} has {len(s.spec)} dimensions, the leaf has rank {len(shape)}"
    sizes = dict(s.mesh.shape)
    for d, entry in enumerate(s.spec):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        n = math.prod(sizes[a] for a in axes)
        if shape[d] % n:
            return (f"dimension {d} (size {shape[d]}) does not divide over mesh axes {axes} ({n} devices) of its "
                    f"sharding {s.spec}; give a size that is a multiple of {n}")
    return None


class _Indivisible(ValueError):
    """A batch leaf whose shape its sharding does not divide (named by `place_batch`)."""


def _put(x: Any, s: NamedSharding) -> Any:
    """``x`` on ``s``. A shape that does not divide is refused before ``jax.device_put``,
    which prints a stray source line to stdout before its own error (JAX 0.12)."""
    if isinstance(x, jax.Array) and x.sharding == s:
        return x
    shape = _shape(x)
    if shape is not None and _indivisible(shape, s) is not None:
        raise _Indivisible
    return jax.device_put(x, s)


def place_batch(batch: Any, shardings: Any, abstract_batch: Any = None, fun: Callable | None = None) -> Any:
    """Move a batch onto its shardings (a no-op for arrays already there); a leaf that cannot go is named."""
    try:
        return jax.tree.map(_put, batch, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    except Exception as e:
        built = jax.tree.leaves(abstract_batch) if abstract_batch is not None else [None] * len(jax.tree.leaves(batch))
        for (path, x), s, a in zip(_leaves(batch), jax.tree.leaves(shardings), built):
            shape = _shape(x)
            why: str | None
            if not is_array(x):
                why = f"it is a {type(x).__name__} {x!r:.60}, not an array"
            else:
                why = _indivisible(shape, s) if shape is not None else None
            if why is not None:
                step = f" of step {fun_name(fun)!r}" if fun is not None else ""
                was = f" (built for {_aval(a)})" if a is not None else ""
                raise StepInputError(f"batch leaf {path!r}{step} has shape {shape}{was}: {why}") from (
                    None if isinstance(e, _Indivisible) else e)
        raise
