"""Hostile and careless input, issue 44: what a command writes (:mod:`hvd_lm.util.files`, the one
owner). Nothing is written through a link out of the folder a run owns (its ``.lock``, its
``metrics.jsonl``); an output flag naming one of the command's inputs or one of the files it
writes is refused before any work (prepare's ``--summary-json``, ``launch --out``, ``eval`` and
``generate --output`` over an export's config.json); two downloads are never saved as one file,
and a destination that is a FIFO is refused, not opened; a directive value ending in a newline
is not one word. Each case through the command a user runs: one ERROR line naming the file or
flag, a non-zero exit, and every file outside what the command owns byte for byte as it was."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hvd_lm.cli import main
from tests.hostile_common import (  # noqa: F401 - fixtures, shared with the first cases
    TINY,
    hvd_lm,
    one_error_line,
    prepare_cli,
    reviews,
    server,
    snapshot,
    sources,
)
from tests.test_transfer import write_checkpoint


def precious(tmp_path: Path) -> Path:
    """A user's file outside every folder the commands below own."""
    p = tmp_path / "elsewhere" / "precious.txt"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("a user's file, not the run's\n")
    return p


# ---- case 1: a folder's .lock that is a link, or a hard link, is never written ------------------

@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_prepare_never_writes_its_lock_through_a_link(reviews, tmp_path, how):
    """A ``.lock`` in a prepare output folder that leads to a user's file: before, the lock
    opened it O_RDWR|O_CREAT (following the link), truncated the target and wrote its holder
    JSON there, exit 0."""
    target = precious(tmp_path)
    before = target.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    if how == "symlink":
        (out / ".lock").symlink_to(target)
    else:
        os.link(target, out / ".lock")
    proc = prepare_cli(reviews, "--out", out)
    needle = "a link to" if how == "symlink" else "a file of 2 names (hard links)"
    one_error_line(proc, f"{out / '.lock'}: {needle}", "a folder's lock is a file of its own")
    assert target.read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no work, no shard


def test_train_never_writes_its_lock_through_a_link(shards, tmp_path):
    target = precious(tmp_path)
    before = target.read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(target)
    proc = hvd_lm("train", "--shards", shards, "--out-dir", run, *TINY, "--max-steps", "2")
    one_error_line(proc, f"{run / '.lock'}: a link to {target}")
    assert target.read_bytes() == before
    assert not (run / "checkpoints").exists()


# ---- case 5: metrics.jsonl that is a link out of the run folder --------------------------------

