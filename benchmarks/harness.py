"""What every benchmark shares: running a child (a rank under ``mpirun``/``horovodrun``, a
training run, one fit) and collecting the JSON records it prints, the seeded LM with its
optimizer and step settings (:func:`lm_step`), the recurrences (:func:`rnn_impls`) and the synthetic
batches the training benches time, the median of repeated runs, the side-by-side table
(:func:`print_table`) and the ``--json`` file.

A child prints each record as one line ``<marker>{json}`` (or ``<marker>[json, ...]``) on
stdout; the marker is looked for anywhere in a line, since ``horovodrun`` prefixes its ranks'
output (``[0]<stdout>:``).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
from pathlib import Path
from types import SimpleNamespace

from hvd_lm.util.atomic import write_text


def run_child(cmd: list[str], timeout: float, env: dict | None = None,
              marker: str | None = "BENCH ", count: int | None = None) -> list:
    """Run ``cmd`` (output captured) and return the JSON of its ``marker`` lines, in order.

    Args:
        env: the child's environment (None: this process's).
        marker: the records' prefix; None: no records wanted, only a clean exit.
        count: the number of records the run must print (None: at least one).

    Raises:
        RuntimeError: a non-zero exit, or not the records asked for, with the tail of the
            child's stdout and stderr. subprocess.TimeoutExpired: past ``timeout`` seconds.
    """
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout.splitlines()
    recs = [json.loads(ln[ln.index(marker) + len(marker):]) for ln in out if marker in ln] \
        if marker else []
    if proc.returncode != 0 or (marker and (not recs or count not in (None, len(recs)))):
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return recs


def random_batches(steps: int, batch: int, seq_len: int, seed: int) -> list:
    """``steps`` training windows (:class:`hvd_lm.train.data.Batch`) of seeded random bytes (a
    step's time does not depend on the values): inputs and targets int64 [batch, seq_len], no
    resets, ``batch x seq_len`` chars."""
    import torch  # here: a bench's --help, and the reports, load no torch

    from hvd_lm.train.data import Batch

    data = torch.randint(0, 256, (steps, batch, seq_len + 1),
                         generator=torch.Generator().manual_seed(seed))
    return [Batch(d[:, :-1].contiguous(), d[:, 1:].contiguous(),
                  torch.zeros(batch, seq_len, dtype=torch.bool), batch * seq_len) for d in data]


def lm_step(model, device, precision: str = "fp32", batch: int = 1) -> SimpleNamespace:
    """What timing the loop's own training step needs, made alike by every bench: the LM of
    ``model`` (a :class:`hvd_lm.model.lm.ModelConfig`) seeded with 0 on ``device``, Adam as
    ``hvd-lm train`` builds it (:func:`hvd_lm.train.optim.build_optimizer`, LR 1e-4), the
    precision's scaler, the step's settings (clip at 1.0) and ``batch`` rows of zero state:
    ``namespace(model, opt, scaler, spec, state)``."""
    import torch

    from hvd_lm.model import device as devices
    from hvd_lm.model.lm import LanguageModel
    from hvd_lm.train.optim import build_optimizer
    from hvd_lm.train.settings import OptimConfig
    from hvd_lm.train.step import StepSpec

    torch.manual_seed(0)
    lm = LanguageModel(model).to(device)
    return SimpleNamespace(model=lm, opt=build_optimizer(lm, OptimConfig(), 1e-4),
                           scaler=devices.make_scaler(device, precision),
                           spec=StepSpec(device, precision, grad_clip=1.0),
                           state=lm.init_state(batch, device))


def rnn_impls(impls: list[str], kernels: list[str], graphs: list[bool]
                ) -> list[tuple[str, str, bool]]:
    """``(rnn_impl, rnn_kernels, cuda_graphs)`` of every mLSTM recurrence to time, in ``impls``
    order, duplicates dropped: a non-fused one once (``auto``, no graphs), ``fused`` once per
    (kernels, graphs) pair."""
    out = []
    for impl in dict.fromkeys(impls):
        out += ([("fused", k, g) for k in dict.fromkeys(kernels) for g in dict.fromkeys(graphs)]
                if impl == "fused" else [(impl, "auto", False)])
    return out


def medians(rows: list[dict], keys: tuple[str, ...]) -> dict:
    """``{key: median of row[key] over rows}``; None for a key no row has a value for."""
    return {k: statistics.median(vals) if (vals := [r[k] for r in rows if r.get(k) is not None])
            else None for k in keys}


def print_table(rows: list[dict], columns: list[tuple], header: bool = True) -> None:
    """The side-by-side table: a header line (unless not ``header``: rows printed as they are
    measured), then one line per row, columns one space apart, each line flushed.

    Args:
        columns: ``(header, spec, value)`` each: ``value`` a key of the row or a function of it,
            printed with the format ``spec`` (e.g. ``">8.3f"``, ``"22"``); the header takes the
            spec's alignment (left when it has none) and width; a value that is None prints
            ``-`` in that width.
    """
    shape = [re.match(r"([<>^]?)[+\- ]?(\d*)", spec).groups() for _, spec, _ in columns]
    if header:
        print(" ".join(f"{h:{a or '<'}{w}}" for (h, _, _), (a, w) in zip(columns, shape)))
    for r in rows:
        vals = [v(r) if callable(v) else r[v] for _, _, v in columns]
        print(" ".join(f"{'-':{a or '>'}{w}}" if x is None else format(x, spec)
                       for x, (_, spec, _), (a, w) in zip(vals, columns, shape)), flush=True)


def run_records(run_dir, kind: str | None = None) -> list[dict]:
    """The ``metrics.jsonl`` records (of ``kind``) a run folder holds so far (read by
    :func:`hvd_lm.train.log.read_metrics`, the one reader: torn lines skipped)."""
    from hvd_lm.train.log import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    return [r for r in read_metrics(path) if kind in (None, r.get("kind"))] if path.exists() \
        else []


def host() -> dict:
    """``{"cpus": logical CPUs, "load_avg_1min": the 1-minute load average}`` of this machine,
    beside a result measured on it."""
    return {"cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0]}


def save_json(path: str, data: dict, indent: int = 2) -> None:
    """Write ``data`` to ``path`` (atomically) as JSON; nothing when ``path`` is empty (no
    ``--json``). Values JSON lacks (paths, dtypes) are written as their ``str``."""
    if path:
        write_text(path, json.dumps(data, indent=indent, default=str) + "\n")
