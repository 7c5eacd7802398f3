"""Trainer configuration: YAML files with inheritance, ``key.sub=value`` overrides, validation.

A config has five sections (see ``configs/tiny.yaml``)::

    model:      TransformerConfig fields (models/transformer.py)
    data:       DataConfig fields (trainers/data.py)
    optimizer:  OptimizerConfig
    layout:     LayoutConfig (mesh, rules, pipeline)
    train:      TrainConfig

``base: NAME`` (or a path) inherits from another config: sections are merged
key by key, the child winning; free-form values (``layout.mesh``,
``layout.rules``, ``data.paths``) are replaced whole. Overrides
``key.sub=value`` are applied last, the value parsed as YAML
(``layout.mesh={data: 8}``, ``layout.pipeline=null``, ``optimizer.lr=1e-3``).
Every key is checked against the schema; an error names the offending key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from models.transformer import TransformerConfig
from multimesh.core.rules import RULE_SETS, Rules, named_rules
from trainers.data import DataConfig
from trainers.errors import ConfigError, ConfigWarning
from trainers.fit import batch_shards, check_batch, check_data, check_microbatch_rows, logical_shards
from trainers.mesh_axes import warn_unused_axes

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_CONFIG",
    "Config",
    "ConfigError",
    "LayoutConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SearchConfig",
    "TrainConfig",
    "config_from_dict",
    "find_config",
    "load_config",
    "parse_overrides",
]

#: Where named configs (``tiny``, ``dp``, ...) live: ``<repo>/configs``.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "tiny"
#: ``layout.pipeline.schedule``: every schedule of ``multimesh.schedules`` (see docs/pipelines.md).
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2")
#: Layer groups per stage of the interleaved schedule when ``interleave`` is not given (the library's default).
DEFAULT_INTERLEAVE = 2
#: What ``train.on_nonfinite`` may say (see trainers/nonfinite.py).
ON_NONFINITE = ("stop", "warn")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup to ``lr``, then ``decay`` to ``min_lr`` at step ``decay_steps``.

    ``decay``: ``cosine``, ``linear`` or ``constant``. ``decay_steps``: the
    schedule's length (``min_lr`` from then on); ``null``: the ``train.steps`` of
    the run that starts it, then kept: a resumed run continues the schedule of the
    run it resumes, whatever its ``train.steps`` (``trainers.continuation``).
    A warmup longer than ``decay_steps`` is cut to it. Weight decay applies to
    matrices only (not norm scales). ``clip_norm``: global gradient-norm clip
    (``null``: none).
    """

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    decay: str = "cosine"
    decay_steps: int | None = None
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"decay={self.decay!r}: use 'cosine', 'linear' or 'constant'")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"decay_steps must be >= 1 or null (the first run's train.steps), got {self.decay_steps}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(f"clip_norm must be positive or null, got {self.clip_norm}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"b1 and b2 must be in [0, 1), got {self.b1}, {self.b2}")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline (MPMD) layout: ``stages`` device groups, each shaped as ``layout.mesh``.

    The global batch is split into ``microbatches`` run in ``schedule`` order:
    ``1f1b``, ``gpipe``, ``interleaved`` (each stage runs ``interleave``
    non-adjacent groups of blocks, default 2: the blocks go round-robin to the
    stages, a group at a time), ``zb-h1`` or ``zb-h2`` (zero bubble: each
    backward split into its input and weight gradients).
    """

    stages: int
    microbatches: int
    schedule: str = "1f1b"
    interleave: int | None = None

    def __post_init__(self) -> None:
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2 (a 1-stage pipeline is plain SPMD), got {self.stages}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: use one of {list(SCHEDULES)}")
        if self.interleave is not None and self.interleave < 1:
            raise ValueError(f"interleave={self.interleave}: the layer groups per stage must be at least 1")
        if self.interleave not in (None, 1) and self.schedule != "interleaved":
            raise ValueError(f"interleave={self.interleave} runs several layer groups per stage, which only "
                             f"schedule 'interleaved' does (schedule is {self.schedule!r}); set "
                             f"layout.pipeline.schedule=interleaved, or drop layout.pipeline.interleave")
        if self.schedule == "interleaved" and self.microbatches % self.stages:
            raise ValueError(f"schedule 'interleaved' runs the microbatches in rounds of one per stage: "
                             f"stages={self.stages} must divide microbatches={self.microbatches}; e.g. "
                             f"layout.pipeline.microbatches={self.stages * max(1, self.microbatches // self.stages)}")

    @property
    def chunks(self) -> int:
        """Groups of blocks per stage: ``interleave`` (default 2) for the interleaved schedule, else 1."""
        if self.schedule != "interleaved":
            return 1
        return DEFAULT_INTERLEAVE if self.interleave is None else self.interleave


#: What ``layout.mesh: auto`` may factorize the devices over (``multimesh.autolayout``'s axes but ``model``).
AUTO_AXES = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """What ``layout.mesh: auto`` tries (``multimesh.jax.auto_layout``): meshes over ``axes`` (every
    factorization of the devices per stage; null: data, fsdp and tensor, and expert for a model with
    experts, in sizes that divide ``model.num_experts``), each with every named rule set of ``rules`` (``sequence``
    where the mesh has a tensor axis), pipelines of each of ``stages`` (1: SPMD), each with every
    count of ``microbatches`` and every ``schedules`` entry. ``time_top``: time the steps of that many
    best-predicted layouts on the run's devices (``time_steps`` each) and pick the fastest measured (0:
    pick by prediction alone)."""

    axes: list | None = None
    stages: list = dataclasses.field(default_factory=lambda: [1])
    microbatches: list = dataclasses.field(default_factory=lambda: [4, 8])
    schedules: list = dataclasses.field(default_factory=lambda: ["1f1b"])
    rules: list = dataclasses.field(default_factory=lambda: list(RULE_SETS))
    time_top: int = 0
    time_steps: int = 3

    def __post_init__(self) -> None:
        bad = [a for a in self.axes or () if a not in AUTO_AXES]
        if self.axes is not None and (not self.axes or bad or len(set(self.axes)) != len(self.axes)):
            raise ValueError(f"axes={self.axes!r}: give distinct mesh axes among {list(AUTO_AXES)}")
        for key in ("stages", "microbatches"):
            values = getattr(self, key)
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ValueError(f"{key}={values!r}: give a list of positive ints, e.g. [1, 2]")
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if not self.schedules or bad:
            raise ValueError(f"schedules={self.schedules!r}: give a list of schedules among {list(SCHEDULES)}")
        bad = [r for r in self.rules if r not in RULE_SETS]
        if not self.rules or bad:
            raise ValueError(f"rules={self.rules!r}: give a list of named rule sets among {list(RULE_SETS)}")
        for key, least in (("time_top", 0), ("time_steps", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{key}={value!r}: give an int >= {least}")


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """How the step is laid out on devices.

    ``mesh``: ``{axis: size}`` (the whole mesh; with a pipeline, each stage's
    mesh). ``rules``: a named rule set (``standard``:
    ``multimesh.jax.standard_rules`` of the mesh axes; ``sequence``: the same
    with activations' sequence split over the tensor axis) or a list of
    ``[logical_name, mesh_axis | [axes] | null]`` pairs. ``pipeline``:
    ``null`` (SPMD) or a :class:`PipelineConfig`. The layout runs on the first
    :attr:`num_devices` devices (``{data: 1}`` without a pipeline: one device).

    ``mesh: auto``: the mesh and pipeline are chosen on the machine's devices
    by ``multimesh.jax.auto_layout`` (what it tries: ``search``, a
    :class:`SearchConfig`), the fastest predicted on ``profile`` (a name of
    ``multimesh.estimate.PROFILES``) that fits ``memory_limit`` bytes per device
    (default: the profile's memory); ``pipeline`` must then be null and
    ``rules`` standard (the search picks the rule set among ``search.rules``).
    ``profile`` also lets ``--plan`` estimate a fixed layout.
    """

    mesh: dict[str, int] | str = dataclasses.field(default_factory=lambda: {"data": 8})
    rules: str | list = "standard"
    pipeline: PipelineConfig | None = None
    profile: str | None = None
    memory_limit: int | None = None
    search: SearchConfig = dataclasses.field(default_factory=SearchConfig)

    @property
    def is_auto(self) -> bool:
        """Whether the mesh (and pipeline) is chosen by the layout search (``mesh: auto``)."""
        return self.mesh == "auto"

    def __post_init__(self) -> None:
        if self.profile is not None:
            from multimesh.estimate import PROFILES

            if self.profile.lower() not in PROFILES:
                raise ValueError(f"profile={self.profile!r} is not a known device profile; use one of "
                                 f"{sorted(PROFILES)}")
        if self.memory_limit is not None and self.memory_limit < 1:
            raise ValueError(f"memory_limit={self.memory_limit}: give bytes per device (a positive int), or null "
                             f"for the profile's memory")
        if isinstance(self.mesh, str):
            self._check_auto()
            return
        if not self.mesh:
            raise ValueError("mesh must name at least one axis, e.g. {data: 8}")
        for axis, size in self.mesh.items():
            if not isinstance(axis, str) or not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh entry {axis!r}: {size!r}; sizes must be positive ints")
        if isinstance(self.rules, str):
            if self.rules not in RULE_SETS:
                raise ValueError(f"rules={self.rules!r}: a named rule set must be one of {list(RULE_SETS)}")
        else:
            Rules(self.rules).require_mesh(self.mesh)  # a RuleError (a ValueError) names the rule and axis

    def _check_auto(self) -> None:
        if self.mesh != "auto":
            raise ValueError(f"mesh={self.mesh!r}: give {{axis: size}} (e.g. {{data: 8}}) or auto (chosen by the "
                             f"layout search)")
        if self.pipeline is not None:
            raise ValueError("mesh=auto chooses the pipeline too: set layout.pipeline=null and list the stage "
                             "counts to try in layout.search.stages (e.g. [1, 2])")
        if self.rules != "standard":
            raise ValueError(f"mesh=auto chooses the rule set among layout.search.rules, so rules={self.rules!r} "
                             f"has no say: set layout.rules=standard and list the sets to try in "
                             f"layout.search.rules (among {list(RULE_SETS)}), or give a mesh of your own")
        if self.profile is None:
            from multimesh.estimate import PROFILES

            raise ValueError(f"mesh=auto ranks layouts by predicted step time on a device profile: set "
                             f"layout.profile to one of {sorted(PROFILES)}")

    @property
    def devices_per_stage(self) -> int:
        if self.is_auto:
            raise ValueError("layout.mesh=auto: the devices per stage are known once the search has chosen")
        return math.prod(self.mesh.values())

    @property
    def num_devices(self) -> int:
        """Devices the layout uses: the mesh size times the pipeline stages."""
        return self.devices_per_stage * (self.pipeline.stages if self.pipeline else 1)

    def rule_pairs(self) -> Sequence[tuple[str, Any]]:
        """The rules as ``(logical, mesh_axes)`` pairs (named sets resolved for this mesh: a `Rules`, which
        also knows the names it leaves whole on purpose)."""
        if isinstance(self.rules, str):
            return named_rules(self.rules, () if self.is_auto else tuple(self.mesh))
        return [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in self.rules]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The loop: ``steps`` optimizer steps; every ``eval_every`` a validation loss over
    ``eval_batches`` batches (and at the end); a metrics line every ``log_every``;
    an asynchronous checkpoint every ``checkpoint_every`` (and at the end; ``0``:
    only at the end) keeping the newest ``keep``; ``seed`` seeds the parameters;
    ``out_dir`` holds ``metrics.jsonl``, ``loss.png``, ``checkpoints/``. With
    ``resume`` a run continues from the latest checkpoint in ``out_dir``.

    Watching a run (``trainers.observe``): ``tensorboard`` writes the metrics as
    TensorBoard scalars to ``out_dir/tensorboard/``; ``profile_steps: [a, b]``
    traces steps ``a`` to ``b`` with ``jax.profiler`` into ``out_dir/profile/``
    (``null``: no trace). ``transfer_port``: where each process receives
    pipeline stages' cross-host transfers: a port (``9100``) or a range
    (``"9100-9163"``, each process taking the first port of it free on its
    host); ``null``: any free port. ``--transfer-port`` wins over it.

    ``on_nonfinite``: what a non-finite loss, gradient norm or parameter does:
    ``stop`` (the run ends with ``NonFiniteError``, saving nothing non-finite) or
    ``warn`` (a warning, and training goes on). ``grad_accum``: micro-steps whose
    gradients each optimizer step sums (``data.batch_size / grad_accum`` rows each;
    `trainers.grad_accum`); 1: the whole batch at once.
    """

    steps: int = 1000
    eval_every: int = 250
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 250
    keep: int = 2
    seed: int = 0
    tensorboard: bool = True
    profile_steps: list | None = None
    transfer_port: int | str | None = None
    out_dir: str | None = None
    resume: bool = True
    on_nonfinite: str = "stop"
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}: use one of {list(ON_NONFINITE)}")
        for name in ("steps", "eval_every", "eval_batches", "log_every", "keep", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: only at the end), got {self.checkpoint_every}")
        if self.profile_steps is not None:
            a_b = self.profile_steps
            if (len(a_b) != 2 or any(not isinstance(s, int) or isinstance(s, bool) for s in a_b)
                    or not 1 <= a_b[0] <= a_b[1]):
                raise ValueError(f"profile_steps={a_b!r}: give [first, last], the steps to trace, 1 <= first <= "
                                 f"last, e.g. train.profile_steps=[5,7]")
            if a_b[1] > self.steps:
                raise ValueError(f"profile_steps={a_b!r} ends after the run's last step (steps={self.steps}); "
                                 f"e.g. train.profile_steps=[{min(a_b[0], self.steps)},{self.steps}]")
        if self.transfer_port is not None:
            from multimesh.startup.ports import port_range

            port_range(self.transfer_port, "transfer_port")


#: The sections of a config, in order, with their dataclass.
SECTIONS: dict[str, type] = {
    "model": TransformerConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "layout": LayoutConfig,
    "train": TrainConfig,
}
#: Nested dataclass fields (merged key by key rather than replaced).
NESTED: dict[tuple[str, str], type] = {("layout", "pipeline"): PipelineConfig, ("layout", "search"): SearchConfig}


@dataclasses.dataclass(frozen=True)
class Config:
    """A complete, validated trainer config."""

    name: str
    model: TransformerConfig
    data: DataConfig
    optimizer: OptimizerConfig
    layout: LayoutConfig
    train: TrainConfig

    @property
    def out_dir(self) -> Path:
        """``train.out_dir``, or ``runs/<name>`` (absolute)."""
        return Path(self.train.out_dir or os.path.join("runs", self.name)).expanduser().resolve()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-safe): every section, defaults resolved."""
        out: dict[str, Any] = {"name": self.name}
        for section in SECTIONS:
            d = dataclasses.asdict(getattr(self, section))
            if section == "data" and d["paths"] is not None:
                d["paths"] = list(d["paths"])
            out[section] = d
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, name: str | None = None, **sections: Mapping[str, Any]) -> Config:
        """A copy with some keys of some sections changed, e.g. ``replace(train={"steps": 5})``."""
        raw = self.to_dict()
        if name is not None:
            raw["name"] = name
        for section, values in sections.items():
            if section not in SECTIONS:
                raise ConfigError(f"unknown section {section!r}; sections: {list(SECTIONS)}")
            raw[section] = {**raw[section], **values}
        return config_from_dict(raw)


# -- loading --------------------------------------------------------------------------


def find_config(name_or_path: str | os.PathLike, relative_to: Path | None = None) -> Path:
    """A config file from a path, or a name in ``configs/`` (``dp`` -> ``configs/dp.yaml``)."""
    text = os.fspath(name_or_path)
    candidates = [Path(text).expanduser()]
    if relative_to is not None:
        candidates.insert(0, relative_to / text)
    if not text.endswith((".yaml", ".yml")):
        candidates += [c.with_name(c.name + ".yaml") for c in list(candidates)]
        candidates.append(CONFIG_DIR / f"{text}.yaml")
    for c in candidates:
        if c.is_file():
            return c.resolve()
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config {text!r} not found (a YAML path, or one of {known} in {CONFIG_DIR})")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a mapping of sections, got {type(data).__name__}")
    return data


def _load_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"config inheritance cycle: {chain}")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be a config name or path, got {base!r}")
    parent = _load_raw(find_config(base, relative_to=path.parent), (*seen, path))
    return _merge(parent, data)


def _merge(base: dict[str, Any], child: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """``child`` over ``base``: sections and nested dataclasses merge, other values are replaced."""
    out = dict(base)
    for key, value in child.items():
        path = (*prefix, key)
        mergeable = len(path) == 1 and key in SECTIONS or path in NESTED
        if mergeable and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, path)
        else:
            out[key] = value
    return out


def parse_overrides(items: Sequence[str]) -> list[tuple[tuple[str, ...], Any]]:
    """``["optimizer.lr=1e-3", ...]`` -> ``[(("optimizer", "lr"), 0.001), ...]`` (YAML values)."""
    out = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        parts = tuple(key.split("."))
        if any(not p for p in parts):
            raise ConfigError(f"override {item!r}: empty component in key {key!r}")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: value {text!r} is not valid YAML: {e}") from None
        glued = _colon_without_space(value)
        if glued is not None:
            name, _, rest = glued.partition(":")
            raise ConfigError(
                f"override {key}={text}: YAML read {glued!r} as one key with no value; YAML needs a space "
                f"after the colon: {key}={text.replace(glued, f'{name}: {rest}', 1)}")
        out.append((parts, value))
    return out


def _colon_without_space(value: Any) -> str | None:
    """The first mapping key like ``'data:3'`` with no value: ``{data:3}`` written without YAML's space."""
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None and isinstance(k, str) and ":" in k:
                return k
            found = _colon_without_space(v)
            if found is not None:
                return found
    elif isinstance(value, list):
        for v in value:
            found = _colon_without_space(v)
            if found is not None:
                return found
    return None


