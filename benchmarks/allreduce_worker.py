"""One rank of ``python -m benchmarks allreduce`` (:mod:`benchmarks.bench_allreduce`, the driver,
launches it: ``python -m benchmarks.allreduce_worker --backend {mpi,torch_gloo,horovod} ...`` under
``mpirun`` or ``horovodrun``): times the collectives of one backend per message size and per
gradient group, and prints its records as one ``RESULT [...]`` JSON line (rank 0).

Here too are what the driver and the worker share: the message sizes (:func:`parse_size`,
:data:`DEFAULT_SIZES`), the gradient groups (:func:`group_tensor_numels`) and the bytes one rank
puts on the wire (:func:`wire_bytes`: ring allreduce 2(n-1)/n of the payload, fp16 half of it,
1-bit :meth:`hvd_lm.comm.onebit_compression.Layout.wire_bytes`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass

import psutil
import torch

from benchmarks.baselines import MpiComm, TorchGlooComm
from hvd_lm.comm import engine
from hvd_lm.comm.engine import (
    HOROVOD_DEFAULT_CYCLE_MS,
    HOROVOD_DEFAULT_FUSION_BYTES,
    ring_allreduce_wire_bytes,
)
from hvd_lm.comm.onebit_compression import (
    DEFAULT_CHUNK,
    ErrorFeedback,
    Layout,
    compressed_allreduce,
)
from hvd_lm.model.lm import mlstm_parameters
from hvd_lm.options import Command, option
from hvd_lm.util.units import KIB, parse_bytes

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
    if m := re.fullmatch(r"mlstm(\d+)", spec):
        return [numel for _, numel in mlstm_parameters(int(m.group(1)))]
    if m := re.fullmatch(r"synthetic(\d+)x(.+)", spec):
        return [parse_size(m.group(2)) // 4] * int(m.group(1))
    raise ValueError(f"unknown group {spec!r}: use mlstm<H> (e.g. mlstm1024) or "
                     "synthetic<N>x<size> (e.g. synthetic200x64k)")


# ---- settings -----------------------------------------------------------------------------------

@dataclass
class AllreduceWorkerConfig:
    """One rank (``python -m benchmarks.allreduce_worker FLAGS``)."""

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
    """Horovod's collectives (:mod:`hvd_lm.comm.engine`) behind the baselines' interface."""

    def __init__(self) -> None:
        ctx = engine.init()  # collective: init (knobs from the environment of this launch)
        self.rank, self.size = ctx.rank, ctx.size
        self.controller = engine.controller()
        #: name -> 1-bit error buffers (see :meth:`onebit_errors`)
        self.errors: dict[str, ErrorFeedback] = {}

    def onebit_errors(self, name: str, numel: int, chunk: int) -> None:
        """Create the error buffers the compressed allreduce ``name`` of ``numel`` values uses."""
        self.errors[name] = ErrorFeedback(Layout(numel, self.size, chunk), self.rank)

    def allreduce(self, t: torch.Tensor, compression: str = "none", name: str = "") -> None:
        """In-place sum-allreduce (fp16: cast around it, as ``Compression.fp16``); ``onebit``: the
        compressed allreduce (an average, with this tensor's error buffers, kept per name)."""
        if compression == "onebit":
            t.copy_(compressed_allreduce(t.view(-1), self.errors[name], name))
        else:
            engine.allreduce_inplace(t, name, "sum", compression)

    def allreduce_group(self, tensors: list[torch.Tensor], prefix: str = "bench.g",
                        compression: str = "none") -> None:
        """``allreduce_async_`` on each, then ``synchronize`` (as DistributedOptimizer)."""
        engine.allreduce_group(tensors, prefix, "average", compression)

    def max(self, x: float) -> float:
        """Maximum over ranks."""
        return engine.allreduce_max(x, "bench.max")

    def close(self) -> None:
        """Nothing to do."""


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
        coll.allreduce(flat, "none" if mode == "flat" else "onebit", f"{prefix}.flat")
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.view(-1).copy_(part)
    else:
        coll.allreduce_group(tensors, prefix, "fp16" if mode == "async+fp16" else "none")


def written_bytes() -> int | None:
    """This process's ``wchar`` from ``/proc/self/io`` (bytes handed to write/send system calls,
    sockets included; proc(5)) as psutil reads it (``io_counters().write_chars``), or None where
    there is no such file (not Linux) or it cannot be read."""
    try:
        return psutil.Process().io_counters().write_chars
    except (AttributeError, OSError, psutil.Error):
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
    coll = {"mpi": MpiComm, "torch_gloo": TorchGlooComm, "horovod": HorovodComm}[args.backend]()
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
            sec, wrote = _time(coll, lambda t=t, c=comp, m=name: coll.allreduce(t, c, m), k,
                               args.warmup)
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


WORKER = Command(AllreduceWorkerConfig, worker, config_flag=False)


if __name__ == "__main__":  # one rank of a run: python -m benchmarks.allreduce_worker FLAGS
    sys.exit(WORKER.main(None, "python -m benchmarks.allreduce_worker"))
