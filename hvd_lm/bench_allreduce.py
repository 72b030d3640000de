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

and a *grouped* case, closer to training: a list of gradient tensors allreduced together per step
(``hvd.allreduce_async_`` on each, then ``hvd.synchronize`` on each, op Average: what
``hvd.DistributedOptimizer`` does), for the mLSTM's own parameter list
(:class:`hvd_lm.model.LanguageModel`, e.g. hidden size 1024: 8 tensors, 23.4 MB) and a synthetic
200 x 64 KiB set, where tensor fusion decides how many allreduces are issued. Raw MPI and
torch.distributed run the same groups twice: one allreduce per tensor, and one allreduce of a
flat buffer packed and unpacked around it (ideal fusion).

Reported per size: mean time per operation (max over ranks; with ``--repeats R`` the median of R
launches run round robin), algorithm bandwidth
``algbw = S / t`` and bus bandwidth ``busbw = algbw x 2(n-1)/n`` in GB/s (1e9 bytes/s), as
nccl-tests define them (nccl-tests ``doc/PERFORMANCE.md``); S is the float32 payload, also for
fp16 compression (which puts S/2 on the wire). Then, per size, the ratio of each Horovod
configuration's time to raw MPI's, and a least-squares alpha-beta fit per configuration
(Hockney's model; for the ring algorithm t = 2(n-1) alpha + 2(n-1)/n S/beta, Thakur et al. 2005,
"Optimization of collective communication operations in MPICH"). ``--json FILE`` saves it all;
:func:`hvd_lm.scaling_model.calibrate_from_bench` reads Horovod's overhead over raw MPI from it.

``bench fusion`` sweeps ``HOROVOD_FUSION_THRESHOLD`` and ``HOROVOD_CYCLE_TIME`` on the training
benchmark of :mod:`hvd_lm.bench` (its worker, under ``mpirun -np N``), then runs it with
``HOROVOD_AUTOTUNE=1`` (Horovod docs: "Autotune") and reads the chosen values from
``HOROVOD_AUTOTUNE_LOG``.

Workers: ``python -m hvd_lm.bench_allreduce worker --backend {mpi,torch_gloo,horovod} ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9
KIB, MIB = 1024, 1024 * 1024
#: Horovod 0.28.1's defaults (horovod/common/operations.cc): fusion threshold, bytes; cycle, ms.
HOROVOD_DEFAULT_FUSION_BYTES = 128 * MIB
HOROVOD_DEFAULT_CYCLE_MS = 1.0
DEFAULT_SIZES = [4 * KIB * 4 ** i for i in range(9)]  # 4 KiB, 16 KiB, ..., 256 MiB
DEFAULT_GROUPS = "mlstm1024,synthetic200x64k"


# ---- small helpers ------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"4096"``, ``"4K"``, ``"64KiB"``, ``"1M"``, ``"256MB"`` -> bytes (K/M/G are powers of 1024).

    Raises:
        ValueError: not a positive size, or not a whole number of float32 elements.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 64K, 1M, 256MB)")
    value = float(m.group(1)) * {"": 1, "k": KIB, "m": MIB, "g": 1024 * MIB}[m.group(2)]
    if value <= 0 or value != int(value) or int(value) % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """Comma-separated sizes (see :func:`parse_size`) -> sorted unique bytes."""
    return sorted({parse_size(s) for s in text.split(",") if s.strip()})


def human_bytes(n: float) -> str:
    """4096 -> ``"4K"``, 268435456 -> ``"256M"`` (binary prefixes, as the sizes are given)."""
    for unit, div in (("G", 1024 ** 3), ("M", MIB), ("K", KIB)):
        if n >= div and n % div == 0:
            return f"{n // div:d}{unit}"
    return f"{n:.0f}"


