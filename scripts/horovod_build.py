"""How to build Horovod 0.28.1 on this machine: the decisions ``scripts/build_horovod.sh`` acts on.

Horovod 0.28.1 (the last release) needs, on today's stack (each found the hard way on a CPU box
and on a CUDA 13 / g++ 13 / CMake 4 H100 node, see ``../shared/README.md``):

* C++17: both ``CMakeLists.txt`` and ``horovod/torch/CMakeLists.txt`` ask for C++14, PyTorch >= 2.1
  headers need C++17 (upstream issue #3996, fixed by PR #3998, unreleased); for CUDA builds
  ``horovod/common/ops/cuda/CMakeLists.txt`` needs ``CMAKE_CUDA_STANDARD 17`` too.
* g++ >= 13 no longer includes ``<cstdint>``, ``<string>`` and ``<stdexcept>`` transitively
  (gcc.gnu.org/gcc-13/porting_to.html): ``group_table.h`` stops at ``std::string`` and
  ``common.h`` at ``std::logic_error``. Upstream PR #3957 (unreleased) adds the includes to the
  headers; :func:`patch_sources` does the same, and, as in the build that worked on the H100,
  :func:`build_env` puts ``-include cstdint -include string -include stdexcept`` into
  ``CXXFLAGS`` so that every translation unit has them, not only the two headers' includers
  (:data:`GXX13_INCLUDES`; harmless for older compilers, so always: the CPU builds here use the
  same flags as the node).
* CMake >= 4 refuses ``cmake_minimum_required`` below 3.5: ``CMAKE_POLICY_VERSION_MINIMUM=3.5``.
* NCCL for the GPU allreduce: a system install (``HOROVOD_NCCL_HOME``, ``/usr``, CUDA's folder) or
  the ``nvidia-nccl-cu*`` wheel beside a pip-installed CUDA torch, which ships only
  ``libnccl.so.2``; Horovod's FindNCCL wants ``libnccl.so``, so a private folder with that link is
  made (:func:`nccl_link_dir`), never touching site-packages.
* ``HOROVOD_BUILD_CUDA_CC_LIST`` from ``TORCH_CUDA_ARCH_LIST`` or the local GPU (else nvcc builds
  every architecture it knows, several times slower).

``python scripts/horovod_build.py env [WORK]`` prints the ``export`` lines (and the wheel-cache
key); ``python scripts/horovod_build.py patch SRC`` patches an unpacked sdist. Both take their
facts from :func:`probe` so tests can give fabricated ones. This script stands beside the
installed package (only the build uses it) and imports nothing of it.
"""

import contextlib
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
#: The headers g++ >= 13 no longer includes transitively, forced into every C++ translation unit
#: (``-include``), as the build that worked on the H100 (g++ 13.3) did: the header patches below
#: cover the two files known to stop, these any other.
GXX13_INCLUDES = ("cstdint", "string", "stdexcept")
#: The includes each header gets (upstream PR #3957), after its include guard / pragma once.
_HEADER_INCLUDES = {
    "horovod/common/group_table.h": ("#include <string>", "#include <cstdint>"),
    "horovod/common/common.h": ("#include <stdexcept>", "#include <cstdint>", "#include <string>"),
}


class BuildError(RuntimeError):
    """A prerequisite of the Horovod build is missing; the message says what to install/set."""


@dataclass
class Facts:
    """What the build decisions depend on (:func:`probe` reads them from this machine).

    Attributes:
        torch_version / torch_cuda: ``torch.__version__`` and ``torch.version.cuda`` (None: CPU).
        capabilities: compute capabilities of the visible GPUs, e.g. ``[(9, 0)]``.
        torch_cuda_arch_list: ``$TORCH_CUDA_ARCH_LIST`` ('' when unset), e.g. ``"8.0 9.0+PTX"``.
        cmake_major: CMake's major version (0: not found).
        nvcc: path of nvcc ('' when not found; CUDA builds need it).
        nccl_home: ``$HOROVOD_NCCL_HOME`` (or ``$NCCL_HOME``) when set.
        site_packages: folders searched for the ``nvidia/nccl`` wheel.
        system_nccl_dirs: folders searched for a system ``libnccl.so*``.
        mpi_version: first line of ``mpirun --version`` ('' without MPI).
        python_tag: e.g. ``py311``.
        cxxflags: ``$CXXFLAGS`` of the caller ('' when unset), kept before the added includes.
    """

    torch_version: str = ""
    torch_cuda: str | None = None
    capabilities: list[tuple[int, int]] = field(default_factory=list)
    torch_cuda_arch_list: str = ""
    cmake_major: int = 0
    nvcc: str = ""
    nccl_home: str = ""
    site_packages: list[str] = field(default_factory=list)
    system_nccl_dirs: list[str] = field(default_factory=lambda: [
        "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/cuda/lib64",
        "/usr/local/nccl/lib"])
    mpi_version: str = ""
    python_tag: str = ""
    cxxflags: str = ""


