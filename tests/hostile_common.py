"""What the hostile-input tests (tests/test_hostile_*.py) share: the command runner, the one-line
error check, run records and folder snapshots, and the fixtures (shards, a trained run, a
classifier, a local HTTP server, a reviews file)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_lm.cli import main
from hvd_lm.formats import checkpoint as ck
from tests import conftest
from tests._mp import launch_env, one_error_line, run  # noqa: F401 - one_error_line for the tests
from tests.test_transfer import synthetic_reviews, write_checkpoint

TINY = [*conftest.TINY, "--log-every", "10"]
HVD_LM = [sys.executable, "-m", "hvd_lm"]


def hvd_lm(*args, timeout=180, **env) -> subprocess.CompletedProcess:
    return run([*HVD_LM, *map(str, args)], timeout=timeout, env=launch_env(**env), check=False)




def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run_a(trained_run):
    """A finished run with checkpoints of steps 10 and 20 (latest: 20): the session's trained
    run (tests/conftest.py), which tests copy before they change it."""
    out = trained_run.run
    assert [p.name for p in ck.list_checkpoints(out)] == ["step_00000010.pt", "step_00000020.pt"]
    return out


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out



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



def prepare_cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "data_prep", "prepare", *map(str, args), "--no-progress"],
               timeout=timeout, check=False)


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    src = tmp_path_factory.mktemp("reviews") / "reviews.txt"
    src.write_text("".join(f"review {i}: the album is {'good' * (i % 5 + 1)} and long enough\n"
                           for i in range(60)))
    return src


def measured_main(argv: list[str], mem_bytes: int = 3 << 30, stdin=None,
                  warmup: list | None = None, env: dict | None = None, cli: str = "hvd_lm.cli"
                  ) -> tuple[subprocess.CompletedProcess, float, float]:
    """``hvd_lm.cli.main(argv)`` in a child with its address space capped at ``mem_bytes`` (so
    a blow-up ends as MemoryError, not a swapping machine), the command's modules imported
    (and ``main(warmup)`` run, when given) before it is measured; returns (process, MB main
    read through read() calls: /proc/self/io's rchar, MB its peak RSS rose above the RSS before
    it: Linux's VmHWM, reset through /proc/self/clear_refs). Bytes and memory, not seconds: a
    verdict on them does not hang on this machine's load. ``env``: variables set for the child
    (on top of :func:`tests._mp.launch_env`). ``cli``: the module with ``build_parser`` and
    ``main`` (``benchmarks`` for ``python -m benchmarks``)."""
    code = (f"import sys, resource; from {cli} import build_parser, main; "
            "argv = sys.argv[1:]; i = argv.index('--'); warm, argv = argv[:i], argv[i + 1:]; "
            "build_parser(argv); warm and main(warm); "
            f"resource.setrlimit(resource.RLIMIT_AS, ({mem_bytes}, {mem_bytes})); "
            "kb = lambda k: int([x for x in open('/proc/self/status') if x.startswith(k)][0]"
            ".split()[1]) / 1024; "
            "rchar = lambda: int([x for x in open('/proc/self/io') if x.startswith('rchar')][0]"
            ".split()[1]); open('/proc/self/clear_refs', 'w').write('5'); "
            "m0 = kb('VmRSS'); r0 = rchar(); rc = main(argv); "
            "print(f'read={(rchar() - r0) / 2**20:.3f} grew={kb(\"VmHWM\") - m0:.1f}', "
            "file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, warmup or []), "--",
                           *map(str, argv)], stdin=stdin, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=launch_env(**(env or {})),
                          timeout=300, check=False)
    stats = [dict(kv.split("=") for kv in x.split()) for x in proc.stderr.splitlines()
             if x.startswith("read=")]
    proc.stderr = "\n".join(x for x in proc.stderr.splitlines() if not x.startswith("read="))
    if not stats:
        return proc, float("inf"), float("inf")
    return proc, float(stats[0]["read"]), float(stats[0]["grew"])
