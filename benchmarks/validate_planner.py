"""The planner against published training runs: predicted vs published step time, dev and held-out rows.

    python benchmarks/validate_planner.py [NAME ...] [--runs FILE] [--json OUT] [--split NAME] [--max-devices N]
                                          [--list]

Each run of ``published_runs.yaml`` (model shape, devices, layout, batch, sequence, precision and measured
throughput, with its source and its split) is rebuilt as a trainer config of the example transformer at the
published sizes and layout, its train step compiled on that many simulated CPU devices from abstract inputs
and priced by the planner (`multimesh.estimate`, bfloat16 compute) on the device's hardware profile, with
``benchmarks/fleet.py``'s machinery: compiled at 1 and 2 blocks and extrapolated linearly to the published
depth. A pipelined run is priced as one stage (its share of the layers, on ``devices / pipeline`` devices,
the whole batch of a data-parallel replica) run through the planner's 1F1B schedule simulator
(`multimesh.schedules`) over microbatches of one sequence (sources do not all state theirs), each send
between stages the activations of one microbatch over the network (stages on different nodes): the stage's
step time is split evenly over the microbatches, forward one third of it; every stage is priced as the one
compiled (each holds the embedding and the logits, which over-counts the two ends slightly). The published
step time is the source's own FLOP count for one step divided by the devices and the
published TFLOP/s per device; the ratio is predicted / published step (above 1: the planner is slow).

Per split (``dev``: rows looked at while the planner was developed; ``held_out``: rows never used to shape
it; ``fresh``: rows added after the planner's current model was written, committed before it first priced
them) it prints each row and the median absolute error ``median |ratio - 1|`` over the rows it could compile.
Nothing is fitted to any row. A row this machine cannot build says why in the table instead of being
skipped: a stage of more devices than ``--max-devices`` (each simulated device adds compile time and memory
here), or a context-parallel layout.

A row with ``micro_batch`` (sequences per data-parallel replica in one micro-step) is built with the trainer's
gradient accumulation over ``global_batch / (micro_batch x data x fsdp x expert)`` micro-steps, and priced as that
program runs (its micro-steps' work and collectives once each, the update once).

``--runs FILE`` prices any file of rows in ``published_runs.yaml``'s schema (a field the schema does not have
is an error naming it), ``--json OUT`` writes every row's name, split, published and predicted step and their
ratio. Beside the planner's median miss each split shows the constant-MFU rule of thumb's on the same rows:
every run priced at the median published MFU of this project's own ``dev`` rows.

Mapping onto the example transformer (RMSNorm, RoPE, SwiGLU, no biases, no dropout): a two-matrix MLP
(GELU, ReLU) of width ``ffn`` becomes a SwiGLU of width ``2 ffn / 3`` rounded to 64, the same parameters
and flops; attention is the example's plain (materialised) attention whatever kernel the source used. A
Mixture-of-Experts row (``model.experts``) becomes the example's MoE layer in every block (`models.moe`:
``experts`` SwiGLU experts of width ``expert_ffn``, top-``top_k`` routing, tokens sent to their experts'
devices by all-to-all over the ``expert`` mesh axis, which also splits the batch); a row with shared experts is
not built (the example has none). It is built at the source's dispatch: Megatron's dropless token dispatcher
sends each expert exactly the copies routed to it, and the sources force-balance the routing, so every expert
gets ``tokens x top_k / experts`` copies: the example's capacity factor 1.0 (``model.moe_capacity_factor``,
`MOE_CAPACITY_FACTOR`), whose all-to-all buffers and grouped products hold exactly that balanced load (the
example's dropless default sizes them for the worst case, all of a device's copies to one device's experts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet  # noqa: E402  (benchmarks/ is not a package)

__all__ = ["FLOP_COUNTS", "RUNS_FILE", "RunsFileError", "ValidationRun", "load_runs", "predict_run",
           "published_step", "source_flops", "why_not_compiled"]

RUNS_FILE = Path(__file__).with_name("published_runs.yaml")
SPLITS = ("dev", "held_out", "fresh", "unseen", "unseen_moe")
LAYOUT_AXES = ("data", "fsdp", "tensor", "pipeline", "context")
#: The example MoE's capacity factor for a row with experts: 1.0, the balanced load an exact (dropless,
#: force-balanced) dispatch sends (module docstring)
MOE_CAPACITY_FACTOR = 1.0
#: layout axes a row may leave out (then 1): the experts' axis, only for a model with experts
LAYOUT_OPTIONAL = ("expert",)
#: MLP kinds and how many ``d_model x ffn`` matrices each has.
FFN_MATRICES = {"gelu": 2, "relu": 2, "swiglu": 3}
MODEL_FIELDS = ("layers", "d_model", "heads", "kv_heads", "head_dim", "ffn", "ffn_kind", "vocab", "tied")
#: a Mixture-of-Experts model's fields in place of ``ffn`` (every layer an MoE layer), and its optional one
MOE_FIELDS = ("experts", "top_k", "expert_ffn")
MOE_OPTIONAL = ("shared_experts",)
DEVICE_FIELDS = ("kind", "count", "per_node")
REQUIRED = ("name", "split", "source", "model", "devices", "layout", "global_batch", "seq_len", "precision",
            "remat", "published", "flop_count")
OPTIONAL = ("notes", "micro_batch")
DEFAULT_MAX_DEVICES = 256


class RunsFileError(ValueError):
    """A row of the runs file is malformed (the message names the row and the field)."""


@dataclass(frozen=True)
class ValidationRun:
    """One published run, as ``published_runs.yaml`` states it."""

    name: str
    split: str
    source: str
    model: dict[str, Any]
    devices: dict[str, Any]
    layout: dict[str, int]
    global_batch: int
    seq_len: int
    precision: str
    remat: bool
    published: dict[str, float]
    flop_count: str
    notes: str = ""
    #: sequences per data-parallel replica in one micro-step (None: the whole batch at once, no accumulation)
    micro_batch: int | None = None

    @property
    def replicas(self) -> int:
        """The ways the batch is split: data x fsdp x expert (the example splits it over expert as over data)."""
        return self.layout["data"] * self.layout["fsdp"] * self.layout["expert"]

    @property
    def grad_accum(self) -> int:
        """Micro-steps whose gradients one optimizer step accumulates (1: none)."""
        if self.micro_batch is None:
            return 1
        return self.global_batch // (self.micro_batch * self.replicas)

    @property
    def is_moe(self) -> bool:
        return "experts" in self.model

    @property
    def device_count(self) -> int:
        return int(self.devices["count"])


def _maxtext_flops(r: ValidationRun) -> float:
    """MaxText's training TFLOP count (train.py 2023, maxtext_utils.py 2024, PaLM appendix B): 6 x parameters
    x tokens, plus causal attention 12 x heads x layers x head_dim x seq^2 x batch / 2."""
    m = r.model
    tokens = r.global_batch * r.seq_len
    attention = 12 * m["heads"] * m["layers"] * m["head_dim"] * r.seq_len ** 2 * r.global_batch / 2
    return 6 * parameter_count(r) * tokens + attention


def _llmfoundry_flops(r: ValidationRun) -> float:
    """LLM Foundry's MFU count (scripts/train/benchmarking/README.md): per sequence 3 x (2 x parameters x seq
    + 4 x layers x d_model x seq^2), i.e. 6 x parameters x tokens + 12 x layers x d_model x seq^2 x batch
    (attention counted whole, not causal)."""
    m = r.model
    tokens = r.global_batch * r.seq_len
    return 6 * parameter_count(r) * tokens + 12 * m["layers"] * m["d_model"] * r.seq_len ** 2 * r.global_batch


def _megatron_bridge_flops(r: ValidationRun) -> float:
    """Megatron Bridge's model FLOP count, per token as the row's two published figures give it (TFLOP/s per
    GPU over tokens/s per GPU), times the step's tokens."""
    per_token = r.published["tflops_per_device"] * 1e12 / r.published["tokens_per_s_per_device"]
    return per_token * r.global_batch * r.seq_len