def busbw_factor(n: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor 2(n-1)/n (n ranks)."""
    if n < 1:
        raise ValueError(f"rank count must be >= 1, got {n}")
    return 2 * (n - 1) / n


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
        from hvd_lm.scaling_model import mlstm_parameters

        return [numel for _, numel in mlstm_parameters(int(m.group(1)))]
    m = re.fullmatch(r"synthetic(\d+)x(.+)", spec)
    if m:
        return [parse_size(m.group(2)) // 4] * int(m.group(1))
    raise ValueError(f"unknown group {spec!r}: use mlstm<H> (e.g. mlstm1024) or "
                     "synthetic<N>x<size> (e.g. synthetic200x64k)")


# ---- worker (one rank) --------------------------------------------------------------------------

class _Comm:
    """The three backends behind one interface: ``allreduce(t)`` in place (sum), grouped variants,
    ``max(x)`` across ranks (used after timing), ``barrier()``."""

    def __init__(self, backend: str):
        import torch

        self.backend = backend
        self.torch = torch
        if backend == "mpi":
            from mpi4py import MPI

            self.MPI, self.comm = MPI, MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        elif backend == "torch_gloo":
            import torch.distributed as tdist

            self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0)))
            self.size = int(os.environ.get("OMPI_COMM_WORLD_SIZE",
                                           os.environ.get("WORLD_SIZE", 1)))
            tdist.init_process_group("gloo", rank=self.rank, world_size=self.size)
            self.tdist = tdist
        elif backend == "horovod":
            import horovod.torch as hvd

            hvd.init()
            self.hvd = hvd
            self.rank, self.size = hvd.rank(), hvd.size()
            self.controller = "mpi" if hvd.mpi_enabled() else "gloo"
        else:
            raise ValueError(f"unknown backend {backend!r}")

    def barrier(self) -> None:
        self.max(0.0)

    def max(self, x: float) -> float:
        if self.backend == "mpi":
            return self.comm.allreduce(x, op=self.MPI.MAX)
        t = self.torch.tensor([x], dtype=self.torch.float64)
        if self.backend == "torch_gloo":
            self.tdist.all_reduce(t, op=self.tdist.ReduceOp.MAX)
            return float(t[0])
        return float(self.hvd.allreduce(t, op=self.hvd.Max, name="bench.max")[0])

    def single(self, t, compression: str, name: str) -> None:
        """One in-place sum-allreduce of ``t`` (float32)."""
        if self.backend == "mpi":
            self.comm.Allreduce(self.MPI.IN_PLACE, t.numpy(), op=self.MPI.SUM)
        elif self.backend == "torch_gloo":
            self.tdist.all_reduce(t)
        elif compression == "fp16":
            c = t.to(self.torch.float16)  # hvd.Compression.fp16.compress
            self.hvd.allreduce_(c, op=self.hvd.Sum, name=name)
            t.copy_(c)  # decompress
        else:
            self.hvd.allreduce_(t, op=self.hvd.Sum, name=name)

    def grouped(self, tensors, mode: str, flat=None, prefix: str = "bench.g") -> None:
        """Allreduce a list of tensors: ``mode`` ``"async"`` (each tensor, issued together then
        waited for; Horovod names ``prefix.i``) or ``"flat"`` (packed into ``flat``, one
        allreduce, unpacked)."""
        torch = self.torch
        if mode == "flat":
            torch.cat([t.view(-1) for t in tensors], out=flat)
            self.single(flat, "none", f"{prefix}.flat")
            off = 0
            for t in tensors:
                t.view(-1).copy_(flat[off:off + t.numel()])
                off += t.numel()
        elif self.backend == "horovod":
            hs = [self.hvd.allreduce_async_(t, op=self.hvd.Average, name=f"{prefix}.{i}")
                  for i, t in enumerate(tensors)]
            for h in hs:
                self.hvd.synchronize(h)
        elif self.backend == "torch_gloo":
            works = [self.tdist.all_reduce(t, async_op=True) for t in tensors]
            for w in works:
                w.wait()
        else:  # MPI: nonblocking Iallreduce on each, then Waitall (MPI-3)
            reqs = [self.comm.Iallreduce(self.MPI.IN_PLACE, t.numpy(), op=self.MPI.SUM)
                    for t in tensors]
            self.MPI.Request.Waitall(reqs)


def _time(comm: _Comm, fn, iters: int, warmup: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls after ``warmup``; max over ranks."""
    for _ in range(warmup):
        fn()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.max((time.perf_counter() - t0) / iters)


def _worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    comm = _Comm(args.backend)
    n = comm.size
    base = {"backend": args.backend, "ranks": n}
    if args.backend == "horovod":
        base |= {"controller": comm.controller,
                 "fusion_threshold_bytes": int(os.environ.get("HOROVOD_FUSION_THRESHOLD",
                                                              HOROVOD_DEFAULT_FUSION_BYTES)),
                 "cycle_time_ms": float(os.environ.get("HOROVOD_CYCLE_TIME",
                                                       HOROVOD_DEFAULT_CYCLE_MS))}
    compressions = args.compressions.split(",") if args.backend == "horovod" else ["none"]
    records = []
    for size in parse_sizes(args.sizes) if args.sizes else []:
        t = torch.zeros(size // 4)
        k = iters_for(size, args.iters)
        for comp in compressions:
            sec = _time(comm, lambda: comm.single(t, comp, f"bench.s{size}"), k, args.warmup)
            records.append(base | {"case": "single", "compression": comp, "size_bytes": size,
                                   "iters": k, "time_s": sec})
        del t
    for spec in [g for g in args.groups.split(",") if g]:
        numels = group_tensor_numels(spec)
        tensors = [torch.zeros(m) for m in numels]
        total = 4 * sum(numels)
        flat = torch.zeros(sum(numels))
        k = iters_for(total, args.iters)
        modes = ["async"] if args.backend == "horovod" else ["async", "flat"]
        for mode in modes:
            sec = _time(comm, lambda: comm.grouped(tensors, mode, flat, f"bench.{spec}"), k,
                        args.warmup)
            records.append(base | {"case": "grouped", "group": spec, "mode": mode,
                                   "tensors": len(numels), "compression": "none",
                                   "size_bytes": total, "iters": k, "time_s": sec})
    if comm.rank == 0:
        print("RESULT " + json.dumps(records), flush=True)
    if args.backend == "torch_gloo":
        comm.tdist.destroy_process_group()
    return 0


# ---- driver -------------------------------------------------------------------------------------

def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Launch environment: one thread per rank, OpenMPI as root / in containers, ranks yielding
    the cores when idle (ranks share this machine's cores; see :mod:`hvd_lm.bench`)."""
    from hvd_lm.launch import local_mpi_env

    env = local_mpi_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    for k in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_AUTOTUNE"):
        env.pop(k, None)  # every configuration states its own
    env.update(extra or {})
    return env


def _mpirun(np_: int, argv: list[str]) -> list[str]:
    return ["mpirun", "-np", str(np_), "-bind-to", "none", "-map-by", "slot",
            "-mca", "pml", "ob1", "-mca", "btl", "^openib", sys.executable, *argv]


def _horovodrun_gloo(np_: int, argv: list[str]) -> list[str]:
    hr = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or "horovodrun"
    return [hr, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable, *argv]


def _run_worker(cmd: list[str], env: dict, timeout: float) -> list[dict]:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:  # horovodrun prefixes rank output with "[0]<stdout>:"
            return json.loads(line[line.index("RESULT ") + 7:])
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-3000:]}")


def configurations(args: argparse.Namespace) -> list[dict]:
    """The launches of one ``bench allreduce`` run: raw MPI, torch gloo, Horovod per controller at
    its defaults, then the MPI controller at each other fusion threshold / cycle time (those only
    up to ``--variant-max-size``: they matter for small messages and for the grouped case)."""
    backends = args.backends.split(",")
    confs = []
    if "mpi" in backends:
        confs.append({"label": "mpi4py", "backend": "mpi", "launcher": "mpirun", "env": {}})
    if "torch_gloo" in backends:
        confs.append({"label": "torch-gloo", "backend": "torch_gloo", "launcher": "mpirun",
                      "env": {}})
    if "horovod" in backends:
        for ctl in args.controllers.split(","):
            confs.append({"label": f"hvd-{ctl}", "backend": "horovod",
                          "launcher": "mpirun" if ctl == "mpi" else "horovodrun",
                          "env": {"HOROVOD_CONTROLLER": ctl} if ctl == "mpi" else {}})
        ctl = "mpi" if "mpi" in args.controllers.split(",") else args.controllers.split(",")[0]
        for mb in [float(x) for x in args.fusion_mb.split(",") if x.strip()]:
            if int(mb * MIB) != HOROVOD_DEFAULT_FUSION_BYTES:
                confs.append({"label": f"hvd-{ctl} fusion={mb:g}MB", "backend": "horovod",
                              "launcher": "mpirun" if ctl == "mpi" else "horovodrun",
                              "variant": True,
                              "env": {"HOROVOD_FUSION_THRESHOLD": str(int(mb * MIB))}
                              | ({"HOROVOD_CONTROLLER": ctl} if ctl == "mpi" else {})})
        for ms in [float(x) for x in args.cycle_ms.split(",") if x.strip()]:
            if ms != HOROVOD_DEFAULT_CYCLE_MS:
                confs.append({"label": f"hvd-{ctl} cycle={ms:g}ms", "backend": "horovod",
                              "launcher": "mpirun" if ctl == "mpi" else "horovodrun",
                              "variant": True, "env": {"HOROVOD_CYCLE_TIME": f"{ms:g}"}
                              | ({"HOROVOD_CONTROLLER": ctl} if ctl == "mpi" else {})})
    return confs


def _sizes(args: argparse.Namespace) -> list[int]:
    sizes = parse_sizes(args.sizes) if args.sizes else list(DEFAULT_SIZES)
    if args.max_size:
        sizes = [s for s in sizes if s <= parse_size(args.max_size)]
    if not sizes:
        raise ValueError("no message sizes left (check --sizes / --max-size)")
    return sizes


def fit_records(records: list[dict]) -> dict[str, dict]:
    """Alpha-beta fit per configuration label over its single-tensor records (see
    :func:`hvd_lm.scaling_model.fit_alpha_beta`); labels with < 2 sizes, or whose times do not
    grow with size (noise), get none."""
    from hvd_lm.scaling_model import fit_alpha_beta

    fits = {}
    for label in dict.fromkeys(r["label"] for r in records if r["case"] == "single"):
        rs = [r for r in records if r["case"] == "single" and r["label"] == label]
        if len({r["size_bytes"] for r in rs}) >= 2:
            try:
                fits[label] = fit_alpha_beta([r["size_bytes"] for r in rs],
                                             [r["time_s"] for r in rs], rs[0]["ranks"])
            except ValueError as e:  # e.g. noise: times not growing with size
                print(f"  no alpha-beta fit for {label}: {e}", file=sys.stderr)
    return fits


def derive(records: list[dict]) -> None:
    """Add ``algbw_GBps`` and ``busbw_GBps`` (nccl-tests' definitions) to every record."""
    for r in records:
        r["algbw_GBps"] = r["size_bytes"] / r["time_s"] / GB
        r["busbw_GBps"] = r["algbw_GBps"] * busbw_factor(r["ranks"])


def ratios_to_mpi(records: list[dict], reference: str = "mpi4py") -> list[dict]:
    """Per single-tensor size and non-reference label: time / the reference's time at that size."""
    ref = {r["size_bytes"]: r["time_s"] for r in records
           if r["case"] == "single" and r["label"] == reference}
    out = []
    for r in records:
        if r["case"] == "single" and r["label"] != reference and r["size_bytes"] in ref:
            out.append({"label": r["label"], "size_bytes": r["size_bytes"],
                        "time_ratio": r["time_s"] / ref[r["size_bytes"]]})
    return out


def _table(records: list[dict], fmt, title: str) -> None:
    single = [r for r in records if r["case"] == "single"]
    labels = list(dict.fromkeys(r["label"] for r in single))
    sizes = sorted({r["size_bytes"] for r in single})
    cell = {(r["label"], r["size_bytes"]): r for r in single}
    w = max(12, *(len(lb) for lb in labels)) + 1
    print(f"\n{title}")
    print(f"{'size':>6} " + "".join(f"{lb:>{w}}" for lb in labels))
    for s in sizes:
        row = "".join(f"{fmt(cell[(lb, s)]) if (lb, s) in cell else '-':>{w}}" for lb in labels)
        print(f"{human_bytes(s):>6} {row}")


def print_report(data: dict) -> None:
    """The tables of a ``bench allreduce`` result (``data`` as written by ``--json``)."""
    recs, n = data["records"], data["ranks"]
    _table(recs, lambda r: f"{r['time_s'] * 1e6:.0f}",
           f"single tensor, {n} ranks: time per allreduce, us (mean, max over ranks)")
    _table(recs, lambda r: f"{r['busbw_GBps']:.2f}",
           f"single tensor: bus bandwidth, GB/s (algbw x 2(n-1)/n = x {busbw_factor(n):.2f})")
    ref = {r["size_bytes"]: r for r in recs if r["case"] == "single" and r["label"] == "mpi4py"}
    if ref:
        _table([r | {"ratio": r["time_s"] / ref[r["size_bytes"]]["time_s"]} for r in recs
                if r["case"] == "single" and r["size_bytes"] in ref],
               lambda r: f"{r['ratio']:.2f}", "time / raw MPI (mpi4py) time, per size")
    if data.get("fits"):
        print("\nalpha-beta fit, t = 2(n-1) alpha + 2(n-1)/n S / beta (weighted least squares):")
        print(f"{'configuration':34} {'a=t(0), us':>11} {'alpha, us':>10} {'beta, GB/s':>11} "
              f"{'max rel err':>11}")
        for label, f in data["fits"].items():
            print(f"{label:34} {f['intercept_s'] * 1e6:>11.1f} {f['alpha_s'] * 1e6:>10.1f} "
                  f"{f['beta_GBps']:>11.2f} {f['max_rel_error']:>11.1%}")
    grouped = [r for r in recs if r["case"] == "grouped"]
    if grouped:
        print("\ngrouped gradients per step (Horovod: allreduce_async_ + synchronize, op Average)")
        print(f"{'group':22} {'configuration':34} {'mode':6} {'tensors':>7} {'MB':>7} "
              f"{'ms/step':>9} {'busbw GB/s':>10}")
        for r in grouped:
            print(f"{r['group']:22} {r['label']:34} {r['mode']:6} {r['tensors']:>7} "
                  f"{r['size_bytes'] / 1e6:>7.2f} {r['time_s'] * 1e3:>9.3f} "
                  f"{r['busbw_GBps']:>10.2f}")


def median_over_repeats(records: list[dict]) -> list[dict]:
    """One record per (label, case, size, group, mode): the median ``time_s`` over repeated
    launches, all of them kept in ``time_s_repeats``."""
    import statistics

    out: dict[tuple, dict] = {}
    for r in records:
        key = (r["label"], r["case"], r["size_bytes"], r.get("group"), r.get("mode"))
        out.setdefault(key, dict(r, time_s_repeats=[]))["time_s_repeats"].append(r["time_s"])
    for r in out.values():
        r["time_s"] = statistics.median(r["time_s_repeats"])
    return list(out.values())


def run_allreduce_bench(args: argparse.Namespace) -> dict:
    """Launch every configuration (see :func:`configurations`), ``--repeats`` times round robin
    (drift on a shared machine then hits every configuration alike), and collect the records,
    each the median over the repeats (:func:`median_over_repeats`)."""
    sizes = _sizes(args)
    variant_sizes = [s for s in sizes if s <= parse_size(args.variant_max_size)] or sizes[:1]
    records = []
    for rep in range(args.repeats):
        for conf in configurations(args):
            szs = variant_sizes if conf.get("variant") else sizes
            argv = ["-m", "hvd_lm.bench_allreduce", "worker", "--backend", conf["backend"],
                    "--sizes", ",".join(map(str, szs)), "--iters", str(args.iters),
                    "--warmup", str(args.warmup), "--compressions", args.compressions,
                    "--groups", args.groups]
            extra = dict(conf["env"])
            if conf["backend"] == "torch_gloo":
                extra.update(MASTER_PORT=str(args.port), GLOO_SOCKET_IFNAME="lo")
            cmd = (_mpirun(args.np, argv) if conf["launcher"] == "mpirun"
                   else _horovodrun_gloo(args.np, argv))
            t0 = time.perf_counter()
            recs = _run_worker(cmd, _env(extra), args.timeout)
            print(f"  {conf['label']} (repeat {rep}): {len(recs)} records in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            for r in recs:
                r["label"] = conf["label"] + ("+fp16" if r.get("compression") == "fp16" else "")
            records += recs
    records = median_over_repeats(records)
    derive(records)
    return {"ranks": args.np, "repeats": args.repeats, "sizes": sizes, "records": records,
            "fits": fit_records(records),
            "ratios_to_mpi": ratios_to_mpi(records),
            "horovod_defaults": {"fusion_threshold_bytes": HOROVOD_DEFAULT_FUSION_BYTES,
                                 "cycle_time_ms": HOROVOD_DEFAULT_CYCLE_MS},
            "host": {"cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0]},
            "args": {k: v for k, v in vars(args).items() if k != "func"}}


def _bench_allreduce(args: argparse.Namespace) -> int:
    try:
        data = run_allreduce_bench(args)
    except (ValueError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"hvd-lm bench allreduce: ERROR: {e}", file=sys.stderr)
        return 1
    print_report(data)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))
    return 0


def load_bench_json(path: str | os.PathLike) -> dict:
    """Read a ``bench allreduce --json`` file and check it.

    Raises:
        ValueError: not such a file (missing keys, no records, non-positive times).
    """
    data = json.loads(Path(path).read_text())
    for key in ("ranks", "records"):
        if key not in data:
            raise ValueError(f"{path}: not a bench-allreduce JSON (no {key!r})")
    if not data["records"]:
        raise ValueError(f"{path}: no records")
    for r in data["records"]:
        missing = {"label", "case", "size_bytes", "time_s", "ranks"} - r.keys()
        if missing:
            raise ValueError(f"{path}: record without {sorted(missing)}: {r}")
        if not (r["time_s"] > 0 and r["size_bytes"] > 0):
            raise ValueError(f"{path}: non-positive time or size in {r}")
    return data


# ---- bench fusion: the training benchmark under fusion / cycle-time settings and autotune -------

@contextlib.contextmanager
def _environ(**kv: str | None):
    """Set (or, for None, remove) environment variables for the ``with`` body, then restore.
    :func:`hvd_lm.bench._launch` passes ``os.environ`` to ``mpirun``."""
    old = {k: os.environ.get(k) for k in kv}
    try:
        for k, v in kv.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_autotune_log(path: str | os.PathLike) -> dict:
    """Horovod's ``HOROVOD_AUTOTUNE_LOG`` CSV (horovod/common/parameter_manager.cc): a header
    ``hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,
    tensor_fusion_threshold,score``, one row per sample (score in bytes/us), and, once tuning
    has finished, a last row with the best values.

    Returns:
        ``{"samples": [row dicts], "best": row dict or None, "finished": bool}``; the fusion
        threshold is in MB as Horovod logs it, the score in bytes per microsecond.
    """
    lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("hierarchical_allreduce"):
        raise ValueError(f"{path}: not a Horovod autotune log")
    head = lines[0].split(",")
    rows = []
    for ln in lines[1:]:
        vals = [v.strip() for v in ln.split(",")]
        if len(vals) != len(head):
            continue
        rows.append({h: float(v) for h, v in zip(head, vals)})
    # The best-parameters row repeats one earlier sample's values with the best score; Horovod
    # writes it only when tuning finished. It is recognisable as the last row whose score equals
    # the maximum of the preceding rows.
    finished = len(rows) >= 2 and rows[-1]["score"] == max(r["score"] for r in rows[:-1])
    best = rows[-1] if finished else (max(rows, key=lambda r: r["score"]) if rows else None)
    return {"samples": rows[:-1] if finished else rows, "best": best, "finished": finished}


def _fusion_configs(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """(label, fusion MB, cycle ms): fusion thresholds at the default cycle time, then cycle times
    at the default threshold (or the full grid with ``--grid``)."""
    fus = [float(x) for x in args.fusion_mb.split(",") if x.strip()]
    cyc = [float(x) for x in args.cycle_ms.split(",") if x.strip()]
    dfus, dcyc = HOROVOD_DEFAULT_FUSION_BYTES / MIB, HOROVOD_DEFAULT_CYCLE_MS
    if args.grid:
        pairs = [(f, c) for f in fus for c in cyc]
    else:
        pairs = [(f, dcyc) for f in fus] + [(dfus, c) for c in cyc]
    pairs = list(dict.fromkeys(pairs))
    return [(f"fusion={f:g}MB cycle={c:g}ms", f, c) for f, c in pairs]


def _bench_fusion(args: argparse.Namespace) -> int:
    from hvd_lm import bench

    confs = _fusion_configs(args)
    runs = []
    clear = {"HOROVOD_AUTOTUNE": None, "HOROVOD_AUTOTUNE_LOG": None}
    try:
        for rep in range(args.repeats):  # round robin: drift on a shared machine hits all alike
            for label, fmb, cms in confs:
                with _environ(HOROVOD_FUSION_THRESHOLD=str(int(fmb * MIB)),
                              HOROVOD_CYCLE_TIME=f"{cms:g}", **clear):
                    r = bench._launch("horovod", args.np, args)
                runs.append({"label": label, "fusion_threshold_mb": fmb, "cycle_time_ms": cms,
                             "repeat": rep, **r})
                _save_fusion(args, runs, None)  # partial results survive an interrupted sweep
                print(f"  {label} (repeat {rep}): {r['step_time_s']:.4f} s/step",
                      file=sys.stderr, flush=True)
        autotune = None
        if args.autotune:
            with tempfile.TemporaryDirectory() as tmp:
                log = Path(tmp) / "autotune.csv"
                steps, args.steps = args.steps, args.autotune_steps
                try:
                    tune_env = {
                        "HOROVOD_FUSION_THRESHOLD": None, "HOROVOD_CYCLE_TIME": None,
                        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": str(args.autotune_warmup),
                        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": str(args.autotune_steps_per_sample),
                        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(args.autotune_samples)}
                    with _environ(**tune_env):
                        r = bench._launch("horovod", args.np, args)
                finally:
                    args.steps = steps
                autotune = parse_autotune_log(log) | {"run": r, "log": log.read_text()}
            best = autotune["best"]
            if best is not None:
                label = (f"autotuned fusion={best['tensor_fusion_threshold']:g}MB "
                         f"cycle={best['cycle_time_ms']:g}ms")
                with _environ(HOROVOD_FUSION_THRESHOLD=str(int(best["tensor_fusion_threshold"]
                                                              * MIB)),
                              HOROVOD_CYCLE_TIME=f"{best['cycle_time_ms']:g}", **clear):
                    r = bench._launch("horovod", args.np, args)
                runs.append({"label": label, "fusion_threshold_mb":
                             best["tensor_fusion_threshold"], "cycle_time_ms":
                             best["cycle_time_ms"], "repeat": 0, **r})
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        print(f"hvd-lm bench fusion: ERROR: {e}", file=sys.stderr)
        return 1
    summary = summarize_fusion(runs)
    print(f"\nhvd-lm bench fusion: {args.np} ranks, {args.cell} H={args.hidden_size}, per-rank "
          f"batch {args.batch_size} x {args.seq_len}, compression {args.compression}, "
          f"{args.steps} timed steps x {args.repeats} repeat(s)")
    print(f"{'configuration':36} {'median s/step':>13} {'min':>9} {'vs default':>10} "
          f"{'ar wait':>8}")
    for s in summary:
        print(f"{s['label']:36} {s['step_time_s']:>13.4f} {s['step_time_min_s']:>9.4f} "
              f"{s['relative_to_default']:>10.3f} {s['allreduce_wait_share']:>8.1%}")
    if autotune:
        b = autotune["best"]
        print(f"autotune ({len(autotune['samples'])} samples, finished={autotune['finished']}): "
              + ("no samples logged" if b is None else
                 f"cycle {b['cycle_time_ms']:g} ms, fusion {b['tensor_fusion_threshold']:g} MB, "
                 f"hierarchical allreduce {int(b['hierarchical_allreduce'])}, cache "
                 f"{int(b['cache_enabled'])}, score {b['score']:.1f} bytes/us"))
    _save_fusion(args, runs, autotune)
    return 0


def _save_fusion(args: argparse.Namespace, runs: list[dict], autotune: dict | None) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"runs": runs, "summary": summarize_fusion(runs), "autotune": autotune,
             "args": {k: v for k, v in vars(args).items() if k != "func"}}, indent=2))


