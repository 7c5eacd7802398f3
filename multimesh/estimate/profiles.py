"""Hardware profiles: the datasheet numbers a step-time estimate divides by.

Compute and memory figures are NVIDIA's published datasheet numbers, dense
(NVIDIA's tables show Tensor Core rates *with* 2:4 sparsity; dense is half).
Link figures are per direction (NVLink's "900 GB/s" is both directions
together). A GPU profile's node is the vendor's reference 8-GPU system, wired
as its documentation says (each profile's ``notes`` cite it): a DGX H100's and
a DGX B200's eight 400 Gb/s ConnectX-7 compute NICs, a DGX A100's eight
200 Gb/s HDR ConnectX-6; ``nics_per_node`` NICs of ``inter_node_bandwidth``
each, shared by the node's devices (`network`). Every latency is an
*assumption*, not a documented value: measure your own and pass a profile.

TPU figures are Google Cloud's TPU documentation pages (one per generation).
There the "node" is the ICI domain: every chip of a slice is linked by the
inter-chip interconnect (a 2-D torus on v5e and v6e, 3-D on v4 and v5p), so
``devices_per_node`` is the largest single slice and the inter-node figures
are the data-center network between slices (Multislice). A collective over
one mesh axis is taken to run as a bidirectional ring over one torus
dimension, i.e. over two of the chip's ICI ports: that per-direction bandwidth
is derived from the page's per-chip total and port count (v4's page gives
none: a per-link figure Google publishes elsewhere, cited in its ``notes``),
an *assumption* of the model (XLA may route over more links), as are every
TPU latency.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from ..core.fmt import format_bytes

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
    (bytes/s per direction, seconds), ``inter_node_*`` those between nodes
    (one NIC's bandwidth per direction, and the network's latency);
    ``nics_per_node``: the NICs a node's collectives run over (0: one per
    device); ``devices_per_node``: how many devices a node holds,
    device id ``i`` on node ``i // devices_per_node`` (JAX numbers a GPU
    cluster's devices process by process, a node's together). A collective
    is priced over the links its group's devices cross (`timing`).
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
    nics_per_node: int = 0
    source: str = ""
    notes: tuple[str, ...] = field(default=())
    #: The JAX platform of these devices (``"gpu"``, ``"tpu"``, ``"cpu"``). A program compiled for the same
    #: platform is timed kernel by kernel (its kernels are the ones that will run); one compiled for another
    #: (a plan for devices you do not have, compiled on CPU) as one roofline over the whole program, as the
    #: target's compiler fuses more than XLA:CPU does. '' (unknown): one roofline.
    platform: str = ""
    #: Figures only a measurement gives (`calibrate`); a datasheet profile keeps these neutral defaults.
    #: ``launch_overhead``: seconds one program execution costs whatever its work.
    launch_overhead: float = 0.0
    #: ``copy_latency``: seconds one copy between submeshes costs whatever its size (dispatch included);
    #: 0: the link's latency.
    copy_latency: float = 0.0
    #: ``alone_speedup``: one device's compute rate while the others idle over its rate with all busy (1:
    #: each device its own compute; above 1: devices sharing a host's cores).
    alone_speedup: float = 1.0
    #: ``(k, speed-up)`` pairs: with ``k`` devices busy (the others idle), their per-device compute rate over
    #: the rate with all busy, for each ``k`` measured.
    busy_speedup: tuple[tuple[int, float], ...] = ()
    #: ``fresh_memory_rate``: bytes/s per device (all busy) at which a program's temporary buffer is first
    #: touched where the host's allocator maps it afresh on every execution (glibc's malloc, a buffer above
    #: `timing.FRESH_MAPPING_BYTES`: the kernel faults in and zeroes every page each time); 0: buffers are
    #: reused (GPUs, TPUs, an allocator told to keep freed memory: see docs/planning.md).
    fresh_memory_rate: float = 0.0
    #: ``achievable_matmul_fraction``: the fraction of ``peak_flops`` a matrix product reaches at best, as an
    #: independent measurement found it (XLA's rate on the device where it was measured, else the maximum
    #: achievable matmul rate over the peak); the step is priced at that rate, utilisation is still reported
    #: against the peak. 1: not measured.
    achievable_matmul_fraction: float = 1.0

    def __post_init__(self) -> None:
        def bad(name: str, value: object, want: str) -> ValueError:
            return ValueError(f"HardwareProfile {self.name!r}: {name}={value!r} must be {want}")

        if not self.peak_flops or not all(_positive(v) for v in self.peak_flops.values()):
            raise bad("peak_flops", self.peak_flops,
                      'a dict of dtype name -> flop/s above 0, e.g. {"bfloat16": 989e12}')
        for name in ("memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "memory_bytes"):
            if not _positive(getattr(self, name)):
                raise bad(name, getattr(self, name), "a number above 0 (bytes/s; memory_bytes: bytes per device)")
        for name in ("intra_node_latency", "inter_node_latency", "launch_overhead", "copy_latency",
                     "fresh_memory_rate"):
            if not _positive(getattr(self, name), or_zero=True):
                raise bad(name, getattr(self, name), "a number of 0 or more")
        if not isinstance(self.devices_per_node, numbers.Integral) or self.devices_per_node < 1:
            raise bad("devices_per_node", self.devices_per_node, "a whole number of 1 or more")
        if not isinstance(self.nics_per_node, numbers.Integral) or self.nics_per_node < 0:
            raise bad("nics_per_node", self.nics_per_node, "a whole number of 0 (one per device) or more")
        if not _positive(self.achievable_matmul_fraction) or self.achievable_matmul_fraction > 1:
            raise bad("achievable_matmul_fraction", self.achievable_matmul_fraction, "a fraction in (0, 1]")
        if not _positive(self.alone_speedup) or not all(_positive(v) for _, v in self.busy_speedup):
            raise bad("alone_speedup/busy_speedup", (self.alone_speedup, self.busy_speedup), "above 0")

    def __repr__(self) -> str:
        top = "bfloat16" if "bfloat16" in self.peak_flops else max(self.peak_flops, key=lambda d: self.peak_flops[d])
        return (f"{type(self).__name__}({self.name!r}: {self.peak_flops[top] / 1e12:.4g} Tflop/s {top}, "
                f"{self.memory_bandwidth / 1e9:.4g} GB/s memory, {format_bytes(self.memory_bytes)}, "
                f"{self.intra_node_bandwidth / 1e9:.4g} GB/s links in nodes of {self.devices_per_node})")

    @property
    def network_share(self) -> float:
        """Bytes/s per direction of the network that one device gets when every device of its node sends at
        once: the node's NICs' total over its devices."""
        nics = self.nics_per_node or self.devices_per_node
        return nics * self.inter_node_bandwidth / self.devices_per_node

    def node_of(self, device_id: int) -> int:
        """The node device ``device_id`` sits on."""
        return int(device_id) // self.devices_per_node

    def flops_rate(self, dtype: str) -> float:
        """The peak for ``dtype``; float32 work is taken at the float32 (non-Tensor-Core) rate."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        raise ValueError(f"profile {self.name!r} has no peak for dtype {dtype!r}; it has "
                         f"{sorted(self.peak_flops)}: pass dtype= one of them")


