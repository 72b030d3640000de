"""Hostile and careless input (issue 35), through the commands users run: no run destroys another
run's checkpoints, ``latest`` is never followed out of its folder, downloads stay in ``--out``
and stop at the listed size, configs and input streams are bounded, directive values cannot
rewrite a job script, and nothing is deleted that the run did not create. Each case is one clear
line naming the file, field or host, a non-zero exit, and nothing written where it must not be."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hvd_lm.cli import main
from hvd_lm.formats import checkpoint as ck
from tests._mp import launch_env, run
from tests.shardutil import default_shards
from tests.test_transfer import synthetic_reviews, write_checkpoint

TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--batch-size", "2",
        "--log-every", "10", "--threads", "1", "--eval-chars", "2000", "--device", "cpu"]
HVD_LM = [sys.executable, "-m", "hvd_lm"]


def hvd_lm(*args, timeout=180, **env) -> subprocess.CompletedProcess:
    return run([*HVD_LM, *map(str, args)], timeout=timeout, env=launch_env(**env), check=False)


def one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The command failed with exactly one ERROR line (no traceback) holding every needle."""
    assert proc.returncode != 0, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "ERROR:" in x]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def records(run_dir: Path, kind: str) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == kind]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return default_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def run_a(shards, tmp_path_factory):
    """A finished run with checkpoints of steps 10 and 20 (latest: 20)."""
    out = tmp_path_factory.mktemp("run_a") / "run"
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "20",
                  "--checkpoint-every", "10", "--keep-checkpoints", "0")
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in ck.list_checkpoints(out)] == ["step_00000010.pt", "step_00000020.pt"]
    return out


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


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


def timed_main(argv: list[str], mem_bytes: int = 3 << 30, stdin=None, warmup: list | None = None
               ) -> tuple[subprocess.CompletedProcess, float, float]:
    """``hvd_lm.cli.main(argv)`` in a child with its address space capped at ``mem_bytes`` (so
    a blow-up ends as MemoryError, not a swapping machine), the command's modules imported
    (and ``main(warmup)`` run, when given) before the clock starts; returns (process, seconds
    main took, MB its peak RSS rose above the RSS before it: Linux's VmHWM, reset through
    /proc/self/clear_refs)."""
    code = ("import sys, time, resource; from hvd_lm.cli import build_parser, main; "
            "argv = sys.argv[1:]; i = argv.index('--'); warm, argv = argv[:i], argv[i + 1:]; "
            "build_parser(argv); warm and main(warm); "
            f"resource.setrlimit(resource.RLIMIT_AS, ({mem_bytes}, {mem_bytes})); "
            "kb = lambda k: int([x for x in open('/proc/self/status') if x.startswith(k)][0]"
            ".split()[1]) / 1024; open('/proc/self/clear_refs', 'w').write('5'); "
            "m0 = kb('VmRSS'); t = time.perf_counter(); rc = main(argv); "
            "print(f'seconds={time.perf_counter() - t:.3f} grew={kb(\"VmHWM\") - m0:.1f}', "
            "file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, warmup or []), "--",
                           *map(str, argv)], stdin=stdin, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=launch_env(), timeout=300,
                          check=False)
    stats = [dict(kv.split("=") for kv in x.split()) for x in proc.stderr.splitlines()
             if x.startswith("seconds=")]
    proc.stderr = "\n".join(x for x in proc.stderr.splitlines() if not x.startswith("seconds="))
    if not stats:
        return proc, float("inf"), float("inf")
    return proc, float(stats[0]["seconds"]), float(stats[0]["grew"])


