"""A fixed small regression problem shared by the multi-process tests and their references."""
import torch


def make_problem(global_batch: int, seed: int = 0):
    """(model, x [global_batch, 16], y [global_batch, 4]) with fixed seeds; same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(global_batch, 16, generator=g)
    y = torch.randn(global_batch, 4, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, x, y


def train_steps(model, opt, x, y, steps: int) -> None:
    """``steps`` full-batch SGD steps of mean-squared error on (x, y)."""
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