def _positive(x: object, or_zero: bool = False) -> bool:
    """Whether ``x`` is a real number above 0 (or 0, ``or_zero``): not a bool, NaN or infinity."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        return False
    value = float(x)
    return value >= 0 if or_zero else value > 0


_T, _G = 1e12, 1e9
#: The maximum achievable matmul rate (bfloat16, the best over shapes), measured independently with
#: mamf-finder.py: https://github.com/stas00/ml-engineering, compute/accelerator/README.md, "Maximum
#: Achievable Matmul FLOPS comparison table".
_MAMF = "achievable_matmul_fraction: maximum achievable matmul FLOPS {} of the datasheet's {} ({}), ml-engineering"
#: The rate a JAX program's matrix products reach on Hopper (H100 SXM and H200 share the GH100's SMs and clocks,
#: and so the datasheet's 989.5 TFLOP/s): XLA's bfloat16 product of 8192 x 8192 measured on an H200 by
#: `multimesh.estimate.calibrate` (benchmarks/RESULTS.md, "The planner against a GPU: estimate vs measured on an
#: H200": 633 to 711 TFLOP/s over the runs, 671.4 in the recorded profile, benchmarks/gpu_estimate_h200.json).
#: The planner prices programs XLA compiles, so XLA's rate, not the best a hand-picked shape reaches with
#: another library (torch's cuBLAS: 794.5, ml-engineering's MAMF table), is the one a step is priced at.
_HOPPER_XLA_MATMUL = 671.4
_XLA_RATE = ("achievable_matmul_fraction: {} TFLOP/s of the datasheet's 989.5 ({:.1%}), the rate XLA reached for a "
             "bfloat16 product of 8192 on an H200 (multimesh.estimate.calibrate, benchmarks/RESULTS.md; torch's "
             "cuBLAS reaches 794.5 at its best shape, ml-engineering's MAMF table)")
_LATENCY_ASSUMPTION = "every latency is an assumption of a typical cluster, not a documented value"
#: The node as wired: the vendor's reference 8-GPU system.
_DGX_H100_NET = (
    "node: a DGX H100/H200, 'Four OSFP ports serving eight single-port NVIDIA ConnectX-7 VPI ... up to 400 Gb/s "
    "InfiniBand/Ethernet' for the compute fabric (NVIDIA DGX BasePOD reference architecture, Core Components: "
    "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/"
    "core-components.html): 8 NICs x 400 Gb/s = 50 GB/s per direction each, one per GPU",
    "NVLink 4: 900 GB/s per GPU, both directions together (H100/H200 datasheet, SXM column): 450 GB/s per "
    "direction through the node's NVSwitches")
_DGX_A100_NET = (
    "node: a DGX A100, eight single-port Mellanox ConnectX-6 200 Gb/s HDR InfiniBand adapters for the cluster "
    "network (NVIDIA, 'Defining AI Innovation with NVIDIA DGX A100', "
    "https://developer.nvidia.com/blog/defining-ai-innovation-with-dgx-a100/): 8 NICs x 200 Gb/s = 25 GB/s per "
    "direction each, one per GPU",
    "NVLink 3: 600 GB/s per GPU, both directions together (A100 datasheet, SXM column): 300 GB/s per direction "
    "through the node's NVSwitches")
_DGX_B200_NET = (
    "node: a DGX B200, 'Network (Cluster) card: 4 x OSFP ports for 8 x NVIDIA ConnectX-7 Single Port Cards ... "
    "InfiniBand (default): Up to 400Gbps' (DGX B200 User Guide, Introduction to NVIDIA DGX B200 Systems, Hardware "
    "Overview: https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html): 8 NICs x 400 Gb/s = 50 "
    "GB/s per direction each, one per GPU",
    "NVLink 5: '2 x 5th generation NVLink switches that provide 14.4 TB/s aggregate bandwidth' for 8 GPUs (the same "
    "table), 1.8 TB/s per GPU both directions together as the HGX page's 'Interconnect: 5th Generation NVLink: "
    "1.8TB/s': 900 GB/s per direction through the node's NVSwitches",
    "memory: '8 x NVIDIA B200 GPUs that provide 1,440 GB total GPU memory' (the same table), 180 GB each as the "
    "HGX page's HGX B200 column ('180GB HBM3E | 7.7TB/s')")
#: TPU v4's page gives no ICI or data-center network figure; these two are from Google's 'How to Scale Your Model'
#: (https://github.com/jax-ml/scaling-book, tpus.md, commit 0819a7d8c55d).
_TPU_V4_LINKS = (
    "ICI: 4.5e10 bytes/s per link one way ('ICI BW/link (one-way, bytes/s)' row 'TPU v4p', Google's 'How to Scale "
    "Your Model', tpus.md, https://jax-ml.github.io/scaling-book/tpus/; the Cloud TPU v4 page gives no ICI "
    "bandwidth); a collective is taken to run as a bidirectional ring over one torus dimension's 2 links (an "
    "assumption, as are the latencies): 2 x 45 GB/s = 90 GB/s per direction",
    "data-center network: 'DCN bandwidth is typically around 2.5e10 bytes / second per host' (the same page; the "
    "Cloud TPU v4 page gives no DCN figure), shared by a host's 4 chips (2x2x1, the same page's table): 6.25 GB/s "
    "per chip, an assumption of a typical host",
    "node: the page's 'TPU Pod size 4096 chips', taken as the largest single slice (a 3-D torus where each "
    "dimension is a multiple of 4)",
)
_NO_MAMF = ("achievable_matmul_fraction: 1, the peak: ml-engineering's MAMF table has no row for this chip and no "
            "other independent measurement is cited")
_TPU_FLOAT32 = ("float32 is listed at the bfloat16 rate: XLA's DEFAULT matmul precision on TPU multiplies float32 "
                "in one bfloat16 pass (precision=HIGHEST takes several passes: give a profile with a lower float32 "
                "peak for that)")
_TPU_ASSUMPTIONS = (
    "intra-node (ICI) bandwidth per direction assumes a collective runs as a bidirectional ring over one torus "
    "dimension: 2 of the chip's ICI ports (the page's per-chip bidirectional total / ports x 2 ports / 2 "
    "directions); latencies are assumptions, not documented values",
    _TPU_FLOAT32,
)

PROFILES: dict[str, HardwareProfile] = {
    "h100-sxm": HardwareProfile(
        name="h100-sxm",
        platform="gpu",
        # datasheet: BF16/FP16 1,979 TFLOPS and FP8 3,958 with sparsity, TF32 989 with sparsity; FP32 67
        peak_flops={"bfloat16": 989.5 * _T, "float16": 989.5 * _T, "float8": 1979 * _T, "tfloat32": 494.5 * _T,
                    "float32": 67 * _T, "float64": 67 * _T},
        memory_bandwidth=3350 * _G, memory_bytes=80 * 10**9,
        intra_node_bandwidth=450 * _G, intra_node_latency=5e-6,  # NVLink 4: 900 GB/s both directions
        inter_node_bandwidth=50 * _G, inter_node_latency=10e-6, nics_per_node=8,  # 8 x ConnectX-7 400 Gb/s
        source="https://www.nvidia.com/en-us/data-center/h100/ (H100 Tensor Core GPU datasheet, SXM column)",
        notes=(*_DGX_H100_NET, _LATENCY_ASSUMPTION, _XLA_RATE.format(_HOPPER_XLA_MATMUL, _HOPPER_XLA_MATMUL / 989.5)),
        achievable_matmul_fraction=_HOPPER_XLA_MATMUL / 989.5,
    ),
    "h200": HardwareProfile(
        name="h200",
        platform="gpu",
        # datasheet: the H100 SXM's compute, 141 GB HBM3e at 4.8 TB/s
        peak_flops={"bfloat16": 989.5 * _T, "float16": 989.5 * _T, "float8": 1979 * _T, "tfloat32": 494.5 * _T,
                    "float32": 67 * _T, "float64": 67 * _T},
        memory_bandwidth=4800 * _G, memory_bytes=141 * 10**9,
        intra_node_bandwidth=450 * _G, intra_node_latency=5e-6,
        inter_node_bandwidth=50 * _G, inter_node_latency=10e-6, nics_per_node=8,  # 8 x ConnectX-7 400 Gb/s
        source="https://www.nvidia.com/en-us/data-center/h200/ (H200 Tensor Core GPU datasheet, SXM column)",
        notes=(*_DGX_H100_NET, _LATENCY_ASSUMPTION, _XLA_RATE.format(_HOPPER_XLA_MATMUL, _HOPPER_XLA_MATMUL / 989.5)),
        achievable_matmul_fraction=_HOPPER_XLA_MATMUL / 989.5,
    ),
    "b200": HardwareProfile(
        name="b200",
        platform="gpu",
        # HGX page, HGX B200 column, Tensor Core rates with sparsity: FP16/BF16 4.5 PFLOPS, FP8 9, TF32 2.2 (dense:
        # half); FP32 75 TFLOPS, FP64/FP64 Tensor Core 37
        peak_flops={"bfloat16": 2250 * _T, "float16": 2250 * _T, "float8": 4500 * _T, "tfloat32": 1100 * _T,
                    "float32": 75 * _T, "float64": 37 * _T},
        memory_bandwidth=7700 * _G, memory_bytes=180 * 10**9,
        intra_node_bandwidth=900 * _G, intra_node_latency=5e-6,  # NVLink 5: 1.8 TB/s both directions
        inter_node_bandwidth=50 * _G, inter_node_latency=10e-6, nics_per_node=8,  # 8 x ConnectX-7 400 Gb/s
        source="https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 column: Individual Blackwell GPU "
               "Specifications) and https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html "
               "(DGX B200 Hardware Overview)",
        notes=(*_DGX_B200_NET, _LATENCY_ASSUMPTION, _MAMF.format("1745.0", "2250", "77.6%, torch 2.7.1+cu128")),
        achievable_matmul_fraction=1745.0 / 2250,
    ),
    "a100-80gb": HardwareProfile(
        name="a100-80gb",
        platform="gpu",
        # datasheet: BF16/FP16 312 TFLOPS dense (624 sparse), TF32 156, FP32 19.5; HBM2e 2,039 GB/s (SXM)
        peak_flops={"bfloat16": 312 * _T, "float16": 312 * _T, "tfloat32": 156 * _T, "float32": 19.5 * _T,
                    "float64": 19.5 * _T},
        memory_bandwidth=2039 * _G, memory_bytes=80 * 10**9,
        intra_node_bandwidth=300 * _G, intra_node_latency=5e-6,  # NVLink 3: 600 GB/s both directions
        inter_node_bandwidth=25 * _G, inter_node_latency=10e-6, nics_per_node=8,  # 8 x ConnectX-6 200 Gb/s
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 80GB SXM column)",
        notes=(*_DGX_A100_NET, _LATENCY_ASSUMPTION, _MAMF.format("271.2", "312", "86.9%, torch 2.6.0+cu126")),
        achievable_matmul_fraction=271.2 / 312,
    ),
    "a100-40gb": HardwareProfile(
        name="a100-40gb",
        platform="gpu",
        # datasheet: the A100 80GB's compute (BF16/FP16 312 TFLOPS dense, 624 sparse; TF32 156; FP32 19.5); 40GB HBM2
        # at 1,555 GB/s (SXM)
        peak_flops={"bfloat16": 312 * _T, "float16": 312 * _T, "tfloat32": 156 * _T, "float32": 19.5 * _T,
                    "float64": 19.5 * _T},
        memory_bandwidth=1555 * _G, memory_bytes=40 * 10**9,
        intra_node_bandwidth=300 * _G, intra_node_latency=5e-6,  # NVLink 3: 600 GB/s both directions
        inter_node_bandwidth=25 * _G, inter_node_latency=10e-6, nics_per_node=8,  # 8 x ConnectX-6 200 Gb/s
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 40GB SXM column)",
        notes=(*_DGX_A100_NET, _LATENCY_ASSUMPTION,
               _MAMF.format("271.2", "312", "86.9%, torch 2.6.0+cu126") + "; the row, 'NVIDIA A100 SXM', names no "
               "memory size: the 40GB and 80GB share the GA100's SMs and clocks"),
        achievable_matmul_fraction=271.2 / 312,
    ),
    "tpu-v4": HardwareProfile(
        name="tpu-v4",
        platform="tpu",
        # page: 275 teraflops (bf16 or int8) per chip; HBM2 32 GiB at 1200 GBps; TPU Pod size 4096 chips; 3-D
        # mesh, a 3-D torus on slices whose dimensions are multiples of 4; no ICI or DCN figure (see _TPU_V4_LINKS)
        peak_flops={"bfloat16": 275 * _T, "float32": 275 * _T, "int8": 275 * _T},
        memory_bandwidth=1200 * _G, memory_bytes=32 * 2**30,
        intra_node_bandwidth=90 * _G, intra_node_latency=5e-6,  # 2 links x 45 GB/s one way (scaling book)
        inter_node_bandwidth=25 * _G / 4, inter_node_latency=20e-6,  # DCN 2.5e10 B/s per host, 4 chips a host
        devices_per_node=4096,
        source="https://cloud.google.com/tpu/docs/v4 (Cloud TPU v4, system architecture: key specifications; 3D mesh "
               "and 3D torus)",
        notes=(*_TPU_V4_LINKS, _TPU_FLOAT32, _NO_MAMF),
    ),
    "tpu-v5e": HardwareProfile(
        name="tpu-v5e",
        platform="tpu",
        # page: 197 TFLOPs bf16 and 393 TOPs int8 per chip; 16 GB HBM2 at 819 GBps; ICI 400 GBps per chip
        # (bidirectional) over 4 ports, 2-D torus, 256 chips per pod; per host of 8 chips 2 x 100 Gbps NICs
        peak_flops={"bfloat16": 197 * _T, "float32": 197 * _T, "int8": 393 * _T},
        memory_bandwidth=819 * _G, memory_bytes=16 * 10**9,
        intra_node_bandwidth=100 * _G, intra_node_latency=5e-6,  # 400 GB/s / 4 ports x 2 ports / 2 directions
        inter_node_bandwidth=25 * _G / 8, inter_node_latency=20e-6,  # 2 x 100 Gb/s per host, shared by 8 chips
        devices_per_node=256,
        source="https://cloud.google.com/tpu/docs/v5e (Cloud TPU v5e, system architecture: key chip and Pod "
               "specifications)",
        notes=_TPU_ASSUMPTIONS,
    ),
    "tpu-v5p": HardwareProfile(
        name="tpu-v5p",
        platform="tpu",
        # page: 459 TFLOPs bf16 and fp8 per chip; 95 GiB HBM2e at 2765 GBps; ICI 1200 GBps per chip
        # (bidirectional; "4800 Gbps" on older versions of the page: one direction), 3-D torus, so 6 ports
        # (2 per dimension: our reading, the page gives no port count); DCN 50 Gbps per chip; largest single
        # slice 6144 chips. No int8 rate is on the page, so none here.
        peak_flops={"bfloat16": 459 * _T, "float32": 459 * _T, "float8": 459 * _T},
        memory_bandwidth=2765 * _G, memory_bytes=95 * 2**30,
        intra_node_bandwidth=200 * _G, intra_node_latency=5e-6,  # 1200 GB/s / 6 ports x 2 ports / 2 directions
        inter_node_bandwidth=50 * _G / 8, inter_node_latency=20e-6,  # DCN 50 Gb/s per chip
        devices_per_node=6144,
        source="https://cloud.google.com/tpu/docs/v5p (Cloud TPU v5p, system architecture: key specifications)",
        notes=_TPU_ASSUMPTIONS,
    ),
    "tpu-v6e": HardwareProfile(
        name="tpu-v6e",
        platform="tpu",
        # page: 918 TFLOPs bf16 and 1836 TOPs int8 per chip; 32 GB HBM at 1638 GBps; ICI 800 GBps per chip
        # (bidirectional) over 4 ports, 2-D torus, 256 chips per Pod (the largest slice, 16x16); per host of 8 chips
        # 4 x 200 Gbps NICs. No fp8 rate is on the page, so none here.
        peak_flops={"bfloat16": 918 * _T, "float32": 918 * _T, "int8": 1836 * _T},
        memory_bandwidth=1638 * _G, memory_bytes=32 * 10**9,
        intra_node_bandwidth=200 * _G, intra_node_latency=5e-6,  # 800 GB/s / 4 ports x 2 ports / 2 directions
        inter_node_bandwidth=100 * _G / 8, inter_node_latency=20e-6,  # 4 x 200 Gb/s per host, shared by 8 chips
        devices_per_node=256,
        source="https://cloud.google.com/tpu/docs/v6e (Cloud TPU v6e (Trillium), system architecture: "
               "specifications; supported configurations)",
        notes=(*_TPU_ASSUMPTIONS, _NO_MAMF),
    ),
}


def get_profile(profile: str | HardwareProfile) -> HardwareProfile:
    """A profile by name (``"h100-sxm"``, ``"h200"``, ``"b200"``, ``"a100-80gb"``, ``"a100-40gb"``,
    ``"tpu-v4"``, ``"tpu-v5e"``, ``"tpu-v5p"``, ``"tpu-v6e"``), or ``profile`` itself."""
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
