"""Step time from a hardware profile: a roofline per kernel and an alpha-beta model per collective.

A matrix product is priced at the peak of the dtype its operands run in
(`precision`: bf16 operands with f32 accumulation are bf16 work), read from
the program; ``dtype=`` overrides that for every flop. Flops take their peak
times the profile's ``achievable_matmul_fraction`` (the best rate a matrix
product reaches, measured independently; 1 where not measured). A program's
kernels run one after another, each bound by its compute or its memory
traffic: a program takes the sum over its kernels (`kernels`) of
``max(flops / rate, bytes / memory bandwidth)``, plus the flops no kernel
shows (a library call whose dimensions its HLO does not print) at that rate,
plus its collectives, plus the profile's ``launch_overhead`` (a
`CalibratedProfile`'s measured cost of one execution whatever its work; 0
for a datasheet profile), plus, where the host's allocator maps a temporary
buffer above `FRESH_MAPPING_BYTES` afresh on every execution (the profile's
``fresh_memory_rate``, measured on CPU), the first touch of all its pages.

A program compiled for another platform than the profile's (a plan for GPUs
or TPUs compiled on CPU) is priced by what the target's compiler does with
it, from the kernels XLA:CPU made:

- on a GPU (``platform="gpu"``), XLA runs each matrix product as a library
  kernel (cuBLAS) and the elementwise work around it as kernels of its own:
  the sum of the kernels' rooflines, as above;
- on a TPU, or a profile of no platform, XLA fuses the elementwise work into
  its matrix-product kernels: one roofline over the whole program,
  ``max(flops / rate, bytes / memory bandwidth)``;

either way without the bytes of the attention score matrices, which the
target's flash-attention kernel keeps on chip (`memory_bytes`), and with
each grouped product (``ragged_dot``: an MoE layer's experts) at its real
work, as the target's grouped GEMM runs it: where XLA:CPU expanded one into
a dense product over every group (the kernels marked ``grouped``), those
kernels give way to the traced program's grouped products (each row through
its own group's matrix; its operands and result read and written once:
`on_platform`).

Collectives: on GPUs and TPUs XLA runs them asynchronously and its
latency-hiding scheduler places independent compute beside them, so only a
``critical`` collective (`collectives`: a product computes its input and
another waits for its result, as a tensor-parallel all-reduce) adds its
time; the others (a parameter's all-gather, a gradient's reduction) take
the links' time while the compute takes its own: the program takes
``max(compute-or-memory bound, those collectives) + critical collectives``.
On a CPU they run one after another with the compute. A copy between
submeshes costs its fixed cost (``transfer_time``) and its bytes over the
link. A collective is priced by `network` over the links its groups' devices
cross: device ``i`` sits on node ``i // devices_per_node`` (the program's
device assignment maps the HLO's replica groups to device ids); a group
inside one node runs a ring over the intra-node link (NVLink, ICI), one
across nodes the fastest of the ring, tree and hierarchical algorithms over
NVLink and all of the group's NICs. Where the devices are not known, a group
of at most ``devices_per_node`` devices is taken to be inside one node, a
larger one to have one device per node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .collectives import Collective
from .kernels import Kernel
from .network import Span, network_seconds
from .precision import main_dtype, rate_for
from .profiles import HardwareProfile
from .programs import ProgramCost

__all__ = ["FRESH_MAPPING_BYTES", "ProgramTime", "collective_time", "compute_time", "fresh_memory_time", "kernels_time",
           "launch_overhead", "memory_bytes", "on_platform", "overlaps_collectives", "program_time", "transfer_time"]

#: A buffer above this many bytes is mapped afresh by glibc's malloc on every allocation and unmapped when
#: freed: 32 MiB, the most its mmap threshold grows to on a 64-bit host (a thread's arena holds no more than
#: 64 MiB). XLA:CPU allocates a program's temporaries as one buffer per execution.
FRESH_MAPPING_BYTES = 32 << 20


def collective_time(c: Collective, profile: HardwareProfile) -> float:
    """One execution of ``c`` over the links its groups' devices cross (`network`)."""
    n = max(c.group_size, 1)
    if n == 1:
        return 0.0
    spanned = c.nodes_spanned(profile.node_of)
    if spanned is None:  # devices not read: a group that fits a node is taken to be inside one, else spread out
        span = Span.inside_one_node(n) if n <= profile.devices_per_node else Span(n, n, 1)
    elif c.kind == "collective-permute":
        span = Span(n, spanned, 1)
    else:
        span = Span(n, spanned, c.per_node(profile.node_of) or 1)
    return network_seconds(c.kind, c.bytes, span, profile)


