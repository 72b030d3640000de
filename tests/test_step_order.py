"""The training step alone on the CPU (hvd_lm.train.step.train_step), and who calls it: the order
of its calls recorded on a recording optimizer and loss scaler (backward x k, Horovod's
synchronize, unscale and clip, the step inside skip_synchronize, zero_grad), k = 2 against a
plain nanoGPT-style loop written here, its windows only read, and every benchmark that times a
step calling it once per step it times (the step's function replaced by a counting one)."""
from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
import torch.nn.functional as F

from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.train import step as step_mod
from hvd_lm.train.data import IGNORE, Batch
from hvd_lm.train.step import StepSpec, train_step
from hvd_lm.train.step import backward as step_backward
from hvd_lm.train.step import update as step_update

CPU = torch.device("cpu")
B, T = 3, 6


def windows(n: int, seed: int = 0) -> list[Batch]:
    """n windows of B x T random bytes; the second row of every other window ends in 2 padding
    targets (IGNORE), counted out of ``chars``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        data = torch.randint(0, 256, (B, T + 1), generator=g)
        targets = data[:, 1:].clone()
        if i % 2:
            targets[1, -2:] = IGNORE
        out.append(Batch(data[:, :-1].clone(), targets, torch.zeros(B, T, dtype=torch.bool),
                         int((targets != IGNORE).sum())))
    return out


def model_(seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(ModelConfig(hidden_size=8, embed_dim=4))


# ---- the order of the calls ---------------------------------------------------------------------

class Recorder:
    """What the step calls, in order, on the optimizer and scaler below."""

    def __init__(self):
        self.events: list[str] = []

    def __call__(self, event: str) -> None:
        self.events.append(event)


def recording_optimizer(rec: Recorder, params, distributed: bool, fused: bool):
    """An SGD whose calls are recorded; ``distributed``: with Horovod's ``synchronize()`` and
    ``skip_synchronize()`` (a :class:`hvd_lm.train.step.SynchronizingOptimizer`)."""

    class Plain(torch.optim.SGD):
        def step(self, closure=None):
            rec("step")
            return super().step(closure)

        def zero_grad(self, set_to_none: bool = True):
            rec("zero_grad")
            return super().zero_grad(set_to_none)

    class Distributed(Plain):
        def synchronize(self):
            rec("synchronize")

        @contextlib.contextmanager
        def skip_synchronize(self):
            rec("skip_synchronize(")
            yield
            rec(")")

    cls = Distributed if distributed else Plain
    return cls(params, lr=0.1, momentum=0.9, fused=fused or None)


def recording_scaler(rec: Recorder, enabled: bool) -> torch.amp.GradScaler:
    """A GradScaler (fp16's dynamic loss scaling when ``enabled``, else fp32/bf16's
    pass-through) whose calls are recorded."""

    class Scaler(torch.amp.GradScaler):
        def scale(self, outputs):
            rec("scale")
            return super().scale(outputs)

        def unscale_(self, optimizer):
            rec("unscale")
            return super().unscale_(optimizer)

        def step(self, optimizer, *args, **kwargs):
            rec("scaler.step(")
            out = super().step(optimizer, *args, **kwargs)
            rec(")")
            return out

        def update(self, new_scale=None):
            rec("update")
            return super().update(new_scale)

    return Scaler("cpu", enabled=enabled)


@pytest.mark.parametrize("fused", [True, False], ids=["device-decision", "host-decision"])
@pytest.mark.parametrize("scaling", [False, True], ids=["fp32", "fp16-scaler"])
def test_the_steps_calls_come_in_horovods_order(monkeypatch, fused, scaling):
    """k = 2 windows: forward and backward twice (each backward through the scaler), then
    Horovod's synchronize once (the end of backward()), then update(): unscale and clip, the
    optimizer step inside skip_synchronize (fp16: through the scaler, then its update; a fused
    optimizer deciding the skip on the device steps itself and the scaler updates after),
    zero_grad."""
    rec = Recorder()
    model = model_()
    model.decoder.weight.register_post_accumulate_grad_hook(lambda p: rec("backward"))
    opt = recording_optimizer(rec, model.parameters(), distributed=True, fused=fused)
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: rec("clip") or real_clip(*a, **k))
    spec = StepSpec(CPU, "fp32", grad_clip=0.5, k=2, clock=lambda part: rec(f"<{part}>"))
    scaler = recording_scaler(rec, scaling)
    g = step_backward(model, opt, scaler, windows(2), model.init_state(B), spec)
    rec("between")  # where the loop counts the previous step
    r = step_update(opt, scaler, g, spec)
    if not scaling:
        update = ["skip_synchronize(", "step", ")"]
    elif fused:  # the device decision: the optimizer's step with found_inf, then the scale
        update = ["skip_synchronize(", "step", "update", ")"]
    else:
        update = ["skip_synchronize(", "scaler.step(", "step", ")", "update", ")"]
    window = ["<forward>", "scale", "backward", "<backward>"]
    assert rec.events == [*window, *window, "synchronize", "<synchronized>", "between",
                          "unscale", "clip", *update, "zero_grad", "<updated>"]
    assert r.read().applied is True and r.chars == sum(w.chars for w in windows(2))
    assert all(p.grad is None for p in model.parameters())  # zero_grad: set to None


def test_a_plain_optimizer_has_nothing_to_wait_for():
    """A plain torch optimizer (one process without Horovod; DDP, reduced inside backward):
    no synchronize and no skip_synchronize, and no wait measured."""
    rec = Recorder()
    model = model_()
    opt = recording_optimizer(rec, model.parameters(), distributed=False, fused=False)
    r = train_step(model, opt, recording_scaler(rec, False), windows(1), model.init_state(B),
                   StepSpec(CPU, grad_clip=1.0))
    assert rec.events == ["scale", "unscale", "step", "zero_grad"]
    assert r.wait_s == 0.0


def test_the_step_only_reads_its_windows():
    """A list of windows is left as it was (the same batches, in order); an iterator is read
    once to its end; a number of windows other than k is refused."""
    model = model_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ws = windows(2)
    given = list(ws)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_step(model, opt, scaler, ws, model.init_state(B), StepSpec(CPU, k=2))
    assert len(ws) == 2 and all(a is b for a, b in zip(ws, given))
    it = iter(windows(2))
    train_step(model, opt, scaler, it, model.init_state(B), StepSpec(CPU, k=2))
    assert next(it, None) is None
    with pytest.raises(ValueError, match="1 window"):
        train_step(model, opt, scaler, windows(1), model.init_state(B), StepSpec(CPU, k=2))


# ---- k = 2 against nanoGPT's loop ---------------------------------------------------------------

def nanogpt_steps(model, opt, ws: list[Batch], k: int, grad_clip: float):
    """Gradient accumulation as nanoGPT's train.py writes it: per micro-step the forward, the
    mean loss over the real targets / k, backward; then clip, step, zero the gradients. The
    recurrent state is carried across windows, detached (truncated BPTT)."""
    state = model.init_state(B)
    for s in range(len(ws) // k):
        for micro in range(k):
            b = ws[s * k + micro]
            logits, state = model(b.inputs, (state[0].detach(), state[1].detach()),
                                  reset=b.reset)  # [B, T, 256]
            loss = F.cross_entropy(logits.reshape(-1, 256), b.targets.reshape(-1),
                                   ignore_index=IGNORE)
            (loss / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return state


@pytest.mark.parametrize("optimizer", ["fused-adam", "sgd"])
def test_k2_equals_a_plain_loop(optimizer):
    """Two optimizer steps of k = 2 windows each (padding in some), clipping at a norm the
    gradients exceed: train_step's parameters and final state equal the plain loop's (fp32
    rounding: the two sum the loss in other orders), and its summed NLL is the loop's mean loss
    x targets."""
    def make():
        model = model_(1)
        if optimizer == "sgd":
            return model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)

    ws = windows(4, seed=3)
    model, opt = make()
    want_state = nanogpt_steps(model, opt, ws, k=2, grad_clip=0.05)
    want = dict(model.named_parameters())

    model, opt = make()
    state, nats = model.init_state(B), []
    spec = StepSpec(CPU, "fp32", grad_clip=0.05, k=2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for s in range(2):
        r = train_step(model, opt, scaler, iter(ws[2 * s:2 * s + 2]), state, spec).read()
        assert r.applied and r.grad_norm > 0.05  # the clip was active
        state, nats = r.state, nats + [float(r.nats)]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name].detach(), rtol=1e-5, atol=1e-6)
    for got, exp in zip(state, want_state):
        torch.testing.assert_close(got, exp.detach(), rtol=1e-5, atol=1e-6)
    # the first step's NLL, from the same start: the plain loop's forward
    first = model_(1)
    st, total = first.init_state(B), 0.0
    for b in ws[:2]:
        with torch.no_grad():
            logits, st = first(b.inputs, st, reset=b.reset)
        total += float(F.cross_entropy(logits.reshape(-1, 256), b.targets.reshape(-1),
                                       ignore_index=IGNORE, reduction="sum"))
    assert nats[0] == pytest.approx(total, rel=1e-6)


# ---- the benchmarks call it once per step they time ---------------------------------------------

class Counted:
    """train_step, counting its calls by the model each is for (and whether it had a clock)."""

    def __init__(self):
        self.models: list[int] = []
        self.clocked: list[bool] = []

    def __call__(self, model, optimizer, scaler, windows, state, spec):
        self.models.append(id(model))
        self.clocked.append(spec.clock is not None)
        return train_step(model, optimizer, scaler, windows, state, spec)


def test_bench_gpu_times_one_step_per_timed_step(monkeypatch):
    """bench gpu's training row: every timed call of its step is one train_step."""
    from benchmarks import bench_gpu as bg

    counted = Counted()
    monkeypatch.setattr(bg, "train_step", counted)
    timed = []

    def timer(fn, n):
        before = len(counted.models)
        for _ in range(n):
            fn()
        timed.append((n, len(counted.models) - before))
        return n * 0.01

    v = bg.Variant("mlstm", "fused", "torch")
    r = bg.train_step_rate(v, 16, 4, 2, 4, "fp32", CPU, timer, steps=3, warmup=1, repeats=2)
    assert timed == [(3, 3), (3, 3)]
    assert r["chars_per_s"] == pytest.approx(2 * 4 / 0.01)