def summarize_fusion(runs: list[dict]) -> list[dict]:
    """Median (robust on a shared machine) and minimum step time per configuration label over
    repeats, relative to Horovod's defaults (fusion 128 MB, cycle 1 ms) when that configuration
    ran (else to the first)."""
    import statistics

    out = []
    for label in dict.fromkeys(r["label"] for r in runs):
        rs = [r for r in runs if r["label"] == label]
        out.append({"label": label, "fusion_threshold_mb": rs[0]["fusion_threshold_mb"],
                    "cycle_time_ms": rs[0]["cycle_time_ms"], "repeats": len(rs),
                    "step_time_s": statistics.median(r["step_time_s"] for r in rs),
                    "step_time_min_s": min(r["step_time_s"] for r in rs),
                    "allreduce_wait_share": sum(r["allreduce_wait_share"] or 0 for r in rs)
                    / len(rs)})
    dflt = [s for s in out if s["fusion_threshold_mb"] == HOROVOD_DEFAULT_FUSION_BYTES / MIB
            and s["cycle_time_ms"] == HOROVOD_DEFAULT_CYCLE_MS and "autotuned" not in s["label"]]
    ref = (dflt or out)[0]["step_time_s"] if out else 1.0
    for s in out:
        s["relative_to_default"] = s["step_time_s"] / ref
    return out


