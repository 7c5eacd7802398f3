"""`microbatch`: split a batch, run a function per microbatch, sum the results.

The function is traced once, as one `jax.jit` (so the model is traced and
differentiated once whatever the number of microbatches), and called once
per microbatch: the calls are unrolled. Each call runs under
``jax.named_scope(f"microbatch_{i}")``; the planner inlines the calls, so
every equation, forward and backward, carries its microbatch index, from
which it forms the (stage, microbatch, forward|backward) units that a
pipeline schedule orders.

The microbatches are called last to first and summed first to last. Reverse
mode visits the trace backwards, so the gradient of a parameter used by every
microbatch is accumulated in the order 0, 1, 2, ...: the order in which
GPipe and 1F1B run the backward passes, which lets each microbatch's gradient
be added (and freed) as soon as it exists.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..schedules import KNOWN_SCHEDULES, Schedule, get_schedule
from .constraints import with_sharding_constraint
from .microbatch_mean import mean_divisors, per_microbatch_mean_outputs
from .pipeline_choice import chosen_pipeline
from .scopes import microbatch_body, scope_stack
from .task import transforms_ignored

__all__ = ["MicrobatchMeanWarning", "Pipeline", "collect_pipelines", "microbatch"]


@dataclass(frozen=True)
class Pipeline:
    """What one `microbatch` call asked for: turned into a `Schedule` once the stages are known."""

    name: str
    num_microbatches: int
    schedule: str | Schedule | type[Schedule]
    num_stages: int | None
    interleave: int | None
    #: Which call of a `microbatch` function this is: two calls in one step are two pipelines, even alike.
    call: int = 0

    @property
    def num_chunks(self) -> int:
        """Chunks per submesh that the schedule asks for (1 but for the interleaved schedule, default 2)."""
        if isinstance(self.schedule, Schedule):
            return self.schedule.num_chunks
        return get_schedule(self.schedule, 1, 1, **({} if self.interleave is None else
                                                    {"num_chunks": self.interleave})).num_chunks

    @property
    def schedule_name(self) -> str:
        """The schedule as the user gave it (a name, or a `Schedule`'s name)."""
        return self.schedule if isinstance(self.schedule, str) else getattr(self.schedule, "name", repr(self.schedule))

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits each backward pass into input and weight gradients (zero-bubble)."""
        if isinstance(self.schedule, Schedule):
            return self.schedule.split_backward
        return self.build(self.num_stages or 1, forward_only=False).split_backward

    def build(self, num_stages: int, *, forward_only: bool) -> Schedule:
        if self.num_stages is not None and self.num_stages != num_stages:
            raise ValueError(
                f"microbatch({self.name}): num_stages={self.num_stages}, but the function's tasks form "
                f"{num_stages} stages; pass num_stages={num_stages} or change the tasks"
            )
        kwargs: dict[str, Any] = {"forward_only": forward_only}
        if self.interleave is not None:  # 1 too: "interleaved" with interleave=1 is one chunk per submesh
            kwargs["num_chunks"] = self.interleave
        if isinstance(self.schedule, Schedule):
            if self.schedule.forward_only != forward_only:
                kind = "forward-only" if self.schedule.forward_only else "forward+backward"
                raise ValueError(f"microbatch({self.name}): the given {kind} schedule does not match a step "
                                 f"{'without' if forward_only else 'with'} a backward pass")
            kwargs.pop("forward_only")
        return get_schedule(self.schedule, num_stages, self.num_microbatches, **kwargs)


_COLLECTOR: contextvars.ContextVar[list | None] = contextvars.ContextVar("multimesh_pipelines", default=None)
_CALLS = itertools.count(1)


@contextlib.contextmanager
def collect_pipelines() -> Iterator[list[Pipeline]]:
    """Record the `microbatch` calls made while tracing inside the block."""
    found: list[Pipeline] = []
    token = _COLLECTOR.set(found)
    try:
        yield found
    finally:
        _COLLECTOR.reset(token)


def _count(leaves: list, dim: int, size: int, where: str) -> int:
    """The number of microbatches, after checking that every leaf splits into it."""
    counts = set()
    for x in leaves:
        shape = np.shape(x)
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"{where}: cannot split along dim {dim}: a leaf has shape {shape}")
        if shape[dim] % size:
            raise ValueError(
                f"{where}: dimension {dim} has size {shape[dim]}, which microbatches of size {size} do not "
                f"divide; use a size that divides {shape[dim]}"
            )
        counts.add(shape[dim] // size)
    if len(counts) > 1:
        raise ValueError(f"{where}: its leaves give different numbers of microbatches {sorted(counts)}; every "
                         f"leaf needs the same size along dim {dim}")
    return counts.pop()


def _size_for(leaves: list, dim: int, count: int, name: str, argnum: int) -> int:
    """The microbatch size that splits dimension ``dim`` of ``leaves`` into ``count`` microbatches."""
    shape = np.shape(leaves[0])
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"microbatch({name}) argument {argnum}: cannot split along dim {dim}: a leaf has shape "
                         f"{shape}")
    if shape[dim] % count:
        raise ValueError(f"microbatch({name}) argument {argnum}: dimension {dim} has size {shape[dim]}, which "
                         f"num_microbatches={count} does not divide; use a number of microbatches that divides "
                         f"{shape[dim]}")
    return shape[dim] // count


def microbatch(
    fun: Callable,
    dim: int,
    size: int | None = None,
    argnum: int = 0,
    schedule: str | Schedule | type[Schedule] | None = None,
    num_stages: int | None = None,
    interleave: int | None = None,
    unrolling: int | None = None,
    arg_shardings: Any = None,
    custom_schedule: Any = None,
    *,
    num_microbatches: int | None = None,
    reduce: str = "sum",
) -> Callable:
    """``fun`` run on microbatches of argument ``argnum``, its results summed (or averaged: ``reduce="mean"``).

    ``microbatch(loss, 0, 4)`` splits dimension 0 into microbatches of *size*
    4 (as MultiMesh's third argument); ``microbatch(loss, 0,
    num_microbatches=4)`` into four microbatches. Give exactly one of the two.

    Args:
      fun: any function; its results (a pytree) are summed over microbatches,
        so a loss must be normalised by the *global* batch for the sum to be
        the mean (as in MultiMesh). A result that plainly is a mean over the
        microbatch (divided by its size, e.g. ``jnp.mean``) is a
        `MicrobatchMeanWarning`: it and its gradient come out ``n`` times the
        mean; pass ``reduce="mean"``.
      dim: the dimension of every leaf of argument ``argnum`` to split.
      size: the microbatch size along ``dim`` (not their number); it must divide the dimension.
      num_microbatches: instead of ``size``, how many microbatches to split
        ``dim`` into; it must divide the dimension.
      argnum: which positional argument to split.
      schedule: with tasks inside, the pipeline schedule: ``"gpipe"``,
        ``"1f1b"`` (default), ``"interleaved"`` (needs the tasks to visit
        each submesh ``interleave`` times per microbatch, in a repeating
        cycle), ``"zb-h1"`` or ``"zb-h2"`` (zero bubble: each backward split
        into input and weight gradients); the aliases ``"one_f_one_b"``,
        ``"onefoneb"``, ``"pipedream_flush"`` (1f1b), ``"interleaved_1f1b"``,
        ``"interleaved1f1b"``, ``"zero-bubble"``, ``"zero-bubble-h1"``,
        ``"zbh1"``, ``"zero-bubble-h2"``, ``"zbh2"`` (names are
        case-insensitive, ``-`` and ``_`` alike); a `Schedule` subclass or
        instance.
      num_stages: the number of stages the tasks are expected to form (checked).
      interleave: virtual stages per device group for the interleaved schedule
        (default 2); ``None`` or 1 for the others.
      unrolling: accepted for MultiMesh compatibility; the calls are always
        unrolled here (the function itself is traced once).
      arg_shardings: a `PartitionSpec` (logical names) or a prefix tree of them
        for argument ``argnum``: constrained before it is sliced (MultiMesh's).
      custom_schedule: MultiMesh's per-mesh lists of task names; not supported
        (pass a `Schedule` as ``schedule`` instead).
      reduce: ``"sum"`` (default, MultiMesh's) adds the microbatches' results;
        ``"mean"`` averages them (their floating-point leaves; gradients
        follow), for a ``fun`` that returns a mean over its microbatch.

    Raises:
      ValueError: a size that does not divide the batch, or an unknown schedule.
    """
    if (size is None) == (num_microbatches is None):
        raise TypeError("microbatch needs exactly one of size (the third argument: how many examples each microbatch "
                        "holds along dim) and num_microbatches= (how many microbatches to split dim into); got "
                        + ("neither" if size is None else f"size={size!r} and num_microbatches={num_microbatches!r}"))
    for what, value in (("size", size), ("num_microbatches", num_microbatches)):
        if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"microbatch: {what} must be a positive integer, got {value!r}")
    for what, value in (("dim", dim), ("argnum", argnum)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"microbatch: {what} must be an int (a dimension / a positional argument index), "
                            f"got {value!r}")
    if custom_schedule is not None:
        raise NotImplementedError(
            "microbatch(custom_schedule=...) is not supported: a schedule here is a Schedule object over "
            "(stage, microbatch, F/B/W) actions; subclass multimesh.jax.Schedule (or pick one of "
            f"{', '.join(KNOWN_SCHEDULES)}) and pass it as schedule= (see MIGRATING.md)")
    if reduce not in ("sum", "mean"):
        raise ValueError(f"microbatch: reduce must be 'sum' (add the microbatches' results, as MultiMesh does) or "
                         f"'mean' (average them), got {reduce!r}")
    if unrolling is not None and (not isinstance(unrolling, (int, np.integer)) or unrolling < 1):
        raise ValueError(f"microbatch: unrolling must be a positive integer, got {unrolling!r}")
    if schedule is None:
        schedule = "1f1b"
    if isinstance(schedule, str):
        get_schedule(schedule, 1, 1, **({"num_chunks": interleave} if interleave not in (None, 1) else {}))
    elif not isinstance(schedule, Schedule) and not (isinstance(schedule, type) and issubclass(schedule, Schedule)):
        raise ValueError(f"microbatch: schedule must be one of {', '.join(KNOWN_SCHEDULES)} or a Schedule, "
                         f"got {schedule!r}")
    name = getattr(fun, "__name__", "fun")

    @functools.wraps(fun)
    def wrapped(*args: Any) -> Any:
        if transforms_ignored():
            return fun(*args)
        if not -len(args) <= argnum < len(args):
            raise ValueError(f"microbatch({name}): argnum={argnum}, but it was called with {len(args)} arguments")
        if arg_shardings is not None:
            constrained = list(args)
            constrained[argnum] = with_sharding_constraint(args[argnum], arg_shardings)
            args = tuple(constrained)
        leaves, treedef = jax.tree.flatten(args[argnum])
        if not leaves:
            raise ValueError(f"microbatch({name}): argument {argnum} has no arrays to split")
        # a layout search may choose the pipeline from outside the step (`pipeline_choice`)
        choice = chosen_pipeline()
        if choice is None:
            if size is not None:
                mb_size = size
            elif num_microbatches is not None:
                mb_size = _size_for(leaves, dim, num_microbatches, name, argnum)
            else:  # checked when microbatch was called: exactly one of the two is given
                raise AssertionError(f"microbatch({name}): neither size nor num_microbatches")
            mb_schedule, mb_stages, mb_interleave = schedule, num_stages, interleave
        else:
            mb_size = choice.size_for(f"microbatch({name})", leaves, dim)
            mb_schedule, mb_stages, mb_interleave = choice.schedule, choice.stages, choice.interleave
        n = _count(leaves, dim, mb_size, f"microbatch({name}) argument {argnum}")
        collector = _COLLECTOR.get()
        if collector is not None:
            collector.append(Pipeline(name, n, mb_schedule, mb_stages, mb_interleave, next(_CALLS)))
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            body = _traced_once(fun, args, argnum, n)
            if reduce == "sum" and n > 1:
                _warn_if_a_mean(body, leaves, treedef, dim, mb_size, n, name)
        else:  # called eagerly: run fun per microbatch (a jit made for this call would compile every call)
            body = lambda mb: fun(*args[:argnum % len(args)], mb, *args[argnum % len(args) + 1:])
        results: list[Any] = [None] * n
        for i in reversed(range(n)):
            with jax.named_scope(f"microbatch_{i}"):  # the slicing too: it belongs to this microbatch
                # A dynamic slice at a literal offset: the segments of every microbatch then differ only
                # in that literal, which the runtime passes as an argument (one program per stage).
                results[i] = body(jax.tree.unflatten(
                    treedef, [jax.lax.dynamic_slice_in_dim(x, i * mb_size, mb_size, axis=dim) for x in leaves]))
        total = results[0]
        for i, r in enumerate(results[1:], 1):
            with jax.named_scope(f"microbatch_{i}"):  # the sum is part of microbatch i's work
                total = jax.tree.map(jax.numpy.add, total, r)
        if reduce == "mean":
            with jax.named_scope(f"microbatch_{n - 1}"):
                total = jax.tree.map(lambda x: x / n if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact) else x,
                                     total)
        return total

    return wrapped


class MicrobatchMeanWarning(UserWarning):
    """A function under `microbatch` returns a mean over its microbatch, which `microbatch` sums."""


def _warn_if_a_mean(body: Callable[[Any], Any], leaves: list, treedef: Any, dim: int, size: int, n: int,
                    name: str) -> None:
    """A `MicrobatchMeanWarning` where the body's scalar result is divided by the microbatch's size
    (`microbatch_mean`); costs one trace of the body, which its first call then reuses."""
    first = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(tuple(size if k == dim % x.ndim else d
                                                                    for k, d in enumerate(x.shape)), x.dtype)
                                         for x in leaves])
    try:
        closed = jax.make_jaxpr(body)(first)
    except Exception:  # noqa: BLE001 -- a body that traces only on its real inputs: nothing to say
        return
    shapes = [x.shape for x in leaves]  # a divisor that is also the global batch's (size * n) is that one
    divisors = mean_divisors(shapes, dim, size) - mean_divisors(shapes, dim, size * n)
    if per_microbatch_mean_outputs(closed, divisors):
        warnings.warn(MicrobatchMeanWarning(
            f"microbatch({name}): its result is divided by the microbatch's size ({size} along dimension {dim}, "
            f"e.g. a jnp.mean), and microbatch sums the {n} microbatches' results, as MultiMesh does: the value "
            f"and its gradient come out {n}x the mean over the batch. Pass reduce='mean' to average them, or "
            f"divide by the global batch ({size * n}) instead"), stacklevel=4)


def _traced_once(fun: Callable, args: tuple, argnum: int, n: int) -> Callable[[Any], Any]:
    """``mb -> fun(*args with mb at argnum)`` as one `jax.jit`, traced for the first microbatch and
    reused by the others (same shapes), so the model is traced and differentiated once, not n times.

    Array leaves of the other arguments are the jit's arguments; any other leaf is fixed. The body is
    traced under the scopes around this call (`scopes.microbatch_body`): JAX starts a jit's trace with
    an empty name stack, and registered scopes and mesh slices are looked up on it. The planner inlines
    the jit again, each copy under its ``microbatch_i`` scope.
    """
    flat, treedef = jax.tree.flatten([a for k, a in enumerate(args) if k != argnum])
    dynamic = [k for k, x in enumerate(flat) if isinstance(x, (jax.Array, np.ndarray, np.generic))]
    outer = scope_stack()

    def body(dyn: list, mb: Any) -> Any:
        others = list(flat)
        for k, x in zip(dynamic, dyn):
            others[k] = x
        call = jax.tree.unflatten(treedef, others)
        call.insert(argnum % len(args), mb)
        with microbatch_body(outer, range(n)):
            return fun(*call)

    body.__name__ = f"microbatch_{getattr(fun, '__name__', 'fun')}"
    jitted = jax.jit(body)
    dyn = [flat[k] for k in dynamic]
    return lambda mb: jitted(dyn, mb)
