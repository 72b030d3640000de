"""The training loop: data-parallel TBPTT training of the byte-level LM with Horovod.

One optimizer step (per rank, B rows x T bytes per window, ``backward_passes_per_step`` = k) is
:func:`hvd_lm.train.step.train_step` (forward, loss, backward, Horovod's synchronize, unscale and
clip, step or skip: the same function every benchmark times); :meth:`Trainer.steps` is the loop
around it: count the step (the LR schedule advances on applied steps only), every
``run.control_every`` attempts one tiny allreduce of control flags (a preemption signal or a
due time-based checkpoint on any rank stops or checkpoints every rank at the same step), log,
validate, stop a diverged run, checkpoint. Each line of it that is a collective says so
(``# Horovod:``): every rank must reach it at the same step.

The host does not wait on the device per window: the next window is read ahead on a thread
(``train.data.Prefetcher``), the loss is summed on the device and read at log time, and the one
per-step sync is the gradient norm (its finiteness decides the skip; fp16 adds GradScaler.step's
read of its inf check). On CUDA the stream is also drained just before the allreduce wait, which
costs nothing (the host then blocks on the allreduce, which needs the backward done) and splits
each step's time into device compute and wait (``compute_time_max``, a slow GPU's straggling).

Rank 0 logs (tqdm bar, a line every ``log_every`` steps, ``metrics.jsonl``, TensorBoard with
``--tensorboard true``) and writes checkpoints; metrics are sums over ranks but
``compute_time_max`` (each step's slowest rank). Every Horovod call is marked ``# Horovod:``
where it happens (as Horovod's ``examples/pytorch`` scripts do).

With ``run.elastic`` (Horovod elastic) the same loop runs under ``hvd.elastic.run``, with a
commit in memory every ``run.commit_every`` steps: :mod:`hvd_lm.train.elastic`.

Without ``run.elastic``, a lost peer (its host's link down, the host or the process gone) fails
the collective it was in after Gloo's ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (``comm.gloo_timeout_s``);
each surviving node's first rank then probes the others (:mod:`hvd_lm.comm.peers`) and the job
stops with one line naming the lost rank's host and the newest complete checkpoint
(:class:`LostPeer`), from which ``--resume auto`` continues.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from hvd_lm.comm import horovod as comm
from hvd_lm.comm.peers import LostPeer, PeerWatch, lost_peers_text
from hvd_lm.formats import checkpoint as ckpt_io
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.formats.shards import verify_shard
from hvd_lm.model import device as devices
from hvd_lm.model.lm import LanguageModel
from hvd_lm.options import Command, check_required, error_text
from hvd_lm.train import faults, preflight
from hvd_lm.train import resume as resume_io
from hvd_lm.train.data import Prefetcher, RankStreams, window_in_new_cut
from hvd_lm.train.elastic import ElasticTraining
from hvd_lm.train.evaluate import bpc as eval_bpc
from hvd_lm.train.guard import DivergenceGuard, TrainingDiverged
from hvd_lm.train.log import MetricsLog, StepMeter, StopSignals, write_failure
from hvd_lm.train.optim import build_optimizer, distributed
from hvd_lm.train.rundir import open_run_folder
from hvd_lm.train.schedule import make_scheduler, scaled_lr, set_peak_lr
from hvd_lm.train.settings import TrainConfig
from hvd_lm.train.step import train_step
from hvd_lm.util.atomic import write_text
from hvd_lm.util.lock import FolderLock

LN2 = math.log(2.0)


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training as configured; returns a summary dict (on every rank).

    Raises:
        ValueError: bad configuration or data (naming the field / file); a ConfigError when the
            shapes or the memory of a step do not fit (:mod:`hvd_lm.train.preflight`).
        ShardChecksumError: a shard does not match its manifest checksum.
        hvd_lm.train.guard.TrainingDiverged: the run diverged (:mod:`hvd_lm.train.guard`).
    """
    return Trainer(cfg).run()


