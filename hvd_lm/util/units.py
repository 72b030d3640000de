"""Units shared by the benchmarks, the scaling model, the Horovod settings and the time limits.

Sizes of messages and buffers are binary (KiB, MiB: powers of 1024, as Horovod's
``HOROVOD_FUSION_THRESHOLD`` and the bench sizes are given); bandwidths are decimal GB/s
(1e9 bytes/s), as nccl-tests report them; durations are seconds (:func:`parse_duration` reads
the forms sbatch's ``--time`` and people write, as sbatch reads them).
"""

import math
import re

from hvd_lm.util.files import shown

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
#: bytes per second in one GB/s (decimal, as nccl-tests' algbw/busbw).
GB = 1e9


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"512K"``, ``"64M"``, ``"1.5G"``, ``"64KiB"``, ``"256MB"`` -> bytes (binary
    units: K = 1024; the suffix is case-insensitive and may end in B or iB).

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512K, 64M, 1G)")
    mult = {"": 1, "K": KIB, "M": MIB, "G": GIB, "T": 1024 * GIB}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


#: Longest duration :func:`parse_duration` accepts: 365 days (a job's walltime, a time limit).
MAX_DURATION_S = 365 * 86400
_UNIT_S = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
#: sbatch's ``--time`` forms (the sbatch manual): "minutes", "minutes:seconds",
#: "hours:minutes:seconds", "days-hours", "days-hours:minutes", "days-hours:minutes:seconds".
_SLURM_TIME = re.compile(r"(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                         r"|(?:(?:(?P<h>\d+):)?(?P<m>\d+):)?(?P<x>\d+))")
#: qsub's ``walltime`` form (PBS Professional's "duration"): "[[hours:]minutes:]seconds".
_PBS_TIME = re.compile(r"(?:(?:\d+:)?\d+:)?\d+")
_FORMS = ("e.g. 90s, 6m, 1.5h, or as sbatch's --time: minutes, minutes:seconds, "
          "hours:minutes:seconds, days-hours[:minutes[:seconds]]")


def parse_duration(text: str, what: str = "duration", bare: str = "minutes") -> int:
    """A duration in whole seconds, from a number and a unit (``"90s"``, ``"6m"``, ``"1.5h"``,
    ``"2d"``; units s, sec, m, min, h, d) or sbatch's ``--time`` forms, read as sbatch reads
    them: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S`` (so ``"10:00"`` is ten
    minutes). Source: the sbatch manual, ``--time``; PBS's ``walltime`` ``[[H:]M:]S`` agrees
    except for a bare number, which qsub reads as seconds (``bare="seconds"``).

    Args:
        what: how the error names the value (e.g. ``"--time-limit"``).
        bare: what a bare number counts: ``"minutes"`` (sbatch) or ``"seconds"`` (qsub).

    Raises:
        ValueError: not one of those forms, not positive, or over :data:`MAX_DURATION_S`, naming
            ``what`` and the forms.
    """
    t = str(text).strip()
    if re.search(r"\d{10}", t):  # int() of a long digit string could take long
        raise ValueError(f"{what} {t[:40]!r}: more than {MAX_DURATION_S // 86400} days")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", t, re.IGNORECASE)
    if m and m.group(2).lower() in _UNIT_S:
        total = float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    elif c := _SLURM_TIME.fullmatch(t):
        n = {k: int(v or 0) for k, v in c.groupdict().items()}
        if c.group("d") is not None:
            total = ((n["d"] * 24 + n["dh"]) * 60 + n["dm"]) * 60 + n["ds"]
        elif c.group("m") is None:  # a bare number
            total = n["x"] * (60 if bare == "minutes" else 1)
        else:  # M:S or H:M:S
            total = (n["h"] * 60 + n["m"]) * 60 + n["x"]
    else:
        raise ValueError(f"{what} {t[:40]!r}: not a duration ({_FORMS})")
    total = round(total)
    if total <= 0:
        raise ValueError(f"{what} {t[:40]!r} must be positive ({_FORMS})")
    if total > MAX_DURATION_S:
        raise ValueError(f"{what} {t[:40]!r} is {total / 86400:,.0f} days, more than "
                         f"{MAX_DURATION_S // 86400}")
    return int(total)


def duration_text(text: str) -> str:
    """A duration option kept as written ('' for none), once :func:`parse_duration` reads it.

    Raises:
        ValueError: as :func:`parse_duration`.
    """
    text = str(text).strip()
    if text:
        parse_duration(text, "duration")
    return text


def scheduler_time(text: str, scheduler: str, what: str = "--walltime") -> str:
    """The value of a job's time directive (``#SBATCH --time=``, ``#PBS -l walltime=``) for a
    duration :func:`parse_duration` reads: the text unchanged when it is already one of that
    scheduler's own forms (sbatch: ``M``, ``M:S``, ``H:M:S``, ``D-H[:M[:S]]``; qsub:
    ``[[H:]M:]S``), else ``H:MM:SS`` (``"4h"``, or ``D-H`` for PBS), which both read.

    Raises:
        ValueError: as :func:`parse_duration`, naming ``what``.
    """
    t = str(text).strip()
    seconds = parse_duration(t, what, bare="seconds" if scheduler == "pbs" else "minutes")
    native = _PBS_TIME if scheduler == "pbs" else _SLURM_TIME
    return t if native.fullmatch(t) else (
        f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}")


def parse_split(text) -> tuple:
    """``"1000,1,1"``, ``"0.9,0.05,0.05"`` or a sequence of numbers -> (train, val, test) ratios;
    missing ones are 0 (``prepare --split``, ``transfer --split``).

    Raises:
        ValueError: not 1-3 non-negative numbers with a positive sum.
    """
    try:
        parts = [float(x) for x in (str(text).split(",") if isinstance(text, str) else text)]
    except (TypeError, ValueError):
        raise ValueError(f"--split {shown(str(text), 80)}: expected up to three numbers, e.g. "
                         "1000,1,1") from None
    # finite, and a finite sum: 1e308,1e308,1 sums to inf and its fractions are NaN
    if not 1 <= len(parts) <= 3 or any(not p >= 0 or not math.isfinite(p) for p in parts) \
            or not 0 < sum(parts) < math.inf:
        raise ValueError(f"--split {shown(str(text), 80)}: expected 1-3 finite non-negative "
                         "numbers with a positive finite sum, e.g. 1000,1,1")
    return tuple(parts + [0.0] * (3 - len(parts)))
