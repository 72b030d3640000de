"""A training run built from its configuration, before its first step: the process (Horovod,
device, precision, threads), the data (the manifest checked, this rank's streams), the model,
optimizer and schedule length, a resume's weights, position, recurrent state and RNG, the
Horovod-wrapped optimizer, the run folder (locked, checked for space, ``config.yaml``) and the
start record. :class:`hvd_lm.train.loop.Trainer` is this plus the loop.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import torch

from hvd_lm import comm
from hvd_lm.comm.peers import PeerWatch
from hvd_lm.comm.threads import set_rank_threads
from hvd_lm.formats import checkpoint as ckpt_io
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.formats.shards import SMALL_SPLIT_BYTES, check_layout, verify_shard
from hvd_lm.model import device as devices
from hvd_lm.model.lm import LanguageModel
from hvd_lm.model.mfu import device_peak
from hvd_lm.options import check_required
from hvd_lm.train import faults, preflight
from hvd_lm.train import resume as resume_io
from hvd_lm.train.async_checkpoint import CheckpointWriter
from hvd_lm.train.data import RankStreams, window_in_new_cut
from hvd_lm.train.deadline import CHECKPOINT_BYTES_PER_S, Cadence, DeadlinePlanner
from hvd_lm.train.evaluate import estimate_seconds
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.log import MetricsLog, StopSignals
from hvd_lm.train.optim import build_optimizer, distributed
from hvd_lm.train.rundir import OPTIMIZER_STATES, open_run_folder
from hvd_lm.train.schedule import make_scheduler, scaled_lr, schedule_of, set_peak_lr
from hvd_lm.train.settings import TrainConfig, time_limit_s
from hvd_lm.util.lock import FolderLock


def small_split_warning(manifest, split: str) -> None:
    """One line on stderr when ``split`` holds fewer than :data:`SMALL_SPLIT_BYTES` bytes: its
    BPC is too noisy to compare runs by."""
    size = sum(s.tokens for s in manifest.shards if s.split == split)
    if size < SMALL_SPLIT_BYTES:
        docs = sum(s.documents for s in manifest.shards if s.split == split)
        print(f"hvd-lm train: WARNING: the {split} split holds {docs:,} document(s), {size:,} "
              f"bytes: too few to measure BPC on (under {SMALL_SPLIT_BYTES // 1024} KiB); "
              "prepare it with a larger share (--split 100,1,1) or more text",
              file=sys.stderr, flush=True)


class TrainingRun:
    """Everything one training run needs before its first step, built in the order the objects
    depend on each other (each block below one comment); the loop
    (:class:`hvd_lm.train.loop.Trainer`) and the elastic half
    (:class:`hvd_lm.train.elastic.ElasticTraining`) work on these attributes.

    Raises:
        ValueError: bad configuration or data (naming the field / file); a ConfigError when the
            shapes or the memory of a step do not fit (:mod:`hvd_lm.train.preflight`).
        ShardChecksumError: a shard does not match its manifest checksum.
    """

    def __init__(self, cfg: TrainConfig):
        check_required(cfg, "config")  # e.g. data.shards (the command line checked it already)
        self.cfg = cfg
        # ---- process: Horovod, device, precision, threads ----------------------------------------
        self.ctx = comm.init(cfg.dist.fusion_threshold_mb, cfg.dist.cycle_time_ms,  # Horovod: init
                             cfg.dist.gloo_timeout_s, cfg.dist.backend)
        self.device = devices.resolve_device(cfg.run.device, self.ctx.local_rank,
                                             self.ctx.local_size)
        devices.check(self.device, cfg.run.precision)
        # threads per rank: the usable cores / the ranks on this machine (hvd_lm.comm.threads;
        # Horovod: an allgather of machine ids, none before an elastic worker's first sync)
        self.threads = set_rank_threads(cfg.run.threads, self.ctx, "train",
                                        collective=not cfg.run.elastic)
        self.out_dir = Path(cfg.run.out_dir)

        # ---- data: the manifest, its splits and shards checked; streams cut for this world -------
        self.manifest = load_manifest(cfg.data.shards)
        # splits, vocabulary, window x rows against the split, one step's memory: before any read
        step_memory = preflight.check_all(cfg, self.manifest, self.device, self.ctx.size,
                                          self.ctx.local_size)
        self.B, self.T = cfg.data.batch_size, cfg.data.seq_len
        self.k = cfg.dist.backward_passes_per_step
        if cfg.data.verify_shards:  # each rank verifies a disjoint subset of the shards
            for i, info in enumerate(self.manifest.shards):
                if i % self.ctx.size == self.ctx.rank:
                    verify_shard(info)
        else:  # still one line naming a shard that is not one, before anything is written
            for info in self.manifest.shards:
                check_layout(info)
        self.cut_streams()
        if self.val is not None and self.ctx.is_root:
            small_split_warning(self.manifest, cfg.data.val_split)

        # ---- model, optimizer, schedule length ---------------------------------------------------
        torch.manual_seed(cfg.data.seed)
        self.model = LanguageModel(cfg.model).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Decay to 0 over --max-steps (the data cycled as often as they need) or an explicit
        # --epochs, whichever comes first; elastic runs keep the length fixed at start.
        self.total_steps, self.total_windows, self.bound = preflight.run_length(
            cfg, self.windows_per_epoch, self.k, warn=self.ctx.is_root)
        self.step_cap = self.total_steps  # with --time-limit the plan stays at or below it
        self.time_limit_s = time_limit_s(cfg)
        optimizer = build_optimizer(self.model, cfg.optim, self.peak_lr)
        self.scaler = devices.make_scaler(self.device, cfg.run.precision)

        # ---- resume: weights, position, recurrent state, RNG (optimizer state after wrapping) ----
        self.pos = resume_io.Position()
        self.rnn_state = self.model.init_state(self.B, self.device)
        resume, self.summary, self.resumed_from = None, None, None
        if cfg.run.resume:  # checked before anything is written: a bad source changes nothing
            auto = cfg.run.resume == "auto"
            resume = resume_io.Resume(self.out_dir if auto else cfg.run.resume, self.device,
                                    fallback=auto, warn=self.ctx.is_root)
            resume.restore_model(self.model, self.scaler)
            self.pos, self.resumed_from = resume.position, resume.path
            if resume.windows_per_epoch:  # another world size x batch cuts other streams:
                # continue at the same point of the epoch (the same window when cut alike)
                self.pos.window = window_in_new_cut(self.pos.window, resume.windows_per_epoch,
                                                    self.windows_per_epoch)
            self.rnn_state = resume.rnn_rows(self.ctx.rank, self.ctx.size, self.B,
                                             warn=self.ctx.is_root) or self.rnn_state
            resume.restore_rng()
            if preflight.resume_end(self.pos.step, self.pos.window, self.total_steps,
                                    sys.maxsize if cfg.run.elastic else self.total_windows,
                                    self.k, resume.path, cfg, warn=self.ctx.is_root) or (
                    self.time_limit_s and preflight.deadline_run_ended(
                        resume.lr_factor(), self.pos.step, cfg, resume.path,
                        warn=self.ctx.is_root)):
                self.summary = {"stop": "nothing-to-train", "step": self.pos.step}
                return  # a finished run started again: nothing is written

        # Horovod: wrap the optimizer (gradient allreduce with fp16 compression and tensor fusion).
        self.optimizer = distributed(optimizer, self.model, cfg.dist.compression, self.k,
                                     cfg.dist.allreduce_op)
        # The scheduler wraps the Horovod optimizer's step(), so it sees the steps really taken.
        self.scheduler = make_scheduler(self.optimizer, cfg.optim.warmup_steps, self.total_steps,
                                        cfg.optim.lr_decay)
        if resume is not None:
            resume.restore_optimizer(self.optimizer, self.scheduler)
            schedule = schedule_of(self.scheduler)
            if self.time_limit_s and self.pos.step >= cfg.optim.warmup_steps:
                # continue the line to 0 from the LR the saved job had (the plan moves its end)
                factor = resume.lr_factor()
                schedule.reset(self.total_steps)
                schedule.anchor_step, schedule.anchor_factor = self.pos.step, (
                    schedule(self.pos.step) if factor is None else factor)
            else:  # the length this configuration gives (a saved plan is not this run's)
                schedule.reset(self.total_steps)
            # the configured rule's peak for this job's global batch (the saving job's may differ:
            # another world size or batch)
            set_peak_lr(self.scheduler, self.peak_lr)
            resume.release()
        if not cfg.run.elastic:
            # Horovod: every rank starts from rank 0's weights (and optimizer state when resuming;
            # an empty Adam state would make Horovod take a zero-gradient step to create it).
            # Elastic runs get it from the state's sync instead (no collective before it).
            comm.broadcast_state(self.model, self.optimizer if resume is not None else None)
        self.peers: list[dict] = []  # every rank's {rank, host, port} (non-elastic, > 1 rank)
        if not cfg.run.elastic and self.ctx.size > 1:
            self.peer_watch = PeerWatch(self.ctx.rank)
            self.peers = comm.allgather_object(self.peer_watch.info(), name="peers")  # Horovod

        # ---- the run folder: locked, checked for space, then config.yaml (rank 0) ----------------
        self.lock: FolderLock | None = None
        self.log = MetricsLog(self.out_dir, False, 0, 0, False)  # rank 0's opens in take_root
        if cfg.run.elastic:
            self.take_root(first=True)  # no collective: a joining worker must not wait here
        else:
            self.lock = comm.root_call(  # Horovod: every rank learns whether rank 0 got it
                lambda: open_run_folder(cfg, self.model, self.ctx.size * self.B,
                                        self.resumed_from))
            self.open_log()
        # the peak the logged MFU is against (a CPU's is a matmul measured now: hvd_lm.model.mfu)
        self.peak = device_peak(self.device, cfg.run.precision, cfg.run.peak_tflops, self.threads)
        self.log.record("start", self.pos.step, world_size=self.ctx.size,
                        launcher=self.ctx.launcher, engine=comm.engine(),
                        device=str(self.device),
                        global_batch=self.global_batch, peak_lr=self.peak_lr,
                        total_steps=self.total_steps if self.total_steps < sys.maxsize // 2
                        else None, bound=self.bound,  # --time-limit: planned, at most this
                        windows_per_epoch=self.windows_per_epoch,
                        chars_per_epoch=self.streams.chars_per_epoch,
                        params=sum(p.numel() for p in self.params),
                        precision=cfg.run.precision, compression=cfg.dist.compression,
                        threads=self.threads, elastic=cfg.run.elastic,
                        step_memory_bytes=step_memory.total,  # per rank, estimated
                        flops_per_char=self.model.flops_per_char(), peak_tflops=self.peak.tflops,
                        peak_source=self.peak.source, async_checkpoint=cfg.run.async_checkpoint,
                        hosts=[p["host"] for p in self.peers] or None,
                        resumed_from=str(resume.path) if resume else None,
                        time_limit_s=self.time_limit_s)

        # ---- control -----------------------------------------------------------------------------
        self.signals = StopSignals(describe=lambda: self.stop_eta())
        self.faults = faults.for_rank(self.ctx.rank, cfg.run.inject_nan_steps)  # tests only
        self.chars_base, self.chars_local = self.pos.chars_trained, 0  # all ranks before; this one
        self.guard = DivergenceGuard(cfg.run.divergence_loss, cfg.run.divergence_logs,
                                     cfg.run.max_skipped_steps, self.pos.step)
        self.last_ckpt_time = time.time()
        self.writer = CheckpointWriter(cfg.run.async_checkpoint, self.checkpoint_written)
        # the control exchange: after the first attempt, then every control_interval() attempts
        self.next_control = self.pos.attempts + 1
        self.attempt_times: collections.deque[float] = collections.deque(maxlen=20)  # seconds
        self.extra_s = 0.0  # seconds of validation and checkpoint in the current attempt
        self.planner = None  # --time-limit: the steps that fit (hvd_lm.train.deadline)
        if self.time_limit_s:
            self.planner = DeadlinePlanner(
                self.time_limit_s,
                cadence=Cadence(cfg.run.eval_every, cfg.run.checkpoint_every,
                                cfg.run.checkpoint_minutes, self.val is not None),
                eval_estimate=lambda: estimate_seconds(self.model, self.val, self.device,
                                                       cfg.run.precision),
                checkpoint_estimate_s=1.0 + ckpt_io.estimate_bytes(
                    self.model, OPTIMIZER_STATES.get(cfg.optim.optimizer, 2),
                    self.ctx.size * self.B) / CHECKPOINT_BYTES_PER_S)
        self.saved_step: int | None = None  # the step of this run's newest checkpoint
        self.step_started = time.monotonic()  # monotonic s: when the current step began
        self.stop_reason = "done"
        self.committed_rows = None  # elastic: this rank's rows at the last commit, and its place
        self.commit_seconds: list[float] = []

    # ---- layout ----------------------------------------------------------------------------------

    def cut_streams(self) -> None:
        """This rank's train (and val) streams for the current world, the global batch and the
        peak LR the configured rule gives it."""
        cfg, ctx = self.cfg, self.ctx
        self.streams = RankStreams(self.manifest, cfg.data.train_split, ctx.rank, ctx.size, self.B,
                                   self.T, seed=cfg.data.seed)
        self.val = None
        if cfg.data.val_split:
            # eval's rows, not the training batch: each row's state starts at zero, so the BPC
            # of a split cut into more rows is higher (an H200's 256 rows: 1.696 vs eval's 1.660)
            self.val = RankStreams(self.manifest, cfg.data.val_split, ctx.rank, ctx.size,
                                   cfg.run.eval_batch_size, self.T, shuffle_shards=False,
                                   max_bytes=cfg.run.eval_chars)
        self.windows_per_epoch = self.streams.steps_per_epoch
        self.global_batch = ctx.size * self.B * self.k
        self.peak_lr = scaled_lr(cfg.optim.lr, cfg.optim.lr_ref_batch, self.global_batch,
                                 cfg.optim.lr_rule, cfg.optim.lr_cap)

    def open_log(self) -> None:
        """Rank 0's metrics log (appending), once."""
        if self.ctx.is_root and not self.log.enabled:
            self.log = MetricsLog(self.out_dir, True,  # --time-limit: the total once planned
                                  None if self.time_limit_s else self.total_steps,
                                  self.pos.step, self.cfg.run.tensorboard)

    def take_root(self, first: bool = False) -> None:
        """Elastic: rank 0 owns the run folder (lock, config.yaml) and the log; a rank that is
        no longer 0 after a reset hands them back. ``first``: at the job's start (another run's
        checkpoints are refused then; later the folder's checkpoints are this job's)."""
        if self.ctx.is_root and self.lock is None:
            self.lock = open_run_folder(self.cfg, self.model, self.ctx.size * self.B,
                                        self.resumed_from, first=first)
            self.open_log()
        elif not self.ctx.is_root and self.lock is not None:
            self.log.close()
            self.log = MetricsLog(self.out_dir, False, 0, 0, False)
            self.lock.release()
            self.lock = None
