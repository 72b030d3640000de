"""Where the test suite's CPU goes, by process: run pytest with a ``sitecustomize`` that makes
every Python process it starts (tests' commands, launchers' ranks, forks of the warm interpreter
in ``tests/_warm.py``) append a line at exit: its CPU seconds (user + system, ``getrusage``),
whether it imported torch and torch._dynamo, and its command. Then sum them by command.

    python scripts/suite_cpu.py -- -n 2 --dist loadfile -m "not serial" tests/
    python scripts/suite_cpu.py --log /tmp/procs.tsv -- -x tests/test_train.py

Processes that are killed (SIGKILL, ``os._exit``) write no line, nor do programs that are not
Python (``mpirun``, ``sshd``, ``bash``): the total below the table is what Python processes that
ended normally used, and pytest's own processes are among them.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: What each Python process runs at start (via ``sitecustomize``); it logs at exit.
SITECUSTOMIZE = '''\
import atexit, os, resource, sys
def _hvd_lm_suite_cpu():
    try:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        m = sys.modules
        line = "%d\\t%.3f\\t%d\\t%d\\t%s\\n" % (os.getpid(), ru.ru_utime + ru.ru_stime,
            "torch" in m, "torch._dynamo" in m, " ".join(sys.argv)[:300].replace("\\t", " "))
        with open(os.environ["HVD_LM_SUITE_CPU_LOG"], "a") as f:
            f.write(line)
    except Exception:
        pass
if os.environ.get("HVD_LM_SUITE_CPU_LOG"):
    atexit.register(_hvd_lm_suite_cpu)
'''


def command_of(argv: str) -> str:
    """A process's command as a table key: ``hvd_lm train``, ``pytest``, ``horovodrun``..."""
    words = argv.split()
    if not words:
        return "(python)"
    name = Path(words[0]).name
    if name in ("hvd-lm", "__main__.py") and len(words) > 1:
        parent = Path(words[0]).parent.name
        module = "hvd_lm" if name == "hvd-lm" or parent == "hvd_lm" else parent
        return f"{module} {words[1]}"
    return name


def summarise(log: Path) -> str:
    """The table: processes, CPU seconds and how many imported torch / torch._dynamo, per
    command, heaviest first."""
    rows = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    torn = 0
    for line in log.read_text(errors="replace").splitlines():
        fields = line.split("\t")
        try:  # processes ending at once may interleave their appends: such a line is skipped
            cpu, torch, dynamo, argv = float(fields[1]), int(fields[2]), int(fields[3]), fields[4]
        except (IndexError, ValueError):
            torn += 1
            continue
        r = rows[command_of(argv)]
        for i, x in enumerate((1, cpu, torch, dynamo)):
            r[i] += x
    out = [f"{'processes':>9} {'CPU s':>8} {'torch':>6} {'dynamo':>6}  command"]
    out += [f"{n:9d} {cpu:8.1f} {t:6d} {d:6d}  {cmd}"
            for cmd, (n, cpu, t, d) in sorted(rows.items(), key=lambda kv: -kv[1][1])]
    total = [sum(r[i] for r in rows.values()) for i in range(4)]
    out.append(f"{total[0]:9d} {total[1]:8.1f} {total[2]:6d} {total[3]:6d}  (all Python "
               "processes that ended normally)" + (f"; {torn} torn line(s) skipped" if torn
                                                    else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", type=Path, help="keep the per-process lines here (default: a "
                    "temporary file)")
    ap.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        log = args.log or Path(tmp) / "procs.tsv"
        log.write_text("")
        env = dict(os.environ, HVD_LM_SUITE_CPU_LOG=str(log.resolve()),
                   PYTHONPATH=os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])))
        rc = subprocess.call([sys.executable, "-m", "pytest", *args.pytest_args], env=env)
        print(summarise(log))
    return rc


if __name__ == "__main__":
    sys.exit(main())
