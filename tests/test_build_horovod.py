"""The Horovod build's decisions (scripts/horovod_build.py, acted on by
scripts/build_horovod.sh) on fabricated machines: a CPU box, a CUDA node with NCCL from the pip
wheel, from HOROVOD_NCCL_HOME, and the failures that must name what to install; the source patches
on a miniature sdist; and the device rule of one rank per GPU
(hvd_lm.model.device.resolve_device)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hvd_lm.install.check_build import missing_components, parse_check_build
from hvd_lm.model.device import DeviceError, resolve_device

_SPEC = importlib.util.spec_from_file_location(
    "horovod_build", Path(__file__).resolve().parents[1] / "scripts" / "horovod_build.py")
B = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(B)

NCCL_H = "#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n#define NCCL_PATCH 3\n"


def nccl_wheel(site: Path, so: str = "libnccl.so.2") -> Path:
    """A fake ``nvidia-nccl-cu13`` wheel as pip lays it out (only ``libnccl.so.2``)."""
    (site / "nvidia/nccl/include").mkdir(parents=True)
    (site / "nvidia/nccl/lib").mkdir(parents=True)
    (site / "nvidia/nccl/include/nccl.h").write_text(NCCL_H)
    (site / "nvidia/nccl/lib" / so).write_bytes(b"\x7fELF")
    return site / "nvidia/nccl"


def cuda_facts(tmp_path: Path, **kw) -> B.Facts:
    base = dict(torch_version="2.11.0+cu130", torch_cuda="13.0", capabilities=[(9, 0)],
                cmake_major=4, nvcc="/usr/local/cuda/bin/nvcc",
                site_packages=[str(tmp_path / "site")], system_nccl_dirs=[],
                mpi_version="mpirun (Open MPI) 4.1.6", python_tag="py312")
    base.update(kw)
    return B.Facts(**base)


def test_cpu_box_builds_mpi_and_gloo_only(tmp_path):
    f = B.Facts(torch_version="2.13.0+cpu", torch_cuda=None, cmake_major=3,
                mpi_version="mpirun (Open MPI) 4.1.4", python_tag="py311")
    env = B.build_env(f, tmp_path)
    assert env["HOROVOD_WITH_MPI"] == env["HOROVOD_WITH_GLOO"] == "1"
    assert "HOROVOD_GPU_OPERATIONS" not in env and "CMAKE_POLICY_VERSION_MINIMUM" not in env
    # the key of the wheels cached before this change: a CPU machine keeps its cache
    assert env["HVD_LM_CACHE_KEY"] == \
        "horovod-0.28.1_torch-2.13.0-cpu_cuda-cpu_py311_mpirun-Open-MPI-4.1.4"


def test_cuda_node_with_the_pip_nccl_wheel(tmp_path):
    wheel = nccl_wheel(tmp_path / "site")
    env = B.build_env(cuda_facts(tmp_path), tmp_path / "work")
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert env["HOROVOD_NCCL_INCLUDE"] == str(wheel / "include")
    link = Path(env["HOROVOD_NCCL_LIB"]) / "libnccl.so"  # made beside, not in site-packages
    assert link.is_symlink() and link.resolve() == (wheel / "lib/libnccl.so.2").resolve()
    assert not (wheel / "lib/libnccl.so").exists()
    assert env["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert env["HOROVOD_CUDA_HOME"] == "/usr/local/cuda"
    assert "_cuda-13.0_nccl-2.28.3_py312_" in env["HVD_LM_CACHE_KEY"]


def test_arch_list_and_nccl_home_win(tmp_path):
    nccl_wheel(tmp_path / "site")
    home = tmp_path / "nccl"
    (home / "include").mkdir(parents=True)
    (home / "lib").mkdir()
    (home / "include/nccl.h").write_text(NCCL_H.replace("28", "19"))
    (home / "lib/libnccl.so").write_bytes(b"")
    env = B.build_env(cuda_facts(tmp_path, torch_cuda_arch_list="8.0 9.0+PTX",
                                 nccl_home=str(home)), tmp_path / "work")
    assert env["HOROVOD_BUILD_CUDA_CC_LIST"] == "80,90"
    assert env["HOROVOD_NCCL_INCLUDE"] == str(home / "include")
    assert env["HOROVOD_NCCL_LIB"] == str(home / "lib")  # has libnccl.so: used as it is
    assert "_nccl-2.19.3_" in env["HVD_LM_CACHE_KEY"]


@pytest.mark.parametrize("facts,needle", [
    (dict(nvcc=""), "nvcc was not found"),
    (dict(site_packages=[]), "pip install nvidia-nccl-cu13"),
    (dict(torch_cuda_arch_list="sm90"), "TORCH_CUDA_ARCH_LIST='sm90'"),
])
def test_failures_name_what_to_install(tmp_path, facts, needle):
    nccl_wheel(tmp_path / "site")
    with pytest.raises(B.BuildError, match=needle):
        B.build_env(cuda_facts(tmp_path, **facts), tmp_path / "work")


def mini_sdist(root: Path) -> Path:
    """The lines of Horovod 0.28.1's sources that the patches touch, as the sdist has them."""
    files = {
        "CMakeLists.txt": "cmake_minimum_required(VERSION 2.8.12)\nset(CMAKE_CXX_STANDARD 14)\n"
                          "set(CMAKE_CXX_STANDARD_REQUIRED ON)\n",
        "horovod/torch/CMakeLists.txt": "if(X)\n    set(CMAKE_CXX_STANDARD 14)\nendif()\n",
        "horovod/common/ops/cuda/CMakeLists.txt": "set(CMAKE_CUDA_STANDARD 11)\n"
                                                   "set(CMAKE_CUDA_STANDARD_REQUIRED ON)\n",
        "horovod/common/group_table.h": "#include <mutex>\n\n#ifndef HOROVOD_GROUP_TABLE_H\n"
                                        "#define HOROVOD_GROUP_TABLE_H\n\nstd::string x;\n#endif\n",
        "horovod/common/common.h": "#ifndef HOROVOD_COMMON_H\n#define HOROVOD_COMMON_H\n\n"
                                   "#include <string>\nstd::logic_error e;\n#endif\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_source_patches_apply_once_and_are_checked(tmp_path):
    src = mini_sdist(tmp_path / "horovod-0.28.1")
    done = B.patch_sources(src)
    assert len(done) == 5
    assert "set(CMAKE_CXX_STANDARD 17)" in (src / "CMakeLists.txt").read_text()
    assert "set(CMAKE_CXX_STANDARD 17)" in (src / "horovod/torch/CMakeLists.txt").read_text()
    assert "CMAKE_CUDA_STANDARD 17" in (src / "horovod/common/ops/cuda/CMakeLists.txt").read_text()
    gt = (src / "horovod/common/group_table.h").read_text()
    assert gt.index("#include <string>") > gt.index("#define HOROVOD_GROUP_TABLE_H")
    common = (src / "horovod/common/common.h").read_text()
    assert "#include <stdexcept>" in common and common.count("#include <string>") == 1
    assert B.patch_sources(src) == []  # idempotent
    (src / "horovod/common/common.h").unlink()
    with pytest.raises(B.BuildError, match="common.h: missing"):
        B.patch_sources(src)


@pytest.mark.parametrize("given", ["", "-O2 -g", "-O2 -include string"])
def test_every_translation_unit_gets_the_gxx13_includes(tmp_path, given):
    """CXXFLAGS forces <cstdint>, <string> and <stdexcept> into every C++ file the build
    compiles (the recipe that built on the H100's g++ 13), after the caller's own flags and
    without repeating one already forced; a file that includes none of them but uses all three
    compiles with the flags and not without (g++ here)."""
    import shlex
    import shutil
    import subprocess

    env = B.build_env(B.Facts(torch_version="2.13.0+cpu", cxxflags=given), tmp_path)
    flags = shlex.split(env["CXXFLAGS"])
    assert flags[:len(shlex.split(given))] == shlex.split(given)
    forced = [b for a, b in zip(flags, flags[1:]) if a == "-include"]
    assert sorted(forced) == sorted(B.GXX13_INCLUDES)
    assert env == B.build_env(B.Facts(torch_version="2.13.0+cpu", cxxflags=given), tmp_path)
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ to compile with")
    tu = tmp_path / "tu.cc"
    tu.write_text("std::uint64_t n = 1;\nstd::string s(\"x\");\n"
                  "void f() { throw std::logic_error(s); }\n")
    compile_ = [gxx, "-std=c++17", "-fsyntax-only", str(tu)]
    assert subprocess.run(compile_, capture_output=True).returncode != 0
    done = subprocess.run(compile_[:1] + flags + compile_[1:], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_check_build_requires_nccl_with_a_cuda_torch():
    text = ("Horovod v0.28.1:\n\nAvailable Frameworks:\n    [ ] TensorFlow\n    [X] PyTorch\n"
            "    [ ] MXNet\n\nAvailable Controllers:\n    [X] MPI\n    [X] Gloo\n\n"
            "Available Tensor Operations:\n    [ ] NCCL\n    [ ] DDL\n    [ ] CCL\n    [X] MPI\n"
            "    [X] Gloo\n")
    info = parse_check_build(text)
    assert missing_components(info, need_nccl=False) == []
    assert missing_components(info, need_nccl=True) == ["NCCL tensor operations"]


@pytest.mark.parametrize("name,rank,size,gpus,want", [
    ("auto", 0, 2, 0, "cpu"),          # no GPU: the CPU, any number of ranks
    ("cpu", 1, 2, 1, "cpu"),           # --device cpu on a GPU node
    ("auto", 1, 2, 2, "cuda:1"),       # one GPU per local rank
    ("cuda", 0, 1, 1, "cuda:0"),
    ("cuda:1", 0, 1, 2, "cuda:1"),
])
def test_one_rank_per_gpu(name, rank, size, gpus, want):
    assert resolve_device(name, rank, size, gpus=gpus) == torch.device(want)


@pytest.mark.parametrize("name,size,gpus,needle", [
    ("auto", 2, 1, r"2 ranks run on this node but torch sees 1 GPU\(s\)"),
    ("cuda", 8, 4, "--device cpu"),
    ("cuda:2", 1, 2, r"torch sees 2 GPU\(s\) \(cuda:0..cuda:1\)"),
    ("cuda", 1, 0, "torch sees no CUDA device"),
    ("cuda:1", 2, 4, r"puts all 2 ranks of this node on one GPU .*use --device cuda"),
])
def test_device_errors_say_what_to_do(name, size, gpus, needle):
    with pytest.raises(DeviceError, match=needle):
        resolve_device(name, 0, size, gpus=gpus)


def test_the_nccl_wheel_is_found_in_dist_packages(tmp_path, monkeypatch):
    """Issue 22, defect 7 (failed before the fix: only ``site-packages`` entries were searched).
    Ubuntu's system Python (the GPU node's ``python3`` with its CUDA torch) installs wheels into
    ``.../dist-packages``: probe() of this machine with such a folder on sys.path finds the NCCL
    wheel there; so does a wheel beside torch in a folder of any name."""
    dist = tmp_path / "usr/lib/python3/dist-packages"
    wheel = nccl_wheel(dist)
    monkeypatch.setattr("sys.path", [*__import__("sys").path, str(dist)])
    facts = B.probe()
    assert str(dist) in facts.site_packages
    inc, lib, where = B.find_nccl(B.Facts(**{**facts.__dict__, "torch_cuda": "13.0",
                                              "nccl_home": "", "system_nccl_dirs": []}))
    assert (inc, lib) == (str(wheel / "include"), str(wheel / "lib")) and "dist-packages" in where
    beside = tmp_path / "opt/py/lib/pkgs"
    nccl_wheel(beside)
    assert str(beside) in B.package_dirs(str(beside / "torch/__init__.py"), [])


@pytest.mark.parametrize("arch,cc", [("9.0a", "90"), ("8.0;9.0a+PTX", "80,90"),
                                     ("10.0f 9.0", "100,90")])
def test_arch_specific_items_build_the_plain_capability(tmp_path, arch, cc):
    """The GPU image sets TORCH_CUDA_ARCH_LIST=9.0a (seen on the H200 node: setup stopped on
    it); Horovod's CUDA kernels build for the plain capability."""
    assert B.cuda_cc_list(cuda_facts(tmp_path, torch_cuda_arch_list=arch)) == cc