#: The sources' FLOP counts for one training step, all devices together.
FLOP_COUNTS: dict[str, Callable[[ValidationRun], float]] = {
    "megatron": lambda r: fleet.megatron_flops(as_fleet_run(r, whole=True)),  # Narayanan et al. 2021, eq. (3)
    "maxtext": _maxtext_flops,
    "llmfoundry": _llmfoundry_flops,
    "megatron_bridge": _megatron_bridge_flops,
}
#: FLOP counts that need a published figure besides tflops_per_device
FLOP_COUNT_NEEDS = {"megatron_bridge": "tokens_per_s_per_device"}
#: FLOP counts that know a Mixture of Experts (the others count a dense model's parameters)
MOE_FLOP_COUNTS = ("megatron_bridge",)


def parameter_count(r: ValidationRun) -> int:
    """The published model's parameters: embedding (and an untied output), attention, MLP and norm scales (an
    MoE layer's MLP: all its experts, routed and shared, and its router)."""
    m = r.model
    e, hd = m["d_model"], m["head_dim"]
    attention = e * hd * (2 * m["heads"] + 2 * m["kv_heads"])
    if r.is_moe:
        experts = m["experts"] + m.get("shared_experts", 0)
        mlp = experts * FFN_MATRICES[m["ffn_kind"]] * e * m["expert_ffn"] + e * m["experts"]
    else:
        mlp = FFN_MATRICES[m["ffn_kind"]] * e * m["ffn"]
    embedding = m["vocab"] * e * (1 if m["tied"] else 2)
    return m["layers"] * (attention + mlp + 2 * e) + embedding + e


