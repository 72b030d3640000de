"""The figure registry and the marker rule (tests/test_figures.py checks them): every figure
README.md, CONTRIBUTING.md and the docs pages quote from a measurement or a model is read back
from where it came from, by a marker beside it, never by the sentence around it.

**The figures.** Measurements live in ``docs/results/`` (committed copies of what the commands
wrote: the demo's ``summary.json``, bench JSONs, metrics logs, each GPU call's files); the
scaling model's figures are recomputed from the shipped calibration
(``docs/results/allreduce_calibration.json``). :data:`GROUPS` is the registry: each function
decorated with :func:`figures` reads one source and returns its figures by name, each formatted
the way the pages print it (``f"{x:.3f}"``, ``f"{x:,.0f}"``, ``f"{x:.1%}"``, minutes from
seconds, ratios, medians over a run). What a source must satisfy beyond its figures (validation
BPC falling at every evaluation, the scaling rows that change < 1%, ...) is asserted in the same
function, so it fails when the source does.

**The marker.** In a page, a quoted figure is followed at once by an HTML comment naming it,
invisible once rendered::

    validation BPC **2.398**<!--fig demo.val_bpc--> for the LM
    | mLSTM fused/triton | 256 | 928,020<!--fig h200_2.triton.b256.chars_per_s--> | ...

The rule (:func:`parse_markers`): ``<!--fig NAME-->`` with NAME dot-separated words of
``[A-Za-z0-9_]``; a marker inside a code span or a fenced block is code, not a marker. Right
before the marker, a run of closing emphasis or code characters (``*``, ``_``, backtick) is
skipped; the figure token is then the longest run of letters, digits, ``.``, ``,`` and ``%``
that ends there (so ``**2.398**``, ``61.2%``, ``1.113x``, ``270.7M`` and `` `--time-limit 349s` ``
give ``2.398``, ``61.2%``, ``1.113x``, ``270.7M`` and ``349s``; in ``244-290 us`` each end is
its own token, and a sign or a ``#`` stays outside). A token without a letter or digit, an
unknown name, a malformed ``<!--fig`` comment, or a token that differs from the registry's
value fails the suite, naming the page, the line, the marker, the token, the value and its
source; so does a registered figure no page quotes.

**Adding a figure** or **re-measuring**: CONTRIBUTING.md, "Figures by marker".
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Callable

import yaml

from tests._mp import REPO

RESULTS = REPO / "docs" / "results"
#: The pages whose markers are checked.
PAGES = ("README.md", "CONTRIBUTING.md",
         *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))

# --- the marker -------------------------------------------------------------------------------

#: A marker's name: dot-separated words of letters, digits and underscores.
NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
MARKER = re.compile(r"<!--fig (" + NAME.pattern + r")-->")
#: Closing emphasis or code skipped between the token and its marker (``**2.398**<!--fig x-->``).
CLOSERS = "*_`"
TOKEN = re.compile(r"[0-9A-Za-z.,%]+\Z")
FENCE = re.compile(r"\s*(```|~~~)")


class MarkerError(ValueError):
    """A malformed marker, or a marker with no figure token right before it."""


@dataclass(frozen=True)
class Marker:
    page: str
    line: int
    name: str
    token: str


def code_spans(line: str) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of the line's inline code spans: a run of n backticks up to
    the next run of exactly n (an unmatched run is literal text, as CommonMark has it)."""
    runs = [(m.start(), m.end()) for m in re.finditer(r"`+", line)]
    spans, i = [], 0
    while i < len(runs):
        n = runs[i][1] - runs[i][0]
        j = next((j for j in range(i + 1, len(runs)) if runs[j][1] - runs[j][0] == n), None)
        if j is None:
            i += 1
            continue
        spans.append((runs[i][0], runs[j][1]))
        i = j + 1
    return spans


def parse_markers(text: str, page: str = "<text>") -> list[Marker]:
    """Every marker of ``text`` with the figure token before it (the rule in the module's
    docstring). Raises :class:`MarkerError` on a malformed ``<!--fig`` comment or a marker with
    no token."""
    found, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if m := FENCE.match(line):
            fence = None if fence == m[1] else fence or m[1]
            continue
        if fence:
            continue
        spans = code_spans(line)
        for start in (m.start() for m in re.finditer(r"<!--\s*fig\b", line)):
            if any(a <= start < b for a, b in spans):
                continue                                  # shown as code, not a marker
            where = f"{page}:{number}"
            m = MARKER.match(line, start)
            if not m:
                raise MarkerError(f"{where}: malformed marker {line[start:start + 60]!r} "
                                  "(the form is <!--fig NAME-->)")
            token = TOKEN.search(line[:start].rstrip(CLOSERS))
            if not token or not any(c.isalnum() for c in token[0]):
                raise MarkerError(f"{where}: {m[0]} has no figure token right before it: "
                                  f"...{line[max(0, start - 30):start]!r}")
            found.append(Marker(page, number, m[1], token[0]))
    return found


