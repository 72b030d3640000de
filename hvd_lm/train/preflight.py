"""Checks of ``hvd-lm train`` (and ``hvd-lm eval``) that need the data, the world and the
device but no model, run before any shard is read, any model is built or anything is written
into the run folder. Each failure is one line naming the field, its flag and what would fit.

* :func:`check_splits`: the train (and val) split exist in the manifest;
* :func:`check_vocab`: ``model.vocab_size`` is the shards' (the byte tokenizer's 256 ids;
  an embedding of fewer rows fails at the first byte beyond it);
* :func:`check_shapes`: every batch row's share of the train split holds at least one full
  window: (bytes - 1) // (world size x ``--batch-size``) >= ``--seq-len``
  (:class:`hvd_lm.train.data.RankStreams` cuts the split so; a longer window is padding);
* :func:`check_memory`: one training step's estimate (:mod:`hvd_lm.train.memory`) times the
  ranks sharing this node's memory fits in what the device has free;
* :func:`resume_end`: a resumed run that is already at (or past) its last step;
* :func:`run_length`: how many steps the run has, and which of ``--max-steps`` and ``--epochs``
  ends it (a warning when an explicit ``--epochs`` ends it before ``--max-steps``).
"""

from __future__ import annotations

import sys

import torch

from hvd_lm.formats.manifest import MANIFEST_NAME, Manifest
from hvd_lm.formats.tokenizer import TOKENIZER_NAME, VOCAB_SIZE
from hvd_lm.options import ConfigError
from hvd_lm.train import memory
from hvd_lm.train.settings import TrainConfig
from hvd_lm.util.atomic import human


def check_splits(manifest: Manifest, cfg: TrainConfig) -> None:
    """The manifest has the train split and (unless ``data.val_split`` is '') the val split.

    Raises:
        ValueError: naming the field, the manifest and the splits it has.
    """
    have = manifest.split_names
    for field_name, split in (("data.train_split", cfg.data.train_split),
                              ("data.val_split", cfg.data.val_split)):
        if split and split not in have:
            hint = " (--val-split '' trains without validation)" if "val" in field_name else ""
            raise ValueError(f"{field_name} {split!r} is not a split of {manifest.directory}/"
                             f"{MANIFEST_NAME} (it has: {', '.join(have)}){hint}")


def check_vocab(vocab_size: int, manifest: Manifest, what: str = "model.vocab_size",
                fix: str = "") -> None:
    """``vocab_size`` (a model's output classes and embedding rows) equals the manifest's.

    Args:
        what: how to name the setting (``eval`` names the checkpoint's); fix: what to do
            (default: ``use --vocab-size N``).

    Raises:
        ConfigError: naming the setting, the manifest and the accepted value.
    """
    want = manifest.meta.get("vocab_size", VOCAB_SIZE)
    if vocab_size != want:
        raise ConfigError(f"{what} is {vocab_size} but the shards of {manifest.directory} hold "
                          f"byte ids 0..{want - 1} (manifest vocab_size {want}, tokenizer "
                          f"{manifest.meta.get('tokenizer', TOKENIZER_NAME)}); "
                          f"{fix or f'use --vocab-size {want}'}")


def split_bytes(manifest: Manifest, split: str) -> int:
    """Bytes (tokens) of one split of the manifest (0 for '' or an absent split)."""
    return sum(s.tokens for s in manifest.shards if split and s.split == split)


def check_shapes(cfg: TrainConfig, manifest: Manifest, world_size: int) -> None:
    """Every row of the train split holds a whole window, and the val split (its first
    ``run.eval_chars`` bytes) at least one byte per validation row (``run.eval_batch_size``
    rows in all, whatever the world size).

    Raises:
        ConfigError: naming ``data.seq_len``/``data.batch_size``, the split's bytes, the
            per-row share and what would fit.
    """
    d = cfg.data
    rows = world_size * d.batch_size
    who = f"{world_size} rank(s) x {d.batch_size} rows (--batch-size)"
    train = split_bytes(manifest, d.train_split)
    per_row = max(0, train - 1) // rows
    if per_row < d.seq_len:
        fits = (f"use --seq-len {per_row:,} or less" if per_row >= 1 else
                f"use at most {max(1, (train - 1) // world_size):,} rows per rank")
        raise ConfigError(
            f"data.seq_len {d.seq_len:,} (--seq-len) is longer than each row's share of the "
            f"{d.train_split} split of {manifest.directory}: {max(0, train - 1):,} targets / "
            f"({who}) = {per_row:,} bytes per row; {fits}, or fewer --batch-size rows or ranks")
    if d.val_split:
        val = eval_bytes(cfg, manifest)
        if val - 1 < cfg.run.eval_batch_size:  # rows in all, whatever the world size
            raise ConfigError(
                f"run.eval_batch_size {cfg.run.eval_batch_size} (--eval-batch-size) rows, but the "
                f"{d.val_split} split evaluated ({val:,} bytes, --eval-chars {cfg.run.eval_chars}) "
                "has fewer targets; raise --eval-chars (0 = the whole split) or lower "
                "--eval-batch-size")


def eval_bytes(cfg: TrainConfig, manifest: Manifest) -> int:
    """Bytes of the validation split one evaluation reads: the split, capped at
    ``run.eval_chars`` (0 = no cap)."""
    return min(split_bytes(manifest, cfg.data.val_split), cfg.run.eval_chars or sys.maxsize)


