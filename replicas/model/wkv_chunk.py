"""The chunked RWKV-7 recurrence of long prefill: three Triton kernels.

Per head, with h the state [N keys, N values], RWKV-7 runs token by token
    h = diag(exp(w)) h + bᵀ(a h) + kᵀv,    o = r h
(a = -κ̂, b = κ̂·gate). Over a chunk of BT tokens this is a few dense products (the WY form of
fla-core's chunk_dplr_fwd, whose five stages these three kernels replace):

`_chunk_prep_kernel`, a program per (chunk, head), parallel over every chunk of every row. It
starts from the layer's projections: the log decay, k', v', a, b and the bonus, as
kernels.wkv_prepare computes them for the recurrent kernel (since 12-02c; a kernel of its own
before, which wrote them out for this one to read). Then the
log₂ decays' sums gi within the chunk (ge: before each token, g_last: the chunk's), the gated
inputs qg = r·2^gi, kg = k·2^(g_last-gi), bg = b·2^(g_last-gi), the intra-chunk matrices
A_qk = tril((r·2^gi)(k·2^-gi)ᵀ), A_qb likewise with b, and the WY representation
    w = (I - L)⁻¹ (a·2^ge),  u = (I - L)⁻¹ A_ak v,  with L = strict((a·2^ge)(b·2^-gi)ᵀ)
and A_ak likewise with k. Exponents are taken from half the chunk's decay, so no factor leaves
fp32's range (fla's fp16 operands could overflow on strong decays); these products are tf32. The
inverse is taken in three levels of blocks, of 4, 16 and 64 tokens, each level from the one below
(the kernel says how), in fp16 operands on heads of 64 (25% faster than tf32 there; fp16 faulted
on heads of 32). Until 12-07e it was one product of (I + L^(2^i)) over the whole chunk, whose
powers of L grew far past the inverse and out of fp16's range on a trained model's repetitive
text; until 12-07h two levels, the first (I + Ld^(2^i)) over blocks of 16 tokens, whose powers
still grew enough for fp16's rounding to cancel into large errors on runs of one token
(docs/gpu.md). It replaces
fla's three parallel stages: 1.5B's 4,096-token prefill spent 6.0 ms in those on an H200, and
spends 2.9 ms here (docs/gpu.md).

`_state_pass_kernel`, a program per (row, head, block of values), walks its row's chunks and keeps
the state in registers from the slot's state to its new one, read and written in place; it stores
each chunk's starting state h_c (fp16) and v2:
    v2 = w h + u                       (h and v2 rounded to fp16 for the products)
    h  = exp2(g_last) h + kgᵀ v + bgᵀ v2
It asks for the next chunk's tiles into registers before the current chunk's products: with
Triton's own pipelining it waited for them at the top of every chunk (2.3 µs a chunk where this
takes 1.3, H200; docs/gpu.md).

`_chunk_out_kernel`, a program per (chunk, head), parallel again: o = qg h_c + A_qk v + A_qb v2,
and in the runner the time mix's end from o in fp32 (GroupNorm, bonus, gate: kernels.wkv_finish's
math), so o never goes through memory.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import kernels as K

CHUNK = 64  # tokens a chunk
PREP_WARPS = 4  # the prep kernel's (8: 1.5B's 4,096-token prefill 9% slower)
F16_INVERSE = True  # the prep kernel's inverse in fp16 operands on heads of 64 (see there)


@triton.jit(do_not_specialize=["H"])
def _state_pass_kernel(KG, BG, W, U, V, GI, V2, HC, S, slots, cu_seqlens, H,
                       N: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """One (block of values, head, row): the state through the row's chunks (module docstring).
    Each chunk's tiles are asked for one chunk ahead, into registers, before the products that
    need the previous chunk's: Triton's own pipelining waited for them at the top of the chunk."""
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
    first = 0  # the row's first chunk among all rows' (rows before it: a few loads)
    for j in tl.range(0, i_n):
        first += tl.cdiv(tl.load(cu_seqlens + j + 1) - tl.load(cu_seqlens + j), BT).to(tl.int32)
    slot = tl.load(slots + i_n).to(tl.int64)
    o_k = tl.arange(0, N)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    # the slot's state is [values, keys]; h here is [keys, values]
    p_s = S + (slot * H + i_h) * (N * N) + o_v[None, :] * N + o_k[:, None]
    h = tl.load(p_s)
    n_chunks = tl.cdiv(T, BT)
    m_t = (o_t < T)[:, None]
    tok = (bos + o_t)[:, None]
    p_k = tok * (H * N) + i_h * N + o_k[None, :]  # [BT, N] of a [T, H, N] tensor
    p_v = tok * (H * N) + i_h * N + o_v[None, :]  # [BT, BV]
    kg_next = tl.load(KG + p_k, mask=m_t, other=0.0)
    bg_next = tl.load(BG + p_k, mask=m_t, other=0.0)
    w_next = tl.load(W + p_k, mask=m_t, other=0.0)
    u_next = tl.load(U + p_v, mask=m_t, other=0.0)
    v_next = tl.load(V + p_v, mask=m_t, other=0.0)
    g_next = tl.load(GI + (bos + tl.minimum(BT, T) - 1) * (H * N) + i_h * N + o_k)
    for c in tl.range(0, n_chunks, num_stages=1):
        kg, bg, w, u, v, g_last, m_c, p_c = kg_next, bg_next, w_next, u_next, v_next, g_next, m_t, p_v
        t = (c + 1) * BT + o_t
        m_t = (t < T)[:, None]
        tok = (bos + t)[:, None]
        p_k = tok * (H * N) + i_h * N + o_k[None, :]
        p_v = tok * (H * N) + i_h * N + o_v[None, :]
        kg_next = tl.load(KG + p_k, mask=m_t, other=0.0)
        bg_next = tl.load(BG + p_k, mask=m_t, other=0.0)
        w_next = tl.load(W + p_k, mask=m_t, other=0.0)
        u_next = tl.load(U + p_v, mask=m_t, other=0.0)
        v_next = tl.load(V + p_v, mask=m_t, other=0.0)
        last = bos + tl.minimum((c + 2) * BT, T) - 1
        g_next = tl.load(GI + last * (H * N) + i_h * N + o_k, mask=c + 1 < n_chunks, other=0.0)
        hh = h.to(v.dtype)
        tl.store(HC + ((first + c) * H + i_h).to(tl.int64) * (N * N) + o_k[:, None] * N + o_v[None, :], hh)
        v2 = (tl.dot(w, hh) + u.to(tl.float32)).to(v.dtype)
        tl.store(V2 + p_c, v2, mask=m_c)
        h = h * tl.exp2(g_last)[:, None] + tl.dot(tl.trans(kg), v) + tl.dot(tl.trans(bg), v2)
    tl.store(p_s, h)


@triton.jit
def _chunk_tile(cu_seqlens, chunk_indices, i_c, BT: tl.constexpr):
    """Chunk i_c: (its first token on the token axis, int64; how many of its BT tokens lie in the
    row; the token offsets in the chunk [BT, 1], int32). Offsets past the first token stay 32-bit:
    a tile of 64-bit offsets takes two registers an element, and the prep kernel is at 255."""
    i_n, c = tl.load(chunk_indices + 2 * i_c), tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    n_valid = tl.minimum(tl.load(cu_seqlens + i_n + 1) - bos - c * BT, BT).to(tl.int32)
    return bos + c * BT, n_valid, tl.arange(0, BT)[:, None]


@triton.jit(do_not_specialize=["H"])
def _chunk_out_kernel(QG, V, V2, AQK, AQB, HC, O, G, ldg, bonus, prm, cu_seqlens, chunk_indices, H, C, gn_eps,
                      N: tl.constexpr, BT: tl.constexpr, FINISH: tl.constexpr, PDL: tl.constexpr):
    """One (chunk, head): o = qg h + A_qk v + A_qb v2 from the state the pass left at the chunk;
    with FINISH, the time mix's end as kernels.wkv_finish (GroupNorm, bonus, gate) from o in fp32."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    K._after_predecessor(PDL)
    t0, n_valid, t = _chunk_tile(cu_seqlens, chunk_indices, i_c, BT)
    if n_valid <= 0:  # an entry past the call's chunks (chunk_indices' padding): nothing to do
        return
    o_k = tl.arange(0, N)
    m_t = t < n_valid
    p = t * (H * N) + i_h * N + o_k[None, :]  # [BT, N] of a [T, H, N] tensor from the chunk's first token
    p_a = t * (H * BT) + i_h * BT + tl.arange(0, BT)[None, :]  # [BT, BT] of a [T, H, BT] tensor
    QG, V, V2, O = QG + t0 * (H * N), V + t0 * (H * N), V2 + t0 * (H * N), O + t0 * (H * N)
    causal = t >= tl.arange(0, BT)[None, :]
    qg = tl.load(QG + p, mask=m_t, other=0.0)
    v = tl.load(V + p, mask=m_t, other=0.0)
    v2 = tl.load(V2 + p, mask=m_t, other=0.0)
    a_qk = tl.where(causal, tl.load(AQK + t0 * (H * BT) + p_a, mask=m_t, other=0.0), 0.0).to(v.dtype)
    a_qb = tl.where(causal, tl.load(AQB + t0 * (H * BT) + p_a, mask=m_t, other=0.0), 0.0).to(v.dtype)
    hc = tl.load(HC + (i_c * H + i_h).to(tl.int64) * (N * N) + o_k[:, None] * N + o_k[None, :])
    o = tl.dot(qg, hc) + tl.dot(a_qk, v) + tl.dot(a_qb, v2)
    if FINISH:
        col = i_h * N + o_k
        mean = tl.sum(o, 1) / N
        d = o - mean[:, None]
        o = d * tl.rsqrt(tl.sum(d * d, 1) / N + gn_eps)[:, None] * tl.load(prm + 6 * C + col)[None, :]
        o += tl.load(prm + 7 * C + col)[None, :]
        o += tl.load(bonus + t0 * H + t * H + i_h, mask=m_t, other=0.0) * v.to(tl.float32)
        o *= tl.load(G + t0 * ldg + t * ldg + col[None, :], mask=m_t, other=0.0).to(tl.float32)
    tl.store(O + p, o.to(O.dtype.element_ty), mask=m_t)


