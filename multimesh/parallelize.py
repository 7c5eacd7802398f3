"""`parallelize`: compile a one-device function into a sharded one.

The front door checks its arguments, evaluates parameter and batch shapes
abstractly (nothing is materialised), derives every sharding from
annotations and rules, and builds the SPMD program (one `jax.jit` on one
mesh) or, when the function calls tasks, the MPMD plan.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from .layout import Layout, constrained_inputs, derive_layout
from .meshes import MeshLike, build_mesh
from .mirror import MirrorIndex
from .report import ShardingReport
from .rules import MeshAxes, PathRules, Rules
from .scope import Scope, use_scope
from .treecheck import check_same_structure

__all__ = ["parallelize", "ShardedFunction"]


def _check_zero_arg(fn: Any, name: str) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be a zero-argument function, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    required = [
        p.name
        for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if required:
        raise TypeError(
            f"{name} must be a zero-argument function, but {getattr(fn, '__name__', fn)!r} requires "
            f"{required}; wrap it, e.g. {name}=lambda: f(key, example_input)"
        )


@contextlib.contextmanager
def tracing(scope: Scope):
    """Our scope, with NNX's eager sharding off: shardings are ours to apply."""
    with use_scope(scope), nnx.use_eager_sharding(False):
        yield


class ShardedFunction:
    """The sharded step built by `parallelize` (SPMD: one `jax.jit` on one mesh).

    Call it as ``fun(params, batch, *args)``. Attributes: ``mesh``, ``rules``,
    ``param_shardings``, ``batch_shardings`` (pytrees like the inputs),
    ``param_layout``/``batch_layout`` (a record per array), and `report`.
    """

    def __init__(self, fun: Callable, scope: Scope, params: Layout, batch: Layout, abstract_params: Any,
                 abstract_batch: Any, donate: bool):
        self.fun = fun
        self.scope = scope
        self.param_layout = params
        self.batch_layout = batch
        self._abstract_params = abstract_params
        self._abstract_batch = abstract_batch
        self._param_treedef = jax.tree.structure(abstract_params)
        self._batch_treedef = jax.tree.structure(abstract_batch)
        self._mirror = MirrorIndex(abstract_params, params.shardings)

        def step(p, b, *args):
            with tracing(scope):
                out = fun(p, b, *args)
            return self._mirror.constrain(out)

        step.__name__ = getattr(fun, "__name__", "step")
        self._donate = donate
        self._jitted: dict[int, Any] = {}
        self._step = step

    @property
    def mesh(self):
        return self.scope.mesh

    @property
    def rules(self) -> Rules:
        return self.scope.rules

    @property
    def param_shardings(self) -> Any:
        return self.param_layout.shardings

    @property
    def batch_shardings(self) -> Any:
        return self.batch_layout.shardings

    def _jit(self, n_extra: int):
        if n_extra not in self._jitted:
            self._jitted[n_extra] = jax.jit(
                self._step,
                in_shardings=(self.param_shardings, self.batch_shardings) + (None,) * n_extra,
                donate_argnums=(0,) if self._donate else (),
            )
        return self._jitted[n_extra]

    def __call__(self, params: Any, batch: Any, *args: Any) -> Any:
        if jax.tree.structure(params) != self._param_treedef:
            check_same_structure(self._abstract_params, params, "params")
        if jax.tree.structure(batch) != self._batch_treedef:
            check_same_structure(self._abstract_batch, batch, "batch")
        return self._jit(len(args))(params, place_batch(batch, self.batch_shardings), *args)

    def lower(self, params: Any, batch: Any, *args: Any):
        return self._jit(len(args)).lower(params, batch, *args)

    def report(self, *, batch: bool = False) -> ShardingReport:
        """Where each parameter (or batch array) lives; print it for a table."""
        layout = self.batch_layout if batch else self.param_layout
        return ShardingReport(layout.leaves, title=f"{'batch' if batch else 'parameters'} of {self!r}")

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", "fun")
        return f"ShardedFunction({name}, mesh={dict(self.mesh.shape)}, {len(self.param_layout.leaves)} params)"