def _first_match(cmd: list[str], pattern: str) -> str:
    """The first group of ``pattern`` (multi-line) in ``cmd``'s output, '' when none/no cmd."""
    out = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    m = re.search(pattern, out, re.M)
    return m.group(1) if m else ""


def probe() -> Facts:
    """The :class:`Facts` of this machine (imports torch; runs g++, cmake, mpirun)."""
    import torch  # the interpreter the build is for: a CPU or CUDA torch

    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return Facts(
        torch_version=torch.__version__, torch_cuda=torch.version.cuda,
        capabilities=sorted({torch.cuda.get_device_capability(i)
                             for i in range(torch.cuda.device_count())}),  # 0 on a CPU torch
        torch_cuda_arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
        cmake_major=int(_first_match(["cmake", "--version"], r"version (\d+)") or 0),
        nvcc=shutil.which("nvcc") or shutil.which("nvcc", path=f"{cuda_home}/bin") or "",
        nccl_home=os.environ.get("HOROVOD_NCCL_HOME", os.environ.get("NCCL_HOME", "")),
        site_packages=package_dirs(torch.__file__, sys.path),
        mpi_version=_first_match(["mpirun", "--version"], r"\A(.*)$"),
        python_tag=f"py{sys.version_info[0]}{sys.version_info[1]}",
        cxxflags=os.environ.get("CXXFLAGS", ""))


def package_dirs(torch_file: str, path: list[str]) -> list[str]:
    """Folders where pip may have put the ``nvidia-nccl-cu*`` wheel: the one holding torch
    (the wheel is installed beside the CUDA torch that needs it), this interpreter's purelib and
    platlib, and every ``sys.path`` entry named ``site-packages`` or ``dist-packages`` (Debian's
    and Ubuntu's system Pythons install into ``dist-packages``), without duplicates."""
    names = ("site-packages", "dist-packages")
    return list(dict.fromkeys([str(Path(torch_file).resolve().parent.parent),
                               sysconfig.get_path("purelib"), sysconfig.get_path("platlib"),
                               *[p for p in path if Path(p).name in names]]))


def cuda_cc_list(f: Facts) -> str:
    """``HOROVOD_BUILD_CUDA_CC_LIST``: ``TORCH_CUDA_ARCH_LIST`` (``"8.0 9.0+PTX"`` -> ``"80,90"``;
    the architecture-specific ``9.0a`` / family ``10.0f`` items, as the H100 image sets, build
    Horovod's few CUDA kernels for the plain capability: ``"90"``, ``"100"``) when set, else the
    local GPUs' capabilities (``"90"``), else '' (nvcc's whole list).

    Raises:
        BuildError: an unreadable ``TORCH_CUDA_ARCH_LIST``.
    """
    items = re.split(r"[;,\s]+", f.torch_cuda_arch_list.strip())
    if items == [""]:
        return ",".join(f"{a}{b}" for a, b in f.capabilities)
    matches = [re.fullmatch(r"(\d+)\.(\d+)[af]?(\+PTX)?", item) for item in items]
    if not all(matches):
        raise BuildError(f"TORCH_CUDA_ARCH_LIST={f.torch_cuda_arch_list!r}: expected "
                         "items like 8.0, 9.0, 9.0a or 9.0+PTX")
    return ",".join(dict.fromkeys(m.group(1) + m.group(2) for m in matches))