def _apply_override(raw: dict[str, Any], parts: tuple[str, ...], value: Any) -> None:
    if parts[0] == "name" and len(parts) == 1:
        raw["name"] = value
        return
    if parts[0] not in SECTIONS:
        raise ConfigError(f"unknown key {'.'.join(parts)!r}: {_suggest(parts[0], ['name', *SECTIONS])}")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            if parts[: i + 1] != parts[:1] and tuple(parts[: i + 1]) not in NESTED:
                raise ConfigError(f"override {'.'.join(parts)}: {'.'.join(parts[:i + 1])} is not a section")
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(
                f"override {'.'.join(parts)}: {'.'.join(parts[:i + 1])} is {child!r}, not a mapping; "
                f"set it whole, e.g. {'.'.join(parts[:i + 1])}={{...}}"
            )
        node = child
    node[parts[-1]] = value


def load_config(config: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a config by name or path (default ``tiny``), apply ``key=value`` overrides, validate."""
    path = find_config(config if config is not None else DEFAULT_CONFIG)
    raw = _load_raw(path)
    raw.setdefault("name", path.stem)
    for parts, value in parse_overrides(overrides):
        _apply_override(raw, parts, value)
    return config_from_dict(raw)


# -- validation -----------------------------------------------------------------------


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    """Validate plain data (as loaded from YAML) into a :class:`Config`."""
    raw = dict(raw)
    name = raw.pop("name", "custom")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name must be a non-empty string, got {name!r}")
    unknown = [k for k in raw if k not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}: {_suggest(unknown[0], ['name', 'base', *SECTIONS])}")
    sections = {}
    for section, cls in SECTIONS.items():
        values = raw.get(section) or {}
        if not isinstance(values, Mapping):
            raise ConfigError(f"{section} must be a mapping of keys, got {values!r}")
        sections[section] = _build(cls, values, section)
    cfg = Config(name=name, **sections)
    _check_consistency(cfg)
    return cfg


def _build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key {where}.{key}: {_suggest(key, list(fields))}")
        nested = NESTED.get((where, key))
        if nested is not None and isinstance(value, Mapping):
            kwargs[key] = _build(nested, value, f"{where}.{key}")
        else:
            kwargs[key] = _check_type(value, hints[key], f"{where}.{key}")
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing key {where}.{missing[0]}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_type(value: Any, hint: Any, key: str) -> Any:
    """``value`` if it fits ``hint`` (ints may stand for floats, '1e-3' strings too), else ConfigError."""
    ok, converted = _fits(value, hint)
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r} ({type(value).__name__})")
    return converted


def _whole(value: Any) -> tuple[bool, Any]:
    """A whole number written as a float or in exponent notation (``memory_limit: 80e9``, which PyYAML reads
    as the string '80e9'), as an int."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False, value
    if isinstance(value, float) and value.is_integer():
        return True, int(value)
    return False, value


def _fits(value: Any, hint: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            ok, converted = _fits(value, arm)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        return _whole(value)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if hint is str:
        return isinstance(value, str), value
    if origin is tuple:
        args = typing.get_args(hint)
        if isinstance(value, str) and args == (str, Ellipsis):
            value = [value]  # a single path
        if not isinstance(value, (list, tuple)):
            return False, value
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_fits(v, args[0]) for v in value]
            return all(ok for ok, _ in items), tuple(v for _, v in items)
        return len(args) == len(value), tuple(value)
    if origin is list or hint is list:
        return isinstance(value, list), value
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return False, value
        args = typing.get_args(hint)
        if args:
            for k, v in value.items():
                if not (_fits(k, args[0])[0] and _fits(v, args[1])[0]):
                    return False, value
        return True, dict(value)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint), value
    return isinstance(value, hint), value


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    if origin is not None:
        return str(hint).replace("typing.", "")
    return getattr(hint, "__name__", str(hint))


