"""How far a predicted step is trusted: the validation's band per kind of layout, printed with the step."""

from multimesh.estimate import PROFILES
from multimesh.estimate.report import DeviceMemory, Estimate, StepTime
from multimesh.estimate.trust import BANDS, band_text, layout_kind


def test_the_kind_of_a_layout():
    assert layout_kind({"data": 8, "fsdp": 8}) == "data/FSDP"
    assert layout_kind({"data": 8, "tensor": 8}) == "tensor"
    assert layout_kind({"data": 8}, pipeline_stages=4) == "pipeline"
    assert layout_kind(tensor=1) == "data/FSDP"


def test_every_band_names_its_rows_and_a_kind_without_rows_says_so():
    for (platform, kind), (miss, rows) in BANDS.items():
        assert 0 < miss < 1 and rows >= 1
        assert band_text(platform, kind) == (f"validation: within ±{miss:.0%} for {kind} on "
                                             f"{platform.upper()}s ({rows} published runs)")
    assert band_text("cpu", "tensor") == "validation: no published run of tensor on cpu checked, no band"


def test_a_printed_estimate_carries_its_band_and_its_verdict(monkeypatch):
    monkeypatch.delenv("MULTIMESH_MEMORY_LIMIT", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    h100 = PROFILES["h100-sxm"]
    memory = {0: DeviceMemory(0, "step", params=40 * 2**30, optimizer=0, batch=0, stashed=0, temp=0, outputs=0)}
    est = Estimate("step", memory, programs=(), profile=h100,
                   time=StepTime(programs={}, transfers=0.0, total=1.17, dtype="bfloat16", mfu=None))
    miss, rows = BANDS[("gpu", "data/FSDP")]
    assert est.step_time_with_band() == (f"1.17 s (validation: within ±{miss:.0%} for data/FSDP on GPUs "
                                         f"({rows} published runs))")
    text = str(est)
    assert est.step_time_with_band() in text
    assert "memory: fits: peak 40.0 GiB of 55.9 GiB per device" in text and "headroom" in text
