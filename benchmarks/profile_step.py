"""One ``torch.profiler`` window of a training step: where a step's device time goes.

``python -m benchmarks gpu --profile-steps N`` profiles the fastest mLSTM variant it measured for N
steps (after its warmup) and reports, from the device's own activity records (CUPTI, through
PyTorch's Kineto profiler: "torch.profiler" in the PyTorch docs):

- the top kernels by total device time (name, launches, microseconds, share of the busy time);
- the **gaps**: the window from the first kernel's start to the last kernel's end, the time in
  it when no kernel ran (idle), and the gaps between consecutive kernels by size. A recurrence
  of small per-step kernels that the CPU cannot launch fast enough shows as many small gaps
  and a large idle fraction; CUDA graphs close those.

On the CPU (tests, ``--device cpu``) the same figures are taken from the top-level CPU
operators instead of kernels.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

import torch
from torch.autograd import DeviceType

#: gap sizes counted separately, microseconds
GAP_EDGES_US = (5.0, 50.0, 500.0)

#: CPU operators that launch no kernel: allocation, views and metadata, host reads, and the
#: composite operators whose work is all in the operators they call (counted there).
NO_KERNEL = frozenset("aten::" + n for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "as_strided",
    "view", "_unsafe_view", "view_as", "reshape", "_reshape_alias", "flatten", "t", "transpose",
    "permute", "select", "slice", "unbind", "split", "split_with_sizes", "chunk", "narrow",
    "expand", "expand_as", "squeeze", "unsqueeze", "detach", "detach_", "alias", "resolve_conj",
    "resolve_neg", "resize_", "lift_fresh", "contiguous", "to", "_to_copy", "clone", "item",
    "is_nonzero", "_local_scalar_dense", "set_", "zeros", "zeros_like", "ones", "ones_like",
    "full", "full_like", "linear", "matmul", "numpy_T", "result_type", "is_same_size"))
#: operators that launch their own kernel besides any they call (a GEMM that first copies its
#: additive input into its output: ``addmm`` with ``out`` not ``self``)
OWN_KERNEL = frozenset("aten::" + n for n in (
    "mm", "addmm", "addmm_", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot"))


def gap_stats(intervals: Iterable[tuple[float, float]]) -> dict:
    """Busy and idle time of a set of (start, end) intervals, microseconds.

    Args:
        intervals: (start_us, end_us) of each kernel; may overlap (concurrent streams) and
            come in any order.

    Returns:
        ``window_us`` (first start to last end), ``busy_us`` (the union of the intervals),
        ``idle_us`` and ``idle_fraction``, ``gaps`` (the number of idle stretches between
        intervals), ``largest_gap_us`` and ``gaps_over_us`` ({edge: count of gaps longer than
        edge} for each of :data:`GAP_EDGES_US`). All zero for no intervals.
    """
    spans = sorted((float(s), float(e)) for s, e in intervals) or [(0.0, 0.0)]
    gaps: list[float] = []
    end = spans[0][1]  # the end of the busy stretch so far
    for s, e in spans[1:]:
        if s > end:  # an idle stretch before this interval
            gaps.append(s - end)
        end = max(end, e)
    window, idle = end - spans[0][0], sum(gaps, 0.0)
    return {"window_us": window, "busy_us": window - idle, "idle_us": idle,
            "idle_fraction": idle / window if window > 0 else 0.0, "gaps": len(gaps),
            "largest_gap_us": max(gaps, default=0.0),
            "gaps_over_us": {str(edge): sum(g > edge for g in gaps) for edge in GAP_EDGES_US}}


def top_kernels(events: Iterable[tuple[str, float]], top: int = 20) -> list[dict]:
    """The ``top`` names by total time.

    Args:
        events: (name, duration_us) of each kernel launch.

    Returns:
        rows of ``name``, ``calls``, ``total_us``, ``mean_us`` and ``share`` (of all the events'
        time), largest total first.
    """
    total, calls = defaultdict(float), defaultdict(int)
    for name, us in events:
        total[name] += us
        calls[name] += 1
    whole = sum(total.values()) or 1.0
    rows = sorted(total, key=total.__getitem__, reverse=True)[:top]
    return [{"name": n, "calls": calls[n], "total_us": total[n], "mean_us": total[n] / calls[n],
             "share": total[n] / whole} for n in rows]


def cpu_launches(events: Iterable, scopes: Iterable[str] = ()) -> int:
    """The kernels a set of profiled CPU operators launched: each ``aten::`` operator that does
    work itself and is not in :data:`NO_KERNEL`, counted where the work is (an operator whose
    callees launch kernels is not counted again, unless it is a GEMM, :data:`OWN_KERNEL`); a
    ``record_function`` scope named in ``scopes`` counts as one kernel whatever it runs (a cell
    kernel that is one Triton kernel on a GPU).

    Args:
        events: the profiler's CPU events (``prof.events()``); only the top-level ones are
            walked (their ``cpu_children``).
    """
    scopes = frozenset(scopes)

    def count(e) -> int:
        if e.name in scopes:
            return 1
        below = sum(count(c) for c in e.cpu_children)
        own = e.name.startswith("aten::") and e.name not in NO_KERNEL and (
            below == 0 or e.name in OWN_KERNEL)
        return below + own

    return sum(count(e) for e in events
               if e.device_type == DeviceType.CPU and e.cpu_parent is None)


def count_launches(fn: Callable[[], object], device: torch.device,
                   scopes: Iterable[str] = ()) -> int:
    """Kernels ``fn()`` launches, from one ``torch.profiler`` run of it: on CUDA the device's
    kernels, copies and memsets (CUPTI's records), elsewhere :func:`cpu_launches` (``scopes``
    as there)."""
    prof = _profiled(fn, device, 1)
    if device.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    return cpu_launches(prof.events(), scopes)


def _profiled(fn: Callable[[], object], device: torch.device, n: int):
    """The ``torch.profiler`` of ``n`` calls of ``fn()``: CPU operators, and on CUDA the
    device's work, synchronized before and after."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return prof


