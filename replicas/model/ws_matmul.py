"""A warp-specialised persistent matmul for Hopper, in Gluon: y = a · wᵀ (relu² optional), the
candidate for the large path's products where Triton's `kernels.mm_relu2` trails cuBLAS.

Why it exists: Triton 3.6 does not warp-specialise `kernels.mm_relu2` on sm_90 (its Hopper pass
acts at 4 warps only), so one set of warps both waits for the loads and issues the products, as
cuBLAS's kernels do not. Here the roles have warps of their own, as in CUTLASS's cooperative
schedule:

    loader     1 warp     TMA loads of a's [BM, BK] and w's [BN, BK] tiles into STAGES buffers,
                          each signalled `ready` by its bytes' arrival; it waits for `empty`
    consumers  2 × 4 warps one warpgroup each, rows [0, BM/2) and [BM/2, BM) of the program's tile:
                          wgmma on the buffers, one product in flight behind the next; a buffer's
                          `empty` takes both consumers' arrivals; then the tile's epilogue
                          (relu², fp16, stored through shared memory by TMA in EPI_N-wide parts,
                          EPI_BUFS buffers taking them in turn)

or, as in CUTLASS's ping-pong schedule (`WsConfig.pingpong`), each consumer takes every other
tile whole, the two taking their tiles' steps in turn (the loads arrive in the tiles' order), so
that one's epilogue runs while the other multiplies.

Every partition walks the same tiles (a program a multiprocessor, tiles grouped GROUP row tiles
at a time for the weights' reuse in L2), so they agree on the buffers' order without talking.
Each consumer is a warpgroup in a partition of its own, so a buffer's `empty` counts consumers
and neither waits for the other within a step (Triton puts a barrier of the partition's warps
before each of its arrivals). Checked on the CPU: a model of these barriers (tools/ws_protocol.py)
runs every interleaving it draws without a deadlock or a buffer reloaded while it is read.

Not yet run on a GPU (12-08b: no device machine lent). `bench/gpu_tune.py --parts mm` times it
against cuBLAS and `kernels.mm_relu2`; the runner takes it for the large path's products with
`CudaRunner.large_mm = "ws"` (off), which `bench/gpu.py --ws` times; tests/gpu check it against
torch and the reference. Needs a GPU of compute capability 9.0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@dataclass(frozen=True)
class WsConfig:
    """A launch: tiles of bm × bn, bk of K a step, `stages` buffers, `group` row tiles sharing column
    tiles in turn, the epilogue stored epi_n columns at a time through epi_bufs buffers a consumer
    (with two, a part is written while the one before is stored); `regs` the consumers' registers a
    thread (the loader keeps 40). Cooperative (each consumer bm/2 rows of every tile), or with
    `pingpong` each consumer every other tile, whole, so that one's epilogue runs while the other
    multiplies. A consumer holds at most 128 fp32 sums a thread: bm · bn ≤ 128 · 256 (cooperative),
    128 · 128 (pingpong)."""
    bm: int = 128
    bn: int = 256
    bk: int = 64
    stages: int = 4
    group: int = 8
    epi_n: int = 64
    epi_bufs: int = 2
    regs: int = 232
    pingpong: bool = False

    @property
    def rows(self) -> int:
        """A consumer's rows of a tile."""
        return self.bm if self.pingpong else self.bm // 2

    def smem_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * self.bk * 2 + 2 * self.epi_bufs * self.rows * self.epi_n * 2

    def __post_init__(self):
        if self.rows not in (64, 128) or self.rows * self.bn > 128 * 128 or self.bn % (self.epi_n * self.epi_bufs):
            raise ValueError(f"{self}: a consumer's rows (bm/2, or bm with pingpong) 64 or 128, at most 128 sums "
                             "a thread (its rows · bn ≤ 128 · 128), bn stored in epi_n parts, a multiple of "
                             "epi_bufs of them (so each tile's first part takes the first buffer)")
        if self.smem_bytes() > 227 * 1024:
            raise ValueError(f"{self}: {self.smem_bytes()} bytes of shared memory, more than 227 KiB")


