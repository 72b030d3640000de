"""``hvd-lm bench allreduce`` and ``hvd-lm bench fusion``: the collective layer measured on its own.

``bench allreduce`` times, in one run (so that a shared, noisy machine affects every figure alike),
an in-place sum-allreduce of one float32 tensor per message size (4 KiB to 256 MiB, powers of 4 by
default) with

* raw MPI: mpi4py ``Comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)`` under ``mpirun``;
* ``torch.distributed`` with the gloo backend (``all_reduce``) under ``mpirun``;
* Horovod (``hvd.allreduce_``) with the MPI controller (``mpirun`` + ``HOROVOD_CONTROLLER=mpi``,
  what ``horovodrun --mpi`` does) and the Gloo controller (``horovodrun --gloo``), each with
  compression none and fp16 (``hvd.Compression.fp16``: cast to float16 before and back after, as
  ``DistributedOptimizer`` does), at Horovod's defaults (``HOROVOD_FUSION_THRESHOLD`` 128 MiB,
  ``HOROVOD_CYCLE_TIME`` 1 ms in 0.28.1) and, for the MPI controller, at each other fusion
  threshold and cycle time asked for (Horovod docs: "Tensor Fusion");

and 1-bit compression (``--compression onebit``): :func:`hvd_lm.comm.horovod.compressed_allreduce`
(Tang et al. 2021: sign bits packed 8 per byte plus one fp32 scale per ``--onebit-chunk`` values,
``hvd.alltoall`` + ``hvd.allgather``, error feedback) of the same float32 tensor, its time including
the compression arithmetic;

and a *grouped* case, closer to training: a list of gradient tensors allreduced together per step
(``hvd.allreduce_async_`` on each, then ``hvd.synchronize`` on each, op Average: what
``hvd.DistributedOptimizer`` does), for the mLSTM's own parameter list
(:class:`hvd_lm.model.lm.LanguageModel`, e.g. hidden size 1024: 8 tensors, 23.4 MB) and a synthetic
200 x 64 KiB set, where tensor fusion decides how many allreduces are issued. Raw MPI and
torch.distributed run the same groups twice: one allreduce per tensor, and one allreduce of a
flat buffer packed and unpacked around it (ideal fusion); with ``onebit`` Horovod also runs the
group as one flat compressed allreduce (mode ``onebit``: what 1-bit Adam sends per step).

**Bytes on the wire** per operation and rank, for every Horovod record: ``wire_bytes`` from the
buffers handed to the collectives (ring allreduce 2(n-1)/n of the payload, fp16 half of it; 1-bit:
:meth:`hvd_lm.comm.onebit_compression.Layout.wire_bytes`) and, with the Gloo controller
(``horovodrun
--gloo``: every byte goes through a TCP socket), ``wire_bytes_measured``: the growth of the rank's
``wchar`` in ``/proc/self/io`` (bytes passed to write/send system calls) over the timed loop,
per operation. The report prints both, and none/fp16 over onebit side by side.

Reported per size: mean time per operation (max over ranks; with ``--repeats R`` the median of R
launches run round robin), algorithm bandwidth
``algbw = S / t`` and bus bandwidth ``busbw = algbw x 2(n-1)/n`` in GB/s (1e9 bytes/s), as
nccl-tests define them (nccl-tests ``doc/PERFORMANCE.md``); S is the float32 payload, also for
fp16 compression (which puts S/2 on the wire). Then, per size, the ratio of each Horovod
configuration's time to raw MPI's, and a least-squares alpha-beta fit per configuration
(Hockney's model; for the ring algorithm t = 2(n-1) alpha + 2(n-1)/n S/beta, Thakur et al. 2005,
"Optimization of collective communication operations in MPICH"). ``--json FILE`` saves it all;
:func:`hvd_lm.perf.calibration.calibrate_from_bench` reads Horovod's overhead over raw MPI from it;
:mod:`hvd_lm.perf.results` owns the records, the JSON file and the fit. Workers: ``python -m
hvd_lm.perf.bench_allreduce --backend {mpi,torch_gloo,horovod} ...``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from hvd_lm import comm, options
from hvd_lm.comm.horovod import HOROVOD_DEFAULT_CYCLE_MS, HOROVOD_DEFAULT_FUSION_BYTES
from hvd_lm.comm.hosts import parse_hosts
from hvd_lm.comm.onebit_compression import (
    DEFAULT_CHUNK,
    ErrorFeedback,
    Layout,
    ring_allreduce_wire_bytes,
)
from hvd_lm.comm.world import horovodrun_argv, local_mpi_env, mpirun_argv
from hvd_lm.model.lm import mlstm_parameters
from hvd_lm.options import Command, option
from hvd_lm.perf.allreduce_report import print_report, wire_summary
from hvd_lm.perf.baselines import MpiComm, TorchGlooComm
from hvd_lm.perf.results import derive, fit_records, median_over_repeats, ratios_to_mpi
from hvd_lm.util.atomic import write_text
from hvd_lm.util.units import KIB, MIB, parse_bytes

DEFAULT_SIZES = [4 * KIB * 4 ** i for i in range(9)]  # 4 KiB, 16 KiB, ..., 256 MiB
DEFAULT_GROUPS = ("mlstm1024", "synthetic200x64k")


# ---- small helpers ------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"4096"``, ``"4K"``, ``"64KiB"``, ``"1M"``, ``"256MB"`` -> bytes (K/M/G are powers of 1024;
    :func:`hvd_lm.util.units.parse_bytes`), a whole number of float32 elements.

    Raises:
        ValueError: not a positive size, or not a multiple of 4 bytes.
    """
    value = parse_bytes(text)
    if value <= 0 or value % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return value