# --- the registry -----------------------------------------------------------------------------

#: ``(source, function)``: each function returns ``{name: formatted value}`` read from ``source``.
GROUPS: list[tuple[str, Callable[[], dict[str, str]]]] = []


def figures(source: str):
    """Register a function returning figures read from ``source`` (a path under the repository,
    or what the figures are recomputed with)."""
    def register(fn: Callable[[], dict[str, str]]) -> Callable[[], dict[str, str]]:
        GROUPS.append((source, fn))
        return fn
    return register


def group_name(fn: Callable[[], dict[str, str]]) -> str:
    if isinstance(fn, functools.partial):
        return f"{fn.func.__name__}{list(fn.args)}"
    return fn.__name__


def values(fn: Callable[[], dict[str, str]]) -> dict[str, str]:
    """The group's figures, after checking each name can be a marker's and each value can be
    read back as one token."""
    out = fn()
    for name, value in out.items():
        assert NAME.fullmatch(name), f"{group_name(fn)}: {name!r} is not a marker name"
        token = TOKEN.search(value)
        assert token and token[0] == value and any(c.isalnum() for c in value), \
            f"{group_name(fn)}: {name} = {value!r} cannot be read back as one token"
    return out


@functools.cache
def registry() -> dict[str, tuple[str, str]]:
    """``{name: (value, source)}`` over every group; a name registered twice is an error."""
    out: dict[str, tuple[str, str]] = {}
    for source, fn in GROUPS:
        for name, value in values(fn).items():
            assert name not in out, f"{name} is registered twice"
            out[name] = (value, source)
    return out


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def jsonl(name: str) -> list[dict]:
    return [json.loads(x) for x in (RESULTS / name).read_text().splitlines()]


def evals(name: str) -> dict[int, float]:
    return {r["step"]: r["val_bpc"] for r in jsonl(name) if r["kind"] == "eval"}


def pct(x: float, places: int = 1) -> str:
    return f"{x:.{places}%}"


#: Row names: impl -> the word in figure names.
IMPL = {"fused/triton": "triton", "fused/triton+graphs": "graphs", "reference": "reference",
        "cudnn": "cudnn"}


# --- README's demo paragraph and docs/transfer.md's example --------------------------------------

@figures("docs/results/demo.json")
def demo() -> dict[str, str]:
    d = load("demo.json")
    t = d["transfer"]
    minutes, seconds = divmod(round(d["total_s"]), 60)
    cfg = yaml.safe_load((REPO / "configs/demo.yaml").read_text())
    data = cfg["train"]["data"]
    chars = d["steps"] * data["batch_size"] * cfg["launch"]["np"] * data["seq_len"]
    return {
        "demo.val_bpc": f"{d['val_bpc']:.3f}",
        "demo.xz_bpc": f"{d['compressor_bpc']['xz']:.3f}",
        "demo.gzip_bpc": f"{d['compressor_bpc']['gzip']:.3f}",
        "demo.val_chars": f"{d['val_chars']:,}",
        "demo.median_chars_per_s": f"{d['median_chars_per_s']:,.0f}",
        "demo.world_size": f"{d['world_size']}",
        "demo.sst2_val": pct(t["val_acc"]),
        "demo.sst2_cv": pct(t["cv_acc"]),
        "demo.nonzero": f"{t['nonzero']}",
        "demo.tfidf_val": pct(t["baseline_val_acc"]),
        "demo.total_min": f"{minutes}",
        "demo.total_sec": f"{seconds}",
        "demo.steps": f"{d['steps']}",
        "demo.features": f"{t['features']}",
        "demo.unit": f"{t['neuron']}",
        "demo.unit_val": pct(t["neuron_val_acc"]),
        "demo.chars_trained": f"{chars:,}",            # steps x batch x ranks x seq_len
        "demo.train_min": f"{d['timings_s']['train_s'] / 60:.1f}",
    }


