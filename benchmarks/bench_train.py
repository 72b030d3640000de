"""``python -m benchmarks train`` and ``python -m benchmarks fusion``: the training step measured
side by side.

``bench train``, in one invocation (so that a shared, noisy machine affects every figure alike):

1. the machine's fp32 matmul rate with one thread (``torch.mm`` of 2048^3, best of 5), GFLOP/s;
2. the training step of :mod:`hvd_lm.train.loop` (same model, same window loss, same optimizer,
   ``synchronize``, ``unscale_and_clip`` and ``step_or_skip``) under ``mpirun -np N`` on each
   engine of ``--engines`` (Horovod and the torch engine, :mod:`hvd_lm.comm.torch_engine`: the
   two engines side by side) for each N in ``--ranks`` (weak scaling: the per-rank batch is
   fixed), one thread per rank, for every mLSTM implementation in ``--rnn-impl`` (``fused`` once
   per ``--rnn-kernels`` x ``--cuda-graphs`` variant, ``reference`` once): the implementations
   side by side in one run;
3. the same model and data with ``torch.nn.parallel.DistributedDataParallel`` (gloo backend,
   :mod:`benchmarks.baselines`) as the baseline, at the largest N (``--no-ddp``: skipped).

Each configuration runs ``--repeats`` times, interleaved with the others, and the median run is
reported with the spread. It prints chars/s per rank and in total, weak-scaling efficiency
(chars/s at N / (N x chars/s at the fewest ranks)), model FLOPs per char
(:meth:`LanguageModel.flops_per_char`), achieved GFLOP/s per rank and its fraction of the measured
matmul rate, the share of step time Horovod waited on the allreduce, every fused variant's
throughput over the reference's at each N, the torch engine / Horovod ratio at each N (repeat by
repeat too: the two ran back to back) and each engine over DDP. ``--json FILE`` saves it.
``--device cuda --precision bf16`` times the same step on GPUs (one rank per GPU).

``bench fusion`` sweeps ``HOROVOD_FUSION_THRESHOLD`` and ``HOROVOD_CYCLE_TIME`` on the same
training step (under ``mpirun -np N``), then runs it with ``HOROVOD_AUTOTUNE=1`` (Horovod docs:
"Autotune") and reads the chosen values from ``HOROVOD_AUTOTUNE_LOG``.

The workers (``python -m benchmarks.bench_train --backend ...``) train on seeded random bytes
(throughput does not depend on the values) or, with ``--shards``, on a shard directory's train
split.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.baselines import TorchGlooComm, ddp
from benchmarks.harness import lm_step, print_table, random_batches, rnn_impls, run_child, save_json
from hvd_lm import options
from hvd_lm.comm import engine
from hvd_lm.jobs.job_scripts import local_mpi_env, mpirun_argv
from hvd_lm.model import device as devices
from hvd_lm.model.config import KERNELS
from hvd_lm.model.lm import ModelConfig, recurrence_label
from hvd_lm.model.mfu import matmul_gflops
from hvd_lm.options import Command, option
from hvd_lm.train.step import train_step


def peak_gflops(step: "StepConfig") -> tuple[float, str]:
    """The matmul rate the achieved FLOP rate is compared with, and its description: one CPU
    rank's fp32 rate with ``step.threads`` threads (2048^3), or on CUDA the GPU's rate in the
    step's GEMM dtype (8192^3)."""
    if step.device == "cuda":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(step.precision,
                                                                     torch.float32)
        return (matmul_gflops(8192, device="cuda", dtype=dtype),
                f"{str(dtype)[6:]} on {torch.cuda.get_device_name()}, 8192^3")
    return matmul_gflops(threads=step.threads), f"fp32, {step.threads} thread(s), 2048^3"


# ---- settings -----------------------------------------------------------------------------------

@dataclass
class StepConfig:
    """The training step every run of these benchmarks times."""

    hidden_size: int = option(1024, "mLSTM width H", ge=1)
    embed_dim: int = option(64, "byte embedding width", ge=1)
    batch_size: int = option(32, "per-rank batch (weak scaling)", ge=1)
    seq_len: int = option(64, "TBPTT window, chars", ge=1)
    steps: int = option(5, "timed steps per run", ge=1)
    warmup: int = option(2, "untimed steps first", ge=0)
    threads: int = option(1, "torch threads per rank", ge=1)
    compression: str = option("fp16", "Horovod allreduce compression", choices=("none", "fp16"))
    device: str = option("cpu", "cpu, or cuda (one GPU per rank: cuda:local_rank)",
                         choices=("cpu", "cuda"))
    precision: str = option("fp32", "fp32, or bf16/fp16 autocast (fp16: CUDA only)",
                            choices=devices.PRECISIONS)


