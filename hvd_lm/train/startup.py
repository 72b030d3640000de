"""A training run built from its configuration, before its first step (:class:`RunParts`): the
process (Horovod, device, precision, threads), the data (the manifest checked, this rank's
streams), the model, optimizer and schedule length, a resume's weights, position, recurrent
state and RNG, the Horovod-wrapped optimizer, every rank's host, and the start record's values
(the run folder is :class:`hvd_lm.train.rundir.RunFolder`'s).
:class:`hvd_lm.train.loop.Trainer` holds one and trains it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hvd_lm.comm import engine
from hvd_lm.comm.peers import PeerWatch
from hvd_lm.comm.threads import set_rank_threads
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.formats.shards import SMALL_SPLIT_BYTES, check_layout, small_split_advice, verify_shard
from hvd_lm.model import device as devices
from hvd_lm.model.lm import LanguageModel
from hvd_lm.model.mfu import Peak
from hvd_lm.options import check_required
from hvd_lm.train import faults, preflight
from hvd_lm.train import resume as resume_io
from hvd_lm.train.data import RankStreams, recut_bytes, window_in_new_cut
from hvd_lm.train.optim import build_optimizer, distributed
from hvd_lm.train.schedule import LRPlan, scaled_lr
from hvd_lm.train.settings import TrainConfig
from hvd_lm.util.units import parse_duration


def small_split_warning(manifest, split: str) -> None:
    """One line on stderr when ``split`` holds fewer than :data:`SMALL_SPLIT_BYTES` bytes: its
    BPC is too noisy to compare runs by."""
    sizes = {name: preflight.split_bytes(manifest, name) for name in {*manifest.split_names, split}}
    if sizes[split] < SMALL_SPLIT_BYTES:
        docs = sum(s.documents for s in manifest.shards if s.split == split)
        advice = small_split_advice(split, sizes, manifest.meta.get("split_ratios"))
        print(f"hvd-lm train: WARNING: the {split} split holds {docs:,} document(s), "
              f"{sizes[split]:,} bytes: too few to measure BPC on (under "
              f"{SMALL_SPLIT_BYTES // 1024} KiB); {advice}", file=sys.stderr, flush=True)


class RunParts:
    """What one training run is made of, built before its first step in the order the objects
    depend on each other (each block below one comment). The trainer
    (:class:`hvd_lm.train.loop.Trainer`) and its components are given what they need of it;
    an elastic reset re-forms its world (:meth:`reform`).

    Attributes (besides the configuration ``cfg`` and what the blocks name):
        start_pos / start_state: the position (:class:`hvd_lm.train.resume.Position`) and the
            recurrent state (h, c), each [B, H], training starts from (a resume's, else zero).
        total_steps: the schedule's length at the start (``--time-limit`` and
            ``--time-budget`` move the trainer's own; ``step_cap`` bounds it).
        summary: ``{"stop": "nothing-to-train", ...}`` when a resumed run had nothing left (then
            nothing after the resume was built), else None.

    Raises:
        ValueError: bad configuration or data (naming the field / file); a ConfigError when the
            shapes or the memory of a step do not fit (:mod:`hvd_lm.train.preflight`).
        ShardChecksumError: a shard does not match its manifest checksum.
    """

    def __init__(self, cfg: TrainConfig):
        check_required(cfg, "config")  # e.g. data.shards (the command line checked it already)
        self.cfg = cfg
        # ---- process: Horovod, device, precision, threads ----------------------------------------
        self.ctx = engine.init(cfg.dist.fusion_threshold_mb, cfg.dist.cycle_time_ms,  # collective
                             cfg.dist.gloo_timeout_s, cfg.dist.backend)
        self.device = devices.resolve_device(cfg.run.device, self.ctx.local_rank,
                                             self.ctx.local_size)
        devices.check(self.device, cfg.run.precision)
        # threads per rank: the usable cores / the ranks on this machine (hvd_lm.comm.threads;
        # collective: an allgather of machine ids, none before an elastic worker's first sync)
        self.threads = set_rank_threads(cfg.run.threads, self.ctx, "train",
                                        collective=not cfg.run.elastic)
        self.out_dir = Path(cfg.run.out_dir)

        # ---- data: the manifest, its splits and shards checked; streams cut for this world -------
        self.manifest = load_manifest(cfg.data.shards)
        # splits, vocabulary, window x rows against the split, one step's memory: before any read
        preflight.check_splits(self.manifest, cfg)
        preflight.check_vocab(cfg.model.vocab_size, self.manifest)
        preflight.check_shapes(cfg, self.manifest, self.ctx.size)
        self.step_memory = preflight.check_memory(cfg, self.manifest, self.device, self.ctx.size,
                                                  self.ctx.local_size)
        self.B, self.T = cfg.data.batch_size, cfg.data.seq_len
        self.k = cfg.dist.backward_passes_per_step
        for i, info in enumerate(self.manifest.shards):
            if not cfg.data.verify_shards:  # still one line naming a shard that is not one,
                check_layout(info)  # before anything is written
            elif i % self.ctx.size == self.ctx.rank:  # each rank verifies a disjoint subset
                verify_shard(info)
        self.cut_streams()
        if self.val is not None and self.ctx.is_root:
            small_split_warning(self.manifest, cfg.data.val_split)

        # ---- model, optimizer, schedule length ---------------------------------------------------
        torch.manual_seed(cfg.data.seed)
        self.model = LanguageModel(cfg.model).to(self.device)
        # Decay to 0 over --max-steps (the data cycled as often as they need) or an explicit
        # --epochs, whichever comes first; elastic runs keep the length fixed at start.
        self.total_steps, self.total_windows, self.bound = preflight.run_length(
            cfg, self.windows_per_epoch, self.k, warn=self.ctx.is_root)
        self.step_cap = self.total_steps  # with --time-limit the plan stays at or below it
        self.time_limit_s = (parse_duration(cfg.run.time_limit, "run.time_limit")
                             if cfg.run.time_limit else None)  # this allocation's, s
        self.time_budget_s = (parse_duration(cfg.run.time_budget, "run.time_budget")
                              if cfg.run.time_budget else None)  # the run's, over every one
        optimizer = build_optimizer(self.model, cfg.optim, self.peak_lr)
        self.scaler = devices.make_scaler(self.device, cfg.run.precision)

        # ---- resume: weights, position, recurrent state, RNG (optimizer state after wrapping) ----
        pos = self.start_pos = resume_io.Position()
        self.start_state = self.model.init_state(self.B, self.device)
        resume, self.summary, self.resumed_from = None, None, None
        if cfg.run.resume:  # checked before anything is written: a bad source changes nothing
            auto = cfg.run.resume == "auto"
            source = self.out_dir if auto else cfg.run.resume
            if cfg.run.elastic:  # no collective before the state's first sync: each rank reads
                resume = resume_io.Resume(source, self.device, fallback=auto, warn=self.ctx.is_root)
            else:  # rank 0 reads the checkpoint (--resume auto: the newest that loads) and
                # broadcasts its weights and optimizer later; the others map the file it chose
                # and read their own rows (collectives: rank 0's outcome, then the path)
                resume = engine.root_call(lambda: resume_io.Resume(source, self.device, auto))
                path = engine.broadcast_object(resume and resume.path, name="resume_path")
                resume = resume or resume_io.Resume(path, self.device, root=False)
            resume.restore_model(self.model)
            pos = self.start_pos = resume.position
            self.resumed_from = resume.path
            saved_window = pos.window
            if resume.windows_per_epoch:  # another world size x batch cuts other streams:
                # continue at the same point of the epoch (the same window when cut alike)
                pos.window = window_in_new_cut(pos.window, resume.windows_per_epoch,
                                               self.windows_per_epoch)
            rows = resume.rnn_rows(self.ctx.rank, self.ctx.size, self.B)
            self.start_state = rows or self.start_state
            if rows is None and self.ctx.is_root:
                print(f"hvd-lm train: warning: {self.recut_text(resume, saved_window)}",
                      file=sys.stderr, flush=True)
            resume.restore_rng()
            if preflight.resume_end(pos.step, pos.window, self.total_steps,
                                    sys.maxsize if cfg.run.elastic else self.total_windows,
                                    self.k, resume.path, cfg, warn=self.ctx.is_root) or (
                    cfg.timed and preflight.deadline_run_ended(
                        resume.lr_factor(), pos.step, cfg, resume.path,
                        warn=self.ctx.is_root, trained_s=pos.trained_s,
                        budget_s=self.time_budget_s)):
                self.summary = {"stop": "nothing-to-train", "step": pos.step}
                return  # a finished run started again: nothing is written

        # the module the step calls: the model, or under the torch engine its DDP wrapper
        # (collective: DDP broadcasts rank 0's parameters as it is built)
        self.train_model = engine.wrap_model(self.model, cfg.dist.compression)
        # the distributed optimizer (Horovod: gradient allreduce, fp16 compression, tensor fusion)
        self.optimizer = distributed(optimizer, self.model, cfg.dist.compression, self.k,
                                     cfg.dist.allreduce_op)
        # the LR, a function of the applied steps (the loop sets it before every update)
        self.lr_plan = LRPlan(self.peak_lr, cfg.optim.warmup_steps, self.total_steps,
                              cfg.optim.lr_decay)
        if resume is not None:
            plan = self.lr_plan
            resume.restore_optimizer(self.optimizer, plan, self.scaler)
            if (self.time_budget_s and plan.total_steps < sys.maxsize // 2
                    and plan.total_steps <= self.total_steps):
                # the saved plan of the budget: the line goes on where it was until re-planned
                self.total_steps = plan.total_steps
            else:  # the length this configuration gives (a saved plan is not this run's)
                factor = plan.factor(pos.step)  # the LR multiplier the saved job had
                plan.reset(self.total_steps)
                if cfg.timed and pos.step >= cfg.optim.warmup_steps:
                    # continue the line to 0 from that LR (the deadline's plan moves its end)
                    plan.anchor_step, plan.anchor_factor = pos.step, factor
            # the configured rule's peak for this job's global batch (the saving job's may differ:
            # another world size or batch)
            plan.peak = self.peak_lr
            resume.release()
        if not cfg.run.elastic:
            # collective: every rank starts from rank 0's weights (and optimizer state when
            # resuming: an empty Adam state would make Horovod take a zero-gradient step).
            # Elastic runs get it from the state's sync instead (no collective before it).
            faults.startup_delay(self.ctx.rank)  # tests only: a rank late for the broadcast
            engine.broadcast_state(self.model, self.optimizer if resume is not None else None)
        self.peers: list[dict] = []  # every rank's {rank, host, port} (non-elastic, > 1 rank)
        if not cfg.run.elastic and self.ctx.size > 1:
            self.peer_watch = PeerWatch(self.ctx.rank)
            self.peers = engine.allgather_object(self.peer_watch.info(), name="peers")  # collective


    def recut_text(self, resume: resume_io.Resume, saved_window: int) -> str:
        """The one line of a resume whose streams are cut anew (another world size x batch):
        where in the epoch it continues and the bytes of that epoch re-read and skipped
        (:func:`hvd_lm.train.data.recut_bytes`)."""
        rows = self.ctx.size * self.B
        text = (f"{resume.path} was written by {resume.rows} rows, this job has {rows} "
                f"({self.ctx.size} rank(s) x {self.B}): recurrent state reset (resume is not "
                "exact)")
        if not resume.windows_per_epoch:  # written before windows per epoch were saved
            return text
        epoch, old = divmod(saved_window, resume.windows_per_epoch)
        new = self.start_pos.window - epoch * self.windows_per_epoch
        reread, skipped = recut_bytes(self.streams.total_bytes, self.T, resume.rows, old, rows, new)
        return (f"{text}; the streams are cut anew at the same point of epoch {epoch} (window "
                f"{old} of {resume.windows_per_epoch} -> {new} of {self.windows_per_epoch}): "
                f"this epoch re-reads {reread:,} bytes and skips {skipped:,} of "
                f"{self.streams.chars_per_epoch:,}")

    # ---- the start record ------------------------------------------------------------------------

    def start_values(self, peak: Peak) -> dict:
        """The ``start`` record's values (after its step), ``peak`` the MFU's."""
        cfg = self.cfg
        return dict(world_size=self.ctx.size, launcher=self.ctx.launcher,
                    engine=engine.engine_name(), device=str(self.device),
                    global_batch=self.global_batch, peak_lr=self.peak_lr,
                    total_steps=self.total_steps if self.total_steps < sys.maxsize // 2
                    else None, bound=self.bound,  # --time-limit: planned, at most this
                    windows_per_epoch=self.windows_per_epoch,
                    chars_per_epoch=self.streams.chars_per_epoch,
                    params=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
                    precision=cfg.run.precision, compression=cfg.dist.compression,
                    threads=self.threads, elastic=cfg.run.elastic,
                    step_memory_bytes=self.step_memory.total,  # per rank, estimated
                    flops_per_char=self.model.flops_per_char(), peak_tflops=peak.tflops,
                    peak_source=peak.source, async_checkpoint=cfg.run.async_checkpoint,
                    hosts=[p["host"] for p in self.peers] or None,
                    resumed_from=str(self.resumed_from) if self.resumed_from else None,
                    time_limit_s=self.time_limit_s, time_budget_s=self.time_budget_s,
                    trained_s=self.start_pos.trained_s)

    # ---- layout ----------------------------------------------------------------------------------

    def cut_streams(self) -> None:
        """This rank's train (and val) streams for the current world, the global batch and the
        peak LR the configured rule gives it."""
        cfg, ctx = self.cfg, self.ctx
        self.streams = RankStreams(self.manifest, cfg.data.train_split, ctx.rank, ctx.size, self.B,
                                   self.T, seed=cfg.data.seed)
        # eval's rows in all, split over the ranks, not the training batch: each row's state
        # starts at zero, so the BPC of a split cut into more rows is higher
        self.val = (RankStreams(self.manifest, cfg.data.val_split, ctx.rank, ctx.size,
                                cfg.run.eval_batch_size, self.T, shuffle_shards=False,
                                max_bytes=cfg.run.eval_chars, global_rows=True)
                    if cfg.data.val_split else None)
        self.windows_per_epoch = self.streams.windows_per_epoch
        self.global_batch = ctx.size * self.B * self.k
        self.peak_lr = scaled_lr(cfg.optim.lr, cfg.optim.lr_ref_batch, self.global_batch,
                                 cfg.optim.lr_rule, cfg.optim.lr_cap)

    def reform(self) -> None:
        """After an elastic reset: this rank's place in the re-formed world, its streams cut
        again (the run folder moves with rank 0: :meth:`hvd_lm.train.rundir.RunFolder.take`)."""
        self.ctx = engine.rank_context()  # Horovod: rank and size now
        self.cut_streams()