def source_flops(r: ValidationRun) -> float:
    """One step's flops, all devices, as the run's source counts them."""
    return FLOP_COUNTS[r.flop_count](r)


def published_step(r: ValidationRun) -> float:
    """Seconds per step implied by the published TFLOP/s per device and the source's FLOP count."""
    return source_flops(r) / (r.device_count * r.published["tflops_per_device"] * 1e12)


def swiglu_width(r: ValidationRun) -> int:
    """The example transformer's SwiGLU width for the run's MLP (an MoE model's: each expert's): the same, or
    of equal parameters."""
    m = r.model
    width = m["expert_ffn"] if r.is_moe else m["ffn"]
    if m["ffn_kind"] == "swiglu":
        return width
    return round(FFN_MATRICES[m["ffn_kind"]] * width / 3 / 64) * 64


def _model_fields(model: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The fields a row's ``model`` must have and may have: a dense model's, or an MoE model's (``experts``
    present) with the experts' fields in place of ``ffn``."""
    if isinstance(model, dict) and "experts" in model:
        return tuple(f for f in MODEL_FIELDS if f != "ffn") + MOE_FIELDS, MOE_OPTIONAL
    return MODEL_FIELDS, ()


def _check_group(where: str, group: str, got: Any, fields: Sequence[str], optional: Sequence[str] = ()) -> None:
    """``got`` has every field of ``fields``, and no field but those and ``optional`` (each named if not)."""
    if not isinstance(got, dict):
        raise RunsFileError(f"{where}: {group} must be a mapping of the fields {list(fields)}, got {got!r}")
    missing = [f for f in fields if f not in got]
    unknown = sorted(set(got) - set(fields) - set(optional))
    if missing or unknown:
        said = [f"missing field(s) {missing}" if missing else "", f"unknown field(s) {unknown}" if unknown else ""]
        more = f" and optionally {list(optional)}" if optional else ""
        raise RunsFileError(f"{where}: {group} has {' and '.join(s for s in said if s)}; it has the fields "
                            f"{list(fields)}{more} (see the comment at the top of {RUNS_FILE.name})")