@dataclass
class WorkerConfig(StepConfig):
    """One rank of a run (``python -m benchmarks.bench_train FLAGS``)."""

    backend: str = option("horovod", "who allreduces the gradients: an engine (horovod, torch) "
                          "or the DDP baseline", choices=("horovod", "torch", "ddp"))
    rnn_impl: list[str] = option(default_factory=lambda: ["fused"],
                                 help="one model per entry (with the same entries of "
                                 "--rnn-kernels/--cuda-graphs), steps alternating",
                                 choices=("fused", "reference"))
    rnn_kernels: list[str] = option(default_factory=lambda: ["auto"],
                                    help="fused path's cell kernels, per model", choices=KERNELS)
    cuda_graphs: list[bool] = option(default_factory=lambda: [False],
                                     help="fused path: CUDA graphs, per model")

    def check(self) -> None:
        """The three per-model lists have one entry per model."""
        if not len(self.rnn_impl) == len(self.rnn_kernels) == len(self.cuda_graphs):
            raise ValueError("rnn_impl, rnn_kernels and cuda_graphs need one entry per model")
    fusion_threshold_mb: float | None = option(None, "HOROVOD_FUSION_THRESHOLD, MiB", ge=0)
    cycle_time_ms: float | None = option(None, "HOROVOD_CYCLE_TIME, ms", gt=0)


@dataclass
class BenchTrainConfig(StepConfig):
    """``python -m benchmarks train``."""

    ranks: list[int] = option(default_factory=lambda: [1, 2], help="rank counts to run, e.g. 1,2",
                              ge=1)
    engines: list[str] = option(default_factory=lambda: ["horovod", "torch"],
                                help="engines to run side by side (horovod: Horovod; torch: "
                                "the torch engine, --backend torch)", choices=("horovod", "torch"))
    rnn_impl: list[str] = option(default_factory=lambda: ["fused", "reference"],
                                 help="mLSTM implementations, side by side",
                                 choices=("fused", "reference"))
    rnn_kernels: list[str] = option(default_factory=lambda: ["auto"],
                                    help="fused variants: cell kernels (auto, torch, compile, "
                                    "triton)", choices=KERNELS)
    cuda_graphs: list[bool] = option(default_factory=lambda: [False],
                                     help="fused variants: CUDA graphs off/on (e.g. false,true)")
    ddp: bool = option(True, "also run the DistributedDataParallel peer (--no-ddp: skip it)",
                       switch=False, flag="--no-ddp")
    repeats: int = option(3, "interleaved runs per config; the median is reported", ge=1)
    timeout: float = option(900.0, "per-run limit, s", gt=0)
    json: str = option("", "write the results here")


# ---- worker (one rank) -------------------------------------------------------------------------