@dataclass(frozen=True)
class ProgramTime:
    """One execution of a program, in seconds: ``compute`` (all its flops at the achievable rate), ``memory``
    (all its bytes at the memory bandwidth), ``kernels`` (the sum of its kernels' rooflines; None: not
    priced kernel by kernel), ``communication`` (its collectives), of which ``overlapped`` can run beside
    the compute, ``launch`` (the execution's fixed cost), ``fresh_memory`` (the first touch of a temporary
    buffer mapped afresh); ``total`` = launch + work, ``work`` = max(bound, overlapped) + the other
    collectives + fresh_memory, ``bound`` = kernels (or max(compute, memory))."""

    compute: float
    memory: float
    communication: float
    launch: float = 0.0
    kernels: float | None = None
    fresh_memory: float = 0.0
    overlapped: float = 0.0

    @property
    def bound(self) -> float:
        """Seconds of compute and memory traffic."""
        return max(self.compute, self.memory) if self.kernels is None else self.kernels

    @property
    def work(self) -> float:
        return max(self.bound, self.overlapped) + self.communication - self.overlapped + self.fresh_memory

    @property
    def total(self) -> float:
        return self.launch + self.work


def launch_overhead(profile: HardwareProfile) -> float:
    """Seconds one program execution costs whatever its work: measured by `calibrate`, else 0."""
    return profile.launch_overhead


def overlaps_collectives(profile: HardwareProfile) -> bool:
    """Whether the profile's compiler runs collectives beside independent compute (XLA on GPU and TPU)."""
    return profile.platform in ("gpu", "tpu")


def _compiled_for(p: ProgramCost, profile: HardwareProfile) -> bool:
    """Whether ``p`` was compiled for the profile's platform (one of no platform matches none)."""
    return bool(profile.platform) and profile.platform == p.platform


def on_platform(p: ProgramCost, profile: HardwareProfile) -> ProgramCost:
    """``p`` as the profile's platform runs it: as compiled where it was compiled for that platform, or where
    XLA made no dense expansion of a grouped product; else with the kernels of those expansions (``grouped``)
    replaced by its grouped products (``p.grouped``), and its flops and bytes changed by as much."""
    expanded = [k for k in p.kernels if k.grouped]
    if _compiled_for(p, profile) or not expanded or not p.grouped:
        return p

    def total(kernels: list[Kernel] | tuple[Kernel, ...], of: str) -> float:
        return sum(getattr(k, of) * k.count for k in kernels)

    counted = sum(f for _, f in p.matmul_dtypes)
    return replace(p, kernels=tuple(k for k in p.kernels if not k.grouped) + p.grouped,
                   flops=max(p.flops - total(expanded, "flops") + total(p.grouped, "flops"), counted),
                   bytes_accessed=max(p.bytes_accessed - total(expanded, "bytes") + total(p.grouped, "bytes"), 0.0))


def compute_time(p: ProgramCost, profile: HardwareProfile, dtype: str | None = None) -> float:
    """Seconds ``p``'s flops take at peak (`program_time` divides by the achievable fraction): each dtype's
    matrix flops (``p.matmul_dtypes``) at that dtype's rate, the rest at the rate of the dtype of most of them;
    ``dtype``: every flop at that dtype's rate."""
    p = on_platform(p, profile)
    if dtype is not None:
        return p.flops / profile.flops_rate(dtype)
    by = dict(p.matmul_dtypes)
    rest = max(p.flops - sum(by.values()), 0.0)
    return sum(f / rate_for(profile, d) for d, f in by.items()) + rest / rate_for(profile, main_dtype(by))


