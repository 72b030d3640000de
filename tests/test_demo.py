"""The demo's pieces: sha256-verified downloads from a local HTTP server, the report built only
from run files, and a miniature end-to-end `hvd-lm demo` run."""
from __future__ import annotations

import functools
import gzip
import http.server
import json
import re
import socket
import threading
from pathlib import Path

import pytest
import yaml

from hvd_lm.jobs.download import ChecksumMismatch, DownloadError, download_all, fetch, load_sources
from hvd_lm.jobs.report import training_summary, write_report
from hvd_lm.train.evaluate import compressor_bpc
from hvd_lm.train.log import read_metrics
from tests._mp import REPO, SHARED, launch_env, run

AMAZON = SHARED / "data" / "amazon"
# sources.yaml save_as -> the shared copy of the same bytes (gzip-compressed there)
SHARED_COPY = {
    "blitzer_mdsd/books/negative.review": "blitzer_mdsd/sorted_data_acl/books/negative.review.gz",
    "blitzer_mdsd/dvd/positive.review": "blitzer_mdsd/sorted_data_acl/dvd/positive.review.gz",
    "blitzer_mdsd/dvd/negative.review": "blitzer_mdsd/sorted_data_acl/dvd/negative.review.gz",
    "blitzer_mdsd/electronics/positive.review":
        "blitzer_mdsd/sorted_data_acl/electronics/positive.review.gz",
    "blitzer_mdsd/electronics/negative.review":
        "blitzer_mdsd/sorted_data_acl/electronics/negative.review.gz",
    "amazon_customer_reviews_us/amazon_reviews_us_Gift_Card_v1_00.tsv":
        "amazon_customer_reviews_us/amazon_reviews_us_Gift_Card_v1_00.tsv.gz",
    "kaggle_musical_instruments/Musical_instruments_reviews.csv":
        "kaggle_musical_instruments/Musical_instruments_reviews.csv.gz",
    "amazon_fine_food/Reviews.csv": "amazon_fine_food/Reviews.csv.gz",
}


@pytest.fixture
def mirror(tmp_path):
    """An HTTP server on 127.0.0.1 serving copies of the demo's source files."""
    if not AMAZON.is_dir():
        pytest.skip(f"{AMAZON} not present")
    root = tmp_path / "www"
    _, sources = load_sources(REPO / "configs" / "sources.yaml")
    for s in sources:
        dest = root / s.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(gzip.decompress((AMAZON / SHARED_COPY[s.save_as]).read_bytes()))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root, sources
    server.shutdown()
    server.server_close()


def test_download_verifies_sha256_and_rejects_corruption(mirror, tmp_path):
    url, root, sources = mirror
    out = tmp_path / "data"
    files = download_all(REPO / "configs" / "sources.yaml", out, mirror=url, log=lambda m: None)
    assert [f.relative_to(out).as_posix() for f in files] == [s.save_as for s in sources]
    assert sum(f.stat().st_size for f in files) == sum(s.bytes for s in sources)
    # The CLI sees them verified and fetches nothing again.
    proc = run([REPO / ".venv/bin/hvd-lm", "download", "--mirror", url, "--out", out], timeout=60)
    assert proc.stdout.count("ok (cached)") == len(sources)
    # A corrupted copy on the server (one flipped byte) is rejected and leaves no file behind.
    victim = root / sources[0].path
    data = bytearray(victim.read_bytes())
    data[1000] ^= 0x01
    victim.write_bytes(bytes(data))
    (out / sources[0].save_as).unlink()
    with pytest.raises(ChecksumMismatch, match="sha256"):
        download_all(REPO / "configs" / "sources.yaml", out, mirror=url, log=lambda m: None)
    assert not (out / sources[0].save_as).exists()
    assert not list((out / sources[0].save_as).parent.glob(".*part*"))


def test_download_errors_name_the_url_and_the_mirror_option(mirror, tmp_path):
    url, root, sources = mirror
    # A path the server does not have: HTTP 404, named with its URL.
    with pytest.raises(DownloadError, match=rf"{url}/missing/file: HTTP 404.*--mirror URL"):
        fetch(f"{url}/missing/file", tmp_path / "x", "0" * 64, 1)
    # No server at all (a closed port): the CLI prints one ERROR line with the URL, exit 1.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc = run([REPO / ".venv/bin/hvd-lm", "download", "--mirror", dead, "--out", tmp_path / "d"],
               timeout=60, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert f"ERROR: {dead}/{sources[0].path}: cannot fetch" in line and "--mirror URL" in line
    assert not list((tmp_path / "d").rglob("*.review"))


def test_compressor_bpc_known_values():
    assert compressor_bpc(b"a" * 100000)["xz"] < 0.05     # trivially compressible
    import os
    rnd = os.urandom(50000)
    assert all(v > 7.9 for v in compressor_bpc(rnd).values())  # incompressible: ~8 bits