def find_nccl(f: Facts) -> tuple[str, str, str]:
    """(include dir, lib dir, where) of an NCCL installation: ``HOROVOD_NCCL_HOME``, then the
    ``nvidia-nccl-cu*`` wheel beside torch, then the system folders.

    Raises:
        BuildError: none found (says what to install or set).
    """
    if f.nccl_home:
        if not os.path.exists(f"{f.nccl_home}/include/nccl.h"):
            raise BuildError(f"HOROVOD_NCCL_HOME={f.nccl_home}: no include/nccl.h there")
        return f"{f.nccl_home}/include", f"{f.nccl_home}/lib", "HOROVOD_NCCL_HOME"
    for sp in dict.fromkeys(f.site_packages):
        wheel = f"{sp}/nvidia/nccl"
        if os.path.exists(f"{wheel}/include/nccl.h") and glob.glob(f"{wheel}/lib/libnccl.so*"):
            return f"{wheel}/include", f"{wheel}/lib", f"the nvidia-nccl wheel in {sp}"
    for d in f.system_nccl_dirs:
        incs = ("/usr/include", "/usr/local/cuda/include", str(Path(d).parent / "include"))
        inc = next((i for i in incs if os.path.exists(f"{i}/nccl.h")), "")
        if inc and glob.glob(f"{d}/libnccl.so*"):
            return inc, d, f"the system install in {d}"
    raise BuildError(
        "CUDA torch found but no NCCL for Horovod's GPU allreduce: install the NCCL wheel that "
        f"matches torch's CUDA {f.torch_cuda} (pip install nvidia-nccl-cu"
        f"{(f.torch_cuda or '12').split('.')[0]}), or the system packages (libnccl2 libnccl-dev), "
        "or set HOROVOD_NCCL_HOME to a folder with include/nccl.h and lib/libnccl.so*")


def nccl_link_dir(lib_dir: str, work: Path) -> str:
    """A folder where ``libnccl.so`` exists: ``lib_dir`` itself when it has one, else ``work``
    with links ``libnccl.so`` and ``libnccl.so.2`` to ``lib_dir``'s ``libnccl.so.2`` (the pip
    wheel ships only the ``.so.2``; Horovod's FindNCCL looks for ``libnccl.so``)."""
    if (Path(lib_dir) / "libnccl.so").exists():
        return lib_dir
    target = sorted(glob.glob(f"{lib_dir}/libnccl.so.*"))
    if not target:
        raise BuildError(f"{lib_dir}: no libnccl.so*")
    work.mkdir(parents=True, exist_ok=True)
    for name in ("libnccl.so", "libnccl.so.2"):
        (work / name).unlink(missing_ok=True)
        (work / name).symlink_to(target[0])
    return str(work)


