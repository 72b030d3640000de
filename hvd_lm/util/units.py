"""Units shared by the benchmarks, the scaling model, the Horovod settings and the time limits.

Sizes of messages and buffers are binary (KiB, MiB: powers of 1024, as Horovod's
``HOROVOD_FUSION_THRESHOLD`` and the bench sizes are given); bandwidths are decimal GB/s
(1e9 bytes/s), as nccl-tests report them; durations are seconds (:func:`parse_duration` reads
the forms SLURM's ``--time`` and people write).
"""

import re

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
_CLOCK = re.compile(r"(?:(?P<d>\d+)-)?(?P<h>\d+)(?::(?P<m>\d+))?(?::(?P<s>\d+))?")


def parse_duration(text: str, what: str = "duration") -> int:
    """A duration in whole seconds, from ``"90s"``, ``"6m"``, ``"1.5h"``, ``"2d"`` (a number and
    a unit: s, sec, m, min, h, d), ``[D-]HH:MM:SS``, ``HH:MM``, ``D-HH`` or a plain number of
    minutes (SLURM's ``--time`` rule for a bare number).

    Args:
        what: how the error names the value (e.g. ``"--time-limit"``).

    Raises:
        ValueError: not one of those forms, not positive, or over :data:`MAX_DURATION_S`, naming
            ``what`` and the forms.
    """
    t = str(text).strip()
    forms = "e.g. 90s, 6m, 1.5h, 3:50:00, 1-00:00:00 or minutes"
    too_long = ValueError(f"{what} {t[:40]!r}: more than {MAX_DURATION_S // 86400} days")
    if re.search(r"\d{10}", t):  # int() of a long digit string could take long
        raise too_long
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", t, re.IGNORECASE)
    if m and m.group(2).lower() in _UNIT_S:
        total = float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    else:
        c = _CLOCK.fullmatch(t)
        if not c:
            raise ValueError(f"{what} {t[:40]!r}: not a duration ({forms})")
        d, h, mi, s = (int(c.group(k) or 0) for k in "dhms")
        if c.group("m") is None and c.group("d") is None:  # plain number = minutes (SLURM)
            h, mi = 0, h
        total = ((d * 24 + h) * 60 + mi) * 60 + s
    total = round(total)
    if total <= 0:
        raise ValueError(f"{what} {t[:40]!r} must be positive ({forms})")
    if total > MAX_DURATION_S:
        raise ValueError(f"{what} {t[:40]!r} is {total / 86400:,.0f} days, more than "
                         f"{MAX_DURATION_S // 86400}; give [D-]HH:MM:SS, HH:MM or minutes")
    return int(total)


def hms(seconds: float) -> str:
    """``H:MM:SS`` of a duration in seconds (rounded down to whole seconds)."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
