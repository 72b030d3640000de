"""``python -m benchmarks elastic``: what elastic training costs, measured on this machine in one
run.

An elastic ``hvd-lm train --elastic`` job (:class:`ElasticJob`) runs under ``horovodrun
--min-np 1 --max-np 2 --host-discovery-script`` on two names of this machine, one slot each
(Horovod blacklists a host whose worker failed, so each "host" is another name of localhost).
The benchmark reads the job's own ``metrics.jsonl``:

1. a commit: the median of the ``commit`` records' seconds (model and optimizer state copied to
   host memory, plus the character-count allreduce) against the median step time of the ``train``
   records, as the share of step time at ``--commit-every`` (commit seconds / (commit_every x step
   seconds));
2. a lost worker: one worker is killed with SIGKILL once ``--kill-at`` steps are done; reported
   are the steps rolled back (the last step the two-rank world completed, read from the records
   after the job, minus the committed step training resumed from; at most ``--commit-every``)
   and the seconds from the kill to the first step trained on the re-formed world (failure
   detection, rendezvous, state sync).

Targets (issue 15): a commit < 2% of step time at the default interval; a lost worker costs at
most the steps since the last commit. ``--json FILE`` saves the figures and the raw records.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.harness import run_records, save_json
from hvd_lm.comm.hosts import interfaces, is_local
from hvd_lm.jobs.job_scripts import local_mpi_env
from hvd_lm.options import Command, option


def local_names() -> list[str]:
    """Names of this machine that Horovod treats as local hosts (no ssh): ``localhost``, the host
    name when it resolves to a local address (:func:`hvd_lm.comm.hosts.is_local`), and every
    non-loopback IPv4 address of an interface that is up (:func:`hvd_lm.comm.hosts.interfaces`)."""
    host = socket.gethostname()
    names = ["localhost"] + ([host] if is_local(host) else [])
    names += sorted(a for nic in interfaces().values() for a in nic["addrs"]
                    if not a.startswith("127."))
    return list(dict.fromkeys(names))


class ElasticJob:
    """An elastic ``hvd-lm train`` under ``horovodrun`` on this machine, driven from outside: the
    host list (what the discovery script prints) can be changed and workers killed while it runs.

    Args:
        workdir: folder for the host list, the discovery script and the run.
        hosts: initial "host:slots" entries (at most 2 ranks: ``--max-np 2``).
        train_args: ``hvd-lm train`` flags (``--elastic true`` and ``--out-dir`` are added).
        env: extra environment for the ranks.
    """

    def __init__(self, workdir: Path, hosts: list[str], train_args: list[str],
                 env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.run_dir = self.workdir / "run"
        self.hosts_file = self.workdir / "hosts.txt"
        self.set_hosts(hosts)
        discover = self.workdir / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        discover.chmod(0o755)
        horovodrun = Path(sys.executable).parent / "horovodrun"
        self.cmd = [str(horovodrun), "-np", str(len(hosts)), "--min-np", "1", "--max-np",
                    "2", "--host-discovery-script", str(discover), sys.executable, "-m",
                    "hvd_lm", "train", *map(str, train_args), "--out-dir", str(self.run_dir),
                    "--elastic", "true"]
        self.proc = subprocess.Popen(self.cmd, env=local_mpi_env(**(env or {})), cwd=self.workdir,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def set_hosts(self, hosts: list[str]) -> None:
        """What the discovery script prints from now on (Horovod re-reads it every second)."""
        self.hosts_file.write_text("".join(h + "\n" for h in hosts))

    def records(self, kind: str | None = None) -> list[dict]:
        """The run's metrics records so far (of ``kind``)."""
        return run_records(self.run_dir, kind)

    def wait_for(self, pred, what: str, timeout: float = 120) -> None:
        """Poll until ``pred()``.

        Raises:
            RuntimeError: the job ended, or ``timeout`` seconds passed, first.
        """
        deadline = time.time() + timeout
        while not pred():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended ({self.proc.returncode}) while waiting for "
                                   f"{what}:\n{self.proc.stdout.read()[-4000:]}")
            if time.time() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.2)

    def trained(self, step: int) -> bool:
        """True once a ``train`` record of ``step`` or later was logged."""
        return any(r["step"] >= step for r in self.records("train"))

    def kill_worker(self, host: str) -> float:
        """SIGKILL the worker running on ``host``; returns the time of the kill."""
        workers = [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                   if p.name().startswith("python") and "hvd_lm" in " ".join(p.cmdline())
                   and p.environ().get("HOROVOD_HOSTNAME") == host]
        if len(workers) != 1:
            raise RuntimeError(f"expected one worker on {host}, found {len(workers)}")
        t = time.time()
        workers[0].kill()
        return t

    def finish(self, timeout: float = 300) -> str:
        """Wait for the job; kill what is left on timeout. Returns its output."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
            return out
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass
class BenchElasticConfig:
    """``python -m benchmarks elastic``."""

    shards: str = option("", "shard directory to train on", required=True)
    hidden_size: int = option(256, "mLSTM width H", ge=1)
    batch_size: int = option(16, "per-rank batch", ge=1)
    seq_len: int = option(64, "TBPTT window, chars", ge=1)
    steps: int = option(120, "optimizer steps of the job", ge=10)
    commit_every: int = option(10, "run.commit_every (the default)", ge=1)
    kill_at: int = option(45, "kill one worker after this many steps (mid commit interval)",
                          ge=1)
    threads: int = option(1, "torch threads per rank", ge=1)
    timeout: float = option(900.0, "limit for the whole job, s", gt=0)
    json: str = option("", "write the figures here")


def bench_elastic(cfg: BenchElasticConfig) -> int:
    """Run the job, kill a worker, print (and save) commit cost and loss cost.

    Raises:
        RuntimeError: fewer than two local host names, or the job failed.
    """
    names = local_names()
    if len(names) < 2:
        raise RuntimeError(f"needs two names of this machine for two elastic hosts, found {names}")
    with tempfile.TemporaryDirectory(prefix="hvd-lm-elastic-") as tmp:
        job = ElasticJob(Path(tmp), [f"{names[0]}:1", f"{names[1]}:1"], [
            "--shards", cfg.shards, "--hidden-size", cfg.hidden_size, "--batch-size",
            cfg.batch_size, "--seq-len", cfg.seq_len, "--max-steps", cfg.steps, "--log-every",
            1, "--threads", cfg.threads, "--device", "cpu", "--commit-every", cfg.commit_every,
            "--eval-chars", 20000])
        try:
            job.wait_for(lambda: job.trained(cfg.kill_at), f"{cfg.kill_at} steps", cfg.timeout)
            killed = job.kill_worker(names[1])
            job.wait_for(lambda: job.records("resize"), "the resize", cfg.timeout)
            resize = job.records("resize")[0]
            job.wait_for(lambda: any(r["time"] > resize["time"] for r in job.records("train")),
                         "a step after the resize", cfg.timeout)
        finally:
            out = job.finish(cfg.timeout)
        recs = job.records()
    if job.proc.returncode != 0:
        raise RuntimeError(f"the elastic job failed ({job.proc.returncode}):\n{out[-3000:]}")
    train = [r for r in recs if r["kind"] == "train"]
    commits = [r["seconds"] for r in recs if r["kind"] == "commit"]
    before = [r["step_time"] for r in train if r["world_size"] == 2 and r["time"] < killed]
    step_s = statistics.median(before[2:] or before)
    commit_s = statistics.median(commits)
    first_after = next(r for r in train if r["time"] > resize["time"])
    # Steps keep coming while the worker is looked up, and the survivor can still finish a step
    # (and commit) whose allreduce the killed worker had joined: the rollback is measured from
    # the last step the two-rank world completed, not from a poll before the kill.
    last = max(r["step"] for r in train if r["world_size"] == 2)
    res = {"commit_s": commit_s, "commits": len(commits), "step_s": step_s,
           "commit_every": cfg.commit_every,
           "commit_share_of_step_time": commit_s / (cfg.commit_every * step_s),
           "last_step_before_kill": last, "resumed_from_step": resize["step"],
           "steps_lost": last - resize["step"],
           "kill_to_first_step_s": first_after["time"] - killed,
           "world_sizes": sorted({r["world_size"] for r in train}),
           "final_step": max(r["step"] for r in train)}
    print(f"elastic job: H={cfg.hidden_size}, per-rank batch {cfg.batch_size} x {cfg.seq_len}, "
          f"2 ranks -> 1 after a SIGKILL (last 2-rank step {last})")
    print(f"commit: {commit_s * 1e3:.1f} ms (median of {len(commits)}), step {step_s * 1e3:.1f} ms:"
          f" {res['commit_share_of_step_time']:.2%} of step time at --commit-every "
          f"{cfg.commit_every}")
    print(f"lost worker: {res['steps_lost']} step(s) rolled back (resumed from the commit at step "
          f"{resize['step']}), {res['kill_to_first_step_s']:.1f} s from the kill to the next step")
    save_json(cfg.json, res | {"records": recs}, indent=1)
    return 0


BENCH_ELASTIC = Command(BenchElasticConfig, bench_elastic, description=__doc__.split("\n\n")[1])
