"""``hvd-lm kernels``: the fused mLSTM's Triton cell kernels (:mod:`hvd_lm.model.mlstm_triton`)
built ahead of time for a GPU architecture on any machine, no GPU needed, and each build's
registers, spills and shared memory (the table in docs/mlstm_fused.md).

Triton is optional (the ``gpu`` extra): it is imported when the command runs, so that without it
the command ends with one line.

Caveat: the builds are made without the 16-byte divisibility hints (``tt.divisibility``) Triton's
JIT adds at launch for aligned pointers and sizes divisible by 16, so an aligned launch on a GPU
may compile to another (vectorised) binary with other register counts than the table's.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hvd_lm.options import Command, option
from hvd_lm.util.atomic import write_text


def _triton():
    """(triton, :mod:`hvd_lm.model.mlstm_triton`), or RuntimeError naming the extra."""
    try:
        import triton

        from hvd_lm.model import mlstm_triton
    except ImportError as e:
        raise RuntimeError(f"hvd-lm kernels needs triton ({e}); install it with "
                           "pip install -e .[gpu]") from e
    return triton, mlstm_triton


def compile_ahead(arch: int = 90) -> list[dict]:
    """Compile every cell kernel the CUDA path can launch (both kernels x compute dtype x
    mask/reset cases, ``BLOCK``, ``NUM_WARPS`` of :mod:`hvd_lm.model.mlstm_triton`) for
    ``sm_<arch>`` without a GPU
    (``triton.compile`` with a ``GPUTarget``; Triton's own ptxas), and read each cubin's
    resources with the ``cuobjdump --dump-resource-usage`` that ships with Triton.

    Returns:
        one dict per build: kernel, compute, has_keep, has_rk, registers (per thread),
        stack / local (bytes per thread: spills), shared (bytes per program), cubin_bytes.

    Raises:
        RuntimeError: triton not installed, cuobjdump missing or its output unreadable.
    """
    triton, tk = _triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if not tool:
        raise RuntimeError("cuobjdump not found (it ships with triton's nvidia backend)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for compute, has_keep, has_rk in itertools.product(tk.COMPUTE_TYPES, (False, True),
                                                           (False, True)):
            consts = tk.launch_constexprs(compute, has_keep, has_rk)
            for name, sig in tk.launch_signatures(compute, has_keep, has_rk).items():
                src = ASTSource(fn=getattr(tk, name), signature=sig, constexprs=consts[name])
                built = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={
                    "num_warps": tk.NUM_WARPS, "enable_fp_fusion": True})
                cubin = Path(tmp) / f"{name}.cubin"
                cubin.write_bytes(built.asm["cubin"])
                out = subprocess.run([tool, "--dump-resource-usage", str(cubin)],
                                     capture_output=True, text=True, timeout=60).stdout
                use = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
                if len(use) < 4:
                    raise RuntimeError(f"cuobjdump: no resource usage for {name}:\n{out}")
                rows.append({"kernel": name, "compute": compute, "has_keep": has_keep,
                             "has_rk": has_rk, "registers": int(use["REG"]),
                             "stack": int(use["STACK"]), "local": int(use["LOCAL"]),
                             "shared": int(use["SHARED"]), "cubin_bytes": len(built.asm["cubin"])})
    return rows


@dataclass
class KernelsConfig:
    """``hvd-lm kernels``: the cell kernels built ahead of time for a GPU, here."""

    arch: int = option(90, "compute capability x 10 to build for (90: H100, 80: A100)", ge=50)
    json: str = option("", "also write the table here")


def kernels_command(cfg: KernelsConfig) -> int:
    """Build every cell kernel for ``sm_<arch>`` (:func:`compile_ahead`) and print (save) the
    resource table; exit 1 when a kernel spills registers."""
    rows = compile_ahead(cfg.arch)
    triton, tk = _triton()
    print(f"triton {triton.__version__}, sm_{cfg.arch}, BLOCK {tk.BLOCK}, {tk.NUM_WARPS} warps")
    print(f"{'kernel':>22} {'compute':>7} {'keep':>5} {'reset':>5} {'regs':>5} {'spill B':>7} "
          f"{'smem B':>6}")
    for r in rows:
        print(f"{r['kernel']:>22} {r['compute']:>7} {str(r['has_keep']):>5} "
              f"{str(r['has_rk']):>5} {r['registers']:>5} {r['stack'] + r['local']:>7} "
              f"{r['shared']:>6}")
    if cfg.json:
        write_text(cfg.json, json.dumps({"triton": triton.__version__, "arch": cfg.arch,
                                         "block": tk.BLOCK, "num_warps": tk.NUM_WARPS,
                                         "kernels": rows}, indent=1) + "\n")
    spilled = [r for r in rows if r["stack"] or r["local"]]
    if spilled:
        print(f"ERROR: {len(spilled)} kernel builds spill registers", file=sys.stderr)
    return 1 if spilled else 0


KERNELS_AOT = Command(KernelsConfig, kernels_command,
                      description="Build the fused mLSTM's Triton cell kernels ahead of time for "
                      "a GPU architecture, on any machine (no GPU needed), and print each "
                      "build's registers, spills and shared memory.")