def kernels_time(p: ProgramCost, profile: HardwareProfile, dtype: str | None = None) -> float | None:
    """The sum of ``p``'s kernels' rooflines, each kernel's flops at the achievable rate of its own dtype
    (``dtype``: all at that one's), plus its flops that no kernel shows at the rate of its main dtype; a
    kernel compiled for another platform without its attention-score bytes (None: no kernels read, or read
    from a compilation for another platform whose compiler the profile's does not follow kernel for kernel:
    see the module docstring)."""
    p = on_platform(p, profile)
    native = _compiled_for(p, profile)
    if not p.kernels or not (native or profile.platform == "gpu"):
        return None
    bandwidth = profile.memory_bandwidth
    main = dtype or main_dtype(dict(p.matmul_dtypes))
    peak_of = profile.flops_rate if dtype is not None else (lambda d: rate_for(profile, d))

    def rate(d: str) -> float:
        return peak_of(d) * profile.achievable_matmul_fraction

    def moved(k: Kernel) -> int:
        return k.bytes if native else k.bytes - k.attention_bytes

    shown = sum(k.flops * k.count for k in p.kernels)
    return (sum(k.count * max(k.flops / rate(dtype or k.dtype or main), moved(k) / bandwidth) for k in p.kernels)
            + max(p.flops - shown, 0.0) / rate(main))


def fresh_memory_time(p: ProgramCost, profile: HardwareProfile) -> float:
    """Seconds one execution of ``p`` spends first touching its temporary buffer, where the profile's host
    maps a buffer of that size afresh every time (``fresh_memory_rate``; 0: reused, or a program compiled for
    another platform than the profile's)."""
    rate = profile.fresh_memory_rate
    if rate <= 0 or p.temp_bytes <= FRESH_MAPPING_BYTES or not _compiled_for(p, profile):
        return 0.0
    return p.temp_bytes / rate


def memory_bytes(p: ProgramCost, profile: HardwareProfile) -> float:
    """The bytes one execution of ``p`` moves through device memory as priced on ``profile``: its kernels'
    as compiled, where that is for the profile's platform; else without its attention score matrices, which
    the target's flash-attention kernel keeps on chip (``attention_bytes``)."""
    if _compiled_for(p, profile):
        return p.bytes_accessed
    return max(p.bytes_accessed - p.attention_bytes, 0.0)


def program_time(p: ProgramCost, profile: HardwareProfile, dtype: str | None = None) -> ProgramTime:
    """One execution of ``p``: its matrix products at the rates of the dtypes they run in (``dtype``: every
    flop at that dtype's rate, an override)."""
    p = on_platform(p, profile)
    collectives = [(c, c.count * collective_time(c, profile)) for c in p.collectives]
    overlapped = sum(t for c, t in collectives if not c.critical) if overlaps_collectives(profile) else 0.0
    return ProgramTime(compute=compute_time(p, profile, dtype) / profile.achievable_matmul_fraction,
                       memory=memory_bytes(p, profile) / profile.memory_bandwidth,
                       communication=sum(t for _, t in collectives), overlapped=overlapped,
                       launch=launch_overhead(profile), kernels=kernels_time(p, profile, dtype),
                       fresh_memory=fresh_memory_time(p, profile))


def transfer_time(nbytes: int, profile: HardwareProfile, *, inside_node: bool) -> float:
    """One copy between submeshes: its fixed cost (the link's latency, or the profile's measured
    ``copy_latency`` where that is more) + bytes / link bandwidth."""
    if inside_node:
        return max(profile.copy_latency, profile.intra_node_latency) + nbytes / profile.intra_node_bandwidth
    return max(profile.copy_latency, profile.inter_node_latency) + nbytes / profile.inter_node_bandwidth
