"""The datasheet hardware profiles: every figure the one its source states (as the source writes it, converted
here), peak rates dense, a GPU's node its reference system's NICs, a TPU's node its slice; and every profile
named where a user looks for the names."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from multimesh.estimate import PROFILES, UnknownProfileError, get_profile

REPO = Path(__file__).resolve().parent.parent
T, G = 1e12, 1e9

#: GPU figures as their sources write them. ``sparse``: Tensor Core TFLOPS as NVIDIA's tables list them, with 2:4
#: sparsity (dense is half); ``plain``: TFLOPS without a sparsity figure; ``nvlink``: GB/s per GPU, both directions
#: together; ``nic_gbit``: one compute NIC's Gb/s; ``mamf``: ml-engineering's MAMF table row (MAMF, Theory), its
#: Theory column being the dense bfloat16 peak (compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
#: comparison table").
GPU_SOURCES = {
    # A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), A100 40GB SXM column; DGX A100: eight
    # single-port ConnectX-6 200 Gb/s HDR; MAMF row "NVIDIA A100 SXM | 271.2 | 312"
    "a100-40gb": dict(sparse={"bfloat16": 624, "float16": 624, "tfloat32": 312},
                      plain={"float32": 19.5, "float64": 19.5}, memory_gbps=1555, memory_gb=40, nvlink=600, nics=8,
                      nic_gbit=200, mamf=(271.2, 312)),
    # HGX page, HGX B200 column: FP16/BF16 4.5 PFLOPS, FP8 9, TF32 2.2 (with sparsity), FP32 75 TFLOPS, FP64 37,
    # 180GB HBM3E at 7.7TB/s; DGX B200 User Guide: 1,440 GB over 8 GPUs, NVSwitches of 14.4 TB/s aggregate over 8
    # GPUs, 8 ConnectX-7 up to 400 Gb/s; MAMF row "NVIDIA B200 SXM | 1745.0 | 2250"
    "b200": dict(sparse={"bfloat16": 4500, "float16": 4500, "float8": 9000, "tfloat32": 2200},
                 plain={"float32": 75, "float64": 37}, memory_gbps=7700, memory_gb=1440 / 8, nvlink=14400 / 8, nics=8,
                 nic_gbit=400, mamf=(1745.0, 2250)),
}

#: TPU figures as Google's pages write them. ``tflops``: per chip (TPUs list no sparse rate); ``ici_per_direction``:
#: bytes/s of a ring over one torus dimension (2 ports); ``dcn_per_host``: bytes/s of a host's NICs, shared by its
#: ``chips_per_host``; ``slice``: the largest single slice, the profile's node.
TPU_SOURCES = {
    # cloud.google.com/tpu/docs/v4: "275 teraflops (bf16 or int8)", "32 GiB, 1200 GBps", "TPU Pod size 4096 chips";
    # no ICI or DCN figure there: Google's scaling book (jax-ml/scaling-book tpus.md) gives "TPU v4p" ICI 4.5e10
    # bytes/s per link one way and DCN "around 2.5e10 bytes / second per host" (2x2x1 = 4 chips a host)
    "tpu-v4": dict(tflops={"bfloat16": 275, "int8": 275}, memory_gbps=1200, memory_bytes=32 * 2**30,
                   ici_per_direction=2 * 4.5e10, dcn_per_host=2.5e10, chips_per_host=4, slice=4096),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 1836 TOPs int8, 32 GB at 1638 GBps, ICI 800 GBps per chip
    # (bidirectional) over 4 ports, 256 chips per Pod (16x16 the largest slice), 8 chips and 4 x 200 Gbps NICs a host
    "tpu-v6e": dict(tflops={"bfloat16": 918, "int8": 1836}, memory_gbps=1638, memory_bytes=32 * 10**9,
                    ici_per_direction=800e9 / 4 * 2 / 2, dcn_per_host=4 * 200e9 / 8, chips_per_host=8, slice=256),
}


@pytest.mark.parametrize("name", sorted(GPU_SOURCES))
def test_a_gpu_profile_holds_its_datasheet_figures(name):
    cited, p = GPU_SOURCES[name], get_profile(name)
    want = {**{k: v / 2 * T for k, v in cited["sparse"].items()}, **{k: v * T for k, v in cited["plain"].items()}}
    assert p.peak_flops == pytest.approx(want) and set(p.peak_flops) == set(want)
    assert p.memory_bandwidth == pytest.approx(cited["memory_gbps"] * G)
    assert p.memory_bytes == pytest.approx(cited["memory_gb"] * G)
    assert p.intra_node_bandwidth == pytest.approx(cited["nvlink"] / 2 * G)  # per direction
    # the node is the reference 8-GPU system, its compute NICs set (not left at one per device by default)
    assert (p.devices_per_node, p.nics_per_node) == (8, cited["nics"])
    assert p.inter_node_bandwidth == pytest.approx(cited["nic_gbit"] / 8 * G)
    assert p.achievable_matmul_fraction == pytest.approx(cited["mamf"][0] / cited["mamf"][1])
    assert p.platform == "gpu" and p.source.startswith("https://")
    assert any("ConnectX" in n and "https://" in n for n in p.notes)  # the NICs' source
    assert any("maximum achievable matmul" in n and str(cited["mamf"][0]) in n for n in p.notes)
    assert any("assumption" in n and "latency" in n for n in p.notes)


@pytest.mark.parametrize("name", sorted(GPU_SOURCES))
def test_a_gpu_profiles_peak_is_dense(name):
    """NVIDIA lists Tensor Core rates with sparsity: the profile holds half, the rate ml-engineering's MAMF table
    states as the dense (no sparsity) peak."""
    cited, p = GPU_SOURCES[name], get_profile(name)
    assert p.peak_flops["bfloat16"] == pytest.approx(cited["mamf"][1] * T)
    assert p.peak_flops["bfloat16"] == pytest.approx(cited["sparse"]["bfloat16"] * T / 2)


@pytest.mark.parametrize("name", sorted(TPU_SOURCES))
def test_a_tpu_profile_holds_its_pages_figures_and_its_node_is_a_slice(name):
    cited, p = TPU_SOURCES[name], get_profile(name)
    want = {k: v * T for k, v in cited["tflops"].items()}
    want["float32"] = want["bfloat16"]  # XLA's default precision: one bfloat16 pass
    assert p.peak_flops == pytest.approx(want) and set(p.peak_flops) == set(want)  # no rate the page lacks
    assert p.memory_bandwidth == pytest.approx(cited["memory_gbps"] * G) and p.memory_bytes == cited["memory_bytes"]
    assert p.intra_node_bandwidth == pytest.approx(cited["ici_per_direction"])
    # the node is the slice: every chip of it on the ICI, the network between slices shared by a host's chips
    assert p.devices_per_node == cited["slice"]
    assert (p.node_of(cited["slice"] - 1), p.node_of(cited["slice"])) == (0, 1)
    assert p.network_share == pytest.approx(cited["dcn_per_host"] / cited["chips_per_host"])
    assert p.achievable_matmul_fraction == 1.0 and any("no row for this chip" in n for n in p.notes)
    assert p.platform == "tpu" and p.source.startswith(f"https://cloud.google.com/tpu/docs/{name[4:]} ")
    assert any("assum" in n for n in p.notes)


def _names(text: str) -> set[str]:
    """The profile names in ``text``: every word shaped like one (a name no profile has included)."""
    return set(re.findall(r"(?<![\w-])(?:[hab]\d{3}(?:-[a-z0-9]+)?|tpu-v\d+[a-z]*)(?![\w-])", text))


def test_every_profile_is_named_where_its_names_are_listed():
    """get_profile's docstring, UnknownProfileError's message, docs/planning.md's table (each row with its
    source) and published_runs.yaml's devices.kind line name every profile."""
    every = set(PROFILES)
    assert _names(inspect.getdoc(get_profile)) == every
    with pytest.raises(UnknownProfileError) as e:
        get_profile("h100-pcie")
    assert str(e.value).startswith("no hardware profile named 'h100-pcie'; known: " + ", ".join(sorted(every)) + ".")
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w-]+)` \| [^|]+ \| ([^|]+) \|",
                                                         (REPO / "docs" / "planning.md").read_text(), re.M)}
    assert set(table) == every and all(len(source.split()) >= 3 for source in table.values())
    header = (REPO / "benchmarks" / "published_runs.yaml").read_text().split("\nruns:")[0]
    kind_line = header[header.index("#   devices"):header.index("#   layout")]
    assert _names(kind_line) == every
