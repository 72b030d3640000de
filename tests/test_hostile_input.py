"""Hostile and careless input (issue 35), through the commands users run: no run destroys another
run's checkpoints, ``latest`` is never followed out of its folder, downloads stay in ``--out``
and stop at the listed size, configs and input streams are bounded, directive values cannot
rewrite a job script, and nothing is deleted that the run did not create. Each case is one clear
line naming the file, field or host, a non-zero exit, and nothing written where it must not be."""
from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from hvd_lm.cli import main
from hvd_lm.formats import checkpoint as ck
from tests.conftest import records
from tests.hostile_common import (  # noqa: F401 - the fixtures these tests take
    TINY,
    copy_of,
    hvd_lm,
    measured_main,
    one_error_line,
    run_a,
    server,
    snapshot,
    sources,
)

# ---- checkpoints: one owner of what a run folder holds (items 1, 2, 10, 11) ----------------------

def test_pruning_never_deletes_the_checkpoint_just_written(shards, run_a, tmp_path):
    """A stray step_99999999.pt (damaged) in checkpoints/ with --keep-checkpoints 1: the resumed
    run's step 30 stays, latest names it, the stray is left alone, and the next --resume auto
    continues from step 30. A killed save's temporary file is removed by that save; files of
    other names are not."""
    out = copy_of(run_a, tmp_path)
    d = ck.checkpoint_dir(out)
    (d / "step_99999999.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    stale = d / ".step_00000030.pt.4242.deadbeef.tmp"  # what a kill -9 during a save leaves
    stale.write_bytes(b"\0" * 100_000)
    others = [d / ".notes.tmp", d / ".model.pt.4242.deadbeef.tmp", out / ".x.1.abcdef12.tmp"]
    for p in others:
        p.write_text("not the checkpoint writer's")
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "30",
                  "--checkpoint-every", "10", "--keep-checkpoints", "1", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    names = [p.name for p in ck.list_checkpoints(out)]
    assert "step_00000030.pt" in names and "step_99999999.pt" in names, names
    assert ck.resolve(out).name == "step_00000030.pt"
    assert ck.load(d / "step_00000030.pt")["step"] == 30
    assert not stale.exists() and all(p.exists() for p in others)
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "31",
                  "--keep-checkpoints", "1", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    start = records(out, "start")[-1]
    assert start["step"] == 30 and start["resumed_from"].endswith("step_00000030.pt")


def test_a_fresh_run_is_refused_over_another_runs_checkpoints(shards, run_a, tmp_path):
    out = copy_of(run_a, tmp_path)
    before = snapshot(out)
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "10",
                  "--checkpoint-every", "10", "--seed", "7")
    assert proc.returncode == 2
    one_error_line(proc, f"{out} holds the checkpoints of another run", "step 20",
                   str(out / "config.yaml"), "--resume auto", "--overwrite")
    assert snapshot(out) == before  # nothing written, nothing deleted
    # resumed from a checkpoint elsewhere into this folder: the same refusal
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "30",
                  "--resume", run_a / "checkpoints" / "step_00000010.pt")
    one_error_line(proc, "holds the checkpoints of another run", "resumed from")
    assert snapshot(out) == before
    # --overwrite: the earlier run's checkpoints, metrics and summary go; only this run's remain
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "10",
                  "--checkpoint-every", "10", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert "--overwrite: deleted" in proc.stderr
    assert [p.name for p in ck.list_checkpoints(out)] == ["step_00000010.pt"]
    assert len(records(out, "start")) == 1 and records(out, "start")[0]["step"] == 0
    assert "overwrite: false" in (out / "config.yaml").read_text()
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--resume", "auto",
                  "--overwrite")
    one_error_line(proc, "run.resume and run.overwrite exclude each other")


