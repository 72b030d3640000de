"""End to end: ``prepare`` on the real shared files, determinism over workers/ranks/memory,
kill + resume, ``verify``, independent HDF5 readers, and the bad-input behaviours."""
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data_prep.cli import PREPARE, VERIFY, build_parser
from data_prep.parallel import Context, PhaseError
from data_prep.pipeline import prepare
from data_prep.plan import KILL_HOOK_ENV, plan_shards, split_counts
from data_prep.resume import WORK_DIR, finished_with_other_inputs
from data_prep.settings import PrepareConfig, PrepareError
from data_prep.sniff import resolve_input
from data_prep.sort import MapTask, SortTask, map_unit, sort_bucket
from hvd_lm import options
from hvd_lm.formats.manifest import MANIFEST_NAME, load_manifest
from hvd_lm.formats.shards import check_shard, open_shard
from hvd_lm.formats.tokenizer import normalize_text
from hvd_lm.util.units import parse_bytes, parse_split
from tests.test_data_prep_readers import BLITZER, FOOD, KAGGLE, MUSIC, TSV, independent

REPO = Path(__file__).resolve().parents[1]
ALL = [MUSIC, TSV, KAGGLE, FOOD] + [f"{BLITZER}/{d}/{p}.review.gz" for d in
                                    ("books", "dvd", "electronics")
                                    for p in ("positive", "negative")]


def run(inputs, out, workers=1, **kw):
    """prepare() in this process (no MPI); returns the summary."""
    cfg = PrepareConfig(inputs=[str(p) for p in inputs], out=str(out), workers=workers,
                        progress=False, **kw)
    return prepare(cfg, Context(workers, progress=False, use_mpi=False))


def cli(*args, env=None, timeout=120):
    """``python -m data_prep ARGS`` in a subprocess."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "data_prep", *map(str, args)], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def shard_files(directory):
    """{file name: sha256 of the whole file} of the shards in ``directory``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).glob("*.h5"))}


def documents(directory):
    """Every document (bytes without EOD) of every shard, by split."""
    out = {}
    for info in load_manifest(directory).shards:
        s = open_shard(info.path)
        out.setdefault(info.split, []).extend(
            s.tokens[a:b - 1].tobytes() for a, b in zip(s.doc_offsets[:-1], s.doc_offsets[1:]))
    return out


@pytest.fixture(scope="module")
def music(shared_data):
    return shared_data / MUSIC


@pytest.fixture(scope="module")
def reference(music, tmp_path_factory):
    """One uninterrupted 1-worker run on the McAuley file, small shards."""
    out = tmp_path_factory.mktemp("ref") / "out"
    summary = run([music], out, shard_size=256 << 10, split=(20, 1, 1))
    return out, summary


def test_documents_in_equal_documents_out(shared_data, tmp_path):
    summary = run([shared_data / r for r in ALL], tmp_path, shard_size=2 << 20)
    texts = [t for rel in ALL for t in independent(shared_data, rel)]
    expected = {t.replace("\0", "").encode() for t in texts if t.replace("\0", "")}
    got = documents(tmp_path)
    flat = [d for docs in got.values() for d in docs]
    assert Counter(flat).most_common(1)[0][1] == 1  # exact duplicates removed
    assert set(flat) == expected  # every distinct document, byte-exact, nothing else
    c = summary["counters"]
    assert c["records"] == len(texts)
    assert c["documents"] == len(expected) and c["too_short"] == 1
    assert c["duplicates"] == len(texts) - c["too_short"] - len(expected)
    raw = [(shared_data / rel).read_bytes() for rel in ALL]  # the inputs' uncompressed bytes
    assert c["bytes_in"] == sum(len(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b)
                                for b in raw)
    assert {k: len(v) for k, v in got.items()} == split_counts(len(expected), (1000, 1, 1))
    m = load_manifest(tmp_path)
    assert m.meta["seed"] == 1234 and m.meta["normalize"] is False and m.meta["dedup"] is True
    assert set(m.meta["versions"]) >= {"hvd_lm", "h5py", "numpy", "python"}
    assert {i["format"] for i in m.meta["inputs"]} == {"json", "tsv", "csv", "review"}
    for info in m.shards:  # shards stay under the size unless one document is larger
        assert info.tokens <= 2 << 20
    assert not (tmp_path / WORK_DIR).exists()


