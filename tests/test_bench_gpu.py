"""``python -m benchmarks gpu`` on the CPU (``--device cpu``, tiny shapes): the step's GEMMs against
the model's own FLOP count, every derived figure against values known in advance (a clock that
reads a fixed time per call), failures recorded and the JSON kept as the run goes (on a GPU
node the same command measures the card)."""
import json

import pytest
import torch

from benchmarks import bench_gpu as bg
from benchmarks import ceilings, main
from hvd_lm.model.lm import LanguageModel, ModelConfig

TINY = ["gpu", "--device", "cpu", "--hidden-size", "32", "--embed-dim", "8",
        "--seq-len", "8", "--batch-sizes", "4", "--steps", "1", "--warmup", "0", "--repeats",
        "1", "--matmul-size", "64", "--copy-mib", "1"]


@pytest.mark.parametrize("H,E,T,B", [(32, 8, 8, 4), (256, 64, 256, 128), (1024, 64, 64, 32)])
def test_step_gemms_add_up_to_the_models_flops(H, E, T, B):
    """The GEMM list's FLOPs per window == T x B x LanguageModel.flops_per_char() (the model's
    own count: 6 (5EH + 5H^2 + 256H)), a third in each phase."""
    gemms = ceilings.step_gemms(H, E, T, B)
    per_char = LanguageModel(ModelConfig(hidden_size=H, embed_dim=E)).flops_per_char()
    assert sum(g.flops for g in gemms) == T * B * per_char
    for phase in ("forward", "backward data", "weight gradient"):
        assert 3 * sum(g.flops for g in gemms if g.phase == phase) == T * B * per_char


def fixed_clock(seconds_per_call: float):
    """A timer that runs ``fn`` ``n`` times (the real work) and reads ``n`` x a fixed time."""
    def timer(fn, n):
        for _ in range(n):
            fn()
        return n * seconds_per_call
    return timer


def test_figures_follow_from_the_clock(tmp_path, capsys):
    """With every call reading 10 ms: matmul TFLOP/s = 2mkn / 10 ms; the training step =
    B x T chars per 10 ms; the GEMM ceiling = B x T chars per (4T + 11) GEMM calls of 10 ms
    (four per-step GEMMs x T, eleven whole-window ones), so each mLSTM variant reaches
    4T + 11 times its GEMM ceiling; every ratio is 1."""
    out = tmp_path / "g.json"
    cfg = bg.BenchGpuConfig(device="cpu", hidden_size=32, embed_dim=8, seq_len=8,
                            batch_sizes=[4], precisions=["fp32"], steps=2, warmup=0, repeats=1,
                            matmul_size=64, copy_mib=1, json=str(out))
    assert bg.bench_gpu(cfg, timer=fixed_clock(0.01)) == 0
    data = json.loads(out.read_text())
    assert data["matmul"][0]["tflops"] == pytest.approx(2 * 64 ** 3 / 0.01 / 1e12)
    assert data["copy_GBps"] == pytest.approx(2 * 2 ** 20 / 0.01 / 1e9)
    assert len(data["gemms"]) == 15
    for g in data["gemms"]:
        assert g["tflops"] == pytest.approx(2 * g["m"] * g["k"] * g["n"] / 0.01 / 1e12)
    (ceiling,) = data["ceiling"]
    assert ceiling["chars_per_s"] == pytest.approx(4 * 8 / ((4 * 8 + 11) * 0.01))
    rows = {r["impl"]: r for r in data["train"]}
    assert set(rows) == {"fused/torch", "reference", "cudnn"}
    for r in rows.values():
        assert r["chars_per_s"] == pytest.approx(4 * 8 / 0.01)
    for impl in ("fused/torch", "reference"):
        assert rows[impl]["fraction_of_gemm_ceiling"] == pytest.approx(4 * 8 + 11)
        assert rows[impl]["vs_reference"] == pytest.approx(1.0)
        assert rows[impl]["vs_cudnn_lstm_per_flop"] == pytest.approx(
            rows[impl]["flops_per_char"] / rows["cudnn"]["flops_per_char"])
    assert "fraction_of_gemm_ceiling" not in rows["cudnn"]
    assert "GEMM ceiling fp32 B=4" in capsys.readouterr().out


