"""Hostile and careless input, the transfer side and job scripts (issue 35): classify streams
its input in bounded memory and never replaces what it reads; a directive value cannot
rewrite a job script. One clear line, a non-zero exit, nothing written where it must not
be."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hvd_lm.cli import main
from tests.hostile_common import (  # noqa: F401 - the fixtures these tests take
    hvd_lm,
    measured_main,
    one_error_line,
    trained,
)

# ---- classify streams its input in bounded memory (item 6) -------------------------------------

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
    proc, _, grew = measured_main([*base, "--input", big, "--output", tmp_path / "p.jsonl"],
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
        proc, _, grew = measured_main(["classify", trained["ckpt"], trained["dir"] / "out",
                                    "--input", "-", "--no-progress"], stdin=feeder.stdout)
    finally:
        feeder.kill()
        feeder.wait()
    one_error_line(proc, "<stdin>:1: line longer than 1,048,576 bytes (--max-line-bytes sets "
                   "the limit)")
    assert grew < 200, grew


def test_transfer_names_what_its_training_file_is(trained, tmp_path, capsys):
    """A FIFO or /dev/zero as ``--train`` is named as what it is (was "no such file"; a plain
    open() of a FIFO without a writer blocks: an alarm fails the test instead of hanging it),
    and a line over the 1 MiB cap names its file and line, not ``--max-line-bytes``, which
    transfer does not have. One ERROR line, exit 2, no output folder."""
    import os
    import signal

    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    long = tmp_path / "long.csv"
    long.write_text("label,text\n1,fine\n0," + "x" * ((1 << 20) + 10) + "\n")
    out = tmp_path / "out"
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("transfer blocked on its input"))
    try:
        for train, needle in ((fifo, "fifo.csv: a FIFO (named pipe), not a regular file"),
                              ("/dev/zero", "/dev/zero: a character device, not a regular"),
                              (long, "long.csv:3: line longer than 1,048,576 bytes; is this")):
            signal.alarm(60)
            rc = main(["transfer", str(trained["ckpt"]), "--train", str(train), "--out",
                       str(out), "--no-progress", "--no-baseline"])
            signal.alarm(0)
            err = capsys.readouterr().err
            assert rc == 2 and err.count("ERROR:") == 1 and needle in err, err
            assert "--max-line-bytes" not in err and not out.exists()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def test_classify_never_replaces_what_it_reads(trained, tmp_path, capsys):
    """--output naming the input, the classifier, the checkpoint, a link to the
    input, or a folder: one ERROR line before any work, and every input byte for byte as it was
    (before: the input or the classifier was replaced by the predictions)."""
    inp = tmp_path / "mine.txt"
    inp.write_text("a great album\nawful, boring\n")
    (tmp_path / "link.txt").symlink_to(inp)
    out = trained["dir"] / "out"
    reads = [inp, out / "classifier.safetensors", trained["ckpt"]]
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
                 "#SBATCH --time=365-00:00:00"):
        assert any(x.startswith(want) for x in lines), want
