"""Per-rank TBPTT streams: disjoint across ranks, nothing skipped, resets at stream/shard starts."""
import numpy as np
import pytest
import torch

from hvd_lm.formats.manifest import load_manifest
from hvd_lm.formats.shards import read_tokens
from hvd_lm.train.data import IGNORE, Prefetcher, RankStreams, epoch_shard_order, stream_bounds
from tests.shardutil import default_shards


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return load_manifest(default_shards(tmp_path_factory.mktemp("shards")))


def test_stream_bounds_partition():
    b = stream_bounds(101, 7)
    assert b[0] == 1 and b[-1] == 101
    lengths = np.diff(b)
    assert lengths.max() - lengths.min() <= 1
    with pytest.raises(ValueError, match="too few"):
        stream_bounds(5, 8)


@pytest.mark.parametrize("rows,world", [(30, 4), (32, 64), (5, 3), (7, 7)])
def test_validation_rows_split_over_the_ranks_rank_0_the_most(manifest, rows, world):
    """``global_rows``: the ranks' rows are the one cut of ``rows`` streams, each row on one rank
    (their bounds together are the one-process cut's), rank 0 with the most (its timing of a
    validation is the deadline plan's), none missing when there are more ranks than rows."""
    cut = [RankStreams(manifest, "val", r, world, rows, 16, shuffle_shards=False,
                       global_rows=True) for r in range(world)]
    counts = [s.batch_size for s in cut]
    assert sum(counts) == rows and counts[0] == max(counts) >= 1
    assert max(counts) - min(counts) <= 1
    whole = RankStreams(manifest, "val", 0, 1, rows, 16, shuffle_shards=False).row_bounds
    starts = np.concatenate([s.row_bounds[:-1] for s in cut])
    np.testing.assert_array_equal(starts, whole[:-1])


@pytest.mark.parametrize("world,batch,seq", [(1, 4, 64), (2, 2, 64), (3, 5, 50)])
def test_every_target_once_per_epoch_across_ranks(manifest, world, batch, seq):
    # The epoch's byte stream, built independently from the shards in the epoch's order.
    shards = manifest.split("train")
    order = epoch_shard_order(len(shards), 7, 1)
    stream = np.concatenate([read_tokens(shards[i].path, 0, shards[i].tokens) for i in order])
    covered = np.zeros(len(stream), np.int32)
    steps = None
    for rank in range(world):
        rs = RankStreams(manifest, "train", rank, world, batch, seq, seed=7)
        steps = steps or rs.windows_per_epoch
        assert rs.windows_per_epoch == steps  # every rank runs the same number of steps
        lo = rs.row_bounds
        for step in range(rs.windows_per_epoch):
            win = rs.window(1, step)
            for b in range(batch):
                t0 = lo[b] + step * seq
                n = int(max(0, min(lo[b + 1], t0 + seq) - t0))
                np.testing.assert_array_equal(win.targets[b, :n].numpy(), stream[t0:t0 + n])
                np.testing.assert_array_equal(win.inputs[b, :n].numpy(), stream[t0 - 1:t0 - 1 + n])
                assert (win.targets[b, n:] == IGNORE).all()
                covered[t0:t0 + n] += 1
                if step == 0:
                    assert win.reset[b, 0]
    assert covered[0] == 0 and (covered[1:] == 1).all()


def test_rows_share_chunk_aligned_reads(manifest, monkeypatch):
    """With a read-ahead of one 4 KiB chunk (data.TOKEN_CHUNK and READ_AHEAD patched down, so
    the ~20 KB test shards span several), every window of 64 rows equals the epoch's byte stream
    built independently; and the epoch's first window reads about once per chunk its rows touch,
    not once per row (each row's stream is ~950 bytes: about four rows start in each chunk)."""
    from hvd_lm.train import data

    monkeypatch.setattr(data, "TOKEN_CHUNK", 4096)
    monkeypatch.setattr(data, "READ_AHEAD", 4096)
    shards = manifest.split("train")
    order = epoch_shard_order(len(shards), 7, 1)
    stream = np.concatenate([read_tokens(shards[i].path, 0, shards[i].tokens) for i in order])
    batch, seq = 64, 64
    rs = RankStreams(manifest, "train", 0, 1, batch, seq, seed=7)
    first = rs.window(1, 0)
    starts = np.cumsum([0] + [shards[i].tokens for i in order])

    def chunk(p):  # (shard, chunk) of stream position p
        j = int(np.searchsorted(starts, p, side="right")) - 1
        return j, int(p - starts[j]) // 4096

    touched = {chunk(p) for lo in rs.row_bounds[:-1] for p in (lo - 1, lo + seq - 1)}
    assert rs._stream.reads <= len(touched) + len(shards) < batch / 2, \
        (rs._stream.reads, len(touched))
    lo = rs.row_bounds
    for step in range(rs.windows_per_epoch):
        win = first if step == 0 else rs.window(1, step)
        for b in range(batch):
            t0 = lo[b] + step * seq
            n = int(max(0, min(lo[b + 1], t0 + seq) - t0))
            np.testing.assert_array_equal(win.inputs[b, :n].numpy(), stream[t0 - 1:t0 - 1 + n])
            np.testing.assert_array_equal(win.targets[b, :n].numpy(), stream[t0:t0 + n])