def test_a_failing_variant_is_recorded_and_the_rest_measured(tmp_path, monkeypatch):
    """Defect 2 of issue 22 (failed before the fix: only RuntimeError was caught, so a
    ValueError ended the run and no JSON was written). One variant raising: its rows carry the
    error, the others their figures, exit 0."""
    real = bg.train_step_rate

    def flaky(v, *args, **kw):
        if v.rnn_impl == "reference":
            raise ValueError("triton mLSTM kernels need contiguous tensors")
        return real(v, *args, **kw)

    monkeypatch.setattr(bg, "train_step_rate", flaky)
    out = tmp_path / "g.json"
    assert main([*TINY, "--precisions", "fp32", "--json", str(out)]) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["train"]}
    assert rows["reference"]["error"] == \
        "ValueError: triton mLSTM kernels need contiguous tensors"
    assert rows["fused/torch"]["chars_per_s"] > 0 and rows["cudnn"]["chars_per_s"] > 0


def test_the_json_holds_every_figure_taken_before_an_interruption(tmp_path, monkeypatch):
    """Defect 2 of issue 22 (failed before the fix: the JSON was written only at the end). A
    run interrupted at its last variant (Ctrl-C, a job's time limit) leaves a JSON with the
    ceilings, the GEMMs and every variant measured before it."""
    real = bg.train_step_rate

    def interrupted(v, *args, **kw):
        if v.cell == "lstm":
            raise KeyboardInterrupt
        return real(v, *args, **kw)

    monkeypatch.setattr(bg, "train_step_rate", interrupted)
    out = tmp_path / "g.json"
    assert main([*TINY, "--precisions", "fp32", "--json", str(out)]) == 130  # interrupted
    data = json.loads(out.read_text())
    assert data["matmul"] and data["copy_GBps"] and len(data["gemms"]) == 15
    assert [r["impl"] for r in data["train"]] == ["fused/torch", "reference"]