def worker(cfg: WorkerConfig) -> int:
    """Time ``cfg.steps`` training steps after ``cfg.warmup`` on this rank, for each model
    variant (``rnn_impl[i]``, ``rnn_kernels[i]``, ``cuda_graphs[i]``, same initial weights and
    data), the variants' steps alternating so that load on a shared machine hits all alike;
    rank 0 prints one ``BENCH {json}`` line per variant (chars/s per rank and in total, step
    time and every timed step's time, allreduce wait share)."""
    torch.set_num_threads(cfg.threads)
    if cfg.backend != "ddp":  # an engine: Horovod or the torch engine
        ctx = engine.init(cfg.fusion_threshold_mb, cfg.cycle_time_ms,  # collective: init
                        backend=cfg.backend)
        rank, size, local_rank = ctx.rank, ctx.size, ctx.local_rank
    else:
        peer = TorchGlooComm()  # the DDP peer: torch.distributed, gloo
        rank, size, local_rank = peer.rank, peer.size, peer.rank
    device = devices.resolve_device(cfg.device, local_rank)
    devices.check(device, cfg.precision)
    B, T = cfg.batch_size, cfg.seq_len
    runs = []
    for impl, kernels, graphs in zip(cfg.rnn_impl, cfg.rnn_kernels, cfg.cuda_graphs):
        r = lm_step(ModelConfig(hidden_size=cfg.hidden_size, embed_dim=cfg.embed_dim,
                                rnn_impl=impl, rnn_kernels=kernels, cuda_graphs=graphs),
                    device, cfg.precision, B)  # Adam as in training (fused)
        if cfg.backend != "ddp":
            r.net = engine.wrap_model(r.model, cfg.compression)  # the torch engine: DDP
            r.opt = engine.distributed_optimizer(r.opt, r.model, cfg.compression)  # Horovod's hooks
            engine.broadcast_state(r.model)  # collective: rank 0's weights everywhere
        else:
            r.net = ddp(r.model, peer)
        vars(r).update(label=recurrence_label(impl, kernels, graphs), impl=impl, kernels=kernels,
                       graphs=graphs, times=[], waits=[])
        runs.append(r)

    for i, batch in enumerate(random_batches(cfg.warmup + cfg.steps, B, T, 1000 + rank)):
        for r in runs:  # round robin over the variants, step by step
            t0 = time.perf_counter()
            # the loop's own step (hvd_lm.train.step.train_step): Horovod's synchronize inside,
            # or DDP's allreduce inside backward (the torch engine and the DDP peer)
            res = train_step(r.net, r.opt, r.scaler, [batch], r.state, r.spec)
            r.state = res.state
            if device.type == "cuda":
                torch.cuda.synchronize()  # the step's kernels are done before the clock is read
            if i >= cfg.warmup:
                r.times.append(time.perf_counter() - t0)
                r.waits.append(res.wait_s)
    for r in runs:
        step_time = sum(r.times) / len(r.times)
        sums = [B * T / step_time, sum(r.waits), sum(r.times)]  # chars/s of this rank, seconds
        tot, wait_sum, time_sum = (peer.sum(sums) if cfg.backend == "ddp"
                                   else engine.allreduce_sum(sums, "bench"))
        if rank == 0:
            print("BENCH " + json.dumps({
                "backend": cfg.backend, "ranks": size, "hidden_size": cfg.hidden_size,
                "variant": r.label, "rnn_impl": r.impl, "rnn_kernels": r.kernels,
                "cuda_graphs": r.graphs, "device": str(device), "precision": cfg.precision,
                "batch_size": B, "seq_len": T, "step_time_s": step_time, "step_times_s": r.times,
                "chars_per_s_per_rank": tot / size, "chars_per_s_total": tot,
                "allreduce_wait_share": wait_sum / time_sum if cfg.backend != "ddp" else None,
                "flops_per_char": r.model.flops_per_char()}), flush=True)
    if cfg.backend == "ddp":
        peer.close()
    return 0


# ---- driver -----------------------------------------------------------------------------------

def launch(backend: str, ranks: int, step: StepConfig, timeout: float,
           env_extra: dict[str, str | None] | None = None,
           variants: list[dict] | None = None) -> list[dict]:
    """Run :func:`worker` on ``ranks`` ranks under ``mpirun``; rank 0's records, one per
    variant. ``env_extra``: variables to set (or, for None, remove) for that launch (Horovod's
    knobs); ``variants``: the models' ``rnn_impl`` / ``rnn_kernels`` / ``cuda_graphs`` (default:
    one fused model, auto kernels, no graphs).

    Raises:
        RuntimeError: the launch failed (with its output). subprocess.TimeoutExpired.
    """
    per_model = {"rnn_impl": [v["rnn_impl"] for v in variants],
                 "rnn_kernels": [v.get("rnn_kernels", "auto") for v in variants],
                 "cuda_graphs": [v.get("cuda_graphs", False) for v in variants]} if variants else {}
    wcfg = WorkerConfig(**{f.name: getattr(step, f.name) for f in dataclasses.fields(StepConfig)},
                        backend=backend, **per_model)
    cmd = mpirun_argv(ranks, ["-m", "benchmarks.bench_train", *options.to_argv(wcfg)])
    # every configuration states its own Horovod knobs; the DDP baseline's env:// rendezvous
    # (the torch engine asks MPI instead)
    env = local_mpi_env(OMP_NUM_THREADS=str(step.threads)) | dict.fromkeys((
        "MASTER_ADDR", "MASTER_PORT", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME",
        "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG")) | (env_extra or {})
    if backend == "ddp":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29507 + ranks))
    env = {k: v for k, v in env.items() if v is not None}
    return run_child(cmd, timeout, env, count=max(1, len(variants or [])))


