"""Units shared by the benchmarks, the scaling model and the Horovod settings.

Sizes of messages and buffers are binary (KiB, MiB: powers of 1024, as Horovod's
``HOROVOD_FUSION_THRESHOLD`` and the bench sizes are given); bandwidths are decimal GB/s
(1e9 bytes/s), as nccl-tests report them.
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