def test_a_diverged_runs_folder_is_another_run_too(shards, run_a, tmp_path):
    """A run that diverged before any checkpoint was confirmed leaves them all in
    checkpoints/diverged/ and no latest: a fresh run into its folder is refused as well (before,
    it appended to the old metrics.jsonl and its own divergence overwrote diverged/), and the
    line does not offer --resume auto (nothing there resumes)."""
    out = copy_of(run_a, tmp_path)
    d = ck.checkpoint_dir(out)
    (d / "diverged").mkdir()
    for p in ck.list_checkpoints(out):
        p.rename(d / "diverged" / p.name)
    (d / "latest").unlink()
    before = snapshot(out)
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "10")
    assert proc.returncode == 2
    line = one_error_line(proc, "a run that diverged (2 checkpoints set aside", "--overwrite")
    assert "--resume auto" not in line
    assert snapshot(out) == before


def test_the_newest_complete_checkpoint_is_latest_not_a_stray(run_a, tmp_path):
    """What a failure record and a launch's closing block name to resume from is the checkpoint
    ``latest`` names (resume's choice), not a stray higher step file; without latest, the newest
    step file; without checkpoints, none."""
    from hvd_lm.jobs.failure_summary import newest_checkpoint

    out = copy_of(run_a, tmp_path)
    (ck.checkpoint_dir(out) / "step_99999999.pt").write_bytes(b"PK\x03\x04 damaged")
    want = ck.checkpoint_dir(out) / "step_00000020.pt"
    assert ck.newest_complete(out) == want and newest_checkpoint(out) == str(want)
    (ck.checkpoint_dir(out) / "latest").unlink()
    assert ck.newest_complete(out).name == "step_99999999.pt"
    assert ck.newest_complete(tmp_path / "none") is None and newest_checkpoint(tmp_path) == "none"


def test_latest_is_never_followed_out_of_its_folder(shards, run_a, tmp_path):
    out = copy_of(run_a, tmp_path / "a")
    outside = tmp_path / "x.pt"  # a loadable checkpoint, but not this run's
    shutil.copy(out / "checkpoints" / "step_00000010.pt", outside)
    (out / "checkpoints" / "latest").write_text("../../x.pt\n")
    proc = hvd_lm("eval", out, shards, "--split", "val", timeout=120)
    one_error_line(proc, str(out / "checkpoints" / "latest"), "'../../x.pt'",
                   "not a checkpoint of this folder")
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "30",
                  "--resume", out)
    one_error_line(proc, "'../../x.pt'", "not a checkpoint of this folder")
    # --resume auto goes on from the folder's own newest step file, with a warning
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "21",
                  "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "not a checkpoint of this folder" in proc.stderr
    assert records(out, "start")[-1]["resumed_from"] == str(out / "checkpoints" /
                                                            "step_00000020.pt")
    assert ck.resolve(out) == out / "checkpoints" / "step_00000021.pt"
    # nor is a step file that links out of the folder, with no latest to name it
    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "step_00000099.pt").symlink_to(outside)
    assert ck.resolve(out) == out / "checkpoints" / "step_00000021.pt"
    assert out / "checkpoints" / "step_00000099.pt" not in ck.list_checkpoints(out)


# ---- YAML: read within a size and alias budget; errors never expand a value (item 5) -------------

