"""Fault injection for the tests, kept out of the training loop's body: the loop calls the hooks of
the object :func:`for_rank` gives, a :class:`NoFaults` that does nothing unless a test asked for a
fault with one of these:

* ``HVD_LM_FAULT_RANK`` / ``HVD_LM_FAULT_STEP`` (environment): that rank exits abruptly (code 3)
  when it reaches that optimizer step, as a crashed process would (the rank-death test).
* ``run.inject_nan_steps`` (config): comma-separated step *attempts* (applied + skipped,
  0-based) whose loss rank 0 multiplies by NaN (the skipped-step test).
* ``HVD_LM_STEP_SLEEP`` (environment): seconds every step sleeps, so a test can act while a tiny
  model trains (the elastic tests kill and add workers mid-run); with ``HVD_LM_STEP_SLEEP_RANK``
  only that rank sleeps (a straggler), or, given as ``r0,r1,...``, rank ``r[s % len]`` at step s
  (a straggler that moves: the ``compute_time_max`` test).
* ``HVD_LM_STARTUP_SLEEP`` (environment): seconds the ``HVD_LM_STEP_SLEEP_RANK`` rank (every
  rank when unset) sleeps at startup before the weights' broadcast
  (:func:`startup_delay`): a rank that loads slowly, late for startup's first collective.
* ``HVD_LM_CHECKPOINT_SLEEP`` (environment): seconds the checkpoint writer sleeps before it
  writes (:func:`checkpoint_write_delay`; with ``HVD_LM_CHECKPOINT_SLEEP_STEP`` only before the
  checkpoint of that step), so a test can signal or kill a process while a write is in flight.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from hvd_lm.comm.world import MAX_RANKS, env_int


class NoFaults:
    """No fault: what the training loop runs with unless a test configured one."""

    def before_step(self, step: int) -> None:
        """Nothing."""

    def loss(self, loss: torch.Tensor, attempt: int) -> torch.Tensor:
        """``loss`` unchanged."""
        return loss


def for_rank(rank: int, inject_nan_steps: str = "") -> "NoFaults | Faults":
    """:class:`Faults` for this rank when a fault is configured (environment or
    ``run.inject_nan_steps``), else :class:`NoFaults`."""
    faults = Faults(rank, inject_nan_steps)
    return faults if (faults.nan_attempts or faults.die_at is not None or faults.sleep) \
        else NoFaults()


class Faults(NoFaults):
    """The faults this rank was asked to inject."""

    def __init__(self, rank: int, inject_nan_steps: str = ""):
        self.rank = rank
        self.nan_attempts = {int(s) for s in inject_nan_steps.split(",") if s.strip()}
        r = env_int("HVD_LM_FAULT_RANK", 0, MAX_RANKS, "a rank")
        s = env_int("HVD_LM_FAULT_STEP", 0, 2**62, "a step")
        self.die_at = s if (r is not None and s is not None and r == rank) else None
        self.sleep = float(os.environ.get("HVD_LM_STEP_SLEEP", "0") or 0)
        self.sleepers = _sleepers()  # [] = every rank

    def before_step(self, step: int) -> None:
        """Exit the process (code 3) when this rank was told to die at ``step``."""
        if self.die_at is not None and step == self.die_at:
            print(f"rank {self.rank}: injected fault at step {step}", file=sys.stderr, flush=True)
            os._exit(3)
        if self.sleep and (not self.sleepers
                           or self.sleepers[step % len(self.sleepers)] == self.rank):
            time.sleep(self.sleep)

    def loss(self, loss: torch.Tensor, attempt: int) -> torch.Tensor:
        """``loss``, made NaN on rank 0 at the configured attempts."""
        if self.rank == 0 and attempt in self.nan_attempts:
            return loss * float("nan")
        return loss


def checkpoint_write_delay(step: int) -> float:
    """Seconds the checkpoint writer (:class:`hvd_lm.train.checkpointer.CheckpointWriter`) sleeps
    before it writes the checkpoint of ``step``: ``HVD_LM_CHECKPOINT_SLEEP``, for every checkpoint
    or, with ``HVD_LM_CHECKPOINT_SLEEP_STEP``, for that step's only; 0 when unset."""
    sleep = float(os.environ.get("HVD_LM_CHECKPOINT_SLEEP", "0") or 0)
    only = os.environ.get("HVD_LM_CHECKPOINT_SLEEP_STEP", "")
    return sleep if not only or int(only) == step else 0.0


def _sleepers() -> list[int]:
    """The ranks of ``HVD_LM_STEP_SLEEP_RANK`` ([] when unset: every rank)."""
    return [int(r) for r in os.environ.get("HVD_LM_STEP_SLEEP_RANK", "").split(",") if r.strip()]


def startup_delay(rank: int) -> None:
    """Sleep ``HVD_LM_STARTUP_SLEEP`` seconds on the ``HVD_LM_STEP_SLEEP_RANK`` ranks (every rank
    when unset); nothing when unset."""
    sleep = float(os.environ.get("HVD_LM_STARTUP_SLEEP", "0") or 0)
    if sleep and (not (who := _sleepers()) or rank in who):
        time.sleep(sleep)
