"""The chunked RWKV-7 recurrence of long prefill: fla-core's intra-chunk stages, then our pass
over the chunks.

fla-core 0.6's `chunk_dplr_fwd` runs five stages: the decay's cumulative sum within chunks, the
intra-chunk matrices, the WY representation (these three parallel over chunks), the state pass
(sequential over a row's chunks) and the output (parallel again, from every chunk's state, which
the pass wrote out). Its state pass loads a chunk's tiles only when it gets there; with the output
kernel it took 5.9 ms of a 1.5B model's 4,096-token prefill on an H200.

`_state_out_kernel` takes the last two stages' place (4.6 ms there). A program per (row, head,
block of values) walks its row's chunks with the next chunks' tiles already loading (Triton's
software pipelining), computes each chunk's output from the state it holds, and keeps that state
in registers from the slot's state to its new one, read and written in place (fla's took a gather
and a scatter). What bounds it: each chunk's seven small products run one after another, about
2.9 µs a chunk (docs/gpu.md).

Same math and roundings as fla's two kernels (chunk_h_fwd.py, chunk_o_fwd.py), per chunk of BT
tokens with h the state [N keys, BV values] at the chunk's start:
    v2 = w h + u                       (h rounded to fp16 for the product, as fla stores it)
    o  = qg h + tril(A_qk) v + tril(A_qb) v2
    h  = exp2(g_last) h + kgᵀ v + bgᵀ v2
"""

from __future__ import annotations

import math
import os
import sys

import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens a chunk; w_log >= -DECAY_SCALE keeps fla's tensor-core scheme exact at 64
STAGES = 2  # chunks whose tiles are in flight at once (software pipelining depth)