def test_same_shards_for_any_workers_and_memory(music, reference, tmp_path):
    ref, _ = reference
    want = shard_files(ref)
    assert len(want) >= 10
    run([music], tmp_path / "w2", workers=2, shard_size=256 << 10, split=(20, 1, 1))
    run([music], tmp_path / "w3", workers=3, shard_size=256 << 10, split=(20, 1, 1),
        max_memory_mb=6)  # 3 stripes, more buckets
    for d in ("w2", "w3"):
        assert shard_files(tmp_path / d) == want  # whole files byte-identical
    m_ref, m2 = load_manifest(ref), load_manifest(tmp_path / "w2")
    assert [(s.path.name, s.sha256) for s in m_ref.shards] == \
        [(s.path.name, s.sha256) for s in m2.shards]
    assert m2.meta["run"]["units"] == 2 and m2.meta["run"]["buckets"] > 1


def test_another_seed_reorders(music, reference, tmp_path):
    ref, _ = reference
    run([music], tmp_path, shard_size=256 << 10, split=(20, 1, 1), seed=99)
    a, b = documents(ref), documents(tmp_path)
    assert a["train"] != b["train"]
    assert sorted(sum(a.values(), [])) == sorted(sum(b.values(), []))


def test_external_sort_splits_oversized_buckets(music, tmp_path):
    """A bucket larger than the budget is split 16 ways recursively; same result."""
    spec = resolve_input(music)
    work = tmp_path / "work"
    map_unit(MapTask(unit=0, spec=spec, stripe=0, n_stripes=1, work=str(work), bits=0,
                     cfg=PrepareConfig(seed=1), buffer_bytes=1 << 20))
    results = []
    for budget in (64 << 20, 96 << 10):
        sort_bucket(SortTask(bucket=0, bits=0, work=str(work), units=1, budget=budget,
                             dedup=True))
        b = work / "sorted" / "b00000"
        results.append(((b / "data.bin").read_bytes(), np.load(b / "lengths.npy"),
                        json.loads((b / "stats.json").read_text())))
        shutil.rmtree(b)
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2] and results[0][2]["duplicates"] >= 1
    assert not list((work / "sorted").iterdir())


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_mpirun_two_ranks_same_shards(music, reference, tmp_path):
    from tests._mp import launch_env

    out = tmp_path / "mpi"
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "-mca", "btl", "^openib", sys.executable,
           "-m", "data_prep", "prepare", str(music), "--out", str(out), "--shard-size", "256K",
           "--split", "20,1,1", "--no-progress"]
    p = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("prepared ") == 1  # summary from rank 0 only
    assert shard_files(out) == shard_files(reference[0])
    assert load_manifest(out).meta["run"]["world_size"] == 2


@pytest.mark.parametrize("workers,rc", [(1, -9), (2, 1)])
def test_killed_run_resumes_to_identical_shards(music, reference, tmp_path, workers, rc):
    out = tmp_path / "out"
    args = ["prepare", music, "--out", out, "--shard-size", "256K", "--split", "20,1,1",
            "--workers", workers, "--no-progress"]
    p = cli(*args, env={KILL_HOOK_ENV: "2"})  # SIGKILL after its 2nd shard
    assert p.returncode == rc, p.stdout + p.stderr
    left = sorted(out.glob("*.h5"))
    assert len(left) >= 2 and not (out / MANIFEST_NAME).exists()
    for path in left:  # whatever was left is complete and self-consistent
        check_shard(path)
    assert cli("verify", out).returncode == 1  # nothing verified without a manifest
    again = cli(*args)
    assert again.returncode == 1 and "--resume" in again.stderr  # no silent reuse
    p = cli(*args, "--resume")
    assert p.returncode == 0, p.stdout + p.stderr
    kept = int(re.search(r"resumed: (\d+) verified shard", p.stdout).group(1))
    assert kept >= 2
    assert shard_files(out) == shard_files(reference[0])
    assert not list(out.glob(".*.tmp")) and not (out / WORK_DIR).exists()
    assert cli("verify", out).returncode == 0
    p = cli(*args, "--resume")  # resuming a finished run only verifies
    assert p.returncode == 0 and "already complete" in p.stdout


