"""When a run has diverged, and which of its checkpoints may stay ``latest``.

Two rules stop a run (:class:`DivergenceGuard`), and every rank reaches the same decision because
both read only values all ranks share:

* **Non-finite steps**: ``run.max_skipped_steps`` step attempts in a row skipped for non-finite
  gradients (the skip itself is decided on the allreduced gradients, so it is global).
* **Loss by value**: the logged training loss (nats per character, the allreduced sum of nats
  over the allreduced characters since the previous log line: the same float on every rank) is
  above ``run.divergence_loss`` for ``run.divergence_logs`` logged steps in a row, or still above
  it at the run's last step. A NaN or infinite logged loss counts as above.

The bound. A predictor that gives each of the V = 256 byte values probability 1/V has
cross-entropy exactly ln V = 5.545 nats (8 bits) per character on any text (Cover & Thomas,
*Elements of Information Theory*, ch. 2: H(p, q) = -sum p ln q, which for a uniform q is ln V
whatever p is); a freshly initialised model starts near it (its logits are small), and a model
that has learned even the byte frequencies of text is below it (the demo's H=256 model reaches
2.398 bits = 1.66 nats per character, README). The default bound is twice that, 2 ln 256 =
11.09 nats (16 bits per character), a loss no learning run reaches: the model then gives the
next byte a geometric-mean probability below 1/65,536. Several logged steps in a row (3 by
default) keep one noisy log interval from stopping a run; a loss that stays up is what large LM
runs restart from a checkpoint written before it for (Chowdhery et al. 2022, PaLM, section 5.1:
restarts from ~100 steps before a loss spike), so that checkpoint is the one kept.

Checkpoints. A logged loss measures the weights of the steps *before* it, so a checkpoint of
step s is *confirmed* once a loss logged at a later step is within the bound.
While the newest logged loss is above the bound no checkpoint is written (:meth:`may_checkpoint`);
the newest confirmed checkpoint is never pruned by ``--keep-checkpoints``
(:meth:`confirmed_below`, passed to :func:`hvd_lm.formats.checkpoint.save`); and when the run stops
diverged, :meth:`settle` moves the checkpoints this job wrote that no good loss confirmed to
``checkpoints/diverged/`` and points ``latest`` at the newest checkpoint written before the
divergence (or removes ``latest`` when there is none).
"""

from __future__ import annotations

import math
from pathlib import Path

from hvd_lm.formats.tokenizer import VOCAB_SIZE
from hvd_lm.util.atomic import write_text

#: Cross-entropy of the uniform predictor over the byte values, nats per character (ln 256).
UNIFORM_LOSS = math.log(VOCAB_SIZE)
#: Default ``run.divergence_loss``: 2 ln 256 = 11.09 nats (16 bits) per character, rounded.
DEFAULT_BOUND = round(2 * UNIFORM_LOSS, 2)


class TrainingDiverged(RuntimeError):
    """The run stopped by one of the two rules of :class:`DivergenceGuard`; the message names
    the rule, the steps, the checkpoint kept as ``latest`` and what to change."""