@triton.jit(do_not_specialize=["H"])
def _state_out_kernel(QG, KG, BG, W, U, V, GI, AQK, AQB, O, S, slots, cu_seqlens, H,
                      N: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
    slot = tl.load(slots + i_n).to(tl.int64)
    o_k = tl.arange(0, N)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    # the slot's state is [values, keys]; h here is [keys, values]
    p_s = S + (slot * H + i_h) * (N * N) + o_v[None, :] * N + o_k[:, None]
    h = tl.load(p_s)
    causal = o_t[:, None] >= o_t[None, :]
    for c in tl.range(0, tl.cdiv(T, BT)):
        t = c * BT + o_t
        m_t = (t < T)[:, None]
        tok = (bos + t)[:, None]
        p_k = tok * (H * N) + i_h * N + o_k[None, :]  # [BT, N] of a [T, H, N] tensor
        p_v = tok * (H * N) + i_h * N + o_v[None, :]  # [BT, BV]
        p_a = tok * (H * BT) + i_h * BT + o_t[None, :]  # [BT, BT] of a [T, H, BT] tensor
        qg = tl.load(QG + p_k, mask=m_t, other=0.0)
        kg = tl.load(KG + p_k, mask=m_t, other=0.0)
        bg = tl.load(BG + p_k, mask=m_t, other=0.0)
        w = tl.load(W + p_k, mask=m_t, other=0.0)
        u = tl.load(U + p_v, mask=m_t, other=0.0)
        v = tl.load(V + p_v, mask=m_t, other=0.0)
        a_qk = tl.where(causal, tl.load(AQK + p_a, mask=m_t, other=0.0), 0.0).to(v.dtype)
        a_qb = tl.where(causal, tl.load(AQB + p_a, mask=m_t, other=0.0), 0.0).to(v.dtype)
        last = bos + tl.minimum(c * BT + BT, T) - 1
        g_last = tl.load(GI + last * (H * N) + i_h * N + o_k)
        hh = h.to(v.dtype)
        v2 = tl.dot(w, hh) + u.to(tl.float32)
        v2h = v2.to(v.dtype)
        o = tl.dot(qg, hh) + tl.dot(a_qk, v) + tl.dot(a_qb, v2h)
        tl.store(O + p_v, o.to(O.dtype.element_ty), mask=m_t)
        h = h * tl.exp2(g_last)[:, None] + tl.dot(tl.trans(kg), v) + tl.dot(tl.trans(bg).to(tl.float32), v2)
    tl.store(p_s, h)


def block_values(rows: int, heads: int, N: int, n_sm: int) -> int:
    """Values a program takes: the whole head when (rows × heads) programs fill the GPU, else
    fewer, down to 16, so that one long row still spreads over the multiprocessors."""
    bv = N
    while bv > 16 and rows * heads * (N // bv) < n_sm:
        bv //= 2
    return bv


def chunk_prefill(r, k, v, a, b, w_log, state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                  chunk_indices: torch.Tensor, n_sm: int) -> torch.Tensor:
    """The recurrence over ragged rows in the chunked form: o [T, C] in v's dtype; the rows' slots
    of state [S, H, N(values), N(keys)] advance in place.

    r, k, v, a, b [T, C] in fp16 or bf16 (one dtype), w_log [T, C] fp32 (log decay, >= -DECAY_SCALE);
    cu_seqlens [R + 1] int64 the rows' bounds on the token axis; chunk_indices fla's [n_chunks, 2]
    (row, chunk within the row) for every chunk of CHUNK tokens.
    """
    cumsum, intra, wy = fla_stages()
    T, C = v.shape
    H, N = state.shape[1], state.shape[2]
    r, k, v, a, b, w_log = (t.view(1, T, H, N) for t in (r, k, v, a, b, w_log))
    kw = {"cu_seqlens": cu_seqlens, "chunk_size": CHUNK, "chunk_indices": chunk_indices}
    gi, ge = cumsum(w_log, CHUNK, scale=math.log2(math.e), cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    A_ab, A_qk, A_ak, A_qb, qg, kg, ag, bg = intra(q=r, k=k, a=a, b=b, gi=gi, ge=ge, scale=1.0, safe_gate=True, **kw)
    w, u, _ = wy(ag=ag, A_ab=A_ab, A_ak=A_ak, v=v, safe_gate=True, **kw)
    o = state_out(qg, kg, bg, w, u, v, gi, A_qk, A_qb, state, slots, cu_seqlens, n_sm)
    return o.view(T, C)


def state_out(qg, kg, bg, w, u, v, gi, A_qk, A_qb, state: torch.Tensor, slots: torch.Tensor,
              cu_seqlens: torch.Tensor, n_sm: int) -> torch.Tensor:
    """The pass over the chunks (see the module's docstring): o like v; state advances in place.

    qg, kg, bg, w [.., T, H, N], u and v [.., T, H, N] in one 16-bit dtype, gi [.., T, H, N] fp32 (the
    decay's inclusive sums within chunks, in log2), A_qk, A_qb [.., T, H, CHUNK]: fla's stages' outputs.
    """
    H, N = state.shape[1], state.shape[2]
    R = slots.shape[0]
    o = torch.empty_like(v)
    bv = block_values(R, H, N, n_sm)
    _state_out_kernel[(N // bv, H, R)](qg, kg, bg, w, u, v, gi, A_qk, A_qb, o, state, slots, cu_seqlens, H,
                                       N=N, BT=CHUNK, BV=bv, num_warps=4, num_stages=STAGES)
    return o


# -- fla-core --------------------------------------------------------------------------------------

_PINNED = False


def fla_stages():
    """fla-core 0.6's three parallel stages (ImportError without it): the cumulative sum, the
    intra-chunk matrices and the WY representation, called below its autograd wrapper so that the
    chunk index comes from the runner's one host copy (the public chunk_rwkv7 builds it with a
    synchronising copy)."""
    global _PINNED
    from fla.ops.generalized_delta_rule.dplr.chunk_A_fwd import chunk_dplr_fwd_intra  # noqa: PLC0415
    from fla.ops.generalized_delta_rule.dplr.wy_fast_fwd import prepare_wy_repr_fwd  # noqa: PLC0415
    from fla.ops.rwkv6.chunk import chunk_rwkv6_fwd_cumsum  # noqa: PLC0415

    if not _PINNED and os.environ.get("RWKV_FLEET_FLA_AUTOTUNE") != "1":
        _pin_autotuners("fla.")
        _PINNED = True
    return chunk_rwkv6_fwd_cumsum, chunk_dplr_fwd_intra, prepare_wy_repr_fwd


def _pin_autotuners(prefix: str) -> None:
    """Gives each Triton autotuner in the modules under `prefix` one config (4 warps, 2 stages,
    the largest block up to 64). fla autotunes every kernel over up to 27 configs on first use,
    which costs minutes of compiling at every start; RWKV_FLEET_FLA_AUTOTUNE=1 keeps its tuning.
    """
    from triton.runtime.autotuner import Autotuner  # noqa: PLC0415

    def score(config):
        blocks = sum(v for v in config.kwargs.values() if isinstance(v, int) and v <= 64)
        return abs(config.num_warps - 4), abs((config.num_stages or 2) - 2), -blocks

    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for value in list(vars(module).values()):
            seen = 0
            while value is not None and seen < 4:  # heuristics/autotune wrappers nest through .fn
                if isinstance(value, Autotuner) and len(value.configs) > 1:
                    value.configs = [min(value.configs, key=score)]
                value, seen = getattr(value, "fn", None), seen + 1