def parallelize(
    fun: Callable,
    *,
    init_params: Callable[[], Any] | None = None,
    get_input_batch: Callable[[], Any] | None = None,
    initial_batch: Any = None,
    devices: Sequence | np.ndarray | None = None,
    mesh: MeshLike = None,
    rules: Iterable[tuple[str, MeshAxes]] | Rules | None = None,
    param_rules: PathRules | dict | Iterable | None = None,
    batch_spec: tuple = ("batch",),
    donate: bool = False,
    strict: bool = False,
) -> tuple:
    """Compile ``fun(params, batch, *args)`` into a sharded function.

    Args:
      fun: the one-device step; parameters first, the batch second.
      init_params: zero-argument function returning the parameters (or the
        whole train state); evaluated abstractly, then compiled so that each
        parameter is created directly in its sharding.
      get_input_batch: zero-argument function returning an example batch.
      initial_batch: instead of ``get_input_batch``, a batch (array or pytree).
      devices: the devices to use (default: all).
      mesh: a `Mesh`, or an ``{axis: size}`` shape laid over ``devices``
        (default: 1-D ``{"data": len(devices)}``).
      rules: logical axis rules (see `multimesh.rules`); without rules, only
        annotations that name mesh axes shard anything.
      param_rules: ``{regex: spec}`` for parameters that carry no metadata.
      batch_spec: logical spec of every batch leaf unless ``fun`` constrains it
        (default: the leading dimension is ``"batch"``).
      donate: donate the parameters' buffers to the step (feed its new state back).
      strict: indivisible dimensions and logical names without a rule are errors.

    Returns:
      ``(sharded_fun, sharded_init_params, sharded_get_input_batch)`` with
      ``get_input_batch``, else ``(sharded_fun, sharded_init_params)``.
    """
    if not callable(fun):
        raise TypeError(f"parallelize needs a function, got {type(fun).__name__}")
    if init_params is None:
        raise TypeError("parallelize needs init_params=, a zero-argument function returning the parameters")
    _check_zero_arg(init_params, "init_params")
    if (get_input_batch is None) == (initial_batch is None):
        raise TypeError(
            "parallelize needs exactly one of get_input_batch= (a zero-argument function returning a batch) "
            "or initial_batch= (an already built batch)"
        )
    if get_input_batch is not None:
        _check_zero_arg(get_input_batch, "get_input_batch")

    the_mesh = build_mesh(mesh, devices)
    scope = Scope(the_mesh, Rules(rules if rules is not None else (), strict=strict))
    path_rules = PathRules(param_rules) if param_rules is not None else PathRules()

    with tracing(scope):
        abstract_params = jax.eval_shape(init_params)
        if get_input_batch is not None:
            abstract_batch = jax.eval_shape(get_input_batch)
        else:
            abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), initial_batch)
        closed = _trace(fun, abstract_params, abstract_batch)

    n_params = len(jax.tree.leaves(abstract_params))
    found = constrained_inputs(closed) if closed is not None else {}
    param_found = {i: s for i, s in found.items() if i < n_params}
    batch_found = {i - n_params: s for i, s in found.items() if i >= n_params}
    params = derive_layout(abstract_params, scope, path_rules=path_rules, constraints=param_found, what="parameter")
    batch = derive_layout(abstract_batch, scope, constraints=batch_found, default=batch_spec, exact=True, what="batch")

    if rules is None and all(leaf.spec == jax.sharding.PartitionSpec() or not any(leaf.spec) for leaf in params.leaves):
        warnings.warn(
            f"parallelize: no rules= and no annotation names a mesh axis, so every parameter is replicated "
            f"on all {the_mesh.size} devices; pass rules=[(logical_name, mesh_axis), ...] to shard",
            stacklevel=2,
        )

    sharded = ShardedFunction(fun, scope, params, batch, abstract_params, abstract_batch, donate)

    def init_in_scope():
        with tracing(scope):
            return init_params()

    sharded_init_params = jax.jit(init_in_scope, out_shardings=params.shardings)

    if get_input_batch is None:
        return sharded, sharded_init_params

    def batch_in_scope():
        with tracing(scope):
            return get_input_batch()

    sharded_get_input_batch = jax.jit(batch_in_scope, out_shardings=batch.shardings)
    return sharded, sharded_init_params, sharded_get_input_batch


def _trace(fun: Callable, params: Any, batch: Any):
    """The jaxpr of ``fun(params, batch)``, or None when fun needs more arguments."""
    try:
        sig = inspect.signature(fun)
        required = [p for p in sig.parameters.values() if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(required) > 2:
            return None
    except (TypeError, ValueError):
        pass
    return jax.make_jaxpr(fun)(params, batch)


def place_batch(batch: Any, shardings: Any) -> Any:
    """Move a batch onto its shardings (a no-op for arrays already there)."""
    return jax.tree.map(
        lambda x, s: x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s),
        batch,
        shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
