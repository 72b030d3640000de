"""The trainer's checkpointer alone (hvd_lm.train.checkpointer), on one process with the one-rank
engine (comm.torch_engine): what torch.load reads back from the file it writes is the tiny
model's tensors, the optimizer's and schedule's state, the recurrent state and the position with
the exact character count; the ``checkpoint`` record names that file; a write in the background
holds the tensors of the moment it was asked for; a run above the divergence bound writes
nothing and says so."""
from __future__ import annotations

import pytest
import torch

from hvd_lm.comm import engine, torch_engine
from hvd_lm.comm.world import RankContext
from hvd_lm.formats import checkpoint as ckpt_io
from hvd_lm.train.checkpointer import Checkpointer
from hvd_lm.train.counting import CharCount
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.log import read_metrics
from hvd_lm.train.metrics import Metrics
from hvd_lm.train.resume import Position, Resume
from hvd_lm.train.schedule import LRPlan
from hvd_lm.train.settings import TrainConfig

H, B = 6, 2


@pytest.fixture
def one_rank(monkeypatch):
    """Collectives on the one-rank engine (what a process without Horovod runs on)."""
    monkeypatch.setattr(engine, "_hvd", lambda: torch_engine)
    torch_engine.init()
    yield
    torch_engine.shutdown()