# ---- argparse -----------------------------------------------------------------------------------

def _allreduce_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="ranks")
    p.add_argument("--sizes", default="", help="message sizes, e.g. 4K,64K,1M (default: 4K to "
                   "256M, powers of 4)")
    p.add_argument("--max-size", default="", help="drop sizes above this (quick runs), e.g. 4M")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (fewer for "
                   "big sizes: at most 1 GiB moved per size, at least 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--repeats", type=int, default=1, help="launches per configuration (round "
                   "robin); each figure is the median")
    p.add_argument("--backends", default="mpi,torch_gloo,horovod")
    p.add_argument("--controllers", default="mpi,gloo", help="Horovod controllers")
    p.add_argument("--compressions", default="none,fp16", help="Horovod compressions")
    p.add_argument("--fusion-mb", default="0,64", help="extra HOROVOD_FUSION_THRESHOLD values, MB "
                   "(MPI controller; the default 128 MB always runs)")
    p.add_argument("--cycle-ms", default="0.2,5", help="extra HOROVOD_CYCLE_TIME values, ms "
                   "(MPI controller; the default 1 ms always runs)")
    p.add_argument("--variant-max-size", default="4M", help="largest single-tensor size for the "
                   "fusion/cycle variants")
    p.add_argument("--groups", default=DEFAULT_GROUPS, help="grouped cases: mlstm<H>, "
                   "synthetic<N>x<size>; empty for none")
    p.add_argument("--port", type=int, default=29533, help="torch.distributed MASTER_PORT")
    p.add_argument("--timeout", type=float, default=600, help="per-launch limit, s")
    p.add_argument("--json", default="", help="write the results here")


