"""Compiles every Triton kernel launch of the CUDA runner (and the sampler's) for an H200 (sm_90)
on a machine without a GPU, so that Triton's type and shape errors surface before a device call.

The CPU interpreter (TRITON_INTERPRET=1) runs the kernels' arithmetic but not Triton's compiler:
a loop-carried value that changes shape, two returns of different types, a bad constexpr branch
all pass it and fail on the GPU. Here the runner's paths run on the CPU on a small random model
(decode on the FMA and tensor-core gemvs and on cuBLAS, short and long prefill, PDL on) with every
Triton launch recorded instead of run; each distinct launch (kernel, argument types, constexprs,
warps, stages) is then compiled to a cubin for sm_90 with the local Triton (AST -> PTX -> ptxas),
and the cubin's resource use is read back with Triton's bundled cuobjdump: registers per thread,
stack frame bytes per thread (where ptxas spills registers; LOCAL, local arrays, stays 0 for
spills), shared memory. A launch whose tensor-core products ptxas serializes (its advisory
C7511: not enough registers to keep them in flight, so each waits for the one before; the chunk
prep kernel's three-level inverse did that in 12-07h: 0.5-2% of a prefill call) is a finding
as a compile error is. Nothing is executed, so no result is checked: tests/gpu do that.

    python tools/compile_kernels.py         # one line per launch; exit 1 on a compile error or serialization
    python tools/compile_kernels.py --sass  # and each launch's SASS: instructions a thread, top opcodes

It compiles the matmul launches that `bench/gpu_tune.py --parts mm` times too, the warp-specialised
Gluon ones (replicas/model/ws_matmul.py) among them, and fails a launch that needs more shared
memory than sm_90's 227 KiB (it would fail at launch).

The SASS counts are static (every loop body once), which for the loop-free chunk prep kernel is
what a thread runs: they showed Triton computing its decays twice, in two layouts (12-02e).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = ("cuda", 90, 32)  # H200: compute capability 9.0, warps of 32
SMEM_LIMIT = 232_448  # bytes of shared memory a block may have on sm_90 (227 KiB)
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "i32", torch.int64: "i64"}


@contextmanager
def recorded_launches() -> Iterator[list]:
    """Inside it, `kernel[grid](...)` records (kernel, args, kwargs) and launches nothing."""
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    launches, run = [], JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if type(value).__name__ == "TensorDescriptor":
        if hasattr(value, "layout"):  # Gluon's: the shared memory layout is part of its type
            return f"tensordesc<{_TYPES[value.base.dtype]}{list(value.block_shape)},{value.layout!r}>"
        return f"tensordesc<{_TYPES[value.base.dtype]}[{','.join(map(str, value.block_shape))}]>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _source(kernel, args, kwargs):
    """The launch as an ASTSource for the compiler, its constexprs by name, and its options."""
    from triton.compiler import ASTSource  # noqa: PLC0415
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415

    names = kernel.arg_names
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg") if k in kwargs}
    kwargs.pop("launch_pdl", None)  # a launch attribute: the kernel's PDL constexpr says what it compiles
    bound = dict(zip(names, args, strict=False)) | kwargs
    constexprs = {names[i]: bound[names[i]] for i in kernel.constexprs}
    signature = {name: "constexpr" if name in constexprs else _arg_type(bound[name]) for name in names}
    source = (GluonASTSource if kernel.is_gluon() else ASTSource)(
        kernel, signature, constexprs=constexprs, attrs=_alignment(kernel, args, kwargs))
    return source, constexprs, options


def _alignment(kernel, args, kwargs) -> dict:
    """What the JIT tells the compiler at a launch: which pointers (data_ptr % 16) and integers
    (% 16, where not do_not_specialize) are multiples of 16. Without it the compiler cannot prove
    rows contiguous and aligned, and loads neither vectorise nor pipeline as they do on the GPU."""
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import make_backend  # noqa: PLC0415
    from triton.runtime.jit import create_function_from_signature  # noqa: PLC0415

    backend = make_backend(GPUTarget(*TARGET))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, options)[3]


def exercise_runner() -> list:
    """Runs the runner's decode and prefill paths on the CPU with PDL on, in fp16 and bf16, the
    chunked prefill at each block of values; returns the launches."""
    from replicas.model.config import ModelConfig  # noqa: PLC0415
    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415
    from replicas.model.rwkv7 import RWKV7, init_random  # noqa: PLC0415

    model = init_random(RWKV7(ModelConfig(2, 256, 64, 1000, 1024, 32, 32, 32, 64)), seed=0).eval()
    with recorded_launches() as launches, torch.no_grad():
        for dtype in (torch.float16, torch.bfloat16):
            runner = CudaRunner(model, max_slots=8, dtype=dtype, prefill_wkv="recurrent", auto_path=False,
                                live_rows=True)
            runner.pdl = True  # what an H200 runs
            for rows, small in ((1, 16), (2, 16), (3, 16), (5, 16), (8, 0)):  # FMA gemv (1-4), tensor cores, cuBLAS
                runner.small_batch = small
                runner.decode(list(range(rows)), [1] * rows)
            runner.prefill([0, 1], [[1] * 40, [2] * 7])  # the gemv path (≤ 128 tokens)
            runner.prefill([0, 1], [[1] * 150, [2] * 70])  # cuBLAS products, the recurrent kernel
            runner.prefill_wkv = "chunked"
            for n_sm in (1, 12, 10**6):  # the pass: 64, 32, 16 values a program
                runner.n_sm = n_sm
                runner.prefill([0, 1], [[1] * 150, [2] * 70])
            runner.n_sm = 132
            runner.prefill([0], [[1] * 1100])  # the key product with relu² (kernels.mm_relu2)
            runner.large_mm = "ws"  # the large path on the warp-specialised matmul (bench/gpu.py --ws)
            runner.prefill([0], [[1] * 1100])
            runner.large_mm = "cublas"
    return launches


def exercise_sampler() -> list:
    """The sampler's kernel (sampling_kernel.py) on the CPU, every branch of a row; its launches."""
    from replicas.sampling import Sampler, SamplingParams  # noqa: PLC0415

    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, top_k=40, presence_penalty=0.5)]
    with recorded_launches() as launches:
        Sampler(2, 65536, kernel=True).sample(torch.zeros(2, 65536), [0, 1], params, [0.5, 0.5])
    return launches


