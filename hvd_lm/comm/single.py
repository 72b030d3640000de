"""One process without Horovod: the part of ``horovod.torch``'s API that :mod:`hvd_lm.comm.engine`
calls, for a world of one rank when Horovod is not installed (a workstation, a GPU node before its
Horovod build). With one rank there is no collective to run, so each returns what Horovod 0.28.1
returns for one rank: ``allreduce`` (sum, average, max) and ``allgather`` a copy of the input,
``broadcast_*`` the root's own value, ``alltoall`` its input; and ``DistributedOptimizer``
returns the optimizer itself (Horovod's registers no gradient hooks at size 1:
``horovod/torch/optimizer.py``, ``if size() > 1 or HOROVOD_ELASTIC``), so a step is the same
with or without Horovod (``tests/test_train.py`` compares the two runs). The training step takes
an optimizer without ``synchronize()`` as it is (:mod:`hvd_lm.train.step`).

:func:`hvd_lm.comm.engine._hvd` picks this module only when ``import horovod.torch`` fails and
the launcher's environment announces one rank; more ranks without Horovod stop with one line.
Elastic training needs Horovod's driver: :data:`elastic` raises, naming what to install.
"""

from __future__ import annotations

import torch

#: What :func:`hvd_lm.comm.engine.rank_context` reports as the launcher.
LAUNCHER = "none (one process, no Horovod)"

# Horovod's reduction ops and compressors, by the names hvd_lm looks up.
Average, Sum, Max, Adasum = "average", "sum", "max", "adasum"


class Compression:
    """``hvd.Compression``'s names (nothing is sent, so neither compresses anything)."""

    none, fp16, bf16 = "none", "fp16", "bf16"


def init() -> None:
    """Nothing to start."""


def shutdown() -> None:
    """Nothing to stop."""


def rank() -> int:
    return 0


def size() -> int:
    return 1


def local_rank() -> int:
    return 0


def local_size() -> int:
    return 1


def mpi_enabled() -> bool:
    return False


def DistributedOptimizer(optimizer, **_):  # noqa: N802 - Horovod's name
    """``optimizer`` itself: Horovod's wrapper adds no hooks for one rank."""
    return optimizer


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Rank 0's parameters are already this process's."""


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    return obj


def allreduce(tensor: torch.Tensor, op=Average, name: str | None = None) -> torch.Tensor:
    """The sum, average or maximum over one rank: a copy of ``tensor``."""
    return tensor.clone()


def allreduce_(tensor: torch.Tensor, op=Average, name: str | None = None) -> torch.Tensor:
    return tensor


def allreduce_async_(tensor: torch.Tensor, op=Average, name: str | None = None) -> torch.Tensor:
    return tensor  # the handle synchronize() takes


def synchronize(handle: torch.Tensor) -> torch.Tensor:
    return handle


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """The concatenation over one rank along dim 0: a copy of ``tensor``."""
    return tensor.clone()


def gather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Rank 0's (the only rank's) ``tensor``."""
    return tensor


def allgather_object(obj, name: str | None = None) -> list:
    return [obj]


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None) -> torch.Tensor:
    return tensor.clone()


class _NoElastic:
    """``hvd.elastic`` without Horovod: any use names what is missing."""

    def __getattr__(self, name):
        raise RuntimeError("elastic training needs Horovod's elastic driver (horovodrun "
                           "--min-np ...); Horovod is not installed here: `make setup` "
                           "(docs/install.md)")


elastic = _NoElastic()
