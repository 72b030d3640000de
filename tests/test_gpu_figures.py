"""The second H200's figures (docs/gpu.md "The second H200", README's "On one GPU"), each
recomputed from the files its one call returned (docs/results/gpu_h200_2026-11-27/: the bench
JSON, metrics.jsonl, eval.json, the transfer reports, the samples, the call's timeline) and
compared with what the pages print; the first card's are in tests/test_readme_figures.py."""
import json
import re
import statistics

from tests.test_readme_figures import REPO, RESULTS, says

NAME = "gpu_h200_2026-11-27"
SRC, PAGE = f"docs/results/{NAME}", "docs/gpu.md"
DIR = RESULTS / NAME


def read(name: str) -> dict:
    return json.loads((DIR / name).read_text())


def records() -> list[dict]:
    return [json.loads(x) for x in (DIR / "metrics.jsonl").read_text().splitlines()]


def test_second_h200_bench_table():
    """Each row of the bench table, the peak it is a fraction of, and the comparison with the
    first card, from the one bench gpu run of the call."""
    d = read("bench_gpu.json")
    (peak,) = d["matmul"]
    says(f"measured in the same run ({peak['tflops']:.1f} TFLOP/s)", SRC, PAGE)
    rows = {(r["impl"], r["batch_size"]): r for r in d["train"]}
    for impl, b in (("fused/triton", 256), ("fused/triton+graphs", 256), ("cudnn", 256),
                    ("fused/triton+graphs", 128), ("fused/triton", 128), ("cudnn", 128)):
        r = rows[(impl, b)]
        name = "cuDNN LSTM" if impl == "cudnn" else f"mLSTM {impl}"
        gemms = "-" if impl == "cudnn" else f"{r['fraction_of_gemm_ceiling']:.1%}"
        vs = "1" if impl == "cudnn" else f"{r['vs_cudnn_lstm_per_flop']:.3f}"
        says(f"| {name} | {b} | {r['chars_per_s']:,.0f} | {r['tflops']:.1f} | "
             f"{r['fraction_of_peak']:.1%} | {gemms} | {vs} | {r['host_s_per_step'] * 1e3:.1f} |",
             SRC, PAGE)
    first = json.loads((RESULTS / "gpu_h200/bench_gpu_b256.json").read_text())["train"]
    old = {r["impl"]: r for r in first if r["batch_size"] == 256 and r["precision"] == "bf16"}
    new, cudnn = rows[("fused/triton", 256)], rows[("cudnn", 256)]
    says(f"({cudnn['chars_per_s']:,.0f} and {old['cudnn']['chars_per_s']:,.0f} chars/s at B=256)",
         SRC, PAGE)
    says(f"went from {old['fused/triton']['chars_per_s']:,.0f} to {new['chars_per_s']:,.0f} "
         f"chars/s ({new['chars_per_s'] / old['fused/triton']['chars_per_s']:.3f}x) and from "
         f"{old['fused/triton']['vs_cudnn_lstm_per_flop']:.3f} to "
         f"{new['vs_cudnn_lstm_per_flop']:.3f} of cuDNN per FLOP", SRC, PAGE)
    says(f"({new['kernels_per_time_step']:.1f} kernels per time step", SRC, PAGE)
    says(f"step at the reference's width (H=4096, T=256, bf16) did {new['chars_per_s']:,.0f} "
         f"chars/s at B=256, {new['vs_cudnn_lstm_per_flop']:.3f} of cuDNN's LSTM per FLOP", SRC,
         "README.md")


