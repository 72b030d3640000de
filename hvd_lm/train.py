"""The training loop: data-parallel TBPTT training of the byte-level LM with Horovod.

One optimizer step (per rank, B rows x T bytes per window, ``backward_passes_per_step`` = k):

1. k windows: forward with the carried (detached) state, loss = mean NLL over the window's real
   targets / k in fp32, backward (scaled by the loss scaler under fp16); Horovod's hooks start the
   fp16-compressed, fused allreduce of each gradient as soon as it is ready.
2. ``clip_and_step`` (hvd_lm.distributed): wait for the allreduce, unscale, clip, step — or skip
   the step when the gradients overflowed / are not finite (counted; the LR schedule does not
   advance on a skipped step).
3. One tiny allreduce of control flags (a preemption signal or a due time-based checkpoint on any
   rank stops or checkpoints every rank at the same step).

Rank 0 logs (tqdm bar, a line every ``log_every`` steps, ``metrics.jsonl``, TensorBoard when
installed) and writes checkpoints; metrics are sums over ranks.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hvd_lm import checkpoint as ckpt_io
from hvd_lm import distributed as dist
from hvd_lm import precision as prec
from hvd_lm.config import TrainConfig, save_yaml
from hvd_lm.data import IGNORE, Batch, RankStreams
from hvd_lm.evaluate import bpc as eval_bpc
from hvd_lm.model import LanguageModel
from hvd_lm.schedule import make_scheduler, scaled_lr
from hvd_lm.shards import load_manifest, verify_shard

LN2 = math.log(2.0)


def resolve_device(name: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` for ``auto`` when CUDA is available (one GPU per local rank), else
    CPU; an explicit ``cpu``/``cuda``/``cuda:N`` is honoured (``cuda`` means ``cuda:local_rank``).

    Raises:
        ValueError: CUDA asked for but not available.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"run.device={name!r} but torch sees no CUDA device")
        dev = torch.device(name if ":" in name else f"cuda:{local_rank % torch.cuda.device_count()}")
        torch.cuda.set_device(dev)
        return dev
    return torch.device(name)


def window_nll(model: LanguageModel, batch: Batch, state, device: torch.device, precision: str):
    """Forward one TBPTT window: (sum of -ln p over its real targets, a 0-d fp32 tensor with
    grad; the new state). The incoming state is detached (truncated BPTT); the logits are upcast
    so the softmax and loss are fp32 whatever the autocast precision (as the reference requires)."""
    state = (state[0].detach(), state[1].detach())
    x, y = batch.inputs.to(device), batch.targets.to(device)
    with prec.autocast(device, precision):
        logits, state = model(x, state, reset=batch.reset.to(device))
    nats = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return nats, state


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, lr: float) -> torch.optim.Optimizer:
    """Adam (the reference's) or SGD with momentum, at peak LR ``lr``."""
    o = cfg.optim
    if o.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=o.momentum,
                           weight_decay=o.weight_decay)


class _Signals:
    """Turns SIGTERM/SIGUSR1 (SLURM preemption, ``scancel --signal``) into a stop flag."""

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = signum


