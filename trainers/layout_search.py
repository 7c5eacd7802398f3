"""``layout.mesh: auto``: the trainer's step laid out by ``multimesh.jax.auto_layout``, and the config it picks.

The search builds the config's own train step (``trainers.step``) on every
candidate, its loss wrapped in ``microbatch`` (one microbatch for an SPMD
layout; a pipeline's count and schedule are chosen by the search), with the
trainer's stage registration (``embed`` and the first blocks on stage 0, ...,
``head`` on the last: ``trainers.layout.stage_of_module``) as ``pipeline=``.
The chosen layout becomes an ordinary config (``layout.mesh`` and
``layout.pipeline`` filled in), which trains as if written by hand: stage
``s`` of the search's mesh is the devices ``[s*n, (s+1)*n)``, the devices
``RunLayout`` gives it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from multimesh.autolayout import (
    LayoutSearch,
    LayoutSearchError,
    ParallelLayout,
    PipelineFactory,
    TimingError,
    stage_task,
)
from multimesh.estimate import UnknownProfileError
from multimesh.jax import auto_layout, microbatch, register_task
from trainers.config import Config
from trainers.errors import ConfigError
from trainers.layout import SCANNED_STACK, STAGE_MODULES, stage_of_module
from trainers.plan_estimate import model_flops_of

__all__ = ["chosen_config", "resolve_auto_layout", "search_layout", "stage_registration"]


def stage_registration(num_layers: int, scanned: bool) -> PipelineFactory:
    """``pipeline(stages, chunks)`` for `auto_layout`: the model's modules on the stages of the layout being
    built, as ``RunLayout.tasks`` places them on device ranges."""

    @contextlib.contextmanager
    def pipeline(stages: int, chunks: int) -> Iterator[None]:
        if stages > num_layers or (chunks > 1 and num_layers % (stages * chunks)):
            raise ValueError(f"{stages} stages x {chunks} groups do not split model.num_layers={num_layers}")
        if scanned and num_layers % stages:
            raise ValueError(f"model.scan_layers splits the stack evenly, and {stages} stages do not divide "
                             f"model.num_layers={num_layers}")

        def placement(match: Any, backprop: bool) -> Any:
            return stage_task(stage_of_module(match.group(0), num_layers, stages, chunks))

        with contextlib.ExitStack() as registered:
            registered.enter_context(register_task(STAGE_MODULES, callback=placement))
            if scanned:
                per = num_layers // stages
                split = {(s * per, (s + 1) * per): stage_task(s) for s in range(stages)}
                registered.enter_context(register_task(SCANNED_STACK, split=split))
            yield

    return pipeline


def _microbatched(loss_fn: Callable, batch_size: int) -> Callable:
    """The loss as a pipeline runs it; one microbatch unless the layout being built chooses more."""
    return microbatch(loss_fn, 0, batch_size, argnum=1)


#: `auto_layout`'s arguments its errors advise changing, and the config keys that set them
_CONFIG_KEYS = {"memory_limit": "layout.memory_limit", "axes": "layout.search.axes",
                "stage_counts": "layout.search.stages"}


def _yaml(value: Any) -> str:
    """A config value as one would write it in an override (``[data, tensor]``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def search_layout(cfg: Config, devices: Any = None, progress: bool | None = None) -> LayoutSearch:
    """``auto_layout`` of ``cfg``'s train step on ``devices`` (default: all), as ``layout`` configures it.

    Raises ``ConfigError`` naming the ``layout`` keys to change when no layout can be chosen (the search,
    with its table, is the error's ``search``).
    """
    from trainers.step import train_functions, zeros_batch  # pulls in the models and optax

    lay, d, m = cfg.layout, cfg.data, cfg.model
    devices = list(jax.devices() if devices is None else devices)
    f = train_functions(cfg, _microbatched, d.batch_size * d.seq_len)
    stages = [s for s in lay.search.stages if s <= max(1, m.num_layers)]
    if not stages:
        raise ConfigError(f"layout.search.stages={lay.search.stages}: every stage count exceeds model.num_layers="
                          f"{m.num_layers} (a stage runs at least one block); add 1 (SPMD) or smaller counts")
    try:
        return auto_layout(f.train_step, init_params=f.init_state,
                           get_input_batch=lambda: zeros_batch(cfg),
                           devices=devices, profile=lay.profile, memory_limit=lay.memory_limit,
                           axes=None if lay.search.axes is None else tuple(lay.search.axes),
                           pipeline=stage_registration(m.num_layers, m.scan_layers),
                           stage_counts=tuple(stages), microbatches=tuple(lay.search.microbatches),
                           schedules=tuple(lay.search.schedules), rule_sets=tuple(lay.search.rules),
                           progress=progress, time_top=lay.search.time_top, time_steps=lay.search.time_steps,
                           model_flops=model_flops_of(cfg), donate=True)
    except UnknownProfileError as e:
        raise ConfigError(f"layout.profile={lay.profile!r}: {e}") from None
    except TimingError as e:
        raise ConfigError(f"layout.search.time_top={lay.search.time_top}: {e}") from None
    except LayoutSearchError as e:
        message = e.explain(_CONFIG_KEYS)  # the search's advice in the config's words
        searched = ", ".join(f"{k}: {_yaml(getattr(lay.search, k))}" for k in ("axes", "stages", "microbatches",
                                                                               "schedules", "rules"))
        error = ConfigError(f"layout.mesh=auto: {message} (layout.memory_limit: {_yaml(lay.memory_limit)}, "
                            f"layout.profile: {lay.profile}, layout.search: {{{searched}}})")
        error.search = e.search
        raise error from None


def chosen_config(cfg: Config, layout: ParallelLayout) -> Config:
    """``cfg`` with ``layout.mesh``, ``rules`` and ``pipeline`` set to ``layout`` (checked like any config)."""
    pipeline = None
    if layout.is_pipeline:
        pipeline = {"stages": layout.stages, "microbatches": layout.microbatches, "schedule": layout.schedule,
                    "interleave": layout.chunks if layout.schedule == "interleaved" else None}
    return cfg.replace(layout={"mesh": dict(layout.mesh), "rules": layout.rules, "pipeline": pipeline})


def resolve_auto_layout(cfg: Config, devices: Any = None,
                        log: Callable[[str], None] | None = None) -> Config:
    """``cfg`` itself, or with ``layout.mesh: auto`` the config of the layout the search picks (``log``:
    where the search's table goes)."""
    if not cfg.layout.is_auto:
        return cfg
    search = search_layout(cfg, devices)
    if log is not None:
        log(f"{search}\nchosen layout: {search.best.describe()}")
    return chosen_config(cfg, search.best)
