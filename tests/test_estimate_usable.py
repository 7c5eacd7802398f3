"""The memory a fit test compares with: what JAX's allocator gives on a GPU (75% by default, or the share the
environment sets), a limit of one's own, a calibrated profile's measured limit; and the verdict with headroom."""

import dataclasses

import pytest

from multimesh.estimate import PROFILES, CalibratedProfile
from multimesh.estimate.report import DeviceMemory, Estimate
from multimesh.estimate.usable import usable_memory

H100 = PROFILES["h100-sxm"]


def test_a_gpu_gives_jax_three_quarters_of_its_memory_by_default():
    got = usable_memory(H100, {})
    assert got.bytes == 60 * 10**9 and "75%" in got.why and "XLA_PYTHON_CLIENT_MEM_FRACTION" in got.why
    assert usable_memory(H100, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}).bytes == 72 * 10**9
    assert usable_memory(H100, {"MULTIMESH_MEMORY_LIMIT": "64GB", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}).bytes \
        == 64 * 10**9
    assert usable_memory(H100, {"MULTIMESH_MEMORY_LIMIT": "60GiB"}).bytes == 60 * 2**30
    assert usable_memory(PROFILES["tpu-v5p"], {}).bytes == 95 * 2**30  # a TPU's runtime: all of its HBM
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='2'"):
        usable_memory(H100, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "2"})
    with pytest.raises(ValueError, match="MULTIMESH_MEMORY_LIMIT='lots'.*10GiB"):
        usable_memory(H100, {"MULTIMESH_MEMORY_LIMIT": "lots"})


def test_a_calibrated_profile_keeps_the_allocators_own_limit():
    fields = {f.name: getattr(H100, f.name) for f in dataclasses.fields(H100)}
    measured = CalibratedProfile(**{**fields, "name": "calibrated-gpu", "memory_bytes": 70 * 10**9})
    assert usable_memory(measured, {}).bytes == 70 * 10**9


def _estimate(peak: int) -> Estimate:
    memory = {0: DeviceMemory(0, "step", params=peak, optimizer=0, batch=0, stashed=0, temp=0, outputs=0)}
    return Estimate("step", memory, programs=(), profile=H100)


def test_fits_and_its_verdict_use_the_usable_memory(monkeypatch):
    monkeypatch.delenv("MULTIMESH_MEMORY_LIMIT", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    tight = _estimate(62_300_000_000)  # under the H100's 80 GB, over the 60 GB JAX takes of it
    assert not tight.fits() and tight.fits(80 * 10**9)
    assert tight.verdict().startswith(
        "does not fit: peak 58.0 GiB is 2.1 GiB over 55.9 GiB per device (JAX's default 75%")
    roomy = _estimate(45 * 2**30)
    assert roomy.fits() and roomy.verdict().startswith("fits: peak 45.0 GiB of 55.9 GiB per device") \
        and "headroom 10.9 GiB (19%)" in roomy.verdict()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert tight.fits()