# --- docs/training.md ---------------------------------------------------------------------------

@figures("docs/results/bench_elastic.json")
def elastic() -> dict[str, str]:
    e = load("bench_elastic.json")
    return {
        "elastic.commit_ms": f"{e['commit_s'] * 1e3:.1f}",
        "elastic.commit_share": pct(e["commit_share_of_step_time"], 2),
        "elastic.commit_every": f"{e['commit_every']}",
        "elastic.killed_at_step": f"{e['last_step_before_kill']}",
        "elastic.steps_lost": f"{e['steps_lost']}",
        "elastic.resumed_from_step": f"{e['resumed_from_step']}",
        "elastic.kill_to_step_s": f"{e['kill_to_first_step_s']:.1f}",
    }


@figures("docs/results/onebit_allreduce.json")
def onebit_wire() -> dict[str, str]:
    w = {(r["controller"], str(r["what"])): r for r in load("onebit_allreduce.json")["wire"]}
    computed, m = w[("hvd-mpi", "mlstm1024")], w[("hvd-gloo", "mlstm1024")]
    return {
        "onebit.wire.fp32_over_onebit": f"{computed['none_over_onebit']:.1f}x",
        "onebit.wire.fp16_over_onebit": f"{computed['fp16_over_onebit']:.1f}x",
        "onebit.wire.measured_fp32_over_onebit":
            f"{m['none_measured'] / m['onebit_measured']:.1f}x",
        "onebit.wire.measured_fp16_over_onebit":
            f"{m['fp16_measured'] / m['onebit_measured']:.1f}x",
    }


@figures("docs/results/onebit/*.jsonl")
def onebit_convergence() -> dict[str, str]:
    a3, o3 = evals("onebit/adam_300.jsonl"), evals("onebit/onebit-adam_300.jsonl")
    a, o = evals("onebit/adam_1000.jsonl"), evals("onebit/onebit-adam_1000.jsonl")
    return {
        "onebit.s300.onebit_bpc": f"{o3[300]:.3f}",
        "onebit.s300.adam_bpc": f"{a3[300]:.3f}",
        "onebit.s1000.max_gap": f"{max(abs(o[s] - a[s]) for s in a):.3f}",
        "onebit.s1000.onebit_bpc": f"{o[1000]:.3f}",
        "onebit.s1000.adam_bpc": f"{a[1000]:.3f}",
    }


# --- docs/performance.md: CPU throughput -----------------------------------------------------

def bench_rows(name: str) -> dict:
    return {(r["backend"], r["ranks"], r.get("variant")): r for r in load(name)["runs"]}


def training_throughput(h: int) -> dict[str, str]:
    name = f"bench_train_h{h}.json"
    d, r = load(name), bench_rows(name)
    one, two = r[("horovod", 1, None)], r[("horovod", 2, None)]
    p = f"train_h{h}"
    return {
        f"{p}.chars_per_s_1": f"{one['chars_per_s_total']:,.0f}",
        f"{p}.chars_per_s_2": f"{two['chars_per_s_total']:,.0f}",
        f"{p}.weak_scaling": f"{two['weak_scaling_efficiency']:.3f}",
        f"{p}.of_matmul_peak": pct(one["fraction_of_matmul_peak"]),
        f"{p}.horovod_over_ddp": f"{d['horovod_over_ddp']:.3f}x",
    }


for _h in (1024, 256):
    figures(f"docs/results/bench_train_h{_h}.json")(
        functools.partial(training_throughput, _h))


def fused_recurrence(h: int, threads: int) -> dict[str, str]:
    name = f"bench_train_fused_h{h}{'_t2' if threads == 2 else ''}.json"
    d, r = load(name), bench_rows(name)
    assert d["args"]["threads"] == threads, name
    ratio = next(x for x in d["impl_ratios"] if x["variant"] == "fused/torch")
    q1, q3 = ratio["step_ratio_quartiles"]
    p = f"fused_h{h}.t{threads}"
    return {
        f"{p}.fused_chars_per_s": f"{r[('horovod', 1, 'fused/torch')]['chars_per_s_total']:,.0f}",
        f"{p}.reference_chars_per_s":
            f"{r[('horovod', 1, 'reference')]['chars_per_s_total']:,.0f}",
        f"{p}.ratio": f"{ratio['step_ratio_median']:.3f}x",
        f"{p}.ratio_q1": f"{q1:.3f}",
        f"{p}.ratio_q3": f"{q3:.3f}",
    }


