"""What ``multimesh-train --plan`` says about a pipeline: which modules each stage runs and how many
parameter bytes it holds, computed from the config alone (shapes by ``jax.eval_shape``, nothing traced
or compiled), with the placement the trainer registers (``trainers.layout.stage_of_module``)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from multimesh.core.fmt import device_span, format_bytes
from trainers.config import Config
from trainers.layout import SCANNED_STACK, stage_of_layer, stage_of_module

__all__ = ["StagePlan", "format_stage_plan", "stage_plans"]


@dataclasses.dataclass
class StagePlan:
    """One stage: its name, device ids, the modules registered on it and their parameter bytes."""

    name: str
    devices: tuple[int, ...]
    modules: list[str] = dataclasses.field(default_factory=list)
    param_bytes: int = 0


def _module_of(path: tuple) -> str:
    """The pipeline module (``embed``, ``layers_3``, ``layers``, ``head``) a parameter path belongs to."""
    for key in path:
        name = str(getattr(key, "key", getattr(key, "name", key)))
        if re.fullmatch(r"embed|head|layers(_\d+)?", name):
            return name
    raise ValueError(f"parameter {jax.tree_util.keystr(path)} belongs to no pipeline module (embed, layers_<i>, "
                     f"head)")


def stage_plans(cfg: Config) -> list[StagePlan]:
    """Per stage of ``cfg``'s pipeline, the modules it runs and the parameter bytes it holds (a scanned
    stack's parameters counted per layer on the stage of that layer). ``cfg.layout.pipeline`` must be set."""
    from trainers.step import build_model  # its import pulls in optax and the models

    m, p = cfg.model, cfg.layout.pipeline
    per_stage = int(np.prod(list(cfg.layout.mesh.values())))
    plans = [StagePlan(f"stage{s}", tuple(range(s * per_stage, (s + 1) * per_stage))) for s in range(p.stages)]
    modules = ["embed", *(f"layers_{i}" for i in range(m.num_layers)), "head"]
    for name in modules:
        plans[stage_of_module(name, m.num_layers, p.stages, p.chunks)].modules.append(name)
    model = build_model(m)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, cfg.data.seq_len), jnp.int32)))
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        module, nbytes = _module_of(path), int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if module == SCANNED_STACK:  # stacked along a leading layer axis, split evenly over the stages
            for layer in range(m.num_layers):
                plans[stage_of_layer(layer, m.num_layers, p.stages, p.chunks)].param_bytes += nbytes // m.num_layers
        else:
            plans[stage_of_module(module, m.num_layers, p.stages, p.chunks)].param_bytes += nbytes
    return plans


def _compact(modules: list[str]) -> str:
    """``embed, layers_0..3, head``: consecutive blocks as one range."""
    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.append(f"layers_{run[0]}" if len(run) == 1 else f"layers_{run[0]}..{run[-1]}")
            run.clear()

    for name in modules:
        if name.startswith("layers_"):
            run.append(int(name.removeprefix("layers_")))
        else:
            flush()
            out.append(name)
    flush()
    return ", ".join(out)


def format_stage_plan(cfg: Config) -> str:
    """The stages as a table (stage, devices, modules, parameter bytes), and where a tied table is read."""
    plans = stage_plans(cfg)
    rows = [("stage", "devices", "modules", "parameters")]
    rows += [(s.name, device_span(s.devices), _compact(s.modules), format_bytes(s.param_bytes)) for s in plans]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    total = sum(s.param_bytes for s in plans)
    lines.append(f"total {format_bytes(total)} of parameters (the optimizer state lives with them)")
    if cfg.model.tie_embeddings and len(plans) > 1:
        lines.append(f"tied embedding: the table lives on {plans[0].name} (embed); the head on {plans[-1].name} "
                     f"reads a copy of it each step and its gradient is summed back")
    return "\n".join(lines)