def test_a_yaml_alias_bomb_fails_fast_with_one_line(shards, tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    assert bomb.stat().st_size < 600
    proc, seconds, _ = timed_main(["train", "--config", bomb, "--shards", shards, "--out-dir",
                                   tmp_path / "r"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_error_line(proc, str(bomb), "expands to more than 100,000 values")
    assert len(line) < 400 and seconds < 5.0, (len(line), seconds)  # was 48 s and 1.8 GB
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
    budget is read to the budget only."""
    proc, seconds, _ = timed_main(["train", "--config", "/dev/zero", "--shards", tmp_path])
    one_error_line(proc, "/dev/zero: a character device, not a regular file")
    assert seconds < 5
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of zeros, no disk used
    proc, seconds, _ = timed_main(["train", "--config", big, "--shards", tmp_path])
    one_error_line(proc, f"{big}: more than 1,048,576 bytes")
    assert seconds < 5


# ---- downloads stay under --out and stop at the listed size (items 3, 4) -------------------------

@pytest.fixture
def server():
    """An HTTP server on 127.0.0.1: ``/endless`` streams zeros without a length (stopping at
    64 MB, so a client that never stops still ends), ``/liar`` announces 10 MB for a file
    listed at 13 bytes, ``/nothttp`` answers with no HTTP status line, anything else is 13
    bytes; ``sent`` counts what was written."""
    import http.server
    import threading

    sent = {"endless": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path.endswith("/nothttp"):  # another protocol's greeting, no status line
                self.wfile.write(b"SSH-2.0-OpenSSH_9.2\r\n")
                return
            self.send_response(200)
            if self.path.endswith("/endless"):
                self.end_headers()
                block = b"\0" * 65536
                try:
                    while sent["endless"] < 64 << 20:
                        self.wfile.write(block)
                        sent["endless"] += len(block)
                except OSError:  # the client hung up
                    pass
                return
            body = b"hello, world\n"
            self.send_header("Content-Length", str(10 << 20 if self.path.endswith("/liar")
                                                   else len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", sent
    srv.shutdown()
    srv.server_close()


HELLO_SHA = "853ff93762a06ddbf722c4ebe9ddd66d8f63ddaea97f521c3ecc20da7c976020"


def sources(path: Path, *entries: tuple[str, str]) -> Path:
    files = "".join(f"  - path: {p}\n    save_as: {json.dumps(s)}\n    sha256: {HELLO_SHA}\n"
                    "    bytes: 13\n" for p, s in entries)
    path.write_text(f"base_url: http://127.0.0.1:9\nfiles:\n{files}")
    return path


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


# ---- classify streams its input in bounded memory (item 6) -------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny checkpoint and a classifier ``hvd-lm transfer`` fit on its features."""
    d = tmp_path_factory.mktemp("trained")
    ckpt = write_checkpoint(d / "run")
    train = synthetic_reviews(d / "train.jsonl", 160, 0)
    assert main(["transfer", str(d / "run"), "--train", str(train), "--text-field", "review",
                 "--label-field", "sentiment", "--out", str(d / "out"), "--no-cache",
                 "--no-progress", "--no-baseline", "--batch-size", "16"]) == 0
    return {"dir": d, "ckpt": ckpt}


def test_classify_memory_does_not_grow_with_its_input(trained, tmp_path):
    """24 MB of one-line texts (60 lines of 400 kB): the peak RSS grows by a fraction of the
    input (the texts are read, featurized and written a block at a time), and every row is
    written, in input order."""
    words = "the a great album song sound bad good love music track voice band really".split()
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        for i in range(60):
            f.write(" ".join(words[(i + k) % len(words)] for k in range(80_000))[:400_000] + "\n")
    size_mb = big.stat().st_size / 1e6
    (tmp_path / "small.txt").write_text("a great album\n")
    base = ["classify", trained["ckpt"], trained["dir"] / "out", "--no-progress", "--threads", "1"]
    proc, _, grew = timed_main([*base, "--input", big, "--output", tmp_path / "p.jsonl"],
                               warmup=[*base, "--input", tmp_path / "small.txt", "--output",
                                       tmp_path / "warm.jsonl"])
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rows] == list(range(1, 61))
    print(f"classify of {size_mb:.1f} MB: peak RSS grew {grew:.1f} MB")
    assert grew < size_mb / 2, (grew, size_mb)  # was 4.5x the input: every text held at once


def test_classify_stops_an_endless_line_at_its_cap(trained, tmp_path):
    """``--input -`` fed by a process that writes forever without a newline: one line naming
    standard input's line 1 and the cap, after at most the cap was held."""
    endless = "import sys\nwhile True: sys.stdout.write('lol ' * 16384)"
    feeder = subprocess.Popen([sys.executable, "-c", endless], stdout=subprocess.PIPE)
    try:
        proc, _, grew = timed_main(["classify", trained["ckpt"], trained["dir"] / "out",
                                    "--input", "-", "--no-progress"], stdin=feeder.stdout)
    finally:
        feeder.kill()
        feeder.wait()
    one_error_line(proc, "<stdin>:1: line longer than 1,048,576 bytes", "--max-line-bytes")
    assert grew < 200, grew


def test_classify_never_replaces_what_it_reads(trained, tmp_path, capsys):
    """--output naming the input, the classifier (its json or npz), the checkpoint, a link to the
    input, or a folder: one ERROR line before any work, and every input byte for byte as it was
    (before: the input or the classifier was replaced by the predictions)."""
    inp = tmp_path / "mine.txt"
    inp.write_text("a great album\nawful, boring\n")
    (tmp_path / "link.txt").symlink_to(inp)
    out = trained["dir"] / "out"
    reads = [inp, out / "classifier.json", out / "classifier.npz", trained["ckpt"]]
    before = [f.read_bytes() for f in reads]
    base = ["classify", str(trained["ckpt"]), str(out), "--input", str(inp), "--no-progress"]
    for target, needle in [*[(f, "which this command reads") for f in reads],
                           (tmp_path / "link.txt", "which this command reads"),
                           (tmp_path, "is a folder")]:
        assert main([*base, "--output", str(target)]) == 2, target
        err = capsys.readouterr().err
        assert err.count("ERROR:") == 1 and needle in err and "--output" in err, err
    assert [f.read_bytes() for f in reads] == before
    assert main([*base, "--output", str(tmp_path / "p.csv")]) == 0  # elsewhere: written


@pytest.mark.parametrize("name,data,needle", [
    ("extra.csv", b"review,sentiment\ngood, but not great,1\n",
     "extra.csv:2: 3 fields, the header has 2"),
    ("dup.csv", b"sentiment,review,sentiment\n1,good,1\n", "['sentiment'] appear more than once"),
    ("latin1.txt", b"fine\ncaf\xe9 au lait\n", "latin1.txt:2: not UTF-8"),
    ("big.jsonl", b'{"review": "x", "n": ' + b"9" * 5000 + b"}\n", "big.jsonl:1: unreadable JSON"),
    ("deep.jsonl", b'{"review": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
     "deep.jsonl:1: unreadable JSON"),
])
def test_classify_input_that_cannot_be_read_as_asked(trained, tmp_path, capsys, name, data,
                                                     needle):
    """A CSV row with more fields than its header (a comma in an unquoted text), a header naming
    a column twice, bytes that are not UTF-8, a JSON number or nesting Python's json refuses:
    one ERROR line naming the file and line (before: the row was cut silently, the last column
    won, or the error named neither)."""
    path = tmp_path / name
    path.write_bytes(data)
    rc = main(["classify", str(trained["ckpt"]), str(trained["dir"] / "out"), "--input",
               str(path), "--text-field", "review", "--output", str(tmp_path / "p.csv"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("ERROR:") == 1 and needle in err, err
    assert not (tmp_path / "p.csv").exists()


def test_classify_reads_tsv_as_amazon_writes_it_and_json_escapes_as_written(trained, tmp_path):
    """A TSV is tab-separated without quoting (Amazon's, and data_prep's reading of it): a
    quote is text, so four rows stay four texts (before: CSV quoting merged them into one); a
    JSON text holding a lone surrogate escape is classified, the surrogate written as U+FFFD
    (before: the run stopped at writing it)."""
    tsv = tmp_path / "am.tsv"
    tsv.write_text('review\tstars\n"Loved it, 10/10\t5\nok\t3\nmeh\t2\nfine" really good\t4\n')
    assert main(["classify", str(trained["ckpt"]), str(trained["dir"] / "out"), "--input",
                 str(tsv), "--text-field", "review", "--output", str(tmp_path / "p.jsonl"),
                 "--no-progress"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == ['"Loved it, 10/10', "ok", "meh", 'fine" really good']
    js = tmp_path / "s.jsonl"
    js.write_text('{"review": "great \\ud83d album"}\n{"review": "pair \\ud83d\\ude00"}\n')
    assert main(["classify", str(trained["ckpt"]), str(trained["dir"] / "out"), "--input",
                 str(js), "--text-field", "review", "--output", str(tmp_path / "s.csv"),
                 "--no-progress"]) == 0
    text = (tmp_path / "s.csv").read_text(encoding="utf-8")
    assert "great \ufffd album" in text and "pair \U0001F600" in text


# ---- job scripts: a value cannot rewrite the scheduler's directives (items 7, 11) --------------

@pytest.mark.parametrize("scheduler,flags,needles", [
    ("slurm", ["--partition", "gpu --output=FILE --wrap=x"], ["--partition 'gpu --output",
                                                              "whitespace"]),
    ("slurm", ["--job-name", "x --chdir=DIR"], ["--job-name 'x --chdir=DIR'", "whitespace"]),
    ("pbs", ["--queue", "batch -W depend=x"], ["--partition 'batch -W", "whitespace"]),
    ("pbs", ["--job-name=-Wblock=true"], ["--job-name '-Wblock=true'", "start with '-'"]),
    ("slurm", ["--partition", "gpu\tdebug"], ["whitespace"]),
    ("slurm", ["--walltime", "99999999999999999999"], ["--walltime", "more than 365 days"]),
    ("pbs", ["--walltime", "400-00:00:00"], ["--walltime '400-00:00:00' is 400 days"]),
    ("horovodrun-multinode", ["--gpus", "16", "--hosts", "a,-oProxyCommand=x"],
     ["--hosts", "'-oProxyCommand=x' is not a host"]),
])
def test_directive_values_are_checked(tmp_path, capsys, scheduler, flags, needles):
    script = tmp_path / "job.sh"
    argv = ["launch", "--scheduler", scheduler, "--gpus", "8", "--device", "cpu", "--out",
            str(script), *flags, "--", "--shards", "d"]
    rc = main(argv)
    one_error_line(subprocess.CompletedProcess([], rc, "", capsys.readouterr().err), *needles)
    assert rc == 2 and not script.exists()


def test_directive_values_a_scheduler_takes_still_render(tmp_path):
    script = tmp_path / "job.sbatch"
    assert main(["launch", "--scheduler", "slurm", "--gpus", "8", "--partition", "gpu,debug",
                 "--job-name", "lm_v2.1-large", "--walltime", "365-00:00:00", "--out",
                 str(script), "--", "--shards", "d"]) == 0
    lines = script.read_text().splitlines()
    for want in ("#SBATCH --partition=gpu,debug", "#SBATCH --job-name=lm_v2.1-large",
                 "#SBATCH --time=8760:00:00"):
        assert any(x.startswith(want) for x in lines), want


# ---- data_prep deletes only what it created (items 8, 11) ----------------------------------------

def prepare_cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "data_prep", "prepare", *map(str, args), "--no-progress"],
               timeout=timeout, check=False)


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    src = tmp_path_factory.mktemp("reviews") / "reviews.txt"
    src.write_text("".join(f"review {i}: the album is {'good' * (i % 5 + 1)} and long enough\n"
                           for i in range(60)))
    return src


def test_prepare_through_a_link_to_a_foreign_folder_touches_nothing(reviews, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    (foreign / ".draft.tmp").write_text("an editor's, not prepare's")
    (foreign / ".train-00000.h5.1.abcdef01.tmp").write_text("named like prepare's")
    link = tmp_path / "out"
    link.symlink_to(foreign)
    before = snapshot(foreign)
    for extra in ([], ["--overwrite"], ["--resume"]):
        proc = prepare_cli(reviews, "--out", link, *extra)
        one_error_line(proc, f"{link} (a link to {foreign})", "notes.txt",
                       "none of them prepared data")
        assert snapshot(foreign) == before and sorted(p.name for p in foreign.iterdir()) == \
            [".draft.tmp", ".train-00000.h5.1.abcdef01.tmp", "notes.txt"]


def test_prepare_removes_only_its_own_temporary_files(reviews, tmp_path):
    out = tmp_path / "out"
    assert prepare_cli(reviews, "--out", out).returncode == 0
    stale = out / ".train-00000.h5.4242.deadbeef.tmp"  # a writer killed in an earlier run
    stale.write_text("partial shard")
    others = [out / ".notes.tmp", out / ".x.1.abcdef01.tmp", out / "notes.txt"]
    for p in others:
        p.write_text("the user's")
    proc = prepare_cli(reviews, "--out", out, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists() and all(p.read_text() == "the user's" for p in others)


def test_prepare_goes_on_in_a_folder_its_killed_run_left_only_its_lock_in(reviews, tmp_path):
    """A prepare killed after taking its folder's lock, before it made its work directory,
    leaves only ``.lock``: the next prepare into that folder runs (before: refused as a folder
    of foreign files)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text("pid 1 on a host long gone\n")
    proc = prepare_cli(reviews, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "manifest.json").is_file()


def test_prepare_of_only_duplicates_leaves_no_work_folder(tmp_path):
    src = tmp_path / "dup.txt"
    src.write_text("the same review again and again, long enough\n" * 50)
    out = tmp_path / "out"
    proc = prepare_cli(src, "--out", out)
    one_error_line(proc, "1 documents are too few for the split", "49 duplicates dropped")
    assert sorted(p.name for p in out.iterdir()) == []


# ---- a shard that is not one, without verification; a hostfile line of 0 slots (item 11) -------

@pytest.mark.parametrize("damage,needle", [
    ("rename", "no dataset 'tokens' (it has: doc_offsets, tokenz)"),
    ("int32", "dataset 'tokens' is int32"),
])
def test_unverified_shards_are_still_checked_before_anything_is_written(shards, tmp_path, damage,
                                                                        needle):
    import h5py
    import numpy as np

    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    victim = sorted(bad.glob("train-*.h5"))[0]
    with h5py.File(victim, "a") as f:
        if damage == "rename":
            f.move("tokens", "tokenz")
        else:
            tokens = f["tokens"][...]
            del f["tokens"]
            f.create_dataset("tokens", data=tokens.astype(np.int32))
    out = tmp_path / "run"
    proc = hvd_lm("train", "--shards", bad, "--out-dir", out, *TINY, "--max-steps", "3",
                  "--verify-shards", "false")
    one_error_line(proc, str(victim), needle)
    assert not out.exists()  # no config.yaml, no metrics.jsonl


@pytest.mark.parametrize("line", ["node1 slots=0", "node1:0", "node1 slots=-1", "node1:x"])
def test_a_hostfile_line_without_slots_names_the_file_and_line(tmp_path, capsys, line):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"# the job's nodes\nnode0 slots=8\n{line}\n")
    rc = main(["doctor", "--hostfile", str(hostfile)])
    one_error_line(subprocess.CompletedProcess([], rc, "", capsys.readouterr().err),
                   f"{hostfile}:3:", repr(line))
    assert rc == 2


def test_a_torn_metrics_line_is_skipped_with_one_warning(tmp_path, capsys):
    """Ranks append failure records to one metrics.jsonl, and appends from several hosts of a
    shared filesystem can interleave: a line that is not JSON is skipped with a warning naming
    the file and line, and every other record is read (before: every reader of the run failed)."""
    from hvd_lm.train.log import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "start", "step": 0}\n{"kind": "fail{"kind": "failure"\n'
                    '{"kind": "end", "step": 3}\n')
    assert [r["kind"] for r in read_metrics(path)] == ["start", "end"]
    assert f"warning: {path}:2: not a JSON record, skipped" in capsys.readouterr().err


def test_eval_and_generate_never_replace_what_they_read(trained, shards, tmp_path, capsys):
    """``eval --output`` naming the checkpoint, the manifest or a shard, ``generate --output``
    naming the checkpoint or the classifier: one ERROR line, nothing replaced
    (before: eval wrote its JSON over the checkpoint and exited 0)."""
    from hvd_lm.formats.manifest import MANIFEST_NAME, load_manifest

    shard = load_manifest(shards).shards[0].path
    reads = [trained["ckpt"], shards / MANIFEST_NAME, shard,
             trained["dir"] / "out" / "classifier.json"]
    before = [Path(f).read_bytes() for f in reads]
    for argv in (["eval", trained["ckpt"], shards, "--output", trained["ckpt"]],
                 ["eval", trained["ckpt"], shards, "--output", shards / MANIFEST_NAME],
                 ["eval", trained["ckpt"], shards, "--output", shard],
                 ["generate", trained["ckpt"], "--length", "4", "--output", trained["ckpt"]],
                 ["generate", trained["ckpt"], "--classifier", trained["dir"] / "out",
                  "--length", "4", "--output", trained["dir"] / "out" / "classifier.json"]):
        assert main([str(a) for a in argv]) != 0, argv
        err = capsys.readouterr().err
        assert err.count("ERROR:") == 1 and "which this command reads" in err, err
    assert [Path(f).read_bytes() for f in reads] == before


# ---- files that lie about themselves: shards, manifests, checkpoints ---------------------------

def test_a_shard_holds_its_own_data_all_of_it_written(shards, tmp_path, capsys):
    """A shard whose tokens live in another file (HDF5 external storage: verify used to hash it
    and training to read it), or whose tokens are declared far past what it stores (2**40 bytes
    never written: verify hashed zeros for days), is refused at once by `hvd-lm verify` and by
    the cheap layout check training makes, naming the file and the dataset."""
    import h5py
    import numpy as np

    from hvd_lm.formats import shards as sh
    from hvd_lm.formats.manifest import load_manifest

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"top secret password\0")
    for name, kw, needle in (
            ("ext", {"shape": (20,), "external": [(str(secret), 0, 20)]}, "stored in other file"),
            ("sparse", {"shape": (2**40,), "chunks": (1 << 20,)}, "stores 0 of its 1,048,576")):
        folder = tmp_path / name
        shutil.copytree(shards, folder)
        info = load_manifest(folder).shards[0]
        with h5py.File(info.path, "r+") as f:
            del f["tokens"]
            f.create_dataset("tokens", dtype=np.uint8, **kw)
            f["doc_offsets"][-1] = kw["shape"][0]
        with pytest.raises(sh.ShardFormatError, match=f"dataset 'tokens' .*{needle}"):
            sh.check_layout(info)
        assert main(["verify", str(folder)]) != 0
        cap = capsys.readouterr()
        assert needle in cap.out + cap.err


def test_a_manifest_lists_each_shard_once(shards, tmp_path):
    """A split listing another split's shard (val's entries replaced by train's: eval then
    scored the training data) or one shard twice: one error naming both places."""
    folder = tmp_path / "dup"
    shutil.copytree(shards, folder)
    m = json.loads((folder / "manifest.json").read_text())
    m["splits"]["val"]["shards"] = [m["splits"]["train"]["shards"][0]]
    (folder / "manifest.json").write_text(json.dumps(m))
    from hvd_lm.formats.manifest import load_manifest
    with pytest.raises(ValueError, match=r"splits.val.shards\[0\].file names 'train-00000.h5', "
                                         r"already listed at splits.train.shards\[0\]"):
        load_manifest(folder)


def test_a_checkpoint_whose_contents_lie(tmp_path, capsys):
    """A checkpoint whose config asks for more parameters than it holds (embed_dim 10**6 in a
    1 kB file: gigabytes were allocated before the first weight was compared), whose weights are
    integers or NaN (evaluated silently to 8.0 or NaN bits), or whose counters or config are of
    the wrong type (a bare 'ERROR: config', or a crash after training began): one ERROR line
    naming the file and the field, at once."""
    import torch

    from tests.test_transfer import tiny_model
    m = tiny_model("mlstm", 16, 0)
    good = {"model": m.state_dict(), "step": 0,
            "config": {"model": {**m.config.__dict__}, "data": {"seq_len": 16}}}
    cases = [
        ({"config": {"model": {**good["config"]["model"], "embed_dim": 10**6}, "data": {}}},
         "asks for"),
        ({"model": {k: v.to(torch.int64) for k, v in good["model"].items()}}, "expected floating"),
        ({"model": {k: v * float("nan") for k, v in good["model"].items()}}, "NaN or infinite"),
        ({"step": "x"}, "field step is 'x', expected an int >= 0"),
        ({"chars_trained": -5}, "field chars_trained is '-5'"),
        ({"config": {"data": {}}}, "no field config.model"),
        ({"config": {"model": [1, 2]}}, "field config.model is '[1, 2]', expected a dict"),
    ]
    for i, (change, needle) in enumerate(cases):
        run_dir = tmp_path / f"r{i}"
        (run_dir / "checkpoints").mkdir(parents=True)  # torch.save: ck.save refuses NaN weights
        torch.save({"format": ck.CHECKPOINT_FORMAT, **good, **change},
                   run_dir / "checkpoints" / "step_00000000.pt")
        assert main(["eval", str(run_dir), str(tmp_path / "no-shards")]) != 0, change
        err = capsys.readouterr().err
        assert err.count("ERROR:") == 1 and needle in err and "step_00000000.pt" in err, err


def test_an_exported_folder_or_checkpoint_with_odd_fields(trained, shards, tmp_path, capsys):
    """An export's config.json whose sha256 field is a number or whose seq_len is 10**7, and a
    checkpoint whose seq_len is a string: one ERROR line naming the file and the field (before:
    a bare TypeError, or eval allocating a 10**7-byte window per row)."""
    import torch

    assert main(["export", str(trained["ckpt"]), str(tmp_path / "exp")]) == 0
    cfg_path = tmp_path / "exp" / "config.json"
    good = json.loads(cfg_path.read_text())
    for change, needle in (({"weights_sha256": 5}, "field 'weights_sha256' is '5', expected"),
                           ({"seq_len": 10**7}, "field 'seq_len' is '10000000', expected an int"
                                                " in 1..1,048,576")):
        cfg_path.write_text(json.dumps({**good, **change}))
        assert main(["eval", str(tmp_path / "exp"), str(shards)]) != 0
        err = capsys.readouterr().err
        assert err.count("ERROR:") == 1 and needle in err and "config.json" in err, err
    ckpt = torch.load(trained["ckpt"], weights_only=True)
    ckpt["config"]["data"]["seq_len"] = "16"
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    torch.save(ckpt, tmp_path / "r" / "checkpoints" / "step_00000000.pt")
    assert main(["eval", str(tmp_path / "r"), str(shards)]) != 0
    err = capsys.readouterr().err
    assert err.count("ERROR:") == 1 and "field config.data.seq_len is '16'" in err, err


def test_flags_and_files_named_in_one_line(trained, tmp_path, capsys):
    """generate's --temperature 1e-320, --seed 2**40 and --overwrite 1e300, transfer's --out
    naming a file, and a YAML config of two documents: one ERROR line naming the flag or the
    file, at once (before: errors naming neither, after the featurization, or over 4 lines);
    classify reads --input from a pipe (``<(cmd)``: before, 'no such file')."""
    ck_ = str(trained["ckpt"])
    for argv, needle in (
            (["generate", ck_, "--temperature", "1e-320"], "--temperature 1e-320 is below 0.001"),
            (["generate", ck_, "--seed", str(2**40)], "seed must be <= 4294967295"),
            (["generate", ck_, "--neuron", "1", "--overwrite", "1e300"], "overwrite must be <="),
            (["transfer", ck_, "--train", str(tmp_path / "t.csv"), "--out",
              str(trained["ckpt"])], "is a file; transfer writes a folder")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("ERROR:") == 1 and len(err.strip().splitlines()) == 1, err
        assert needle in err, err
    (tmp_path / "two.yaml").write_text("model: {hidden_size: 32}\n---\nrun: {}\n")
    assert main(["train", "--config", str(tmp_path / "two.yaml")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "expected a single document" in err, err
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"printf 'a great album\\nawful\\n' > {fifo}"])
    try:
        assert main(["classify", ck_, str(trained["dir"] / "out"), "--input", str(fifo),
                     "--output", str(tmp_path / "p.csv"), "--no-progress"]) == 0
    finally:
        writer.wait(timeout=30)
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 3  # header + 2 rows


def test_a_checkpoint_of_compressed_zip_entries_is_not_inflated(trained, tmp_path, capsys):
    """A checkpoint rewritten with deflated zip entries (torch.load would inflate them, 800:1
    for zeros) is refused before loading, naming the entry; torch.save never compresses."""
    import zipfile

    src, bomb = Path(trained["ckpt"]), tmp_path / "r" / "checkpoints" / "step_00000000.pt"
    bomb.parent.mkdir(parents=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    assert main(["eval", str(tmp_path / "r"), str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert err.count("ERROR:") == 1 and "is compressed" in err and "step_00000000.pt" in err, err
