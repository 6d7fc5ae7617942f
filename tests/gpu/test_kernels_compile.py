"""Every Triton launch of the CUDA runner compiles for an H200 (sm_90), checked without a GPU.

tools/compile_kernels.py runs the runner's decode and prefill paths on the CPU with the launches
recorded, then compiles each for sm_90: Triton's type and shape errors (which the interpreter does
not see) fail here instead of on the device, and so does a kernel whose tensor-core products
ptxas serializes for want of registers (the chunk prep kernel's, in 12-07h). The matmul launches
that bench/gpu_tune.py times are compiled too, the warp-specialised Gluon ones among them (Gluon
has no interpreter: this is all of it that runs without a GPU). Needs Triton, which
CPU-only torch does not bring, so it is marked `gpu` and skipped where Triton is absent.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_every_launch_compiles_for_sm90():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs kernels instead of compiling them")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import compile_kernels  # noqa: PLC0415

    C = compile_kernels
    launches = C.exercise_runner() + C.exercise_sampler() + C.exercise_matmuls()
    names = {kernel.fn.__name__ for kernel, _, _ in launches}
    assert {"_gemv_kernel", "_gemv_fma_kernel", "_wkv_decode_kernel", "_ln_shift_mix_kernel", "_wkv_recurrent_kernel",
            "_sample_kernel", "_gemv_live_rows_kernel", "_mm_kernel", "_ws_kernel"} <= names  # every path was exercised
    assert C.compile_all(launches) == []