def block_values(rows: int, heads: int, N: int, n_sm: int) -> int:
    """Values a pass program takes: at most 32 (a whole head of 64 in registers spills), fewer,
    down to 16, while the programs would fill half the multiprocessors or less, so that one long
    row still spreads over the GPU (H200, one layer of 4,096 tokens: 1.5B's 32 heads fastest at 16,
    7.2B's 64 heads at 32; docs/gpu.md)."""
    bv = min(N, 32)
    while bv > 16 and rows * heads * (N // bv) <= n_sm // 2:
        bv //= 2
    return bv


@triton.jit
def _next_level(d_inv, lo, eye, dt: tl.constexpr):
    """(I - L)⁻¹ in dt from d_inv = (I - Ld)⁻¹ (Ld: L's blocks on the diagonal) and lo = L - Ld, where
    each block of the level holds four of Ld's: M = d_inv lo is strictly lower by blocks (M⁴ = 0),
    so (I - L)⁻¹ = (I - M)⁻¹ d_inv = (I + M)(I + M²) d_inv."""
    M = tl.dot(d_inv, lo.to(dt))
    inv = tl.dot((eye + M).to(dt), (eye + tl.dot(M.to(dt), M.to(dt))).to(dt))
    return tl.dot(inv.to(dt), d_inv).to(dt)


@triton.jit(do_not_specialize=["H"])
def _chunk_prep_kernel(Rr, Kr, Vr, ldp, WLr, ALr, VLr, ldl, VF, prm, V, BONUS, QG, KG, BG, W, U, GI, AQK, AQB,
                       cu_seqlens, chunk_indices, H, C, N: tl.constexpr, BT: tl.constexpr, F16: tl.constexpr,
                       FIRST: tl.constexpr, PDL: tl.constexpr):
    """One (chunk, head): first the time mix's inputs from the projections, as kernels.wkv_prepare
    (log decay, k', v', a, b, the bonus; v' and the bonus are stored for the pass and the outputs,
    on the first layer v as v_first), then what the pass takes (the module's docstring)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    K._after_predecessor(PDL)
    t0, n_valid, t = _chunk_tile(cu_seqlens, chunk_indices, i_c, BT)
    if n_valid <= 0:  # an entry past the call's chunks (chunk_indices' padding): nothing to do
        return
    o_k = tl.arange(0, N)
    m_t = t < n_valid
    ch = i_h * N + o_k[None, :]  # the head's channels
    p = t * (H * N) + ch  # [BT, N] of a [T, H, N] tensor from the chunk's first token
    Rr, Kr, Vr = Rr + t0 * ldp, Kr + t0 * ldp, Vr + t0 * ldp
    WLr, ALr, VLr = WLr + t0 * ldl, ALr + t0 * ldl, VLr + t0 * ldl
    VF, V, BONUS, GI = VF + t0 * C, V + t0 * C, BONUS + t0 * H, GI + t0 * C
    QG, KG, BG, W, U = QG + t0 * C, KG + t0 * C, BG + t0 * C, W + t0 * C, U + t0 * C
    # the packed parameters [8, C], rows w0, a0, v0, k_k, k_a, r_k (kernels._time_mix_params), then the
    # GroupNorm's weight and bias: each read where it is used
    prm += ch
    # wl, k, al and r asked for at once, v' made and stored right after the decays' sums (then only
    # its 16 bits stay live through the products): each input loaded where it was first needed cost
    # one DRAM round trip after another (7.2B's shape, one launch: 354 -> 297 us; docs/gpu-history.md)
    wl = tl.load(WLr + t * ldl + ch, mask=m_t, other=0.0).to(tl.float32)
    k16 = tl.load(Kr + t * ldp + ch, mask=m_t, other=0.0)
    al16 = tl.load(ALr + t * ldl + ch, mask=m_t, other=0.0)
    q16 = tl.load(Rr + t * ldp + ch, mask=m_t, other=0.0)
    g = tl.where(m_t, K._log_decay(wl, tl.load(prm)) * 1.4426950408889634, 0.0)  # log2 decays; 0 past the row's end
    gi = tl.cumsum(g, 0)  # through each token
    ge = gi - g  # before each token
    g_last = tl.sum(g, 0)
    off = 0.5 * g_last  # 2^(gi - off) and its inverse stay in range (|g| < 0.88 a token)
    tl.store(GI + (n_valid - 1) * C + i_h * N + o_k, g_last)  # the pass reads the last token's gi only
    v = tl.load(Vr + t * ldp + ch, mask=m_t, other=0.0).to(tl.float32)
    if FIRST:
        tl.store(VF + p, v.to(VF.dtype.element_ty), mask=m_t)
    else:
        vl = tl.load(VLr + t * ldl + ch, mask=m_t, other=0.0).to(tl.float32)
        v = K._value_input(v, vl, tl.load(VF + p, mask=m_t, other=0.0).to(tl.float32), tl.load(prm + 2 * C), FIRST)
    v = v.to(V.dtype.element_ty)
    tl.store(V + p, v, mask=m_t)
    k = k16.to(tl.float32)
    al = al16.to(tl.float32)
    k, a, b = K._key_inputs(k, al, tl.load(prm + C), tl.load(prm + 3 * C), tl.load(prm + 4 * C), 1)
    a = a.to(V.dtype.element_ty)  # (|a| <= 1) held in 16 bits until it is scaled, below
    up = K._exp2(off)[None, :]  # 2^off, a column's factor (g_last = 2·off)
    from_mid = K._exp2(off[None, :] - gi)
    to_end = from_mid * up  # 2^(g_last - gi)
    tl.store(KG + p, (k * to_end).to(KG.dtype.element_ty), mask=m_t)
    tl.store(BG + p, (b * to_end).to(BG.dtype.element_ty), mask=m_t)
    k_t, b_t = tl.trans(k * from_mid), tl.trans(b * from_mid)
    q = q16.to(tl.float32)
    tl.store(BONUS + t * H + i_h, K._bonus(q, k, tl.load(prm + 5 * C), 1), mask=m_t)
    q = q * K._exp2(gi - off[None, :])
    tl.store(QG + p, (q * up).to(QG.dtype.element_ty), mask=m_t)  # r·2^gi
    row, col = t, tl.arange(0, BT)[None, :]
    AQK, AQB = AQK + t0 * (H * BT), AQB + t0 * (H * BT)
    p_a = t * (H * BT) + i_h * BT + col  # [BT, BT] of a [T, H, BT] tensor
    # fp32 operands, tf32 products: the gated factors may leave fp16's range, their products do not
    tl.store(AQK + p_a, tl.where(row >= col, tl.dot(q, k_t), 0.0).to(AQK.dtype.element_ty), mask=m_t)
    tl.store(AQB + p_a, tl.where(row >= col, tl.dot(q, b_t), 0.0).to(AQB.dtype.element_ty), mask=m_t)
    a = a.to(tl.float32) * K._exp2(ge - off[None, :])
    L = tl.where(row > col, tl.dot(a, b_t), 0.0)
    A_ak = tl.where(row > col, tl.dot(a, k_t), 0.0)
    # (I - L)⁻¹ in three levels of blocks, BT/16, BT/4 and BT tokens (docs/gpu-history.md, "12-07e" and
    # "12-07h"). With L1 the blocks of BT/16 on L's diagonal (L1⁴ = 0): (I - L1)⁻¹ = (I + L1)(I + L1²);
    # then each level from the one below (_next_level). Ten products, as the two levels before 12-07h
    # (the first: (I + Ld)(I + Ld²)(I + Ld⁴)(I + Ld⁸) over blocks of BT/4), whose powers of Ld grew
    # to 47 where the inverse is at most 1, so that their fp16 rounding cancelled into errors of w past
    # 100% on a trained model's runs of one token (a run of 130 "x": logits 2.0e-2 from fp32).
    # On heads of 64 fp16 operands, as fla's WY stage; on smaller heads tf32 (docs/gpu.md: fp16
    # faulted there). The first level is L1 + L1² + L1·L1² with its diagonal set to 1: as (I + L1)
    # times (I + L1²), I added to each, ptxas found too few registers for the products' pipeline
    # and made every product of the kernel wait for the one before (its advisory C7511;
    # tools/compile_kernels.py reports it): against the two levels, new prompts' prefill 0.8% slower
    # at 7.2B's 4,096 tokens, 2.0% at 1.5B's 16 x 1,024; so written, 0.3% and 0.1% (H100, 12-07i)
    dt = tl.float16 if F16 else tl.float32
    eye = tl.where(row == col, 1.0, 0.0)
    in_4 = (row // (BT // 16)) == (col // (BT // 16))
    in_16 = (row // (BT // 4)) == (col // (BT // 4))
    L1 = tl.where(in_4, L, 0.0).to(dt)
    L1_2 = tl.dot(L1, L1).to(dt)
    d_inv = tl.where(row == col, 1.0, tl.dot(L1, L1_2, L1.to(tl.float32) + L1_2.to(tl.float32)))
    d_inv = _next_level(d_inv.to(dt), tl.where(in_16 & ~in_4, L, 0.0), eye, dt)
    inv = _next_level(d_inv, tl.where(in_16, 0.0, L), eye, dt)
    w = tl.dot(inv, (a * up).to(dt))
    tl.store(W + p, w.to(W.dtype.element_ty), mask=m_t)
    u = tl.dot(tl.dot(inv, A_ak.to(dt)).to(dt), v.to(dt))
    tl.store(U + p, u.to(U.dtype.element_ty), mask=m_t)


def chunk_indices(lengths, n: int | None = None) -> torch.Tensor:
    """(row, chunk within the row) for every chunk of CHUNK tokens of rows of these lengths (any
    1-D integer array): int64 [n_chunks, 2] on the CPU (chunk_prefill takes it on the device).
    With n, n entries: those past the rows' chunks name the last row's chunk n, which holds no
    token (its programs store nothing), so that a call's shape follows its buckets only.
    numpy: torch's small operations cost microseconds each on the host."""
    n_chunks = (np.asarray(lengths, dtype=np.int64) + CHUNK - 1) // CHUNK
    row_of = np.repeat(np.arange(n_chunks.shape[0]), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks
    out = np.stack([row_of, np.arange(row_of.shape[0]) - first[row_of]], 1)
    if n is not None:
        if n < out.shape[0]:
            raise ValueError(f"{out.shape[0]} chunks do not fit in {n}")
        out = np.concatenate([out, np.tile([[n_chunks.shape[0] - 1, n]], (n - out.shape[0], 1))])
    return torch.from_numpy(out)


def chunk_prefill(r, k, v, wl, al, vl, v_first: torch.Tensor, prm: torch.Tensor, first: bool, state: torch.Tensor,
                  slots: torch.Tensor, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, n_sm: int,
                  kv_dtype: torch.dtype = torch.float16, finish: tuple | None = None, bv: int | None = None,
                  ) -> torch.Tensor:
    """The time mix's recurrence over ragged rows in the chunked form, from the projections: o
    [T, C] in kv_dtype; the rows' slots of state [S, H, N(values), N(keys)] advance in place. With
    finish = (g, dtype), the time mix's output instead: kernels.wkv_finish's math (GroupNorm,
    bonus, gate) from o in fp32, without o's round trip through memory.

    r, k, v [T, C] sharing a row stride, wl, al, vl (the LoRAs' outputs) [T, C] sharing another,
    v_first [T, C] (written on the first layer, read after), prm the layer's packed time-mix
    parameters [8, C] (kernels.wkv_prepare takes the same); cu_seqlens [R + 1] int64 the rows'
    bounds on the token axis; chunk_indices [n_chunks, 2] (row, chunk within the row) for every
    chunk of CHUNK tokens (chunk_indices()). kv_dtype: the 16-bit dtype of the chunk kernels'
    products.
    """
    T, C = r.shape
    H, N = state.shape[1], state.shape[2]
    dev = r.device
    qg, kg, bg, w, u, v_ = (torch.empty(T, C, device=dev, dtype=kv_dtype) for _ in range(6))
    bonus = torch.empty(T, H, device=dev, dtype=torch.float32)
    gi = torch.empty(T, C, device=dev, dtype=torch.float32)  # written at each chunk's last token
    A_qk, A_qb = (torch.empty(T, H, CHUNK, device=dev, dtype=kv_dtype) for _ in range(2))
    _chunk_prep_kernel[(chunk_indices.shape[0], H)](
        r, k, v, r.stride(0), wl, al, vl, wl.stride(0), v_first, prm, v_, bonus, qg, kg, bg, w, u, gi, A_qk, A_qb,
        cu_seqlens, chunk_indices, H, C, N=N, BT=CHUNK, F16=F16_INVERSE and N >= 64, FIRST=first,
        num_warps=PREP_WARPS, **K._pdl())
    if finish is not None:
        finish = (finish[0], bonus, prm, finish[1])
    o = state_out(*(t.view(T, H, N) for t in (qg, kg, bg, w, u, v_, gi)), A_qk, A_qb, state, slots, cu_seqlens,
                  chunk_indices, n_sm, finish, bv)
    return o.view(T, C)


def state_out(qg, kg, bg, w, u, v, gi, A_qk, A_qb, state: torch.Tensor, slots: torch.Tensor,
              cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, n_sm: int,
              finish: tuple | None = None, bv: int | None = None) -> torch.Tensor:
    """The pass over the chunks, then the outputs (see the module's docstring): o like v (or the
    time mix's output, as chunk_prefill says); state advances in place. bv: the pass's values a
    program (default block_values of these rows).

    qg, kg, bg, w [.., T, H, N], u and v [.., T, H, N] in one 16-bit dtype, gi [.., T, H, N] fp32 (the
    decay's inclusive sums within chunks, in log2; read at each chunk's last token), A_qk, A_qb
    [.., T, H, CHUNK]: _chunk_prep_kernel's outputs.
    """
    H, N = state.shape[1], state.shape[2]
    R, n_chunks = slots.shape[0], chunk_indices.shape[0]
    v2 = torch.empty_like(v)
    h_c = torch.empty(n_chunks, H, N, N, device=v.device, dtype=v.dtype)  # the state at each chunk's start
    bv = bv or block_values(R, H, N, n_sm)
    _state_pass_kernel[(N // bv, H, R)](kg, bg, w, u, v, gi, v2, h_c, state, slots, cu_seqlens, H,
                                        N=N, BT=CHUNK, BV=bv, num_warps=4)
    g, bonus, prm, dtype = finish if finish is not None else (v, v, v, v.dtype)  # (unread without finish)
    o = torch.empty(v.shape, device=v.device, dtype=dtype)
    _chunk_out_kernel[(n_chunks, H)](qg, v, v2, A_qk, A_qb, h_c, o, g, g.stride(0), bonus, prm, cu_seqlens,
                                     chunk_indices, H, H * N, K.GN_EPS, N=N, BT=CHUNK, FINISH=finish is not None,
                                     num_warps=4, **K._pdl())
    return o