class Trainer(ElasticTraining):
    """One training run: :meth:`__init__` sets everything up (no collective in elastic mode,
    where a joining worker gets the state from the others), :meth:`run` trains.

    Raises:
        as :func:`train`.
    """

    def __init__(self, cfg: TrainConfig):
        check_required(cfg, "config")  # e.g. data.shards (the command line checked it already)
        self.cfg = cfg
        # ---- process: Horovod, device, precision, threads ----------------------------------------
        self.ctx = comm.init(cfg.dist.fusion_threshold_mb, cfg.dist.cycle_time_ms,  # Horovod: init
                             cfg.dist.gloo_timeout_s)
        self.device = devices.resolve_device(cfg.run.device, self.ctx.local_rank,
                                             self.ctx.local_size)
        devices.check(self.device, cfg.run.precision)
        self.threads = preflight.threads_per_rank(cfg.run.threads, self.ctx.local_size,
                                                  warn=self.ctx.local_rank == 0)
        torch.set_num_threads(self.threads)
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
        self.cut_streams()

        # ---- model, optimizer, schedule length ---------------------------------------------------
        torch.manual_seed(cfg.data.seed)
        self.model = LanguageModel(cfg.model).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Decay to 0 over --max-steps (the data cycled as often as they need) or an explicit
        # --epochs, whichever comes first; elastic runs keep the length fixed at start.
        self.total_steps, self.total_windows, self.bound = preflight.run_length(
            cfg, self.windows_per_epoch, self.k, warn=self.ctx.is_root)
        optimizer = build_optimizer(self.model, cfg.optim, self.peak_lr)
        self.scaler = devices.make_scaler(self.device, cfg.run.precision)

        # ---- resume: weights, position, recurrent state, RNG (optimizer state after wrapping) ----
        self.pos = resume_io.Position()
        self.rnn_state = self.model.init_state(self.B, self.device)
        resume, self.summary = None, None
        if cfg.run.resume:  # checked before anything is written: a bad source changes nothing
            auto = cfg.run.resume == "auto"
            resume = resume_io.Resume(self.out_dir if auto else cfg.run.resume, self.device,
                                    fallback=auto, warn=self.ctx.is_root)
            resume.restore_model(self.model, self.scaler)
            self.pos = resume.position
            if resume.windows_per_epoch:  # another world size x batch cuts other streams:
                # continue at the same point of the epoch (the same window when cut alike)
                self.pos.window = window_in_new_cut(self.pos.window, resume.windows_per_epoch,
                                                    self.windows_per_epoch)
            self.rnn_state = resume.rnn_rows(self.ctx.rank, self.ctx.size, self.B,
                                             warn=self.ctx.is_root) or self.rnn_state
            resume.restore_rng()
            if preflight.resume_end(self.pos.step, self.pos.window, self.total_steps,
                                    sys.maxsize if cfg.run.elastic else self.total_windows,
                                    self.k, resume.path, cfg, warn=self.ctx.is_root):
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
            self.take_root()  # no collective: a joining worker must not wait on the others here
        else:
            self.lock = comm.root_call(  # Horovod: every rank learns whether rank 0 got it
                lambda: open_run_folder(cfg, self.model, self.ctx.size * self.B))
            self.open_log()
        self.log.record("start", self.pos.step, world_size=self.ctx.size, device=str(self.device),
                        global_batch=self.global_batch, peak_lr=self.peak_lr,
                        total_steps=self.total_steps, bound=self.bound,
                        windows_per_epoch=self.windows_per_epoch,
                        chars_per_epoch=self.streams.chars_per_epoch,
                        params=sum(p.numel() for p in self.params),
                        precision=cfg.run.precision, compression=cfg.dist.compression,
                        threads=self.threads, elastic=cfg.run.elastic,
                        step_memory_bytes=step_memory.total,  # per rank, estimated
                        hosts=[p["host"] for p in self.peers] or None,
                        resumed_from=str(resume.path) if resume else None)

        # ---- control -----------------------------------------------------------------------------
        self.signals = StopSignals()
        self.faults = faults.for_rank(self.ctx.rank, cfg.run.inject_nan_steps)  # tests only
        self.chars_base, self.chars_local = self.pos.chars_trained, 0  # all ranks before; this one
        self.guard = DivergenceGuard(cfg.run.divergence_loss, cfg.run.divergence_logs,
                                     cfg.run.max_skipped_steps, self.pos.step)
        self.last_ckpt_time = time.time()
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
            self.val = RankStreams(self.manifest, cfg.data.val_split, ctx.rank, ctx.size, self.B,
                                   self.T, shuffle_shards=False, max_bytes=cfg.run.eval_chars)
        self.windows_per_epoch = self.streams.steps_per_epoch
        self.global_batch = ctx.size * self.B * self.k
        self.peak_lr = scaled_lr(cfg.optim.lr, cfg.optim.lr_ref_batch, self.global_batch,
                                 cfg.optim.lr_rule, cfg.optim.lr_cap)

    def open_log(self) -> None:
        """Rank 0's metrics log (appending), once."""
        if self.ctx.is_root and not self.log.enabled:
            self.log = MetricsLog(self.out_dir, True, self.total_steps, self.pos.step,
                                  self.cfg.run.tensorboard)

    def take_root(self) -> None:
        """Elastic: rank 0 owns the run folder (lock, config.yaml) and the log; a rank that is
        no longer 0 after a reset hands them back."""
        if self.ctx.is_root and self.lock is None:
            self.lock = open_run_folder(self.cfg, self.model, self.ctx.size * self.B)
            self.open_log()
        elif not self.ctx.is_root and self.lock is not None:
            self.log.close()
            self.log = MetricsLog(self.out_dir, False, 0, 0, False)
            self.lock.release()
            self.lock = None

    # ---- collectives used by the loop ------------------------------------------------------------

    def chars_total(self) -> int:
        """Characters trained on by all ranks, exact across world-size changes (Horovod: sum)."""
        return self.chars_base + int(comm.allreduce_sum([float(self.chars_local)],
                                                        name="chars_total")[0])

    def save_checkpoint(self) -> None:
        """Every rank: gather the recurrent state rows; rank 0 writes the checkpoint. Held
        (nothing written) while the newest logged loss is above the divergence bound."""
        if not self.guard.may_checkpoint():
            self.log.record("checkpoint_held", self.pos.step,
                            loss=self.guard.above[-1][1] if self.guard.above else None)
            return
        # Horovod: gather every rank's recurrent state rows (rank order) for an exact resume.
        h = comm.allgather(self.rnn_state[0].detach().float().cpu(), name="ckpt_h")
        c = comm.allgather(self.rnn_state[1].detach().float().cpu(), name="ckpt_c")
        pos = dataclasses.replace(self.pos, chars_trained=self.chars_total())
        opt_state = self.optimizer.state_dict()  # every rank: 1-bit optimizers gather errors
        if self.ctx.is_root:
            path = ckpt_io.save(resume_io.payload(pos, self.model, opt_state, self.scheduler,
                                                self.scaler, (h, c), self.cfg.to_dict(),
                                                self.ctx.size, self.windows_per_epoch),
                                self.out_dir, pos.step, self.cfg.run.keep_checkpoints,
                                self.guard.confirmed_below())
            self.log.record("checkpoint", pos.step, path=str(path))
        self.guard.wrote(pos.step)
        self.saved_step = pos.step  # every rank: the end does not write (or print) it again

    def validate(self) -> None:
        """Validation BPC over all ranks (Horovod: sums bits and chars), logged by rank 0."""
        if self.val is None:
            return
        v_bpc, v_chars = eval_bpc(self.model, self.val, self.device, self.cfg.run.precision)
        self.model.train()
        self.log.record("eval", self.pos.step, val_bpc=v_bpc, val_chars=v_chars)

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> dict:
        """Train to the end (or a stop signal), then validate, checkpoint and write the summary."""
        if self.summary is not None:  # nothing to train (preflight.resume_end)
            return self.summary
        try:
            if self.cfg.run.elastic:
                self.run_elastic()  # hvd_lm.train.elastic
            else:
                try:
                    self.loop()
                    self.finish()
                except Exception as e:
                    if self.peers and comm.is_collective_failure(e):
                        raise self.lost_peer(e) from e
                    raise
            return self.end()
        except Exception as e:
            # the rank that prints the one-line cause records it for the launch's summary (a
            # divergence, the same on every rank: rank 0 alone)
            if (e.report if isinstance(e, LostPeer) else
                    self.ctx.is_root or not isinstance(e, TrainingDiverged)):
                last = ckpt_io.list_checkpoints(self.out_dir)
                write_failure(self.out_dir, self.pos.step, self.ctx.rank, error_text(e),
                              str(last[-1]) if last else None)
            raise

    def lost_peer(self, error: BaseException) -> LostPeer:
        """The one-line error of a collective that lost a peer: who (probed, at most 3 s), when,
        after which timeout, and the newest complete checkpoint to resume from."""
        # how long the failed collective waited (from its step's start, an upper bound): Gloo's
        # timeout is named only when it is what ended it (a killed peer fails at once)
        waited = time.monotonic() - self.step_started
        timeout = comm.gloo_timeout_s()
        bound = (f" (Gloo gave up after HOROVOD_GLOO_TIMEOUT_SECONDS={timeout:g} s)"
                 if timeout and waited >= 0.8 * timeout else
                 f" after {waited:.1f} s (its peer's connection closed)")
        last = ckpt_io.list_checkpoints(self.out_dir)
        return LostPeer(
            f"{lost_peers_text(self.peers, self.ctx.rank)}: a collective failed at step "
            f"{self.pos.step + 1}{bound}; the newest complete checkpoint is "
            f"{last[-1] if last else 'none (no step was saved)'}; bring the host back or leave "
            "it out, and run again with --resume auto (the launch templates add it)",
            report=self.ctx.local_rank == 0)

    def loop(self, state=None) -> None:
        """Optimizer steps until ``total_steps``, a stop signal or divergence."""
        # window i+1's bytes are read on a background thread while window i trains (elastic
        # runs wrap around epochs, so no read-ahead limit there)
        batches = Prefetcher(self.streams, limit=None if state is not None else self.total_windows,
                             pin_memory=self.device.type == "cuda")
        try:
            self.steps(batches, state)
        finally:
            batches.close()

    def steps(self, batches: Prefetcher, state=None) -> None:
        """The body of :meth:`loop`: one iteration per optimizer step (attempt)."""
        cfg, k, pos = self.cfg, self.k, self.pos
        self.meter = StepMeter()
        self.model.train()

        def windows():  # the step's k windows, read ahead on a thread; counted as consumed
            for _ in range(k):
                yield batches.get(pos.window)
                pos.window += 1

        while pos.step < self.total_steps and (state is not None
                                               or pos.window + k <= self.total_windows):
            t_step = time.perf_counter()
            self.step_started = time.monotonic()  # what a failed collective waited: lost_peer
            self.faults.before_step(pos.step)

            # forward, loss, backward, Horovod: synchronize, unscale and clip, step or skip
            # (hvd_lm.train.step, the one training step)
            r = train_step(self.model, self.optimizer, self.scaler, self.params, windows(), k,
                           self.rnn_state, self.device, cfg.run.precision, cfg.optim.grad_clip,
                           cfg.run.nan_check,
                           loss_hook=lambda loss: self.faults.loss(loss, pos.attempts))
            self.rnn_state = r.state

            # count it (the LR schedule advances on applied steps only), then log and validate
            self.count_step(r.applied, r.grad_norm)
            self.chars_local += r.chars
            self.meter.add(r.nats, r.chars, r.wait_s, time.perf_counter() - t_step)
            stop_flag, due_flag = self.control_flags()  # Horovod: allreduce (every control_every)
            if r.applied and (pos.step % cfg.run.log_every == 0 or pos.step == self.total_steps):
                self.log_train(r.grad_norm)  # Horovod: allreduce of the metrics
            if r.applied and cfg.run.eval_every and pos.step % cfg.run.eval_every == 0:
                self.validate()  # Horovod: allreduce of bits and chars

            # stop a diverged run (every rank decides alike: global skips, allreduced losses)
            if self.guard.reason:
                self.stop_reason = "diverged"
                break
            # checkpoint: on a stop signal (then leave), every checkpoint_every steps, or when due
            if stop_flag > 0:
                self.stop_reason = "signal"
                self.save_checkpoint()  # Horovod: allgather of the recurrent state
                break
            if r.applied and ((cfg.run.checkpoint_every
                               and pos.step % cfg.run.checkpoint_every == 0) or due_flag > 0):
                self.save_checkpoint()  # Horovod: allgather of the recurrent state
                self.last_ckpt_time = time.time()
            # elastic: commit in memory every commit_every steps (Horovod: may raise
            # HostsUpdatedInterrupt when workers are added or removed, after saving)
            if state is not None and r.applied and pos.step % cfg.run.commit_every == 0:
                self.commit(state)

    def count_step(self, applied: bool, grad_norm: float) -> None:
        """An applied step advances the step count and the LR schedule; a skipped one is counted
        (and logged), and a non-finite recurrent state restarts from zero."""
        pos = self.pos
        self.guard.attempt(applied)
        self.log.tick(1 if applied else 0)
        if applied:
            self.scheduler.step()
            pos.step += 1
            return
        pos.skipped_steps += 1
        if not all(bool(torch.isfinite(s).all()) for s in self.rnn_state):
            self.rnn_state = self.model.init_state(self.B, self.device)
        self.log.record("skip", pos.step, skipped_steps=pos.skipped_steps, grad_norm=grad_norm,
                        loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None)

    def control_flags(self) -> tuple[float, float]:
        """(stop, checkpoint due): every ``run.control_every`` attempts (the same attempts on
        every rank) one tiny allreduce: any rank's signal stops all, rank 0's clock times
        checkpoints; (0, 0) between them."""
        cfg = self.cfg
        if self.pos.attempts % cfg.run.control_every:
            return 0.0, 0.0
        due = (cfg.run.checkpoint_minutes > 0 and self.ctx.is_root
               and time.time() - self.last_ckpt_time >= 60 * cfg.run.checkpoint_minutes)
        stop, due_flag = comm.allreduce_sum(  # Horovod: sums of the flags over ranks
            [1.0 if self.signals.received else 0.0, 1.0 if due else 0.0], name="control")
        return stop, due_flag

    def log_train(self, grad_norm: float) -> None:
        """A ``train`` record (rank 0) of the steps since the last one, over all ranks; the loss
        goes to the divergence guard (the same float on every rank)."""
        m, pos = self.meter, self.pos
        # Horovod: metrics summed over ranks (float(): the device sum, read now)
        nats, chars, waits, busy = comm.allreduce_sum([float(m.nats), m.chars, m.wait, m.busy],
                                                      name="log")
        # Horovod: each step's slowest rank outside the allreduce wait, which sets the step (a
        # straggler shows as its mean well above the mean rank's)
        slowest = comm.allreduce_max_each(m.compute, name="log.compute")
        wall = time.perf_counter() - m.t0
        loss = nats / max(1.0, chars)
        self.guard.logged(pos.step, loss)
        scaler = self.scaler
        self.log.record("train", pos.step, loss=loss, bpc=loss / LN2,
                        lr=self.scheduler.get_last_lr()[0],
                        loss_scale=scaler.get_scale() if scaler.is_enabled() else None,
                        chars_per_s=chars / wall, step_time=wall / m.steps,
                        allreduce_wait=waits / max(busy, 1e-9),
                        compute_time_max=sum(slowest) / m.steps,
                        compute_time_mean=(busy - waits) / (self.ctx.size * m.steps),
                        grad_norm=grad_norm,
                        skipped_steps=pos.skipped_steps,
                        epoch=pos.window / self.windows_per_epoch, world_size=self.ctx.size,
                        **comm.comm_stats(self.optimizer))  # bytes on the wire (and 1-bit phase)
        self.meter = StepMeter()

    def finish(self) -> None:
        """Final validation and checkpoint of a run that reached its end (unless its newest
        logged loss is above the divergence bound: then it diverged)."""
        if self.stop_reason == "done":
            self.guard.at_end()
            self.stop_reason = "diverged" if self.guard.reason else "done"
        self.step_started = time.monotonic()  # the final validation's and save's collectives
        if self.stop_reason == "done":
            if not (self.cfg.run.eval_every and self.pos.step % self.cfg.run.eval_every == 0):
                self.validate()
            if self.saved_step != self.pos.step:  # --checkpoint-every may have saved it
                self.save_checkpoint()
        self.summary = {"stop": self.stop_reason, "step": self.pos.step,
                        "skipped_steps": self.pos.skipped_steps,
                        "chars_trained": self.chars_total(), "world_size": self.ctx.size}

    def end(self) -> dict:
        """The summary (and ``summary.json``), released folder; raise on divergence."""
        summary = self.summary
        if self.ctx.is_root:
            self.log.record("end", self.pos.step,
                            **{k: v for k, v in summary.items() if k != "step"})
            write_text(self.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        self.log.close()
        settled = self.guard.settle(self.out_dir) if (
            self.stop_reason == "diverged" and self.ctx.is_root) else None
        if self.lock is not None:
            self.lock.release()
        if self.stop_reason == "diverged":
            raise self.guard.error(self.pos.step, settled)
        return summary


def train_command(cfg: TrainConfig) -> int:
    """``hvd-lm train``: 0 when training finished, stopped on a signal (checkpointed) or had
    nothing left to train."""
    try:
        summary = train(cfg)
    except LostPeer as e:
        if e.report:
            raise
        return 1
    return 0 if summary["stop"] in ("done", "signal", "nothing-to-train") else 1


TRAIN = Command(TrainConfig, train_command,
                description="Train the LM. Flags override --config; each names its YAML field "
                "and default in brackets.")
