"""The dtypes a program's matrix products run in, and the peak flop rate each is priced at.

A product is priced at the rate of its operands' dtype, not its result's: bf16
operands accumulated in f32 (``preferred_element_type=float32``) are bf16 work
on a Tensor Core or an MXU. Operands of two dtypes run in the wider one. The
names are the profiles' (`HardwareProfile.peak_flops`): numpy's and HLO's
spellings (``bf16``, ``f32``, ``float8_e4m3fn``, ``s8``) mapped to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .profiles import HardwareProfile

__all__ = ["HIGHEST_FLOAT32", "dot_dtype", "dtype_label", "main_dtype", "profile_dtype", "rate_for", "work_dtype"]

#: float32 products asked to run at full precision (``precision=HIGHEST``, or
#: ``jax_default_matmul_precision="highest"``): true float32 work, where a GPU runs float32 products of the
#: default precision on its TF32 Tensor Cores
HIGHEST_FLOAT32 = "float32-highest"

_HLO = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "s8": "int8", "u8": "int8",
        "s16": "int16", "s32": "int32", "s64": "int64"}


def profile_dtype(name: str) -> str:
    """A dtype name as the profiles spell it: ``bf16`` and ``bfloat16`` -> ``bfloat16``; every 8-bit float
    (``f8e4m3fn``, ``float8_e5m2``) -> ``float8``; ``s8`` -> ``int8``."""
    name = str(name)
    if name.startswith(("f8", "float8")):
        return "float8"
    return _HLO.get(name, name)


def _itemsize(name: str) -> int:
    if name == HIGHEST_FLOAT32:
        return 4
    try:
        return np.dtype(name).itemsize
    except TypeError:
        return {"bfloat16": 2, "float8": 1}.get(name, 4)


def work_dtype(lhs: str, rhs: str) -> str:
    """The dtype a product of operands ``lhs`` and ``rhs`` runs in: theirs, or the wider of the two."""
    a, b = profile_dtype(lhs), profile_dtype(rhs)
    return a if _itemsize(a) >= _itemsize(b) else b


def _highest(precision: Any) -> bool:
    """Whether a product's ``precision`` parameter (None: JAX's default, itself configurable) asks for full
    float32."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    names = [str(p).lower() for p in (precision if isinstance(precision, (tuple, list)) else (precision,))]
    return any(n.endswith(("highest", "float32", "f32_f32_f32")) for n in names)


def dot_dtype(lhs: str, rhs: str, precision: Any = None) -> str:
    """A ``dot_general``'s dtype, as priced: its operands' (`work_dtype`), float32 asked at full precision
    (``precision``, the product's parameter) as `HIGHEST_FLOAT32`."""
    dtype = work_dtype(lhs, rhs)
    return HIGHEST_FLOAT32 if dtype == "float32" and _highest(precision) else dtype


def main_dtype(flops_by_dtype: Mapping[str, float], default: str = "float32") -> str:
    """The dtype of the most matrix flops (``default`` when there are none)."""
    positive = {k: v for k, v in flops_by_dtype.items() if v > 0}
    return max(positive, key=lambda k: positive[k]) if positive else default


def rate_for(profile: HardwareProfile, dtype: str) -> float:
    """The profile's peak for work read in ``dtype``. float32 at JAX's default precision runs on a GPU's
    TF32 Tensor Cores (JAX's matmul-precision guide: "TF32 on recent GPUs"; on a TPU the profile's float32
    is already its one-pass default): a GPU profile's ``tfloat32`` peak; float32 asked at full precision
    (`HIGHEST_FLOAT32`): its ``float32`` peak. A dtype the profile lists no peak for (a calibrated profile
    measures one dtype) falls back to its float32 peak, or its lowest; an explicit override
    (`estimate(dtype=...)`) goes through `HardwareProfile.flops_rate`, which refuses an unknown name."""
    peaks = profile.peak_flops
    if dtype == "float32" and profile.platform == "gpu" and "tfloat32" in peaks:
        return peaks["tfloat32"]
    if dtype in peaks:
        return peaks[dtype]
    return peaks.get("float32", min(peaks.values()))


def dtype_label(flops_by_dtype: Mapping[str, float], override: str | None = None) -> str:
    """How a step's products were priced, in words: the override, one dtype, or each dtype's share."""
    if override is not None:
        return override
    total = sum(flops_by_dtype.values())
    shares = sorted(((v / total, k) for k, v in flops_by_dtype.items() if v > 0), reverse=True) if total else []
    if not shares:
        return "float32"
    if len(shares) == 1 or shares[0][0] > 0.999:
        return shares[0][1]
    return ", ".join(f"{k} {s:.0%}" for s, k in shares)
