"""How far a predicted step time can be trusted: the band the planner's validation against published
training runs supports, per kind of layout and platform (`benchmarks/validate_planner.py`, results in
`benchmarks/RESULTS.md`; docs/planning.md, "How far to trust a predicted step").

Each band is the largest miss, ``|predicted / published step - 1|``, seen on the validation rows of that kind,
rounded up to 5%, shown with the range of predicted / published steps seen (below 1: the planner predicted
the step faster than it ran); nothing in the planner's model is fitted to those rows. A kind of layout with
no validation row says so instead of a band.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["BANDS", "band", "band_text", "estimate_kind", "layout_kind"]

#: (platform, kind) -> (lowest, highest predicted / published step seen, rows). Kinds: "data/FSDP" (data
#: parallelism and sharded parameters only), "tensor" (tensor parallelism, with or without data/FSDP),
#: "pipeline", "MoE" (a Mixture of Experts with its experts split over devices, whatever else the layout
#: does: its step turns on the all-to-alls and grouped products the dense rows have none of). From
#: `benchmarks/validate_planner.py` over every split (RESULTS.md, "The planner against published runs:
#: networks as wired, bytes as sent"; the MoE band: its ``unseen_moe`` split, "The planner against published
#: Mixture-of-Experts runs").
BANDS: dict[tuple[str, str], tuple[float, float, int]] = {
    ("gpu", "data/FSDP"): (0.64, 0.99, 17),
    ("gpu", "tensor"): (0.72, 0.89, 3),
    ("gpu", "pipeline"): (0.81, 0.86, 6),
    ("tpu", "data/FSDP"): (0.77, 0.86, 3),
    ("tpu", "tensor"): (1.05, 1.22, 4),
    ("gpu", "MoE"): (0.70, 1.78, 4),
}


def band(platform: str, kind: str) -> float | None:
    """The largest miss seen for that kind of layout, rounded up to 5% (None: no row of that kind)."""
    if (platform, kind) not in BANDS:
        return None
    low, high, _ = BANDS[(platform, kind)]
    return math.ceil(round(max(1 - low, high - 1) * 100, 6) / 5) * 5 / 100


_PLATFORM_NAMES = {"gpu": "GPUs", "tpu": "TPUs"}


def layout_kind(mesh: dict[str, int] | None = None, pipeline_stages: int = 1, tensor: int | None = None,
                experts: bool = False) -> str:
    """The kind of a layout: ``MoE`` for a model with experts (``experts``) split over an ``expert`` axis
    (whatever else the layout does), ``pipeline`` over several stages, ``tensor`` where a tensor axis splits
    the model, else ``data/FSDP``. ``tensor``: the tensor-parallel size, where not read from ``mesh``."""
    if experts:
        return "MoE"
    if pipeline_stages > 1:
        return "pipeline"
    size = tensor if tensor is not None else max(
        (v for k, v in (mesh or {}).items() if k in ("tensor", "model", "tp")), default=1)
    return "tensor" if size > 1 else "data/FSDP"


def estimate_kind(est: Any) -> str:
    """An `Estimate`'s kind of layout, from its programs: grouped products (``ragged_dot``: a Mixture of
    Experts' experts; an all-to-all alone is no sign of one, XLA reshards dense arrays with it too); a
    pipeline schedule; a collective on the products' path (a tensor-parallel reduction of activations); else
    data/FSDP."""
    if any(p.grouped for p in est.programs):
        return "MoE"
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
    low, high, rows = BANDS[(platform, kind)]
    return (f"validation: within ±{band(platform, kind):.0%} for {where}, {low:.2f} to {high:.2f} of the "
            f"published step over {rows} published runs")