def profile_window(step: Callable[[], object], device: torch.device, steps: int = 3,
                   top: int = 20) -> dict:
    """Run ``step()`` ``steps`` times under ``torch.profiler`` and summarise the device's work.

    Args:
        step: one training step (already warmed up: compiled kernels, captured graphs).
        device: the step's device; on CUDA the kernels are read, elsewhere the top-level CPU
            operators.

    Returns:
        ``source`` ("cuda kernels" or "cpu operators"), ``steps``, ``events`` (their number),
        ``top`` (:func:`top_kernels`) and ``gaps`` (:func:`gap_stats`).
    """
    prof = _profiled(step, device, steps)
    if device.type == "cuda":
        evs = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        source = "cuda kernels"
    else:
        evs = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.cpu_parent is None
               and not e.name.startswith("ProfilerStep")]
        source = "cpu operators"
    spans = [(e.time_range.start, e.time_range.end) for e in evs]
    return {"source": source, "steps": steps, "events": len(evs),
            "top": top_kernels(((e.name, e.time_range.elapsed_us()) for e in evs), top),
            "gaps": gap_stats(spans)}


def print_profile(p: dict, label: str) -> None:
    """The profile as a table on stdout."""
    g = p["gaps"]
    print(f"\nprofile of {label}: {p['steps']} steps, {p['events']} {p['source']}; window "
          f"{g['window_us'] / 1e3:.1f} ms, busy {g['busy_us'] / 1e3:.1f} ms, idle "
          f"{g['idle_fraction']:.1%} in {g['gaps']} gaps (largest {g['largest_gap_us']:.0f} us; "
          + ", ".join(f"{n} over {e} us" for e, n in g["gaps_over_us"].items()) + ")")
    print(f"{'share':>6} {'total ms':>9} {'calls':>7} {'mean us':>8}  name")
    for r in p["top"]:
        print(f"{r['share']:>6.1%} {r['total_us'] / 1e3:>9.2f} {r['calls']:>7} "
              f"{r['mean_us']:>8.1f}  {r['name'][:90]}")
