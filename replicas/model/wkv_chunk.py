"""The chunked RWKV-7 recurrence of long prefill: two Triton kernels.

Per head, with h the state [N keys, N values], RWKV-7 runs token by token
    h = diag(exp(w)) h + bᵀ(a h) + kᵀv,    o = r h
(a = -κ̂, b = κ̂·gate). Over a chunk of BT tokens this is a few dense products (the WY form of
fla-core's chunk_dplr_fwd, whose five stages these two kernels replace):

`_chunk_prep_kernel`, a program per (chunk, head), parallel over every chunk of every row: the
log₂ decays' sums gi within the chunk (ge: before each token, g_last: the chunk's), the gated
inputs qg = r·2^gi, kg = k·2^(g_last-gi), bg = b·2^(g_last-gi), the intra-chunk matrices
A_qk = tril((r·2^gi)(k·2^-gi)ᵀ), A_qb likewise with b, and the WY representation
    w = (I - L)⁻¹ (a·2^ge),  u = (I - L)⁻¹ A_ak v,  with L = strict((a·2^ge)(b·2^-gi)ᵀ)
and A_ak likewise with k. Exponents are taken from the chunk's middle token, so no factor leaves
fp32's range (fla's fp16 operands could overflow on strong decays); the products are tf32, the
inverse a product of (I + L^(2^i)), exact since L is strictly lower (L⁶⁴ = 0). It replaces
fla's three parallel stages: 1.5B's 4,096-token prefill spent 6.0 ms in those on an H200, and
spends 3.9 ms here (docs/gpu.md).

`_state_out_kernel`, a program per (row, head, block of values), walks its row's chunks with the
next chunks' tiles already loading (Triton's software pipelining), computes each chunk's output
from the state it holds, and keeps that state in registers from the slot's state to its new one,
read and written in place:
    v2 = w h + u                       (h rounded to fp16 for the product)
    o  = qg h + A_qk v + A_qb v2
    h  = exp2(g_last) h + kgᵀ v + bgᵀ v2
What bounds it: each chunk's seven small products run one after another, about 2.9 µs a chunk
(docs/gpu.md).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import kernels as K

CHUNK = 64  # tokens a chunk
PREP_WARPS = 4  # the prep kernel's (8: 1.5B's 4,096-token prefill 9% slower)
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


@triton.jit(do_not_specialize=["H"])
def _chunk_prep_kernel(Q, Kk, A, B, V, WL, QG, KG, BG, W, U, GI, AQK, AQB, cu_seqlens, chunk_indices, H,
                       N: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
    """One (chunk, head): what the pass takes (see the module's docstring)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    K._after_predecessor(PDL)
    i_n, c = tl.load(chunk_indices + 2 * i_c), tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    n_valid = tl.minimum(tl.load(cu_seqlens + i_n + 1) - bos - c * BT, BT).to(tl.int32)
    o_t, o_k = tl.arange(0, BT), tl.arange(0, N)
    m_t = (o_t < n_valid)[:, None]
    tok = (bos + c * BT + o_t)[:, None]
    p = tok * (H * N) + i_h * N + o_k[None, :]  # [BT, N] of a [T, H, N] tensor
    g = tl.load(WL + p, mask=m_t, other=0.0) * 1.4426950408889634  # log2 decays; 0 past the row's end
    gi = tl.cumsum(g, 0)  # through each token
    ge = gi - g  # before each token
    g_last = tl.sum(g, 0)
    off = tl.sum(tl.where(o_t[:, None] <= n_valid // 2, g, 0.0), 0)  # the middle token's gi: 2^± stay in range
    tl.store(GI + p, gi, mask=(o_t == n_valid - 1)[:, None])  # the pass reads the last token's only
    to_end = tl.exp2(g_last[None, :] - gi)
    from_mid = tl.exp2(off[None, :] - gi)
    k = tl.load(Kk + p, mask=m_t, other=0.0).to(tl.float32)
    b = tl.load(B + p, mask=m_t, other=0.0).to(tl.float32)
    tl.store(KG + p, (k * to_end).to(KG.dtype.element_ty), mask=m_t)
    tl.store(BG + p, (b * to_end).to(BG.dtype.element_ty), mask=m_t)
    k_t, b_t = tl.trans(k * from_mid), tl.trans(b * from_mid)
    q = tl.load(Q + p, mask=m_t, other=0.0).to(tl.float32)
    tl.store(QG + p, (q * tl.exp2(gi)).to(QG.dtype.element_ty), mask=m_t)
    q = q * tl.exp2(gi - off[None, :])
    row, col = o_t[:, None], o_t[None, :]
    p_a = tok * (H * BT) + i_h * BT + col  # [BT, BT] of a [T, H, BT] tensor
    # fp32 operands, tf32 products: the gated factors may leave fp16's range, their products do not
    tl.store(AQK + p_a, tl.where(row >= col, tl.dot(q, k_t), 0.0).to(AQK.dtype.element_ty), mask=m_t)
    tl.store(AQB + p_a, tl.where(row >= col, tl.dot(q, b_t), 0.0).to(AQB.dtype.element_ty), mask=m_t)
    a = tl.load(A + p, mask=m_t, other=0.0).to(tl.float32) * tl.exp2(ge - off[None, :])
    L = tl.where(row > col, tl.dot(a, b_t), 0.0)
    A_ak = tl.where(row > col, tl.dot(a, k_t), 0.0)
    # (I - L)⁻¹ = (I + L)(I + L²)(I + L⁴)…(I + L³²): L is strictly lower, so L⁶⁴ = 0. tf32 products
    # (fp16 operands from here on were 13% faster on 32 heads of 64, but faulted on heads of 32)
    inv = tl.where(row == col, 1.0, 0.0) + L
    for _ in tl.static_range(5):
        L = tl.dot(L, L)
        inv += tl.dot(inv, L)
    w = tl.dot(inv, a * tl.exp2(off[None, :]))
    tl.store(W + p, w.to(W.dtype.element_ty), mask=m_t)
    v = tl.load(V + p, mask=m_t, other=0.0).to(tl.float32)
    u = tl.dot(tl.dot(inv, A_ak), v)
    tl.store(U + p, u.to(U.dtype.element_ty), mask=m_t)


def chunk_indices(lengths: torch.Tensor) -> torch.Tensor:
    """(row, chunk within the row) for every chunk of CHUNK tokens of rows of these lengths: int64
    [n_chunks, 2] on the CPU (chunk_prefill takes it on the device)."""
    n_chunks = (lengths + CHUNK - 1) // CHUNK
    row_of = torch.from_numpy(np.repeat(np.arange(lengths.shape[0]), n_chunks.numpy()))  # torch's: ms on a CPU
    first = torch.cat([n_chunks.new_zeros(1), n_chunks.cumsum(0)[:-1]])
    return torch.stack([row_of, torch.arange(row_of.shape[0]) - first[row_of]], 1)


def chunk_prefill(r, k, v, a, b, w_log, state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                  chunk_indices: torch.Tensor, n_sm: int) -> torch.Tensor:
    """The recurrence over ragged rows in the chunked form: o [T, C] in v's dtype; the rows' slots
    of state [S, H, N(values), N(keys)] advance in place.

    r, k, v, a, b [T, C] (k, v, a, b in one 16-bit dtype), w_log [T, C] fp32 (log decay);
    cu_seqlens [R + 1] int64 the rows' bounds on the token axis; chunk_indices [n_chunks, 2]
    (row, chunk within the row) for every chunk of CHUNK tokens.
    """
    T, C = v.shape
    H, N = state.shape[1], state.shape[2]
    qg, kg, bg, w, u = (torch.empty_like(v) for _ in range(5))
    gi = torch.empty(T, C, device=v.device, dtype=torch.float32)  # written at each chunk's last token
    A_qk, A_qb = (torch.empty(T, H, CHUNK, device=v.device, dtype=v.dtype) for _ in range(2))
    _chunk_prep_kernel[(chunk_indices.shape[0], H)](r, k, a, b, v, w_log, qg, kg, bg, w, u, gi, A_qk, A_qb,
                                                    cu_seqlens, chunk_indices, H, N=N, BT=CHUNK,
                                                    num_warps=PREP_WARPS, **K._pdl())
    o = state_out(*(t.view(T, H, N) for t in (qg, kg, bg, w, u, v, gi)), A_qk, A_qb, state, slots, cu_seqlens,
                  n_sm)
    return o.view(T, C)


def state_out(qg, kg, bg, w, u, v, gi, A_qk, A_qb, state: torch.Tensor, slots: torch.Tensor,
              cu_seqlens: torch.Tensor, n_sm: int) -> torch.Tensor:
    """The pass over the chunks (see the module's docstring): o like v; state advances in place.

    qg, kg, bg, w [.., T, H, N], u and v [.., T, H, N] in one 16-bit dtype, gi [.., T, H, N] fp32 (the
    decay's inclusive sums within chunks, in log2; read at each chunk's last token), A_qk, A_qb
    [.., T, H, CHUNK]: _chunk_prep_kernel's outputs.
    """
    H, N = state.shape[1], state.shape[2]
    R = slots.shape[0]
    o = torch.empty_like(v)
    bv = block_values(R, H, N, n_sm)
    _state_out_kernel[(N // bv, H, R)](qg, kg, bg, w, u, v, gi, A_qk, A_qb, o, state, slots, cu_seqlens, H,
                                       N=N, BT=CHUNK, BV=bv, num_warps=4, num_stages=STAGES)
    return o