class _Log:
    """Rank 0's outputs: metrics.jsonl, stdout lines, tqdm bar, TensorBoard (when installed)."""

    def __init__(self, out_dir: Path, enabled: bool, total: int, initial: int, tensorboard: bool):
        self.enabled = enabled
        self.bar = None
        self.tb = None
        if not enabled:
            return
        self.file = open(out_dir / "metrics.jsonl", "a", buffering=1)
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=None, file=sys.stderr)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                self.tb = None

    def record(self, kind: str, step: int, **values) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "step": step, "time": time.time(), **values}
        self.file.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(f"{kind}/{k}", v, step)
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        msg = f"[{kind}] step={step} {shown}"
        if self.bar is not None and not self.bar.disable:  # a terminal: keep the bar below
            self.bar.write(msg, file=sys.stdout)
        else:  # one write per line: launchers tag each write (stdout may be unbuffered)
            sys.stdout.write(msg + "\n")
            sys.stdout.flush()

    def tick(self, n: int = 1, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        if self.enabled:
            if self.bar is not None:
                self.bar.close()
            if self.tb is not None:
                self.tb.close()
            self.file.close()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _fault_injection(rank: int, step: int) -> None:
    """Testing aid for the rank-death test: HVD_LM_FAULT_RANK/HVD_LM_FAULT_STEP make that rank exit
    abruptly (code 3) at that step, as a crashed process would."""
    r, s = os.environ.get("HVD_LM_FAULT_RANK"), os.environ.get("HVD_LM_FAULT_STEP")
    if r is not None and s is not None and int(r) == rank and int(s) == step:
        print(f"rank {rank}: injected fault at step {step}", file=sys.stderr, flush=True)
        os._exit(3)


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training as configured; returns a summary dict (on every rank).

    Raises:
        ValueError: bad configuration or data (naming the field / file).
        ShardChecksumError: a shard does not match its manifest checksum.
    """
    ctx = dist.init(cfg.dist.fusion_threshold_mb, cfg.dist.cycle_time_ms)
    device = resolve_device(cfg.run.device, ctx.local_rank)
    prec.check(device, cfg.run.precision)
    threads = cfg.run.threads or max(1, (os.cpu_count() or 1) // ctx.local_size)
    torch.set_num_threads(threads)
    out_dir = Path(cfg.run.out_dir)
    if ctx.is_root:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, out_dir / "config.yaml")

    # ---- data -------------------------------------------------------------------------------
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

    # ---- model, optimiser, schedule --------------------------------------------------------------
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
    optimizer = build_optimizer(model, cfg, peak_lr)
    scaler = prec.make_scaler(device, cfg.run.precision)

    step, window, skipped, chars_trained = 0, 0, 0, 0
    rnn_state = model.init_state(B, device)
    resumed_from = None
    if cfg.run.resume:
        src = ckpt_io.resolve(out_dir if cfg.run.resume == "auto" else cfg.run.resume)
        ck = ckpt_io.load(src, map_location=device)
        model.load_state_dict(ck["model"])
        if scaler is not None and ck.get("scaler"):
            scaler.load_state_dict(ck["scaler"])
        step, window = ck["step"], ck["window"]
        skipped, chars_trained = ck["skipped_steps"], ck["chars_trained"]
        h, c = ck["rnn_state"]
        if h.shape[0] == ctx.size * B:
            rnn_state = (h[ctx.rank * B:(ctx.rank + 1) * B].to(device),
                         c[ctx.rank * B:(ctx.rank + 1) * B].to(device))
        elif ctx.is_root:
            print(f"warning: {src} was written by {h.shape[0]} rows, this job has "
                  f"{ctx.size * B}: recurrent state reset (resume is not exact)", file=sys.stderr)
        ckpt_io.set_rng_state(ck["rng"])
        resumed_from = str(src)

    # hvd.DistributedOptimizer builds a new optimizer over the same param groups (it does not keep
    # the wrapped one's state), so optimizer state is loaded after wrapping, as Horovod's examples do.
    optimizer = dist.distributed_optimizer(optimizer, model, cfg.dist.compression, k,
                                           cfg.dist.allreduce_op)
    if resumed_from:
        optimizer.load_state_dict(ck["optimizer"])
    # The scheduler wraps the Horovod optimizer's step(), so it sees the steps really taken.
    scheduler = make_scheduler(optimizer, cfg.optim.warmup_steps, total_steps, cfg.optim.lr_decay)
    if resumed_from:
        scheduler.load_state_dict(ck["scheduler"])
        # Building the scheduler reset the LR to step 0's; restore the checkpoint's.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        del ck
    # Optimiser state exists only when resuming; broadcasting an empty Adam state would make
    # Horovod take a zero-gradient step to create it (bumping Adam's step count), so skip then.
    dist.broadcast_state(model, optimizer if resumed_from else None)

    # ---- loop ------------------------------------------------------------------------------------
    log = _Log(out_dir, ctx.is_root, total_steps, step, cfg.run.tensorboard)
    if ctx.is_root:
        log.record("start", step, world_size=ctx.size, device=str(device), global_batch=global_batch,
                   peak_lr=peak_lr, total_steps=total_steps, windows_per_epoch=windows_per_epoch,
                   chars_per_epoch=streams.chars_per_epoch, params=sum(p.numel() for p in params),
                   precision=cfg.run.precision, compression=cfg.dist.compression,
                   threads=threads, resumed_from=resumed_from)
    signals = _Signals()
    nan_steps = {int(s) for s in cfg.run.inject_nan_steps.split(",") if s.strip()}
    last_ckpt_time = time.time()
    acc = {"nats": 0.0, "chars": 0.0, "wait": 0.0, "busy": 0.0, "t0": time.perf_counter(),
           "steps": 0}
    stop_reason = "done"

    def save_checkpoint() -> None:
        h = dist.allgather(rnn_state[0].detach().float().cpu(), name="ckpt_h")
        c = dist.allgather(rnn_state[1].detach().float().cpu(), name="ckpt_c")
        if ctx.is_root:
            path = ckpt_io.save({
                "step": step, "window": window, "skipped_steps": skipped,
                "chars_trained": chars_trained,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rnn_state": (h, c), "rng": ckpt_io.rng_state(), "config": cfg.to_dict(),
                "world_size": ctx.size,
            }, out_dir, step, cfg.run.keep_checkpoints)
            log.record("checkpoint", step, path=str(path))

    def validate() -> None:
        if val is None:
            return
        v_bpc, v_chars = eval_bpc(model, val, device, cfg.run.precision)
        model.train()
        log.record("eval", step, val_bpc=v_bpc, val_chars=v_chars)

    model.train()
    while step < total_steps and window + k <= total_windows:
        t_step = time.perf_counter()
        _fault_injection(ctx.rank, step)
        nats_step, chars_step = 0.0, 0
        for _ in range(k):
            epoch, w = divmod(window, windows_per_epoch)
            batch = streams.window(epoch, w)
            nats, rnn_state = window_nll(model, batch, rnn_state, device, cfg.run.precision)
            loss = nats / max(1, batch.chars) / k
            if step + skipped in nan_steps and ctx.is_root:  # counts attempts, not applied steps
                loss = loss * float("nan")
            (scaler.scale(loss) if scaler is not None else loss).backward()
            nats_step += float(nats.detach())
            chars_step += batch.chars
            window += 1
        applied, grad_norm, wait = dist.clip_and_step(optimizer, params, cfg.optim.grad_clip,
                                                      scaler, cfg.run.nan_check)
        optimizer.zero_grad()
        if applied:
            scheduler.step()
            step += 1
        else:
            skipped += 1
            if not all(bool(torch.isfinite(s).all()) for s in rnn_state):
                rnn_state = model.init_state(B, device)
            log.record("skip", step, skipped_steps=skipped, grad_norm=grad_norm,
                       loss_scale=scaler.get_scale() if scaler is not None else None)
        chars_trained += chars_step  # this rank's
        acc["nats"] += nats_step
        acc["chars"] += chars_step
        acc["wait"] += wait
        acc["busy"] += time.perf_counter() - t_step
        acc["steps"] += 1

        # Control: any rank's signal stops all; rank 0's clock triggers timed checkpoints.
        due = (cfg.run.checkpoint_minutes > 0 and ctx.is_root
               and time.time() - last_ckpt_time >= 60 * cfg.run.checkpoint_minutes)
        stop_flag, due_flag = dist.allreduce_sum(
            [1.0 if signals.received else 0.0, 1.0 if due else 0.0], name="control")

        log.tick(1 if applied else 0)
        if applied and (step % cfg.run.log_every == 0 or step == total_steps):
            nats, chars, waits, busy = dist.allreduce_sum(
                [acc["nats"], acc["chars"], acc["wait"], acc["busy"]], name="log")
            wall = time.perf_counter() - acc["t0"]
            loss = nats / max(1.0, chars)
            log.record("train", step, loss=loss, bpc=loss / LN2, lr=scheduler.get_last_lr()[0],
                       loss_scale=scaler.get_scale() if scaler is not None else None,
                       chars_per_s=chars / wall, step_time=wall / acc["steps"],
                       allreduce_wait=waits / max(busy, 1e-9), grad_norm=grad_norm,
                       skipped_steps=skipped, epoch=window / windows_per_epoch)
            acc.update(nats=0.0, chars=0.0, wait=0.0, busy=0.0, t0=time.perf_counter(), steps=0)
        if applied and cfg.run.eval_every and step % cfg.run.eval_every == 0:
            validate()
        if stop_flag > 0:
            stop_reason = "signal"
            save_checkpoint()
            break
        if applied and ((cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0)
                        or due_flag > 0):
            save_checkpoint()
            last_ckpt_time = time.time()

    if stop_reason == "done":
        if not (cfg.run.eval_every and step % cfg.run.eval_every == 0):
            validate()
        save_checkpoint()
    total_chars, = dist.allreduce_sum([float(chars_trained)], name="chars_total")
    summary = {"stop": stop_reason, "step": step, "skipped_steps": skipped,
               "chars_trained": int(total_chars), "world_size": ctx.size}
    if ctx.is_root:
        log.record("end", step, **{k: v for k, v in summary.items() if k != "step"})
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.close()
    return summary
