"""How far a predicted step is trusted: the validation's band per kind of layout, printed with the step."""

import dataclasses

from multimesh.estimate import PROFILES, Collective
from multimesh.estimate.kernels import Kernel
from multimesh.estimate.programs import ProgramCost
from multimesh.estimate.report import DeviceMemory, Estimate, StepTime
from multimesh.estimate.trust import BANDS, band, band_text, estimate_kind, layout_kind


def test_the_kind_of_a_layout():
    assert layout_kind({"data": 8, "fsdp": 8}) == "data/FSDP"
    assert layout_kind({"data": 8, "tensor": 8}) == "tensor"
    assert layout_kind({"data": 8}, pipeline_stages=4) == "pipeline"
    assert layout_kind(tensor=1) == "data/FSDP"
    assert layout_kind({"data": 2, "expert": 8}, pipeline_stages=4, experts=True) == "MoE"


def _program(*kinds: str) -> ProgramCost:
    collectives = tuple(Collective(kind, 1 << 20, 8, ("expert",), f"c{i}") for i, kind in enumerate(kinds))
    return ProgramCost("step", frozenset(range(8)), 0, 0, 0, 0, 1e12, 1e9, collectives)


def test_a_step_with_grouped_products_is_an_moe_layout_with_the_moe_validations_band_never_a_dense_one():
    """Four published MoE runs (validate_planner.py --split unseen_moe) were predicted 0.70 to 1.78 of their
    step: the MoE band is 80% over 4 runs, whatever else the layout does; the dense kinds' bands are not it. A
    dense step XLA reshards with an all-to-all (Llama 3 8B on data x fsdp) stays dense."""
    h100 = PROFILES["h100-sxm"]
    memory = {0: DeviceMemory(0, "step", params=0, optimizer=0, batch=0, stashed=0, temp=0, outputs=0)}
    time = StepTime(programs={}, transfers=0.0, total=1.0, dtype="bfloat16", mfu=None)
    experts = dataclasses.replace(_program("all-reduce", "all-to-all"), grouped=(Kernel(1e9, 1 << 20),))
    moe = Estimate("step", memory, programs=(experts,), profile=h100, time=time)
    dense = Estimate("step", memory, programs=(_program("all-reduce"),), profile=h100, time=time)
    resharded = Estimate("step", memory, programs=(_program("all-reduce", "all-to-all"),), profile=h100, time=time)
    assert estimate_kind(moe) == "MoE" and estimate_kind(dense) == estimate_kind(resharded) == "data/FSDP"
    assert band("gpu", "MoE") == 0.80 and BANDS[("gpu", "MoE")][2] == 4
    assert moe.step_time_with_band() == ("1 s (validation: within ±80% for MoE on GPUs, 0.70 to 1.78 of the "
                                         "published step over 4 published runs)")
    assert all(band_text("gpu", "MoE") != band_text("gpu", kind) for kind in ("data/FSDP", "tensor", "pipeline"))
    assert band_text("tpu", "MoE") == "validation: no published run of MoE on TPUs checked, no band"


def test_every_band_names_its_rows_and_a_kind_without_rows_says_so():
    for (platform, kind), (low, high, rows) in BANDS.items():
        assert 0 < low <= high and rows >= 1
        miss = band(platform, kind)
        assert max(1 - low, high - 1) <= miss < max(1 - low, high - 1) + 0.05 and round(miss * 100) % 5 == 0
        assert band_text(platform, kind) == (f"validation: within ±{miss:.0%} for {kind} on {platform.upper()}s, "
                                             f"{low:.2f} to {high:.2f} of the published step over {rows} "
                                             f"published runs")
    assert band("gpu", "data/FSDP") == 0.40 and band("gpu", "pipeline") == 0.20  # 0.64 and 0.81 at worst
    assert band_text("cpu", "tensor") == "validation: no published run of tensor on cpu checked, no band"


def test_a_printed_estimate_carries_its_band_and_its_verdict(monkeypatch):
    monkeypatch.delenv("MULTIMESH_MEMORY_LIMIT", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    h100 = PROFILES["h100-sxm"]
    memory = {0: DeviceMemory(0, "step", params=40 * 2**30, optimizer=0, batch=0, stashed=0, temp=0, outputs=0)}
    est = Estimate("step", memory, programs=(), profile=h100,
                   time=StepTime(programs={}, transfers=0.0, total=1.17, dtype="bfloat16", mfu=None))
    assert est.step_time_with_band() == "1.17 s (" + band_text("gpu", "data/FSDP") + ")"
    assert est.step_time_with_band().startswith("1.17 s (validation: within ±40% for data/FSDP on GPUs, 0.64 to")
    text = str(est)
    assert est.step_time_with_band() in text
    assert "memory: fits: peak 40.0 GiB of 55.9 GiB per device" in text and "headroom" in text