def _check_run(raw: Any, index: int, seen: set[str], file_name: str = RUNS_FILE.name) -> ValidationRun:
    where = f"{file_name} row {index}"
    if not isinstance(raw, dict):
        raise RunsFileError(f"{where}: expected a mapping of fields, got {type(raw).__name__}")
    where = f"{where} ({raw.get('name', '?')})"
    missing = [f for f in REQUIRED if f not in raw]
    if missing:
        raise RunsFileError(f"{where}: missing field(s) {missing}; every row needs {list(REQUIRED)}")
    unknown = sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise RunsFileError(f"{where}: unknown field(s) {unknown}; a row has the fields {list(REQUIRED)} and "
                            f"optionally {list(OPTIONAL)} (see the comment at the top of {RUNS_FILE.name})")
    if raw["name"] in seen:
        raise RunsFileError(f"{where}: the name {raw['name']!r} is used twice")
    if not isinstance(raw["split"], str) or not re.fullmatch(r"[A-Za-z][\w-]*", raw["split"]):
        raise RunsFileError(f"{where}: split={raw['split']!r} must be a name, such as one of {SPLITS}")
    if not isinstance(raw["source"], str) or len(raw["source"].split()) < 5:
        raise RunsFileError(f"{where}: source must cite where every figure is written, got {raw['source']!r}")
    model_fields, model_optional = _model_fields(raw["model"])
    _check_group(where, "model", raw["model"], model_fields, model_optional)
    _check_group(where, "devices", raw["devices"], DEVICE_FIELDS)
    _check_group(where, "layout", raw["layout"], LAYOUT_AXES, LAYOUT_OPTIONAL)
    m, layout = raw["model"], {**raw["layout"], "expert": raw["layout"].get("expert", 1)}
    positive = {f"model.{k}": m[k] for k in model_fields if k not in ("ffn_kind", "tied")}
    positive.update({f"layout.{k}": v for k, v in layout.items()})
    positive.update({"devices.count": raw["devices"]["count"], "devices.per_node": raw["devices"]["per_node"],
                     "global_batch": raw["global_batch"], "seq_len": raw["seq_len"]})
    bad = {k: v for k, v in positive.items() if not (isinstance(v, int) and not isinstance(v, bool) and v > 0)}
    if bad:
        raise RunsFileError(f"{where}: these must be positive integers: {bad}")
    if m["ffn_kind"] not in FFN_MATRICES:
        raise RunsFileError(f"{where}: model.ffn_kind={m['ffn_kind']!r}; use one of {sorted(FFN_MATRICES)}")
    if not isinstance(m["tied"], bool) or not isinstance(raw["remat"], bool):
        raise RunsFileError(f"{where}: model.tied and remat must be true or false")
    if m["heads"] % m["kv_heads"]:
        raise RunsFileError(f"{where}: model.heads={m['heads']} is not a multiple of kv_heads={m['kv_heads']}")
    _check_experts(where, m, layout["expert"])
    product = math.prod(layout.values())
    if product != raw["devices"]["count"]:
        raise RunsFileError(f"{where}: the layout {raw['layout']} covers {product} devices, not "
                            f"devices.count={raw['devices']['count']}")
    replicas = layout["data"] * layout["fsdp"] * layout["expert"]
    if raw["global_batch"] % replicas:
        raise RunsFileError(f"{where}: global_batch={raw['global_batch']} does not divide over data x fsdp x "
                            f"expert = {replicas}")
    _check_published(where, raw["published"], raw["flop_count"])
    if "experts" in m and raw["flop_count"] not in MOE_FLOP_COUNTS:
        raise RunsFileError(f"{where}: flop_count={raw['flop_count']} counts a dense model's parameters; a model "
                            f"with experts needs one of {list(MOE_FLOP_COUNTS)}")
    from multimesh.estimate import PROFILES

    kind = raw["devices"]["kind"]
    if not isinstance(kind, str) or kind.lower() not in PROFILES:
        raise RunsFileError(f"{where}: devices.kind={kind!r} is no hardware profile; known: "
                            f"{', '.join(sorted(PROFILES))} (multimesh.estimate.PROFILES: add a HardwareProfile "
                            f"there for another device)")
    micro = raw.get("micro_batch")
    if micro is not None:
        if not (isinstance(micro, int) and not isinstance(micro, bool) and micro > 0) \
                or raw["global_batch"] % (micro * replicas):
            raise RunsFileError(f"{where}: micro_batch={micro!r} must be a positive integer whose product with "
                                f"data x fsdp x expert = {replicas} divides global_batch={raw['global_batch']}")
    return ValidationRun(**{**{k: raw[k] for k in REQUIRED}, "layout": layout}, notes=str(raw.get("notes", "")),
                         micro_batch=micro)


