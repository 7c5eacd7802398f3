"""JAX and jaxlib internals used by multimesh (tested: the suite on jax/jaxlib 0.12.1 and 0.12.0, its smoke
subset on 0.11.0).

Each function names the public API that would replace it. What jax 0.13 is known to change here is in
``README.md`` beside this module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

from jax._src import config as _config
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import mesh as _mesh
from jax._src import source_info_util as _source_info
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import Jaxpr, JaxprEqn
from jax.sharding import AbstractMesh, Mesh, NamedSharding

__all__ = [
    "batched_copy",
    "concrete_mesh_in_context",
    "convert_constvars_jaxpr",
    "coordination_client",
    "equation_abstract_mesh",
    "equation_context",
    "is_name_scope",
    "legacy_mesh_in_context",
    "name_scope",
    "trace_state_clean",
]


def trace_state_clean() -> bool:
    """Whether no trace is in progress (`jax._src.core.trace_state_clean`).

    Public replacement: none; ``jax.extend.core.unsafe_am_i_under_a_jit_DO_NOT_USE`` answers only for
    ``jit``. Tested on jax 0.12.1 and 0.12.0.
    """
    return _core.trace_state_clean()


def concrete_mesh_in_context() -> Any:
    """The concrete mesh of ``jax.set_mesh`` (an empty mesh outside one), also inside ``jax.jit``.

    Public replacement: ``jax.sharding.get_mesh()``, which refuses to answer inside ``jax.jit``
    (where multimesh's tasks are traced). Tested on jax 0.12.1 and 0.12.0.
    """
    return _mesh.get_concrete_mesh()


def legacy_mesh_in_context() -> Mesh:
    """The mesh of a legacy ``with mesh:`` block (an empty mesh outside one).

    Public replacement: none (``with mesh:`` is superseded by ``jax.set_mesh``; when JAX removes it
    this returns an empty mesh). Tested on jax 0.12.1 and 0.12.0.
    """
    return _mesh.thread_resources.env.physical_mesh


def coordination_client() -> Any:
    """The client of JAX's coordination service (None before ``jax.distributed.initialize``).

    multimesh uses its key-value store, barriers and live-node query, the only channel between
    processes before any compile. Public replacement: none (``jax.experimental.multihost_utils``
    exchanges arrays only, through a compiled program). Tested on jax 0.12.1 and 0.12.0.
    """
    return _distributed.global_state.client


def equation_context(eqn: JaxprEqn) -> contextlib.AbstractContextManager:
    """The settings ``eqn`` was traced under (abstract mesh, compute type, PRNG partitioning, XLA metadata...),
    in force inside ``with``: to bind its primitive again as the equation did (``eqn.ctx.manager``).

    Public replacement: none (``jax.extend.core.JaxprEqn`` carries ``ctx``, a ``jax._src.core.JaxprEqnContext``
    whose fields are not part of the API). Tested on jax 0.12.1 and 0.12.0.
    """
    return eqn.ctx.manager


#: jax 0.11.0 to 0.12.0: an equation's context has one field per setting (``cur_abstract_mesh``...); from
#: 0.12.1 it holds the values of the settings registered for it, in the order of ``jaxpr_eqn_ctx_names()``.
_CONTEXT_HAS_FIELDS = hasattr(_core.JaxprEqnContext, "cur_abstract_mesh")


@functools.cache
def _abstract_mesh_slot() -> int:
    names = getattr(_config, "jaxpr_eqn_ctx_names")  # jax 0.12.1 on
    return names().index("abstract_mesh_context_manager")


def equation_abstract_mesh(eqn: JaxprEqn) -> AbstractMesh:
    """The abstract mesh that was in context where ``eqn`` was traced (an empty one where none was).

    Read as ``eqn.ctx.cur_abstract_mesh`` on jax 0.11.0 to 0.12.0 (checked in their sources, run on 0.12.0),
    from ``eqn.ctx.configs`` at the slot ``jaxpr_eqn_ctx_names()`` gives ``abstract_mesh_context_manager``
    from 0.12.1 (run on 0.12.1). Public replacement: ``jax.sharding.get_abstract_mesh()`` inside
    `equation_context` (the same mesh, for the cost of entering every setting of the equation).
    """
    ctx: Any = eqn.ctx  # typed as the installed JAX has it: one of the two forms
    return ctx.cur_abstract_mesh if _CONTEXT_HAS_FIELDS else ctx.configs[_abstract_mesh_slot()]


def convert_constvars_jaxpr(jaxpr: Jaxpr) -> Jaxpr:
    """``jaxpr`` with its constants turned into leading inputs (``partial_eval.convert_constvars_jaxpr``).

    Public replacement: none in ``jax.extend``. Tested on jax 0.12.1 and 0.12.0.
    """
    return _pe.convert_constvars_jaxpr(jaxpr)


def name_scope(name: str) -> Any:
    """One element of a name stack (``source_info_util.Scope``), as ``jax.named_scope(name)`` pushes.

    Public replacement: none (``jax.extend.source_info_util`` exports ``NameStack`` but not its
    elements). Tested on jax 0.12.1 and 0.12.0.
    """
    return _source_info.Scope(name)


def is_name_scope(element: Any) -> bool:
    """Whether ``element`` of a name stack is a named scope (not a transform such as ``jvp``).

    Public replacement: none (see `name_scope`). Tested on jax 0.12.1 and 0.12.0.
    """
    return isinstance(element, _source_info.Scope)


def _batched_copy_function() -> Any:
    try:
        from jax._src.lib import xla_client

        NamedSharding._internal_device_list  # noqa: B018 - present? (no backend is started at import)
        return xla_client.batched_copy_array_to_devices_with_sharding, xla_client.ArrayCopySemantics.REUSE_INPUT
    except (ImportError, AttributeError):  # pragma: no cover - another jaxlib
        return None


_BATCHED_COPY = _batched_copy_function()
#: Whether `batched_copy` is available in this jaxlib.
HAS_BATCHED_COPY = _BATCHED_COPY is not None


def batched_copy(xs: Sequence[Any], targets: Sequence[NamedSharding]) -> list:
    """Each ``xs[i]``, shard for shard, onto ``targets[i]`` in one call of the runtime's batched copy
    (what ``jax.device_put(xs, targets)`` ends in after its Python checks, ~50 us a call on CPU).

    Only when `HAS_BATCHED_COPY`. Public replacement: ``jax.device_put(list(xs), list(targets))``,
    the same copy with its checks. Tested on jaxlib 0.12.1 and 0.12.0.
    """
    copy, reuse = _BATCHED_COPY  # type: ignore[misc]
    return copy(list(xs), [t._internal_device_list for t in targets], list(targets), [reuse] * len(xs))