def test_metrics_are_never_appended_through_a_link_out_of_the_run(shards, tmp_path):
    """Before: the run appended its records to the file the link led to, outside the run."""
    target = precious(tmp_path)
    before = target.read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(target)
    proc = hvd_lm("train", "--shards", shards, "--out-dir", run, *TINY, "--max-steps", "2")
    one_error_line(proc, f"{run / 'metrics.jsonl'}: a link to {target}", "outside",
                   "remove the link")
    assert target.read_bytes() == before
    # a link inside the run folder is the run's own file: followed
    (run / "metrics.jsonl").unlink()
    (run / "old.jsonl").write_text("")
    (run / "metrics.jsonl").symlink_to("old.jsonl")
    proc = hvd_lm("train", "--shards", shards, "--out-dir", run, *TINY, "--max-steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert '"kind": "start"' in (run / "old.jsonl").read_text()


# ---- case 2: prepare's --summary-json naming its input or its manifest -------------------------

def test_prepare_summary_never_replaces_an_input_or_the_manifest(reviews, tmp_path):
    """Before: ``--summary-json INPUT`` replaced the input CSV with the summary, and
    ``--summary-json OUT/manifest.json`` replaced the manifest (verify then failed)."""
    src = tmp_path / "mine.txt"
    src.write_bytes(reviews.read_bytes())
    out = tmp_path / "out"
    proc = prepare_cli(src, "--out", out, "--summary-json", src)
    one_error_line(proc, f"--summary-json {src}: is {src}, which this command reads")
    assert src.read_bytes() == reviews.read_bytes() and not out.exists()  # before any work
    assert prepare_cli(src, "--out", out).returncode == 0
    before = snapshot(out)
    for target in (out / "manifest.json", out / "train-00000.h5", out / ".lock"):
        proc = prepare_cli(src, "--out", out, "--overwrite", "--summary-json", target)
        one_error_line(proc, f"--summary-json {target}: is {target.name} of --out {out}",
                       "which this command writes")
        assert snapshot(out) == before
    ok = tmp_path / "summary.json"  # anywhere else: written
    assert prepare_cli(src, "--out", out, "--overwrite", "--summary-json", ok).returncode == 0
    assert '"documents"' in ok.read_text() or ok.stat().st_size > 10
    assert main(["verify", str(out)]) == 0


# ---- case 3: eval/generate --output naming an export's config.json ------------------------------

def test_outputs_never_replace_an_exports_config(shards, tmp_path, capsys):
    """Before: the guard listed only the weights file, so ``--output EXPORT/config.json``
    replaced the export's config.json and the export no longer loaded."""
    ckpt = write_checkpoint(tmp_path / "run")
    exp = tmp_path / "exp"
    assert main(["export", str(ckpt), str(exp)]) == 0
    reads = snapshot(exp)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    for argv in (["eval", str(exp), str(shards), "--output", str(exp / "config.json")],
                 ["generate", str(exp), "--length", "4", "--output", str(exp / "config.json")],
                 ["eval", str(tmp_path / "run"), str(shards), "--output", str(latest)]):
        assert main(argv) != 0, argv
        line = one_error_line(subprocess.CompletedProcess([], 1, "", capsys.readouterr().err),
                              "--output", "which this command reads")
        assert argv[-1] in line, line
    assert snapshot(exp) == reads and latest.read_text().strip() == "step_00000000.pt"
    assert main(["eval", str(exp), str(shards), "--output", str(tmp_path / "r.json")]) == 0


# ---- case 4: launch --out naming its training config ---------------------------------------------

def test_launch_never_writes_its_script_over_its_config(tmp_path, capsys):
    """Before: ``hvd-lm launch --config train.yaml --out train.yaml`` replaced the training
    config with the job script."""
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model:\n  hidden_size: 64\n")
    before = cfg.read_bytes()
    rc = main(["launch", "--scheduler", "slurm", "--gpus", "8", "--device", "cpu", "--config",
               str(cfg), "--out", str(cfg), "--", "--shards", "d"])
    one_error_line(subprocess.CompletedProcess([], rc, "", capsys.readouterr().err),
                   f"--out {cfg}: is {cfg}, which this command reads")
    assert rc == 2 and cfg.read_bytes() == before
    script = tmp_path / "job.sbatch"
    assert main(["launch", "--scheduler", "slurm", "--gpus", "8", "--device", "cpu", "--config",
                 str(cfg), "--out", str(script), "--", "--shards", "d"]) == 0
    assert script.read_text().startswith("#!")


# ---- a directive value is one word: "$" matched before a trailing newline ------------------------

@pytest.mark.parametrize("scheduler,flag,value", [
    ("slurm", "--partition", "gpu\n"), ("slurm", "--job-name", "lm\n"),
    ("pbs", "--queue", "batch\n"), ("horovodrun-multinode", "--hosts", "a,b\n")],
    ids=["partition", "job-name", "queue", "hosts"])
def test_a_value_ending_in_a_newline_is_not_one_word(tmp_path, capsys, scheduler, flag, value):
    """Before: the one-word check (``re.match`` with ``$``) let ``$'gpu\\n'`` through, and the
    newline split the ``#SBATCH --partition=`` directive line in two."""
    script = tmp_path / "job.sh"
    rc = main(["launch", "--scheduler", scheduler, "--gpus", "16", "--device", "cpu", "--out",
               str(script), flag, value, "--", "--shards", "d"])
    line = one_error_line(subprocess.CompletedProcess([], rc, "", capsys.readouterr().err),
                          repr(value.split(",")[-1]))
    assert rc == 2 and not script.exists(), line


# ---- downloads: one source per file; a FIFO destination is named, not opened ---------------------

def test_two_sources_are_never_saved_as_one_file(server, tmp_path):
    """Before: ``f.txt`` and ``./f.txt`` were both fetched and both reported "sha256 verified";
    the second replaced the first."""
    url, _ = server
    out = tmp_path / "out"
    listed = sources(tmp_path / "s.yaml", ("plain", "f.txt"), ("other", "./f.txt"))
    proc = hvd_lm("download", "--sources", listed, "--out", out, "--mirror", url, timeout=60)
    one_error_line(proc, f"{listed}: files[0].save_as 'f.txt' and files[1].save_as './f.txt' "
                   "are the same file")
    assert not out.exists() or list(out.iterdir()) == []  # before the first fetch


def test_a_download_destination_that_is_a_fifo_is_refused_unopened(server, tmp_path):
    """Before: the cached-file check hashed the destination, and opening a FIFO nobody writes
    never returned."""
    url, _ = server
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "f.txt")
    listed = sources(tmp_path / "s.yaml", ("plain", "f.txt"))
    proc = hvd_lm("download", "--sources", listed, "--out", out, "--mirror", url, timeout=60)
    one_error_line(proc, f"{out / 'f.txt'}: a FIFO (named pipe), not a regular file")
    assert (out / "f.txt").is_fifo()
