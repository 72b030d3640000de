"""The docs run as written: every fenced shell block of README.md, docs/*.md and CONTRIBUTING.md,
in reading order.

Blocks are extracted with mktestdocs (``grab_code_blocks``) and every command in them is run or
checked the way a new user on this machine would meet it, in one temporary clone of the working
tree (its tracked files, the repository's ``.venv``) with ``../shared`` beside it, so later blocks
see what earlier ones wrote (prepare writes ``data/amazon``, train writes ``runs/h256``, transfer
reads it):

* **run**: help, rendering (``hvd-lm launch``), data preparation and verification, training,
  evaluation, transfer, the scaling model and the launch templates on this machine. Long runs are
  shrunk, and only these ways (:func:`shrink`): ``--max-steps N`` becomes ``max(2, N // 500)``
  (from the config's ``optim.max_steps`` when no flag gives it), ``--hidden-size 64`` is added when
  neither a flag nor the config sets the width, transfer gets ``--max-examples`` of at most 200
  and ``--max-chars`` of at most 256 (a Blitzer review is ~1,000 bytes),
  and ranks (``-np``, ``NP``, ``-H localhost:N``, torchrun's ``--nproc-per-node`` and
  ``NPROC_PER_NODE``) are capped at 2, this machine's cores.
* **check**: benchmarks, the demo, downloads, ``hvd-lm check-build`` (tests/test_foundation.py
  runs it as written) and anything that needs a cluster (``sbatch``, ``qsub``, several hosts) are
  parsed by the command's real parser (``hvd-lm``'s, horovodrun's, the template's knobs block,
  ``bash -n``) and their input paths must exist or be written by an earlier block (outputs of
  checked commands count as written).
* **named**: ``python -m tests.cluster ...`` (the cluster in a box: root and network
  namespaces; the ``cluster`` tests run it) must name one of its subcommands.

On a GPU node with fewer GPUs than a non-GPU block's ranks, those ranks run with
``CUDA_VISIBLE_DEVICES=""`` (``--device auto`` is then the CPU, as on a machine without GPU).

Python blocks run with mktestdocs (``check_md_file``), and every ``-np``/``NP`` above this
machine's core count must sit next to a sentence saying how to run it here (``--oversubscribe``
or the core count).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests._mp import REPO, SHARED, launch_env

mktestdocs = pytest.importorskip("mktestdocs")
from tests.docs_runner import (  # noqa: E402 - mktestdocs first: the runner needs it
    CORES,
    REMOTE_KNOBS,
    Session,
    _cap_ranks,
    _local_hosts,
    _ranks,
    _split_launcher,
    commands,
    handle,
    shrink,
)

#: Reading order: README first (it writes data/amazon and runs/h256, which the docs use), then
#: docs/ in this order (training.md writes hosts.txt, which launch.md's elastic block reads), then
#: CONTRIBUTING.md.
DOCS = ["README.md", "docs/install.md", "docs/architecture.md", "docs/data_prep.md",
        "docs/training.md", "docs/reliability.md", "docs/transfer.md", "docs/launch.md",
        "docs/performance.md", "docs/mlstm_fused.md", "docs/gpu.md", "CONTRIBUTING.md"]

def test_every_doc_is_covered_and_has_shell_blocks():
    docs = {"README.md", "CONTRIBUTING.md",
            *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))}
    assert docs == set(DOCS), "add new docs to DOCS (in reading order)"
    assert all(commands(d) for d in DOCS)



@pytest.fixture(scope="module")
def session(tmp_path_factory):
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (the project's shared data) is not present")
    top = tmp_path_factory.mktemp("docs")
    root = top / "repo"
    root.mkdir()
    (top / "shared").symlink_to(SHARED)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for name in sorted({t.split("/")[0] for t in tracked if t} | {".venv"}):
        (root / name).symlink_to(REPO / name)
    env = launch_env()
    env.pop("OUT_DIR", None)
    return Session(root, env)


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_shell_blocks_run_as_written(doc, session):
    for cmd in commands(doc):
        try:
            handle(cmd, session)
        except AssertionError:
            print("\n".join(session.log[-40:]))
            raise


@pytest.mark.parametrize("doc", DOCS)
def test_ranks_above_this_machines_cores_are_explained(doc):
    text = (REPO / doc).read_text().splitlines()
    for cmd in commands(doc):
        launcher, _, facts = ([], [], {})
        if cmd.argv and Path(cmd.argv[0]).name in ("mpirun", "horovodrun", "torchrun"):
            launcher, _, facts = _split_launcher(cmd.argv)
        ranks = cmd.env.get("NP") or cmd.env.get("NPROC_PER_NODE") or ""
        n = facts.get("np") or (int(ranks) if ranks.isdigit() else 0)
        local = not facts or _local_hosts(facts.get("hosts", "localhost"))
        local &= not (REMOTE_KNOBS & set(cmd.env)) and "sbatch" not in cmd.text
        if n > CORES and local and not facts.get("oversubscribe"):
            near = "\n".join(text[max(0, cmd.line - 15):cmd.line + 15])
            assert re.search(r"oversubscribe|\bcores?\b|-core", near), (
                f"{cmd.where()}: {n} ranks on one machine; say how to run it on {CORES} cores")


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc, session, monkeypatch):
    monkeypatch.chdir(session.root)
    mktestdocs.check_md_file(REPO / doc, lang="python", memory=True)


def test_shrinking_is_what_the_docstring_says(tmp_path):
    (tmp_path / "c.yaml").write_text("optim: {max_steps: 2000}\nmodel: {hidden_size: 256}\n")
    assert shrink(["train", "--max-steps", "4000"], tmp_path)[-4:] == [
        "--max-steps", "8", "--hidden-size", "64"]
    assert shrink(["train", "--config", "c.yaml"], tmp_path)[-2:] == ["--max-steps", "4"]
    assert shrink(["transfer", "x", "--max-examples", "2000"], tmp_path)[-4:] == [
        "--max-examples", "200", "--max-chars", "256"]
    assert shrink(["transfer", "x", "--max-chars", "100"], tmp_path)[-2:] == ["--max-chars", "100"]
    assert shrink(["transfer", "x", "--max-chars", "0"], tmp_path)[-2:] == ["--max-chars", "256"]
    assert _cap_ranks(["mpirun", "-np", "8", "-H", "localhost:8"]) == [
        "mpirun", "-np", "2", "-H", "localhost:2"]
    launcher, inner, facts = _split_launcher(["torchrun", "--standalone", "--nproc-per-node", "8",
                                              "-m", "hvd_lm", "train", "--shards", "d"])
    assert _cap_ranks(launcher) == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m"]
    assert inner == ["python", "-m", "hvd_lm", "train", "--shards", "d"]
    assert facts == {"np": 8, "hosts": "localhost", "exec": inner[2:]}


def test_ranks_of_a_command():
    """What decides whether a block's ranks must leave the GPU alone (``_execute``)."""
    assert _ranks(["horovodrun", "-np", "2", "python", "-m", "hvd_lm", "train"], {}) == 2
    assert _ranks(["srun", "-n", "4", "hvd-lm", "eval"], {}) == 4
    assert _ranks(["bash", "launch/horovodrun.sh"], {"NP": "2"}) == 2
    assert _ranks(["hvd-lm", "train", "--shards", "d"], {}) == 1
