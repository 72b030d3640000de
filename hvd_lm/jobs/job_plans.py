"""``hvd-lm launch``: plan one job or a scaling sweep (sizes, global batch, peak LR), render its
scripts (:mod:`hvd_lm.jobs.job_scripts`) and optionally submit them.

``--sweep 1,8,16,32,64,128`` writes one job per GPU count for a weak-scaling study as in the
reference's table (Puri et al. 2018, "Distributed data parallel scaling"): the per-GPU batch is
fixed, so the global batch is GPUs x per-GPU batch (x backward passes per step) and the peak LR
follows the configured rule (:func:`hvd_lm.train.schedule.scaled_lr`, which ``hvd-lm train`` applies
the same way). ``python -m benchmarks scaling-report`` (from a checkout) turns the finished runs
into the s/iter and speedup table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from hvd_lm.comm.hosts import parse_hosts
from hvd_lm.jobs.job_scripts import SCHEDULERS, SUBMIT, RenderSpec, job_size, render, template_dir
from hvd_lm.options import Command, option
from hvd_lm.train.schedule import scaled_lr
from hvd_lm.train.settings import add_arguments, from_args
from hvd_lm.util.atomic import write_text
from hvd_lm.util.files import check_output
from hvd_lm.util.units import duration_text, parse_duration


class _Raising(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and sys.exit(2)
        raise ValueError(message)


def train_config(config: str | None, train_args: list[str]):
    """The :class:`hvd_lm.train.settings.TrainConfig` that ``hvd-lm train [--config FILE]
    TRAIN_ARGS`` would run (so the sweep's batch and LR are the ones training will use).

    Raises:
        ValueError: an unknown or malformed training flag, a bad config file, or a flag the launch
            command owns (``--config``, ``--out-dir``).
    """
    for owned, instead in (("--config", "--config before --"), ("--out-dir", "--run-dir")):
        if any(a == owned or a.startswith(owned + "=") for a in train_args):
            raise ValueError(f"training flag {owned} is set by hvd-lm launch: use {instead}")
    parser = _Raising(prog="hvd-lm train", add_help=False)
    add_arguments(parser)
    ns = parser.parse_args(train_args)
    ns.config = config
    return from_args(ns)


@dataclass
class JobPlan:
    """One job's size, batch and LR (a row of the sweep table).

    Attributes:
        gpus / nodes / tasks_per_node: layout (see :class:`JobSize`).
        global_batch: sequences per optimizer step = GPUs x per-GPU batch x backward passes.
        lr: peak LR ``hvd-lm train`` derives for that global batch.
        steps: optimizer steps (``--max-steps``), or None for the config's.
        out_dir: the run directory, or None for the template's.
        script: where the rendered script was written ('' until then).
    """

    gpus: int
    nodes: int
    tasks_per_node: int
    global_batch: int
    lr: float
    steps: int | None = None
    out_dir: str | None = None
    script: str = ""


def plan_job(gpus: int, gpus_per_node: int, cfg, nodes: int | None = None,
             steps: int | None = None, out_dir: str | None = None) -> JobPlan:
    """Layout (:func:`job_size`), global batch = GPUs x ``cfg.data.batch_size`` x
    ``cfg.dist.backward_passes_per_step`` and peak LR = ``scaled_lr(cfg.optim.lr,
    cfg.optim.lr_ref_batch, global batch, cfg.optim.lr_rule, cfg.optim.lr_cap)``, exactly as
    ``hvd-lm train`` computes it at that world size.

    Raises:
        ValueError: as :func:`job_size`.
    """
    size = job_size(gpus, gpus_per_node, nodes)
    gb = gpus * cfg.data.batch_size * cfg.dist.backward_passes_per_step
    lr = scaled_lr(cfg.optim.lr, cfg.optim.lr_ref_batch, gb, cfg.optim.lr_rule, cfg.optim.lr_cap)
    return JobPlan(gpus, size.nodes, size.tasks_per_node, gb, lr, steps, out_dir)


def sweep_table(jobs: list[JobPlan]) -> str:
    """The sweep as a text table: GPUs, nodes, global batch, LR, steps, script."""
    rows = [f"{'GPUs':>5} {'nodes':>5} {'global batch':>12} {'LR':>9} {'steps':>7}  script"]
    rows += [f"{j.gpus:>5} {j.nodes:>5} {j.global_batch:>12} {j.lr:>9.3g} {j.steps:>7}  {j.script}"
             for j in jobs]
    return "\n".join(rows)


def _lr_rule_text(cfg) -> str:
    o = cfg.optim
    cap = f", cap {o.lr_cap:g}" if o.lr_cap is not None else ""
    return f"LR rule {o.lr_rule}: {o.lr:g} at global batch {o.lr_ref_batch}{cap}"


#: ``--lr-rule none`` at this many times the reference batch or more gets a warning line.
LR_RULE_NONE_WARN_RATIO = 32


def lr_warning(cfg, job: JobPlan) -> str:
    """``WARNING: ...`` when the training keeps its LR unscaled (``--lr-rule none``) at a global
    batch :data:`LR_RULE_NONE_WARN_RATIO` or more times ``--lr-ref-batch``; else ''."""
    o = cfg.optim
    if o.lr_rule != "none" or job.global_batch < LR_RULE_NONE_WARN_RATIO * o.lr_ref_batch:
        return ""
    return (f"WARNING: LR rule none at global batch {job.global_batch}, "
            f"{job.global_batch / o.lr_ref_batch:g}x its reference {o.lr_ref_batch}: the peak LR "
            f"stays {job.lr:.4g}, as at {o.lr_ref_batch}; scale it with --lr-rule sqrt (or "
            "linear, with --lr-cap)")


def _parse_counts(text: str) -> list[int]:
    """The GPU counts of ``--sweep N,N,...``, fewest first.

    Raises:
        ValueError: not integers, one below 1, none, or one given twice.
    """
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep expects comma-separated GPU counts, got {text!r}") from None
    if any(c < 1 for c in counts):
        raise ValueError(f"--sweep GPU counts must be >= 1, got {text!r}")
    if not counts or len(set(counts)) != len(counts):
        raise ValueError(f"--sweep needs distinct GPU counts, got {counts}")
    return sorted(counts)


def _unit(device: str) -> str:
    """What one rank is: a GPU (``--device cuda``) or a CPU rank (``--device cpu``)."""
    return "rank" if device == "cpu" else "GPU"


def _size_text(job: JobPlan, device: str) -> str:
    """``16 GPUs = 2 node(s) x 8`` (cuda) or ``2 ranks = 2 node(s) x 1`` (cpu: no GPU asked)."""
    return (f"{job.gpus} {_unit(device)}s = {job.nodes} node(s) x {job.tasks_per_node}"
            + (" (CPU, no GPU requested)" if device == "cpu" else ""))


def _render_job(args: LaunchConfig, job: JobPlan, train_args: list[str], job_name: str,
                cfg, templates: Path) -> str:
    per_gpu = cfg.data.batch_size * cfg.dist.backward_passes_per_step
    if job.steps is not None:
        train_args = [*train_args, "--max-steps", str(job.steps)]
    else:
        limit = derived_time_limit(args.walltime, args.time_margin, cfg, args.scheduler)
        train_args = [*train_args, *(["--time-limit", limit] if limit is not None else []),
                      *(["--time-budget", args.time_budget] if args.time_budget else [])]
    if warning := lr_warning(cfg, job):
        print(f"hvd-lm launch: {warning}", file=sys.stderr)
    kind = "Scaling sweep job, rendered" if args.sweep else "Rendered"
    header = (f"{kind} by `hvd-lm launch --scheduler {args.scheduler}`: its knobs and directives "
              "are filled in, the rest is the template",
              f"{_size_text(job, args.device)}; global batch {job.global_batch} ({per_gpu} per "
              f"{_unit(args.device)}); peak LR at that batch {job.lr:.4g} ({_lr_rule_text(cfg)})"
              + (f"; {job.steps} steps" if job.steps else ""), *([warning] if warning else []))
    same = {f.name: getattr(args, f.name) for f in fields(RenderSpec) if hasattr(args, f.name)}
    return render(RenderSpec(**{
        **same, "size": job_size(job.gpus, job.tasks_per_node, job.nodes), "out_dir": job.out_dir,
        "train_args": tuple(train_args), "job_name": job_name, "header": header,
        "hosts": _hosts(args.hosts, job.tasks_per_node)}), templates)


def _hosts(text: str | None, per_node: int) -> tuple[str, ...]:
    """The node names of ``--hosts`` (:func:`hvd_lm.comm.hosts.parse_hosts`: ``n1,n2`` or
    SLURM's ``n[001-004,7]``); slots, when given, must be the job's ranks per node."""
    hosts = parse_hosts(text) if text else []
    if text and ":" in text and {n for _, n in hosts} != {per_node}:
        raise ValueError(f"--hosts {text!r}: the job runs {per_node} ranks on each node; give "
                         f"the node names alone (n[001-004,7]) or with :{per_node}")
    return tuple(h for h, _ in hosts)


#: SLURM's warning before the walltime: launch/slurm.sbatch's ``#SBATCH --signal=B:USR1@120``.
SLURM_SIGNAL_LEAD_S = 120
#: How much earlier SLURM may deliver it: "the signal may be sent up to 60 seconds earlier than
#: specified" (sbatch's ``--signal`` documentation).
SLURM_SIGNAL_EARLY_S = 60
#: The least of a SLURM margin left to the job's start (allocation, launcher, imports) once the
#: signal's window is set aside.
MIN_START_S = 30


def derived_time_limit(walltime: str | None, margin: str, cfg,
                       scheduler: str = "slurm") -> str | None:
    """The ``--time-limit`` a job rendered with ``--walltime`` gives its training: the walltime
    less ``margin`` (the job's start: allocation, launcher, imports, shard verification), so
    the LR reaches 0 and the final checkpoint is written before the scheduler kills the job.
    None without a walltime, with a margin of 0, or when the training flags set a time limit.
    The walltime is read as ``scheduler`` reads it (a bare number: minutes for sbatch, seconds
    for qsub; :func:`hvd_lm.util.units.parse_duration`). Under SLURM the training must end
    before the script's warning signal too, which comes :data:`SLURM_SIGNAL_LEAD_S` before the
    walltime and up to :data:`SLURM_SIGNAL_EARLY_S` earlier: a signal in the middle of the
    run's last minutes checkpointed it and requeued the job, every allocation again (a requeue
    loop), and one after its end failed a finished job.

    Raises:
        ValueError: the margin is not a duration, not below the walltime (naming both), or under
            SLURM below the signal's window plus :data:`MIN_START_S` (naming both numbers).
    """
    if not walltime or cfg.run.time_limit or str(margin).strip() in ("0", "none", ""):
        return None
    total = parse_duration(walltime, "--walltime", bare="seconds" if scheduler == "pbs" else
                           "minutes")
    keep = parse_duration(margin, "--time-margin")
    least = SLURM_SIGNAL_LEAD_S + SLURM_SIGNAL_EARLY_S + MIN_START_S
    if scheduler == "slurm" and keep < least and keep < total:
        raise ValueError(
            f"--time-margin {margin} ({keep} s) would let the training run into SLURM's warning "
            f"signal: the job's --signal=B:USR1@{SLURM_SIGNAL_LEAD_S} comes {SLURM_SIGNAL_LEAD_S}"
            f" s before the walltime and up to {SLURM_SIGNAL_EARLY_S} s earlier (sbatch's --signal "
            f"docs), so the training must end {least - MIN_START_S} s before it, after a start of "
            f"at least {MIN_START_S} s: give --time-margin {least}s or more (the default 5m fits)")
    if keep >= total:
        reader = "qsub" if scheduler == "pbs" else "sbatch"
        raise ValueError(f"--time-margin {margin} ({keep} s) is not below --walltime {walltime} "
                         f"({total} s, as {reader} reads it): no time is left to train; give "
                         "a longer walltime, a shorter margin, or --time-margin 0 (no "
                         "--time-limit for the training)")
    return f"{total - keep}s"


def _write_script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text)
    path.chmod(0o755)


def launch(args: LaunchConfig) -> int:
    """Write (or print) one rendered script, or a sweep directory (:class:`LaunchConfig`).

    Raises:
        ValueError, KeyError, FileNotFoundError: a size, flag or template problem.
    """
    train_args = list(args.train_args)
    while train_args and train_args[0] == "--":  # argparse may keep the separator
        train_args.pop(0)
    templates = Path(args.template_dir) if args.template_dir else template_dir()
    if not args.sweep and args.out not in (None, "-"):  # never over its training config
        check_output(args.out, "--out", *([args.config] if args.config else []),
                     templates / SCHEDULERS[args.scheduler])
    torch_engine = args.engine == "torch" or args.scheduler == "torchrun"
    cfg = train_config(args.config, ["--backend", "torch", *train_args] if torch_engine
                       else train_args)
    submit_with = SUBMIT[args.scheduler]

    if not args.sweep:
        if args.gpus is None:
            raise ValueError("--gpus is required (or --sweep)")
        gpn = args.gpus_per_node or (args.gpus if args.scheduler == "horovodrun" else 8)
        job = plan_job(args.gpus, gpn, cfg, args.nodes, out_dir=args.run_dir)
        text = _render_job(args, job, train_args, args.job_name, cfg, templates)
        if args.out in (None, "-"):
            sys.stdout.write(text)
        else:
            _write_script(Path(args.out), text)
            print(f"wrote {args.out} ({_size_text(job, args.device)}); "
                  f"start it with: {submit_with} {args.out}", file=sys.stderr)
        return 0

    if args.gpus is not None or args.nodes is not None:
        raise ValueError("--sweep sets the GPU and node counts: drop --gpus/--nodes")
    if not (steps := args.steps or cfg.optim.max_steps):
        raise ValueError("a sweep needs a step count per job: --steps N (or --max-steps after --)")
    out = Path(args.out or "sweep")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} must be a directory for --sweep")
    gpn = args.gpus_per_node or 8
    runs_dir = (args.run_dir or "runs/scaling").rstrip("/")
    # weak scaling: the per-GPU batch fixed (plan_job), steps each, a run folder per GPU count
    jobs = [plan_job(g, gpn, cfg, steps=steps, out_dir=f"{runs_dir}/g{g:03d}")
            for g in _parse_counts(args.sweep)]
    template = Path(SCHEDULERS[args.scheduler])
    for job in jobs:
        path = out / f"{template.stem}_g{job.gpus:03d}{template.suffix}"
        _write_script(path, _render_job(args, job, train_args, f"{args.job_name}-g{job.gpus}",
                                        cfg, templates))
        job.script = str(path)
    how = "one after another" if submit_with == "bash" else "into the queue"
    _write_script(out / "submit_all.sh", (
        "#!/usr/bin/env bash\n"
        f"# Start every job of the scaling sweep ({how}). Run it from the directory the runs\n"
        f"# should go under ({runs_dir}/gNNN is relative to it).\n"
        'set -euo pipefail\nsweep_dir="$(dirname "${BASH_SOURCE[0]}")"\n'
        + "".join(f'{submit_with} "$sweep_dir/{Path(j.script).name}"\n' for j in jobs)))
    per_gpu = cfg.data.batch_size * cfg.dist.backward_passes_per_step
    write_text(out / "sweep.json", json.dumps({
        "scheduler": args.scheduler, "gpus_per_node": gpn, "per_gpu_batch": per_gpu,
        "lr": cfg.optim.lr, "lr_ref_batch": cfg.optim.lr_ref_batch, "lr_rule": cfg.optim.lr_rule,
        "lr_cap": cfg.optim.lr_cap, "jobs": [asdict(j) for j in jobs]}, indent=2) + "\n")
    print(f"scaling sweep ({args.scheduler}, {gpn} GPUs per node): per-GPU batch {per_gpu} fixed "
          f"(weak scaling), {_lr_rule_text(cfg)}")
    print(sweep_table(jobs))
    print(f"start all: bash {out / 'submit_all.sh'}; then, from a checkout: "
          f"python -m benchmarks scaling-report {runs_dir}/g*")
    return 0


@dataclass
class LaunchConfig:
    """Settings of ``hvd-lm launch`` (flags only: its ``--config`` is the training YAML the
    rendered job passes to ``hvd-lm train``)."""

    scheduler: str = option("", "which template: " + ", ".join(
        f"{k} ({v})" for k, v in SCHEDULERS.items()), choices=tuple(SCHEDULERS), required=True)
    # size
    gpus: Optional[int] = option(None, "world size: ranks = GPUs, one rank per GPU", ge=1)
    gpus_per_node: Optional[int] = option(None, "ranks (GPUs) per node (default 8, a DGX-1 as in "
                                          "the reference; horovodrun: all on one node)", ge=1)
    nodes: Optional[int] = option(None, "nodes (default: derived; checked when given)", ge=1)
    sweep: str = option("", "weak-scaling study: one job per GPU count, e.g. "
                        "1,8,16,32,64,128; --out is then a directory", metavar="N,N,...")
    steps: Optional[int] = option(None, "--sweep: optimizer steps per job (default: --max-steps "
                                  "after --)", ge=1)
    device: str = option("cuda", "cuda asks the scheduler for one GPU per rank; cpu renders the "
                         "same ranks without a GPU request (CPU clusters, tests)",
                         choices=("cuda", "cpu"))
    cpus_per_task: Optional[int] = option(None, "CPU cores per rank for its threads (SLURM "
                                           "--cpus-per-task; PBS ncpus = ranks per node x this, "
                                           "default 4 per GPU rank, 1 per CPU rank)", ge=1)
    # scheduler
    partition: Optional[str] = option(None, "SLURM partition / PBS queue (default: the "
                                      "cluster's)", aliases=("--queue",))
    walltime: Optional[str] = option(
        None, "time limit in sbatch's --time forms (M, M:S, H:M:S, D-H[:M[:S]]; PBS: [[H:]M:]S, a "
        "bare number is seconds) or 4h-style, written into the job as given; the training gets "
        "--time-limit = walltime - --time-margin (not in a --sweep: its jobs run fixed steps)")
    time_margin: str = option("5m", "with --walltime: the part of it the training's --time-limit "
                              "leaves to the job's start and end (0: no --time-limit)")
    time_budget: Optional[str] = option(
        None, "the training's --time-budget: its time over every allocation (40h, 2d...); with "
        "--walltime each job trains its --time-limit of it and (SLURM) requeues itself until the "
        "budget is spent, the LR reaching 0 at its end", parse=duration_text)
    job_name: str = option("hvd-lm", "job name (SLURM, PBS)")
    launcher: Optional[str] = option(None, "SLURM: how ranks start inside the allocation "
                                     "(template default srun)", choices=("srun", "mpirun"))
    elastic: bool = option(False, "elastic Horovod (slurm: horovodrun over the allocation with "
                           "launch/discover_hosts.sh dropping failed nodes; training with "
                           "--elastic true)", switch=True)
    min_np: Optional[int] = option(None, "elastic: fewest ranks the job continues with "
                                   "(template default 1)", ge=1)
    controller: Optional[str] = option(None, "horovodrun: Horovod controller (template default "
                                       "gloo)", choices=("gloo", "mpi"))
    engine: Optional[str] = option(
        None, "collective engine the job trains on: horovod (templates' default) or torch "
        "(--backend torch: torch.distributed; slurm: srun starts one rank per GPU; mpirun, pbs; "
        "--scheduler torchrun always)", choices=("horovod", "torch"))
    hosts: Optional[str] = option(None, "horovodrun-multinode/mpirun/torchrun: comma-separated "
                                  "node names, one per node, or SLURM's n[001-004,7] (default: "
                                  "a hostfile named 'hostfile'; torchrun: the first hosts the "
                                  "rendezvous)")
    network_interface: Optional[str] = option(None, "horovodrun-multinode/torchrun: NIC, e.g. ib0")
    # run
    config: Optional[str] = option(None, "YAML training config (hvd-lm train --config)")
    run_dir: Optional[str] = option(None, "training out-dir (default: the template's; sweep: "
                                    "runs/scaling/gNNN)")
    python: Optional[str] = option(None, "Python with hvd_lm + horovod (default: this one)")
    out: Optional[str] = option(None, "file to write (default: stdout); --sweep: directory "
                                "(default ./sweep)")
    template_dir: Optional[str] = option(None, "templates (default: the repository's launch/)")
    train_args: list[str] = option(default_factory=list, help="hvd-lm train flags after --, "
                                   "e.g. -- --shards data/amazon --lr-rule sqrt",
                                   positional=True, metavar="-- TRAIN_FLAGS")


LAUNCH = Command(
    LaunchConfig, launch, config_flag=False, usage_errors=(ValueError, KeyError, FileNotFoundError),
    description="Render a launch template (launch/) for a scheduler and size, or write the jobs "
    "of a weak-scaling sweep. Flags after -- are hvd-lm train flags.",
    epilog="examples:\n"
    "  hvd-lm launch --scheduler slurm --gpus 128 --gpus-per-node 8 --walltime 4:00:00 "
    "--out job.sbatch -- --shards data/amazon\n"
    "  hvd-lm launch --scheduler slurm --sweep 1,8,16,32,64,128 --steps 200 --out sweep -- "
    "--shards data/amazon --batch-size 32 --lr-rule sqrt --lr-cap 3e-3")
