"""Per-rank TBPTT streams over the HDF5 shards of one manifest split.

Layout of one epoch (Radford et al. 2017 / sentiment-discovery "batchify" generalised to ranks):
the split's shards, in an order fixed by ``seed`` and the epoch, are one byte stream of N tokens.
Its N - 1 prediction targets (positions 1..N-1) are cut into S = world_size x batch_size contiguous
*streams* of near-equal length (the first N mod S are one longer). Rank r owns streams
r*B .. r*B+B-1, one per batch row. Step k feeds each row the window of its stream
``[k*T, (k+1)*T)``: inputs are the bytes just before the targets. So, per epoch, every byte but the
very first is a target exactly once, on exactly one rank, and rows shorter than the longest
stream are padded with ``IGNORE`` targets in the last window. The hidden state is carried across
consecutive windows of a row and reset where a row starts a stream or crosses into a new shard
(``reset`` marks those positions).

The data position (epoch, step) is all a checkpoint needs: windows are a pure function of it.
:class:`Prefetcher` reads the next window on a background thread while the current one trains.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hvd_lm.formats.manifest import Manifest, ShardInfo
from hvd_lm.formats.shards import TOKEN_CHUNK, read_tokens, verify_shard

IGNORE = -100  # target id that torch.nn.functional.cross_entropy(ignore_index=IGNORE) skips
#: Bytes each batch row's reader fetches per HDF5 read (:class:`ConcatStream`); the memory
#: estimate counts one such buffer per row (:mod:`hvd_lm.train.memory`).
READ_AHEAD = 1 << 20


@dataclass
class Batch:
    """One TBPTT window for the B rows of one rank.

    Attributes:
        inputs: int64 [B, T] byte ids.
        targets: int64 [B, T] next-byte ids, ``IGNORE`` on padding.
        reset: bool [B, T]; True where the state must be zeroed before that position.
        chars: number of real (non-padding) targets.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    reset: torch.Tensor
    chars: int


class ConcatStream:
    """Random access to the concatenation of shards, with a read-ahead buffer per caller slot.

    A miss reads ``buffer_bytes`` from the start of the shard's HDF5 chunk that holds ``start``
    (:data:`hvd_lm.formats.shards.TOKEN_CHUNK`): a gzip/lzf shard inflates whole chunks, so an
    aligned read inflates each chunk it needs once. Before reading, a miss looks for another
    slot's buffer that holds the range and shares it (a view, no copy): the B rows of a window
    start at adjacent places, so at an epoch's first window a chunk is read about once, not once
    per row whose stream starts in it (a small corpus's many short rows made that burst stall
    every epoch's first step, most with gzip shards: ``tests/test_data.py`` counts the reads).

    Args:
        shards: the shards, in stream order.
        buffer_bytes: bytes fetched per HDF5 read (sequential reads amortise file opens;
            default :data:`READ_AHEAD`).

    Attributes:
        reads: HDF5 reads made so far (each one file open and one slice).
    """

    def __init__(self, shards: list[ShardInfo], buffer_bytes: int | None = None):
        self.shards = shards
        self.starts = np.concatenate([[0], np.cumsum([s.tokens for s in shards])]).astype(np.int64)
        self.total = int(self.starts[-1])
        self.buffer_bytes = buffer_bytes or READ_AHEAD
        self._buf: dict[int, tuple[int, np.ndarray]] = {}
        self.reads = 0

    def _shard_of(self, pos: int) -> int:
        return int(np.searchsorted(self.starts, pos, side="right")) - 1

    def _read(self, start: int, stop: int) -> np.ndarray:
        out = []
        i = self._shard_of(start)
        while start < stop:
            s_lo, hi = int(self.starts[i]), min(stop, int(self.starts[i + 1]))
            out.append(read_tokens(self.shards[i].path, start - s_lo, hi - s_lo))
            self.reads += 1
            start, i = hi, i + 1
        return np.concatenate(out) if len(out) != 1 else out[0]

    def read(self, start: int, stop: int, slot: int = 0) -> np.ndarray:
        """Bytes ``[start, stop)`` of the stream (uint8), via the buffer of ``slot``."""
        stop = min(stop, self.total)
        if start >= stop:
            return np.zeros(0, np.uint8)
        b0, buf = self._buf.get(slot, (0, np.zeros(0, np.uint8)))
        if not (b0 <= start and stop <= b0 + len(buf)):
            held = [(o, b) for o, b in self._buf.values() if o <= start and stop <= o + len(b)]
            if held:
                b0, buf = max(held, key=lambda ob: ob[0] + len(ob[1]))  # the longest ahead
            else:
                s_lo = int(self.starts[self._shard_of(start)])
                b0 = start - (start - s_lo) % TOKEN_CHUNK
                buf = self._read(b0, min(self.total, max(stop, b0 + self.buffer_bytes)))
            self._buf[slot] = (b0, buf)
        return buf[start - b0:stop - b0]


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """Shard order of ``epoch``: a permutation fixed by (seed, epoch); epoch 0 of seed s is the same
    on every rank and every run."""
    return np.random.default_rng([seed, epoch]).permutation(num_shards).tolist()