def test_bench_gpu_measures_on_the_cpu(tmp_path, capsys):
    """A real run (no fake clock): fp32 and bf16, every variant; oneDNN has no bf16 LSTM on
    this CPU, so that row holds its error and the others their figures."""
    out = tmp_path / "g.json"
    assert main([*TINY, "--precisions", "fp32,bf16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "vs cuDNN/FLOP" in printed and "kernels  per t  host ms" in printed
    rows = {(r["impl"], r["precision"]): r for r in data["train"]}
    assert len(rows) == 6
    assert {k for k, r in rows.items() if "error" in r} <= {("cudnn", "bf16")}
    assert all(rows[(impl, p)]["chars_per_s"] > 0 for impl in ("fused/torch", "reference")
               for p in ("fp32", "bf16"))
    # issue 43: the step's kernels (profiled) and the host's time in it, every row measured
    for (impl, p), r in rows.items():
        if "error" not in r:
            assert r["kernels_per_step"] > 0 and r["host_s_per_step"] > 0
            assert r["kernels_per_time_step"] == r["kernels_per_step"] / 8  # T = 8
    # the fused window launches fewer kernels per step than the per-step reference loop
    assert rows[("fused/torch", "fp32")]["kernels_per_step"] < \
        rows[("reference", "fp32")]["kernels_per_step"]
    assert {(c["precision"], c["batch_size"]) for c in data["ceiling"]} == {("fp32", 4),
                                                                          ("bf16", 4)}


def test_variants_per_kernels_and_graphs():
    """Graphs only for the fused path on CUDA; kernels resolved for the device, duplicates
    dropped (auto is torch on the CPU)."""
    cfg = bg.BenchGpuConfig(rnn_kernels=["triton", "torch"])
    assert [v.label for v in bg.variants(cfg, torch.device("cuda"))] == [
        "fused/triton", "fused/triton+graphs", "fused/torch", "fused/torch+graphs",
        "reference", "cudnn"]
    cfg = bg.BenchGpuConfig(rnn_kernels=["auto", "torch"])
    assert [v.label for v in bg.variants(cfg, torch.device("cpu"))] == [
        "fused/torch", "reference", "cudnn"]


def test_a_variant_leaves_no_graphed_window_alive(monkeypatch):
    """Each measurement frees its model's CUDA graphs before the next one starts (before: a
    graphed window sits in reference cycles, as torch.cuda.make_graphed_callables' does, and
    with its private memory pool outlived the variant until the garbage collector happened to
    run). On the CPU: WindowGraphs with a capture whose graphed callable is in a cycle, the
    automatic collector off; after the variant no WindowGraphs and no graphed callable live."""
    import gc
    import weakref

    from hvd_lm.model import lm as model_mod
    from hvd_lm.model import mlstm_fused

    made = []

    class Graphed:  # a graphed window: replays fn, and keeps itself alive through a cycle
        def __init__(self, fn):
            self.fn, self.me = fn, self
            made.append(weakref.ref(self))

        def __call__(self, *args):
            return self.fn(*args)

    monkeypatch.setattr(model_mod, "WindowGraphs", lambda: mlstm_fused.WindowGraphs(
        device_type="cpu", capture=lambda fn, sample: Graphed(fn)))
    v = bg.Variant("mlstm", "fused", "torch", cuda_graphs=True)
    gc.collect()
    gc.disable()
    try:
        r = bg.train_step_rate(v, 16, 4, 2, 4, "fp32", torch.device("cpu"), fixed_clock(0.01),
                               steps=2, warmup=1, repeats=1)
        live = [o for o in gc.get_objects() if type(o) is mlstm_fused.WindowGraphs]
    finally:
        gc.enable()
    assert r["chars_per_s"] == pytest.approx(2 * 4 / 0.01)
    assert made and all(ref() is None for ref in made)
    assert live == []


def test_gap_stats_against_a_hand_count():
    """Kernels at [0,10], [5,12] (overlapping: one busy stretch 0-12), [20,30], [100,101]:
    window 101 us, busy 12 + 10 + 1 = 23, gaps of 8 and 70 us."""
    from benchmarks.profile_step import gap_stats, top_kernels
    g = gap_stats([(20, 30), (0, 10), (100, 101), (5, 12)])
    assert g["window_us"] == 101 and g["busy_us"] == 23 and g["idle_us"] == 78
    assert g["gaps"] == 2 and g["largest_gap_us"] == 70
    assert g["gaps_over_us"] == {"5.0": 2, "50.0": 1, "500.0": 0}
    assert gap_stats([])["gaps"] == 0
    rows = top_kernels([("a", 1.0), ("b", 5.0), ("a", 3.0)], top=1)
    assert rows == [{"name": "b", "calls": 1, "total_us": 5.0, "mean_us": 5.0,
                     "share": pytest.approx(5 / 9)}]


def test_profile_of_the_fastest_variant(tmp_path, capsys):
    """--profile-steps profiles the fastest mLSTM row (the fused one when the clock says it is
    faster) through the CLI: the JSON's profile names it and holds the operators that ran."""
    out = tmp_path / "g.json"
    assert main(TINY + ["--precisions", "fp32", "--cells", "mlstm", "--profile-steps", "2",
                        "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    best = max(data["train"], key=lambda r: r["chars_per_s"])
    p = data["profile"]
    assert p["variant"] == f"{best['impl']} B=4 fp32"
    assert p["source"] == "cpu operators" and p["steps"] == 2 and p["events"] > 0
    names = {r["name"] for r in p["top"]}
    assert any("mm" in n or "addmm" in n or "linear" in n for n in names), names
    assert 0 <= p["gaps"]["idle_fraction"] < 1
    assert sum(r["share"] for r in p["top"]) <= 1 + 1e-9
    assert f"profile of {p['variant']}" in capsys.readouterr().out


def test_cudnn_fp32_rows_are_a_fraction_of_the_tf32_peak(monkeypatch):
    """PyTorch lets cuDNN use TF32 in fp32 (torch.backends.cudnn.allow_tf32) but not its
    matmuls: cuDNN's fp32 LSTM is measured against the TF32 peak when one was taken (on an
    H200 it reached 3.2x the fp32 matmul peak); every other row against its own precision."""
    from benchmarks.ceilings import peak_key
    peaks = {"fp32": 51.0, "tf32": 400.0, "bf16": 800.0}
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert peak_key("lstm", "fp32", peaks) == "tf32"
    assert peak_key("mlstm", "fp32", peaks) == "fp32"
    assert peak_key("lstm", "bf16", peaks) == "bf16"
    assert peak_key("lstm", "fp32", {"fp32": 51.0}) == "fp32"
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert peak_key("lstm", "fp32", peaks) == "fp32"