def parse_sizes(text: str) -> list[int]:
    """Comma-separated sizes (see :func:`parse_size`) -> sorted unique bytes."""
    return sorted({parse_size(s) for s in text.split(",") if s.strip()})


def iters_for(size: int, iters: int, budget_bytes: int = 1 << 30) -> int:
    """Timed iterations for a message of ``size`` bytes: ``iters``, fewer for big messages so that
    each size moves at most ``budget_bytes`` (at least 3)."""
    return max(3, min(iters, budget_bytes // max(size, 1)))


def group_tensor_numels(spec: str) -> list[int]:
    """Element counts (float32) of a named gradient group.

    ``mlstm<H>`` (e.g. ``mlstm1024``): the parameter list of ``LanguageModel(ModelConfig(
    hidden_size=H, embed_dim=64))`` in registration order; ``synthetic<N>x<size>`` (e.g.
    ``synthetic200x64k``): N tensors of ``size`` bytes.

    Raises:
        ValueError: unknown spec.
    """
    m = re.fullmatch(r"mlstm(\d+)", spec)
    if m:
        return [numel for _, numel in mlstm_parameters(int(m.group(1)))]
    m = re.fullmatch(r"synthetic(\d+)x(.+)", spec)
    if m:
        return [parse_size(m.group(2)) // 4] * int(m.group(1))
    raise ValueError(f"unknown group {spec!r}: use mlstm<H> (e.g. mlstm1024) or "
                     "synthetic<N>x<size> (e.g. synthetic200x64k)")


# ---- settings -----------------------------------------------------------------------------------

@dataclass
class AllreduceConfig:
    """``hvd-lm bench allreduce``."""

    np: int = option(2, "ranks", ge=1)
    sizes: str = option("", "message sizes, e.g. 4K,64K,1M (default: 4K to 256M, powers of 4)")
    max_size: str = option("", "drop sizes above this (quick runs), e.g. 4M")
    iters: int = option(20, "timed iterations per size (fewer for big sizes: at most 1 GiB "
                        "moved per size, at least 3)", ge=1)
    warmup: int = option(2, "untimed iterations first", ge=0)
    repeats: int = option(1, "launches per configuration (round robin); each figure is the "
                          "median", ge=1)
    backends: list[str] = option(default_factory=lambda: ["mpi", "torch_gloo", "horovod"],
                                 help="who allreduces", choices=("mpi", "torch_gloo", "horovod"))
    controllers: list[str] = option(default_factory=lambda: ["mpi", "gloo"],
                                    help="Horovod controllers", choices=("mpi", "gloo"))
    compressions: list[str] = option(default_factory=lambda: ["none", "fp16"],
                                     help="Horovod compressions (onebit: 1-bit compressed "
                                     "allreduce with error feedback)",
                                     choices=("none", "fp16", "onebit"),
                                     aliases=("--compression",))
    onebit_chunk: int = option(DEFAULT_CHUNK, "onebit: values per fp32 scale (0 = one per "
                               "rank's part)", ge=0)
    fusion_mb: list[float] = option(default_factory=lambda: [0.0, 64.0], help="extra "
                                    "HOROVOD_FUSION_THRESHOLD values, MiB (MPI controller; the "
                                    "default 128 MiB always runs)", ge=0)
    cycle_ms: list[float] = option(default_factory=lambda: [0.2, 5.0], help="extra "
                                   "HOROVOD_CYCLE_TIME values, ms (MPI controller; the default "
                                   "1 ms always runs)", gt=0)
    variant_max_size: str = option("4M", "largest single-tensor size for the fusion/cycle "
                                   "variants")
    groups: list[str] = option(default_factory=lambda: list(DEFAULT_GROUPS), help="grouped "
                               "cases: mlstm<H>, synthetic<N>x<size>; empty for none")
    hosts: str = option("", "run across these hosts, host:slots,... as horovodrun -H takes "
                        "them (slots must add up to --np; default: this machine)")
    network_interface: str = option("", "with --hosts: the interface between them (what "
                                    "`hvd-lm doctor` picks), for Horovod, OpenMPI and Gloo")
    port: int = option(29533, "torch.distributed MASTER_PORT", ge=1, le=65535)
    timeout: float = option(600.0, "per-launch limit, s", gt=0)
    json: str = option("", "write the results here")


@dataclass
class AllreduceWorkerConfig:
    """One rank (``python -m hvd_lm.perf.bench_allreduce FLAGS``)."""

    backend: str = option("horovod", "who allreduces", choices=("mpi", "torch_gloo", "horovod"))
    sizes: str = option("", "message sizes, bytes, comma-separated")
    iters: int = option(20, "timed iterations per size", ge=1)
    warmup: int = option(2, "untimed iterations first", ge=0)
    compressions: list[str] = option(default_factory=lambda: ["none", "fp16"],
                                     help="Horovod compressions",
                                     choices=("none", "fp16", "onebit"))
    onebit_chunk: int = option(DEFAULT_CHUNK, "onebit: values per fp32 scale", ge=0)
    groups: list[str] = option(default_factory=list, help="grouped cases")


# ---- worker (one rank) --------------------------------------------------------------------------

class HorovodComm:
    """Horovod's collectives (:mod:`hvd_lm.comm.horovod`) behind the baselines' interface."""

    def __init__(self) -> None:
        ctx = comm.init()  # Horovod: init (knobs from the environment of this launch)
        self.rank, self.size = ctx.rank, ctx.size
        self.controller = comm.controller()
        #: name -> 1-bit error buffers (see :meth:`onebit_errors`)
        self.errors: dict[str, ErrorFeedback] = {}

    def onebit_errors(self, name: str, numel: int, chunk: int) -> None:
        """Create the error buffers the compressed allreduce ``name`` of ``numel`` values uses."""
        self.errors[name] = ErrorFeedback(Layout(numel, self.size, chunk), self.rank)

    def allreduce(self, t: torch.Tensor, compression: str = "none", name: str = "") -> None:
        """In-place sum-allreduce (fp16: cast around it, as ``Compression.fp16``); ``onebit``: the
        compressed allreduce (an average, with this tensor's error buffers, kept per name)."""
        if compression == "onebit":
            t.copy_(comm.compressed_allreduce(t.view(-1), self.errors[name], name))
        else:
            comm.allreduce_inplace(t, name, "sum", compression)

    def allreduce_group(self, tensors: list[torch.Tensor], prefix: str = "bench.g",
                        compression: str = "none") -> None:
        """``allreduce_async_`` on each, then ``synchronize`` (as DistributedOptimizer)."""
        comm.allreduce_group(tensors, prefix, "average", compression)

    def max(self, x: float) -> float:
        """Maximum over ranks."""
        return comm.allreduce_max(x, "bench.max")

    def close(self) -> None:
        """Nothing to do."""


def make_comm(backend: str):
    """The communicator of ``backend``: raw MPI or torch gloo (:mod:`hvd_lm.perf.baselines`) or
    Horovod (:class:`HorovodComm`).

    Raises:
        ValueError: unknown backend.
    """
    if backend == "mpi":
        return MpiComm()
    if backend == "torch_gloo":
        return TorchGlooComm()
    if backend == "horovod":
        return HorovodComm()
    raise ValueError(f"unknown backend {backend!r}")


def _single(coll, t: torch.Tensor, compression: str, name: str) -> None:
    if isinstance(coll, HorovodComm):
        coll.allreduce(t, compression, name)
    else:
        coll.allreduce(t)


def _bytes(comp: str, numel: int, n: int, args, measured: bool, wrote: float | None) -> dict:
    """The record's bytes on the wire per operation: computed, and measured when ``measured``."""
    return {"wire_bytes": wire_bytes(comp, numel, n, args.onebit_chunk),
            "wire_bytes_measured": wrote if measured else None}


def _grouped(coll, tensors: list[torch.Tensor], mode: str, flat: torch.Tensor,
             prefix: str) -> None:
    """``async``: each tensor issued together, then waited for (``async+fp16``: cast to fp16
    around it); ``flat``: packed into one buffer, one allreduce, unpacked (ideal fusion);
    ``onebit``: packed, one compressed allreduce (1-bit Adam's momentum exchange), unpacked."""
    if mode in ("flat", "onebit"):
        torch.cat([t.view(-1) for t in tensors], out=flat)
        _single(coll, flat, "none" if mode == "flat" else "onebit", f"{prefix}.flat")
        off = 0
        for t in tensors:
            t.view(-1).copy_(flat[off:off + t.numel()])
            off += t.numel()
    elif isinstance(coll, HorovodComm):
        coll.allreduce_group(tensors, prefix, "fp16" if mode == "async+fp16" else "none")
    else:
        coll.allreduce_group(tensors)


def written_bytes() -> int | None:
    """This process's ``wchar`` from ``/proc/self/io`` (bytes handed to write/send system calls,
    sockets included; proc(5)), or None where there is no such file."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _time(coll, fn, iters: int, warmup: int) -> tuple[float, float | None]:
    """(mean seconds per call of ``fn`` over ``iters`` calls after ``warmup``, max over ranks;
    this rank's written bytes per call over the same calls, or None)."""
    for _ in range(warmup):
        fn()
    coll.max(0.0)  # barrier
    w0 = written_bytes()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sec = time.perf_counter() - t0
    w1 = written_bytes()
    return coll.max(sec / iters), (None if w0 is None or w1 is None else (w1 - w0) / iters)


def wire_bytes(compression: str, numel: int, n: int, chunk: int) -> int:
    """Bytes one rank sends per operation on ``numel`` float32 values: ring allreduce (fp16: 2
    bytes per value) or the 1-bit compressed allreduce."""
    if compression == "onebit":
        return Layout(numel, n, chunk).wire_bytes()
    return ring_allreduce_wire_bytes(numel * (2 if compression == "fp16" else 4), n)


def worker(args: AllreduceWorkerConfig) -> int:
    """Time every size and group on this rank's backend; rank 0 prints ``RESULT [records]``."""
    torch.set_num_threads(1)
    coll = make_comm(args.backend)
    n = coll.size
    base = {"backend": args.backend, "ranks": n}
    if args.backend == "horovod":
        base |= {"controller": coll.controller,
                 "fusion_threshold_bytes": int(os.environ.get("HOROVOD_FUSION_THRESHOLD",
                                                              HOROVOD_DEFAULT_FUSION_BYTES)),
                 "cycle_time_ms": float(os.environ.get("HOROVOD_CYCLE_TIME",
                                                       HOROVOD_DEFAULT_CYCLE_MS))}
    compressions = list(args.compressions) if args.backend == "horovod" else ["none"]
    records = []
    measured = args.backend == "horovod" and coll.controller == "gloo"  # all traffic via TCP
    for size in parse_sizes(args.sizes) if args.sizes else []:
        t = torch.randn(size // 4, generator=torch.Generator().manual_seed(coll.rank))
        k = iters_for(size, args.iters)
        for comp in compressions:
            name = f"bench.s{size}.{comp}"
            if comp == "onebit":
                coll.onebit_errors(name, t.numel(), args.onebit_chunk)
            sec, wrote = _time(coll, lambda t=t, comp=comp, name=name: _single(coll, t, comp, name),
                               k, args.warmup)
            records.append(base | {"case": "single", "compression": comp, "size_bytes": size,
                                   "iters": k, "time_s": sec}
                           | _bytes(comp, t.numel(), n, args, measured, wrote))
        del t
    for spec in args.groups:
        numels = group_tensor_numels(spec)
        tensors = [torch.zeros(m) for m in numels]
        total = 4 * sum(numels)
        flat = torch.zeros(sum(numels))
        k = iters_for(total, args.iters)
        modes = ["async"] if args.backend == "horovod" else ["async", "flat"]
        if args.backend == "horovod" and "fp16" in compressions and "onebit" in compressions:
            modes.append("async+fp16")  # the fp16 baseline of the per-step byte comparison
        if args.backend == "horovod" and "onebit" in compressions:
            modes.append("onebit")
            coll.onebit_errors(f"bench.{spec}.flat", flat.numel(), args.onebit_chunk)
        for mode in modes:
            sec, wrote = _time(coll, lambda: _grouped(coll, tensors, mode, flat, f"bench.{spec}"),
                               k, args.warmup)
            comp = {"onebit": "onebit", "async+fp16": "fp16"}.get(mode, "none")
            records.append(base | {"case": "grouped", "group": spec, "mode": mode,
                                   "tensors": len(numels), "compression": comp,
                                   "size_bytes": total, "iters": k, "time_s": sec}
                           | (_bytes(comp, flat.numel(), n, args, measured, wrote)
                              if args.backend == "horovod" else {}))
    if coll.rank == 0:
        print("RESULT " + json.dumps(records), flush=True)
    coll.close()
    return 0


# ---- driver -------------------------------------------------------------------------------------

def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Launch environment: one thread per rank, OpenMPI as root / in containers, ranks yielding
    the cores when idle (:func:`hvd_lm.comm.world.local_mpi_env`); every configuration states
    its own Horovod knobs."""
    env = local_mpi_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    for k in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_AUTOTUNE"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def _run_worker(cmd: list[str], env: dict, timeout: float) -> list[dict]:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:  # horovodrun prefixes rank output with "[0]<stdout>:"
            return json.loads(line[line.index("RESULT ") + 7:])
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-3000:]}")


def configurations(args: AllreduceConfig) -> list[dict]:
    """The launches of one ``bench allreduce`` run: raw MPI, torch gloo, Horovod per controller at
    its defaults, then the MPI controller at each other fusion threshold / cycle time (those only
    up to ``--variant-max-size``: they matter for small messages and for the grouped case)."""
    backends = list(args.backends)
    confs = []
    if "mpi" in backends:
        confs.append({"label": "mpi4py", "backend": "mpi", "launcher": "mpirun", "env": {}})
    if "torch_gloo" in backends:
        confs.append({"label": "torch-gloo", "backend": "torch_gloo", "launcher": "mpirun",
                      "env": {}})
    if "horovod" in backends:
        for ctl in args.controllers:
            confs.append({"label": f"hvd-{ctl}", "backend": "horovod",
                          "launcher": "mpirun" if ctl == "mpi" else "horovodrun",
                          "env": {"HOROVOD_CONTROLLER": ctl} if ctl == "mpi" else {}})
        ctl = "mpi" if "mpi" in args.controllers else args.controllers[0]
        for mb in args.fusion_mb:
            if int(mb * MIB) != HOROVOD_DEFAULT_FUSION_BYTES:
                confs.append({"label": f"hvd-{ctl} fusion={mb:g}MB", "backend": "horovod",
                              "launcher": "mpirun" if ctl == "mpi" else "horovodrun",
                              "variant": True,
                              "env": {"HOROVOD_FUSION_THRESHOLD": str(int(mb * MIB))}
                              | ({"HOROVOD_CONTROLLER": ctl} if ctl == "mpi" else {})})
        for ms in args.cycle_ms:
            if ms != HOROVOD_DEFAULT_CYCLE_MS:
                confs.append({"label": f"hvd-{ctl} cycle={ms:g}ms", "backend": "horovod",
                              "launcher": "mpirun" if ctl == "mpi" else "horovodrun",
                              "variant": True, "env": {"HOROVOD_CYCLE_TIME": f"{ms:g}"}
                              | ({"HOROVOD_CONTROLLER": ctl} if ctl == "mpi" else {})})
    return confs


def _sizes(args: AllreduceConfig) -> list[int]:
    sizes = parse_sizes(args.sizes) if args.sizes else list(DEFAULT_SIZES)
    if args.max_size:
        sizes = [s for s in sizes if s <= parse_size(args.max_size)]
    if not sizes:
        raise ValueError("no message sizes left (check --sizes / --max-size)")
    return sizes


def run_allreduce_bench(args: AllreduceConfig) -> dict:
    """Launch every configuration (see :func:`configurations`), ``--repeats`` times round robin
    (drift on a shared machine then hits every configuration alike), and collect the records,
    each the median over the repeats (:func:`median_over_repeats`)."""
    sizes = _sizes(args)
    variant_sizes = [s for s in sizes if s <= parse_size(args.variant_max_size)] or sizes[:1]
    records = []
    for rep in range(args.repeats):
        for conf in configurations(args):
            szs = variant_sizes if conf.get("variant") else sizes
            wcfg = AllreduceWorkerConfig(conf["backend"], ",".join(map(str, szs)), args.iters,
                                         args.warmup, list(args.compressions),
                                         args.onebit_chunk, list(args.groups))
            argv = ["-m", "hvd_lm.perf.bench_allreduce", *options.to_argv(wcfg)]
            extra = dict(conf["env"])
            if conf["backend"] == "torch_gloo":
                extra.update(MASTER_PORT=str(args.port),
                             GLOO_SOCKET_IFNAME=args.network_interface or "lo")
                if args.hosts:
                    extra["MASTER_ADDR"] = socket.gethostbyname(parse_hosts(args.hosts)[0][0])
            env = _env(extra)
            cmd = (mpirun_argv(args.np, argv, args.hosts, args.network_interface, env)
                   if conf["launcher"] == "mpirun"
                   else horovodrun_argv(args.np, argv, "gloo", args.hosts,
                                        args.network_interface))
            t0 = time.perf_counter()
            recs = _run_worker(cmd, env, args.timeout)
            print(f"  {conf['label']} (repeat {rep}): {len(recs)} records in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            for r in recs:
                comp = r.get("compression", "none")
                r["label"] = conf["label"] + (f"+{comp}" if comp != "none" else "")
            records += recs
    records = median_over_repeats(records)
    derive(records)
    return {"ranks": args.np, "hosts": args.hosts or None, "repeats": args.repeats,
            "sizes": sizes, "records": records,
            "fits": fit_records(records),
            "wire": wire_summary(records),
            "ratios_to_mpi": ratios_to_mpi(records),
            "horovod_defaults": {"fusion_threshold_bytes": HOROVOD_DEFAULT_FUSION_BYTES,
                                 "cycle_time_ms": HOROVOD_DEFAULT_CYCLE_MS},
            "host": {"cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0]},
            "args": options.to_dict(args)}


def bench_allreduce(args: AllreduceConfig) -> int:
    """Run, print the tables, and with ``--json`` save; 1 with one ``ERROR:`` line when a
    launch fails."""
    try:
        data = run_allreduce_bench(args)
    except (ValueError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"hvd-lm bench allreduce: ERROR: {e}", file=sys.stderr)
        return 1
    print_report(data)
    if args.json:
        write_text(args.json, json.dumps(data, indent=2))
    return 0


# ---- command line -------------------------------------------------------------------------------

BENCH_ALLREDUCE = Command(AllreduceConfig, bench_allreduce,
                          description="Allreduce latency and bandwidth, 4 KiB - 256 MiB and "
                          "grouped gradients: Horovod (MPI and Gloo controllers, fp16, fusion "
                          "threshold, cycle time) vs raw MPI (mpi4py) vs torch.distributed gloo.")
WORKER = Command(AllreduceWorkerConfig, worker, config_flag=False)


if __name__ == "__main__":  # one rank of a run: python -m hvd_lm.perf.bench_allreduce FLAGS
    sys.exit(WORKER.main(None, "python -m hvd_lm.perf.bench_allreduce"))