def test_second_h200_model_and_targets():
    """The model paragraph, the targets table and README's summary, from the run's metrics,
    eval.json and transfer reports: eval on the final checkpoint equals the last logged val BPC
    (to four places), and training ended before its deadline with the LR at 0."""
    recs = records()
    start = next(r for r in recs if r["kind"] == "start")
    end = next(r for r in recs if r["kind"] == "end")
    train = [r for r in recs if r["kind"] == "train"]
    val = [r["val_bpc"] for r in recs if r["kind"] == "eval"]
    ev = read("eval.json")
    minutes = (end["time"] - start["time"]) / 60
    assert train[-1]["lr"] == 0.0 and 0 <= end["deadline_left_s"] and end["stop"] == "done"
    assert f"{ev['bpc']:.4f}" == f"{val[-1]:.4f}" and ev["step"] == end["step"]
    assert all(a > b for a, b in zip(val, val[1:]))  # "fell at every evaluation"
    says(f"`--time-limit {start['time_limit_s']}s`", SRC, PAGE)
    says(f"{end['step']:,} steps in {minutes:.1f} minutes at a median "
         f"{statistics.median(r['chars_per_s'] for r in train):,.0f} chars/s (MFU "
         f"{statistics.median(r['mfu'] for r in train):.2f}), ending "
         f"{end['deadline_left_s']:.1f} s before its deadline", SRC, PAGE)
    says(", ".join(f"{v:.3f}" for v in val[:-1]) + f" to {val[-1]:.3f} (the final training "
         f"windows read {statistics.mean(r['bpc'] for r in train[-10:]):.3f})", SRC, PAGE)
    says(f"after {train[-1]['epoch']:.1f} passes over the corpus", SRC, PAGE)
    says(f"gives {ev['bpc']:.4f}, the last logged validation BPC", SRC, PAGE)
    says(f"| trained >= 5 minutes, on the new corpus | {minutes:.1f} minutes | met |", SRC, PAGE)
    says(f"| `hvd-lm eval` = last logged val BPC | {ev['bpc']:.4f} = {val[-1]:.4f} | met |", SRC,
         PAGE)
    mean, cell = read("transfer/transfer.json"), read("transfer_cell/transfer.json")
    acc, unit = mean["classifier"]["accuracy"]["val"], mean["neuron"]["accuracy"]["val"]
    tfidf = mean["baseline"]["accuracy"]["val"]
    says(f"| {acc:.1%} (mean of h_t) | missed by {(tfidf - acc) * 100:.1f} points |", SRC, PAGE)
    says(f"| {unit:.1%} | missed by {(0.7 - unit) * 100:.1f} points |", SRC, PAGE)
    says(f"mean of h_t {acc:.1%} val at C={mean['classifier']['C']:g} "
         f"({mean['classifier']['nonzero']:,} non-zero", SRC, PAGE)
    says(f"the final cell state {cell['classifier']['accuracy']['val']:.1%} at "
         f"C={cell['classifier']['C']:g}, TF-IDF {tfidf:.1%}", SRC, PAGE)
    says(f"trained to a {start['time_limit_s']} s `--time-limit` on 135.8M bytes reached "
         f"{ev['bpc']:.3f} validation "
         f"BPC, {acc:.1%} on SST-2 (TF-IDF: {tfidf:.1%})", SRC, "README.md")
    says(f"saw {end['chars_trained'] / 1e6:.1f}M characters, {train[-1]['epoch']:.1f} passes", SRC,
         PAGE)


def test_second_h200_steering_went_nowhere():
    """The unit alone near chance, and the pinned samples' mean P(positive) the page quotes
    (the wrong way round: what generate's WEAK_UNIT_ACCURACY warning is for)."""
    from hvd_lm.transfer.generate import WEAK_UNIT_ACCURACY
    p = {v: statistics.mean(json.loads(x)["p_positive"] for x in
                            (DIR / f"samples_unit{v}.jsonl").read_text().splitlines())
         for v in ("1.0", "-1.0")}
    says(f"held at +1 (toward negative) the three samples' classifier P(positive) averaged "
         f"{p['1.0']:.3f}, held at -1 (toward positive) {p['-1.0']:.3f}", SRC, PAGE)
    assert read("transfer/transfer.json")["neuron"]["accuracy"]["val"] < WEAK_UNIT_ACCURACY
    says(f"under {WEAK_UNIT_ACCURACY:.0%} (`WEAK_UNIT_ACCURACY`)", SRC, PAGE)


def test_post_training_budget_covers_what_the_h200_took():
    """The steps after training took 125 s on the H200 (the call's timeline, session.log; the
    three it cut ran in 36.0 s in a later call, commands.md): scripts/gpu_session.sh keeps at
    least that (POST_S), and the page says both."""
    log = (DIR / "session.log").read_text()
    at = {m[2]: int(m[1]) for m in re.finditer(r"\+(\d+)s\] (\S+)$", log, re.M)}
    done = {m[2]: int(m[1]) for m in re.finditer(r"\+(\d+)s\] (\S+): exit 0$", log, re.M)}
    took = {k: done[k] - at[k] for k in ("eval", "transfer", "transfer_cell", "generate")}
    later = float(re.search(r"three cut steps \(wall ([\d.]+) s",
                            (DIR / "commands.md").read_text())[1])
    total = sum(took.values()) + later
    script = (REPO / "scripts/gpu_session.sh").read_text()
    defaults = {int(x) for x in re.findall(r"\$\{POST_S:-(\d+)\}", script)}
    assert len(defaults) == 1 and defaults.pop() >= total, (took, later)
    says(f"took {round(total)} s (eval {took['eval']}, mean transfer {took['transfer']}, the "
         f"cell transfer {took['transfer_cell']}, generate {took['generate']}, the pinned "
         f"generates and visualize {round(later)} in the later call)", SRC, PAGE)
