"""Hostile and careless input, files on disk (issue 35): data_prep deletes only what it created,
shards, manifests, hostfiles, metrics lines and checkpoints that lie about themselves are
named in one line before anything is written; a hostfile is a regular file within its cap and a
tar's URL lists are never documents, whatever the globs (issue 56)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hvd_lm.cli import main
from hvd_lm.formats import checkpoint as ck
from tests.hostile_common import (  # noqa: F401 - the fixtures these tests take
    TINY,
    hvd_lm,
    measured_main,
    one_error_line,
    prepare_cli,
    reviews,
    snapshot,
    trained,
)

# ---- data_prep deletes only what it created (items 8, 11) ----------------------------------------

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


@pytest.mark.parametrize("kind,needle", [
    ("fifo", "a FIFO (named pipe), not a regular file"),
    ("device", "a character device, not a regular file"),
    ("huge", "more than 16,777,216 bytes"),
])
def test_a_hostfile_is_a_regular_file_within_its_cap(tmp_path, kind, needle):
    """Before (issue 56): a 1 GB --hostfile took ``hvd-lm doctor`` to 3.1 GB (read whole), and a
    FIFO or /dev/zero was reported as "no such file". Now named as what it is, and a file over
    16 MiB refused from its size, before a byte is read."""
    hostfile = tmp_path / "hosts.txt"
    if kind == "fifo":
        os.mkfifo(hostfile)
    elif kind == "device":
        hostfile.symlink_to("/dev/zero")
    else:
        with open(hostfile, "wb") as f:  # 1 GB of host lines' worth, sparse
            f.truncate(1 << 30)
    proc, read_mb, grew_mb = measured_main(["doctor", "--hostfile", hostfile])
    one_error_line(proc, f"--hostfile {hostfile}: {needle}", "HOSTFILE_MAX_BYTES")
    assert proc.returncode == 2 and read_mb < 1 and grew_mb < 32, (read_mb, grew_mb)


def test_tar_url_lists_are_never_documents_whatever_the_glob(tmp_path):
    """Before (issue 56): with the glob docs/data_prep.md gives for IMDB
    (``*/train/pos/*.txt,...``) a ``urls_*.txt`` inside ``train/pos/`` was read as a document:
    only the default globs left the URL lists out. Now they are left out by name, counted."""
    import io
    import tarfile

    from hvd_lm.formats.manifest import load_manifest
    from hvd_lm.formats.shards import open_shard

    reviews = {f"aclImdb/train/{d}/{i}_{7 if d == 'pos' else 2}.txt":
               f"Review {i} ({d}): a film I would {'gladly' if d == 'pos' else 'never'} watch "
               f"again, number {i}." for d in ("pos", "neg") for i in range(8)}
    urls = "http://www.imdb.com/title/tt0453418/usercomments\n" * 8
    src = tmp_path / "acl.tar.gz"
    with tarfile.open(src, "w:gz") as tar:
        for name, text in [*reviews.items(), ("aclImdb/train/pos/urls_pos.txt", urls),
                           ("aclImdb/train/neg/urls_neg.txt", urls)]:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    proc = prepare_cli(src, "--out", out, "--split", "1", "--summary-json", summary,
                       "--tar-members", "*/train/pos/*.txt,*/train/neg/*.txt")
    assert proc.returncode == 0, proc.stderr
    counters = json.loads(summary.read_text())["counters"]
    assert counters["members_left_out"] == 2 and counters["documents"] == len(reviews), counters
    docs = [bytes(sh.document(i)[:-1]).decode() for info in load_manifest(out).shards
            for sh in [open_shard(info.path)] for i in range(len(sh.doc_offsets) - 1)]
    assert sorted(docs) == sorted(reviews.values())


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
             trained["dir"] / "out" / "classifier.safetensors"]
    before = [Path(f).read_bytes() for f in reads]
    for argv in (["eval", trained["ckpt"], shards, "--output", trained["ckpt"]],
                 ["eval", trained["ckpt"], shards, "--output", shards / MANIFEST_NAME],
                 ["eval", trained["ckpt"], shards, "--output", shard],
                 ["generate", trained["ckpt"], "--length", "4", "--output", trained["ckpt"]],
                 ["generate", trained["ckpt"], "--classifier", trained["dir"] / "out",
                  "--length", "4", "--output", trained["dir"] / "out" / "classifier.safetensors"]):
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