def check_memory(cfg: TrainConfig, manifest: Manifest, device: torch.device, world_size: int,
                 local_size: int) -> memory.StepMemory:
    """One training step's memory estimate, refused when the ranks that share this node's
    memory (``local_size`` on the CPU; one per GPU) need more than is free
    (:func:`hvd_lm.train.memory.free_memory`). Skipped with ``run.check_memory`` false.

    Returns:
        The estimate (per rank).

    Raises:
        ConfigError: the estimate by kind, the memory free and what to lower.
    """
    est = memory.step_memory(cfg, device.type, world_size,
                             (split_bytes(manifest, cfg.data.train_split),
                              eval_bytes(cfg, manifest)))
    if not cfg.run.check_memory:
        return est
    sharing = local_size if device.type == "cpu" else 1
    free, where = memory.free_memory(device)
    # the async checkpoint's host copy is rank 0's alone: once per node, not per rank
    if est.total * sharing - (sharing - 1) * est.checkpoint_copy > free:
        d, m = cfg.data, cfg.model
        raise ConfigError(
            f"one training step needs about {human(est.total)} per rank ({est.describe()}) and "
            f"{sharing} rank(s) share the {human(free)} {where}; lower --batch-size "
            f"({d.batch_size}) or --seq-len ({d.seq_len}) (activations grow with both), or "
            f"--hidden-size ({m.hidden_size}); --check-memory false skips this check")
    return est


def resume_end(step: int, window: int, total_steps: int, total_windows: int, k: int,
               source, cfg: TrainConfig, warn: bool = True) -> bool:
    """Whether a run resumed at ``step`` (``window``) has nothing left to train.

    Returns:
        True when it is exactly at the end of this schedule (a finished run started again, e.g.
        a second ``make demo``): a note on stderr when ``warn``; the caller writes nothing.
        False when steps remain.

    Raises:
        ConfigError: it is past the end (``--max-steps`` or ``--epochs`` ending before the
            resumed step): naming the setting, the checkpoint's step and what to give.
    """
    if step < total_steps and window + k <= total_windows:
        return False
    by_steps = cfg.optim.max_steps is not None and total_steps == cfg.optim.max_steps
    ends = (f"--max-steps {cfg.optim.max_steps} (optim.max_steps)" if by_steps else
            f"--epochs {cfg.epochs_bound():g} (data.epochs, {total_steps:,} steps)")
    if step > total_steps or window > total_windows:
        more = (f"give --max-steps above {step} (it counts from step 0, not from the resumed "
                "step)" if by_steps else "raise --epochs or give --max-steps")
        raise ConfigError(f"{source} is at step {step:,}, past the end of this schedule: "
                          f"{ends}; nothing to train: {more}")
    if warn:
        print(f"note: {source} is at step {step:,}, the last of this schedule ({ends}): nothing to "
              "train, nothing written; raise --max-steps or --epochs to continue", file=sys.stderr)
    return True


def deadline_run_ended(lr_factor: float | None, step: int, cfg: TrainConfig, source,
                       warn: bool = True, trained_s: float = 0.0,
                       budget_s: float | None = None) -> bool:
    """Whether a run resumed with ``--time-limit`` or ``--time-budget`` has nothing left to
    train: its saved LR is 0 (the schedule ended there: a run trained to its deadline started
    again), or it has trained ``trained_s`` seconds of its ``budget_s`` already. One note on
    stderr when ``warn``; the caller writes nothing."""
    ended = lr_factor is not None and lr_factor <= 0 and step >= cfg.optim.warmup_steps
    if budget_s is not None and (ended or trained_s >= budget_s):
        why = (f" (step {step:,}) has trained {trained_s:,.1f} s of its --time-budget "
               f"{cfg.run.time_budget}: the budget is spent"
               f"{' (its LR reached 0)' if ended else ''},")
    elif ended:
        why = f" is at step {step:,}, where its schedule ended (LR 0):"
    else:
        return False
    if warn:
        print(f"note: {source}{why} nothing to train, nothing written; start a new run "
              "(--out-dir) to train further", file=sys.stderr)
    return True


def run_length(cfg: TrainConfig, windows_per_epoch: int, k: int, warn: bool = False
               ) -> tuple[int, int, str]:
    """(optimizer steps, windows, which bound ends the run: ``"max_steps"``, ``"epochs"`` or
    ``"time_limit"``).

    ``--max-steps`` wins over the default epoch count (the data is cycled as often as it needs,
    as Lightning's ``max_steps``); an explicit ``--epochs`` still ends the run first when it
    comes first, with a warning on stderr (when ``warn``) that ``--max-steps`` is not reached.
    The window count bounds the read-ahead (``sys.maxsize``: none, the steps end the run).
    With ``--time-limit`` the steps returned are the most the run may take (``--max-steps``,
    ``--epochs`` or ``sys.maxsize``): :mod:`hvd_lm.train.deadline` sets the end as it goes.

    Raises:
        ValueError: not one optimizer step fits the epochs.
    """
    epochs, max_steps = cfg.epochs_bound(), cfg.optim.max_steps
    total_windows = int(epochs * windows_per_epoch) if epochs > 0 else sys.maxsize
    total_steps = total_windows // k
    if total_steps < 1:
        raise ValueError(f"no optimizer step fits: {windows_per_epoch} windows per epoch x "
                         f"{epochs:g} epochs (--epochs) / {k} backward passes per step")
    if cfg.timed:
        return min(total_steps, max_steps or total_steps), total_windows, "time_limit"
    if max_steps and max_steps <= total_steps:
        return max_steps, total_windows, "max_steps"
    if max_steps and warn:
        print(f"hvd-lm train: WARNING: --max-steps {max_steps} is not reached: --epochs {epochs:g} "
              f"ends the run at step {total_steps} ({windows_per_epoch} windows per epoch / {k}); "
              "leave --epochs unset to let --max-steps decide", file=sys.stderr, flush=True)
    return total_steps, total_windows, "epochs"
