"""``python -m benchmarks checkpoint``: the training step time around a checkpoint, written
synchronously and in the background (:class:`hvd_lm.train.checkpointer.CheckpointWriter`), side by
side in one run.

One process trains the LM (``--hidden-size``, default 2048: a 266 MB checkpoint with Adam's
state, large enough for the write to show) with the loop's own step
(:func:`hvd_lm.train.step.train_step`, Adam) on random bytes. Each round runs ``--steps`` steps
and checkpoints after step ``--checkpoint-after`` exactly as the loop does (the payload of
:func:`hvd_lm.train.resume.payload`, rank 0's :class:`~hvd_lm.train.checkpointer.
CheckpointWriter`), then waits for the write at the end of the round. Rounds alternate between
the two modes (``--repeats`` each), so a drifting machine load hits both alike.

Per mode (medians over its rounds): the step time (the round's steps that did not overlap the
write); the write's own seconds; **blocked**, what the loop waited in the checkpoint call (the
whole write when synchronous; the host copy in the background mode); the mean step while the
background write was in flight (against the step time: the write's contention for cores,
memory bandwidth and the GIL); the wait for the write at the end of the round (a write longer
than the round's remaining steps); and the **stall**, what one checkpoint cost training:
blocked + the steps during the write less as many step times + the end wait. The headline is
the stall's ratio, background over synchronous.

Checkpoints go to ``--out-dir`` (default: a temporary folder, removed afterwards; give a folder
on the file system checkpoints really go to, e.g. a cluster's shared one, to measure that).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness import lm_step, medians, print_table, random_batches, save_json
from hvd_lm import options
from hvd_lm.model.lm import ModelConfig
from hvd_lm.options import Command, option
from hvd_lm.train.checkpointer import CheckpointWriter
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.resume import Position, payload
from hvd_lm.train.schedule import LRPlan
from hvd_lm.train.step import train_step

MODES = ("sync", "async")


@dataclass
class BenchCheckpointConfig:
    """``python -m benchmarks checkpoint`` (module docstring)."""

    hidden_size: int = option(2048, "mLSTM width H (2048: a 266 MB checkpoint with Adam)", ge=1)
    embed_dim: int = option(64, "byte embedding width", ge=1)
    batch_size: int = option(4, "rows per step", ge=1)
    seq_len: int = option(16, "TBPTT window, chars", ge=1)
    steps: int = option(10, "steps per round", ge=2)
    checkpoint_after: int = option(3, "the checkpoint follows this step of each round", ge=1)
    repeats: int = option(5, "rounds per mode, the modes alternating", ge=1)
    threads: int = option(1, "torch threads (the write gets the cores training leaves)", ge=1)
    added_write_latency: float = option(0.0, "seconds the writer also sleeps before each write, "
                                        "as a file system whose writes block without using "
                                        "the CPU (a network file system) would add "
                                        "(HVD_LM_CHECKPOINT_SLEEP)", ge=0)
    out_dir: str = option("", "folder the checkpoints are written to ('' = a temporary folder, "
                          "removed afterwards)")
    json: str = option("", "also write the results to this JSON file")

    def check(self) -> None:
        """The checkpoint falls inside a round."""
        if self.checkpoint_after >= self.steps:
            raise ValueError(f"checkpoint_after ({self.checkpoint_after}) must be below steps "
                             f"({self.steps})")


def one_round(cfg: BenchCheckpointConfig, mode: str, job, out: Path, index: int) -> dict:
    """One round (module docstring): step times, which steps overlapped the write, the time the
    loop was blocked by the checkpoint and waited for it at the end, and the stall."""
    writer = CheckpointWriter(mode == "async", lambda w: setattr(job, "last", w))
    times, during, blocked = [], [], 0.0
    for i in range(cfg.steps):
        in_flight = writer.in_flight
        t0 = time.perf_counter()
        job.state = train_step(job.model, job.opt, job.scaler, [job.batches[i]], job.state,
                               job.spec).state
        times.append(time.perf_counter() - t0)
        if in_flight:
            during.append(i)
            writer.poll()
        if i + 1 == cfg.checkpoint_after:
            tb = time.perf_counter()
            step = index * cfg.steps + i + 1
            writer.submit(payload(Position(step, step), job.model, job.opt, job.sched, job.scaler,
                                  job.guard, job.state, {"bench": "checkpoint"}, 1), out, step,
                          keep=1)
            blocked = time.perf_counter() - tb
    tw = time.perf_counter()
    writer.wait()
    tail = time.perf_counter() - tw
    base = statistics.median(t for i, t in enumerate(times) if i not in during)
    return {"mode": mode, "step_s": base, "blocked_s": blocked, "tail_wait_s": tail,
            "stall_s": blocked + sum(times[i] - base for i in during) + tail,
            "write_s": job.last.write_s, "steps_during_write": len(during),
            "step_during_write_s": statistics.mean(times[i] for i in during) if during else None,
            "step_times_s": times}


def bench_checkpoint(cfg: BenchCheckpointConfig) -> int:
    """Print (and with ``--json`` save) the table of the module docstring."""
    torch.set_num_threads(cfg.threads)
    old_sleep = os.environ.pop("HVD_LM_CHECKPOINT_SLEEP", None)
    if cfg.added_write_latency:
        os.environ["HVD_LM_CHECKPOINT_SLEEP"] = str(cfg.added_write_latency)
    load_before = os.getloadavg()[0]
    B, T = cfg.batch_size, cfg.seq_len
    job = lm_step(ModelConfig(hidden_size=cfg.hidden_size, embed_dim=cfg.embed_dim),
                  torch.device("cpu"), "fp32", B)
    job.sched, job.guard = LRPlan(1e-3, 0, 10 ** 6, "none"), DivergenceGuard(10.0, 3, 0)
    job.batches = random_batches(cfg.steps, B, T, 1)
    out = Path(cfg.out_dir or tempfile.mkdtemp(prefix="hvd_lm_bench_checkpoint_"))
    rounds: list[dict] = []
    try:
        train_step(job.model, job.opt, job.scaler, job.batches[:1], job.state,
                   job.spec)  # warm-up (Adam's state made)
        for rep in range(cfg.repeats):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                rounds.append(one_round(cfg, mode, job, out, len(rounds)))
                print(f"round {len(rounds)} {mode:5}: stall {rounds[-1]['stall_s']:.3f} s, "
                      f"write {rounds[-1]['write_s']:.3f} s", flush=True)
        size = max(p.stat().st_size for p in (out / "checkpoints").glob("step_*.pt"))
    finally:
        os.environ.pop("HVD_LM_CHECKPOINT_SLEEP", None)
        if old_sleep is not None:
            os.environ["HVD_LM_CHECKPOINT_SLEEP"] = old_sleep
        if not cfg.out_dir:
            shutil.rmtree(out, ignore_errors=True)
    summary = {mode: medians([r for r in rounds if r["mode"] == mode], (
        "step_s", "stall_s", "blocked_s", "tail_wait_s", "write_s", "step_during_write_s"))
        for mode in MODES}
    ratio = summary["async"]["stall_s"] / summary["sync"]["stall_s"]
    load = (load_before, os.getloadavg()[0])
    print(f"model: mlstm H={cfg.hidden_size} E={cfg.embed_dim}, batch {B} x {T} chars, "
          f"{cfg.threads} thread(s); checkpoint {size / 1e6:.0f} MB to "
          f"{cfg.out_dir or 'a temporary folder'}"
          + (f", {cfg.added_write_latency:g} s added to each write" if cfg.added_write_latency
             else "") + f"; load average {load[0]:.1f} before, {load[1]:.1f} after "
          f"({os.cpu_count()} cores)")
    print_table([summary[m] | {"mode": m} for m in MODES], [
        ("mode", "6", "mode"), ("step s", ">8.3f", "step_s"), ("write s", ">8.3f", "write_s"),
        ("blocked s", ">9.3f", "blocked_s"),
        ("step during write s", ">19.3f", "step_during_write_s"),
        ("end wait s", ">10.3f", "tail_wait_s"), ("stall s", ">8.3f", "stall_s")])
    print(f"stall per checkpoint, async / sync: {ratio:.3f} (medians of {cfg.repeats} rounds "
          "each, alternating)")
    save_json(cfg.json, {"checkpoint_bytes": size, "load_average": load,
                         "cpu_count": os.cpu_count(), **summary,
                         "stall_ratio_async_over_sync": ratio, "rounds": rounds,
                         "args": options.to_dict(cfg)})
    return 0


BENCH_CHECKPOINT = Command(BenchCheckpointConfig, bench_checkpoint,
                           description=__doc__.split("\n\n")[1])
