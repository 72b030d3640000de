"""``hvd-lm scaling-model``: an alpha-beta model of data-parallel mLSTM training, 1 to 128 GPUs.

Per training step (weak scaling: the per-GPU batch is fixed) on n GPUs, g per node:

    t(n) = t_comp + t_comm_exposed(n) + t_sync            (n > 1; t(1) = t_comp)

* ``t_comp``: measured 1-GPU compute time per step (s/iter) at batch ``ref_batch``, scaled
  linearly to ``batch_per_gpu`` (a saturated GPU).
* Ring allreduce of S bytes over n ranks, per link latency alpha (s) and bandwidth beta (B/s)
  (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication operations in
  MPICH"; Patarasuk & Yuan 2009): ``2(n-1) alpha + 2(n-1)/n S / beta``. Across nodes, NCCL's
  flat ring crosses every node boundary, so each step pays the slowest link's latency and each
  node's NICs carry ``2(n-1)/n S``: beta = min(intra beta per GPU, inter beta per node).
* Hierarchical allreduce (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``, Horovod docs "Hierarchical
  allreduce"): intra-node reduce-scatter ``(g-1) alpha_l + (g-1)/g S / beta_l``, then the g local
  ranks each allreduce their S/g shard across the m = n/g nodes concurrently, sharing the node's
  inter-node bandwidth ``2(m-1) alpha_x + 2(m-1)/m (S/g) / (beta_x/g)``, then intra-node
  allgather (as the reduce-scatter); optionally plus the host staging copies of Horovod's
  MPI-based variant, ``2 (S/g) / beta_pcie``.
* Tensor fusion (Horovod docs "Tensor Fusion"): gradients ready together are packed greedily, in
  order, into buffers of at most ``HOROVOD_FUSION_THRESHOLD`` bytes (0: one allreduce per tensor;
  for equal small tensors the count is ceil(bytes / threshold)); each buffer is one allreduce and
  pays its latency term, and a buffer of more than one tensor also the copies into and out of the
  fusion buffer, 2 x bytes / copy bandwidth. Each group of tensors ready together (one background
  cycle) waits on average half a ``HOROVOD_CYCLE_TIME`` for the next cycle, plus the coordinator's
  negotiation (a bit-vector allreduce, 2 ceil(log2 n) latencies) and Horovod's per-cycle overhead.
* fp16 compression: 2 bytes per gradient value on the wire instead of 4.
* 1-bit compression (``compression="onebit"``: the compressed phase of 1-bit Adam / 1-bit LAMB,
  Tang et al. 2021, :func:`hvd_lm.dist.horovod.compressed_allreduce`): no gradient allreduce;
  after the backward pass the momentum, packed as :class:`hvd_lm.dist.onebit.Layout` packs it
  (N/8 sign bytes + 4 bytes per ``onebit_chunk`` values, S_c = n x part bytes), goes through an
  ``alltoall`` and a ring ``allgather`` of 1/n of that each (:func:`onebit_allreduce_time`), plus
  a tiny allreduce of the gradient norm; three Horovod cycles; the compression arithmetic is
  ``ONEBIT_PASSES`` passes over the fp32 momentum at the device copy rate. Nothing overlaps.
* Compute/communication overlap, from backward order: the decoder's gradient is final right after
  the output layer's backward, before BPTT, so its allreduce can run during BPTT (a window of
  ``backward_fraction x t_comp``); the recurrent weights (``w_mh``, ``w_h``) accumulate over all T
  steps, and the input projections (``w_x``, ``w_mx``, bias) and the embedding are differentiated
  after the recurrence, so their allreduce starts only after the whole backward. The overlappable
  fraction is the decoder's share of the gradient bytes (1.2% at H=4096).
* Horovod's overhead over raw MPI, calibrated on this machine from ``hvd-lm bench allreduce
  --json`` (:func:`calibrate_from_bench`): the extra latency of a synchronous allreduce (per
  cycle: measured equal for 1 and for 200 unfused tensors) and the ratio of the bandwidth terms
  (Horovod time / MPI time for large messages), applied on top of the links.
* ``t_sync``: one global per-step overhead of synchronous multi-GPU training (stragglers, the
  framework's gradient bookkeeping), calibrated once, on the 8-GPU row of the reference's 4096-d
  table, and then used unchanged for every other row, column and model.

Speedup is n x t(1) / t(n) (weak scaling), efficiency = speedup / n. :func:`validate` compares
with the reference talk (Puri et al. 2018) on DGX-1V figures (:data:`DGX1V_LINKS`), and
:func:`recommend` evaluates settings at 128 GPUs.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

from typing import Optional

import matplotlib

from hvd_lm import REPO_ROOT
from hvd_lm.core.atomic import write_text
from hvd_lm.core.config import Command, option
from hvd_lm.core.model import mlstm_parameters
from hvd_lm.core.units import GB, MIB
from hvd_lm.dist.onebit import DEFAULT_CHUNK, Layout
from hvd_lm.perf.results import fit_alpha_beta, load_bench_json
from hvd_lm.perf.scaling_report import REFERENCE

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


# ---- links --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """One level of the interconnect, as a ring allreduce sees it.

    Attributes:
        bandwidth_GBps: unidirectional bandwidth, GB/s (1e9 bytes/s): per GPU within a node (the
            ring's busbw), per node across nodes (all the node's NICs together).
        latency_s: cost of one ring step (one message), seconds.
        name: what it is.
    """

    bandwidth_GBps: float
    latency_s: float
    name: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_GBps > 0:
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {self.bandwidth_GBps}")
        if self.latency_s < 0:
            raise ValueError(f"link latency must be >= 0 s, got {self.latency_s}")

    @property
    def beta(self) -> float:
        """Bandwidth in bytes/s."""
        return self.bandwidth_GBps * GB


#: DGX-1V links (see docs/performance.md for the sources): NVLink 2.0 hybrid cube-mesh, 6 links
#: of 25 GB/s per direction per V100 that NCCL runs as rings, ~130 GB/s allreduce busbw assumed;
#: 4 x EDR InfiniBand (ConnectX-4, 100 Gb/s each) = 50 GB/s per node; dual 10GBASE-T, NCCL's socket
#: transport on one port = 1.25 GB/s; PCIe 3.0 x16 ~12 GB/s achieved for host staging.
DGX1V_LINKS = {
    "nvlink": Link(130.0, 5e-6, "NVLink 2.0 hybrid cube-mesh (NCCL ring busbw)"),
    "ib": Link(50.0, 5e-6, "4 x EDR InfiniBand, 100 Gb/s each, per node"),
    "10gbe": Link(1.25, 30e-6, "10 GbE (TCP sockets), one port per node"),
}
PCIE3_X16_GBPS = 12.0
#: V100 device-to-device copy rate for packing fusion buffers, GB/s: each byte is read and written
#: once, so about half of HBM2's 900 GB/s peak (assumption).
V100_COPY_GBPS = 400.0


# ---- collectives --------------------------------------------------------------------------------

def ring_allreduce_time(nbytes: float, n: int, latency_s: float, bandwidth_GBps: float) -> float:
    """Ring allreduce of ``nbytes`` over ``n`` ranks: 2(n-1) alpha + 2(n-1)/n S/beta, seconds
    (Thakur et al. 2005). 0 for n = 1.

    Raises:
        ValueError: n < 1, negative bytes or latency, non-positive bandwidth.
    """
    if n < 1:
        raise ValueError(f"rank count must be >= 1, got {n}")
    if nbytes < 0 or latency_s < 0 or not bandwidth_GBps > 0:
        raise ValueError(f"need nbytes >= 0, latency >= 0, bandwidth > 0; got {nbytes}, "
                         f"{latency_s}, {bandwidth_GBps}")
    if n == 1:
        return 0.0
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / (bandwidth_GBps * GB)


def flat_ring_time(nbytes: float, n: int, gpus_per_node: int, intra: Link, inter: Link,
                   bandwidth_factor: float = 1.0) -> float:
    """NCCL-style flat ring over n GPUs, seconds: within a node (n <= g) over ``intra``; across
    nodes every ring step pays the slower latency and the ring's bandwidth is the slower of the
    per-GPU intra-node and the per-node inter-node bandwidth (each node's NICs carry 2(n-1)/n S).
    ``bandwidth_factor`` (>= 1: slower) scales the bandwidth term."""
    _check_topology(n, gpus_per_node)
    if n <= gpus_per_node:
        lat, bw = intra.latency_s, intra.bandwidth_GBps
    else:
        lat = max(intra.latency_s, inter.latency_s)
        bw = min(intra.bandwidth_GBps, inter.bandwidth_GBps)
    return ring_allreduce_time(nbytes, n, lat, bw / bandwidth_factor)


def hierarchical_allreduce_time(nbytes: float, n: int, gpus_per_node: int, intra: Link,
                                inter: Link, staging_GBps: float | None = None,
                                bandwidth_factor: float = 1.0) -> float:
    """Hierarchical allreduce (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``), seconds.

    Intra-node reduce-scatter, (g-1) alpha_l + (g-1)/g S/beta_l; inter-node allreduce of each
    rank's S/g shard over m = n/g nodes, the g shards concurrently sharing the node bandwidth:
    2(m-1) alpha_x + 2(m-1)/m (S/g)/(beta_x/g); intra-node allgather, as the reduce-scatter.
    ``staging_GBps``: Horovod's MPI-based variant copies the shard to host memory and back,
    2 (S/g) / staging bandwidth (None: no staging, e.g. NCCL across nodes). Within one node it is
    a plain ring.

    Raises:
        ValueError: n > g and n not a multiple of g.
    """
    g = gpus_per_node
    _check_topology(n, g)
    if n <= g:
        return ring_allreduce_time(nbytes, n, intra.latency_s,
                                   intra.bandwidth_GBps / bandwidth_factor)
    if n % g:
        raise ValueError(f"hierarchical allreduce needs whole nodes: {n} GPUs, {g} per node")
    m = n // g
    half = (g - 1) * intra.latency_s + (g - 1) / g * nbytes * bandwidth_factor / intra.beta
    cross = ring_allreduce_time(nbytes / g, m, inter.latency_s,
                                inter.bandwidth_GBps / g / bandwidth_factor)
    stage = 2 * (nbytes / g) / (staging_GBps * GB) if staging_GBps else 0.0
    return 2 * half + cross + stage


def alltoall_time(nbytes: float, n: int, gpus_per_node: int, intra: Link, inter: Link,
                  bandwidth_factor: float = 1.0) -> float:
    """Pairwise-exchange alltoall of a ``nbytes`` buffer per rank (each rank sends nbytes/n to
    each of the n - 1 others in n - 1 steps; Thakur et al. 2005), seconds:
    ``(n-1) alpha + max(intra term, inter term)``. Within a node the intra term is
    ``(n-1)/n S / beta_intra`` (per GPU). Across nodes every rank sends ``(n-g)/n S`` to other
    nodes through its node's NICs, shared by the g local ranks: ``g (n-g)/n S / beta_inter``
    (per node), while the ``(g-1)/n S`` for local peers go over the intra-node links at the same
    time. Unlike a ring, whose every node carries about 2 S, an alltoall sends g times more per
    node across the network than it would with one rank per node. 0 for n = 1."""
    _check_topology(n, gpus_per_node)
    if n == 1:
        return 0.0
    g = min(n, gpus_per_node)
    if n <= gpus_per_node:
        return (n - 1) * intra.latency_s + (n - 1) / n * nbytes * bandwidth_factor / intra.beta
    local = (g - 1) / n * nbytes * bandwidth_factor / intra.beta
    remote = g * (n - g) / n * nbytes * bandwidth_factor / inter.beta
    return (n - 1) * max(intra.latency_s, inter.latency_s) + max(local, remote)


def ring_allgather_time(part_bytes: float, n: int, gpus_per_node: int, intra: Link, inter: Link,
                        bandwidth_factor: float = 1.0) -> float:
    """Ring allgather of one ``part_bytes`` part per rank, seconds: ``(n-1) alpha + (n-1)
    part / beta``, with the flat ring's slowest link across nodes (as :func:`flat_ring_time`:
    each node's NICs carry (n-1) parts). 0 for n = 1."""
    _check_topology(n, gpus_per_node)
    if n == 1:
        return 0.0
    if n <= gpus_per_node:
        lat, beta = intra.latency_s, intra.beta
    else:
        lat, beta = max(intra.latency_s, inter.latency_s), min(intra.beta, inter.beta)
    return (n - 1) * lat + (n - 1) * part_bytes * bandwidth_factor / beta


def onebit_allreduce_time(numel: int, n: int, gpus_per_node: int, intra: Link, inter: Link,
                          chunk: int = DEFAULT_CHUNK, bandwidth_factor: float = 1.0) -> float:
    """The wire part of one 1-bit compressed allreduce of ``numel`` values on n GPUs, seconds:
    :func:`alltoall_time` of the packed buffer (n parts of ``Layout.part_bytes``) plus
    :func:`ring_allgather_time` of one part (without the compression arithmetic and Horovod's
    cycles, which :func:`step_time` adds)."""
    lay = Layout(numel, n, chunk)
    return (alltoall_time(n * lay.part_bytes, n, gpus_per_node, intra, inter, bandwidth_factor)
            + ring_allgather_time(lay.part_bytes, n, gpus_per_node, intra, inter,
                                  bandwidth_factor))


#: Passes over the fp32 momentum (4 bytes per value, read or written) the compressed allreduce's
#: arithmetic makes on a GPU, memory-bound (assumption): worker error add, norms, sign packing,
#: error update, the server's decode and mean (over n parts of N/n), its error update, and the
#: final decode.
ONEBIT_PASSES = 8


def _check_topology(n: int, g: int) -> None:
    if n < 1 or g < 1:
        raise ValueError(f"need >= 1 GPU and >= 1 GPU per node, got n={n}, g={g}")


# ---- fusion and overlap -------------------------------------------------------------------------

def fused_buffers(tensor_bytes: Sequence[float], threshold_bytes: float) -> list[list[float]]:
    """Greedy in-order packing of tensors into fusion buffers of at most ``threshold_bytes``, as
    Horovod's controller fuses ready responses (a tensor larger than the threshold, or any tensor
    with threshold 0, is an allreduce of its own). Returns the tensor sizes of each buffer."""
    if threshold_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {threshold_bytes}")
    buffers: list[list[float]] = []
    for b in tensor_bytes:
        if buffers and sum(buffers[-1]) + b <= threshold_bytes:
            buffers[-1].append(b)
        else:
            buffers.append([b])
    return buffers


def fused_buffer_sizes(tensor_bytes: Sequence[float], threshold_bytes: float) -> list[float]:
    """Bytes of each fusion buffer (:func:`fused_buffers`)."""
    return [sum(buf) for buf in fused_buffers(tensor_bytes, threshold_bytes)]


def fused_buffer_count(tensor_bytes: Sequence[float], threshold_bytes: float) -> int:
    """Number of allreduces a group of ready tensors becomes (:func:`fused_buffer_sizes`); for many
    equal small tensors it is ceil(total bytes / threshold)."""
    return len(fused_buffer_sizes(tensor_bytes, threshold_bytes))


#: Parameter-name prefixes whose gradient is final before BPTT's backward starts.
EARLY_PREFIXES = ("decoder.",)


def split_by_readiness(params: Sequence[tuple[str, int]], early_prefixes=EARLY_PREFIXES
                       ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(early, late): parameters whose gradient is ready before the recurrence's backward (the
    decoder), and those ready only after it (recurrent weights, input projections, embedding),
    each in the order their gradients become ready (reverse registration order)."""
    early = [p for p in reversed(params) if p[0].startswith(tuple(early_prefixes))]
    late = [p for p in reversed(params) if not p[0].startswith(tuple(early_prefixes))]
    return early, late


def overlappable_fraction(params: Sequence[tuple[str, int]], early_prefixes=EARLY_PREFIXES
                          ) -> float:
    """Share of the gradient elements whose allreduce can overlap the backward pass."""
    early, late = split_by_readiness(params, early_prefixes)
    total = sum(m for _, m in early) + sum(m for _, m in late)
    if total <= 0:
        raise ValueError("empty parameter list")
    return sum(m for _, m in early) / total


# ---- the step model -----------------------------------------------------------------------------

@dataclass
class ScalingConfig:
    """Inputs of :func:`step_time`. Units: seconds, bytes, GB/s.

    Attributes:
        compute_time_s: 1-GPU compute time per step at ``ref_batch`` (s/iter, measured).
        params: (name, element count) of the gradients (:func:`mlstm_parameters`).
        grad_bytes: bytes per gradient value before compression (4 fp32, 2 fp16 training).
        compression: "none", "fp16" (2 bytes per value on the wire) or "onebit" (the compressed
            phase of 1-bit Adam / LAMB: :func:`onebit_allreduce_time` of the momentum).
        onebit_chunk: values per fp32 scale with "onebit".
        batch_per_gpu / ref_batch: per-GPU batch, and the batch ``compute_time_s`` was measured at.
        gpus_per_node: g.
        intra / inter: the links (:class:`Link`).
        algorithm: "ring" (flat, NCCL-style) or "hierarchical".
        staging_GBps: host staging bandwidth of the hierarchical variant (None: none).
        fusion_threshold_bytes: HOROVOD_FUSION_THRESHOLD (0: no fusion).
        cycle_time_s: HOROVOD_CYCLE_TIME (0 for a framework without a cycle, e.g. NCCL DDP).
        per_cycle_overhead_s: the framework's extra latency per background cycle, i.e. per group
            of tensors ready together (calibrated).
        fusion_copy_GBps: memory-copy bandwidth for packing/unpacking fusion buffers, GB/s
            (None: free).
        bandwidth_factor: the framework's bandwidth-term slowdown over raw MPI (calibrated, >= 1).
        negotiation: charge Horovod's coordinator bit-vector allreduce per ready group.
        backward_fraction: share of ``t_comp`` spent in the backward pass (2/3: backward is twice
            the forward's FLOPs).
        sync_overhead_s: per-step overhead of synchronous multi-GPU training (n > 1).
    """

    compute_time_s: float
    params: list
    grad_bytes: int = 4
    compression: str = "fp16"
    onebit_chunk: int = DEFAULT_CHUNK
    batch_per_gpu: int = 256
    ref_batch: int = 256
    gpus_per_node: int = 8
    intra: Link = field(default_factory=lambda: DGX1V_LINKS["nvlink"])
    inter: Link = field(default_factory=lambda: DGX1V_LINKS["ib"])
    algorithm: str = "ring"
    staging_GBps: float | None = None
    fusion_threshold_bytes: float = 128 * MIB
    cycle_time_s: float = 1e-3
    per_cycle_overhead_s: float = 0.0
    fusion_copy_GBps: float | None = None
    bandwidth_factor: float = 1.0
    negotiation: bool = True
    backward_fraction: float = 2 / 3
    sync_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.compute_time_s > 0:
            raise ValueError(f"compute time must be > 0 s, got {self.compute_time_s}")
        if self.compression not in ("none", "fp16", "onebit"):
            raise ValueError("compression must be 'none', 'fp16' or 'onebit', got "
                             f"{self.compression!r}")
        if self.algorithm not in ("ring", "hierarchical"):
            raise ValueError(f"algorithm must be 'ring' or 'hierarchical', got {self.algorithm!r}")
        if self.batch_per_gpu < 1 or self.ref_batch < 1:
            raise ValueError("batch sizes must be >= 1")
        if not self.params:
            raise ValueError("params must list the gradient tensors")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"grad_bytes must be 2 or 4, got {self.grad_bytes}")

    @property
    def wire_bytes_per_value(self) -> float:
        """Bytes per gradient value on the wire (onebit: 1/8 + 4 / chunk)."""
        if self.compression == "onebit":
            return 1 / 8 + 4 / (self.onebit_chunk or 1 << 30)
        return 2 if self.compression == "fp16" else self.grad_bytes

    @property
    def gradient_bytes(self) -> float:
        """Bytes allreduced per step (all gradients, after compression)."""
        return self.wire_bytes_per_value * sum(m for _, m in self.params)

    @property
    def compute_s(self) -> float:
        """Compute time per step at ``batch_per_gpu``, s."""
        return self.compute_time_s * self.batch_per_gpu / self.ref_batch


def allreduce_time(cfg: ScalingConfig, nbytes: float, n: int) -> float:
    """One allreduce of ``nbytes`` on n GPUs with ``cfg``'s algorithm and links, s (without the
    framework's per-operation overhead)."""
    if cfg.algorithm == "hierarchical" and n > cfg.gpus_per_node:
        return hierarchical_allreduce_time(nbytes, n, cfg.gpus_per_node, cfg.intra, cfg.inter,
                                           cfg.staging_GBps, cfg.bandwidth_factor)
    return flat_ring_time(nbytes, n, cfg.gpus_per_node, cfg.intra, cfg.inter,
                          cfg.bandwidth_factor)


def group_comm_time(cfg: ScalingConfig, tensor_bytes: Sequence[float], n: int) -> float:
    """Communication time of one group of tensors ready together (one background cycle), s: half
    a cycle time, the coordinator's negotiation and the per-cycle overhead, then per fused buffer
    one allreduce, plus the fusion copies for a buffer of several tensors."""
    if n == 1 or not tensor_bytes:
        return 0.0
    lat = max(cfg.intra.latency_s, cfg.inter.latency_s if n > cfg.gpus_per_node else 0.0)
    t = cfg.cycle_time_s / 2 + cfg.per_cycle_overhead_s
    if cfg.negotiation:
        t += 2 * math.ceil(math.log2(n)) * lat
    for buf in fused_buffers(tensor_bytes, cfg.fusion_threshold_bytes):
        t += allreduce_time(cfg, sum(buf), n)
        if len(buf) > 1 and cfg.fusion_copy_GBps:
            t += 2 * sum(buf) / (cfg.fusion_copy_GBps * GB)
    return t


def step_time(cfg: ScalingConfig, n: int) -> dict:
    """Predicted step on n GPUs.

    Returns:
        dict with ``n``, ``s_per_iter``, ``compute_s``, ``comm_s`` (all allreduces, unhidden),
        ``exposed_comm_s``, ``hidden_comm_s``, ``sync_s``, ``speedup`` (n t(1)/t(n)),
        ``efficiency`` (speedup / n), ``overlappable_fraction``, ``buffers`` (fused allreduces).
    """
    if n < 1:
        raise ValueError(f"GPU count must be >= 1, got {n}")
    tc = cfg.compute_s
    if cfg.compression == "onebit":
        return _onebit_step(cfg, n)
    early, late = split_by_readiness(cfg.params)
    w = cfg.wire_bytes_per_value
    eb, lb = [w * m for _, m in early], [w * m for _, m in late]
    t_early, t_late = group_comm_time(cfg, eb, n), group_comm_time(cfg, lb, n)
    window = cfg.backward_fraction * tc
    exposed = max(0.0, t_early - window) + t_late
    sync = cfg.sync_overhead_s if n > 1 else 0.0
    t = tc + exposed + sync
    speedup = n * tc / t
    return {"n": n, "s_per_iter": t, "compute_s": tc, "comm_s": t_early + t_late,
            "exposed_comm_s": exposed, "hidden_comm_s": t_early + t_late - exposed,
            "sync_s": sync, "speedup": speedup, "efficiency": speedup / n,
            "overlappable_fraction": overlappable_fraction(cfg.params),
            "buffers": (fused_buffer_count(eb, cfg.fusion_threshold_bytes)
                        + fused_buffer_count(lb, cfg.fusion_threshold_bytes)) if n > 1 else 0}


def _onebit_step(cfg: ScalingConfig, n: int) -> dict:
    """:func:`step_time` in the compressed phase of 1-bit Adam / LAMB (see the module)."""
    tc, numel = cfg.compute_s, sum(m for _, m in cfg.params)
    comm = 0.0
    if n > 1:
        lat = max(cfg.intra.latency_s, cfg.inter.latency_s if n > cfg.gpus_per_node else 0.0)
        cycle = cfg.cycle_time_s / 2 + cfg.per_cycle_overhead_s
        if cfg.negotiation:
            cycle += 2 * math.ceil(math.log2(n)) * lat
        comm = (3 * cycle  # gradient-norm allreduce, alltoall, allgather: one cycle each
                + allreduce_time(cfg, 8, n)
                + onebit_allreduce_time(numel, n, cfg.gpus_per_node, cfg.intra, cfg.inter,
                                        cfg.onebit_chunk, cfg.bandwidth_factor))
        if cfg.fusion_copy_GBps:
            comm += ONEBIT_PASSES * 4 * numel / (cfg.fusion_copy_GBps * GB)
    sync = cfg.sync_overhead_s if n > 1 else 0.0
    t = tc + comm + sync
    speedup = n * tc / t
    return {"n": n, "s_per_iter": t, "compute_s": tc, "comm_s": comm, "exposed_comm_s": comm,
            "hidden_comm_s": 0.0, "sync_s": sync, "speedup": speedup, "efficiency": speedup / n,
            "overlappable_fraction": 0.0, "buffers": 2 if n > 1 else 0}


def predict(cfg: ScalingConfig, gpus: Sequence[int] = (1, 8, 16, 32, 64, 128)) -> list[dict]:
    """:func:`step_time` for each GPU count."""
    return [step_time(cfg, n) for n in gpus]


# ---- calibration from `hvd-lm bench allreduce --json` -------------------------------------------


@dataclass
class Calibration:
    """Horovod's overhead over raw MPI measured on this machine (``bench allreduce``).

    Attributes:
        per_cycle_overhead_s: Horovod's extra time per allreduce over raw MPI for small messages
            (median over sizes <= 64 KiB), at the smallest cycle time measured, s. A synchronous
            loop pays max(cycle, overhead) per allreduce, so this includes up to that cycle.
        bandwidth_factor: the factor the model applies to the bandwidth term: max(1, measured).
        measured_bandwidth_ratio: median Horovod / MPI time over sizes >= 16 MiB (or, without
            such sizes, the ratio of the fitted alpha-beta slopes). Horovod calls the same
            ``MPI_Allreduce`` for a single tensor, so this is 1 up to noise.
        latency_label / horovod_label / mpi_label: the configurations compared.
        fits: alpha-beta fits (:func:`fit_alpha_beta`) of the compared configurations.
        per_cycle_overhead_range_s / bandwidth_ratio_range: the interquartile range (25th, 75th
            percentile) of the same quantity over every size and repeated launch: how much one
            noisy measurement could move the calibration.
        source: the bench JSON it came from.
    """

    per_cycle_overhead_s: float = 0.0
    bandwidth_factor: float = 1.0
    measured_bandwidth_ratio: float = 1.0
    latency_label: str = ""
    horovod_label: str = ""
    mpi_label: str = ""
    fits: dict = field(default_factory=dict)
    per_cycle_overhead_range_s: tuple = (0.0, 0.0)
    bandwidth_ratio_range: tuple = (1.0, 1.0)
    source: str = ""

    def bounds(self) -> tuple["Calibration", "Calibration"]:
        """The calibration at the low and the high end of both ranges (a cheap, a dear
        Horovod): the predictions' sensitivity to the measurement's noise."""
        lo_o, hi_o = self.per_cycle_overhead_range_s
        lo_r, hi_r = self.bandwidth_ratio_range
        return (replace(self, per_cycle_overhead_s=lo_o, measured_bandwidth_ratio=lo_r,
                        bandwidth_factor=max(1.0, lo_r)),
                replace(self, per_cycle_overhead_s=hi_o, measured_bandwidth_ratio=hi_r,
                        bandwidth_factor=max(1.0, hi_r)))


def calibrate_from_bench(data: dict, horovod_label: str = "hvd-mpi", mpi_label: str = "mpi4py",
                         latency_label: str | None = None, small_max: int = 64 * 1024,
                         large_min: int = 16 * MIB) -> Calibration:
    """Horovod's per-operation overhead and bandwidth factor from a ``bench allreduce`` result
    (the dict of its ``--json``), single-tensor records of the same run.

    ``latency_label`` defaults to the uncompressed, default-fusion ``horovod_label``
    configuration with the smallest ``cycle_time_ms`` (e.g. ``"hvd-mpi cycle=0.2ms"``): a
    synchronous allreduce waits for the background thread's next cycle, which would otherwise
    hide the overhead under the cycle time.

    Raises:
        ValueError: a configuration missing, or no common sizes in the needed ranges.
    """
    recs = [r for r in data["records"] if r["case"] == "single"]
    labels = {r["label"] for r in recs}
    if latency_label is None:
        cands = [r for r in recs if r["label"].split(" ")[0] == horovod_label
                 and "fusion" not in r["label"] and r.get("compression", "none") == "none"]
        if cands:
            latency_label = min(cands, key=lambda r: r.get("cycle_time_ms", 1.0))["label"]
    by = {lb: {r["size_bytes"]: r["time_s"] for r in recs if r["label"] == lb}
          for lb in (horovod_label, mpi_label, latency_label)}
    # every launch's time (median_over_repeats keeps them), for the spread
    reps = {lb: {r["size_bytes"]: r.get("time_s_repeats") or [r["time_s"]] for r in recs
                 if r["label"] == lb} for lb in (horovod_label, mpi_label, latency_label)}
    for lb in (horovod_label, mpi_label, latency_label):
        if not by.get(lb):
            raise ValueError(f"no single-tensor records for {lb!r}; present: {sorted(labels)}")
    small = [s for s in by[latency_label] if s <= small_max and s in by[mpi_label]]
    if not small:
        raise ValueError(f"no common sizes <= {small_max} bytes for {latency_label!r} and "
                         f"{mpi_label!r}")
    overhead = max(0.0, _median([by[latency_label][s] - by[mpi_label][s] for s in small]))
    overhead_samples = [max(0.0, a - b) for s in small
                        for a, b in zip(reps[latency_label][s], reps[mpi_label][s])]
    common = sorted(set(by[horovod_label]) & set(by[mpi_label]))
    large = [s for s in common if s >= large_min]
    n = data["ranks"]
    fits = {}
    for key, lb in (("horovod", horovod_label), ("mpi", mpi_label)):
        try:
            fits[key] = fit_alpha_beta(common, [by[lb][s] for s in common], n)
        except ValueError:
            pass
    if large:
        ratio = _median([by[horovod_label][s] / by[mpi_label][s] for s in large])
        ratio_samples = [a / b for s in large
                         for a, b in zip(reps[horovod_label][s], reps[mpi_label][s])]
    elif len(fits) == 2:
        ratio = fits["horovod"]["slope_s_per_byte"] / fits["mpi"]["slope_s_per_byte"]
        ratio_samples = [ratio]
    else:
        raise ValueError(f"no sizes >= {large_min} bytes and no alpha-beta fits to compare")
    return Calibration(overhead, max(1.0, ratio), ratio, latency_label, horovod_label, mpi_label,
                       fits, _iqr(overhead_samples), _iqr(ratio_samples),
                       str(data.get("source", "")))


def _iqr(xs: Sequence[float]) -> tuple[float, float]:
    """(25th, 75th) percentile of ``xs`` (both the value for one sample)."""
    if len(xs) == 1:
        return (float(xs[0]), float(xs[0]))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return (q[0], q[2])


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


# ---- validation against the reference talk ------------------------------------------------------

#: Puri et al. 2018 (the reference talk), "Distributed data parallel scaling": s/iter and their
#: speedup column, per GPU count; the numbers live once, in :data:`hvd_lm.perf.scaling_report.REFERENCE`.
PUBLISHED = {
    "4096-d w/o IB": {"hidden_size": 4096, "inter": "10gbe", "rows": REFERENCE["no-ib"]},
    "4096-d w/ IB": {"hidden_size": 4096, "inter": "ib", "rows": REFERENCE["ib"]},
    "8192-d w/ IB": {"hidden_size": 8192, "inter": "ib", "rows": REFERENCE["8192-ib"]},
}


def reference_config(hidden_size: int, inter: str | Link, compute_time_s: float,
                     calibration: Calibration | None = None, sync_overhead_s: float = 0.0,
                     **overrides) -> ScalingConfig:
    """The reference's setup as modelled: mixed-precision training (fp16 gradients, 2 bytes per
    value on the wire), batch 256 per GPU (32k over 128 GPUs), 8 V100 per DGX-1V, NCCL flat ring,
    with Horovod's overhead (``calibration``) and defaults (128 MiB fusion, 1 ms cycle) on top.
    ``inter``: a :data:`DGX1V_LINKS` key or a :class:`Link`."""
    cal = calibration or Calibration()
    kw = dict(compute_time_s=compute_time_s, params=mlstm_parameters(hidden_size), grad_bytes=2,
              compression="fp16", batch_per_gpu=256, ref_batch=256, gpus_per_node=8,
              intra=DGX1V_LINKS["nvlink"],
              inter=inter if isinstance(inter, Link) else DGX1V_LINKS[inter], algorithm="ring",
              per_cycle_overhead_s=cal.per_cycle_overhead_s, fusion_copy_GBps=V100_COPY_GBPS,
              bandwidth_factor=cal.bandwidth_factor,
              sync_overhead_s=sync_overhead_s)
    kw.update(overrides)
    return ScalingConfig(**kw)


def calibrate_sync_overhead(calibration: Calibration | None = None,
                            column: str = "4096-d w/ IB", n: int = 8) -> float:
    """The one global fitted constant: the per-step multi-GPU overhead that makes the model meet
    the published s/iter of ``column`` at n GPUs (default: one DGX-1V, 4096-d), s (>= 0)."""
    col = PUBLISHED[column]
    cfg = reference_config(col["hidden_size"], col["inter"], col["rows"][1][0], calibration)
    return max(0.0, col["rows"][n][0] - step_time(cfg, n)["s_per_iter"])


def validate(calibration: Calibration | None = None, sync_overhead_s: float | None = None
             ) -> dict:
    """Predicted vs published for every row of the reference's scaling table.

    Two predictions per row: ``pure`` (published link figures and local calibration only, no
    fitted constant) and ``model`` (plus the global ``t_sync`` of :func:`calibrate_sync_overhead`).

    Returns:
        ``{"sync_overhead_s", "rows": [...], "summary": {column: max/mean abs error}}``.
    """
    if sync_overhead_s is None:
        sync_overhead_s = calibrate_sync_overhead(calibration)
    rows = []
    for col, spec in PUBLISHED.items():
        t1 = spec["rows"][1][0]
        pure = reference_config(spec["hidden_size"], spec["inter"], t1, calibration)
        full = replace(pure, sync_overhead_s=sync_overhead_s)
        for n, (pub_t, pub_speed) in spec["rows"].items():
            p, f = step_time(pure, n), step_time(full, n)
            rows.append({"column": col, "gpus": n, "published_s_per_iter": pub_t,
                         "published_speedup": pub_speed,
                         "published_n_t1_over_tn": n * t1 / pub_t,
                         "pure_s_per_iter": p["s_per_iter"],
                         "pure_error": p["s_per_iter"] / pub_t - 1,
                         "model_s_per_iter": f["s_per_iter"],
                         "model_error": f["s_per_iter"] / pub_t - 1,
                         "model_speedup": f["speedup"], "model_efficiency": f["efficiency"],
                         "model_exposed_comm_s": f["exposed_comm_s"],
                         "gradient_MB": full.gradient_bytes / 1e6})
    summary = {}
    for col in PUBLISHED:
        errs = [abs(r["model_error"]) for r in rows if r["column"] == col and r["gpus"] > 1]
        perrs = [abs(r["pure_error"]) for r in rows if r["column"] == col and r["gpus"] > 1]
        summary[col] = {"model_max_abs_error": max(errs), "model_mean_abs_error":
                        sum(errs) / len(errs), "pure_max_abs_error": max(perrs)}
    return {"sync_overhead_s": sync_overhead_s, "rows": rows, "summary": summary,
            "links": {k: asdict(v) for k, v in DGX1V_LINKS.items()},
            "calibration": asdict(calibration or Calibration())}


def effective_inter_bandwidth(column: str = "4096-d w/ IB", n: int = 128,
                              sync_overhead_s: float = 0.0,
                              calibration: Calibration | None = None) -> float:
    """The inter-node bandwidth per node, GB/s, at which the model meets the published s/iter of
    ``column`` at n GPUs (bisection): what the 2018 software stack achieved, if the rest holds.

    Raises:
        ValueError: no bandwidth in (1e-3, 1e4) GB/s meets it.
    """
    col = PUBLISHED[column]
    target = col["rows"][n][0]
    base = reference_config(col["hidden_size"], col["inter"], col["rows"][1][0], calibration,
                            sync_overhead_s)

    def t(bw: float) -> float:
        return step_time(replace(base, inter=replace(base.inter, bandwidth_GBps=bw)),
                         n)["s_per_iter"]

    lo, hi = 1e-3, 1e4
    if not t(hi) <= target <= t(lo):
        raise ValueError(f"no inter-node bandwidth reproduces {target} s/iter at {n} GPUs")
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if t(mid) > target else (lo, mid)
    return math.sqrt(lo * hi)


def recommend(calibration: Calibration | None = None, sync_overhead_s: float | None = None,
              n: int = 128, published_speedup: float = 109.0) -> dict:
    """Settings at n GPUs (4096-d, DGX-1V with InfiniBand), each alone and combined, in two
    scenarios for the inter-node link: ``wire`` (4 x EDR at line rate) and ``as-published`` (the
    effective per-node bandwidth that reproduces the published 128-GPU s/iter,
    :func:`effective_inter_bandwidth`). Speedup is n t(1)/t(n) at the setting's own batch;
    ``throughput_vs_1gpu_ref`` is throughput relative to 1 GPU at batch 256."""
    if sync_overhead_s is None:
        sync_overhead_s = calibrate_sync_overhead(calibration)
    bw_eff = effective_inter_bandwidth(sync_overhead_s=sync_overhead_s, calibration=calibration)
    fusion_default = 128 * MIB
    settings = {
        "reference (fp16 grads, ring, 128 MB fusion, 1 ms cycle, batch 256)": {},
        "fp32 gradients (no compression)": {"grad_bytes": 4, "compression": "none"},
        "no fusion (threshold 0)": {"fusion_threshold_bytes": 0},
        "fusion 64 MB": {"fusion_threshold_bytes": 64 * MIB},
        "cycle time 5 ms": {"cycle_time_s": 5e-3},
        "hierarchical allreduce (NCCL across nodes)": {"algorithm": "hierarchical"},
        "hierarchical allreduce (Horovod MPI variant, host staging)": {
            "algorithm": "hierarchical", "staging_GBps": PCIE3_X16_GBPS},
        "batch 512 per GPU (or 2 backward passes per step)": {"batch_per_gpu": 512},
        "batch 1024 per GPU (or 4 backward passes per step)": {"batch_per_gpu": 1024},
        "batch 512 + hierarchical (NCCL)": {"batch_per_gpu": 512, "algorithm": "hierarchical"},
        "(not a setting) without the multi-GPU overhead t_sync": {"sync_overhead_s": 0.0},
    }
    out = {"n": n, "published_speedup": published_speedup, "sync_overhead_s": sync_overhead_s,
           "effective_inter_GBps": bw_eff, "fusion_default_bytes": fusion_default, "rows": []}
    for scen, inter in (("wire", DGX1V_LINKS["ib"]),
                        ("as-published", replace(DGX1V_LINKS["ib"], bandwidth_GBps=bw_eff))):
        for name, kw in settings.items():
            cfg = reference_config(4096, inter, 0.81, calibration,
                                   **({"sync_overhead_s": sync_overhead_s} | kw))
            r = step_time(cfg, n)
            thr = n * (cfg.batch_per_gpu / 256) * 0.81 / r["s_per_iter"]
            out["rows"].append({"scenario": scen, "setting": name, "s_per_iter": r["s_per_iter"],
                                "speedup": r["speedup"], "efficiency": r["efficiency"],
                                "throughput_vs_1gpu_ref": thr,
                                "vs_published": r["speedup"] / published_speedup - 1,
                                "exposed_comm_s": r["exposed_comm_s"]})
    for row in out["rows"]:  # relative to the same scenario's reference row
        base = next(b for b in out["rows"] if b["scenario"] == row["scenario"])
        row["vs_reference_setting"] = row["speedup"] / base["speedup"] - 1
    return out


def onebit_study(calibration: Calibration | None = None, sync_overhead_s: float | None = None,
                 gpus: Sequence[int] = (1, 8, 16, 32, 64, 128), warmup_fraction: float = 0.15,
                 chunk: int = DEFAULT_CHUNK, n_recommend: int = 128) -> dict:
    """1-bit Adam / LAMB against the reference's fp16 gradient allreduce on the talk's columns
    (4096-d mLSTM, DGX-1V, batch 256 per GPU, t(1) = 0.81 s): ``10 GbE`` (the "w/o I.band" column,
    which the model reproduces within 2.3%), ``IB as published`` (InfiniBand at the effective
    per-node bandwidth behind their 0.91 s/iter at 128 GPUs) and ``IB wire`` (4 x EDR).

    Per column and GPU count: the fp16 model's speedup, the compressed phase's, and the
    end-to-end speedup with ``warmup_fraction`` of the steps in the warmup (fp16 gradient
    allreduce): ``t = f t_fp16 + (1 - f) t_onebit``. Then, at ``n_recommend`` GPUs, settings of
    compression x batch per GPU, and the recommended one: the fastest at the reference's batch
    (256 per GPU, 32k global: larger batches converged worse in the reference, see its LR table).

    Raises:
        ValueError: ``warmup_fraction`` outside [0, 1].
    """
    if not 0 <= warmup_fraction <= 1:
        raise ValueError(f"warmup fraction must be in [0, 1], got {warmup_fraction}")
    if sync_overhead_s is None:
        sync_overhead_s = calibrate_sync_overhead(calibration)
    bw_eff = effective_inter_bandwidth(sync_overhead_s=sync_overhead_s, calibration=calibration)
    columns = {"10 GbE": DGX1V_LINKS["10gbe"],
               "IB as published": replace(DGX1V_LINKS["ib"], bandwidth_GBps=bw_eff),
               "IB wire": DGX1V_LINKS["ib"]}

    def cfg(inter: Link, **kw) -> ScalingConfig:
        return reference_config(4096, inter, 0.81, calibration, sync_overhead_s=sync_overhead_s,
                                onebit_chunk=chunk, **kw)

    def blended(fp16: dict, onebit: dict, n: int) -> float:
        t = warmup_fraction * fp16["s_per_iter"] + (1 - warmup_fraction) * onebit["s_per_iter"]
        return n * fp16["compute_s"] / t

    rows = []
    for col, inter in columns.items():
        for n in gpus:
            f16, one = step_time(cfg(inter), n), step_time(cfg(inter, compression="onebit"), n)
            rows.append({"column": col, "gpus": n, "fp16_s_per_iter": f16["s_per_iter"],
                         "fp16_speedup": f16["speedup"], "onebit_s_per_iter": one["s_per_iter"],
                         "onebit_comm_s": one["comm_s"], "fp16_comm_s": f16["exposed_comm_s"],
                         "onebit_speedup": one["speedup"],
                         "onebit_end_to_end_speedup": blended(f16, one, n)})
    settings = []
    for col, inter in columns.items():
        for comp in ("fp16", "onebit"):
            for batch in (256, 512, 1024):
                f16 = step_time(cfg(inter, batch_per_gpu=batch), n_recommend)
                r = step_time(cfg(inter, compression=comp, batch_per_gpu=batch), n_recommend)
                speed = r["speedup"] if comp == "fp16" else blended(f16, r, n_recommend)
                settings.append({"column": col, "compression": comp, "batch_per_gpu": batch,
                                 "global_batch": batch * n_recommend, "speedup": speed,
                                 "compressed_phase_speedup": r["speedup"]})
    recommended = {}
    for col in columns:
        at_ref = [x for x in settings if x["column"] == col and x["batch_per_gpu"] == 256]
        recommended[col] = max(at_ref, key=lambda x: x["speedup"])
    return {"sync_overhead_s": sync_overhead_s, "effective_inter_GBps": bw_eff,
            "warmup_fraction": warmup_fraction, "chunk": chunk, "rows": rows,
            "settings": settings, "recommended": recommended, "n": n_recommend,
            "published": {"10 GbE": 92.6, "IB as published": 109.0, "IB wire": 109.0}}


def plot_validation(result: dict, path: str | Path) -> None:
    """PNG (matplotlib, Agg) of published vs predicted s/iter and speedup per column."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(PUBLISHED, ("tab:red", "tab:blue", "tab:green")))
    for col in PUBLISHED:
        rs = [r for r in result["rows"] if r["column"] == col]
        x = [r["gpus"] for r in rs]
        c = colors[col]
        axes[0].plot(x, [r["published_s_per_iter"] for r in rs], "o", color=c,
                     label=f"{col} published")
        axes[0].plot(x, [r["model_s_per_iter"] for r in rs], "-", color=c,
                     label=f"{col} model")
        axes[0].plot(x, [r["pure_s_per_iter"] for r in rs], ":", color=c)
        axes[1].plot(x, [r["published_speedup"] / r["gpus"] for r in rs], "o", color=c)
        axes[1].plot(x, [r["published_n_t1_over_tn"] / r["gpus"] for r in rs], "x", color=c)
        axes[1].plot(x, [r["model_efficiency"] for r in rs], "-", color=c, label=col)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("s/iter")
    axes[0].set_title(f"step time (dots: published; lines: model; dotted: without t_sync "
                      f"= {result['sync_overhead_s'] * 1e3:.0f} ms)", fontsize=9)
    axes[1].set_ylabel("efficiency = speedup / n")
    axes[1].set_title("efficiency: model (lines), published speedup column (o), published "
                      "n t1/tn (x)", fontsize=9)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- CLI ----------------------------------------------------------------------------------------

#: The calibration the docs' figures used: ``hvd-lm bench allreduce --np 2 --repeats 3`` on the
#: project's 2-core CI machine (the model's default ``--bench-json``).
SHIPPED_CALIBRATION = REPO_ROOT / "docs" / "results" / "allreduce_calibration.json"


def _load_calibration(args: "ScalingModelConfig") -> Calibration | None:
    if args.bench_json in ("", "none"):
        return None
    path = SHIPPED_CALIBRATION if args.bench_json == "shipped" else Path(args.bench_json)
    data = load_bench_json(path)
    data["source"] = str(path)
    return calibrate_from_bench(data, args.horovod_label, args.mpi_label,
                                args.latency_label or None)


def _print_validation(v: dict) -> None:
    print(f"t_sync (fitted once, 4096-d IB, 8 GPUs) = {v['sync_overhead_s'] * 1e3:.1f} ms")
    print(f"{'column':14} {'GPUs':>4} {'pub s/it':>8} {'pure':>7} {'err':>7} {'model':>7} "
          f"{'err':>7} {'pub speed':>9} {'n t1/tn pub':>11} {'model speed':>11}")
    for r in v["rows"]:
        print(f"{r['column']:14} {r['gpus']:>4} {r['published_s_per_iter']:>8.2f} "
              f"{r['pure_s_per_iter']:>7.3f} {r['pure_error']:>+7.1%} "
              f"{r['model_s_per_iter']:>7.3f} {r['model_error']:>+7.1%} "
              f"{r['published_speedup']:>9.1f} {r['published_n_t1_over_tn']:>11.1f} "
              f"{r['model_speedup']:>11.1f}")
    for col, s in v["summary"].items():
        print(f"{col}: model max |error| {s['model_max_abs_error']:.1%}, mean "
              f"{s['model_mean_abs_error']:.1%} (without t_sync: max "
              f"{s['pure_max_abs_error']:.1%})")


def _print_onebit(r: dict) -> None:
    print(f"4096-d mLSTM, DGX-1V, batch 256/GPU; t_sync {r['sync_overhead_s'] * 1e3:.1f} ms; "
          f"1-bit: {r['chunk']} values per scale, {r['warmup_fraction']:.0%} of steps in the "
          f"fp16 warmup; IB as published = {r['effective_inter_GBps']:.2f} GB/s per node")
    print(f"{'column':16} {'GPUs':>4} {'fp16 s/it':>9} {'speedup':>8} {'1-bit s/it':>10} "
          f"{'speedup':>8} {'end-to-end':>10} {'comm fp16 ms':>12} {'comm 1-bit ms':>13}")
    for x in r["rows"]:
        print(f"{x['column']:16} {x['gpus']:>4} {x['fp16_s_per_iter']:>9.3f} "
              f"{x['fp16_speedup']:>8.1f} {x['onebit_s_per_iter']:>10.3f} "
              f"{x['onebit_speedup']:>8.1f} {x['onebit_end_to_end_speedup']:>10.1f} "
              f"{x['fp16_comm_s'] * 1e3:>12.1f} {x['onebit_comm_s'] * 1e3:>13.1f}")
    print(f"\nat {r['n']} GPUs (1-bit speedups end to end, warmup included):")
    print(f"{'column':16} {'compression':>11} {'batch/GPU':>9} {'global':>7} {'speedup':>8} "
          f"{'published':>9}")
    for x in r["settings"]:
        print(f"{x['column']:16} {x['compression']:>11} {x['batch_per_gpu']:>9} "
              f"{x['global_batch']:>7} {x['speedup']:>8.1f} {r['published'][x['column']]:>9}")
    for col, x in r["recommended"].items():
        print(f"recommended ({col}, the reference's 32k batch): {x['compression']} "
              f"-> {x['speedup']:.1f}x")


def run(args: "ScalingModelConfig") -> int:
    """Print (and with ``--json`` write) the predictions, the validation or the recommendations;
    1 with one ``ERROR:`` line on a bad calibration file or setting."""
    try:
        cal = _load_calibration(args)
        if cal is not None:
            lo_o, hi_o = cal.per_cycle_overhead_range_s
            lo_r, hi_r = cal.bandwidth_ratio_range
            print(f"calibration {cal.source} (vs {cal.mpi_label}): Horovod per-cycle overhead "
                  f"{cal.per_cycle_overhead_s * 1e6:.0f} us (interquartile {lo_o * 1e6:.0f}.."
                  f"{hi_o * 1e6:.0f}; {cal.latency_label}), bandwidth ratio "
                  f"{cal.measured_bandwidth_ratio:.3f} ({lo_r:.3f}..{hi_r:.3f}; "
                  f"{cal.horovod_label}; model uses {cal.bandwidth_factor:.3f})")
        else:
            print("calibration: none (Horovod's overhead over raw MPI taken as 0)")
        out: dict = {"calibration": asdict(cal) if cal else None}
        if args.mode == "predict":
            if args.params:
                params = [("all", args.params)]
            else:
                params = mlstm_parameters(args.hidden_size, args.embed_dim)
            links = {**DGX1V_LINKS}
            intra = Link(args.intra_bw, args.intra_latency) if args.intra_bw else links["nvlink"]
            inter = (Link(args.inter_bw, args.inter_latency) if args.inter_bw
                     else links[args.inter])
            sync = (args.sync_overhead if args.sync_overhead is not None
                    else calibrate_sync_overhead(cal))
            cfg = ScalingConfig(
                compute_time_s=args.compute_time, params=params, grad_bytes=args.grad_bytes,
                compression=args.compression, onebit_chunk=args.onebit_chunk,
                batch_per_gpu=args.batch_per_gpu or args.ref_batch,
                ref_batch=args.ref_batch, gpus_per_node=args.gpus_per_node, intra=intra,
                inter=inter, algorithm=args.algorithm,
                staging_GBps=args.staging_bw or None,
                fusion_threshold_bytes=args.fusion_threshold_mb * MIB,
                cycle_time_s=args.cycle_time_ms / 1e3,
                per_cycle_overhead_s=cal.per_cycle_overhead_s if cal else 0.0,
                fusion_copy_GBps=args.copy_bw or None,
                bandwidth_factor=cal.bandwidth_factor if cal else 1.0, sync_overhead_s=sync)
            rows = predict(cfg, list(args.gpus))
            print(f"{cfg.gradient_bytes / 1e6:.1f} MB of gradients per step, overlappable "
                  f"{rows[0]['overlappable_fraction']:.1%}, t_sync {sync * 1e3:.1f} ms")
            print(f"{'GPUs':>5} {'s/iter':>8} {'comm':>8} {'exposed':>8} {'buffers':>7} "
                  f"{'speedup':>8} {'eff':>6}")
            for r in rows:
                print(f"{r['n']:>5} {r['s_per_iter']:>8.4f} {r['comm_s']:>8.4f} "
                      f"{r['exposed_comm_s']:>8.4f} {r['buffers']:>7} {r['speedup']:>8.1f} "
                      f"{r['efficiency']:>6.1%}")
            out["predictions"] = rows
        elif args.mode == "validate":
            v = validate(cal)
            _print_validation(v)
            if cal is not None:  # how far the calibration's noise moves the comparison
                v["calibration_range"] = {}
                for name, bound in zip(("low", "high"), cal.bounds()):
                    vb = validate(bound)
                    v["calibration_range"][name] = vb["summary"]
                for col, s_ in v["summary"].items():
                    lo = v["calibration_range"]["low"][col]["model_max_abs_error"]
                    hi = v["calibration_range"]["high"][col]["model_max_abs_error"]
                    print(f"{col}: max |error| {s_['model_max_abs_error']:.1%} with the "
                          f"calibration's interquartile range {min(lo, hi):.1%}..{max(lo, hi):.1%}")
            out["validation"] = v
            if args.plot:
                plot_validation(v, args.plot)
                print(f"plot: {args.plot}")
        elif args.mode == "onebit":
            r = onebit_study(cal, args.sync_overhead, list(args.gpus),
                             args.onebit_warmup_fraction, args.onebit_chunk)
            _print_onebit(r)
            out["onebit"] = r
        else:
            r = recommend(cal)
            print(f"{r['n']} GPUs, 4096-d, DGX-1V + IB; published speedup {r['published_speedup']}x"
                  f"; effective inter-node bandwidth behind the published row "
                  f"{r['effective_inter_GBps']:.2f} GB/s per node")
            print(f"{'scenario':13} {'setting':62} {'s/iter':>7} {'speedup':>8} {'vs 109x':>8} "
                  f"{'vs ref':>7} {'thru vs 1GPU@256':>16}")
            for row in r["rows"]:
                print(f"{row['scenario']:13} {row['setting']:62} {row['s_per_iter']:>7.3f} "
                      f"{row['speedup']:>8.1f} {row['vs_published']:>+8.1%} "
                      f"{row['vs_reference_setting']:>+7.1%} "
                      f"{row['throughput_vs_1gpu_ref']:>16.1f}")
            out["recommendations"] = r
    except (ValueError, OSError, KeyError) as e:
        print(f"hvd-lm scaling-model: ERROR: {e}", file=sys.stderr)
        return 1
    if args.json:
        write_text(args.json, json.dumps(out, indent=2, default=str))
    return 0


@dataclass
class ScalingModelConfig:
    """Settings of ``hvd-lm scaling-model {predict,validate,recommend}``."""

    mode: str = option("predict", "predict s/iter on 1-128 GPUs, validate against the reference "
                       "table, recommend settings at 128 GPUs, or onebit: 1-bit Adam/LAMB vs "
                       "fp16 on the talk's 10 GbE and IB columns", positional=True,
                       choices=("predict", "validate", "recommend", "onebit"))
    hidden_size: int = option(4096, "mLSTM width H", ge=1)
    embed_dim: int = option(64, "byte embedding width", ge=1)
    params: int = option(0, "parameter count instead of H (then no overlap is assumed)", ge=0)
    compute_time: float = option(0.81, "1-GPU compute s/iter at --ref-batch (reference: 0.81 for "
                                 "4096-d on a V100)", gt=0)
    ref_batch: int = option(256, "batch --compute-time was measured at", ge=1)
    batch_per_gpu: int = option(0, "per-GPU batch (0: --ref-batch)", ge=0)
    gpus: list[int] = option(default_factory=lambda: [1, 8, 16, 32, 64, 128],
                             help="GPU counts, comma-separated", ge=1)
    gpus_per_node: int = option(8, "GPUs per node", ge=1)
    inter: str = option("ib", "DGX-1V inter-node link preset", choices=("ib", "10gbe"))
    intra_bw: float = option(0.0, "intra-node GB/s (0: NVLink preset)", ge=0)
    intra_latency: float = option(5e-6, "intra-node latency, s", ge=0)
    inter_bw: float = option(0.0, "inter-node GB/s per node (0: --inter preset)", ge=0)
    inter_latency: float = option(5e-6, "inter-node latency, s", ge=0)
    algorithm: str = option("ring", "allreduce algorithm", choices=("ring", "hierarchical"))
    staging_bw: float = option(0.0, "hierarchical host staging GB/s (0: none)", ge=0)
    grad_bytes: int = option(2, "bytes per gradient value (2: mixed-precision training)",
                             choices=(2, 4))
    compression: str = option("fp16", "gradient compression on the wire (onebit: the "
                              "compressed phase of 1-bit Adam/LAMB)",
                              choices=("none", "fp16", "onebit"))
    onebit_chunk: int = option(DEFAULT_CHUNK, "onebit: values per fp32 scale", ge=0)
    onebit_warmup_fraction: float = option(0.15, "onebit mode: share of the steps in the "
                                           "uncompressed warmup", ge=0, le=1)
    fusion_threshold_mb: float = option(128.0, "HOROVOD_FUSION_THRESHOLD, MiB", ge=0)
    copy_bw: float = option(V100_COPY_GBPS, "fusion-buffer copy GB/s (0: free)", ge=0)
    cycle_time_ms: float = option(1.0, "HOROVOD_CYCLE_TIME, ms", ge=0)
    sync_overhead: Optional[float] = option(None, "t_sync, s (default: calibrated on the "
                                            "reference's 8-GPU row)", ge=0)
    bench_json: str = option("shipped", "`hvd-lm bench allreduce --json` output calibrating "
                             "Horovod's per-op overhead and bandwidth factor: a file, 'shipped' "
                             "(docs/results/allreduce_calibration.json, what the docs used) or 'none'")
    horovod_label: str = option("hvd-mpi", "bench configuration of Horovod")
    mpi_label: str = option("mpi4py", "bench configuration of raw MPI")
    latency_label: str = option("", "configuration for the per-op overhead (default: the "
                                "--horovod-label one with the smallest cycle time)")
    plot: str = option("", "validate: write a PNG here")
    json: str = option("", "write the results here")


SCALING_MODEL = Command(
    ScalingModelConfig, run,
    description="Alpha-beta model of data-parallel mLSTM training on 1-128 GPUs: predict s/iter, "
    "speedup and efficiency; validate against the reference talk's table; recommend settings "
    "at 128 GPUs.")