def exercise_matmuls() -> list:
    """The launches `bench/gpu_tune.py --parts mm` times, at 7.2B's output product (4,096 x 4,096 ·
    4,096): the persistent matmul's MmConfigs and the warp-specialised one's WsConfigs (relu² off,
    and the default with it and in bf16, as its check runs them); the latter are Gluon, which the
    interpreter cannot run at all."""
    import json  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from gpu_tune import MM_CONFIGS, WS_CONFIGS  # noqa: PLC0415

    from replicas.model import kernels as K  # noqa: PLC0415
    from replicas.model.ws_matmul import WsConfig, mm_ws  # noqa: PLC0415

    a, w = torch.empty(4096, 4096, dtype=torch.float16), torch.empty(4096, 4096, dtype=torch.float16)
    with recorded_launches() as launches:
        for cfg in MM_CONFIGS:
            K.mm_relu2(a, w, 132, relu2=False, cfg=cfg)
        for cfg in WS_CONFIGS:
            mm_ws(a, w, 132, relu2=False, cfg=WsConfig(**json.loads(cfg)))
        mm_ws(a, w, 132)
        mm_ws(a.bfloat16(), w.bfloat16(), 132, relu2=False)
    return launches


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """What Triton's bundled cuobjdump prints for the cubin with this flag; empty if it is missing."""
    import triton  # noqa: PLC0415

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.fspath(tool), flag, f.name], capture_output=True, text=True).stdout