def _suggest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}known keys: {', '.join(known)}"


def _check_data_keys(d: DataConfig) -> None:
    """The ``data`` section's own ranges (``DataConfig`` is also a plain dataclass of ``trainers.data``)."""
    for key in ("batch_size", "seq_len", "max_bytes"):
        if getattr(d, key) < 1:
            raise ConfigError(f"data.{key}={getattr(d, key)}: must be at least 1; e.g. data.{key}="
                              f"{getattr(DataConfig, key)} (the default)")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction}: must be between 0 and 1 (exclusive), the share "
                          f"of the corpus held out for the validation loss; e.g. data.val_fraction=0.05 "
                          f"(the default)")


def _check_experts(m: TransformerConfig, mesh: Mapping[str, int]) -> None:
    """The ``expert`` mesh axis (each device of it holds ``num_experts / size`` experts) against the model's."""
    ways = mesh.get("expert", 1)
    if ways == 1:
        return
    if not m.num_experts:
        warnings.warn(f"layout.mesh has an expert axis of size {ways}, but the model has no experts "
                      f"(model.num_experts=0): the axis only splits the batch, as a data axis would; set "
                      f"model.num_experts, or name the axis data", ConfigWarning, stacklevel=4)
    elif m.num_experts % ways:
        raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by the expert axis of layout.mesh "
                          f"(size {ways}): each of its devices holds the same number of experts; make "
                          f"model.num_experts a multiple of {ways}, or the expert axis a divisor of "
                          f"{m.num_experts}")


