"""How far a predicted step time can be trusted: the band the planner's validation against published
training runs supports, per kind of layout and platform (`benchmarks/validate_planner.py`, results in
`benchmarks/RESULTS.md`; docs/planning.md, "How far to trust a predicted step").

Each band is the largest miss, ``|predicted / published step - 1|``, seen on the validation rows of that kind,
rounded up to 5%; nothing in the planner's model is fitted to those rows. A kind of layout with no
validation row says so instead of a band.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BANDS", "band_text", "layout_kind"]

#: (platform, kind) -> (largest miss seen, rows it was seen on). Kinds: "data/FSDP" (data parallelism and
#: sharded parameters only), "tensor" (tensor parallelism, with or without data/FSDP), "pipeline".
BANDS: dict[tuple[str, str], tuple[float, int]] = {
    ("gpu", "data/FSDP"): (0.45, 4),
    ("gpu", "tensor"): (0.15, 3),
    ("gpu", "pipeline"): (0.15, 6),
    ("tpu", "data/FSDP"): (0.70, 3),
    ("tpu", "tensor"): (0.65, 4),
}

_PLATFORM_NAMES = {"gpu": "GPUs", "tpu": "TPUs"}


def layout_kind(mesh: dict[str, int] | None = None, pipeline_stages: int = 1, tensor: int | None = None) -> str:
    """The kind of a layout: ``pipeline`` over several stages, ``tensor`` where a tensor axis splits the
    model, else ``data/FSDP``. ``tensor``: the tensor-parallel size, where not read from ``mesh``."""
    if pipeline_stages > 1:
        return "pipeline"
    size = tensor if tensor is not None else max(
        (v for k, v in (mesh or {}).items() if k in ("tensor", "model", "tp")), default=1)
    return "tensor" if size > 1 else "data/FSDP"


def estimate_kind(est: Any) -> str:
    """An `Estimate`'s kind of layout, from its programs: a pipeline schedule; a collective on the products'
    path (a tensor-parallel reduction of activations); else data/FSDP."""
    if est.time is not None and est.time.pipeline:
        return "pipeline"
    if any(c.critical for p in est.programs for c in p.collectives):
        return "tensor"
    return "data/FSDP"


def band_text(platform: str, kind: str) -> str:
    """``validation: within ±25% for data/FSDP on GPUs (4 published runs)``, or why there is no band."""
    where = f"{kind} on {_PLATFORM_NAMES.get(platform, platform or 'this platform')}"
    if (platform, kind) not in BANDS:
        return f"validation: no published run of {where} checked, no band"
    miss, rows = BANDS[(platform, kind)]
    return f"validation: within ±{miss:.0%} for {where} ({rows} published runs)"
