"""Merge what the stages of ``scripts/gpu_check.sh`` left in OUT into OUT/summary.json and
OUT/summary.md, and exit 1 when a recorded stage failed (standard library only: it also runs
when setup failed and there is no venv).

    python scripts/gpu_check_summary.py OUT

Reads: ``<stage>.json`` (exit status, seconds) for setup, cuda, bench, suite; the parts of the
pytest stages, ``cuda-<k>.xml`` and ``suite-<k>.xml`` (pytest's JUnit reports: counts and the
failed tests) with ``<stage>-<k>.budget.json`` (tests/_budget.py: how many were left for the
next part); ``bench_gpu.json`` (``python -m benchmarks gpu``). Stages run in separate invocations
are merged: the newest record of each stage wins, the parts of a pytest stage add up.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STAGES = ("setup", "cuda", "bench", "suite")


def junit(path: Path) -> dict:
    """Counts (tests, failures, errors, skipped, seconds) and the failed test ids of a JUnit
    XML report."""
    root = ET.parse(path).getroot()
    s = root if root.tag == "testsuite" else root.find("testsuite")
    failed = [c.get("classname", "") + "::" + c.get("name", "") for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    out = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**out, "seconds": float(s.get("time", 0)), "failed": failed}


def parts(out: Path, stage: str) -> dict | None:
    """The parts of a pytest stage added up: counts, seconds, failed tests, ``parts``, and
    ``left`` (tests the newest part left for the next; None when it wrote no budget report, i.e.
    it was stopped before its end)."""
    def number(p: Path) -> int:
        return int(p.name[len(stage) + 1:-len(".xml")])

    xmls = sorted((p for p in out.glob(f"{stage}-*.xml")
                   if p.name[len(stage) + 1:-len(".xml")].isdigit()), key=number)
    if not xmls:
        return None
    total: dict = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "seconds": 0.0,
                   "failed": [], "parts": len(xmls)}
    for r in map(junit, xmls):
        for k in ("tests", "failures", "errors", "skipped", "seconds", "failed"):
            total[k] += r[k]
    report = out / f"{stage}-{number(xmls[-1])}.budget.json"
    total["left"] = json.loads(report.read_text())["left"] if report.exists() else None
    return total


def summarize(out: Path) -> dict:
    """The merged summary of the stages recorded in ``out``."""
    summary: dict = {"stages": {stage: json.loads((out / f"{stage}.json").read_text())
                                for stage in STAGES if (out / f"{stage}.json").exists()}}
    for stage in ("cuda", "suite"):
        if stage in summary["stages"] and (r := parts(out, stage)) is not None:
            summary[stage] = r
    bench = out / "bench_gpu.json"
    if "bench" in summary["stages"] and bench.exists():
        summary["bench_gpu"] = json.loads(bench.read_text())
    return summary


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def markdown(summary: dict) -> str:
    """summary.md: the stages, the test counts with the failed tests, the bench tables."""
    md = ["# scripts/gpu_check.sh", "", "| stage | exit status | seconds | finished |",
          "|---|---:|---:|---|"]
    for stage, r in summary["stages"].items():
        md.append(f"| {stage} | {r['exit_status']} | {r['seconds']} | {r['finished']} |")
    md.append("")
    for name in ("cuda", "suite"):
        if name in summary:
            r = summary[name]
            left = ("all tests run" if r["left"] == 0 else
                    f"{r['left']} tests left: run --stage {name} again" if r["left"] else
                    "the last part was stopped at the stage's limit: run --stage "
                    f"{name} again")
            md.append(f"- {name}: {r['tests']} tests in {r['parts']} part(s), "
                      f"{r['failures'] + r['errors']} failed, {r['skipped']} skipped, "
                      f"{r['seconds']:.0f} s; {left}"
                      + "".join(f"\n  - FAILED {x}" for x in r["failed"]))
    b = summary.get("bench_gpu")
    if b:
        md += ["", f"## python -m benchmarks gpu ({b['device']}, torch {b['torch']})", "",
               "| matmul | shape | TFLOP/s |", "|---|---|---:|"]
        md += [f"| {r['precision']} | {'x'.join(map(str, r['shape']))} | "
               f"{_fmt(r.get('tflops'), '.1f', r.get('error', '-'))} |" for r in b["matmul"]]
        copy = _fmt(b.get("copy_GBps"), ".0f", b.get("copy_error") or "-")
        md += ["", f"device-to-device copy: {copy} GB/s", ""]
        if b.get("ceiling"):
            md += ["| GEMM ceiling | B | chars/s | TFLOP/s |", "|---|---:|---:|---:|"]
            md += [f"| {c['precision']} | {c['batch_size']} | {c['chars_per_s']:,.0f} | "
                   f"{c['tflops']:.1f} |" for c in b["ceiling"]]
            md.append("")
        md += ["| cell | impl | B | precision | chars/s | TFLOP/s | of peak | of GEMM ceiling "
               "| peak GiB | estimated GiB | mLSTM/cuDNN per FLOP | vs reference |",
               "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in b["train"]:
            head = f"| {r['cell']} | {r['impl']} | {r['batch_size']} | {r['precision']} |"
            if "error" in r:
                md.append(f"{head} {r['error']} | | | | | | | |")
                continue
            md.append(f"{head} {r['chars_per_s']:,.0f} | {r['tflops']:.1f} | "
                      f"{_fmt(r.get('fraction_of_peak'), '.1%')} | "
                      f"{_fmt(r.get('fraction_of_gemm_ceiling'), '.1%')} | "
                      f"{_fmt(r.get('peak_memory_gib'), '.1f')} | "
                      f"{_fmt(r.get('estimated_memory_gib'), '.1f')} | "
                      f"{_fmt(r.get('vs_cudnn_lstm_per_flop'), '.3f')} | "
                      f"{_fmt(r.get('vs_reference'), '.2f')} |")
    return "\n".join(md) + "\n"


def main(argv: list[str]) -> int:
    """Write OUT/summary.json and OUT/summary.md, print the markdown; 1 when a stage failed."""
    out = Path(argv[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    print(text)
    return int(any(r["exit_status"] != 0 for r in summary["stages"].values()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