def _fake_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "train").mkdir(parents=True)
    recs = [{"kind": "start", "step": 0, "time": 100.0, "world_size": 2, "global_batch": 64,
             "params": 12345},
            {"kind": "train", "step": 10, "time": 110.0, "bpc": 3.25, "chars_per_s": 1000.0},
            {"kind": "train", "step": 20, "time": 120.0, "bpc": 2.875, "chars_per_s": 3000.0},
            {"kind": "eval", "step": 20, "time": 121.0, "val_bpc": 2.5},
            {"kind": "end", "step": 20, "time": 125.0, "chars_trained": 98765}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return run_dir


def test_report_numbers_come_from_the_files(tmp_path):
    run_dir = _fake_run(tmp_path)
    path = write_report(run_dir, run_dir, "t", {"bpc": 2.5, "chars": 1000, "step": 20},
                        {"xz": 3.0, "gzip": 3.4}, None)
    text = path.read_text()
    s = training_summary(read_metrics(run_dir / "metrics.jsonl"))
    assert s["median_chars_per_s"] == 2000.0 and s["wall_s"] == 25.0
    row = "| 2 | 64 | 12,345 | 20 | 98,765 | 2000 | 25 | 2.8750 |"
    assert row in text
    assert "| `xz -9` | 3.0000 |" in text and "| `gzip -9` | 3.4000 |" in text
    assert "beats `xz -9` and `gzip -9`" in text
    for png in ("bpc_vs_step.png", "bpc_vs_time.png", "chars_per_s.png"):
        assert (run_dir / png).stat().st_size > 1000


def test_the_rate_plot_starts_at_zero(tmp_path, monkeypatch):
    """chars/s on an axis from 0 (a 5% wobble drawn on an axis from 1,950 looked like a
    collapse)."""
    import matplotlib.pyplot as plt

    from hvd_lm.jobs.report import plot_training
    axes, subplots = [], plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: (lambda f: axes.append(f[1]) or f)(
        subplots(*a, **k)))
    run_dir = _fake_run(tmp_path)
    plot_training(read_metrics(run_dir / "metrics.jsonl"), run_dir)
    rate, = [ax for ax in axes if ax.get_ylabel().startswith("chars/s")]
    assert rate.get_ylim()[0] == 0


@pytest.mark.slow
def test_mini_demo_end_to_end(tmp_path):
    """The whole demo with a tiny model and budget, from a copied config run in another folder:
    every step runs, the outputs go to ./runs/<name> there (not into the checkout), and the
    report matches the metrics and eval files it came from."""
    if not AMAZON.is_dir():
        pytest.skip(f"{AMAZON} not present")
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["name"] = f"pytest-{tmp_path.name}"
    cfg["train"]["model"]["hidden_size"] = 32
    cfg["train"]["data"].update(batch_size=4, seq_len=32)
    cfg["train"]["optim"]["max_steps"] = 20
    cfg["train"]["run"].update(log_every=5, eval_every=10, eval_chars=20000)
    cfg["transfer"].update(max_examples=200, cache_dir=str(tmp_path / "cache"),
                           data_dir=str(REPO / cfg["transfer"]["data_dir"]))
    cfg["corpus"].update(shared_dir=str(AMAZON), sources=str(REPO / cfg["corpus"]["sources"]))
    (tmp_path / "my").mkdir()
    path = tmp_path / "my" / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "runs" / cfg["name"]
    try:
        proc = run([REPO / ".venv/bin/hvd-lm", "demo", "--config", "my/demo.yaml"],
                   timeout=600, env=launch_env(), cwd=tmp_path)
        assert not (REPO / "runs" / cfg["name"]).exists()
        report = (run_dir / "report.md").read_text()
        ev = json.loads((run_dir / "eval.json").read_text())
        assert f"{ev['bpc']:.4f}" in report
        assert f"| `xz -9` | {ev['compressors']['xz']:.4f} |" in report
        recs = read_metrics(run_dir / "train" / "metrics.jsonl")
        assert [r["step"] for r in recs if r["kind"] == "train"] == [5, 10, 15, 20]
        assert f"{[r for r in recs if r['kind'] == 'train'][-1]['bpc']:.4f}" in report
        tr = json.loads((run_dir / "transfer" / "transfer.json").read_text())
        assert tr["baseline"] is not None
        assert re.search(r"report: .*report\.md", proc.stdout)
        # summary.json (what README's demo figures are checked against) repeats these files.
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["val_bpc"] == ev["bpc"] and summary["compressor_bpc"] == ev["compressors"]
        assert summary["val_chars"] == ev["chars"] and summary["steps"] == 20
        assert summary["transfer"]["val_acc"] == tr["classifier"]["accuracy"]["val"]
        assert summary["transfer"]["baseline_val_acc"] == tr["baseline"]["accuracy"]["val"]
        assert f"{summary['median_chars_per_s']:.0f} |" in report
        assert summary["total_s"] >= sum(summary["timings_s"].values())
    finally:
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