WS = WsConfig()
LOADER_REGS = 40


@gluon.jit
def _tile(t, n_m, n_n, GROUP: gl.constexpr):
    """The program's t-th tile → (row tile, column tile), GROUP row tiles taking each column tile in
    turn (kernels._mm_kernel's order)."""
    in_group = GROUP * n_n
    first_m = t // in_group * GROUP
    rows = gl.minimum(n_m - first_m, GROUP)
    return first_m + t % in_group % rows, t % in_group // rows


@gluon.jit
def _parts(x, N_PARTS: gl.constexpr):
    """x [R, C] as N_PARTS (a power of two) tensors [R, C / N_PARTS], left to right."""
    xs = (x,)
    for _ in gl.static_range(N_PARTS.bit_length() - 1):
        halves = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            halves += y.reshape(y.shape[0], 2, y.shape[1] // 2).permute(0, 2, 1).split()
        xs = halves
    return xs


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, GROUP_N, GROUP: gl.constexpr,
            PROGRAMS: gl.constexpr):
    """The loads in the tiles' order; a column tile in the g-th GROUP_N outputs reads a's g-th K
    columns (one group: all of them)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    n_m, n_n, n_k = gl.cdiv(M, BM), gl.cdiv(N, BN), gl.cdiv(K, BK)
    i = 0
    for t in range(gl.program_id(0), n_m * n_n, PROGRAMS):
        i_m, i_n = _tile(t, n_m, n_n, GROUP)
        a_col = i_n * BN // GROUP_N * K
        for k in range(n_k):
            s = i % STAGES
            # a buffer's barrier starts in phase 0 complete: its first wait (phase 1) passes
            mbarrier.wait(empty.index(s), (i // STAGES & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [i_m * BM, a_col + k * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [i_n * BN, k * BK], ready.index(s), w_bufs.index(s))
            i += 1


@gluon.jit
def _consumer(y_desc, a_bufs, w_bufs, ready, empty, turn, y_smem, M, N, K, HALF: gl.constexpr,
              GROUP: gl.constexpr, PROGRAMS: gl.constexpr, RELU2: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup: rows [HALF·BM/2, (HALF+1)·BM/2) of each tile; with PINGPONG, all of every
    other tile (the HALF-th, HALF+2-th, ... of the program's), its steps taken only when the other
    consumer has taken all of its tile's (`turn`): a barrier's parity tells apart only the phase
    it is in and the one before, so no consumer may wait for a buffer more than one round ahead
    of the loads, as it would by skipping the other's steps on its own."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = w_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROWS: gl.constexpr = BM if PINGPONG else BM // 2
    FIRST_ROW: gl.constexpr = 0 if PINGPONG else HALF * ROWS
    EPI_N: gl.constexpr = y_desc.block_type.shape[1]
    EPI_BUFS: gl.constexpr = y_smem.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    n_m, n_n, n_k = gl.cdiv(M, BM), gl.cdiv(N, BN), gl.cdiv(K, BK)
    if PINGPONG:  # every other tile; i: where its first step lies in the loader's sequence
        first, step, i = gl.program_id(0) + HALF * PROGRAMS, 2 * PROGRAMS, HALF * n_k
    else:
        first, step, i = gl.program_id(0), PROGRAMS, 0 * n_k
    m = 0
    for t in range(first, n_m * n_n, step):
        i_m, i_n = _tile(t, n_m, n_n, GROUP)
        if PINGPONG:  # consumer 0 goes first: its first wait passes on the fresh barrier
            mbarrier.wait(turn.index(HALF), (m & 1) ^ (1 - HALF))
        acc = gl.zeros((ROWS, BN), gl.float32, acc_layout)
        for k in range(n_k):
            s = i % STAGES
            mbarrier.wait(ready.index(s), i // STAGES & 1)
            a = a_bufs.index(s).slice(FIRST_ROW, ROWS)
            acc = warpgroup_mma(a, w_bufs.index(s).permute((1, 0)), acc, is_async=True)
            # the product before this one has retired: its buffer is free
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=k > 0)
            i += 1
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - HALF), count=1)
        m += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1)
        if RELU2:
            acc = gl.maximum(acc, 0.0)
            acc = acc * acc
        parts = _parts(acc.to(y_desc.dtype), BN // EPI_N)
        for j in gl.static_range(len(parts)):
            buf = y_smem.index(j % EPI_BUFS)
            tma.store_wait(pendings=EPI_BUFS - 1)  # the part EPI_BUFS before has left buf
            buf.store(parts[j])
            fence_async_shared()
            tma.async_copy_shared_to_global(y_desc, [i_m * BM + FIRST_ROW, i_n * BN + j * EPI_N], buf)
        if PINGPONG:
            i += n_k  # the other consumer's tile
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_kernel(a_desc, w_desc, y_desc, M, N, K, GROUP_N, STAGES: gl.constexpr, GROUP: gl.constexpr,
               PROGRAMS: gl.constexpr, RELU2: gl.constexpr, PINGPONG: gl.constexpr, EPI_BUFS: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    y_smem0 = gl.allocate_shared_memory(y_desc.dtype, [EPI_BUFS] + y_desc.block_type.shape, y_desc.layout)
    y_smem1 = gl.allocate_shared_memory(y_desc.dtype, [EPI_BUFS] + y_desc.block_type.shape, y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # pingpong: whose steps next
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)  # the loader's expect, then the bytes
        mbarrier.init(empty.index(s), count=1 if PINGPONG else 2)  # the consumers that read it
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    gl.warp_specialize([
        (_consumer, (y_desc, a_bufs, w_bufs, ready, empty, turn, y_smem0, M, N, K, 0, GROUP, PROGRAMS, RELU2,
                     PINGPONG)),
        (_consumer, (y_desc, a_bufs, w_bufs, ready, empty, turn, y_smem1, M, N, K, 1, GROUP, PROGRAMS, RELU2,
                     PINGPONG)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, M, N, K, GROUP_N, GROUP, PROGRAMS)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def mm_ws(a: torch.Tensor, w: torch.Tensor, n_sm: int, relu2: bool = True, cfg: WsConfig = WS,
          groups: int = 1) -> torch.Tensor:
    """relu(a · wᵀ)² [M, N] in a's dtype (a · wᵀ without relu2), the sums in fp32: a [M, K], w [N, K],
    fp16 or bf16, rows contiguous (a may be a view of wider rows), K a multiple of 8;
    kernels.mm_relu2's contract. groups > 1: `groups` products in one launch, a [M, groups · K]
    and w [groups · N', K], output columns [g·N', (g+1)·N') from a's columns [g·K, (g+1)·K)
    (the time mix's r, k, v from their mixes; N' a multiple of cfg.bn, K of cfg.bk)."""
    M, N, K = a.shape[0], w.shape[0], w.shape[1]
    if a.shape[1] != groups * K or N % groups or groups > 1 and (N // groups % cfg.bn or K % cfg.bk):
        raise ValueError(f"mm_ws: a {tuple(a.shape)}, w {tuple(w.shape)} in {groups} groups at {cfg}")
    y = torch.empty(M, N, device=a.device, dtype=a.dtype)
    dt = gl.float16 if a.dtype == torch.float16 else gl.bfloat16

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))

    # 12 warps (the loader's warp rounds up to a warpgroup) within the 64 K registers: 168 a thread
    # at launch, then set per partition (the default partition takes what the other two leave)
    _ws_kernel[(n_sm,)](
        desc(a, [cfg.bm, cfg.bk]), desc(w, [cfg.bn, cfg.bk]), desc(y, [cfg.rows, cfg.epi_n]), M, N, K, N // groups,
        STAGES=cfg.stages, GROUP=cfg.group, PROGRAMS=n_sm, RELU2=relu2, PINGPONG=cfg.pingpong, EPI_BUFS=cfg.epi_bufs,
        CONSUMER_REGS=cfg.regs, LOADER_REGS=LOADER_REGS, num_warps=4, maxnreg=168)
    return y


def check(configs: list[WsConfig], shape: tuple[int, int, int] = (4160, 808, 1088)) -> list[str]:
    """Each launch against torch's fp64 product of the same operands, at (M, K, N) cut by the tiles
    at both ends of M and N, K not a multiple of the steps: fp16, and for the first launch relu²,
    bf16 and three groups too (the epilogue's, the types' and the loads' cases, the same in every
    launch). What differs, as lines (none: all agree within 1e-3, bf16 4e-3: its output's rounding
    alone is about 1e-3)."""
    M, K, N = shape
    torch.manual_seed(0)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count

    def problem(cfg: WsConfig, relu2: bool, dtype: torch.dtype, groups: int) -> str:
        k, n = (K, N) if groups == 1 else (K // cfg.bk * cfg.bk, cfg.bn * 2)  # a group: whole steps and tiles
        a = torch.randn(M, groups * k + 8, device="cuda").to(dtype)[:, :groups * k]  # rows wider than the product's
        w = (torch.randn(groups * n, k, device="cuda") / k**0.5).to(dtype)
        want = torch.cat([a[:, g * k:(g + 1) * k].double() @ w[g * n:(g + 1) * n].double().t() for g in range(groups)],
                         dim=1)
        want = want.relu() ** 2 if relu2 else want
        try:
            got = mm_ws(a, w, n_sm, relu2, cfg, groups)
        except Exception as e:  # noqa: BLE001 (Triton's compile and launch errors: reported, the next checked)
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        err = ((got.double() - want).norm() / want.norm()).item()
        return "" if err <= (1e-3 if dtype == torch.float16 else 4e-3) else f"{err:.1e} from torch's product"

    problems = []
    fp16, bf16 = torch.float16, torch.bfloat16
    for cfg in configs:
        first = [(True, fp16, 1), (False, bf16, 1), (False, fp16, 3)] if cfg == configs[0] else []
        for relu2, dtype, groups in [(False, fp16, 1), *first]:
            if found := problem(cfg, relu2, dtype, groups):
                problems.append(f"{cfg} relu2={relu2} {dtype} groups={groups}: {found}")
    return problems


def check_in_child(configs: list[str], timeout: float = 240) -> tuple[list[WsConfig] | None, str]:
    """check() on the launches (WsConfig fields as JSON, "{}" the default) in a process of its own,
    so that a launch whose barriers never complete is ended by the timeout instead of hanging the
    caller: (the launches that agree, or None if the check itself did not finish; its output)."""
    root = Path(__file__).resolve().parents[2]
    try:
        run = subprocess.run([sys.executable, "-m", "replicas.model.ws_matmul", *configs], capture_output=True,
                             text=True, timeout=timeout, cwd=root)
    except subprocess.TimeoutExpired:
        return None, f"the check did not finish in {timeout:.0f} s: a partition waits for a barrier forever"
    out = (run.stdout + run.stderr).strip()
    if not (run.returncode == 0 or run.returncode == 1 and " relu2=" in run.stdout):
        return None, out[-3000:]  # the check failed before it could judge the launches
    launches = [WsConfig(**json.loads(c)) for c in configs]
    return [c for c in launches if f"{c} relu2=" not in run.stdout], out[-3000:]


if __name__ == "__main__":
    # python -m replicas.model.ws_matmul ['{"stages": 3}' ...]: check() on these launches
    found = check([WsConfig(**json.loads(arg)) for arg in sys.argv[1:]] or [WS])
    torch.cuda.synchronize()
    print("\n".join(found) or "every launch agrees with torch's product")
    sys.exit(1 if found else 0)
