"""GPU tests also run on the CPU under Triton's interpreter (TRITON_INTERPRET=1), slowly.

KERNEL_MARKS: for the modules that run the kernels on a GPU or under the interpreter; rel_err:
their measure of a result against its reference. The
interpreter hands kernels their runtime scalars as one-element arrays, which Python's range
refuses; the shim below lets `tl.range` take them. Nothing changes when the interpreter is off.
"""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9  # Gluon's warpgroup products (ws_matmul.py)
KERNEL_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)"),
]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """‖ours − ref‖ / ‖ref‖, after checking ours is finite."""
    ours, ref = ours.float().cpu(), ref.float().cpu()
    assert torch.isfinite(ours).all()
    return ((ours - ref).norm() / ref.norm()).item()


if INTERPRET:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        pass
    else:
        _patch_lang_core = interpreter._patch_lang_core

        def _scalar(value):
            return int(value.handle.data.reshape(-1)[0]) if isinstance(value, tl.tensor) else value

        def _range(start, stop=None, step=None, **_):
            start, stop = (0, start) if stop is None else (start, stop)
            return range(_scalar(start), _scalar(stop), _scalar(step) or 1)

        def _patched(lang, scope):
            _patch_lang_core(lang, scope)
            scope.set_attr(lang, "range", _range)

        interpreter._patch_lang_core = _patched
