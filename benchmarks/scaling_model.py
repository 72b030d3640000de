"""An alpha-beta model of data-parallel mLSTM training, 1 to 128 GPUs.

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
  Tang et al. 2021, ``onebit_compression.compressed_allreduce``): no gradient allreduce;
  after the backward pass the momentum, packed as :class:`hvd_lm.comm.onebit_compression.Layout`
  packs it (N/8 sign bytes + 4 bytes per ``onebit_chunk`` values, S_c = n x part bytes), goes
  through an
  ``alltoall`` and a ring ``allgather`` of 1/n of that each (:func:`onebit_allreduce_time`), plus
  a tiny allreduce of the gradient norm; three Horovod cycles; the compression arithmetic is
  ``ONEBIT_PASSES`` passes over the fp32 momentum at the device copy rate. Nothing overlaps.
* Compute/communication overlap, from backward order: the decoder's gradient is final right after
  the output layer's backward, before BPTT, so its allreduce can run during BPTT (a window of
  ``backward_fraction x t_comp``); the recurrent weights (``w_mh``, ``w_h``) accumulate over all T
  steps, and the input projections (``w_x``, ``w_mx``, bias) and the embedding are differentiated
  after the recurrence, so their allreduce starts only after the whole backward. The overlappable
  fraction is the decoder's share of the gradient bytes (1.2% at H=4096).
* Horovod's overhead over raw MPI, calibrated on this machine from ``python -m benchmarks allreduce
  --json`` (:func:`calibrate_from_bench`): the extra latency of a synchronous allreduce (per
  cycle: measured equal for 1 and for 200 unfused tensors) and the ratio of the bandwidth terms
  (Horovod time / MPI time for large messages), applied on top of the links.
* ``t_sync``: one global per-step overhead of synchronous multi-GPU training (stragglers, the
  framework's gradient bookkeeping), calibrated once, on the 8-GPU row of the reference's 4096-d
  table, and then used unchanged for every other row, column and model.

Speedup is n x t(1) / t(n) (weak scaling), efficiency = speedup / n. :func:`validate` compares
with the reference talk (Puri et al. 2018) on DGX-1V figures (:data:`DGX1V_LINKS`), and
:func:`recommend` evaluates settings at 128 GPUs: both in :mod:`benchmarks.scaling_study`, with
the ``python -m benchmarks scaling-model`` command; this module is the model alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from hvd_lm.comm.onebit_compression import DEFAULT_CHUNK, Layout
from hvd_lm.util.units import GB, MIB

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
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / (bandwidth_GBps * GB)


def flat_ring_time(nbytes: float, n: int, gpus_per_node: int, intra: Link, inter: Link,
                   bandwidth_factor: float = 1.0) -> float:
    """NCCL-style flat ring over n GPUs, seconds: within a node (n <= g) over ``intra``; across
    nodes every ring step pays the slower latency and the ring's bandwidth is the slower of the
    per-GPU intra-node and the per-node inter-node bandwidth (each node's NICs carry 2(n-1)/n S).
    ``bandwidth_factor`` (>= 1: slower) scales the bandwidth term."""
    lat, bw = _ring_link(n, gpus_per_node, intra, inter)
    return ring_allreduce_time(nbytes, n, lat, bw / bandwidth_factor)


def _ring_link(n: int, g: int, intra: Link, inter: Link) -> tuple[float, float]:
    """(latency s, bandwidth GB/s) of a flat ring over n GPUs, g per node: ``intra`` within
    a node; across nodes the slower latency and the lower bandwidth of the two links.

    Raises:
        ValueError: n < 1 or g < 1.
    """
    _check_topology(n, g)
    if n <= g:
        return intra.latency_s, intra.bandwidth_GBps
    return max(intra.latency_s, inter.latency_s), min(intra.bandwidth_GBps, inter.bandwidth_GBps)


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
        return flat_ring_time(nbytes, n, g, intra, inter, bandwidth_factor)
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
    lat, bw = _ring_link(n, gpus_per_node, intra, inter)
    return (n - 1) * lat + (n - 1) * part_bytes * bandwidth_factor / (bw * GB)


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
    with threshold 0, is an allreduce of its own). Returns the tensor sizes of each buffer: as
    many buffers as allreduces, for many equal small tensors ceil(total bytes / threshold)."""
    if threshold_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {threshold_bytes}")
    buffers: list[list[float]] = []
    for b in tensor_bytes:
        if buffers and sum(buffers[-1]) + b <= threshold_bytes:
            buffers[-1].append(b)
        else:
            buffers.append([b])
    return buffers


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
        backward_fraction: share of ``t_comp`` the early group's allreduce can overlap: the
            backward pass after the early gradients are ready (2/3: backward is twice the
            forward's FLOPs; ``python -m benchmarks multinode`` measures it,
            :func:`benchmarks.bench_multinode.measure_backward_window`).
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
    t = _cycle_s(cfg, n)
    for buf in fused_buffers(tensor_bytes, cfg.fusion_threshold_bytes):
        t += allreduce_time(cfg, sum(buf), n)
        if len(buf) > 1 and cfg.fusion_copy_GBps:
            t += 2 * sum(buf) / (cfg.fusion_copy_GBps * GB)
    return t


def _cycle_s(cfg: ScalingConfig, n: int) -> float:
    """What one background cycle (n > 1 GPUs) adds, s: half a cycle time on average, the
    framework's per-cycle overhead and, with ``negotiation``, the coordinator's bit-vector
    allreduce (2 ceil(log2 n) latencies of the slowest link in use)."""
    lat = max(cfg.intra.latency_s, cfg.inter.latency_s if n > cfg.gpus_per_node else 0.0)
    neg = 2 * math.ceil(math.log2(n)) * lat if cfg.negotiation else 0.0
    return cfg.cycle_time_s / 2 + cfg.per_cycle_overhead_s + neg


def _step(cfg: ScalingConfig, n: int, comm: float, exposed: float, **rest) -> dict:
    """:func:`step_time`'s dict from the communication (all of it, and the exposed part)."""
    tc, sync = cfg.compute_s, (cfg.sync_overhead_s if n > 1 else 0.0)
    t = tc + exposed + sync
    speedup = n * tc / t
    return {"n": n, "s_per_iter": t, "compute_s": tc, "comm_s": comm, "exposed_comm_s": exposed,
            "hidden_comm_s": comm - exposed, "sync_s": sync, "speedup": speedup,
            "efficiency": speedup / n, **rest}


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
    exposed = max(0.0, t_early - cfg.backward_fraction * tc) + t_late
    return _step(cfg, n, t_early + t_late, exposed,
                 overlappable_fraction=overlappable_fraction(cfg.params),
                 buffers=(len(fused_buffers(eb, cfg.fusion_threshold_bytes))
                          + len(fused_buffers(lb, cfg.fusion_threshold_bytes))) if n > 1 else 0)


def _onebit_step(cfg: ScalingConfig, n: int) -> dict:
    """:func:`step_time` in the compressed phase of 1-bit Adam / LAMB (see the module)."""
    numel = sum(m for _, m in cfg.params)
    comm = 0.0
    if n > 1:
        comm = (3 * _cycle_s(cfg, n)  # gradient-norm allreduce, alltoall, allgather: a cycle each
                + allreduce_time(cfg, 8, n)
                + onebit_allreduce_time(numel, n, cfg.gpus_per_node, cfg.intra, cfg.inter,
                                        cfg.onebit_chunk, cfg.bandwidth_factor))
        if cfg.fusion_copy_GBps:
            comm += ONEBIT_PASSES * 4 * numel / (cfg.fusion_copy_GBps * GB)
    return _step(cfg, n, comm, comm, overlappable_fraction=0.0, buffers=2 if n > 1 else 0)


def predict(cfg: ScalingConfig, gpus: Sequence[int] = (1, 8, 16, 32, 64, 128)) -> list[dict]:
    """:func:`step_time` for each GPU count."""
    return [step_time(cfg, n) for n in gpus]


# ---- calibration from `python -m benchmarks allreduce --json` ---------------------------------


