"""Checks of the installed Horovod stack: `horovodrun --check-build`, parsed.

`horovodrun --check-build` prints, per section (Available Frameworks / Controllers / Tensor
Operations), one line per component, ``[X] Name`` when built in and ``[ ] Name`` when not
(Horovod docs, "Install": "Check build"). :func:`parse_check_build` turns that text into data and
:func:`missing_components` names what a training host needs but lacks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hvd_lm.options import Command, option

_LINE = re.compile(r"^\s*\[(?P<mark>[ Xx])\]\s+(?P<name>\S.*?)\s*$")
_VERSION = re.compile(r"Horovod v(?P<version>\S+?):?\s*$")
#: The sections' headings (``Available Frameworks:``...), as :class:`BuildInfo`'s fields.
_SECTIONS = ("frameworks", "controllers", "tensor operations")


@dataclass
class BuildInfo:
    """What one Horovod build supports.

    Attributes:
        version: Horovod version string, e.g. ``"0.28.1"``.
        frameworks / controllers / tensor_operations: section -> {component name: built in?}.
    """

    version: str = ""
    frameworks: dict[str, bool] = field(default_factory=dict)
    controllers: dict[str, bool] = field(default_factory=dict)
    tensor_operations: dict[str, bool] = field(default_factory=dict)


def parse_check_build(text: str) -> BuildInfo:
    """Parse the text printed by ``horovodrun --check-build``.

    Raises:
        ValueError: when the text holds no ``Horovod vX.Y.Z`` header or no ``[X]``/``[ ]`` lines,
            i.e. it is not check-build output.
    """
    info = BuildInfo()
    section: dict[str, bool] | None = None
    seen = 0
    for line in text.splitlines():
        m = _VERSION.search(line)
        low = line.strip().lower()
        head = next((name for name in _SECTIONS if low.startswith("available " + name)), None)
        if m:
            info.version = m.group("version")
        elif head is not None:
            section = getattr(info, head.replace(" ", "_"))
        elif (m := _LINE.match(line)) and section is not None:
            section[m.group("name")] = m.group("mark") in "Xx"
            seen += 1
    if not info.version or not seen:
        raise ValueError(f"not `horovodrun --check-build` output:\n{text[:500]}")
    return info


def missing_components(info: BuildInfo, need_nccl: bool = False) -> list[str]:
    """Names of the components hvd_lm needs that ``info`` lacks (empty list when all are there).

    Needed: the PyTorch framework, the MPI and Gloo controllers, and with ``need_nccl`` (CUDA
    hosts) the NCCL tensor operations.
    """
    needed = [(info.frameworks, "PyTorch", "framework"), (info.controllers, "MPI", "controller"),
              (info.controllers, "Gloo", "controller")]
    if need_nccl:
        needed.append((info.tensor_operations, "NCCL", "tensor operations"))
    return [f"{name} {what}" for section, name, what in needed if not section.get(name)]


def check_build(need_nccl: bool | None = None) -> BuildInfo:
    """Run ``horovodrun --check-build`` (the one beside the running interpreter, the venv's,
    else on PATH) and verify it; return the parsed info.

    Args:
        need_nccl: require NCCL; ``None`` means "when torch sees a CUDA build".

    Raises:
        FileNotFoundError: no ``horovodrun`` (Horovod is not installed).
        RuntimeError: naming every missing component, or when the command fails.
    """
    found = (shutil.which("horovodrun", path=str(Path(sys.executable).parent))
             or shutil.which("horovodrun"))
    if not found:
        raise FileNotFoundError("horovodrun not found: run `make setup` (scripts/setup.sh)")
    proc = subprocess.run([found, "--check-build"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"horovodrun --check-build failed ({proc.returncode}):\n{proc.stderr}")
    info = parse_check_build(proc.stdout)
    missing = missing_components(info, bool(torch.version.cuda) if need_nccl is None else need_nccl)
    if missing:
        raise RuntimeError(f"Horovod {info.version} lacks: {', '.join(missing)}. Rebuild with "
                           "HVD_LM_REBUILD=1 scripts/setup.sh (see scripts/build_horovod.sh).")
    return info


@dataclass
class CheckBuildConfig:
    """``hvd-lm check-build``."""

    nccl: bool = option(False, "also require NCCL (default: only on CUDA hosts)", switch=True)


def check_build_command(cfg: CheckBuildConfig) -> int:
    """``hvd-lm check-build``: print the built components (errors: what is missing, exit 1)."""
    info = check_build(need_nccl=True if cfg.nccl else None)
    built = [n for sec in (info.frameworks, info.controllers, info.tensor_operations)
             for n, ok in sec.items() if ok]
    print(f"Horovod {info.version}: built with {', '.join(dict.fromkeys(built))}")
    return 0


CHECK_BUILD = Command(CheckBuildConfig, check_build_command, config_flag=False,
                      description="Parse `horovodrun --check-build` and fail naming any of "
                      "PyTorch, MPI, Gloo (and NCCL on CUDA hosts) that is missing.")
