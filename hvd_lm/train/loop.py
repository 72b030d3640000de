"""The training loop: data-parallel TBPTT training of the byte-level LM with Horovod.

One optimizer step (per rank, B rows x T bytes per window, ``backward_passes_per_step`` = k):

1. k windows: forward with the carried (detached) state, loss = mean NLL over the window's real
   targets / k in fp32, backward (scaled by the loss scaler under fp16); Horovod's hooks start the
   fp16-compressed, fused allreduce of each gradient as soon as it is ready.
2. ``clip_and_step`` (hvd_lm.dist.horovod): wait for the allreduce, unscale, clip, step — or skip
   the step when the gradients overflowed / are not finite (counted; the LR schedule does not
   advance on a skipped step).
3. Every ``run.control_every`` step attempts, one tiny allreduce of control flags (a preemption
   signal or a due time-based checkpoint on any rank stops or checkpoints every rank at the same
   step).

The host does not wait on the device per window: the next window is read ahead on a thread
(``train.data.Prefetcher``), the loss is summed on the device and read at log time, and the one
per-step sync is the gradient norm's finiteness check in ``clip_and_step``.

Rank 0 logs (tqdm bar, a line every ``log_every`` steps, ``metrics.jsonl``, TensorBoard when
installed) and writes checkpoints; metrics are sums over ranks. Every Horovod call is marked
``# Horovod:`` where it happens (as Horovod's ``examples/pytorch`` scripts do).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from hvd_lm.core.atomic import write_text
from hvd_lm.core.config import Command
from hvd_lm.core.model import LanguageModel
from hvd_lm.core.shards import load_manifest, verify_shard
from hvd_lm.dist import horovod as dist
from hvd_lm.train import checkpoint as ckpt_io
from hvd_lm.train import runtime
from hvd_lm.train.config import TrainConfig, save_yaml
from hvd_lm.train.data import Prefetcher, RankStreams
from hvd_lm.train.evaluate import bpc as eval_bpc
from hvd_lm.train.evaluate import window_nll
from hvd_lm.train.faults import Faults
from hvd_lm.train.log import MetricsLog, StopSignals
from hvd_lm.train.optim import build_optimizer
from hvd_lm.train.schedule import make_scheduler, scaled_lr

LN2 = math.log(2.0)


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training as configured; returns a summary dict (on every rank).

    Raises:
        ValueError: bad configuration or data (naming the field / file).
        ShardChecksumError: a shard does not match its manifest checksum.
    """
    # ---- process: Horovod, device, precision, threads ---------------------------------------------
    ctx = dist.init(cfg.dist.fusion_threshold_mb, cfg.dist.cycle_time_ms)  # Horovod: init
    device = runtime.resolve_device(cfg.run.device, ctx.local_rank)
    runtime.check(device, cfg.run.precision)
    threads = cfg.run.threads or max(1, (os.cpu_count() or 1) // ctx.local_size)
    torch.set_num_threads(threads)
    out_dir = Path(cfg.run.out_dir)
    if ctx.is_root:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, out_dir / "config.yaml")

    # ---- data: this rank's B streams of the train split (and of the val split) -----------------------
    if not cfg.data.shards:
        raise ValueError("data.shards is not set (--shards DIR)")
    manifest = load_manifest(cfg.data.shards)
    B, T, k = cfg.data.batch_size, cfg.data.seq_len, cfg.dist.backward_passes_per_step
    streams = RankStreams(manifest, cfg.data.train_split, ctx.rank, ctx.size, B, T,
                          seed=cfg.data.seed)
    if cfg.data.verify_shards:  # each rank verifies a disjoint subset of the shards
        for i, info in enumerate(manifest.shards):
            if i % ctx.size == ctx.rank:
                verify_shard(info)
    val = None
    if cfg.data.val_split and any(s.split == cfg.data.val_split for s in manifest.shards):
        val = RankStreams(manifest, cfg.data.val_split, ctx.rank, ctx.size, B, T,
                          shuffle_shards=False, max_bytes=cfg.run.eval_chars)

    # ---- model, optimizer, schedule length ---------------------------------------------------------
    torch.manual_seed(cfg.data.seed)
    model = LanguageModel(cfg.model).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    global_batch = ctx.size * B * k
    peak_lr = scaled_lr(cfg.optim.lr, cfg.optim.lr_ref_batch, global_batch, cfg.optim.lr_rule,
                        cfg.optim.lr_cap)
    windows_per_epoch = streams.steps_per_epoch
    # Decay to 0 over --max-steps or --epochs, whichever comes first (epochs <= 0: steps only).
    total_windows = int(cfg.data.epochs * windows_per_epoch) if cfg.data.epochs > 0 else sys.maxsize
    total_steps = total_windows // k
    if cfg.optim.max_steps:
        total_steps = min(total_steps, cfg.optim.max_steps)
    if total_steps < 1:
        raise ValueError(f"no optimizer step fits: {windows_per_epoch} windows per epoch x "
                         f"{cfg.data.epochs} epochs / {k} backward passes per step")
    optimizer = build_optimizer(model, cfg.optim, peak_lr)
    scaler = runtime.make_scaler(device, cfg.run.precision)

    # ---- resume: weights, position, recurrent state, RNG (optimizer state after wrapping) -------------
    pos = ckpt_io.Position()
    rnn_state = model.init_state(B, device)
    resume = None
    if cfg.run.resume:
        resume = ckpt_io.Resume(out_dir if cfg.run.resume == "auto" else cfg.run.resume, device)
        resume.restore_model(model, scaler)
        pos = resume.position
        rnn_state = resume.rnn_rows(ctx.rank, ctx.size, B, device, warn=ctx.is_root) or rnn_state
        resume.restore_rng()

    # Horovod: wrap the optimizer (gradient allreduce with fp16 compression and tensor fusion).
    optimizer = dist.distributed_optimizer(optimizer, model, cfg.dist.compression, k,
                                           cfg.dist.allreduce_op)
    # The scheduler wraps the Horovod optimizer's step(), so it sees the steps really taken.
    scheduler = make_scheduler(optimizer, cfg.optim.warmup_steps, total_steps, cfg.optim.lr_decay)
    if resume is not None:
        resume.restore_optimizer(optimizer, scheduler)
        resume.release()
    # Horovod: every rank starts from rank 0's weights (and optimizer state when resuming; an
    # empty Adam state would make Horovod take a zero-gradient step to create it, so not then).
    dist.broadcast_state(model, optimizer if resume is not None else None)

    # ---- outputs and control ---------------------------------------------------------------------
    log = MetricsLog(out_dir, ctx.is_root, total_steps, pos.step, cfg.run.tensorboard)
    log.record("start", pos.step, world_size=ctx.size, device=str(device),
               global_batch=global_batch, peak_lr=peak_lr, total_steps=total_steps,
               windows_per_epoch=windows_per_epoch, chars_per_epoch=streams.chars_per_epoch,
               params=sum(p.numel() for p in params), precision=cfg.run.precision,
               compression=cfg.dist.compression, threads=threads,
               resumed_from=str(resume.path) if resume else None)
    signals = StopSignals()
    faults = Faults(ctx.rank, cfg.run.inject_nan_steps)
    chars_base, chars_local = pos.chars_trained, 0  # all ranks before this job; this rank since
    last_ckpt_time = time.time()
    acc = {"nats": 0.0, "chars": 0.0, "wait": 0.0, "busy": 0.0, "t0": time.perf_counter(),
           "steps": 0}

    def chars_total() -> int:
        # Horovod: characters trained on by all ranks, exact across world-size changes.
        return chars_base + int(dist.allreduce_sum([float(chars_local)], name="chars_total")[0])

    def save_checkpoint() -> None:
        # Horovod: gather every rank's recurrent state rows (rank order) for an exact resume.
        h = dist.allgather(rnn_state[0].detach().float().cpu(), name="ckpt_h")
        c = dist.allgather(rnn_state[1].detach().float().cpu(), name="ckpt_c")
        position = ckpt_io.Position(pos.step, pos.window, pos.skipped_steps, chars_total())
        if ctx.is_root:
            path = ckpt_io.save(ckpt_io.payload(position, model, optimizer, scheduler, scaler,
                                                (h, c), cfg.to_dict(), ctx.size),
                                out_dir, pos.step, cfg.run.keep_checkpoints)
            log.record("checkpoint", pos.step, path=str(path))

    def validate() -> None:
        if val is None:
            return
        v_bpc, v_chars = eval_bpc(model, val, device, cfg.run.precision)  # Horovod: sums bits
        model.train()
        log.record("eval", pos.step, val_bpc=v_bpc, val_chars=v_chars)

    # ---- the loop ---------------------------------------------------------------------------------
    model.train()
    stop_reason = "done"
    # Issue 12: window i+1's bytes are read on a background thread while window i trains.
    batches = Prefetcher(streams, limit=total_windows, pin_memory=device.type == "cuda")
    while pos.step < total_steps and pos.window + k <= total_windows:
        t_step = time.perf_counter()
        faults.before_step(pos.step)

        # forward + backward over k windows; Horovod's hooks allreduce each gradient when ready
        nats_step, chars_step = 0.0, 0
        for _ in range(k):
            batch = batches.get(pos.window)  # Issue 12: prefetched (was streams.window(...))
            nats, rnn_state = window_nll(model, batch, rnn_state, device, cfg.run.precision)
            loss = faults.loss(nats / max(1, batch.chars) / k, pos.step + pos.skipped_steps)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            # Issue 12: summed on the device (a 0-d tensor), read only at log time: no host sync
            nats_step = nats_step + nats.detach().double()
            chars_step += batch.chars
            pos.window += 1

        # Horovod: wait for the allreduce, unscale, clip, step (or skip a non-finite step)
        applied, grad_norm, wait = dist.clip_and_step(optimizer, params, cfg.optim.grad_clip,
                                                      scaler, cfg.run.nan_check)
        optimizer.zero_grad()
        if applied:
            scheduler.step()
            pos.step += 1
        else:
            pos.skipped_steps += 1
            if not all(bool(torch.isfinite(s).all()) for s in rnn_state):
                rnn_state = model.init_state(B, device)
            log.record("skip", pos.step, skipped_steps=pos.skipped_steps, grad_norm=grad_norm,
                       loss_scale=scaler.get_scale() if scaler is not None else None)

        # bookkeeping for the next log line
        chars_local += chars_step
        acc["nats"] += nats_step
        acc["chars"] += chars_step
        acc["wait"] += wait
        acc["busy"] += time.perf_counter() - t_step
        acc["steps"] += 1

        # Horovod: control flags; any rank's signal stops all, rank 0's clock times checkpoints.
        # Issue 12: every control_every attempts (the same attempts on every rank), not per step.
        stop_flag = due_flag = 0.0
        if (pos.step + pos.skipped_steps) % cfg.run.control_every == 0:
            due = (cfg.run.checkpoint_minutes > 0 and ctx.is_root
                   and time.time() - last_ckpt_time >= 60 * cfg.run.checkpoint_minutes)
            stop_flag, due_flag = dist.allreduce_sum(
                [1.0 if signals.received else 0.0, 1.0 if due else 0.0], name="control")

        # log a line every log_every steps (Horovod: metrics summed over ranks)
        log.tick(1 if applied else 0)
        if applied and (pos.step % cfg.run.log_every == 0 or pos.step == total_steps):
            nats, chars, waits, busy = dist.allreduce_sum(  # float(): the device sum, read now
                [float(acc["nats"]), acc["chars"], acc["wait"], acc["busy"]], name="log")
            wall = time.perf_counter() - acc["t0"]
            loss = nats / max(1.0, chars)
            log.record("train", pos.step, loss=loss, bpc=loss / LN2,
                       lr=scheduler.get_last_lr()[0],
                       loss_scale=scaler.get_scale() if scaler is not None else None,
                       chars_per_s=chars / wall, step_time=wall / acc["steps"],
                       allreduce_wait=waits / max(busy, 1e-9), grad_norm=grad_norm,
                       skipped_steps=pos.skipped_steps, epoch=pos.window / windows_per_epoch)
            acc.update(nats=0.0, chars=0.0, wait=0.0, busy=0.0, t0=time.perf_counter(), steps=0)

        # validate every eval_every steps
        if applied and cfg.run.eval_every and pos.step % cfg.run.eval_every == 0:
            validate()

        # checkpoint: on a stop signal (then leave), every checkpoint_every steps, or when due
        if stop_flag > 0:
            stop_reason = "signal"
            save_checkpoint()
            break
        if applied and ((cfg.run.checkpoint_every and pos.step % cfg.run.checkpoint_every == 0)
                        or due_flag > 0):
            save_checkpoint()
            last_ckpt_time = time.time()

    # ---- the end: final validation and checkpoint, summary ---------------------------------------------
    batches.close()
    if stop_reason == "done":
        if not (cfg.run.eval_every and pos.step % cfg.run.eval_every == 0):
            validate()
        save_checkpoint()
    summary = {"stop": stop_reason, "step": pos.step, "skipped_steps": pos.skipped_steps,
               "chars_trained": chars_total(), "world_size": ctx.size}
    if ctx.is_root:
        log.record("end", pos.step, **{k: v for k, v in summary.items() if k != "step"})
        write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    log.close()
    return summary


def train_command(cfg: TrainConfig) -> int:
    """``hvd-lm train``: 0 when training finished or stopped on a signal (checkpointed)."""
    summary = train(cfg)
    return 0 if summary["stop"] in ("done", "signal") else 1


TRAIN = Command(TrainConfig, train_command,
                description="Train the LM. Flags override --config; each names its YAML field "
                "and default in brackets.")