def _check_expert_hidden(m: TransformerConfig, mesh: Mapping[str, int], rule_pairs: Sequence[tuple[str, Any]]) -> None:
    """The mesh axes the rules give the experts' hidden units (logical ``mlp``: expert tensor parallelism, each
    device of them computing ``d_ff / size`` of every expert) against ``model.d_ff``."""
    axes, ways = logical_shards("mlp", mesh, rule_pairs)
    if m.num_experts and m.d_ff % ways:
        named = " x ".join(axes)
        raise ConfigError(f"model.d_ff={m.d_ff} is not divisible by the {named} axis of layout.mesh (size {ways}) "
                          f"that the rules split the experts' hidden units ('mlp') over: each of its devices computes "
                          f"d_ff / {ways} of every expert; make model.d_ff a multiple of {ways}, or the {named} axis "
                          f"a divisor of {m.d_ff}")


def _check_consistency(cfg: Config) -> None:
    """Cross-section checks that no single section can make."""
    m, d, lay = cfg.model, cfg.data, cfg.layout
    _check_data_keys(d)
    if d.seq_len > m.max_len:
        raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_len={m.max_len}")
    if m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size}: the byte-level data needs at least 256")
    p = lay.pipeline
    k = cfg.train.grad_accum
    if k > 1 and p is not None:
        raise ConfigError(f"train.grad_accum={k} with a pipeline: the pipeline already runs the batch in "
                          f"layout.pipeline.microbatches={p.microbatches} microbatches; raise those instead and "
                          f"set train.grad_accum=1")
    if d.batch_size % k:
        raise ConfigError(f"train.grad_accum={k} does not divide data.batch_size={d.batch_size}: each micro-step "
                          f"takes batch_size / grad_accum rows; choose a divisor of {d.batch_size}")
    if p is not None:
        if m.num_layers < p.stages:
            raise ConfigError(f"layout.pipeline.stages={p.stages} exceeds model.num_layers={m.num_layers}")
        if p.chunks > 1 and m.scan_layers:
            raise ConfigError("model.scan_layers=true cannot run schedule 'interleaved': a scanned stack is split "
                              "into one range of blocks per stage; use model.scan_layers=false, or another "
                              "layout.pipeline.schedule")
        if p.chunks > 1 and m.num_layers % (p.stages * p.chunks):
            raise ConfigError(
                f"schedule 'interleaved' gives each of layout.pipeline.stages={p.stages} stages "
                f"{p.chunks} equal groups of blocks (layout.pipeline.interleave={p.chunks}), so "
                f"{p.stages * p.chunks} must divide model.num_layers={m.num_layers}; change model.num_layers "
                f"or layout.pipeline.interleave")
        if m.scan_layers and m.num_layers % p.stages:
            raise ConfigError(f"model.scan_layers splits the scanned stack evenly over the stages, but "
                              f"layout.pipeline.stages={p.stages} does not divide model.num_layers={m.num_layers}")
        if d.batch_size % p.microbatches:
            raise ConfigError(
                f"layout.pipeline.microbatches={p.microbatches} does not divide data.batch_size={d.batch_size}"
            )
    # What fits is decided by the config alone here; the machine's devices and corpus are checked by
    # --plan and at the start of training (trainers.fit).
    if lay.is_auto:  # the search rejects the meshes that do not split the batch; one window per device is
        check_data(d, 1)  # checked once one is chosen (trainers.layout_search)
        if "expert" in (lay.search.axes or ()) and not m.num_experts:
            raise ConfigError(f"layout.search.axes={lay.search.axes} names expert, but the model has no experts "
                              f"(model.num_experts=0): the axis would split only the batch, as data does; leave it "
                              f"out, or set model.num_experts")
        return
    _check_experts(m, lay.mesh)
    _check_expert_hidden(m, lay.mesh, lay.rule_pairs())
    check_batch(lay.mesh, lay.rule_pairs(), d.batch_size)
    if p is not None:
        check_microbatch_rows(lay.mesh, lay.rule_pairs(), d.batch_size, p.microbatches, p.stages)
    check_data(d, batch_shards(lay.mesh, lay.rule_pairs())[1])
    if isinstance(lay.rules, str):  # a named set: the user's own rules name their axes themselves
        warn_unused_axes(lay.mesh, lay.rule_pairs())
