"""The control plane of a 128-GPU job rehearsed on CPU ranks: what each rank pays as the world
grows, under each launcher, and a model of 128 and 1,024 ranks (issue #61).

For each launcher (the templates ``launch/horovodrun_local.sh`` with Gloo, ``launch/mpirun.sh``,
``launch/torchrun.sh`` on the torch engine) and each world size N (CPU ranks of one thread on
this machine, oversubscribed), two launches of a tiny run (H=16, B=2, T=16, synthetic text
prepared by ``python -m data_prep prepare``):

* **stop**: trains with a checkpoint every 10 steps; SIGTERM to the template after step 15. It
  gives the startup (s from the launch to the ``start`` record), the median step (s), the peak
  RSS of each rank (MB, psutil every 0.5 s: the median and the largest over the ranks), the
  checkpoint's bytes (the file, and the recurrent rows' part: 2 x N x B x H x 4), the lines the
  launch printed before its first step and after the signal, and whether rank 0 confirmed the
  checkpoint.
* **kill**: rank N-1 SIGKILLed after step 5 (N > 1): whether the closing block's cause names that
  rank and no other, and the lines printed after the kill.

The bytes a resume reads on a rank but 0 (:class:`hvd_lm.train.resume.Resume` with
``root=False``: it maps the file and touches its own rows, the RNG and the counters) are replayed
in this process on the N-rank run's checkpoint and on one of H=1024 (one step of one rank),
measured as the file pages it mapped (``/proc/self/smaps``: the mapping's Rss, in 4 KiB pages
with the kernel's fault-around), against the whole file rank 0 reads.

The model (:func:`model`) states what scales with the world size, per rank, before this issue
and now, at 128 and 1,024 ranks of 8 per host, the 4096-d model (B=32): checkpoint bytes sent
and received, the file, bytes read on resume, probe connections per failure, lines per stop.

Run from a checkout (``make setup`` first)::

    python -m benchmarks.control_plane --ranks 1,4,16,32 --json docs/results/control_plane.json

It needs about 0.4 GB of memory per rank (32 ranks: 13 GB) and, on 2 cores, about 25 minutes
for the default sizes. The table it prints is docs/launch.md's "The control plane at scale".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.harness import run_records, save_json
from hvd_lm.jobs.job_scripts import local_mpi_env

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = {  # template, its ranks variable, extra knobs
    "horovodrun": ("horovodrun_local.sh", "NP", {"CONTROLLER": "gloo"}),
    "mpirun": ("mpirun.sh", "NP", {"MPIRUN_ARGS": "--oversubscribe"}),
    "torchrun": ("torchrun.sh", "NPROC_PER_NODE", {"ENGINE": "torch"}),
}
H, B, T = 16, 2, 16
TINY = f"--hidden-size {H} --embed-dim 8 --seq-len {T} --batch-size {B} --threads 1 --device cpu"


def corpus(folder: Path) -> Path:
    """Shards of 2,000 synthetic reviews (~250 KB, seeded), through ``data_prep prepare``."""
    rng = np.random.default_rng(0)
    words = "the a great album song sound bad good love music track voice band really".split()
    text = folder / "reviews.txt"
    text.write_text("".join(" ".join(rng.choice(words, size=rng.integers(10, 40))) + "\n"
                            for _ in range(2000)))
    subprocess.run([sys.executable, "-m", "data_prep", "prepare", str(text), "--out",
                    str(folder / "shards"), "--format", "text", "--no-progress"], check=True,
                   cwd=REPO, capture_output=True)
    return folder / "shards"


class Launch:
    """One template launch: its output lines with their times (monotonic s), the peak RSS of
    each rank (bytes), and the records of its run folder."""

    def __init__(self, launcher: str, n: int, shards: Path, out: Path):
        template, ranks, knobs = LAUNCHERS[launcher]
        self.out, self.lines, self.rss = out, [], {}
        env = local_mpi_env(**{ranks: str(n)}, **knobs, OUT_DIR=str(out), PREFLIGHT="0",
                            HVD_LM_STEP_SLEEP="0.05",
                            TRAIN_ARGS=f"--shards {shards} {TINY} --max-steps 100000 "
                                       "--checkpoint-every 10 --eval-chars 2000")
        self.t0 = time.time()  # (the records' clock)
        self.proc = subprocess.Popen(["bash", str(REPO / "launch" / template)], env=env,
                                     cwd=out.parent, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def ranks(self) -> dict[int, psutil.Process]:
        """The training processes by rank (their environment says it)."""
        out = {}
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                env, cmd = p.environ(), " ".join(p.cmdline())
            except psutil.Error:
                continue
            rank = env.get("OMPI_COMM_WORLD_RANK") or env.get("HOROVOD_RANK") or env.get("RANK")
            if "hvd_lm" in cmd and " train " in f" {cmd} " and rank is not None:
                out[int(rank)] = p
        return out

    def records(self, kind: str) -> list[dict]:
        return run_records(self.out, kind)

    def wait_steps(self, steps: int, timeout: float) -> None:
        """Until ``steps`` train records are logged, sampling every rank's RSS; the launch
        killed when they are not (or on any error here)."""
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end and self.proc.poll() is None:
                for rank, p in self.ranks().items():
                    with contextlib.suppress(psutil.Error):
                        self.rss[rank] = max(self.rss.get(rank, 0), p.memory_info().rss)
                if len(self.records("train")) >= steps:
                    return
                time.sleep(0.5)
            raise RuntimeError(f"no step {steps} within {timeout:.0f} s: "
                               + " | ".join(x for _, x in self.lines[-5:]))
        except BaseException:
            self.kill()
            raise

    def finish(self, timeout: float) -> int:
        """The launch's exit status; whatever is left of it killed (its process group)."""
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the launch and every process under it (its ranks may sit in sessions
        of their own: horovodrun starts each through a shell of its own)."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def after(self, t: float) -> list[str]:
        return [x for s, x in self.lines if s >= t]