def add_bench_subcommands(subparsers) -> None:
    """Register ``allreduce`` and ``fusion`` in the ``hvd-lm bench`` group."""
    from hvd_lm import bench

    p = subparsers.add_parser("allreduce", help="allreduce latency/bandwidth: Horovod (MPI, Gloo "
                              "controllers; fp16; fusion, cycle time) vs mpi4py vs torch gloo")
    _allreduce_args(p)
    p.set_defaults(func=_bench_allreduce)

    f = subparsers.add_parser("fusion", help="training step time vs HOROVOD_FUSION_THRESHOLD / "
                              "HOROVOD_CYCLE_TIME, and HOROVOD_AUTOTUNE's choice")
    bench._common(f)
    f.set_defaults(hidden_size=256, steps=20, warmup=3)
    f.add_argument("--np", type=int, default=2, help="ranks")
    f.add_argument("--fusion-mb", default="0,1,16,64,128", help="fusion thresholds, MB")
    f.add_argument("--cycle-ms", default="0.2,1,5,20", help="cycle times, ms")
    f.add_argument("--grid", action="store_true", help="every (fusion, cycle) pair, not two "
                   "one-dimensional sweeps")
    f.add_argument("--repeats", type=int, default=1, help="round-robin repeats")
    f.add_argument("--no-autotune", dest="autotune", action="store_false")
    f.add_argument("--autotune-steps", type=int, default=150, help="timed steps of the autotune "
                   "run (the tuner needs (warmup + samples + 8) x 5 x steps-per-sample steps)")
    f.add_argument("--autotune-warmup", type=int, default=1, help="HOROVOD_AUTOTUNE_WARMUP_SAMPLES")
    f.add_argument("--autotune-steps-per-sample", type=int, default=1,
                   help="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE")
    f.add_argument("--autotune-samples", type=int, default=12,
                   help="HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES")
    f.add_argument("--timeout", type=float, default=600, help="per-run limit, s")
    f.add_argument("--json", default="", help="write the results here")
    f.set_defaults(func=_bench_fusion)


def main(argv: list[str] | None = None) -> int:
    """``python -m hvd_lm.bench_allreduce worker ...`` (one rank) or ``allreduce ...`` /
    ``fusion ...`` (the drivers)."""
    p = argparse.ArgumentParser(prog="python -m hvd_lm.bench_allreduce")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--backend", choices=["mpi", "torch_gloo", "horovod"], required=True)
    w.add_argument("--sizes", default="")
    w.add_argument("--iters", type=int, default=20)
    w.add_argument("--warmup", type=int, default=2)
    w.add_argument("--compressions", default="none,fp16")
    w.add_argument("--groups", default="")
    w.set_defaults(func=_worker)
    add_bench_subcommands(sub)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