class DivergenceGuard:
    """Counts the two divergence signals of one run (see the module docstring).

    Args:
        max_loss: ``run.divergence_loss``, nats per character.
        logs: ``run.divergence_logs``, logged steps in a row above ``max_loss`` (0 = off).
        max_skipped: ``run.max_skipped_steps``, skipped attempts in a row (0 = never).
        start_step: the step this job starts at (a resumed run's checkpoint is the confirmed
            point before any loss is logged).

    Attributes:
        reason: None while training may go on; ``"skipped"`` or ``"loss"`` once a rule fired.
    """

    def __init__(self, max_loss: float, logs: int, max_skipped: int, start_step: int = 0):
        self.max_loss, self.logs, self.max_skipped = max_loss, logs, max_skipped
        self.reason: str | None = None
        self.skipped_in_a_row = 0
        self.above: list[tuple[int, float]] = []  # (step, loss) of the logged losses in a row
        # checkpoints below this step are confirmed: the newest logged loss within the bound,
        # or, before any, the checkpoint this job resumed from (hence + 1)
        self.last_good_step = start_step + 1
        self.written: list[int] = []              # steps of the checkpoints this job wrote

    # ---- what the loop reports ----------------------------------------------------------------

    def attempt(self, applied: bool) -> None:
        """One step attempt: applied, or skipped for non-finite gradients."""
        self.skipped_in_a_row = 0 if applied else self.skipped_in_a_row + 1
        if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            self.reason = "skipped"

    def logged(self, step: int, loss: float) -> None:
        """The logged (allreduced) training loss at ``step``, nats per character. With the loss
        rule off (``logs`` = 0) every logged step confirms the checkpoints before it, so
        ``above`` holds losses only while the rule is on."""
        if not self.logs or loss <= self.max_loss:  # False for NaN
            self.above.clear()
            self.last_good_step = step
            return
        self.above.append((step, loss))
        if len(self.above) >= self.logs:
            self.reason = "loss"

    def at_end(self) -> None:
        """The run reached its last step: ending with the newest logged loss above the bound
        is a divergence too (its final checkpoint would be a diverged model)."""
        if self.above and self.reason is None:
            self.reason = "loss"

    def wrote(self, step: int) -> None:
        """The checkpoint of ``step`` was written (every rank records it: the counters stay
        alike on all ranks)."""
        self.written.append(step)

    # ---- what the loop asks -------------------------------------------------------------------

    def newest_above(self) -> float | None:
        """The newest logged loss above the bound in the current streak (None: none)."""
        return self.above[-1][1] if self.above else None

    def one_skip_from_the_end(self) -> bool:
        """Whether one more skipped attempt would end the run (``max_skipped``)."""
        return bool(self.max_skipped and self.skipped_in_a_row + 1 >= self.max_skipped)

    def may_checkpoint(self) -> bool:
        """Whether a checkpoint may be written now: no rule fired and the newest logged loss is
        within the bound."""
        return self.reason is None and not self.above

    def confirmed_below(self) -> int:
        """Checkpoints of steps below this one were confirmed by a later logged loss within the
        bound (the newest of them is kept whatever ``--keep-checkpoints`` says)."""
        return self.last_good_step

    def state_dict(self) -> dict:
        """The counters (an elastic commit carries them, so a joining worker decides alike)."""
        return {"skipped_in_a_row": self.skipped_in_a_row, "above": list(self.above),
                "last_good_step": self.last_good_step, "written": list(self.written)}

    def load_state_dict(self, state: dict) -> None:
        """Take the counters of :meth:`state_dict`."""
        self.skipped_in_a_row = state["skipped_in_a_row"]
        self.above = [tuple(x) for x in state["above"]]
        self.last_good_step = state["last_good_step"]
        self.written = list(state["written"])

    # ---- after the stop (rank 0) ----------------------------------------------------------------

    def settle(self, run_dir: str | Path) -> tuple[Path | None, list[Path]]:
        """Move this job's unconfirmed checkpoints (step >= :meth:`confirmed_below`) to
        ``checkpoints/diverged/`` and point ``latest`` at the newest confirmed checkpoint left
        (step below :meth:`confirmed_below`).

        Returns:
            (the checkpoint now ``latest`` or None, the moved files at their new paths).
        """
        from hvd_lm.formats import checkpoint as ckpt_io  # torch: not for the settings' import

        d = ckpt_io.checkpoint_dir(run_dir)
        moved = []
        for path in ckpt_io.list_checkpoints(run_dir):
            step = ckpt_io.step_of(path)
            if step in self.written and step >= self.last_good_step:
                aside = d / "diverged" / path.name
                aside.parent.mkdir(exist_ok=True)
                path.replace(aside)
                moved.append(aside)
        # latest goes back to a confirmed checkpoint (a file of a higher step that this job did
        # not write is not this run's: hvd_lm.formats.checkpoint)
        kept = [p for p in ckpt_io.list_checkpoints(run_dir)
                if ckpt_io.step_of(p) < self.last_good_step]
        if kept:
            write_text(d / "latest", kept[-1].name + "\n")
        elif (d / "latest").exists():
            (d / "latest").unlink()
        return (kept[-1] if kept else None), moved

    def error(self, step: int, settled: tuple[Path | None, list[Path]] | None) -> TrainingDiverged:
        """The one-line error of a diverged run stopped at ``step``; ``settled`` is what
        :meth:`settle` returned (None on the ranks that did not settle: they leave the
        checkpoint to rank 0's line)."""
        if self.reason == "skipped":
            what = (f"{self.skipped_in_a_row} steps in a row had non-finite gradients (step "
                    f"{step}); --max-skipped-steps allows more")
        else:
            (s0, l0), (s1, l1) = self.above[0], self.above[-1]
            span = f"step {s0}" if s0 == s1 else f"steps {s0}-{s1}"
            what = (f"the logged training loss stayed above --divergence-loss {self.max_loss:g} "
                    f"nats per char (a uniform guess is {UNIFORM_LOSS:.3f}) for {len(self.above)}"
                    f" logged step(s) in a row ({span}: {l0:.4g} .. {l1:.4g}); "
                    "--divergence-logs 0 turns this check off")
        if settled is None:
            kept = "rank 0 names the checkpoint kept as latest"
        else:
            latest, moved = settled
            kept = (f"the newest checkpoint written before it, {latest}, is latest" if latest
                    else "no checkpoint was written before it")
            if moved:
                kept += f"; {len(moved)} written since moved to {moved[0].parent}"
        return TrainingDiverged(f"training diverged: {what}; {kept}; lower --lr or --lr-cap")