def tiny(tmp_path, asynchronous=False, guard=None):
    """A checkpointer over a 2-layer model after one Adam step, rank 0's log open."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, H), torch.nn.Linear(H, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = LRPlan(0.1, 0, 100)
    sched.replan(1, 50)
    model(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    metrics = Metrics(tmp_path, tensorboard=False)
    metrics.open(None, 0)
    guard = guard or DivergenceGuard(max_loss=10.0, logs=3, max_skipped=0)
    cfg = TrainConfig()
    cfg.run.out_dir, cfg.run.keep_checkpoints = str(tmp_path), 3
    cfg.run.async_checkpoint = asynchronous
    ck = Checkpointer(cfg, model, opt, sched, scaler, guard, metrics)
    return ck, model, opt, sched, metrics


def test_the_file_holds_what_was_saved_and_the_record_names_it(one_rank, tmp_path):
    ck, model, opt, sched, metrics = tiny(tmp_path)
    pos = Position(step=7, window=9, skipped_steps=1, chars_trained=100)
    h, c = torch.randn(B, H), torch.randn(B, H)
    chars = CharCount(100)
    chars.add(23)
    seconds = ck.save(pos, (h, c), chars, RankContext(rank=0, size=1), windows_per_epoch=40)
    metrics.close()

    assert seconds >= 0 and ck.saved_step == 7 and pos.chars_trained == 100  # pos unchanged
    path = tmp_path / "checkpoints" / "step_00000007.pt"
    assert ck.newest() == path
    saved = torch.load(path, weights_only=False)
    assert (saved["step"], saved["window"], saved["skipped_steps"], saved["chars_trained"]) == (
        7, 9, 1, 123)
    assert (saved["world_size"], saved["windows_per_epoch"]) == (1, 40)
    assert saved["config"]["run"]["out_dir"] == str(tmp_path)
    assert saved["config"] == TrainConfig().to_dict() | {"run": saved["config"]["run"]}
    assert saved["model"].keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(saved["model"][k], v), k
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], exp_avg)
    assert saved["lr_plan"] == sched.state_dict() and saved["lr_plan"]["anchor_step"] == 1
    assert saved["scaler"] is None
    assert torch.equal(saved["rnn_state"][0], h) and torch.equal(saved["rnn_state"][1], c)
    [rec] = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "checkpoint"]
    assert rec["step"] == 7 and rec["path"] == str(path)
    assert rec["write_s"] >= 0 and rec["blocked_s"] >= 0


def test_a_background_write_keeps_the_tensors_of_the_save(one_rank, tmp_path):
    ck, model, *_ = tiny(tmp_path, asynchronous=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(Position(step=3), (torch.zeros(B, H), torch.zeros(B, H)), CharCount(0),
            RankContext(), windows_per_epoch=5)
    with torch.no_grad():  # the loop trains on while the file is written
        for p in model.parameters():
            p.add_(1.0)
    ck.wait()
    saved = torch.load(tmp_path / "checkpoints" / "step_00000003.pt", weights_only=False)
    for k, v in before.items():
        assert torch.equal(saved["model"][k], v), k


def test_above_the_divergence_bound_nothing_is_written(one_rank, tmp_path):
    guard = DivergenceGuard(max_loss=1.0, logs=3, max_skipped=0)
    guard.logged(4, 2.5)  # the newest logged loss is above the bound
    ck, _, _, _, metrics = tiny(tmp_path, guard=guard)
    seconds = ck.save(Position(step=4), (torch.zeros(B, H), torch.zeros(B, H)), CharCount(0),
                      RankContext(), windows_per_epoch=5)
    metrics.close()
    assert seconds == 0.0 and ck.saved_step is None and ck.newest() is None
    assert not (tmp_path / "checkpoints").exists()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["step"], r["loss"]) for r in recs] == [("checkpoint_held", 4, 2.5)]


def test_the_checkpoint_loads_through_the_project_reader(one_rank, tmp_path):
    ck, *_ = tiny(tmp_path)
    ck.save(Position(step=2), (torch.ones(B, H), torch.ones(B, H)), CharCount(5), RankContext(),
            windows_per_epoch=5)
    assert ckpt_io.load(ck.newest())["chars_trained"] == 5


def test_a_rank_but_0_maps_the_file_and_takes_its_rows_alone(one_rank, tmp_path):
    """What a resume reads on a rank other than 0 (the others get rank 0's weights and optimizer
    state by broadcast): its own B rows of the saved recurrent state, the LR plan and the
    position; its model keeps its own weights (names and shapes checked), its optimizer stays
    empty, and the tensors come from a memory map of the file (read only where touched)."""
    ck, model, opt, sched, _ = tiny(tmp_path)
    rows = torch.arange(3 * B * H, dtype=torch.float32).view(3 * B, H)  # 3 ranks' rows
    ck.save(Position(step=5, window=6), (rows, -rows), CharCount(0), RankContext(),
            windows_per_epoch=9)
    ck.wait()
    (tmp_path / "other").mkdir()
    other, _, other_sched, *_ = tiny(tmp_path / "other")[1:]
    for p in other.parameters():
        torch.nn.init.constant_(p, 0.5)
    other_sched.reset(7)  # another line: the saved one must replace it
    resume = Resume(ck.newest(), root=False)
    resume.restore_model(other)
    resume.restore_optimizer(torch.optim.Adam(other.parameters()), other_sched)
    assert all(bool((p == 0.5).all()) for p in other.parameters())
    assert other_sched.state_dict() == sched.state_dict()
    h, c = resume.rnn_rows(1, 3, B)
    assert torch.equal(h, rows[B:2 * B]) and torch.equal(c, -rows[B:2 * B])
    assert (resume.position.step, resume.position.window) == (5, 6)
    root = Resume(ck.newest())  # rank 0 reads the weights and the optimizer state
    fresh = torch.optim.Adam(other.parameters())
    root.restore_model(other)
    root.restore_optimizer(fresh, other_sched)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])


def test_one_save_protocol_round_trips_every_part():
    """A checkpoint and an elastic commit hold the same train_state: each part's state_dict()
    (position, LR plan, loss scaler, divergence guard), given back by load_train_state to
    fresh objects that then hold the same state."""
    from hvd_lm.train.resume import load_train_state, train_state

    plan, guard = LRPlan(3e-3, 5, 100), DivergenceGuard(max_loss=10.0, logs=3, max_skipped=2)
    plan.replan(40, 70)
    guard.logged(7, 12.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    pos = Position(step=40, window=44, skipped_steps=1, chars_trained=9000, trained_s=12.5)
    state = train_state(pos, plan, scaler, guard, world_size=4, windows_per_epoch=30)
    assert (state["step"], state["world_size"], state["windows_per_epoch"]) == (40, 4, 30)
    plan2, guard2 = LRPlan(1.0, 0, 1), DivergenceGuard(max_loss=10.0, logs=3, max_skipped=2)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    assert load_train_state(state, plan2, scaler2, guard2) == pos
    assert plan2.state_dict() == plan.state_dict() and guard2.above == [(7, 12.0)]
    assert scaler2.get_scale() == 512.0
    assert load_train_state(state, LRPlan(1.0, 0, 1)) == pos  # the scaler, the guard: left