def variants(cfg: BenchTrainConfig) -> list[tuple[str, dict]]:
    """(label, worker settings) of every mLSTM implementation to time: ``reference`` once,
    ``fused`` once per (kernels, CUDA graphs) pair, in ``--rnn-impl`` order (e.g.
    ``fused/auto``, ``fused/triton+graphs``, ``reference``)."""
    return [(recurrence_label(*r), dict(zip(("rnn_impl", "rnn_kernels", "cuda_graphs"), r)))
            for r in rnn_impls(cfg.rnn_impl, cfg.rnn_kernels, cfg.cuda_graphs)]


def summarize_train(trials: dict[tuple[str, str, int], list[dict]], peak: float) -> dict:
    """The medians and ratios of ``bench train`` from its trials: ``(variant label, backend,
    ranks) -> [worker records]``, in run order (backend: ``horovod``, ``torch`` or ``ddp``).

    Returns:
        ``{"runs": [median record per configuration, with chars_per_s_total_trials,
        weak_scaling_efficiency (vs the variant's fewest ranks on the same engine; DDP's vs the
        first engine's), gflops_per_rank, fraction_of_matmul_peak], "impl_ratios": [{"variant",
        "ranks", "ratio", "paired_ratios", "paired_ratio_median"}: on the first engine run
        (Horovod, else torch), a fused variant's median total chars/s over the reference's at
        the same ranks, and repeat by repeat (the two ran back to back, so drifting load
        cancels)], "horovod_over_ddp" / "torch_over_ddp": ratio or None, "torch_over_horovod":
        [{"variant", "ranks", "ratio", "paired_ratios", "paired_ratio_median"}]}``.
    """
    runs = [dict(sorted(recs, key=lambda r: r["chars_per_s_total"])[len(recs) // 2],
                 variant=label, chars_per_s_total_trials=[r["chars_per_s_total"] for r in recs])
            for (label, _, _), recs in trials.items()]
    engines = [e for e in ("horovod", "torch") if any(r["backend"] == e for r in runs)]
    first = engines[0] if engines else "horovod"
    for r in runs:
        own = first if r["backend"] == "ddp" else r["backend"]
        same = [x for x in runs if x["variant"] == r["variant"] and x["backend"] == own]
        base = min(same, key=lambda x: x["ranks"]) if same else r
        gf = r["chars_per_s_per_rank"] * r["flops_per_char"] / 1e9
        r.update(weak_scaling_efficiency=r["chars_per_s_per_rank"] / base["chars_per_s_per_rank"],
                 gflops_per_rank=gf, fraction_of_matmul_peak=gf / peak)
    by = {(r["backend"], r["variant"], r["ranks"]): r for r in runs}

    def paired(a_key, b_key) -> dict:  # median ratio a/b, and repeat by repeat
        pairs = list(zip(trials[a_key], trials[b_key]))
        each = [a["chars_per_s_total"] / b["chars_per_s_total"] for a, b in pairs]
        return {"variant": a_key[0], "ranks": a_key[2],
                "ratio": by[(a_key[1], a_key[0], a_key[2])]["chars_per_s_total"]
                / by[(b_key[1], b_key[0], b_key[2])]["chars_per_s_total"],
                "paired_ratios": each, "paired_ratio_median": statistics.median(each)}

    ratios = []
    for (b, v, n) in by:
        if b != first or v == "reference" or (first, "reference", n) not in by:
            continue
        x = paired((v, first, n), ("reference", first, n))
        # step by step, where the two alternated in one process: reference time / variant time
        pairs = zip(trials[(v, first, n)], trials[("reference", first, n)])
        steps = [tb / ta for a, b in pairs for ta, tb in
                 zip(a.get("step_times_s", []), b.get("step_times_s", []))]
        if steps:
            q = statistics.quantiles(steps, n=4) if len(steps) > 1 else steps * 3
            x.update(step_ratios=steps, step_ratio_median=statistics.median(steps),
                     step_ratio_quartiles=[q[0], q[2]])
        ratios.append(x)
    engine_ratios = [paired((v, "torch", n), (v, "horovod", n)) for (b, v, n) in by
                     if b == "torch" and ("horovod", v, n) in by]
    ddp_run = next((r for r in runs if r["backend"] == "ddp"), None)
    over_ddp = {}
    for e in ("horovod", "torch"):
        key = (e, ddp_run["variant"], ddp_run["ranks"]) if ddp_run else None
        over_ddp[f"{e}_over_ddp"] = (by[key]["chars_per_s_total"] / ddp_run["chars_per_s_total"]
                                     if key in by else None)
    return {"runs": runs, "impl_ratios": ratios, **over_ddp, "torch_over_horovod": engine_ratios}


def bench_train(cfg: BenchTrainConfig) -> int:
    """Print (and with ``--json`` save) the ``bench train`` table (see the module docstring)."""
    ranks = sorted(set(cfg.ranks))
    engines = list(dict.fromkeys(cfg.engines))
    peak, what = peak_gflops(cfg)
    print(f"matmul peak ({what}): {peak:.1f} GFLOP/s per rank")
    var = variants(cfg)
    # one launch per group: every variant together (their steps alternate in one process); the
    # engines back to back at each rank count
    groups = [(e, n, var) for n in ranks for e in engines]
    if cfg.ddp:
        groups.append(("ddp", ranks[-1], [var[0]]))
    trials: dict[tuple[str, str, int], list[dict]] = {
        (name, b, n): [] for b, n, g in groups for name, _ in g}
    for _ in range(cfg.repeats):  # interleaved, so drifting machine load hits every config alike
        for backend, n, group in groups:
            recs = launch(backend, n, cfg, cfg.timeout, variants=[v for _, v in group])
            for (name, _), rec in zip(group, recs):
                trials[(name, backend, n)].append(rec)
    summary = summarize_train(trials, peak)
    runs = summary["runs"]
    print(f"model: mLSTM H={cfg.hidden_size} E={cfg.embed_dim}, per-rank batch "
          f"{cfg.batch_size} x {cfg.seq_len} chars, {runs[0]['flops_per_char'] / 1e6:.2f} "
          f"MFLOP/char (fwd+bwd), {cfg.device} {cfg.precision}")
    print_table(runs, [
        ("variant", "22", "variant"), ("backend", "8", "backend"), ("ranks", ">5", "ranks"),
        ("s/step", ">8.3f", "step_time_s"), ("chars/s/rank", ">13.0f", "chars_per_s_per_rank"),
        ("chars/s", ">10.0f", "chars_per_s_total"),
        ("weak eff", ">8.3f", "weak_scaling_efficiency"),
        ("GFLOP/s/rank", ">12.1f", "gflops_per_rank"),
        ("of peak", ">7.1%", "fraction_of_matmul_peak"),
        ("ar wait", ">7.1%", "allreduce_wait_share")])
    spread = "; ".join(f"{r['variant']} {r['backend']} x{r['ranks']} "
                       + ",".join(f"{v:.0f}" for v in r["chars_per_s_total_trials"])
                       for r in runs)
    for x in summary["impl_ratios"]:
        print(f"{x['variant']} / reference throughput at {x['ranks']} rank(s): "
              f"{x['ratio']:.3f}x (ratio of medians); per repeat "
              + ", ".join(f"{v:.3f}" for v in x["paired_ratios"])
              + f", median {x['paired_ratio_median']:.3f}x"
              + (f"; step by step (alternating in one process, {len(x['step_ratios'])} pairs): "
                 f"median {x['step_ratio_median']:.3f}x, quartiles "
                 f"{x['step_ratio_quartiles'][0]:.3f}-{x['step_ratio_quartiles'][1]:.3f}"
                 if "step_ratios" in x else ""))
    for x in summary["torch_over_horovod"]:
        print(f"torch engine / Horovod throughput at {x['ranks']} rank(s) ({x['variant']}): "
              f"{x['ratio']:.3f}x (ratio of medians); per repeat "
              + ", ".join(f"{v:.3f}" for v in x["paired_ratios"]))
    for e, name in (("horovod", "Horovod"), ("torch", "torch engine")):
        if summary[f"{e}_over_ddp"] is not None:
            print(f"{name} / DDP throughput at {ranks[-1]} ranks ({var[0][0]}): "
                  f"{summary[f'{e}_over_ddp']:.3f}x")
    print(f"(medians of {cfg.repeats} interleaved runs; per-run totals, chars/s: {spread})")
    save_json(cfg.json, {"matmul_gflops": peak, **summary,
                         "args": options.to_dict(cfg)})
    return 0


# ---- command line -------------------------------------------------------------------------------

BENCH_TRAIN = Command(BenchTrainConfig, bench_train, description=__doc__.split("\n\n")[1])
WORKER = Command(WorkerConfig, worker, config_flag=False)


if __name__ == "__main__":  # one rank of a run: python -m benchmarks.bench_train FLAGS
    sys.exit(WORKER.main(None, "python -m benchmarks.bench_train"))
