"""Hostile and careless input, issue 44: errors are one line naming the file or flag. A path or
value a user gave is rendered by one function (:func:`hvd_lm.util.files.shown`: control characters
escaped, length capped), so a path holding a newline never prints a forged second ``ERROR:``
line and a 5,000-character path gives a line of a few hundred; a file that is not what it
should be is named with what it is (a FIFO, a device, an .npz named .npy, a 2 TiB array header,
JSON nested 100,000 deep, a model config's bad field, a damaged gzip chunk of an unverified
shard); ``import-openai`` refuses NaN, infinite and complex arrays instead of writing an export
every command then refuses or misreads. Each through the command a user runs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hvd_lm.cli import main
from tests.hostile_common import (  # noqa: F401 - fixtures, shared with the first cases
    TINY,
    hvd_lm,
    one_error_line,
    prepare_cli,
    reviews,
)
from tests.test_hostile_reads import capped
from tests.test_transfer import write_checkpoint


def err_of(rc: int, capsys) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], rc, "", capsys.readouterr().err)


# ---- a newline in a path is escaped: one line, never a forged second ERROR -----------------------

FORGED = "x\nERROR: all is well, ignore the line above"


def test_a_newline_in_a_path_never_forges_a_second_error_line(shards, tmp_path, capsys):
    """Before: prepare, classify and train printed the path as it was, newline included: two
    lines, the second a forged ``ERROR:``."""
    bad = tmp_path / FORGED
    ckpt = write_checkpoint(tmp_path / "run")
    proc = prepare_cli(bad, "--out", tmp_path / "out")
    line = one_error_line(proc, "x\\nERROR: all is well", "no such file")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for argv in (["train", "--shards", str(bad), "--out-dir", str(tmp_path / "r")],
                 ["classify", str(ckpt), str(bad), "--input", "-"],
                 ["eval", str(bad), str(shards)]):
        rc = main(argv)
        cap = err_of(rc, capsys)
        line = one_error_line(cap, "x\\nERROR: all is well")
        assert len(cap.stderr.strip().splitlines()) == 1 and line.count("ERROR:") >= 2, cap.stderr


def test_a_path_of_5000_characters_gives_a_short_line(shards, tmp_path):
    """Before: a 5,000-character --out-dir gave a 5,055-character error line."""
    long = tmp_path / ("d" * 5000)
    proc = hvd_lm("train", "--shards", shards, "--out-dir", long, *TINY, "--max-steps", "1")
    line = one_error_line(proc, "file name too long", "characters left out")
    assert len(line) < 600, len(line)
    assert str(tmp_path)[:40] in line and "d" * 60 in line


@pytest.mark.parametrize("split", ["1e308,1e308,1", "inf,1,1", "1,nan"])
def test_split_ratios_are_finite(reviews, tmp_path, split):
    """Before: ``--split 1e308,1e308,1`` failed with "cannot convert float NaN to integer"."""
    proc = prepare_cli(reviews, "--out", tmp_path / "out", "--split", split)
    one_error_line(proc, f"--split {split}: expected 1-3 finite non-negative numbers")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags,needle", [
    (["--cycle-time-ms", "5"], "dist.cycle_time_ms (--cycle-time-ms) is Horovod's fusion cycle"),
    (["--allreduce-op", "adasum"], "dist.allreduce_op adasum (--allreduce-op) is Horovod's"),
])
def test_horovod_only_knobs_are_refused_with_the_torch_engine(shards, tmp_path, capsys, flags,
                                                              needle):
    """Before (issue 56): ``--backend torch --cycle-time-ms 5`` was accepted and did nothing
    (adasum failed only once the engine was up). Now one line naming the flag, before any
    work; the same flags with Horovod are still accepted by the settings."""
    out = tmp_path / "r"
    rc = main(["train", "--backend", "torch", *flags, "--shards", str(shards), "--out-dir",
               str(out), *TINY])
    one_error_line(err_of(rc, capsys), needle, "--backend horovod")
    assert rc == 2 and not out.exists()
    from hvd_lm.options import from_dict
    from hvd_lm.train.settings import TrainConfig

    from_dict(TrainConfig, {"dist": {"backend": "horovod", "cycle_time_ms": 5.0,
                                     "allreduce_op": "adasum"}, "optim": {"max_steps": 1}})


# ---- files named with what they are: a FIFO, a device --------------------------------------------

def test_a_fifo_or_a_device_is_named_as_what_it_is(shards, tmp_path, capsys):
    """Before: a FIFO given to prepare, or /dev/zero given to eval as its checkpoint, were
    reported as "no such file"."""
    fifo = tmp_path / "reviews.txt"
    os.mkfifo(fifo)
    proc = prepare_cli(fifo, "--out", tmp_path / "out", timeout=60)
    one_error_line(proc, f"{fifo}: a FIFO (named pipe), not a regular file")
    rc = main(["eval", "/dev/zero", str(shards)])
    one_error_line(err_of(rc, capsys), "/dev/zero: a character device, not a regular file",
                   "checkpoints are torch.save zip files")


# ---- an export's config.json: nested 100,000 deep, a model field out of its choices -------------

def test_an_exports_config_that_is_not_one_is_named(shards, tmp_path, capsys):
    """Before: a deeply nested config.json raised RecursionError, and ``model: {cell: bogus}``
    printed ``model: cell must be one of ...`` naming no file."""
    exp = tmp_path / "exp"
    assert main(["export", str(write_checkpoint(tmp_path / "run")), str(exp)]) == 0
    cfg = exp / "config.json"
    good = json.loads(cfg.read_text())
    cfg.write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc = main(["eval", str(exp), str(shards)])
    one_error_line(err_of(rc, capsys), f"{cfg}: JSON nested too deeply")
    cfg.write_text(json.dumps({**good, "model": {**good["model"], "cell": "bogus"}}))
    rc = main(["eval", str(exp), str(shards)])
    one_error_line(err_of(rc, capsys), f"{cfg}: model.cell must be one of ['mlstm', 'lstm'], "
                   "got 'bogus'")
    assert rc != 0


# ---- a damaged gzip chunk of a shard read without verification -----------------------------------

def test_a_damaged_chunk_of_an_unverified_shard_names_the_shard(reviews, tmp_path):
    """Before: ``--verify-shards false`` over a shard whose gzip chunk was damaged stopped with
    HDF5's message (``Can't read data (inflate() failed)``), naming no shard."""
    import h5py

    data = tmp_path / "data"
    assert prepare_cli(reviews, "--out", data, "--compression", "gzip", "--split", "8,2",
                       "--shard-size", "64K").returncode == 0
    shard = data / "train-00000.h5"
    with h5py.File(shard, "r") as f:
        info = f["tokens"].id.get_chunk_info(0)
    with open(shard, "r+b") as f:
        f.seek(info.byte_offset + info.size // 2)
        f.write(b"\xff" * 16)
    proc = hvd_lm("train", "--shards", data, "--out-dir", tmp_path / "r", *TINY,
                  "--max-steps", "2", "--verify-shards", "false")
    one_error_line(proc, f"{shard}: tokens", "unreadable", "the shard is damaged",
                   "hvd-lm verify")


# ---- import-openai: the header before the array; finite real weights -----------------------------

def openai_arrays(folder: Path, E: int = 4, H: int = 8) -> Path:
    """OpenAI's 15 arrays (hvd_lm/model/load.py's layout) at a tiny width."""
    shapes = [(256, E), (E, 4 * H)] + [(H, H)] * 4 + [(E, H), (H, H), (4 * H,), (4 * H,),
                                                      (4 * H,), (H,), (H,), (H, 256), (256,)]
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, shape in enumerate(shapes):
        np.save(folder / f"{i}.npy", rng.standard_normal(shape).astype(np.float32) + 0.5)
    return folder


def huge_header(path: Path) -> None:
    """A .npy of 128 bytes whose header declares 2 TiB of float64."""
    header = np.lib.format.header_data_from_array_1_0(np.zeros(0))
    header["shape"] = (2**38,)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * 16)


@pytest.mark.parametrize("index,damage,needle", [
    (0, huge_header, "its header declares [274877906944] float64 (2,199,023,255,552 bytes), "
                     "more than the 1,073,741,824 bytes"),
    (1, lambda p: np.savez(p.with_suffix(".npz"), a=np.zeros(3)) or os.replace(
        p.with_suffix(".npz"), p), "a zip archive (an .npz?), not a .npy array file"),
    (5, lambda p: np.save(p, np.full((8, 8), np.nan, np.float32)), "holds 64 NaN or infinite"),
    (13, lambda p: np.save(p, np.full((8, 256), 1e300)), "holds 2,048 NaN or infinite values "
                                                         "(as float32)"),
    (8, lambda p: np.save(p, np.ones(32, np.complex64)), "dtype complex64, expected floating"),
    (0, lambda p: np.save(p, np.zeros((256, 0), np.float32)),
     "0.npy: shape [256, 0] gives no E (its columns)"),
])
def test_import_openai_refuses_arrays_that_are_not_weights(tmp_path, index, damage, needle):
    """Before: a 2 TiB header was a MemoryError, an .npz named 1.npy an AttributeError, NaN
    and inf weights were written into an export every command then refused, a complex array was
    cast with only a numpy warning, and an empty embedding read ``shape [256, 0], expected
    [256, 0]``. Under an address-space cap: nothing is allocated from a header."""
    model = openai_arrays(tmp_path / "model")
    out = tmp_path / "exp"
    assert capped("import-openai", model, out).returncode == 0  # the undamaged set imports
    shutil.rmtree(out)
    damage(model / f"{index}.npy")
    proc = capped("import-openai", model, out)
    one_error_line(proc, f"{index}.npy", needle)
    assert not out.exists()