def resource_use(cubin: bytes) -> dict[str, int]:
    """Registers per thread (REG), stack frame bytes per thread (STACK: spills) and local arrays
    (LOCAL) of the cubin's kernel, from cuobjdump; empty if the tool is missing."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out)}


def sass_counts(cubin: bytes) -> collections.Counter:
    """The cubin's SASS instructions by opcode (static counts), from cuobjdump."""
    line = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.MULTILINE)  # [guard] op
    return collections.Counter(m.group(1) for m in line.finditer(_cuobjdump(cubin, "-sass")))


def serialized_products(ptx: str) -> str:
    """ptxas's advisory where it serializes the PTX's wgmma products (compiled again for sm_90a by
    Triton's bundled ptxas, which Triton runs without -v); empty if none, or if the tool is missing."""
    import triton  # noqa: PLC0415

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if "wgmma.mma_async" not in ptx or not tool.exists():
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        args = [os.fspath(tool), "-arch=sm_90a", "-v", os.fspath(src), "-o", os.fspath(src.with_suffix(".cubin"))]
        out = subprocess.run(args, capture_output=True, text=True)
    return next((line.split("Potential Performance Loss: ", 1)[-1] for line in (out.stdout + out.stderr).splitlines()
                 if "wgmma.mma_async instructions are serialized" in line), "")


def compile_all(launches: list, sass: bool = False) -> list[tuple[str, str]]:
    """Compiles each distinct launch; returns (launch, problem) for those that fail to compile, need
    more shared memory than sm_90 has, or whose tensor-core products ptxas serializes. With sass,
    each launch's SASS instruction count and its most frequent opcodes too."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    seen, failures = set(), []
    for kernel, args, kwargs in launches:
        src, constexprs, options = _source(kernel, args, dict(kwargs))
        key = (kernel.fn.__name__, tuple(src.signature.items()), tuple(constexprs.items()), tuple(options.items()))
        if key in seen:
            continue
        seen.add(key)
        tiles = re.findall(r"tensordesc<(\w+\[[^\]]*\])", " ".join(map(str, src.signature.values())))
        label = (f"{kernel.fn.__name__}({', '.join(f'{k}={v}' for k, v in constexprs.items())}) {options}"
                 + (f" tiles {' '.join(tiles)}" if tiles else ""))
        try:
            compiled = triton.compile(src, target=GPUTarget(*TARGET), options=options)
            use = resource_use(compiled.asm["cubin"]) | {"SMEM": compiled.metadata.shared}
            spills = " SPILLS" if use.get("STACK") or use.get("LOCAL") else ""
            serial = serialized_products(compiled.asm["ptx"])
            big = compiled.metadata.shared > SMEM_LIMIT  # the launch would fail: out of resources
            problem = (f"{compiled.metadata.shared} bytes of shared memory, more than sm_90's {SMEM_LIMIT}" if big
                       else serial)
            status = "FAIL" if big else "SLOW" if serial else "ok  "
            print(f"{status}  {label} {' '.join(f'{k}={v}' for k, v in use.items())}{spills}"
                  + (f"\n      {problem}" if problem else ""), flush=True)
            if problem:
                failures.append((label, problem))
            if sass:
                ops = sass_counts(compiled.asm["cubin"])
                top = " ".join(f"{op} {n}" for op, n in ops.most_common(8))
                print(f"      SASS: {sum(ops.values())} instructions a thread ({top})", flush=True)
        except Exception as error:  # noqa: BLE001 - every compiler error is a finding to report
            failures.append((label, str(error)))
            print(f"FAIL  {label}\n{error}\n{error.__cause__!r}", flush=True)
    return failures


def main() -> int:
    failures = compile_all(exercise_runner() + exercise_sampler() + exercise_matmuls(), sass="--sass" in sys.argv[1:])
    print(f"{len(failures)} launch(es) failed to compile for sm_90, need too much shared memory or have their "
          "products serialized" if failures else "every launch compiles for sm_90, none with its products serialized")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