def test_reset_at_shard_starts(manifest):
    shards = manifest.split("train")
    rs = RankStreams(manifest, "train", 0, 1, 1, 10_000_000, shuffle_shards=False)
    win = rs.window(0, 0)
    starts = np.cumsum([s.tokens for s in shards])[:-1]
    # input position p sits at column p (the row starts at input 0)
    assert sorted(np.nonzero(win.reset[0].numpy())[0].tolist()) == [0, *starts.tolist()]


def test_order_is_a_shuffle_fixed_by_seed_and_epoch_alone():
    """The epoch's shard order is a permutation of the shards; the same in another process and
    whatever the global RNGs hold (every rank of every run agrees); another epoch or seed gives
    another order; and it shuffles: over 2000 seeds each shard comes first about equally often
    (a fixed or rotated order fails)."""
    import random
    import subprocess
    import sys

    import torch

    order = epoch_shard_order(10, 3, 2)
    assert sorted(order) == list(range(10))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    assert epoch_shard_order(10, 3, 2) == order
    other = subprocess.run([sys.executable, "-c", "from hvd_lm.train.data import "
                            "epoch_shard_order as o; print(o(10, 3, 2))"],
                           capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(order)
    assert epoch_shard_order(10, 3, 3) != order and epoch_shard_order(10, 4, 2) != order
    firsts = np.bincount([epoch_shard_order(10, seed, 0)[0] for seed in range(2000)],
                         minlength=10)
    assert firsts.min() > 140 and firsts.max() < 260, firsts  # 200 each expected


class CountingStreams(RankStreams):
    """RankStreams that records which windows were read (and can fail on one)."""

    def __init__(self, *args, fail_at=None, **kw):
        super().__init__(*args, **kw)
        self.read, self.fail_at = [], fail_at

    def window(self, epoch, step):
        self.read.append((epoch, step))
        if (epoch, step) == self.fail_at:
            raise OSError("shard unreadable")
        return super().window(epoch, step)


def test_prefetcher_returns_the_same_windows_in_any_order(manifest):
    """Sequential reads, an epoch boundary, a jump (resume) and a step back all give exactly
    RankStreams.window's windows; nothing at or past ``limit`` is read ahead."""
    direct = RankStreams(manifest, "train", 1, 2, 3, 40, seed=5)
    n = direct.windows_per_epoch
    streams = CountingStreams(manifest, "train", 1, 2, 3, 40, seed=5)
    pre = Prefetcher(streams, depth=2, limit=n + 4)
    try:
        for index in [0, 1, 2, n - 1, n, n + 1, 7, 3, n + 3]:
            got, want = pre.get(index), direct.window(*divmod(index, n))
            assert got.chars == want.chars
            for a, b in ((got.inputs, want.inputs), (got.targets, want.targets),
                         (got.reset, want.reset)):
                assert torch.equal(a, b), index
    finally:
        pre.close()
    assert max(e * n + s for e, s in streams.read) == n + 3  # limit n + 4: n + 4, n + 5 never
    assert (0, 1) in streams.read[:3]  # window 1 was read ahead while 0 was being used


def test_prefetcher_raises_the_readers_error(manifest):
    streams = CountingStreams(manifest, "train", 0, 1, 2, 50, fail_at=(0, 1))
    pre = Prefetcher(streams)
    try:
        pre.get(0)
        with pytest.raises(OSError, match="unreadable"):
            pre.get(1)
        with pytest.raises(ValueError, match="depth"):
            Prefetcher(streams, depth=0)
    finally:
        pre.close()