def test_bench_train_times_one_step_per_timed_step(monkeypatch, capsys):
    """bench train's worker (one rank, on the torch engine's world of one), two models
    alternating: each model's step is one train_step per step, warm-up and timed, and each
    timed step is one of its step times."""
    from benchmarks import bench_train as bt
    from hvd_lm.comm import engine, torch_engine

    monkeypatch.setattr(engine, "_hvd", functools.cache(lambda: torch_engine))
    counted = Counted()
    monkeypatch.setattr(bt, "train_step", counted)
    cfg = bt.WorkerConfig(hidden_size=16, embed_dim=8, batch_size=2, seq_len=8, steps=3,
                          warmup=1, backend="horovod", rnn_impl=["fused", "reference"],
                          rnn_kernels=["torch", "auto"], cuda_graphs=[False, False])
    threads = torch.get_num_threads()
    try:
        assert bt.worker(cfg) == 0
    finally:
        torch.set_num_threads(threads)
        torch_engine.shutdown()
    recs = [json.loads(line[len("BENCH "):]) for line in capsys.readouterr().out.splitlines()
            if line.startswith("BENCH ")]
    assert [r["variant"] for r in recs] == ["fused/torch", "reference"]
    assert all(len(r["step_times_s"]) == 3 for r in recs)
    first, second = counted.models[0], counted.models[1]
    assert counted.models == [first, second] * 4  # round robin, step by step


def test_bench_multinode_times_one_step_per_step(monkeypatch):
    """bench multinode's step parts: one train_step per step, each with the clock that times
    its parts."""
    from benchmarks.bench_multinode import MultinodeConfig, measure_backward_window

    counted = Counted()
    monkeypatch.setattr(step_mod, "train_step", counted)  # bench_multinode imports it late
    cfg = MultinodeConfig(hosts="n1:1,n2:1", network_interface="eth0", shards="/s",
                          hidden_size=16, embed_dim=8, seq_len=4, batch_size=2)
    w = measure_backward_window(cfg, steps=3, skip=1)
    assert len(counted.models) == 1 + 3 and all(counted.clocked)
    assert w["step_s"] > 0