for _h, _t in ((1024, 2), (256, 2), (1024, 1), (256, 1)):
    figures(f"docs/results/bench_train_fused_h{_h}{'_t2' if _t == 2 else ''}.json")(
        functools.partial(fused_recurrence, _h, _t))


@figures("docs/results/bench_train_engines_h256.json")
def engines() -> dict[str, str]:
    """`python -m benchmarks train --engines horovod,torch` (docs/performance.md section 9, the
    choice between the engines in docs/training.md)."""
    name = "bench_train_engines_h256.json"
    d, r = load(name), bench_rows(name)
    out = {}
    for engine in ("horovod", "torch"):
        one, two = r[(engine, 1, "fused/auto")], r[(engine, 2, "fused/auto")]
        out |= {f"engines.{engine}.chars_per_s_1": f"{one['chars_per_s_total']:,.0f}",
                f"engines.{engine}.chars_per_s_2": f"{two['chars_per_s_total']:,.0f}",
                f"engines.{engine}.weak_scaling": f"{two['weak_scaling_efficiency']:.3f}",
                f"engines.{engine}.allreduce_wait": pct(two["allreduce_wait_share"]),
                f"engines.{engine}.over_ddp": f"{d[f'{engine}_over_ddp']:.3f}x"}
    x = {e["ranks"]: e for e in d["torch_over_horovod"]}
    return out | {
        "engines.torch_over_horovod_1": f"{x[1]['ratio']:.3f}x",
        "engines.torch_over_horovod_2": f"{x[2]['ratio']:.3f}x",
        "engines.repeats": f"{d['args']['repeats']}",
        "engines.paired_min_2": f"{min(x[2]['paired_ratios']):.3f}",
        "engines.paired_max_2": f"{max(x[2]['paired_ratios']):.3f}",
    }


# --- docs/performance.md and docs/training.md: the scaling model -----------------------------

@functools.cache
def calibration():
    from benchmarks import scaling_study as ss
    from benchmarks.calibration import calibrate_from_bench
    from benchmarks.results import load_bench_json
    return calibrate_from_bench(load_bench_json(ss.SHIPPED_CALIBRATION))


def calibration_figures(prefix: str, cal) -> dict[str, str]:
    lo, hi = cal.per_cycle_overhead_range_s
    rlo, rhi = cal.bandwidth_ratio_range
    return {f"{prefix}.overhead_us": f"{cal.per_cycle_overhead_s * 1e6:.0f}",
            f"{prefix}.overhead_lo_us": f"{lo * 1e6:.0f}",
            f"{prefix}.overhead_hi_us": f"{hi * 1e6:.0f}",
            f"{prefix}.bandwidth_ratio": f"{cal.measured_bandwidth_ratio:.2f}x",
            f"{prefix}.bandwidth_ratio_lo": f"{rlo:.2f}",
            f"{prefix}.bandwidth_ratio_hi": f"{rhi:.2f}x"}


@figures("docs/results/allreduce_calibration.json")
def shipped_calibration() -> dict[str, str]:
    return calibration_figures("calibration", calibration())


@figures("docs/results/allreduce_loaded.json")
def loaded_calibration() -> dict[str, str]:
    from benchmarks.calibration import calibrate_from_bench
    from benchmarks.results import load_bench_json
    return calibration_figures(
        "loaded_calibration",
        calibrate_from_bench(load_bench_json(RESULTS / "allreduce_loaded.json")))


@figures("python -m benchmarks scaling-model validate/recommend with "
         "docs/results/allreduce_calibration.json")
def scaling_model() -> dict[str, str]:
    from benchmarks import scaling_study as ss
    v = ss.validate(calibration())["summary"]
    worst = max(v["4096-d w/o IB"]["model_max_abs_error"],
                v["8192-d w/ IB"]["model_max_abs_error"])
    rows = {(r["scenario"], r["setting"]): r for r in ss.recommend(calibration())["rows"]}
    pub = {s: r for (sc, s), r in rows.items() if sc == "as-published"}
    small = ("no fusion (threshold 0)", "fusion 64 MB", "cycle time 5 ms",
             "hierarchical allreduce (NCCL across nodes)")
    assert max(abs(pub[s]["vs_reference_setting"]) for s in small) < 0.01, \
        "docs/performance.md says fusion, cycle time and hierarchical allreduce change < 1%"
    return {
        "scaling.max_error_gbe_8192": pct(worst),
        "scaling.max_error_ib_4096": pct(v["4096-d w/ IB"]["model_max_abs_error"]),
        "scaling.fp32_speedup": f"{pub['fp32 gradients (no compression)']['speedup']:.1f}x",
        "scaling.batch512_speedup":
            f"{pub['batch 512 per GPU (or 2 backward passes per step)']['speedup']:.1f}x",
    }