def test_verify_reports_each_mismatch(reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference[0], out)
    p = cli("verify", out)
    assert p.returncode == 0 and "match the manifest" in p.stdout
    m = load_manifest(out)
    # flip one byte of the token stream inside the HDF5 file (found by content)
    victim = m.split("train")[1]
    first_doc = open_shard(victim.path).document(0)[:-1].tobytes()
    raw = bytearray(victim.path.read_bytes())
    at = raw.find(first_doc[:64])
    assert at > 0
    raw[at + 10] ^= 0x01
    victim.path.write_bytes(bytes(raw))
    p = cli("verify", out)
    assert p.returncode == 1
    assert victim.path.name in p.stdout and "sha256" in p.stdout and victim.sha256 in p.stdout
    # a missing shard and a manifest count that lies are reported too
    m.split("val")[0].path.unlink()
    data = json.loads((out / MANIFEST_NAME).read_text())
    data["splits"]["test"]["shards"][0]["documents"] += 1
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    p = cli("verify", out)
    assert p.returncode == 1 and p.stdout.count("MISMATCH") == 4, p.stdout
    assert "val-00000.h5: shard file not found" in p.stdout
    assert "test-00000.h5: documents=250, manifest says 251" in p.stdout
    assert "totals.documents" in p.stdout


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump (hdf5-tools) not installed")
def test_hdf5_tools_read_pipeline_shards(reference):
    info = load_manifest(reference[0]).split("train")[0]
    ls = subprocess.run(["h5ls", str(info.path)], capture_output=True, text=True).stdout
    shapes = dict(re.findall(r"^(\w+)\s+Dataset \{(\d+)", ls, re.M))
    assert shapes == {"tokens": str(info.tokens), "doc_offsets": str(info.documents + 1)}
    dump = subprocess.run(["h5dump", "-d", "/tokens", "-s", "0", "-c", "12", str(info.path)],
                          capture_output=True, text=True, check=True).stdout
    values = [int(v) for v in dump.split("DATA {")[1].split("}")[0].split(":")[1]
              .replace(",", " ").split()]
    assert bytes(values) == open_shard(info.path).document(0).tobytes()[:12]
    dump = subprocess.run(["h5dump", "-A", str(info.path)], capture_output=True, text=True,
                          check=True).stdout
    assert info.sha256 in dump and "bytes-utf8-eod0" in dump and "reviews_Digital" in dump


# ---- bad input, end to end -----------------------------------------------------------------


def _jsonl(path, lines):
    path.write_bytes(gzip.compress(b"".join(line + b"\n" for line in lines), mtime=0))
    return path


def _good(n=30):
    return [json.dumps({"reviewText": f"review number {i} is fine"}).encode() for i in range(n)]


def test_malformed_line_stops_or_is_skipped(tmp_path):
    lines = _good()
    lines[4] = b'{"reviewText": "broken'
    src = _jsonl(tmp_path / "in.json.gz", lines)
    p = cli("prepare", src, "--out", tmp_path / "a", "--no-progress")
    assert p.returncode == 1 and f"{src}:5: invalid JSON" in p.stderr
    assert not (tmp_path / "a" / MANIFEST_NAME).exists()
    p = cli("prepare", src, "--out", tmp_path / "b", "--no-progress", "--skip-bad")
    assert p.returncode == 0, p.stderr
    assert "1 bad records" in p.stdout and f"{src}:5: invalid JSON" in p.stdout
    meta = load_manifest(tmp_path / "b").meta
    assert meta["counters"]["bad_records"] == 1 and meta["counters"]["documents"] == 29
    assert meta["bad_samples"][0].startswith(f"{src}:5:")
    # fixed input, same directory: the failed run's work is redone without --resume
    src.write_bytes(gzip.compress(b"".join(line + b"\n" for line in _good()), mtime=0))
    p = cli("prepare", src, "--out", tmp_path / "a", "--no-progress")
    assert p.returncode == 0 and load_manifest(tmp_path / "a").meta["counters"]["documents"] == 30


def test_empty_input_is_an_error_and_writes_nothing(tmp_path):
    src = tmp_path / "empty.json.gz"
    src.write_bytes(gzip.compress(b""))
    p = cli("prepare", src, "--out", tmp_path / "o", "--no-progress")
    assert p.returncode == 1 and "no documents" in p.stderr
    assert not list((tmp_path / "o").iterdir())  # no shards, no manifest, no work left
    with pytest.raises(PrepareError, match="no input files"):
        run([], tmp_path / "x")