def stop_run(launcher: str, n: int, shards: Path, folder: Path, timeout: float) -> dict:
    """The stop launch's figures (module docstring)."""
    run = Launch(launcher, n, shards, folder / f"{launcher}-{n}-stop")
    run.wait_steps(15, timeout)
    start, = run.records("start")
    first = min(s for s, x in run.lines if "[train] " in x)
    signalled = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc = run.finish(timeout)
    ckpt = sorted((run.out / "checkpoints").glob("step_*.pt"))[-1]
    rss = sorted(run.rss.values())
    return {"launcher": launcher, "ranks": n, "rc": rc,
            "startup_s": start["time"] - run.t0,
            "step_s": statistics.median(r["step_time"] for r in run.records("train")),
            "rss_mb_median": rss[len(rss) // 2] / 2**20, "rss_mb_max": rss[-1] / 2**20,
            "checkpoint_bytes": ckpt.stat().st_size, "rows_bytes": 2 * n * B * H * 4,
            "lines_before_first_step": sum(1 for s, _ in run.lines if s < first),
            "lines_after_stop": len(run.after(signalled)),
            "hvd_lm_lines_after_stop": sum(_ours(x) for x in run.after(signalled)),
            "acknowledged": sum("received:" in x for x in run.after(signalled)),
            "confirmed": any("stopped on a signal: every rank checkpointed" in x
                             for x in run.after(signalled)),
            "checkpoint": str(ckpt)}


def kill_run(launcher: str, n: int, shards: Path, folder: Path, timeout: float) -> dict:
    """The kill launch's figures (module docstring)."""
    run = Launch(launcher, n, shards, folder / f"{launcher}-{n}-kill")
    run.wait_steps(5, timeout)
    victim = run.ranks()[n - 1]
    killed = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    rc = run.finish(timeout)
    cause = next((x for x in reversed(run.after(killed)) if x.startswith("cause: ")), "")
    named = {int(r) for r in re.findall(r"ranks? ([\d,]+)", cause) for r in r.split(",") if r}
    return {"launcher": launcher, "ranks": n, "rc": rc, "cause": cause,
            "names_the_killed_rank_alone": named == {n - 1},
            "lines_after_kill": len(run.after(killed)),
            "hvd_lm_lines_after_kill": sum(_ours(x) for x in run.after(killed))}


def _ours(line: str) -> bool:
    """A line hvd-lm printed (a rank's ``hvd-lm train:`` or ``[kind]`` record line, the
    template's own), not the launcher's (torchrun's per-rank closing signals and failures block,
    horovodrun's per-rank exit status, tracebacks)."""
    return bool(re.match(r"(\[[\d,]+\]<std(out|err)>:)?(hvd-lm |\[\w+\] |==== hvd-lm|where: |"
                         r"newest complete|resume: |cause: |\d{4}-\d\d-\d\d \S+ launch:)", line))


def resume_reads(path: Path, ranks: int, batch: int = B) -> dict:
    """What the last rank of ``ranks`` reads of checkpoint ``path`` on resume, replayed in this
    process (module docstring): bytes of the file it mapped, against the file's size."""
    from hvd_lm.train.resume import Resume

    resume = Resume(path, root=False)
    resume.rnn_rows(ranks - 1, ranks, batch)  # its own B rows
    _ = resume.position, resume.windows_per_epoch, resume.lr_factor()
    resume.restore_rng()
    mapped, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                mapped += int(line.split()[1]) * 1024
    return {"file_bytes": path.stat().st_size, "read_bytes": mapped}


def big_checkpoint(folder: Path, shards: Path) -> Path:
    """One step of one rank at H=1024 (B=2): a checkpoint whose rows are a sliver of it."""
    out = folder / "h1024"
    subprocess.run([sys.executable, "-m", "hvd_lm", "train", "--shards", str(shards),
                    "--out-dir", str(out), "--hidden-size", "1024", "--seq-len", "16",
                    "--batch-size", "2", "--max-steps", "1", "--threads", "2", "--device", "cpu",
                    "--eval-chars", "2000"], check=True, cwd=REPO, capture_output=True)
    return sorted((out / "checkpoints").glob("step_*.pt"))[-1]


def model(ranks: int, per_host: int = 8, hidden: int = 4096, batch: int = 32,
          params: int = 86_000_000, optimizer_states: int = 2) -> dict:
    """What scales with the world size, per rank, before #61 and now (bytes, connections,
    lines), for ``ranks`` ranks of ``per_host`` per host, the recurrent rows of
    ``hidden`` x ``batch`` and a model of ``params`` fp32 parameters with Adam's 2 states.
    Before: the rows allgathered to every rank, the 1-bit optimizers' error buffers
    (4 bytes x params per rank) gathered into the file, every rank reading the whole file, every
    survivor probing every peer, every rank acknowledging a signal."""
    rows = 2 * batch * hidden * 4  # one rank's (h, c), fp32
    base = 4 * params * (1 + optimizer_states)
    hosts = -(-ranks // per_host)
    return {
        "ranks": ranks, "hosts": hosts,
        "received_per_rank_before": ranks * rows, "received_rank0_now": ranks * rows,
        "received_other_rank_now": 0, "sent_per_rank": rows,
        "file_bytes_now": base + ranks * rows,
        "file_bytes_before_onebit": base + ranks * rows + (ranks + 1) * 4 * params,
        "resume_read_per_rank_before": base + ranks * rows,
        "resume_read_other_rank_now": rows,  # + the RNG and counters: kilobytes
        "probe_connections_before": (ranks - 1) * ranks,
        "probe_connections_now": 2 * ranks - hosts,
        "probes_per_prober_now": 2 * per_host - 1 if hosts > 1 else per_host - 1,
        "stop_lines_before": ranks + 1, "stop_lines_now": hosts + 1,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.control_plane",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,4,16,32", help="world sizes, comma-separated")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS),
                    help="comma-separated: " + ", ".join(LAUNCHERS))
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch phase")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.ranks.split(",")]
    rows = {"stop": [], "kill": [], "resume": [], "model": [model(128), model(1024)]}
    with tempfile.TemporaryDirectory(prefix="hvd-lm-control-plane.") as tmp:
        folder = Path(tmp)
        shards = corpus(folder)
        for launcher in args.launchers.split(","):
            for n in sizes:
                s = stop_run(launcher, n, shards, folder, args.timeout)
                rows["stop"].append(s)
                rows["resume"].append({"launcher": launcher, "ranks": n,
                                       **resume_reads(Path(s.pop("checkpoint")), n)})
                if n > 1:
                    rows["kill"].append(kill_run(launcher, n, shards, folder, args.timeout))
                print(json.dumps(rows["stop"][-1]), flush=True)
        rows["resume_h1024"] = resume_reads(big_checkpoint(folder, shards), 1)
    print(table(rows))
    save_json(args.json, rows, indent=1)
    return 0


