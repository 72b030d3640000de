"""``python -m benchmarks multinode``: the scaling model against measured links, across hosts, in
one run.

For each node count n of ``--nodes`` (the first n hosts of ``--hosts``, one rank each), the
benchmark measures, interleaved over ``--repeats`` rounds so that a shared machine's drift hits
every figure alike:

1. ``python -m benchmarks allreduce`` across the n hosts (Horovod's Gloo controller under
   ``horovodrun``, as the training runs; ``--compression``; single tensors of ``--sizes`` and the
   model's own gradient list as a group), and from it the alpha-beta fit of that configuration
   at n ranks, ``t(S) = a + b S`` read as the ring ``2(n-1) alpha + 2(n-1)/n S / beta``
   (Hockney; Thakur, Rabenseifner & Gropp 2005; :func:`benchmarks.results.fit_alpha_beta`);
2. the host time of one optimizer step (compute plus Horovod's own work: everything but the
   gradients' time on the wire): ``hvd-lm train`` as one process with the same per-rank batch
   (:func:`measure_compute`), or with ``--colocated`` (the n "hosts" share this machine's cores,
   as on the cluster in a box) from inside the run of 3.: each step's slowest rank less its
   wait for the gradient allreduce (the ``compute_time_max`` of its ``train`` records). With more
   ranks than cores the contention between the ranks, and with the links' own traffic, is part of
   every step, and only the run itself has it (docs/performance.md section 8: how far the
   rounds' ``compute_s_runs`` spread). The comparison then tests
   the model's communication (from the fit of 1.) against what the measured step spent beyond
   that host time;
3. the training step across the n hosts: ``hvd-lm train`` under ``horovodrun -H`` (median
   ``step_time`` of the ``train`` records, the first ``--skip`` dropped as warm-up).

and predicts 3. from 1. and 2. with the scaling model (:func:`predict_step`:
:func:`benchmarks.scaling_model.step_time` with both links set to the measured one, one rank per
node, Horovod's default fusion), plus the training loop's own small allreduces (control flags
every ``--control-every`` steps, the metrics' sum and per-step maximum every ``--log-every``).
The link is Hockney's two parameters, alpha measured where it is defined: the time of a
:data:`LATENCY_BYTES` allreduce (``--latency-iters`` of them, a launch of its own: Horovod's
negotiation round, cycle and the ring's latency; a free line through the large sizes alone puts
its intercept wherever their noise takes it) is the fit's intercept, and beta
is fitted to the sizes' times less it (``fit``; the free line is kept as ``fit_free``). Each fused
allreduce of S bytes then costs ``t(32 B) + b S`` and each of the loop's small allreduces
``t(32 B)``. How much of the early gradients' allreduce (the decoder's, ready first)
hides behind the backward pass is measured too (:func:`measure_backward_window`: the share of the
step after those gradients are ready, one process, the same model, batch and optimizer); for a
small model the optimizer's step and the forward pass are most of the step, so the window is
less than the 2/3 that :class:`~benchmarks.scaling_model.ScalingConfig` assumes for a large
one. The report prints per n: alpha, beta, compute, predicted communication, predicted and
measured s/step and their ratio (predicted / measured). ``--json FILE`` keeps everything (the
allreduce records too).
The links are what they are: on the cluster in a box (tests/cluster.py) ``tc tbf`` sets them,
and ``--label`` names the rate in the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench_allreduce import AllreduceConfig, run_allreduce_bench
from benchmarks.harness import host, lm_step, print_table, random_batches, run_child, save_json
from benchmarks.results import fit_alpha_beta
from benchmarks.scaling_model import Link, ScalingConfig, ring_allreduce_time, step_time
from benchmarks.scaling_report import read_run
from hvd_lm import options
from hvd_lm.comm.engine import HOROVOD_DEFAULT_FUSION_BYTES
from hvd_lm.comm.hosts import parse_hosts
from hvd_lm.jobs.job_scripts import horovodrun_argv, local_mpi_env
from hvd_lm.model.lm import mlstm_parameters
from hvd_lm.options import Command, option


@dataclass
class MultinodeConfig:
    """Settings of ``python -m benchmarks multinode``."""

    hosts: str = option("", "the hosts, host:slots,... (one rank each is used)", required=True)
    network_interface: str = option("", "the interface between them (`hvd-lm doctor` prints "
                                    "it)", required=True)
    nodes: list[int] = option(default_factory=lambda: [2, 3], help="node counts to measure "
                              "(the first n hosts)", ge=2)
    shards: str = option("", "shard folder for the training runs (readable on every host)",
                         required=True)
    hidden_size: int = option(512, "mLSTM width of the training runs", ge=8)
    embed_dim: int = option(64, "byte embedding width", ge=1)
    batch_size: int = option(1, "per-rank batch (rows)", ge=1)
    seq_len: int = option(16, "TBPTT window, bytes", ge=2)
    compression: str = option("none", "gradient compression of the training and the allreduce "
                              "bench", choices=("none", "fp16"))
    steps: int = option(100, "optimizer steps per training run", ge=10)
    log_every: int = option(10, "steps per train record (each record's step_time is their "
                            "mean)", ge=1)
    control_every: int = option(10, "hvd-lm train --control-every", ge=1)
    skip: int = option(1, "train records dropped as warm-up", ge=0)
    sizes: str = option("auto", "allreduce sizes for the fit (float32 payload), e.g. "
                        "64K,1M,16M; auto: the powers of two around the model's gradient bytes "
                        "(fit_sizes)")
    iters: int = option(10, "timed allreduces per size", ge=1)
    latency_iters: int = option(50, "timed allreduces of 32 bytes (alpha: the per-operation "
                                "time)", ge=1)
    repeats: int = option(2, "rounds of every measurement (interleaved); medians", ge=1)
    colocated: bool = option(False, "the hosts share this machine's cores (the cluster in a "
                             "box): the host time is taken from inside the run across the hosts "
                             "(the slowest rank's step less its allreduce wait)", switch=True)
    label: str = option("", "what the links are, for the report (e.g. 1gbit)")
    timeout: float = option(600.0, "limit per launch, s", gt=0)
    json: str = option("", "write the results here")


def train_argv(cfg: MultinodeConfig, out_dir: Path) -> list[str]:
    """``-m hvd_lm train`` arguments of every run (no validation split: steps only)."""
    return ["-m", "hvd_lm", "train", "--shards", cfg.shards, "--out-dir", str(out_dir),
            "--hidden-size", str(cfg.hidden_size), "--embed-dim", str(cfg.embed_dim),
            "--batch-size", str(cfg.batch_size), "--seq-len", str(cfg.seq_len),
            "--max-steps", str(cfg.steps), "--log-every", str(cfg.log_every),
            "--control-every", str(cfg.control_every), "--compression", cfg.compression,
            "--threads", "1", "--device", "cpu", "--val-split", "", "--check-free-space",
            "false"]


def _timing(cmd: list[str], out: Path, cfg: MultinodeConfig):
    """Run ``cmd`` (an ``hvd-lm train`` writing to ``out``), then
    :func:`benchmarks.scaling_report.read_run` of it, its errors as RuntimeError (a run that
    logged too little is a failed measurement, not a bad setting)."""
    run_child(cmd, cfg.timeout, local_mpi_env(), marker=None)
    try:
        return read_run(out, cfg.skip)
    except ValueError as e:
        raise RuntimeError(str(e)) from e


def measure_training(cfg: MultinodeConfig, hosts: str, work: Path) -> tuple[float, float]:
    """``hvd-lm train`` on ``hosts`` (``host:1,...``, ``horovodrun --gloo``): the median s/step
    of its ``train`` records after ``--skip``, and the median of their ``compute_time_max`` (each
    step's slowest rank's seconds outside the gradient allreduce's wait, averaged over the record's
    steps; :meth:`hvd_lm.train.metrics.Metrics.log_train`).

    Raises:
        RuntimeError: the run failed, or logged no ``train`` record (with ``compute_time_max``)
            after ``--skip``.
    """
    n = len(parse_hosts(hosts))
    out = work / f"train_n{n}"
    timing = _timing(horovodrun_argv(n, train_argv(cfg, out), "gloo", hosts,
                                     cfg.network_interface), out, cfg)
    if timing.compute_time_max is None:
        raise RuntimeError(f"{out}: no train record with compute_time_max")
    return timing.step_time, timing.compute_time_max


def measure_compute(cfg: MultinodeConfig, work: Path) -> float:
    """Seconds per step of one process alone (``hvd-lm train`` without a launcher, the same
    per-rank batch): the host time of a node that has its cores to itself. Median over the
    ``train`` records after ``--skip``.

    Raises:
        RuntimeError: the run failed, or logged no ``train`` record after ``--skip``.
    """
    out = work / "compute_p1"
    return _timing([sys.executable, *train_argv(cfg, out)], out, cfg).step_time


def measure_backward_window(cfg: MultinodeConfig, steps: int = 30, skip: int = 5) -> dict:
    """The parts of one training step on this process alone, one thread, ``cfg``'s model and
    per-rank batch, the optimizer ``hvd-lm train`` builds (fused Adam) and its gradient clipping:
    medians over ``steps`` after ``skip``, seconds.

    Returns:
        ``forward_s`` (:func:`hvd_lm.train.step.window_nll`), ``backward_s``, ``window_s``
        (the part of the backward after the last gradient of the early group is ready:
        :data:`benchmarks.scaling_model.EARLY_PREFIXES`, whose allreduce Horovod starts then
        and which that time can hide), ``update_s`` (the wait, unscale and clip, step or skip,
        zero_grad),
        ``step_s`` and ``fraction`` = window_s / step_s, the share of the step's compute the
        model lets the early allreduce overlap (``ScalingConfig.backward_fraction``).
    """
    import torch

    from benchmarks.scaling_model import EARLY_PREFIXES
    from hvd_lm.model.lm import ModelConfig
    from hvd_lm.train.step import train_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the training runs (--threads 1)
    try:
        j = lm_step(ModelConfig(hidden_size=cfg.hidden_size, embed_dim=cfg.embed_dim),
                    torch.device("cpu"), "fp32", cfg.batch_size)
        ready: dict[str, float] = {}
        for name, p in j.model.named_parameters():
            if name.startswith(EARLY_PREFIXES):
                p.register_hook(lambda g, name=name: ready.__setitem__(name, time.perf_counter()))
        t: dict[str, float] = {}  # the step's parts, timed as they end
        spec = dataclasses.replace(j.spec, clock=lambda k: t.__setitem__(k, time.perf_counter()))
        parts = []
        for i, batch in enumerate(random_batches(skip + steps, cfg.batch_size, cfg.seq_len, 0)):
            # the training loop's own step (hvd_lm.train.step.train_step) on one process
            t["start"] = time.perf_counter()
            j.state = train_step(j.model, j.opt, j.scaler, [batch], j.state, spec).state
            if i >= skip:
                parts.append((t["forward"] - t["start"], t["backward"] - t["forward"],
                              t["backward"] - max(ready.values()), t["updated"] - t["backward"],
                              t["updated"] - t["start"]))
    finally:
        torch.set_num_threads(threads)
    med = [statistics.median(p[k] for p in parts) for k in range(5)]
    out = dict(zip(("forward_s", "backward_s", "window_s", "update_s", "step_s"), med))
    return out | {"fraction": out["window_s"] / out["step_s"]}


def fit_sizes(gradient_bytes: int) -> list[int]:
    """The message sizes of the fit by default, bytes: the powers of two from the one at or below
    an eighth of ``gradient_bytes`` to the one at or above them, at least two (e.g. 512 KiB-8 MiB
    for the 6.50 MB of H=512). The alpha-beta model is a straight line, and an allreduce's cost
    per byte is not one constant from 64 KiB to 16 MiB (across 3 hosts sharing 2 cores it fell
    with size), so the line is fitted where the model uses it."""
    lo = 1 << (max(4, gradient_bytes // 8).bit_length() - 1)
    hi = max(2 * lo, 1 << (gradient_bytes - 1).bit_length())
    return [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]


#: Bytes of the allreduce whose time gives alpha (the loop's control flags and metrics are
#: allreduces of this order: 2-4 float64 values).
LATENCY_BYTES = 32


def predict_step(t_comp: float, params: list, fit: dict, n: int, control_every: int,
                 log_every: int, backward_fraction: float = 2 / 3) -> dict:
    """The scaling model's step on n nodes (one rank each) over the measured link, seconds.

    Args:
        t_comp: compute time of one step (s), measured.
        params: (name, elements) of the gradients (:func:`hvd_lm.model.lm.mlstm_parameters`).
        fit: :func:`benchmarks.results.fit_alpha_beta` of Horovod's allreduce at n ranks, time
            against the float32 payload (so fp16 compression is inside the fit: the model moves
            4 bytes per value); the bench fixes its intercept at the measured time of a
            :data:`LATENCY_BYTES` allreduce.
        control_every / log_every: the loop's small allreduces (control flags every
            ``control_every`` steps; metrics, two, every ``log_every``), each costing one
            allreduce of :data:`LATENCY_BYTES`.
        backward_fraction: share of ``t_comp`` the early gradients' allreduce can hide behind
            (:func:`measure_backward_window`).

    Returns:
        :func:`benchmarks.scaling_model.step_time`'s dict plus ``loop_s`` (the small
        allreduces per step) and ``predicted_s`` (s_per_iter + loop_s).
    """
    link = Link(fit["beta_GBps"], fit["alpha_s"], "fitted")
    cfg = ScalingConfig(compute_time_s=t_comp, params=params, grad_bytes=4, compression="none",
                        batch_per_gpu=1, ref_batch=1, gpus_per_node=1, intra=link, inter=link,
                        fusion_threshold_bytes=HOROVOD_DEFAULT_FUSION_BYTES, cycle_time_s=0.0,
                        per_cycle_overhead_s=0.0, negotiation=False, sync_overhead_s=0.0,
                        backward_fraction=backward_fraction)
    out = step_time(cfg, n)
    small = ring_allreduce_time(LATENCY_BYTES, n, link.latency_s, link.bandwidth_GBps)
    out["loop_s"] = (1 / control_every + 2 / log_every) * small
    out["predicted_s"] = out["s_per_iter"] + out["loop_s"]
    return out


def estimate(n: int, records: list[dict], latency: list[float], compute: list[float],
             measured: list[float], params: list, cfg: MultinodeConfig,
             backward_fraction: float) -> dict:
    """The fit, the model's step and predicted / measured from measurements at n ranks, each the
    median of its list: ``records`` (:func:`run_allreduce_bench`'s, the ``single`` ones fitted),
    ``latency`` (s per :data:`LATENCY_BYTES` allreduce: the fit's intercept), ``compute`` and
    ``measured`` (s per step). Rows use every round's; ``ratio_rounds`` one round's each.
    ``fit_free`` (the free line, for the record) is None where it cannot be fitted.

    Raises:
        ValueError: as :func:`benchmarks.results.fit_alpha_beta` (no single-tensor size, or
            times that do not grow with size).
    """
    sizes = sorted({r["size_bytes"] for r in records if r["case"] == "single"})
    times = [statistics.median(r["time_s"] for r in records if r["case"] == "single"
                               and r["size_bytes"] == s) for s in sizes]
    lat_s = statistics.median(latency)
    fit = fit_alpha_beta(sizes, times, n, intercept_s=lat_s)
    t_comp, t_step = statistics.median(compute), statistics.median(measured)
    pred = predict_step(t_comp, params, fit, n, cfg.control_every, cfg.log_every,
                        backward_fraction)
    free = None  # the free line, where the times allow one
    with contextlib.suppress(ValueError):
        free = fit_alpha_beta(sizes, times, n)
    return {"fit": fit, "fit_free": free,
            "allreduce": [{"size_bytes": s, "time_s": t} for s, t in zip(sizes, times)],
            "latency_s": lat_s, "compute_s": t_comp, "measured_s": t_step, "pred": pred,
            "ratio": pred["predicted_s"] / t_step}


def run_multinode_bench(cfg: MultinodeConfig) -> dict:
    """Every measurement, ``repeats`` rounds interleaved; fits, predictions and ratios."""
    hosts = parse_hosts(cfg.hosts)
    if max(cfg.nodes) > len(hosts):
        raise ValueError(f"--nodes {max(cfg.nodes)} but --hosts lists {len(hosts)} hosts")
    params = mlstm_parameters(cfg.hidden_size, cfg.embed_dim)
    gradient_bytes = 4 * sum(m for _, m in params)
    sizes_arg = cfg.sizes if cfg.sizes != "auto" else ",".join(
        str(b) for b in fit_sizes(gradient_bytes))
    # per node count, one entry per round: that round's allreduce records, s per 32-byte
    # allreduce, s per training step, compute s per step
    records, latency, train_t, comp_t = ({n: [] for n in cfg.nodes} for _ in range(4))
    window = measure_backward_window(cfg)
    # run folders are written by rank 0 only, which horovodrun starts on this host
    with tempfile.TemporaryDirectory(prefix="hvdlm-multinode-") as tmp:
        for rep in range(cfg.repeats):
            alone = None if cfg.colocated else measure_compute(cfg, Path(tmp) / f"r{rep}")
            for n in cfg.nodes:
                work = Path(tmp) / f"r{rep}_n{n}"
                t0 = time.perf_counter()
                on = ",".join(f"{h}:1" for h, _ in hosts[:n])
                sweep = AllreduceConfig(
                    np=n, sizes=sizes_arg, iters=cfg.iters, backends=["horovod"],
                    controllers=["gloo"], compressions=[cfg.compression], fusion_mb=[],
                    cycle_ms=[], groups=[f"mlstm{cfg.hidden_size}"] if cfg.embed_dim == 64
                    else [], hosts=on, network_interface=cfg.network_interface,
                    timeout=cfg.timeout)
                records[n].append(run_allreduce_bench(sweep)["records"])
                lat = run_allreduce_bench(dataclasses.replace(
                    sweep, sizes=str(LATENCY_BYTES), iters=cfg.latency_iters, groups=[]))
                latency[n].append(statistics.median(r["time_s"] for r in lat["records"]))
                step, in_run = measure_training(cfg, on, work)
                train_t[n].append(step)
                comp_t[n].append(in_run if alone is None else alone)
                print(f"  round {rep}, {n} nodes: allreduce and training in "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for n in cfg.nodes:
        every = [r for recs in records[n] for r in recs]
        est = estimate(n, every, latency[n], comp_t[n], train_t[n], params, cfg,
                       window["fraction"])
        ratio_rounds = []
        for i, recs in enumerate(records[n]):  # each round alone; a round too noisy to fit: None
            try:
                ratio_rounds.append(estimate(n, recs, latency[n][i:i + 1], comp_t[n][i:i + 1],
                                             train_t[n][i:i + 1], params, cfg,
                                             window["fraction"])["ratio"])
            except ValueError:
                ratio_rounds.append(None)
        pred = est.pop("pred")
        grouped = [r["time_s"] for r in every if r["case"] == "grouped"]
        rows.append({"nodes": n, "link": cfg.label, **est, "latency_s_runs": latency[n],
                     "grouped_allreduce_s": statistics.median(grouped) if grouped else None,
                     "compute_s_runs": comp_t[n], "comm_s": pred["exposed_comm_s"],
                     "hidden_comm_s": pred["hidden_comm_s"], "loop_s": pred["loop_s"],
                     "predicted_s": pred["predicted_s"], "measured_s_runs": train_t[n],
                     "ratio_rounds": ratio_rounds})
    return {"label": cfg.label, "hosts": cfg.hosts, "network_interface": cfg.network_interface,
            "gradient_bytes": gradient_bytes, "rows": rows, "step_parts": window,
            "host": host(), "args": options.to_dict(cfg),
            "records": {str(n): [r for recs in rs for r in recs] for n, rs in records.items()}}


def print_report(data: dict) -> None:
    """The table of a ``bench multinode`` result (``data`` as ``--json`` writes it)."""
    mb = data["gradient_bytes"] / 1e6
    print(f"\nscaling model vs measured, links {data['label'] or '?'}, gradients {mb:.2f} MB "
          "(float32 payload), one rank per node")
    print_table(data["rows"], [
        ("nodes", ">5", "nodes"), ("alpha, us", ">9.0f", lambda r: r["fit"]["alpha_s"] * 1e6),
        ("beta, GB/s", ">10.3f", lambda r: r["fit"]["beta_GBps"]),
        ("fit err", ">7.1%", lambda r: r["fit"]["max_rel_error"]),
        ("compute, ms", ">11.1f", lambda r: r["compute_s"] * 1e3),
        ("comm, ms", ">8.1f", lambda r: (r["comm_s"] + r["loop_s"]) * 1e3),
        ("predicted, ms", ">13.1f", lambda r: r["predicted_s"] * 1e3),
        ("measured, ms", ">12.1f", lambda r: r["measured_s"] * 1e3),
        ("pred/meas", ">9.3f", "ratio")])
    spans = {r["nodes"]: [x for x in r["ratio_rounds"] if x is not None] for r in data["rows"]}
    spread = "; ".join(f"{min(x):.2f}-{max(x):.2f} at {n}" for n, x in spans.items()
                       if len(x) > 1)
    if spread:
        print(f"pred/meas of each round alone (its own fit, compute and step): {spread} nodes")
    lat = ", ".join(f"{r['latency_s'] * 1e3:.1f} ms at {r['nodes']}" for r in data["rows"])
    print(f"alpha: a {LATENCY_BYTES}-byte allreduce took {lat} ranks (2(n-1) alpha); beta: "
          "fitted to the sizes' times less that")
    w = data["step_parts"]
    print(f"one process's step: forward {w['forward_s'] * 1e3:.1f} ms, backward "
          f"{w['backward_s'] * 1e3:.1f} ms ({w['window_s'] * 1e3:.1f} ms after the early "
          f"gradients), update {w['update_s'] * 1e3:.1f} ms: the early allreduce may hide "
          f"behind {w['fraction']:.0%} of the step")


def bench_multinode(cfg: MultinodeConfig) -> int:
    """Run, print, and with ``--json`` save."""
    data = run_multinode_bench(cfg)
    print_report(data)
    save_json(cfg.json, data, indent=1)
    return 0


BENCH_MULTINODE = Command(
    MultinodeConfig, bench_multinode, usage_errors=(ValueError,),
    description="Across hosts: Horovod's allreduce and its alpha-beta fit at each node count, "
    "the compute time, and the scaling model's predicted training step against the measured one.")