@figures("python -m benchmarks scaling-model onebit with docs/results/allreduce_calibration.json")
def onebit_scaling() -> dict[str, str]:
    from benchmarks import scaling_study as ss
    at = {(x["column"], x["gpus"]): x for x in ss.onebit_study(calibration())["rows"]}
    g, ib = at[("10 GbE", 128)], at[("IB as published", 128)]
    return {
        "onebit_scaling.gbe.fp16": f"{g['fp16_speedup']:.1f}x",
        "onebit_scaling.gbe.onebit": f"{g['onebit_speedup']:.1f}x",
        "onebit_scaling.gbe.onebit_end_to_end": f"{g['onebit_end_to_end_speedup']:.1f}x",
        "onebit_scaling.ib.onebit": f"{ib['onebit_speedup']:.1f}x",
        "onebit_scaling.ib.onebit_end_to_end": f"{ib['onebit_end_to_end_speedup']:.1f}x",
    }


# --- docs/performance.md and docs/reliability.md: bench multinode ---------------------------

NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


@figures("docs/results/bench_multinode_{1gbit,200mbit}.json")
def multinode() -> dict[str, str]:
    """Every row of ``python -m benchmarks multinode`` (2 and 3 hosts at each shaped link speed, one
    ``docs/results/bench_multinode_<rate>.json`` per speed) and the figures the prose takes from
    them: the free line's and the 32-byte allreduce's times, one process's step parts and the
    window's share, the previous model's ratios on the same measurements, each round's ratios,
    the 8 MiB allreduce's range, and the 3-host step against its parts measured apart."""
    from benchmarks.bench_multinode import predict_step
    from hvd_lm.model.lm import mlstm_parameters

    assert len(list(RESULTS.glob("bench_multinode_*.json"))) == 2, "two shaped link speeds"
    run = {lb: load(f"bench_multinode_{lb}.json") for lb in ("1gbit", "200mbit")}
    row = {(lb, r["nodes"]): r for lb in run for r in run[lb]["rows"]}
    keys = [("1gbit", 2), ("1gbit", 3), ("200mbit", 2), ("200mbit", 3)]
    out = {}
    for (lb, n) in keys:
        r, f = row[(lb, n)], row[(lb, n)]["fit"]
        assert run[lb]["label"] == lb
        out |= {f"multinode.{lb}.n{n}.alpha_us": f"{f['alpha_s'] * 1e6:.0f}",
                f"multinode.{lb}.n{n}.beta_GBps": f"{f['beta_GBps']:.3f}",
                f"multinode.{lb}.n{n}.compute_ms": f"{r['compute_s'] * 1e3:.1f}",
                f"multinode.{lb}.n{n}.comm_ms": f"{(r['comm_s'] + r['loop_s']) * 1e3:.1f}",
                f"multinode.{lb}.n{n}.predicted_ms": f"{r['predicted_s'] * 1e3:.1f}",
                f"multinode.{lb}.n{n}.measured_ms": f"{r['measured_s'] * 1e3:.1f}",
                f"multinode.{lb}.n{n}.ratio": f"{r['predicted_s'] / r['measured_s']:.2f}"}
    ratios = [row[k]["predicted_s"] / row[k]["measured_s"] for k in keys]
    g3, m3 = row[("1gbit", 3)], row[("200mbit", 3)]
    w = run["1gbit"]["step_parts"]
    # "within 5% on three rows and 19% low": the fourth row is 3 hosts at 1 Gbit/s
    given = [row[k]["ratio"] for k in keys]
    within = [abs(r - 1) for r in given if abs(r - 1) < 0.05]
    assert len(within) == 3 and abs(given[1] - 1) >= 0.05
    args = run["1gbit"]["args"]
    params = mlstm_parameters(args["hidden_size"], args["embed_dim"])
    previous = [predict_step(row[k]["compute_s"], params, row[k]["fit_free"], k[1],
                             run[k[0]]["args"]["control_every"],
                             run[k[0]]["args"]["log_every"])["predicted_s"] / row[k]["measured_s"]
                for k in keys]
    big = [r["time_s"] for r in run["1gbit"]["records"]["3"] if r["case"] == "single"
           and r["size_bytes"] == 8 << 20]
    parts = (g3["compute_s"] + g3["grouped_allreduce_s"]) / g3["measured_s"]
    for (lb, n) in keys:
        rounds = row[(lb, n)]["ratio_rounds"]
        out |= {f"multinode.{lb}.n{n}.rounds_min": f"{min(rounds):.2f}",
                f"multinode.{lb}.n{n}.rounds_max": f"{max(rounds):.2f}"}
    return out | {
        "multinode.ratio_min": f"{min(ratios):.2f}",
        "multinode.ratio_max": f"{max(ratios):.2f}",
        "multinode.1gbit.n3.free_intercept_ms": f"{g3['fit_free']['intercept_s'] * 1e3:.1f}",
        "multinode.200mbit.n3.free_intercept_ms": f"{m3['fit_free']['intercept_s'] * 1e3:.1f}",
        "multinode.1gbit.n3.latency_ms": f"{g3['latency_s'] * 1e3:.1f}",
        "multinode.200mbit.n3.latency_ms": f"{m3['latency_s'] * 1e3:.1f}",
        "multinode.step.forward_ms": f"{w['forward_s'] * 1e3:.1f}",
        "multinode.step.backward_ms": f"{w['backward_s'] * 1e3:.1f}",
        "multinode.step.window_ms": f"{w['window_s'] * 1e3:.1f}",
        "multinode.step.update_ms": f"{w['update_s'] * 1e3:.1f}",
        "multinode.step.window_share": pct(w["fraction"], 0),
        "multinode.step.window_share_200mbit": pct(run["200mbit"]["step_parts"]["fraction"], 0),
        "multinode.rows_within_5pct": NUMBER_WORDS[len(within)],
        "multinode.1gbit.n3.low_by": pct(1 - given[1], 0),
        "multinode.1gbit.n3.ratio_x": f"{given[1]:.2f}x",
        **{f"multinode.{lb}.n{n}.previous_ratio": f"{p:.2f}" for (lb, n), p in zip(keys, previous)},
        "multinode.1gbit.allreduce_8MiB_min_ms": f"{min(big) * 1e3:.0f}",
        "multinode.1gbit.allreduce_8MiB_max_ms": f"{max(big) * 1e3:.0f}",
        "multinode.1gbit.n3.compute_ms_0": f"{g3['compute_s'] * 1e3:.0f}",
        "multinode.1gbit.n3.grouped_allreduce_ms": f"{g3['grouped_allreduce_s'] * 1e3:.0f}",
        "multinode.1gbit.n3.parts_over_step": f"{parts:.2f}",
        "multinode.1gbit.n3.parts_over_step_x": f"{parts:.2f}x",
        "multinode.1gbit.n3.measured_ms_0": f"{g3['measured_s'] * 1e3:.0f}",
        "multinode.1gbit.n3.parts_miss": pct(1 - parts, 0),
    }


