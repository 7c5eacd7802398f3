"""JAX's ``shard_map`` internals used by multimesh (tested: jax 0.12.1 and 0.12.0; 0.11.0 has the same).

A model may call ``jax.shard_map`` with its own mesh; inside a pipeline stage multimesh runs it on the stage's
submesh instead (`multimesh.trace.stage_shard_map`). That needs the ``shard_map`` equation's parameters, which
JAX does not document, and the mesh a call is checked against while it is traced. Each function names the public
API that would replace it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jax._src import flattree as _ft
from jax._src import shard_map as _shard_map
from jax.extend.core import JaxprEqn

__all__ = ["ShardMapCall", "set_shard_map_router", "shard_map_call", "shard_map_moved",
           "shard_map_rebound"]

#: JAX's own check of a call's mesh, as imported.
_JAX_CHECKS = _shard_map._shmap_checks


@dataclass(frozen=True)
class ShardMapCall:
    """What a ``shard_map`` equation says of its call: its mesh (a `Mesh` or `AbstractMesh`), its flat
    ``in_specs`` and ``out_specs``, the axes it makes manual, and the name of the function it maps."""

    mesh: Any
    in_specs: tuple
    out_specs: tuple
    manual_axes: frozenset[str]
    function: str


def shard_map_call(eqn: JaxprEqn) -> ShardMapCall | None:
    """The call of a ``shard_map`` equation (None for any other equation).

    Its parameters (``mesh``, ``in_specs``, ``out_specs``, ``newly_manual_axes``, ``jaxpr``) are JAX's
    internals. Public replacement: none (``jax.extend`` does not describe the primitive). Tested on jax 0.12.1
    and 0.12.0.
    """
    if eqn.primitive.name != "shard_map":
        return None
    params = eqn.params
    info = getattr(params["jaxpr"], "debug_info", None)
    return ShardMapCall(params["mesh"], tuple(params["in_specs"]), tuple(params["out_specs"]),
                        frozenset(params["newly_manual_axes"]), getattr(info, "func_name", None) or "<function>")


def shard_map_moved(eqn: JaxprEqn, mesh: Any, manual_axes: frozenset[str]) -> JaxprEqn:
    """``eqn`` (a ``shard_map``) on ``mesh``, manual over ``manual_axes``; its specs and body unchanged.

    Public replacement: none (see `shard_map_call`). Tested on jax 0.12.1 and 0.12.0.
    """
    return eqn.replace(params={**eqn.params, "mesh": mesh, "newly_manual_axes": frozenset(manual_axes)})


#: ``route(mesh, axis_names, in_specs, out_specs, function) -> (mesh, axis_names)``
Router = Callable[[Any, Any, Any, Any, Callable | None], tuple[Any, Any]]
_LOCK = threading.Lock()


def set_shard_map_router(route: Router | None) -> None:
    """Every call of a shard-mapped function (``jax.shard_map``, ``jax.experimental.shard_map.shard_map``, and
    so multimesh's own) passes the mesh it was given through ``route`` before JAX checks it, while ``route`` is
    set (None: JAX's own check again). ``route`` gets the mesh (None: the one in context), the axes made manual,
    the specs and the mapped function, and returns the mesh and axes to use.

    JAX looks up ``jax._src.shard_map._shmap_checks`` each time a shard-mapped function is called, also for one
    decorated before the route was set; the mapped function is its caller's ``f``. Public replacement: none
    (``jax.shard_map`` takes its mesh from its caller, or from the context, which inside a pipeline stage's
    trace is the stage's and so refuses the model's own mesh). Tested on jax 0.12.1 and 0.12.0.
    """
    with _LOCK:
        if route is None:
            _shard_map._shmap_checks = _JAX_CHECKS
            return

        def checks(mesh: Any, axis_names: Any, in_specs: Any, out_specs: Any, smap: bool) -> Any:
            function = sys._getframe(1).f_locals.get("f")
            mesh, axis_names = route(mesh, axis_names, in_specs, out_specs, function)
            return _JAX_CHECKS(mesh, axis_names, in_specs, out_specs, smap)

        _shard_map._shmap_checks = checks


def shard_map_rebound(eqn: JaxprEqn, ins: list, mesh: Any, manual_axes: frozenset[str],
                      body: Callable[[Any, list], list], specs: tuple[tuple, tuple] | None = None) -> list:
    """``eqn`` (a ``shard_map``) bound on ``ins`` over ``mesh``, manual over ``manual_axes``, its body traced
    again as ``body(jaxpr, inputs) -> outputs`` on that mesh's manual abstract mesh (the body's equations keep
    the mesh they were traced under in their context, so they cannot be bound as they are); ``specs``: its flat
    ``(in_specs, out_specs)`` instead of its own.

    Public replacement: none (see `shard_map_call`). Tested on jax 0.12.1 and 0.12.0.
    """
    params = eqn.params
    jaxpr = params["jaxpr"]
    in_specs, out_specs = specs if specs is not None else (params["in_specs"], params["out_specs"])

    def traced_again(*args: Any) -> Any:
        return _ft.flatten(body(jaxpr, list(args))).with_aux(out_specs)

    outs = _shard_map.shard_map_p.bind(*ins, subfuns=(traced_again,), mesh=mesh, in_specs=tuple(in_specs),
                                       check_vma=params["check_vma"], newly_manual_axes=frozenset(manual_axes),
                                       debug_info=jaxpr.debug_info)
    return list(outs)
