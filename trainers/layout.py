"""From a ``layout:`` config to a parallel step: SPMD (one mesh, logical rules) or a pipeline (MPMD).

SPMD (``pipeline: null``): ``multimesh.parallelize`` on a mesh of
``layout.mesh`` over the first devices, parameters and activations sharded by
the logical-axis rules.

Pipeline: the same model and step. ``register_task`` places the modules by
name: ``embed`` and the first blocks on stage 0, ..., the last blocks and
``head`` on the last stage (blocks split evenly); stage ``s`` runs on the
layout's devices ``[s*n, (s+1)*n)`` (``n`` = the size of ``layout.mesh``, its
shape and axes), with the same rules. A tied embedding (``model.tie_embeddings``,
every config's default) is ``embed``'s: its table lives on stage 0, the head
reads it again on the last stage (the table copied there each step, its
gradient summed back), so a pipeline trains the model every layout trains. With
``model.scan_layers`` the blocks are
one scanned stack, split evenly over the stages (``register_task("layers",
split=...)``): its stacked parameters live in per-stage parts. ``microbatch`` wraps the loss so that the global batch
runs as ``microbatches`` microbatches in ``schedule`` order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

from multimesh.core.fmt import device_span
from multimesh.core.rules import Rules
from multimesh.jax import microbatch, parallelize, register_task
from multimesh.schedules import Schedule, get_schedule, plot_schedule
from trainers.config import LayoutConfig, PipelineConfig
from trainers.fit import batch_shards, check_devices

__all__ = ["RunLayout", "build_layout", "pipeline_schedule", "sharding_rows", "sharding_table", "stage_of_layer",
           "stage_of_module", "write_schedule_png"]

#: Module names placed on pipeline stages: the embedding, each block, the head.
STAGE_MODULES = r"embed|head|layers_(\d+)"
#: The blocks as one scanned stack (``model.scan_layers``), split over the stages.
SCANNED_STACK = r"layers"


def stage_of_layer(layer: int, num_layers: int, stages: int, chunks: int = 1) -> int:
    """The stage of block ``layer`` when ``num_layers`` blocks are split evenly into ``stages * chunks``
    groups, dealt round-robin to the stages (``chunks > 1``: the interleaved schedule's virtual stages)."""
    return layer * stages * chunks // num_layers % stages


def stage_of_module(name: str, num_layers: int, stages: int, chunks: int = 1) -> int:
    """The stage that module ``name`` (``embed``, ``layers_<i>``, ``head``) is registered on.

    With tied embeddings the table belongs to ``embed`` (stage 0); the head reads it again on the last
    stage, and its gradient is summed back (``docs/implicit-tasks.md``).
    """
    if name == "embed":
        return 0
    if name == "head":
        return stages - 1
    match = re.fullmatch(STAGE_MODULES, name)
    if match is None or match.group(1) is None:
        raise ValueError(f"module {name!r} is not one of the pipeline's: embed, layers_<i>, head")
    return stage_of_layer(int(match.group(1)), num_layers, stages, chunks)


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """How a run is laid out: the devices it uses, the (per-stage) mesh shape, rules (and the name of
    their set: ``standard``, ``sequence``, or ``custom`` for a config's own list), pipeline."""

    devices: tuple
    mesh: dict[str, int]
    rules: Rules
    pipeline: PipelineConfig | None = None
    rule_set: str = "standard"

    @property
    def is_pipeline(self) -> bool:
        return self.pipeline is not None

    @property
    def batch_ways(self) -> int:
        """How many ways a step splits its batch (the mesh axes the rules give logical ``batch``)."""
        return batch_shards(self.mesh, self.rules)[1]

    def describe(self) -> str:
        mesh = "x".join(f"{k}={v}" for k, v in self.mesh.items())
        if self.rule_set != "standard":
            mesh += f" ({self.rule_set} rules)"
        if self.pipeline is None:
            return f"SPMD on {len(self.devices)} devices, mesh {mesh}"
        p = self.pipeline
        groups = f" ({p.chunks} block groups per stage)" if p.chunks > 1 else ""
        return (f"{p.stages}-stage {p.schedule}{groups} pipeline (MPMD) on {len(self.devices)} devices, "
                f"stage mesh {mesh}, {p.microbatches} microbatches")

    # -- the step --------------------------------------------------------------------

    def loss_for_grad(self, loss_fn: Callable, batch_size: int) -> Callable:
        """``loss_fn(params, batch)`` as the step differentiates it: microbatched in a pipeline.

        ``loss_fn`` must be normalised by the *global* token count, so that the
        sum over microbatches is the mean.
        """
        if self.pipeline is None:
            return loss_fn
        p = self.pipeline
        return microbatch(loss_fn, 0, batch_size // p.microbatches, argnum=1, schedule=p.schedule,
                          num_stages=p.stages, interleave=p.chunks if p.schedule == "interleaved" else None)

    @contextlib.contextmanager
    def tasks(self, num_layers: int, scanned: bool = False) -> Iterator[None]:
        """Within the block, the model's modules run as pipeline stages (nothing for SPMD).

        ``scanned``: the blocks are one ``nn.scan`` stack ``layers`` (``model.scan_layers``), split
        evenly over the stages by ``register_task(..., split=...)``.
        """
        if self.pipeline is None:
            yield
            return
        stages, per_stage = self.pipeline.stages, math.prod(self.mesh.values())
        placement_kw = dict(dims=tuple(self.mesh.values()), device_axes=tuple(self.mesh), logical_axes=self.rules)

        def placement(match: Any, backprop: bool) -> tuple[tuple, str]:
            s = stage_of_module(match.group(0), num_layers, stages, self.pipeline.chunks)
            return self.devices[s * per_stage:(s + 1) * per_stage], f"stage{s}"

        with contextlib.ExitStack() as registered:
            registered.enter_context(register_task(STAGE_MODULES, callback=placement, **placement_kw))
            if scanned:
                per_layer = num_layers // stages  # the config checks that the stages divide the layers
                split = {(s * per_layer, (s + 1) * per_layer):
                         (self.devices[s * per_stage:(s + 1) * per_stage], f"stage{s}") for s in range(stages)}
                registered.enter_context(register_task(SCANNED_STACK, split=split, **placement_kw))
            yield

    def parallelize(self, fun: Callable, init: Callable[[], Any], batch: Any, *, donate: bool) -> tuple:
        """``parallelize(fun, ...)`` on this layout: ``(sharded_fun, sharded_init)``.

        For a pipeline, call it inside :meth:`tasks`.
        """
        # A pipeline's meshes and rules come from its registered tasks.
        spmd = {} if self.is_pipeline else {"mesh": dict(self.mesh), "rules": self.rules}
        return parallelize(fun, init_params=init, initial_batch=batch, devices=list(self.devices),
                           donate=donate, **spmd)


def pipeline_schedule(cfg: PipelineConfig) -> Schedule:
    """The schedule object a pipeline layout runs (stages, microbatches, order of F/B actions)."""
    chunks = {"num_chunks": cfg.chunks} if cfg.schedule == "interleaved" else {}
    return get_schedule(cfg.schedule, num_stages=cfg.stages, num_microbatches=cfg.microbatches, **chunks)


def write_schedule_png(cfg: PipelineConfig, path: Any, title: str | None = None) -> int:
    """The pipeline's timeline (stages x time, a box per forward/backward, bubbles empty) as a PNG at
    ``path``; returns the number of boxes (the schedule's actions)."""
    return plot_schedule(pipeline_schedule(cfg), path, title=title)


def build_layout(cfg: LayoutConfig, devices: Any = None) -> RunLayout:
    """Resolve ``cfg`` on ``devices`` (default ``jax.devices()``): it uses the first ``cfg.num_devices``.

    A layout that does not fit them is a ``ConfigError`` naming ``layout.mesh``.
    """
    devices = list(jax.devices() if devices is None else devices)
    check_devices(cfg.mesh, cfg.pipeline.stages if cfg.pipeline else None, len(devices), jax.process_count())
    need = cfg.num_devices
    return RunLayout(tuple(devices[:need]), dict(cfg.mesh), Rules(cfg.rule_pairs()), cfg.pipeline,
                     cfg.rules if isinstance(cfg.rules, str) else "custom")


def sharding_rows(step_fn: Any, prefix: str = "params/") -> list[tuple[str, str, str, str, str]]:
    """``(path, shape, PartitionSpec, mesh, devices)`` of every leaf whose path starts with ``prefix``
    (default: the model parameters, not the optimizer state that mirrors them)."""
    rows = []
    for leaf in step_fn.param_layout.leaves:
        if leaf.path.startswith(prefix):
            mesh = "x".join(f"{k}={v}" for k, v in leaf.sharding.mesh.shape.items())
            devices = device_span(sorted(d.id for d in leaf.sharding.device_set))
            rows.append((leaf.path, str(tuple(leaf.shape)), str(leaf.spec), mesh, devices))
    return rows


def sharding_table(step_fn: Any, prefix: str = "params/") -> str:
    """:func:`sharding_rows` as an aligned text table (deterministic: used for golden files)."""
    rows = [("path", "shape", "PartitionSpec", "mesh", "devices"), *sharding_rows(step_fn, prefix)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows) + "\n"