# --- docs/performance.md section 11 and README: bench checkpoint -----------------------------

@figures("docs/results/bench_checkpoint*.json")
def checkpoint_stall() -> dict[str, str]:
    local, slow = load("bench_checkpoint.json"), load("bench_checkpoint_latency2.json")
    out = {}
    for d, label in ((local, "local"), (slow, "latency2")):
        for mode in ("sync", "async"):
            r, p = d[mode], f"checkpoint.{label}.{mode}"
            out |= {f"{p}.{k}": f"{r[k]:.2f}"
                    for k in ("step_s", "write_s", "blocked_s", "stall_s")}
            if r["step_during_write_s"] is None:
                assert mode == "sync"                      # the page prints "-"
            else:
                out[f"{p}.step_during_write_s"] = f"{r['step_during_write_s']:.2f}"
    return out | {
        "checkpoint.mb": f"{local['checkpoint_bytes'] / 1e6:.0f}",
        "checkpoint.local.async_over_sync": f"{local['stall_ratio_async_over_sync']:.2f}x",
        "checkpoint.latency2.async_over_sync": f"{slow['stall_ratio_async_over_sync']:.2f}x",
        "checkpoint.load_average_min": f"{local['load_average'][0]:.1f}",
        "checkpoint.load_average_max": f"{slow['load_average'][1]:.1f}",
    }
