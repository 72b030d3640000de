"""Phases 3 and 4 of ``prepare``: the key-ordered stream of the sorted buckets cut into splits and
shards (:func:`plan_shards`, on rank 0: shards are pure functions of the ordered stream), and
each shard assembled from its byte ranges and written atomically (:func:`write_task`, one task
per shard; a resumed run keeps a shard that verifies and matches its plan)."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.settings import PrepareError
from hvd_lm.formats import shards

#: Environment hook for tests: after this many shards written by one process, it kills itself
#: with SIGKILL (simulates a crash midway; ``--resume`` must recover).
KILL_HOOK_ENV = "HVD_LM_PREP_KILL_AFTER_SHARDS"


@dataclass(frozen=True)
class ShardPlan:
    """One output shard: its split, index, file name, counts, and the byte ranges of sorted
    buckets it is made of, ``(bucket, first_doc, stop_doc, first_byte, stop_byte)``."""

    split: str
    index: int
    file: str
    documents: int
    tokens: int
    pieces: tuple


@dataclass(frozen=True)
class WriteTask:
    """Phase-4 task: write shard ``plan`` into ``out`` from the sorted buckets in ``work``;
    with ``resume``, keep an existing file that verifies and matches the plan."""

    plan: ShardPlan
    out: str
    work: str
    attrs: dict
    compression: str
    resume: bool


def split_counts(n: int, ratios: tuple) -> dict:
    """Documents per split for ``n`` documents: val and test get ``floor(n * r / sum)`` but at
    least 1 when their ratio is positive; train gets the rest.

    Raises:
        PrepareError: too few documents to give every split with a positive ratio one.
    """
    total = sum(ratios)
    counts = {name: max(1, int(n * r // total)) if r > 0 else 0
              for name, r in zip(shards.SPLITS[1:], ratios[1:])}
    counts["train"] = n - sum(counts.values())
    if n < sum(r > 0 for r in ratios) or (ratios[0] > 0 and counts["train"] < 1):
        raise PrepareError(f"{n} documents are too few for the split {ratios} "
                           f"(every split with a positive ratio needs one)")
    return {name: counts[name] for name in shards.SPLITS}


# ---- phase 3: plan -------------------------------------------------------------------------


def plan_shards(work: Path, n_buckets: int, counts: dict, shard_size: int) -> list:
    """Cut the key-ordered stream of all sorted buckets into splits and shards.

    Args:
        work: work directory with ``sorted/b*/lengths.npy``.
        n_buckets: number of buckets.
        counts: documents per split (:func:`split_counts`), taken in ``SPLITS`` order.
        shard_size: bytes per shard; a shard is closed before a document that would pass it
            (a document longer than ``shard_size`` gets a shard of its own).
    Returns:
        :class:`ShardPlan` list, splits in ``SPLITS`` order, shards by index.
    """
    plans: list = []
    order = [s for s in shards.SPLITS if counts[s] > 0]
    si, left = 0, counts[order[0]] if order else 0  # the split being cut, its documents left
    index = {s: 0 for s in shards.SPLITS}
    cur, cur_docs, cur_tokens = [], 0, 0  # the shard being cut

    def close():
        nonlocal cur, cur_docs, cur_tokens
        if cur_docs:
            split = order[si]
            plans.append(ShardPlan(split=split, index=index[split],
                                   file=f"{split}-{index[split]:05d}.h5", documents=cur_docs,
                                   tokens=cur_tokens, pieces=tuple(cur)))
            index[split] += 1
        cur, cur_docs, cur_tokens = [], 0, 0

    for b in range(n_buckets):
        lens = np.load(work / "sorted" / f"b{b:05d}" / "lengths.npy")
        cum = np.r_[0, np.cumsum(lens, dtype=np.int64)]
        i = 0
        while i < len(lens):
            room = shard_size - cur_tokens
            j = int(np.searchsorted(cum, cum[i] + room, side="right")) - 1
            j = min(j, i + left, len(lens))
            if j <= i and cur_docs == 0:
                j = i + 1  # one document larger than a shard: a shard of its own
            if j > i:
                cur.append((b, i, j, int(cum[i]), int(cum[j])))
                cur_docs += j - i
                cur_tokens += int(cum[j] - cum[i])
                left -= j - i
                i = j
            if left == 0:
                close()
                si += 1
                if si >= len(order):
                    break
                left = counts[order[si]]
            elif i < len(lens):
                close()  # the next document does not fit
    close()
    return plans


# ---- phase 4: write ------------------------------------------------------------------------


def _kill_hook() -> None:
    limit = os.environ.get(KILL_HOOK_ENV)
    if limit:
        _kill_hook.count = getattr(_kill_hook, "count", 0) + 1
        if _kill_hook.count >= int(limit):
            os.kill(os.getpid(), signal.SIGKILL)


def write_task(task: WriteTask, progress=None) -> tuple:
    """Phase 4 for one shard: keep it when resuming and it verifies, else assemble and write it.

    Returns:
        ``(sha256 hex, kept)``.
    """
    plan = task.plan
    path = Path(task.out) / plan.file
    if task.resume and path.exists():
        with contextlib.suppress(ValueError, OSError):  # a shard that fails is rewritten below
            attrs = shards.check_shard(path)
            want = {"config_sha256": task.attrs["config_sha256"], "split": plan.split,
                    "documents": plan.documents, "bytes": plan.tokens}
            if all(attrs.get(k) == v for k, v in want.items()):
                return attrs["sha256"], True
    tokens = np.empty(plan.tokens, dtype=np.uint8)
    offsets = np.zeros(plan.documents + 1, dtype=np.int64)
    view = memoryview(tokens)
    pos = d = 0
    for b, i, j, a, z in plan.pieces:
        bdir = Path(task.work) / "sorted" / f"b{b:05d}"
        with open(bdir / "data.bin", "rb") as f:
            f.seek(a)
            got = f.readinto(view[pos:pos + z - a])
        if got != z - a:
            raise OSError(f"{bdir / 'data.bin'}: short read ({got} of {z - a} bytes)")
        lens = np.load(bdir / "lengths.npy", mmap_mode="r")[i:j]
        offsets[d + 1:d + 1 + len(lens)] = pos + np.cumsum(lens)
        pos += z - a
        d += len(lens)
    attrs = dict(task.attrs, split=plan.split, shard_index=plan.index)
    digest = shards.write_shard(path, tokens, offsets, attrs, compression=task.compression)
    _kill_hook()
    if progress is not None:
        progress(plan.tokens)
    return digest, False