def _check_experts(where: str, m: dict[str, Any], expert: int) -> None:
    """An MoE model's top_k and shared_experts in range, its experts split evenly over the expert axis; no
    expert axis on a dense model."""
    if "experts" not in m:
        if expert > 1:
            raise RunsFileError(f"{where}: layout.expert={expert} but the model has no experts (model.experts); "
                                f"drop layout.expert or give the model's experts, top_k and expert_ffn")
        return
    if m["top_k"] > m["experts"]:
        raise RunsFileError(f"{where}: model.top_k={m['top_k']} exceeds model.experts={m['experts']}")
    shared = m.get("shared_experts", 0)
    if not (isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0):
        raise RunsFileError(f"{where}: model.shared_experts={shared!r} must be an integer >= 0")
    if m["experts"] % expert:
        raise RunsFileError(f"{where}: model.experts={m['experts']} do not split evenly over layout.expert={expert}")


def _check_published(where: str, pub: Any, flop_count: Any) -> None:
    """``published`` holds tflops_per_device > 0 and, optionally, an MFU fraction and tokens/s per device; the
    FLOP count is known, with the figures it needs."""
    allowed = {"tflops_per_device", "mfu", "tokens_per_s_per_device"}
    if not isinstance(pub, dict) or not isinstance(pub.get("tflops_per_device"), (int, float)) \
            or pub["tflops_per_device"] <= 0 or not set(pub) <= allowed:
        raise RunsFileError(f"{where}: published must be {{tflops_per_device: >0[, mfu: 0..1][, "
                            f"tokens_per_s_per_device: >0]}}, got {pub!r}")
    if "mfu" in pub and not 0 < pub["mfu"] <= 1:
        raise RunsFileError(f"{where}: published.mfu={pub['mfu']} is not a fraction")
    tokens = pub.get("tokens_per_s_per_device")
    if tokens is not None and not (isinstance(tokens, (int, float)) and tokens > 0):
        raise RunsFileError(f"{where}: published.tokens_per_s_per_device={tokens!r} must be > 0")
    if flop_count not in FLOP_COUNTS:
        raise RunsFileError(f"{where}: flop_count={flop_count!r}; use one of {sorted(FLOP_COUNTS)}")
    needs = FLOP_COUNT_NEEDS.get(flop_count)
    if needs and needs not in pub:
        raise RunsFileError(f"{where}: flop_count={flop_count} is taken from published.{needs}, which the row "
                            f"lacks")


