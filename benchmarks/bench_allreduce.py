"""``python -m benchmarks allreduce`` and ``python -m benchmarks fusion``: the collective layer
measured on its own.

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

and 1-bit compression (``--compression onebit``): ``onebit_compression.compressed_allreduce``
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
:func:`benchmarks.calibration.calibrate_from_bench` reads Horovod's overhead over raw MPI
from it; :mod:`benchmarks.results` owns the records, the JSON file and the fit. Workers (one
per rank): :mod:`benchmarks.allreduce_worker`.
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass

from benchmarks.allreduce_report import print_report, wire_summary
from benchmarks.allreduce_worker import (
    DEFAULT_GROUPS,
    DEFAULT_SIZES,
    AllreduceWorkerConfig,
    parse_size,
    parse_sizes,
)
from benchmarks.harness import host, run_child, save_json
from benchmarks.results import derive, fit_records, median_over_repeats, ratios_to_mpi
from hvd_lm import options
from hvd_lm.comm.engine import HOROVOD_DEFAULT_CYCLE_MS, HOROVOD_DEFAULT_FUSION_BYTES
from hvd_lm.comm.hosts import parse_hosts
from hvd_lm.comm.onebit_compression import DEFAULT_CHUNK
from hvd_lm.jobs.job_scripts import horovodrun_argv, local_mpi_env, mpirun_argv
from hvd_lm.options import Command, option
from hvd_lm.util.units import MIB

# ---- settings -----------------------------------------------------------------------------------

@dataclass
class AllreduceConfig:
    """``python -m benchmarks allreduce``."""

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


# ---- driver -------------------------------------------------------------------------------------

def configurations(args: AllreduceConfig) -> list[dict]:
    """The launches of one ``bench allreduce`` run: raw MPI, torch gloo, Horovod per controller at
    its defaults, then the MPI controller at each other fusion threshold / cycle time (those only
    up to ``--variant-max-size``: they matter for small messages and for the grouped case)."""
    confs = [{"label": label, "backend": backend, "launcher": "mpirun", "env": {}}
             for label, backend in (("mpi4py", "mpi"), ("torch-gloo", "torch_gloo"))
             if backend in args.backends]
    if "horovod" in args.backends:
        ctl = "mpi" if "mpi" in args.controllers else args.controllers[0]
        knobs = [(f" fusion={mb:g}MB", {"HOROVOD_FUSION_THRESHOLD": str(int(mb * MIB))})
                 for mb in args.fusion_mb if int(mb * MIB) != HOROVOD_DEFAULT_FUSION_BYTES]
        knobs += [(f" cycle={ms:g}ms", {"HOROVOD_CYCLE_TIME": f"{ms:g}"})
                  for ms in args.cycle_ms if ms != HOROVOD_DEFAULT_CYCLE_MS]
        for c, name, env in [(c, "", {}) for c in args.controllers] + [(ctl, *k) for k in knobs]:
            confs.append({"label": f"hvd-{c}{name}", "backend": "horovod",
                          "launcher": "mpirun" if c == "mpi" else "horovodrun",
                          "variant": bool(name),
                          "env": env | ({"HOROVOD_CONTROLLER": c} if c == "mpi" else {})})
    return confs


def run_allreduce_bench(args: AllreduceConfig) -> dict:
    """Launch every configuration (see :func:`configurations`), ``--repeats`` times round robin
    (drift on a shared machine then hits every configuration alike), and collect the records,
    each the median over the repeats (:func:`median_over_repeats`)."""
    sizes = parse_sizes(args.sizes) if args.sizes else list(DEFAULT_SIZES)
    if args.max_size:
        sizes = [s for s in sizes if s <= parse_size(args.max_size)]
    if not sizes:
        raise ValueError("no message sizes left (check --sizes / --max-size)")
    variant_sizes = [s for s in sizes if s <= parse_size(args.variant_max_size)] or sizes[:1]
    # one thread per rank, OpenMPI as root / in containers, ranks yielding the cores when idle
    # (local_mpi_env); every configuration states its own Horovod knobs
    base_env = {k: v for k, v in local_mpi_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
                .items() if k not in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME",
                                      "HOROVOD_AUTOTUNE")}
    records = []
    for rep in range(args.repeats):
        for conf in configurations(args):
            szs = variant_sizes if conf.get("variant") else sizes
            wcfg = AllreduceWorkerConfig(conf["backend"], ",".join(map(str, szs)), args.iters,
                                         args.warmup, list(args.compressions),
                                         args.onebit_chunk, list(args.groups))
            argv = ["-m", "benchmarks.allreduce_worker", *options.to_argv(wcfg)]
            extra = dict(conf["env"])
            if conf["backend"] == "torch_gloo":
                extra.update(MASTER_PORT=str(args.port),
                             GLOO_SOCKET_IFNAME=args.network_interface or "lo")
                if args.hosts:
                    extra["MASTER_ADDR"] = socket.gethostbyname(parse_hosts(args.hosts)[0][0])
            env = base_env | extra
            cmd = (mpirun_argv(args.np, argv, args.hosts, args.network_interface, env)
                   if conf["launcher"] == "mpirun"
                   else horovodrun_argv(args.np, argv, "gloo", args.hosts,
                                        args.network_interface))
            t0 = time.perf_counter()
            recs = run_child(cmd, args.timeout, env, "RESULT ", count=1)[0]
            print(f"  {conf['label']} (repeat {rep}): {len(recs)} records in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            for r in recs:
                comp = r.get("compression", "none")
                r["label"] = conf["label"] + (f"+{comp}" if comp != "none" else "")
            records += recs
    records = median_over_repeats(records)
    derive(records)
    return {"ranks": args.np, "hosts": args.hosts or None, "repeats": args.repeats,
            "sizes": sizes, "records": records, "fits": fit_records(records),
            "wire": wire_summary(records), "ratios_to_mpi": ratios_to_mpi(records),
            "horovod_defaults": {"fusion_threshold_bytes": HOROVOD_DEFAULT_FUSION_BYTES,
                                 "cycle_time_ms": HOROVOD_DEFAULT_CYCLE_MS},
            "host": host(), "args": options.to_dict(args)}


def bench_allreduce(args: AllreduceConfig) -> int:
    """Run, print the tables, and with ``--json`` save.

    Raises:
        RuntimeError: a launch failed (:func:`benchmarks.harness.run_child`);
            subprocess.TimeoutExpired; ValueError: bad sizes or groups.
    """
    data = run_allreduce_bench(args)
    print_report(data)
    save_json(args.json, data)
    return 0

# ---- command line -------------------------------------------------------------------------------

BENCH_ALLREDUCE = Command(AllreduceConfig, bench_allreduce,
                          description="Allreduce latency and bandwidth, 4 KiB - 256 MiB and "
                          "grouped gradients: Horovod (MPI and Gloo controllers, fp16, fusion "
                          "threshold, cycle time) vs raw MPI (mpi4py) vs torch.distributed gloo.")
