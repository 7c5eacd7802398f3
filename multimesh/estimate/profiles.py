"""Hardware profiles: the datasheet numbers a step-time estimate divides by.

Compute and memory figures are NVIDIA's published datasheet numbers, dense
(NVIDIA's tables show Tensor Core rates *with* 2:4 sparsity; dense is half).
Link figures are per direction (NVLink's "900 GB/s" is both directions
together). The inter-node figures and every latency are *assumptions* of a
typical cluster (one 400 Gb/s NDR InfiniBand NIC per Hopper GPU, 200 Gb/s
HDR per A100), not datasheet values: measure your own and pass a profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PROFILES", "HardwareProfile", "UnknownProfileError", "get_profile"]


class UnknownProfileError(KeyError):
    """A hardware profile name that no profile has."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator and its links, as the roofline and alpha-beta models see them.

    ``peak_flops``: dense peak per dtype name (``"bfloat16"``, ``"float32"``,
    ...) in flop/s; ``memory_bandwidth`` in bytes/s; ``memory_bytes`` the
    device memory; ``intra_node_*`` the links between devices of one node
    (bytes/s per direction, seconds), ``inter_node_*`` those between nodes;
    ``devices_per_node`` says which collectives stay inside a node.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    devices_per_node: int = 8
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def flops_rate(self, dtype: str) -> float:
        """The peak for ``dtype``; float32 work is taken at the float32 (non-Tensor-Core) rate."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        raise ValueError(f"profile {self.name!r} has no peak for dtype {dtype!r}; it has "
                         f"{sorted(self.peak_flops)}: pass dtype= one of them")


_T, _G = 1e12, 1e9
_LINK_ASSUMPTION = "inter-node bandwidth and all latencies are assumptions of a typical cluster, not datasheet values"

PROFILES: dict[str, HardwareProfile] = {
    "h100-sxm": HardwareProfile(
        name="h100-sxm",
        # datasheet: BF16/FP16 1,979 TFLOPS and FP8 3,958 with sparsity, TF32 989 with sparsity; FP32 67
        peak_flops={"bfloat16": 989.5 * _T, "float16": 989.5 * _T, "float8": 1979 * _T, "tfloat32": 494.5 * _T,
                    "float32": 67 * _T, "float64": 67 * _T},
        memory_bandwidth=3350 * _G, memory_bytes=80 * 10**9,
        intra_node_bandwidth=450 * _G, intra_node_latency=5e-6,  # NVLink 4: 900 GB/s both directions
        inter_node_bandwidth=50 * _G, inter_node_latency=10e-6,  # assumed: NDR 400 Gb/s per GPU
        source="https://www.nvidia.com/en-us/data-center/h100/ (H100 Tensor Core GPU datasheet, SXM column)",
        notes=(_LINK_ASSUMPTION,),
    ),
    "h200": HardwareProfile(
        name="h200",
        # datasheet: the H100 SXM's compute, 141 GB HBM3e at 4.8 TB/s
        peak_flops={"bfloat16": 989.5 * _T, "float16": 989.5 * _T, "float8": 1979 * _T, "tfloat32": 494.5 * _T,
                    "float32": 67 * _T, "float64": 67 * _T},
        memory_bandwidth=4800 * _G, memory_bytes=141 * 10**9,
        intra_node_bandwidth=450 * _G, intra_node_latency=5e-6,
        inter_node_bandwidth=50 * _G, inter_node_latency=10e-6,
        source="https://www.nvidia.com/en-us/data-center/h200/ (H200 Tensor Core GPU datasheet, SXM column)",
        notes=(_LINK_ASSUMPTION,),
    ),
    "a100-80gb": HardwareProfile(
        name="a100-80gb",
        # datasheet: BF16/FP16 312 TFLOPS dense (624 sparse), TF32 156, FP32 19.5; HBM2e 2,039 GB/s (SXM)
        peak_flops={"bfloat16": 312 * _T, "float16": 312 * _T, "tfloat32": 156 * _T, "float32": 19.5 * _T,
                    "float64": 19.5 * _T},
        memory_bandwidth=2039 * _G, memory_bytes=80 * 10**9,
        intra_node_bandwidth=300 * _G, intra_node_latency=5e-6,  # NVLink 3: 600 GB/s both directions
        inter_node_bandwidth=25 * _G, inter_node_latency=10e-6,  # assumed: HDR 200 Gb/s per GPU
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 80GB SXM column)",
        notes=(_LINK_ASSUMPTION,),
    ),
}


def get_profile(profile: str | HardwareProfile) -> HardwareProfile:
    """A profile by name (``"h100-sxm"``, ``"h200"``, ``"a100-80gb"``), or ``profile`` itself."""
    if isinstance(profile, HardwareProfile):
        return profile
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a name or a HardwareProfile, not {type(profile).__name__}")
    key = profile.lower()
    if key not in PROFILES:
        raise UnknownProfileError(
            f"no hardware profile named {profile!r}; known: {', '.join(sorted(PROFILES))}. "
            f"Pass one of these names, or a multimesh.estimate.HardwareProfile with your own numbers")
    return PROFILES[key]