def load_runs(path: str | os.PathLike = RUNS_FILE) -> list[ValidationRun]:
    """The rows of a runs file (``published_runs.yaml``'s schema), each checked (`RunsFileError` names a
    malformed row and field)."""
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise RunsFileError(f"cannot read the runs file {path}: {e}") from None
    if isinstance(doc, list):  # a bare list of rows is accepted as the 'runs:' list
        doc = {"runs": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise RunsFileError(f"{path}: expected a top-level 'runs:' list")
    unknown = sorted(set(doc) - {"runs"})
    if unknown:
        raise RunsFileError(f"{path}: unknown top-level field(s) {unknown}; the file holds one 'runs:' list")
    seen: set[str] = set()
    runs = []
    for i, raw in enumerate(doc["runs"]):
        runs.append(_check_run(raw, i, seen, Path(path).name))
        seen.add(runs[-1].name)
    return runs


def why_not_compiled(r: ValidationRun, max_devices: int) -> str | None:
    """Why this machine does not build ``r`` (None: it does)."""
    reasons = []
    if r.model.get("shared_experts", 0):
        reasons.append(f"shared_experts={r.model['shared_experts']}: the example's MoE layer has no shared expert")
    if r.layout["context"] > 1:
        reasons.append(f"context={r.layout['context']}: the example transformer has no context parallelism")
    if r.layout["pipeline"] > 1 and r.model["layers"] % r.layout["pipeline"]:
        reasons.append(f"{r.model['layers']} layers do not split evenly into {r.layout['pipeline']} stages")
    stage = r.device_count // r.layout["pipeline"]
    if stage > max_devices:
        reasons.append(f"a stage's {stage} devices exceed --max-devices {max_devices} (raise it to try: every "
                       "simulated device adds compile time and memory on this host)")
    return "; ".join(reasons) or None


def as_fleet_run(r: ValidationRun, whole: bool = False) -> fleet.PublishedRun:
    """``r`` as `fleet.PublishedRun`, the example transformer's config at the published sizes and layout (a
    pipelined run's: one stage, its share of the layers on its share of the devices; ``whole``: all of them)."""
    mesh = {k: r.layout[k] for k in ("data", "fsdp", "tensor", "expert") if r.layout[k] > 1} or {"data": 1}
    m, stages = r.model, 1 if whole else r.layout["pipeline"]
    return fleet.PublishedRun(
        name=r.name, source=r.source, profile=r.devices["kind"], devices=r.device_count // stages, mesh=mesh,
        d_model=m["d_model"], num_layers=m["layers"] // stages, num_heads=m["heads"], num_kv_heads=m["kv_heads"],
        head_dim=m["head_dim"], d_ff=swiglu_width(r), vocab=m["vocab"], seq_len=r.seq_len,
        global_batch=r.global_batch, tie_embeddings=m["tied"], remat=r.remat,
        published_tflops=float(r.published["tflops_per_device"]), source_flops=lambda _: source_flops(r),
        notes=r.notes, grad_accum=r.grad_accum, num_experts=m.get("experts", 0), experts_per_token=m.get("top_k", 2),
        moe_capacity_factor=MOE_CAPACITY_FACTOR if r.is_moe else None)


@dataclass(frozen=True)
class PipelinePrediction:
    """A pipelined run: its one stage's `fleet.Prediction` (the parts shown) and the schedule's step time."""

    stage: fleet.Prediction
    step_time: float
    microbatches: int

    def __getattr__(self, name: str) -> Any:  # compute, memory, communication, compile_seconds: the stage's
        return getattr(self.stage, name)


def pipelined(r: ValidationRun, stage: fleet.Prediction) -> PipelinePrediction:
    """``r``'s step from its stage's: the 1F1B schedule over microbatches of one sequence (module docstring)."""
    from multimesh.estimate import get_profile
    from multimesh.estimate.timing import transfer_time
    from multimesh.schedules import get_schedule

    stages = r.layout["pipeline"]
    m = r.global_batch // r.replicas
    per = stage.step_time / m
    sent = r.seq_len * r.model["d_model"] * 2 // r.layout["tensor"]  # bfloat16 activations, split over tensor
    send = transfer_time(sent, get_profile(r.devices["kind"]), inside_node=False)
    timeline = get_schedule("1f1b", stages, m).simulate(forward_time=per / 3, backward_time=2 * per / 3,
                                                         comm_time=send)
    return PipelinePrediction(stage, timeline.makespan, m)


def predict_run(r: ValidationRun) -> fleet.Prediction | PipelinePrediction:
    """The planner's estimate of ``r`` (compiled on the first devices of JAX: as many as a stage has)."""
    import jax

    run = as_fleet_run(r)
    if jax.device_count() < run.devices:
        raise RuntimeError(f"{r.name} needs {run.devices} devices, JAX has {jax.device_count()}: run "
                           f"validate_planner.py, which sets the simulated device count")
    estimates, seconds = fleet.compile_depths(run)
    stage = fleet.predict(run, estimates, r.devices["kind"], seconds)
    return pipelined(r, stage) if r.layout["pipeline"] > 1 else stage


def _peak(r: ValidationRun) -> float:
    from multimesh.estimate import get_profile

    return get_profile(r.devices["kind"]).peak_flops["bfloat16"]


def _layout(r: ValidationRun) -> str:
    return " x ".join(f"{k} {v}" for k, v in r.layout.items() if v > 1) or "1 device"


HEADER = ("| run | devices | layout | predicted step | published step | ratio | predicted TFLOP/s/dev | "
          "published | MFU predicted / published | compute / memory / comm. (s) | built in |\n|" + "---|" * 11)


def format_row(r: ValidationRun, p: fleet.Prediction | PipelinePrediction | None,
               reason: str | None = None) -> str:
    """One table row: the prediction against the published figures, or why there is none."""
    pub_step, pub_tflops, peak = published_step(r), r.published["tflops_per_device"], _peak(r)
    head = f"| {r.name} | {r.device_count} {r.devices['kind']} | {_layout(r)} | "
    if p is None:
        return (head + f"not compiled | {pub_step:.3f} s | - | - | {pub_tflops:g} | - / {pub_tflops * 1e12 / peak:.0%} "
                f"| {reason} | - |")
    step = p.step_time
    tflops = source_flops(r) / (r.device_count * step) / 1e12
    return (head + f"{step:.3f} s | {pub_step:.3f} s | {step / pub_step:.2f} | {tflops:.0f} | {pub_tflops:g} | "
            f"{tflops * 1e12 / peak:.0%} / {pub_tflops * 1e12 / peak:.0%} | "
            f"{p.compute:.3f} / {p.memory:.3f} / {p.communication:.3f} | {p.compile_seconds:.0f} s |")


def median_abs_error(ratios: Sequence[float]) -> float:
    """median |predicted / published - 1| (nan for no rows)."""
    return statistics.median(abs(x - 1) for x in ratios) if ratios else float("nan")


def published_mfu(r: ValidationRun) -> float:
    """The published throughput over the device's bfloat16 peak (in the source's FLOP count)."""
    return r.published["tflops_per_device"] * 1e12 / _peak(r)


def rule_of_thumb_mfu() -> float:
    """The constant-MFU rule of thumb: the median published MFU of this project's own ``dev`` rows."""
    return statistics.median(published_mfu(r) for r in load_runs(RUNS_FILE) if r.split == "dev")


def rule_of_thumb_step(r: ValidationRun, mfu: float) -> float:
    """``r``'s step had it run at ``mfu`` of its devices' bfloat16 peak."""
    return source_flops(r) / (r.device_count * _peak(r) * mfu)


def band_label(r: ValidationRun) -> str:
    """The band `multimesh.estimate.trust` states for ``r``'s kind of layout."""
    from multimesh.estimate.trust import band_text

    return band_text(*_kind(r))


def _kind(r: ValidationRun) -> tuple[str, str]:
    """(platform, kind of layout) of ``r``, as `multimesh.estimate.trust` keys its bands; a model with experts
    is a kind of its own (``MoE``, whatever else its layout does), kept out of the dense layouts' bands."""
    from multimesh.estimate import get_profile
    from multimesh.estimate.trust import layout_kind

    kind = layout_kind(pipeline_stages=r.layout["pipeline"], tensor=r.layout["tensor"], experts=r.is_moe)
    return get_profile(r.devices["kind"]).platform, kind


def _splits_in_order(runs: Sequence[ValidationRun]) -> list[str]:
    """The known splits first, in their order, then the others as they first appear."""
    found = list(dict.fromkeys(r.split for r in runs))
    return [s for s in SPLITS if s in found] + [s for s in found if s not in SPLITS]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", help="which runs (default all of the file's; --list names them)")
    parser.add_argument("--runs", dest="runs_file", default=str(RUNS_FILE), metavar="FILE",
                        help=f"the rows to price, in {RUNS_FILE.name}'s schema (default: that file)")
    parser.add_argument("--json", metavar="OUT", help="also write every row's name, split, published and "
                        "predicted step and their ratio (and the rule of thumb's) to this JSON file")
    parser.add_argument("--split", help=f"only this split's rows ({', '.join(SPLITS)}, or a file's own)")
    parser.add_argument("--max-devices", type=int, default=DEFAULT_MAX_DEVICES,
                        help="build no run of more simulated devices (default %(default)s)")
    parser.add_argument("--list", action="store_true", help="print the runs and their sources, and exit")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.runs_file)
    except RunsFileError as e:
        parser.exit(2, f"validate_planner.py: {e}\n")
    names = [r.name for r in runs]
    unknown = [n for n in args.runs if n not in names]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; known: {', '.join(names)}")
    chosen = [r for r in runs if (not args.runs or r.name in args.runs) and args.split in (None, r.split)]
    if args.list:
        for r in chosen:
            print(f"{r.name} [{r.split}]: {r.source}\n  {r.notes}")
        return
    reasons = {r.name: why_not_compiled(r, args.max_devices) for r in chosen}
    built = [r for r in chosen if reasons[r.name] is None]
    if built:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" in flags:
            sys.exit("validate_planner.py sets the simulated device count itself: unset XLA_FLAGS' "
                     "--xla_force_host_platform_device_count")
        os.environ["JAX_PLATFORMS"] = "cpu"
        most = max(r.device_count // r.layout["pipeline"] for r in built)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={most}"
    import jax

    thumb = rule_of_thumb_mfu()
    print(f"{jax.device_count()} simulated {jax.devices()[0].platform} devices, {os.cpu_count()} cores, "
          f"jax {jax.__version__}; runs from {args.runs_file}; rule of thumb: every run at {thumb:.1%} MFU (the "
          f"median of {RUNS_FILE.name}'s dev rows)")
    summary, rows = [], []
    for split in _splits_in_order(chosen):
        split_rows = [r for r in chosen if r.split == split]
        print(f"\n{split}:\n\n{HEADER}", flush=True)
        ratios, thumbs = [], []
        for r in split_rows:
            pub = published_step(r)
            row: dict[str, Any] = {"name": r.name, "split": r.split, "published_step_s": pub,
                                   "rule_of_thumb_step_s": rule_of_thumb_step(r, thumb),
                                   "rule_of_thumb_ratio": rule_of_thumb_step(r, thumb) / pub}
            if reasons[r.name]:
                print(format_row(r, None, reasons[r.name]), flush=True)
                rows.append({**row, "predicted_step_s": None, "ratio": None, "not_compiled": reasons[r.name]})
                continue
            p = predict_run(r)
            ratios.append(p.step_time / pub)
            thumbs.append(row["rule_of_thumb_ratio"])
            print(format_row(r, p), flush=True)
            rows.append({**row, "predicted_step_s": p.step_time, "ratio": p.step_time / pub,
                         "band": band_label(r), "kind": _kind(r)})
        summary.append(f"{split}: median |predicted / published step - 1| = {median_abs_error(ratios):.0%} "
                       f"(rule of thumb at {thumb:.1%} MFU: {median_abs_error(thumbs):.0%}) over {len(ratios)} "
                       f"compiled row(s); {len(split_rows) - len(ratios)} not compiled (said why above)")
    print()
    print("\n".join(summary))
    print("\nlargest miss per kind of layout, every split (multimesh.estimate.trust's bands are these, rounded up "
          "to 5%):")
    kinds: dict[tuple[str, str], list[float]] = {}
    for x in rows:
        if x["ratio"] is not None:
            kinds.setdefault(tuple(x["kind"]), []).append(abs(x["ratio"] - 1))
    for (platform, kind), misses in sorted(kinds.items()):
        print(f"  {kind} on {platform}: {max(misses):.0%} over {len(misses)} row(s) "
              f"(median {statistics.median(misses):.0%})")
    if args.json:
        done = [x for x in rows if x["ratio"] is not None]
        out = {"runs_file": str(args.runs_file), "rule_of_thumb_mfu": thumb, "rows": rows,
               "median_miss": median_abs_error([x["ratio"] for x in done]),
               "rule_of_thumb_median_miss": median_abs_error([x["rule_of_thumb_ratio"] for x in done])}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
