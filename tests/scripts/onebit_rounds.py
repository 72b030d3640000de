"""The inputs of the 1-bit compressed allreduce's rounds (tests/parallel/test_optimizers.py,
tests/test_onebit.py): rank r's input in round t is drawn from a generator seeded with
(seed, t, r), so every rank can rebuild every rank's inputs."""

import numpy as np
import torch


def inputs(seed: int, t: int, r: int, numel: int) -> torch.Tensor:
    """Rank r's tensor of round t: a common drift plus rank noise (float32 [numel])."""
    g = np.random.default_rng([seed, t, r])
    base = np.random.default_rng([seed, t]).standard_normal(numel)
    return torch.from_numpy((base + 0.5 * g.standard_normal(numel)).astype(np.float32))