def billion_laughs(levels: int = 9) -> str:
    """A ~360-byte train config whose model.hidden_size is 9**levels aliased strings."""
    lines = ["model:", "  hidden_size: [&a [lol,lol,lol,lol,lol,lol,lol,lol,lol],"]
    for prev, cur in zip("abcdefgh", "bcdefghi"[:levels - 2]):
        lines.append(f"    &{cur} [" + ",".join([f"*{prev}"] * 9) + "],")
    lines.append("    [" + ",".join([f"*{'abcdefghi'[levels - 2]}"] * 9) + "]]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_fails_fast_with_one_line(shards, tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    assert bomb.stat().st_size < 600
    proc, _, grew = measured_main(["train", "--config", bomb, "--shards", shards,
                                   "--out-dir", tmp_path / "r"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_error_line(proc, str(bomb), "expands to more than 100,000 values")
    assert len(line) < 400 and grew < 100, (len(line), grew)  # was 48 s and 1.8 GB
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text,needle", [
    # a 120,000-value list in 240 kB: refused by the value budget before any validation
    ("model:\n  hidden_size: [" + "0," * 120_000 + "0]\n", "expands to more than"),
    # one 500 kB string where an int goes: the message quotes 200 characters of it
    ("model:\n  hidden_size: " + "9x" * 250_000 + "\n", "expected int, got '9x9x"),
    ("run:\n  out_dir: [" + ",".join(["y" * 900] * 500) + "]\n", "expected str, got ["),
    ("a: &a [*a]\n", "recursive YAML value"),
    ("model: " + "[" * 5000 + "]" * 5000 + "\n", "invalid YAML"),
])
def test_yaml_errors_are_short_and_name_the_file(tmp_path, capsys, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    rc = main(["train", "--config", str(cfg), "--shards", str(tmp_path)])
    line = one_error_line(subprocess.CompletedProcess([], rc, "", capsys.readouterr().err),
                          str(cfg), needle)
    assert rc == 2 and len(line) < 600, len(line)


def test_a_config_that_never_ends_is_cut_at_its_size_budget(tmp_path):
    """/dev/zero is named as the device it is, unread (issue 44); a regular file over the
    budget is refused from its size, unread (files.read_bounded, as every bounded read)."""
    proc, read, _ = measured_main(["train", "--config", "/dev/zero", "--shards", tmp_path])
    one_error_line(proc, "/dev/zero: a character device, not a regular file")
    assert read < 0.5, read  # MB: the device unread
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of zeros, no disk used
    proc, read, _ = measured_main(["train", "--config", big, "--shards", tmp_path])
    one_error_line(proc, f"{big}: more than 1,048,576 bytes")
    assert read < 0.5, read  # MB: neither the GiB nor the budget read


# ---- downloads stay under --out and stop at the listed size (items 3, 4) -------------------------

@pytest.mark.parametrize("save_as", ["../../escaped.txt", "/tmp/hvd_lm_escaped_{n}.txt",
                                     "a/../../escaped.txt", "link/escaped.txt"])
def test_download_never_writes_outside_out(server, tmp_path, save_as):
    url, _ = server
    save_as = save_as.format(n=uuid.uuid4().hex)
    out = tmp_path / "a" / "out"
    (out / "ok").mkdir(parents=True)
    (out / "link").symlink_to(tmp_path)  # a link inside --out that leads out of it
    listed = sources(tmp_path / "s.yaml", ("good.txt", "ok/first.txt"), ("x.txt", save_as))
    proc = hvd_lm("download", "--sources", listed, "--out", out, "--mirror", url, timeout=120)
    one_error_line(proc, str(listed), save_as)
    assert not (out / "ok" / "first.txt").exists()  # checked before the first fetch
    assert sorted(p.name for p in tmp_path.rglob("*escaped*")) == []
    assert not Path(save_as).exists()
    assert (tmp_path / "a" / "out" / "ok").is_dir()


@pytest.mark.parametrize("name,needle", [("endless", "more than the 13 bytes"),
                                         ("liar", "announces 10,485,760 bytes"),
                                         ("nothttp", "cannot fetch (SSH-2.0-OpenSSH_9.2")])
def test_download_stops_at_the_listed_size(server, tmp_path, name, needle):
    url, sent = server
    out = tmp_path / "out"
    listed = sources(tmp_path / "s.yaml", (name, "f.txt"))
    proc = hvd_lm("download", "--sources", listed, "--out", out, "--mirror", url, timeout=120)
    one_error_line(proc, f"{url}/{name}", needle)
    assert sent["endless"] < 32 << 20  # cut off long before the server's 64 MB
    assert list(out.iterdir()) == []  # no partial file left
    # the same list with an honest server: kept
    ok = sources(tmp_path / "ok.yaml", ("plain", "f.txt"))
    proc = hvd_lm("download", "--sources", ok, "--out", out, "--mirror", url, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "f.txt").read_bytes() == b"hello, world\n"
