"""A pytest plugin for runs that must end in time (``scripts/gpu_check.sh`` on a GPU node lent
for 10 minutes a call): a suite cut into parts that each fit, each part going on where the last
stopped.

* ``--time-budget S``: once S seconds have passed since the session started, no further test
  starts (the one running finishes); the rest are left for the next part, not reported as run.
  At least one test runs per part, so repeated parts always progress.
* ``--done-file FILE``: tests listed in FILE (node ids, one a line) are deselected, and every
  test that finishes is appended (so the next part skips it).
* ``--budget-report FILE``: JSON ``{"ran", "left", "budget_s", "seconds"}`` at the end.
* ``--run-first TEXT``: the tests whose node id contains TEXT run first, in their order (what a
  part must not lose to its budget: the GPU session's cpu -> cuda resume test).

A part that leaves nothing to run (every test in the done file) exits 0.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("budget", "time-budgeted parts of a suite (scripts/gpu_check.sh)")
    group.addoption("--time-budget", type=float, default=None, metavar="S",
                    help="start no test after S seconds; the rest are left for the next part")
    group.addoption("--done-file", default=None, metavar="FILE",
                    help="skip the tests listed in FILE; append each test that finishes")
    group.addoption("--budget-report", default=None, metavar="FILE",
                    help="write {ran, left, budget_s, seconds} as JSON at the end")
    group.addoption("--run-first", default=None, metavar="TEXT",
                    help="run the tests whose node id contains TEXT before the others")


class _Budget:
    def __init__(self, config):
        self.budget = config.getoption("--time-budget")
        done = config.getoption("--done-file")
        self.done_file = Path(done) if done else None
        report = config.getoption("--budget-report")
        self.report = Path(report) if report else None
        self.t0 = time.monotonic()
        self.ran = self.left = self.already = 0

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        first = config.getoption("--run-first")
        if first:  # a stable sort: those first, each group in collection order
            items.sort(key=lambda i: first not in i.nodeid)
        if self.done_file is None or not self.done_file.exists():
            return
        done = set(self.done_file.read_text().split("\n"))
        skip = [i for i in items if i.nodeid in done]
        if skip:
            self.already = len(skip)
            items[:] = [i for i in items if i.nodeid not in done]
            config.hook.pytest_deselected(items=skip)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        over = self.budget is not None and time.monotonic() - self.t0 > self.budget
        if over and self.ran > 0:
            self.left += 1
            return True  # not run, not reported: the next part runs it
        return None

    def pytest_runtest_logfinish(self, nodeid, location):
        self.ran += 1
        if self.done_file is not None:
            with open(self.done_file, "a") as f:
                f.write(nodeid + "\n")

    def pytest_sessionfinish(self, session, exitstatus):
        if self.report is not None:
            self.report.write_text(json.dumps(
                {"ran": self.ran, "left": self.left, "already_done": self.already,
                 "budget_s": self.budget, "seconds": round(time.monotonic() - self.t0, 1)})
                + "\n")
        if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and self.already:
            session.exitstatus = pytest.ExitCode.OK  # everything was done by earlier parts


def pytest_configure(config):
    if any(config.getoption(o) is not None
           for o in ("--time-budget", "--done-file", "--budget-report", "--run-first")):
        config.pluginmanager.register(_Budget(config), "hvd_lm_budget")
