"""The report of ``python -m benchmarks allreduce``: time,
bus bandwidth and ratio-to-MPI tables per size, the alpha-beta fits, and the bytes on the wire
per configuration (:func:`wire_summary`), printed from the records
:mod:`benchmarks.results` owns.
"""

from __future__ import annotations

from benchmarks.harness import print_table
from benchmarks.results import busbw_factor
from hvd_lm.util.units import KIB, MIB


def _table(records: list[dict], fmt, title: str) -> None:
    single = [r for r in records if r["case"] == "single"]
    labels = list(dict.fromkeys(r["label"] for r in single))
    sizes = sorted({r["size_bytes"] for r in single})
    cell = {(r["label"], r["size_bytes"]): r for r in single}
    w = max(12, *(len(lb) for lb in labels)) + 1
    print(f"\n{title}")
    print(f"{'size':>6} " + "".join(f"{lb:>{w}}" for lb in labels))
    for s in sizes:
        row = "".join(f"{fmt(cell[(lb, s)]) if (lb, s) in cell else '-':>{w}}" for lb in labels)
        print(f"{human_bytes(s):>6} {row}")


def print_report(data: dict) -> None:
    """The tables of a ``bench allreduce`` result (``data`` as written by ``--json``)."""
    recs, n = data["records"], data["ranks"]
    _table(recs, lambda r: f"{r['time_s'] * 1e6:.0f}",
           f"single tensor, {n} ranks: time per allreduce, us (mean, max over ranks)")
    _table(recs, lambda r: f"{r['busbw_GBps']:.2f}",
           f"single tensor: bus bandwidth, GB/s (algbw x 2(n-1)/n = x {busbw_factor(n):.2f})")
    ref = {r["size_bytes"]: r for r in recs if r["case"] == "single" and r["label"] == "mpi4py"}
    if ref:
        _table([r | {"ratio": r["time_s"] / ref[r["size_bytes"]]["time_s"]} for r in recs
                if r["case"] == "single" and r["size_bytes"] in ref],
               lambda r: f"{r['ratio']:.2f}", "time / raw MPI (mpi4py) time, per size")
    if data.get("fits"):
        print("\nalpha-beta fit, t = 2(n-1) alpha + 2(n-1)/n S / beta (weighted least squares):")
        print_table([f | {"label": label} for label, f in data["fits"].items()], [
            ("configuration", "34", "label"),
            ("a=t(0), us", ">11.1f", lambda f: f["intercept_s"] * 1e6),
            ("alpha, us", ">10.1f", lambda f: f["alpha_s"] * 1e6),
            ("beta, GB/s", ">11.2f", "beta_GBps"), ("max rel err", ">11.1%", "max_rel_error")])
    _wire_table(recs)
    grouped = [r for r in recs if r["case"] == "grouped"]
    if grouped:
        print("\ngrouped gradients per step (Horovod: allreduce_async_ + synchronize, op Average)")
        print_table(grouped, [
            ("group", "22", "group"), ("configuration", "34", "label"), ("mode", "6", "mode"),
            ("tensors", ">7", "tensors"), ("MB", ">7.2f", lambda r: r["size_bytes"] / 1e6),
            ("ms/step", ">9.3f", lambda r: r["time_s"] * 1e3),
            ("busbw GB/s", ">10.2f", "busbw_GBps")])


def wire_summary(records: list[dict]) -> list[dict]:
    """Per controller and single size / group: bytes on the wire per rank for none, fp16 and
    onebit (computed and measured) and the ratios none / onebit and fp16 / onebit."""
    rows: dict[tuple, dict] = {}
    for r in records:
        if r.get("wire_bytes") is None or r.get("backend") != "horovod" or " " in r["label"]:
            continue  # fusion / cycle-time variants repeat their defaults' bytes
        key = (r["label"].split("+")[0], r["case"], r.get("group") or r["size_bytes"])
        row = rows.setdefault(key, {"controller": key[0], "case": r["case"], "what": key[2]})
        row[r["compression"]] = r["wire_bytes"]
        row[r["compression"] + "_measured"] = r.get("wire_bytes_measured")
    for row in rows.values():
        if row.get("onebit"):
            for comp in ("none", "fp16"):
                for suffix in ("", "_measured"):
                    a, b = row.get(comp + suffix), row.get("onebit" + suffix)
                    if a and b:
                        row[f"{comp}_over_onebit{suffix}"] = a / b
    return list(rows.values())


def _wire_table(records: list[dict]) -> None:
    rows = wire_summary(records)
    if not any("onebit" in r for r in rows):
        return
    print("\nbytes on the wire per operation and rank (computed from the buffers; measured: "
          "/proc/self/io wchar, Gloo controller)")
    print_table(rows, [
        ("controller", "10", "controller"),
        ("size/group", ">17", lambda r: r["what"] if isinstance(r["what"], str)
         else human_bytes(r["what"])),
        *((c, f">{w}", lambda r, c=c: r.get(c, 0)) for c, w in
          (("none", 11), ("fp16", 11), ("onebit", 10))),
        ("none/1bit", ">9.1f", lambda r: r.get("none_over_onebit", 0)),
        ("fp16/1bit", ">9.1f", lambda r: r.get("fp16_over_onebit", 0)),
        ("measured none/fp16/onebit", ">32", lambda r: "/".join(
            f"{r[c + '_measured']:.0f}" if r.get(c + "_measured") else "-"
            for c in ("none", "fp16", "onebit"))),
        ("ratios", ">12", lambda r: "/".join(f"{r[c]:.1f}" for c in (
            "none_over_onebit_measured", "fp16_over_onebit_measured") if c in r))])


def human_bytes(n: float) -> str:
    """4096 -> ``"4K"``, 268435456 -> ``"256M"`` (binary prefixes, as the sizes are given)."""
    for unit, div in (("G", 1024 ** 3), ("M", MIB), ("K", KIB)):
        if n >= div and n % div == 0:
            return f"{n // div:d}{unit}"
    return f"{n:.0f}"