def test_missing_text_field(tmp_path):
    lines = _good()
    lines[2] = json.dumps({"summary": "no text here"}).encode()
    src = _jsonl(tmp_path / "in.json.gz", lines)
    with pytest.raises(PhaseError, match=rf"{re.escape(str(src))}:3: no field 'reviewText'"):
        run([src], tmp_path / "a")
    s = run([src], tmp_path / "b", skip_bad=True)
    assert s["counters"]["bad_records"] == 1 and s["counters"]["documents"] == 29


def test_invalid_utf8_and_nul(tmp_path):
    lines = _good()
    lines[0] = b'{"reviewText": "caf\xe9 latin-1"}'
    lines[1] = json.dumps({"reviewText": "nul\u0000inside"}).encode()
    src = _jsonl(tmp_path / "in.json.gz", lines)
    s = run([src], tmp_path / "a", split=(1, 0, 0))
    assert s["counters"]["utf8_replaced"] == 1 and s["counters"]["nul_removed"] == 1
    docs = documents(tmp_path / "a")["train"]
    assert "caf\ufffd latin-1".encode() in docs and b"nulinside" in docs
    with pytest.raises(PhaseError, match=":1: invalid UTF-8"):
        run([src], tmp_path / "b", utf8_errors="strict")


def test_truncated_and_corrupt_gzip(shared_data, tmp_path):
    data = (shared_data / MUSIC).read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) // 4])
    with pytest.raises(PhaseError, match="truncated"):
        run([cut], tmp_path / "a")
    s = run([cut], tmp_path / "b", skip_bad=True)
    assert s["counters"]["truncated_files"] == 1 and 0 < s["counters"]["records"] < 6908
    bad = bytearray((shared_data / TSV).read_bytes())
    bad[len(bad) // 2] ^= 0xFF
    corrupt = tmp_path / "bad.tsv.gz"
    corrupt.write_bytes(bytes(bad))
    with pytest.raises(PhaseError, match="corrupt compressed stream"):
        run([corrupt], tmp_path / "c")
    s2 = run([corrupt, cut], tmp_path / "d", skip_bad=True)  # the corrupt file is dropped
    assert s2["counters"]["corrupt_files"] == 1
    assert s2["counters"]["documents"] == s["counters"]["documents"]


def test_normalize_is_applied_and_recorded(music, tmp_path):
    s = run([music], tmp_path, normalize=True, min_chars=20)
    docs = [d.decode() for v in documents(tmp_path).values() for d in v]
    want = {normalize_text(t) for t in independent(music.parents[2], MUSIC)}
    want = {t for t in want if len(t) >= 20}
    assert set(docs) == want
    assert all("  " not in d and "\n" not in d for d in docs)
    assert s["normalize"] is True and s["min_chars"] == 20 and s["counters"]["too_short"] > 0


def test_existing_output_needs_resume_or_overwrite(music, reference, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(reference[0], out)
    with pytest.raises(PrepareError, match="--resume"):
        run([music], out, shard_size=256 << 10, split=(20, 1, 1))
    (out / "notes.txt").write_text("mine")
    s = run([music], out, overwrite=True, shard_size=1 << 20, split=(20, 1, 1))
    assert shard_files(out) != shard_files(reference[0])  # bigger shards now, old ones gone
    assert len(list(out.glob("*.h5"))) == s["totals"]["shards"]
    assert (out / "notes.txt").read_text() == "mine"  # never touches files it did not write


def test_finished_with_other_inputs_sees_a_recopied_input(music, tmp_path):
    """A re-copied input (same bytes, new mtime) makes --resume refuse; the helper says so first."""
    src = tmp_path / "in" / music.name
    src.parent.mkdir()
    shutil.copy2(music, src)
    out = tmp_path / "o"
    cfg = dict(shard_size=256 << 10, split=(20, 1, 1))
    run([src], out, **cfg)
    same = PrepareConfig(inputs=[str(src)], out=str(out), resume=True, **cfg)
    assert finished_with_other_inputs(same) is False
    assert run([src], out, resume=True, **cfg)["resumed_complete"]
    assert finished_with_other_inputs(
        PrepareConfig(inputs=[str(src)], out=str(out), resume=True, shard_size=1 << 20,
                      split=(20, 1, 1))) is True          # other settings
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "copied again"
    assert finished_with_other_inputs(same) is True
    with pytest.raises(PrepareError, match="versions of the input files"):
        run([src], out, resume=True, **cfg)
    assert finished_with_other_inputs(
        PrepareConfig(inputs=[str(src)], out=str(tmp_path / "none"), **cfg)) is False


# ---- units ---------------------------------------------------------------------------------


def test_split_counts():
    assert split_counts(1002, (1000, 1, 1)) == {"train": 1000, "val": 1, "test": 1}
    assert split_counts(10, (1000, 1, 1)) == {"train": 8, "val": 1, "test": 1}
    assert split_counts(100, (0.8, 0.1, 0.1)) == {"train": 80, "val": 10, "test": 10}
    assert split_counts(5, (1, 0, 0)) == {"train": 5, "val": 0, "test": 0}
    with pytest.raises(PrepareError, match="too few"):
        split_counts(2, (1000, 1, 1))
    with pytest.raises(ValueError):
        parse_split("1,-1")
    assert parse_split("98,1") == (98.0, 1.0, 0.0)
    assert parse_bytes("64M") == 64 << 20 and parse_bytes("1.5K") == 1536


def test_plan_cuts_at_document_boundaries(tmp_path):
    work = tmp_path
    lens = [np.array([5, 5, 30, 5], np.int64), np.array([2, 2, 2], np.int64)]
    for b, arr in enumerate(lens):
        (work / "sorted" / f"b{b:05d}").mkdir(parents=True)
        np.save(work / "sorted" / f"b{b:05d}" / "lengths.npy", arr)
    plans = plan_shards(work, 2, {"train": 5, "val": 1, "test": 1}, shard_size=12)
    assert [(p.file, p.documents, p.tokens) for p in plans] == [
        ("train-00000.h5", 2, 10), ("train-00001.h5", 1, 30), ("train-00002.h5", 2, 7),
        ("val-00000.h5", 1, 2), ("test-00000.h5", 1, 2)]
    assert plans[2].pieces == ((0, 3, 4, 40, 45), (1, 0, 1, 0, 2))


def test_subcommands_parse_into_the_config():
    parser = build_parser()
    args = parser.parse_args(["prepare", "a.json", "--out", "d", "--split", "98,1,1",
                              "--shard-size", "8M"])
    cfg = options.from_args(PrepareConfig, args)
    assert args.command_obj is PREPARE and cfg.split == (98.0, 1.0, 1.0)
    assert cfg.shard_size == 8 << 20 and cfg.inputs == ["a.json"] and cfg.dedup
    assert parser.parse_args(["verify", "d"]).command_obj is VERIFY


def test_bench_smoke(shared_data, tmp_path):
    from benchmarks.bench_prepare import BenchPrepareConfig, run_bench

    lines = []
    result = run_bench(BenchPrepareConfig(data=str(shared_data / "amazon"), workdir=str(tmp_path),
                                          size_mb=2, workers=[1, 2]), echo=lines.append)
    assert result["corpus"]["bytes"] >= 2e6 and result["raw_mb_s"] > 0
    assert [r["workers"] for r in result["runs"]] == [1, 2]
    assert any("synthetic scale-up" in line for line in lines)


def test_the_imdb_tarball_through_the_cli(shared_data, tmp_path):
    """``prepare`` reads IMDB's aclImdb tarball as it ships (--tar-members picks the reviews,
    not the urls lists): its 25,000 train reviews, byte for byte what the transfer's IMDB loader
    (hvd_lm.transfer.datasets.load_imdb, another reader) reads; the summary names the members
    and the manifest records them, so --resume with other members is another run."""
    from hvd_lm.transfer.datasets import load_imdb

    tar = shared_data / "imdb/aclImdb_train.tar.gz"
    out = tmp_path / "imdb"
    globs = "*/train/pos/*.txt,*/train/neg/*.txt"
    p = cli("prepare", tar, "--tar-members", globs, "--out", out,
            "--split", "1", "--no-dedup", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert f"aclImdb_train.tar.gz: tar (file name), members '{globs}' (given)" in p.stdout
    want = sorted(t.encode() for t in load_imdb(tar)["train"].texts)
    assert sorted(documents(out)["train"]) == want and len(want) == 25_000
    inp, = json.loads((out / MANIFEST_NAME).read_text())["inputs"]
    assert (inp["format"], inp["text_field"]) == ("tar", globs)
    same = PrepareConfig(inputs=[str(tar)], out=str(out), tar_members=globs, split=(1, 0, 0),
                         dedup=False)
    assert not finished_with_other_inputs(same)
    assert finished_with_other_inputs(PrepareConfig(**{**vars(same), "tar_members": "*.txt"}))