def build_env(f: Facts, work: Path) -> dict[str, str]:
    """The environment of the Horovod build for ``f`` (``work``: a scratch folder for the NCCL
    link), plus ``HVD_LM_CACHE_KEY`` (Horovod, torch, CUDA, NCCL, Python and MPI versions).
    ``CXXFLAGS`` is the caller's followed by ``-include H`` for each header of
    :data:`GXX13_INCLUDES` it does not force already.

    Raises:
        BuildError: a CUDA torch without nvcc or NCCL (naming what to install).
    """
    forced = re.findall(r"(?<!\S)-include\s+(\S+)", f.cxxflags)
    extra = " ".join(f"-include {h}" for h in GXX13_INCLUDES if h not in forced)
    env = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITH_MPI": "1", "HOROVOD_WITH_GLOO": "1",
           "HOROVOD_WITHOUT_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1",
           "CXXFLAGS": f"{f.cxxflags.strip()} {extra}".strip()}
    if f.cmake_major >= 4:
        env["CMAKE_POLICY_VERSION_MINIMUM"] = "3.5"
    gpu = ""  # CPU keys as before: old caches still hit
    if f.torch_cuda:
        if not f.nvcc:
            raise BuildError(
                f"torch is a CUDA {f.torch_cuda} build but nvcc was not found: install the CUDA "
                "toolkit (or put its bin/ on PATH, or set CUDA_HOME), or use a CPU torch")
        inc, lib, _ = find_nccl(f)
        env.update(HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_NCCL_INCLUDE=inc,
                   HOROVOD_NCCL_LIB=nccl_link_dir(lib, work / "nccl-lib"),
                   HOROVOD_NCCL_LINK="SHARED", HOROVOD_CUDA_HOME=str(Path(f.nvcc).parents[1]))
        if cc := cuda_cc_list(f):
            env["HOROVOD_BUILD_CUDA_CC_LIST"] = cc
        # nccl.h's NCCL_MAJOR/MINOR/PATCH, e.g. 2.28.3
        text = (Path(inc) / "nccl.h").read_text(errors="replace")
        parts = [re.search(rf"#define NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
        gpu = "_nccl-" + (".".join(m.group(1) for m in parts) if all(parts) else "unknown")
    mpi = re.sub(r"[^A-Za-z0-9.]+", "-", f.mpi_version).strip("-") or "nompi"
    torch_tag = f.torch_version.replace("+", "-")
    env["HVD_LM_CACHE_KEY"] = (f"horovod-{HOROVOD_VERSION}_torch-{torch_tag}"
                               f"_cuda-{f.torch_cuda or 'cpu'}{gpu}_{f.python_tag}_{mpi}")
    return env


def patch_sources(src: str | Path) -> list[str]:
    """Patch an unpacked Horovod 0.28.1 sdist for today's toolchains (idempotent); returns the
    changes made, one line each.

    Raises:
        BuildError: a file to patch is missing or the patch did not take (another Horovod
            version?).
    """
    src, done = Path(src), []
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt", *_HEADER_INCLUDES):
        if not (src / rel).exists():
            raise BuildError(f"{src / rel}: missing (not a Horovod {HOROVOD_VERSION} source tree?)")
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        text = (src / rel).read_text()
        if "set(CMAKE_CXX_STANDARD 14)" in text:
            text = text.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)")
            (src / rel).write_text(text)
            done.append(f"{rel}: C++14 -> C++17 (PR #3998)")
        if "set(CMAKE_CXX_STANDARD 17)" not in text:
            raise BuildError(f"{src / rel}: the C++17 patch did not apply")
    cuda = src / "horovod/common/ops/cuda/CMakeLists.txt"
    text = cuda.read_text() if cuda.exists() else "CMAKE_CUDA_STANDARD 17"  # none: no patch
    patched = re.sub(r"(CMAKE_CUDA_STANDARD\s+)1[14]\b", r"\g<1>17", text)
    if "CMAKE_CUDA_STANDARD" not in text:
        patched = "set(CMAKE_CUDA_STANDARD 17)\nset(CMAKE_CUDA_STANDARD_REQUIRED ON)\n" + text
    if patched != text:
        cuda.write_text(patched)
        done.append("horovod/common/ops/cuda/CMakeLists.txt: CMAKE_CUDA_STANDARD 17")
    for rel, includes in _HEADER_INCLUDES.items():
        text = (src / rel).read_text()
        if missing := [i for i in includes if i not in text]:
            m = re.search(r"^(#pragma once|#define [A-Z0-9_]+_H\w*)\s*$", text, re.M)
            at = m.end() + 1 if m else 0
            (src / rel).write_text(text[:at] + "\n".join(missing) + "\n" + text[at:])
            done.append(f"{rel}: + {' '.join(missing)} (g++ >= 13, PR #3957)")
    return done


def main(argv: list[str] | None = None) -> int:
    """``python scripts/horovod_build.py env [WORK]`` (print ``export`` lines) or
    ``patch SRC``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["env"] and (argv[:1] != ["patch"] or len(argv) != 2):
        print("usage: scripts/horovod_build.py env [WORKDIR] | patch SRCDIR", file=sys.stderr)
        return 2
    try:
        if argv[0] == "env":
            work = Path(argv[1] if len(argv) > 1 else os.environ.get("TMPDIR", "/tmp"))
            out = [f"export {k}={shlex.quote(v)}" for k, v in build_env(probe(), work).items()]
        else:
            out = [f"[horovod] patched {line}" for line in patch_sources(argv[1])]
    except BuildError as e:
        print(f"[horovod] ERROR: {e}", file=sys.stderr)
        return 1
    sys.stdout.writelines(f"{line}\n" for line in out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
