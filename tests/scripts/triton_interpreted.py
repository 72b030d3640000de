"""The Triton mLSTM kernels under Triton's CPU interpreter, compared with the specification;
prints one JSON line ``{case: [max difference, tolerance]}`` (tests/test_mlstm_fused.py reads
it; differences as :func:`tests.scripts.mlstm_cases.cell_diff` / ``window_diff`` measure them).

A separate process because ``TRITON_INTERPRET=1`` must be set before triton is first imported
(triton.language's own functions are built at import); the test sets it in the environment.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from hvd_lm.model import mlstm_kernels as K
from hvd_lm.model import mlstm_triton
from tests.scripts.mlstm_cases import cell_case, cell_diff, model_diff, window_diff


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    kernels = K.get_kernels("triton", "cpu")
    out = {}
    # bf16 storage (g, hs, dg): a rounding step is 2^-7 relative; allow two
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -6)):
        for keep, rk in ((False, False), (True, False), (False, True), (True, True)):
            # 5 x 300 = 1500 elements: two programs of BLOCK = 1024, the second one partial
            fwd_in, bwd_in = cell_case(5, 300, keep, rk, dtype, seed=7)
            name = f"cell {str(dtype)[6:]} keep={keep} reset={rk}"
            out[name] = [cell_diff(kernels, fwd_in, bwd_in, dtype), tol]
    # the saved pre-activations' path (a compute dtype narrower than the state's): no
    # activations saved, recomputed in the backward, gate gradients written over them
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -6)):
        for keep, rk in ((False, False), (True, True)):
            fwd_in, bwd_in = cell_case(5, 300, keep, rk, dtype, seed=8)
            name = f"cell {str(dtype)[6:]} keep={keep} reset={rk} recomputed"
            out[name] = [cell_diff(kernels, fwd_in, bwd_in, dtype, recompute=True), tol]
    out["fused window vs torch kernels"] = [window_diff(kernels), 1e-6]
    out["fused window bf16 vs torch kernels' fp32 window (relative)"] = [
        window_diff(kernels, compute=torch.bfloat16), 2e-2]
    out["LanguageModel.encode (mask, reset as [B, T]) vs torch kernels"] = [
        model_diff("triton"), 1e-6]
    try:
        fwd_in, _ = cell_case(2, 3, False, False)
        mlstm_triton.cell_forward(*[t.double() if t is not None else None for t in fwd_in],
                                  *[torch.empty(2, n, dtype=torch.float64)
                                    for n in (12, 3, 3, 3, 3, 3)])
        out["rejects fp64 state"] = [1.0, 0.0]
    except ValueError:
        out["rejects fp64 state"] = [0.0, 0.0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