def stream_bounds(total: int, num_streams: int) -> np.ndarray:
    """Target ranges of the streams: int64 [num_streams + 1] boundaries over positions 1..total-1.

    Stream s predicts positions ``[b[s], b[s+1])``; lengths differ by at most 1.

    Raises:
        ValueError: when there are fewer targets than streams.
    """
    targets = total - 1
    if targets < num_streams:
        raise ValueError(f"{total} bytes are too few for {num_streams} streams "
                         "(world size x batch size); use fewer ranks or a smaller batch")
    base, extra = divmod(targets, num_streams)  # the first `extra` streams one target longer
    s = np.arange(num_streams + 1, dtype=np.int64)
    return 1 + s * base + np.minimum(s, extra)


class RankStreams:
    """The B streams of one rank over one split, for one epoch at a time.

    Args:
        manifest: the shard directory's manifest.
        split: manifest split name (``train``, ``val``...).
        rank, world_size: this rank and the number of ranks.
        batch_size: rows per rank (B).
        seq_len: window length T, in bytes.
        seed: fixes the shard order of each epoch.
        shuffle_shards: permute the shard order per epoch (False: manifest order, e.g. for eval).
        max_bytes: use only the first ``max_bytes`` of the (ordered) split, 0 = all.
        verify: check every shard's sha256 against the manifest first (raises ShardChecksumError).
        global_rows: ``batch_size`` is the rows of all ranks together (validation: the same cut,
            so the same BPC, at any world size); rank r takes rows [r R / n, (r + 1) R / n)
            rounded up, so rank 0 has the most (its timing of a validation is the slowest
            rank's, what the deadline's plan reserves) and, with more ranks than rows, the last
            ranks none (``batch_size`` 0).

    Raises:
        KeyError: the split is not in the manifest. ValueError: too little data.
    """

    def __init__(self, manifest: Manifest, split: str, rank: int, world_size: int,
                 batch_size: int, seq_len: int, seed: int = 0, shuffle_shards: bool = True,
                 max_bytes: int = 0, verify: bool = False, global_rows: bool = False):
        self.shards = manifest.split(split)
        if verify:
            for info in self.shards:
                verify_shard(info)
        self.rank, self.world_size, self.seq_len = rank, world_size, seq_len
        self.seed, self.shuffle_shards, self.max_bytes = seed, shuffle_shards, max_bytes
        self.total_bytes = min(sum(s.tokens for s in self.shards), max_bytes or math.inf)
        streams = batch_size if global_rows else world_size * batch_size
        self.bounds = stream_bounds(self.total_bytes, streams)
        first, last = ((-(-rank * batch_size // world_size),
                        -(-(rank + 1) * batch_size // world_size))
                       if global_rows else (rank * batch_size, (rank + 1) * batch_size))
        self.batch_size = last - first
        self.row_bounds = self.bounds[first:last + 1]  # [B + 1]
        longest = int(np.max(np.diff(self.bounds)))
        self.windows_per_epoch = math.ceil(longest / seq_len)
        self._epoch = -1
        self._stream: ConcatStream | None = None

    @property
    def chars_per_epoch(self) -> int:
        """Targets per epoch over all ranks: total bytes - 1."""
        return self.total_bytes - 1

    def window(self, epoch: int, step: int) -> Batch:
        """The window of step ``step`` (0-based within ``epoch``) for this rank's rows."""
        if epoch != self._epoch:  # the epoch's shard order
            order = (epoch_shard_order(len(self.shards), self.seed, epoch)
                     if self.shuffle_shards else range(len(self.shards)))
            self._stream = ConcatStream([self.shards[i] for i in order])
            self._epoch = epoch
        stream = self._stream
        B, T = self.batch_size, self.seq_len
        inputs = np.zeros((B, T), np.int64)
        targets = np.full((B, T), IGNORE, np.int64)
        reset = np.zeros((B, T), bool)
        shard_starts = stream.starts[:-1]  # global offsets where each shard begins
        chars = 0
        for b in range(B):
            lo, hi = int(self.row_bounds[b]), int(self.row_bounds[b + 1])
            t0 = lo + step * T  # first target position of the window
            t1 = min(hi, t0 + T)
            if t0 >= t1:
                continue
            seg = stream.read(t0 - 1, t1, slot=b)  # inputs t0-1..t1-2, targets t0..t1-1
            n = t1 - t0
            inputs[b, :n] = seg[:-1]
            targets[b, :n] = seg[1:]
            chars += n
            reset[b, 0] = step == 0
            # A shard start at input position p = t0-1+j: reset before consuming it.
            starts = shard_starts[(shard_starts >= t0 - 1) & (shard_starts < t1 - 1)]
            reset[b, starts - (t0 - 1)] = True
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets),
                     torch.from_numpy(reset), chars)

    def __iter__(self):
        """Windows of epoch 0, in order (evaluation)."""
        for step in range(self.windows_per_epoch):
            yield self.window(0, step)


class Prefetcher:
    """Windows of a :class:`RankStreams` read ahead on one background thread, so the HDF5 reads
    of window i+1 overlap the training step of window i (the step releases the GIL inside
    torch's kernels). Windows are addressed by their global index (epoch x steps per epoch +
    step, as ``Position.window``); a request for any other index than the one read ahead (a
    resume, a jump) is read on the thread too and waited for, so results never depend on timing.
    Every read runs on the one thread, in request order: the streams' caches see one caller.

    Args:
        streams: this rank's training streams.
        depth: windows read ahead (>= 1).
        limit: no window at or past this global index is read ahead (None: no limit).
        pin_memory: return page-locked tensors (for ``.to(cuda, non_blocking=True)``).

    Raises (from :meth:`get`): whatever :meth:`RankStreams.window` raised for that window.
    """

    def __init__(self, streams: RankStreams, depth: int = 1, limit: int | None = None,
                 pin_memory: bool = False):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.streams, self.depth, self.limit, self.pin_memory = streams, depth, limit, pin_memory
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hvd-lm-prefetch")
        self._ahead: dict[int, Future] = {}

    def _read(self, index: int) -> Batch:
        epoch, step = divmod(index, self.streams.windows_per_epoch)
        batch = self.streams.window(epoch, step)
        if self.pin_memory:
            batch = Batch(batch.inputs.pin_memory(), batch.targets.pin_memory(),
                          batch.reset.pin_memory(), batch.chars)
        return batch

    def get(self, index: int) -> Batch:
        """The window with global index ``index``; then the next ``depth`` are read ahead."""
        fut = self._ahead.pop(index, None) or self._pool.submit(self._read, index)
        for stale in [i for i in self._ahead if i < index or i > index + self.depth]:
            self._ahead.pop(stale).cancel()
        for i in range(index + 1, index + 1 + self.depth):
            if i not in self._ahead and (self.limit is None or i < self.limit):
                self._ahead[i] = self._pool.submit(self._read, i)
        return fut.result()

    def close(self) -> None:
        """Drop what was read ahead and stop the thread."""
        self._ahead.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


def window_in_new_cut(window: int, old_windows_per_epoch: int, windows_per_epoch: int) -> int:
    """The window index at the same fraction of the epoch once the streams are cut for another
    world (or batch): epochs done are kept, the part of the epoch scales by ``windows_per_epoch``
    / ``old_windows_per_epoch`` (rounded); ``window`` itself when the cut is the same.

    Args:
        window: windows trained so far (all epochs) in the old cut.
        old_windows_per_epoch, windows_per_epoch: windows per epoch of each rank's streams in
            the old and the new cut (:attr:`RankStreams.windows_per_epoch`).
    """
    epoch, w = divmod(window, old_windows_per_epoch)
    return epoch * windows_per_epoch + round(w * windows_per_epoch / old_windows_per_epoch)


def recut_bytes(total: int, seq_len: int, old_rows: int, old_window: int, rows: int,
                window: int) -> tuple[int, int]:
    """What a resume that cuts an epoch's streams anew (another world size or batch) does to that
    epoch: (bytes re-read, bytes skipped). The saving job had trained the first ``old_window``
    windows of each of its ``old_rows`` streams; the resumed job counts the first ``window`` of
    each of its ``rows`` as done and trains the rest. Re-read: targets trained before that the
    new cut trains again; skipped: targets neither cut trains this epoch (both 0 when the cut is
    the same). Exact interval arithmetic over the epoch's ``total`` bytes (``stream_bounds``),
    O(rows + old_rows) whatever the bytes.

    Args:
        total: bytes of the split (its targets are positions 1..total-1).
        seq_len: the window T, bytes (the same before and after).
        old_rows, old_window: the saving job's streams (world size x batch) and windows done
            in this epoch; rows, window: the resumed job's.
    """
    def done(streams: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        b = stream_bounds(total, streams)
        return b[:-1], np.minimum(b[1:], b[:-1] + w * seq_len)  # disjoint, sorted

    (alo, ahi), (blo, bhi) = done(old_rows, old_window), done(rows, window)
    # measure of B below x: whole intervals before x's, plus the part of x's own
    before = np.concatenate([[0], np.cumsum(bhi - blo)])

    def below(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(blo, x, side="right") - 1
        inside = np.clip(x - blo[np.maximum(i, 0)], 0, (bhi - blo)[np.maximum(i, 0)])
        return np.where(i >= 0, before[np.maximum(i, 0)] + inside, 0)

    both = int(np.sum(below(ahi) - below(alo)))
    return int(np.sum(ahi - alo)) - both, int(np.sum(bhi - blo)) - both