def table(rows: dict) -> str:
    """The figures as docs/launch.md's markdown tables."""
    kill = {(k["launcher"], k["ranks"]): k for k in rows["kill"]}
    read = {(r["launcher"], r["ranks"]): r for r in rows["resume"]}
    out = ["| launcher | N | startup s | s/step | RSS/rank MB (median, max) | checkpoint B "
           "(rows) | resume read B, rank > 0 | lines: start, after stop ([hvd-lm's;] acks) | "
           "killed rank named alone | lines after kill [(hvd-lm's)] |", "|" + "---|" * 10]
    for s in rows["stop"]:
        k, r = kill.get((s["launcher"], s["ranks"]), {}), read[(s["launcher"], s["ranks"])]
        out.append(
            f"| {s['launcher']} | {s['ranks']} | {s['startup_s']:.1f} | {s['step_s']:.3f} | "
            f"{s['rss_mb_median']:.0f}, {s['rss_mb_max']:.0f} | {s['checkpoint_bytes']:,} "
            f"({s['rows_bytes']:,}) | {r['read_bytes']:,} of {r['file_bytes']:,} | "
            f"{s['lines_before_first_step']}, {s['lines_after_stop']} ("
            + (f"{s['hvd_lm_lines_after_stop']}; " if "hvd_lm_lines_after_stop" in s else "")
            + f"{s['acknowledged']}) | {k.get('names_the_killed_rank_alone', '-')} | "
            f"{k.get('lines_after_kill', '-')}"
            + (f" ({k['hvd_lm_lines_after_kill']})" if "hvd_lm_lines_after_kill" in k else "")
            + " |")
    big = rows.get("resume_h1024")
    if big:
        out.append(f"\nH=1024 checkpoint: a rank but 0 reads {big['read_bytes']:,} of its "
                   f"{big['file_bytes']:,} bytes on resume.")
    out += ["", "| model, 8 ranks/host, 4096-d, B=32 | 128 ranks | 1,024 ranks |",
            "|---|---|---|"]
    m128, m1024 = rows["model"]
    for key in ("received_per_rank_before", "received_other_rank_now", "received_rank0_now",
                "file_bytes_before_onebit", "file_bytes_now", "resume_read_per_rank_before",
                "resume_read_other_rank_now", "probe_connections_before",
                "probe_connections_now", "probes_per_prober_now", "stop_lines_before",
                "stop_lines_now"):
        out.append(f"| {key} | {m128[key]:,} | {m1024[key]:,} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
