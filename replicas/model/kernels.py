"""Triton kernels of the CUDA runner (cuda_runner.py), each beside the torch lines it replaces.

Owns fused arithmetic only: no weights, no slots, no decisions about which path runs. Every kernel
is checked against `rwkv7.py` (the fp32 definition) in tests/gpu, on the H200 and, slowly, on the
CPU under TRITON_INTERPRET=1.

Layouts (T = tokens or decode rows, C = n_embd, H heads of N, slot = a row of the state tensors):
    x          [T, C]      fp32  the residual stream
    mixed      [T, G·C]    fp16  token-shift mixes, group-major: time mix G = 6 (r, k, v, w, a, g),
                                 channel mix G = 1
    shift      [S, C]      fp32  one layer's token-shift state (att or ffn)
    wkv        [S, H, N, N] fp32 one layer's wkv state: rows = value index, columns = key index
    proj       [T, 3C + Rp] fp16 decode: r | k | v | the four LoRA hiddens (activated), padded
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

DECAY_SCALE = 0.606531  # as in rwkv7.py: w = exp(-DECAY_SCALE · sigmoid(·))
LN_EPS = 1e-5
GN_EPS = 64e-5

ACT_NONE, ACT_TANH, ACT_SIGMOID, ACT_RELU2 = 0, 1, 2, 3
EPI_STORE, EPI_ATOMIC_ADD = 0, 1  # gemv epilogues: store (in Y's dtype), or add into fp32 Y


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while its
# predecessor in the stream finishes. `_after_predecessor` waits until the predecessor has
# finished and its writes are visible, then lets the next kernel launch. Before it, a kernel reads
# only what no kernel writes (weights, tables) or what only kernels before its predecessor wrote
# (a slot's wkv state: the predecessor started after those had finished). Every kernel here calls
# it, so the chain stays in order (at most two kernels in flight). The runner sets PDL for the
# launches that follow (pdl_supported says where it may).
PDL = False


def pdl_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# The hardware's approximate exp2 and reciprocal, one instruction each (flush-to-zero). Triton's exp2
# guards against denormal results (four instructions an element) and its division takes an
# IEEE-safe path (sigmoid: 14-16 instructions an element where _sigmoid takes 4); the chunk prep
# kernel is bound by the instructions it issues at its two programs a multiprocessor
# (docs/gpu-history.md, 12-02e). The interpreter runs the plain forms (it has no PTX).
if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def _exp2(x):
        return tl.exp2(x)

    @triton.jit
    def _rcp(x):
        return 1.0 / x
else:
    @triton.jit
    def _exp2(x):
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _rcp(x):
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _sigmoid(x):
    return _rcp(1.0 + _exp2(x * -1.4426950408889634))


def _pdl() -> dict:
    return {"PDL": True, "launch_pdl": True} if PDL else {"PDL": False}


@triton.jit
def _after_predecessor(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def _warps(C: int) -> int:
    """Warps for a program that holds a whole [C] row (or a few [H, N] tiles) in registers."""
    return max(4, min(16, _pow2(C) // 256))


# --------------------------------------------------------------------------------------------
# LayerNorm and token shift
#   torch: h = ln(x + dx); prev = previous token's h (or the slot's shift); out_g = h + (prev - h)·mix_g
# --------------------------------------------------------------------------------------------


@triton.jit
def _layernorm(x, w, b, mask, C, eps):
    mean = tl.sum(x, 0) / C
    d = tl.where(mask, x - mean, 0.0)
    var = tl.sum(d * d, 0) / C
    return d * tl.rsqrt(var + eps) * w + b


@triton.jit
def _embed_ln_kernel(tok_ptr, emb_ptr, w_ptr, b_ptr, x_ptr, C, eps, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    tok = tl.load(tok_ptr + t).to(tl.int64)
    e = tl.load(emb_ptr + tok * C + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0)
    _after_predecessor(PDL)  # loads before it, stores after: x's memory may be a buffer it reads
    tl.store(x_ptr + t * C + cols, _layernorm(e, w, b, mask, C, eps), mask=mask)


def embed_ln(tokens: torch.Tensor, emb: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x [T, C] fp32 = LayerNorm(emb[tokens]) (block 0's ln0)."""
    T, C = tokens.shape[0], emb.shape[1]
    x = torch.empty(T, C, device=emb.device, dtype=torch.float32)
    _embed_ln_kernel[(T,)](tokens, emb, w, b, x, C, LN_EPS, BLOCK_C=_pow2(C), num_warps=4, **_pdl())
    return x


@triton.jit(do_not_specialize=["cols_per"])
def _ln_shift_mix_kernel(
    x_in, dx, x_out, ln_w, ln_b, shift, tok_slot, tok_row, new_shift, mix, out, C, cols_per, eps,
    HAS_DX: tl.constexpr, STORE_X: tl.constexpr, PREFILL: tl.constexpr, NMIX: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    # program (token, column block): the statistics need the whole row, the stores only the block's
    t = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * cols_per
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    cmask = mask & (cols >= lo) & (cols < lo + cols_per)
    groups = tl.arange(0, BLOCK_G)[:, None]
    gmask = (groups < NMIX) & cmask[None, :]
    # before the wait (PDL): the weights, the mixes (as one tile), and the slot's shift (which only
    # this kernel writes, a step or a call ago; in prefill, a row's first token's)
    w = tl.load(ln_w + cols, mask=mask, other=0.0)
    b = tl.load(ln_b + cols, mask=mask, other=0.0)
    m = tl.load(mix + groups * C + cols[None, :], mask=gmask, other=0.0)  # [BLOCK_G, BLOCK_C]
    slot = tl.load(tok_slot + t).to(tl.int64)
    prev = tl.load(shift + tl.maximum(slot, 0) * C + cols, mask=cmask & (slot >= 0), other=0.0)
    _after_predecessor(PDL)
    xt = tl.load(x_in + t * C + cols, mask=mask, other=0.0)
    if HAS_DX:
        xt += tl.load(dx + t * C + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_X:
        tl.store(x_out + t * C + cols, xt, mask=cmask)
    h = _layernorm(xt, w, b, mask, C, eps)
    if PREFILL:
        # a token other than its row's first takes its predecessor's h, which this program
        # recomputes (x_in is never written here, so there is no race)
        if slot < 0:
            xp = tl.load(x_in + (t - 1) * C + cols, mask=mask, other=0.0)
            if HAS_DX:
                xp += tl.load(dx + (t - 1) * C + cols, mask=mask, other=0.0).to(tl.float32)
            prev = _layernorm(xp, w, b, mask, C, eps)
        row = tl.load(tok_row + t).to(tl.int64)  # >= 0 on a row's last token
        if row >= 0:
            tl.store(new_shift + row * C + cols, h, mask=cmask)
    else:  # decode: one token per row, so this program alone reads and writes these columns of the shift
        tl.store(shift + slot * C + cols, h, mask=cmask)
    mixed = h[None, :] + (prev - h)[None, :] * m
    tl.store(out + t * (NMIX * C) + groups * C + cols[None, :], mixed.to(out.dtype.element_ty), mask=gmask)


@triton.jit
def _residual_row(x_in, dx, t, cols, mask, C, HAS_DX: tl.constexpr):
    """Token t's x_in + dx (zeros where masked)."""
    x = tl.load(x_in + t * C + cols, mask=mask, other=0.0)
    if HAS_DX:
        x += tl.load(dx + t * C + cols, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["T"])
def _ln_shift_mix_rows_kernel(
    x_in, dx, x_out, ln_w, ln_b, shift, tok_slot, tok_row, new_shift, mix, out, T, C, eps,
    HAS_DX: tl.constexpr, STORE_X: tl.constexpr, PREFILL: tl.constexpr, NMIX: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, TOK: tl.constexpr, PDL: tl.constexpr,
):
    """The same for many tokens: a program takes TOK consecutive tokens, one after another. The mixes
    and LayerNorm weights are read once (before the PDL wait), a token's h is its successor's
    predecessor (only the program's first token recomputes one), and the next token's row is read
    while this one's is worked on."""
    t0 = tl.program_id(0).to(tl.int64) * TOK
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    groups = tl.arange(0, BLOCK_G)[:, None]
    gmask = (groups < NMIX) & mask[None, :]
    w = tl.load(ln_w + cols, mask=mask, other=0.0)
    b = tl.load(ln_b + cols, mask=mask, other=0.0)
    m = tl.load(mix + groups * C + cols[None, :], mask=gmask, other=0.0)  # [BLOCK_G, BLOCK_C]
    _after_predecessor(PDL)
    prev = tl.zeros([BLOCK_C], dtype=tl.float32)
    if PREFILL:  # the first token's predecessor, unless it starts its row (then the slot's shift, below)
        prev = _layernorm(_residual_row(x_in, dx, t0 - 1, cols, mask & (t0 > 0), C, HAS_DX), w, b, mask, C, eps)
    x_next = _residual_row(x_in, dx, t0, cols, mask & (t0 < T), C, HAS_DX)
    for i in tl.static_range(TOK):
        t = t0 + i
        live = t < T
        xt = x_next
        if i + 1 < TOK:
            x_next = _residual_row(x_in, dx, t + 1, cols, mask & (t + 1 < T), C, HAS_DX)
        slot = tl.load(tok_slot + t, mask=live, other=-1).to(tl.int64)  # decode: every token has one
        prev = tl.where(slot >= 0, tl.load(shift + tl.maximum(slot, 0) * C + cols, mask=mask & (slot >= 0)), prev)
        if STORE_X:
            tl.store(x_out + t * C + cols, xt, mask=mask & live)
        h = _layernorm(xt, w, b, mask, C, eps)
        if PREFILL:
            row = tl.load(tok_row + t, mask=live, other=-1).to(tl.int64)  # >= 0 on a row's last token
            tl.store(new_shift + tl.maximum(row, 0) * C + cols, h, mask=mask & (row >= 0))
        else:  # one token per row: only this program reads and writes its slot's shift
            tl.store(shift + tl.maximum(slot, 0) * C + cols, h, mask=mask & live)
        mixed = h[None, :] + (prev - h)[None, :] * m
        tl.store(out + t * (NMIX * C) + groups * C + cols[None, :], mixed.to(out.dtype.element_ty), mask=gmask & live)
        prev = h


# Up to this many tokens, a program a token (few tokens: their columns spread over programs); more
# take the rows kernel, which reads the mixes once for a run of tokens: on an H200 a program a token
# was 5% slower at 256 decode rows and 8% in a 4,096-token prefill (docs/gpu.md).
TOKEN_PROGRAMS_MAX = 64
ROWS_TOKENS = 4  # at most this many tokens per program of the rows kernel,
ROWS_PROGRAMS = 512  # fewer (a power of 2) when there would be fewer programs than about this
# Its warps: enough that a thread holds at most this many elements of the mixes' [BLOCK_G, BLOCK_C]
# tile, at least 4. H200, the kernel alone at 4,095 tokens (12-01k): 1.5B's six mixes 71.7 -> 54.6 us
# (8 warps and 8 tokens a program before), its one mix 35.6 -> 33.3; 7.2B's one mix 74.0 -> 61.8, its
# six equal (116-118 us at 8 warps; 4 warps spill there: 243-263 us).
ROWS_TILE_PER_THREAD = 128


def ln_shift_mix(
    x_in: torch.Tensor, dx: torch.Tensor | None, x_out: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor,
    shift: torch.Tensor, mix: torch.Tensor, tok_slot: torch.Tensor, out_dtype: torch.dtype,
    tok_row: torch.Tensor | None = None, new_shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_out = x_in + dx; h = LayerNorm(x_out); returns the token-shift mixes [T, G·C].

    Decode (tok_row None): every token is its own row in slot tok_slot[t]; the slot's shift is
    read and replaced by h in place. Prefill: tok_slot[t] is the slot on a row's first token and
    -1 elsewhere; tok_row[t] is the row on a row's last token and -1 elsewhere; the rows' new
    shifts go to new_shift [rows, C] (the caller writes them to the slots afterwards); x_out must
    not alias x_in.
    """
    T, C = x_in.shape
    G = mix.shape[0]
    prefill = tok_row is not None
    store_x = dx is not None or x_out.data_ptr() != x_in.data_ptr()
    out = torch.empty(T, G * C, device=x_in.device, dtype=out_dtype)
    # no more threads than columns: a replicated element's store (x updated in place) could land
    # before its replica's load
    warps = max(4, min(16, _pow2(C) // 64))
    if T > TOKEN_PROGRAMS_MAX:
        # rounded up: a new prompt's 4,095 tokens after its first (cuda_runner.prefill) run 4 a program
        tok = 1 << max(0, min(ROWS_TOKENS, -(-T // ROWS_PROGRAMS)).bit_length() - 1)
        _ln_shift_mix_rows_kernel[(triton.cdiv(T, tok),)](
            x_in, dx if dx is not None else x_in, x_out, ln_w, ln_b, shift, tok_slot,
            tok_row if prefill else tok_slot, new_shift if prefill else shift, mix, out, T, C, LN_EPS,
            HAS_DX=dx is not None, STORE_X=store_x, PREFILL=prefill, NMIX=G, BLOCK_G=_pow2(G),
            BLOCK_C=_pow2(C), TOK=tok, num_warps=min(warps, max(4, _pow2(G) * _pow2(C) // (32 * ROWS_TILE_PER_THREAD))),
            **_pdl(),
        )
        return out
    # few tokens: their columns spread over several programs (each reads the whole row for the
    # statistics); not when x_out is x_in, where one block's store would race another's read
    blocks = 1 if store_x and x_out.data_ptr() == x_in.data_ptr() else max(1, min(triton.cdiv(C, 256), 1024 // T))
    cols_per = triton.cdiv(C, blocks)
    _ln_shift_mix_kernel[(T, blocks)](
        x_in, dx if dx is not None else x_in, x_out, ln_w, ln_b, shift, tok_slot,
        tok_row if prefill else tok_slot, new_shift if prefill else shift, mix, out, C, cols_per, LN_EPS,
        HAS_DX=dx is not None, STORE_X=store_x, PREFILL=prefill,
        NMIX=G, BLOCK_G=_pow2(G), BLOCK_C=_pow2(C), num_warps=warps, **_pdl(),
    )
    return out


@triton.jit
def _add_ln_kernel(x, dx, sel, ln_w, ln_b, out, C, eps, HAS_DX: tl.constexpr, HAS_SEL: tl.constexpr,
                   BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    t = tl.load(sel + i).to(tl.int64) if HAS_SEL else i
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    w = tl.load(ln_w + cols, mask=mask, other=0.0)
    b = tl.load(ln_b + cols, mask=mask, other=0.0)
    _after_predecessor(PDL)
    xt = tl.load(x + t * C + cols, mask=mask, other=0.0)
    if HAS_DX:
        xt += tl.load(dx + t * C + cols, mask=mask, other=0.0).to(tl.float32)
    h = _layernorm(xt, w, b, mask, C, eps)
    tl.store(out + i * C + cols, h.to(out.dtype.element_ty), mask=mask)


def add_ln(x: torch.Tensor, dx: torch.Tensor | None, ln_w: torch.Tensor, ln_b: torch.Tensor,
           sel: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm(x + dx) of the selected tokens (all when sel is None): [len(sel), C]."""
    C = x.shape[1]
    n = x.shape[0] if sel is None else sel.shape[0]
    out = torch.empty(n, C, device=x.device, dtype=out_dtype)
    _add_ln_kernel[(n,)](x, dx if dx is not None else x, sel if sel is not None else x, ln_w, ln_b, out, C,
                         LN_EPS, HAS_DX=dx is not None, HAS_SEL=sel is not None, BLOCK_C=_pow2(C),
                         num_warps=4 if C <= 2048 else 8, **_pdl())
    return out


# --------------------------------------------------------------------------------------------
# Small-batch matrix products (decode at up to a few dozen rows): Y = epi(act(A · Wᵀ))
#   W is an nn.Linear weight [N, K]; the product is bound by reading W once, so each program
#   streams a [BLOCK_N, K-range] slab of it with 16-byte loads (K is a multiple of BLOCK_K: no
#   masks along K). "Grouped": each BLOCK_N block of output columns has its own input columns, K
#   and activation (r/k/v and the four LoRA first stages in one launch). EPI_ATOMIC_ADD splits K
#   over programs and adds into an fp32 Y (the residual stream).
#   SPLIT_A: A is fp32 and enters the tensor cores as hi + lo parts in W's dtype, two products per W tile:
#   the activations keep ~16 mantissa bits at no cost in bytes of W (decode is bound by those).
# --------------------------------------------------------------------------------------------


@triton.jit
def _activate(y, act):
    y = tl.where(act == 1, 2.0 * tl.sigmoid(2.0 * y) - 1.0, y)  # tanh
    y = tl.where(act == 2, tl.sigmoid(y), y)
    r = tl.maximum(y, 0.0)
    return tl.where(act == 3, r * r, y)


@triton.jit
def _mma(acc, a, w, SPLIT_A: tl.constexpr):
    """acc + a · w on the tensor cores; SPLIT_A: a fp32 as hi + lo parts in w's dtype."""
    if SPLIT_A:
        hi = a.to(w.dtype)
        acc += tl.dot(hi, w)
        return acc + tl.dot((a - hi.to(tl.float32)).to(w.dtype), w)
    return acc + tl.dot(a.to(w.dtype), w)


@triton.jit
def _gemv_program(A, lda, M, N, K, table, n_blocks, ACT, SPLIT_K, offs_m,
                  GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """What program (block of N, part of K) of a gemv reads: its output columns, activation,
    K range [k_lo, k_hi), the row pointers of A at column 0 of that range, its first row of W,
    and the masks."""
    pid_n = tl.program_id(0)
    if GROUPED:
        a_col = tl.load(table + pid_n)
        k_len = tl.load(table + n_blocks + pid_n)
        act = tl.load(table + 2 * n_blocks + pid_n)
        w_row = tl.load(table + 3 * n_blocks + pid_n)
    else:
        a_col = 0
        k_len = K
        act = ACT
        w_row = pid_n * BLOCK_N
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_per = tl.cdiv(tl.cdiv(k_len, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.multiple_of(tl.program_id(1) * k_per, BLOCK_K)
    k_hi = tl.minimum(k_lo + k_per, k_len)
    a_rows = A + offs_m[:, None].to(tl.int64) * lda + a_col + offs_k[None, :]
    return offs_n, act, k_lo, k_hi, a_rows, w_row, offs_m[:, None] < M, offs_n[:, None] < N


@triton.jit
def _gemv_epilogue(Y, ldy, N, offs_m, offs_n, m_mask, y, act, EPI: tl.constexpr):
    """Y = act(y) in Y's dtype, or (EPI_ATOMIC_ADD) Y += y."""
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * ldy + offs_n[None, :]
    y_mask = m_mask & (offs_n[None, :] < N)
    if EPI == 1:
        tl.atomic_add(y_ptrs, y, mask=y_mask)
    else:
        tl.store(y_ptrs, _activate(y, act).to(Y.dtype.element_ty), mask=y_mask)


# Sizes that change with the batch or the model are not specialised on (one compile serves all);
# strides are, so that loads of rows stay 16-byte wide.
@triton.jit(do_not_specialize=["M", "N", "n_blocks", "ACT", "SPLIT_K"])
def _gemv_kernel(
    A, lda, W, ldw, Y, ldy, M, N, K, table, n_blocks, ACT, SPLIT_K,
    GROUPED: tl.constexpr, SPLIT_A: tl.constexpr, EPI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n, act, k_lo, k_hi, a_rows, w_row, m_mask, n_mask = _gemv_program(
        A, lda, M, N, K, table, n_blocks, ACT, SPLIT_K, offs_m, GROUPED, BLOCK_N, BLOCK_K)
    w_rows = W + (w_row + tl.arange(0, BLOCK_N))[:, None].to(tl.int64) * ldw + tl.arange(0, BLOCK_K)[None, :]
    # the first tile of W is loaded before waiting for the kernel that writes A (PDL)
    w = tl.load(w_rows + k_lo, mask=n_mask & (k_lo < k_hi), other=0.0)
    _after_predecessor(PDL)
    a = tl.load(a_rows + k_lo, mask=m_mask & (k_lo < k_hi), other=0.0)
    acc = _mma(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a, tl.trans(w), SPLIT_A)
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)
        acc = _mma(acc, tl.load(a_rows + k0, mask=m_mask, other=0.0),
                   tl.trans(tl.load(w_rows + k0, mask=n_mask, other=0.0)), SPLIT_A)
    _gemv_epilogue(Y, ldy, N, offs_m, offs_n, m_mask, acc, act, EPI)


@triton.jit(do_not_specialize=["M", "N", "n_blocks", "ACT", "SPLIT_K"])
def _gemv_fma_kernel(
    A, lda, Wd, Y, ldy, M, N, K, table, n_blocks, ACT, SPLIT_K,
    GROUPED: tl.constexpr, EPI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """The same product for a few rows on the FMA units: fp32 activations as they are, each thread
    keeping partial sums for its part of the [BLOCK_M, BLOCK_N, BLOCK_K] tile, one reduction at the end.
    W's tiles come through its TMA descriptor Wd, so the loop keeps STAGES - 1 of them in flight in
    shared memory (plain loads would hold them in registers, and registers bound the bytes in flight)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n, act, k_lo, k_hi, a_rows, w_row, m_mask, _ = _gemv_program(
        A, lda, M, N, K, table, n_blocks, ACT, SPLIT_K, offs_m, GROUPED, BLOCK_N, BLOCK_K)
    w = Wd.load([w_row, k_lo]).to(tl.float32)  # before the wait (PDL); rows past W's end read as zeros
    _after_predecessor(PDL)
    a = tl.load(a_rows + k_lo, mask=m_mask & (k_lo < k_hi), other=0.0).to(tl.float32)
    acc = w[None, :, :] * a[:, None, :]
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
        k0 = tl.multiple_of(k0, BLOCK_K)
        wk = Wd.load([w_row, k0]).to(tl.float32)
        ak = tl.load(a_rows + k0, mask=m_mask, other=0.0).to(tl.float32)
        acc += wk[None, :, :] * ak[:, None, :]
    _gemv_epilogue(Y, ldy, N, offs_m, offs_n, m_mask, tl.sum(acc, axis=2), act, EPI)


@dataclass(frozen=True)
class GemvConfig:
    """How a gemv launches: FMA units or tensor cores, tile, warps, pipeline depth, and (for the
    atomic epilogue) how many programs per multiprocessor the K split aims at."""

    fma: bool
    block_n: int
    block_k: int
    warps: int
    stages: int
    per_sm: int = 2


# Chosen on an H200 (docs/gpu.md) at one and two rows of every matrix, the head included: narrow FMA
# programs, 8 weight rows × 256 columns, W's tiles in flight through TMA.
# - Matrices up to 64 MB: one warp a program, two tiles in flight, the atomic epilogue's K split
#   aiming at 8 programs a multiprocessor. Against four warps and three tiles, in the decode graph
#   (12-01h, one call), one row went from 820 to 908 tokens/s at 1.5B, 242 to 250 at 7.2B and 3,450
#   to 3,612 at 0.1B: more programs fit a multiprocessor.
# - Larger matrices (7.2B's, every head): four warps, three tiles in flight (7.2B with two warps on
#   every matrix read 242 -> 237).
# TMA-fed FMA programs for every matrix once took 7.2B at one row from 200 to 239 tokens/s and 1.5B
# from 790 to 817, where the plain-load FMA kernel (registers bound its bytes in flight) had lost to
# the tensor cores on matrices over 64 MB. More rows: tensor-core tiles 64 wide (or 32: dot_block_n),
# four stages deep.
# Up to this many rows the FMA kernel runs (exact fp32 activations). Four rows against the
# tensor-core tiles (12-03c, decode at 4 rows, one call): 1.5B 2,081 -> 2,630 tokens/s, 0.1B 9,289 ->
# 10,703, 7.2B 740 -> 764; eight rows on it were slower (0.1B 17,809 -> 14,451; at 1.5B and 7.2B
# cuBLAS was picked over it) and sixteen spill (docs/gpu-history.md, "Changed on 12-03c").
FMA_ROWS = 4
GEMV_FMA = GemvConfig(fma=True, block_n=8, block_k=256, warps=1, stages=3, per_sm=8)
GEMV_FMA_LARGE = GemvConfig(fma=True, block_n=8, block_k=256, warps=4, stages=4, per_sm=4)
FMA_LARGE_BYTES = 64 << 20  # matrices above this take GEMV_FMA_LARGE
GEMV_DOT = GemvConfig(fma=False, block_n=64, block_k=128, warps=4, stages=4, per_sm=2)


def gemv_config(m: int, w_bytes: int) -> GemvConfig:
    """The configuration for m rows of a matrix of w_bytes."""
    if m > FMA_ROWS:
        return GEMV_DOT
    return GEMV_FMA_LARGE if w_bytes > FMA_LARGE_BYTES else GEMV_FMA


def dot_block_n(cfg: GemvConfig, n: int, m: int, epi: int, n_sm: int) -> int:
    """The tensor-core tile's width for n output columns of m rows: cfg's, or half of it
    - for the atomic epilogue at up to 16 rows: the K split then fills the multiprocessors with
      half as many parts, so each program runs a K loop twice as long and half as many partial
      sums are added into Y;
    - for a plain store whose tiles would leave more than half the multiprocessors without a program.
    Measured on an H200 (docs/gpu-history.md, "Changed on 12-03d"): at 16 rows the output and value
    products 1.5B 16.1 -> 9.8 and 22.0 -> 18.8 us, 7.2B 24.2 -> 17.3 and 60.5 -> 46.6; 0.1B's
    stores 7.1 -> 6.2 (r, k, v) and 5.6 -> 5.1 (the FFN key). Wider stores lost to half-width tiles
    (1.5B's r, k, v 17.6 -> 19.8 us; 7.2B's 41.9 -> 65.7)."""
    block_n = _dot_width(cfg.block_n, n)
    if epi == EPI_ATOMIC_ADD:
        narrow = m <= 16
    else:
        narrow = triton.cdiv(n, block_n) * triton.cdiv(m, _dot_block_m(m)) < n_sm // 2
    return max(16, block_n // 2) if narrow else block_n


def _dot_width(block_n: int, n: int) -> int:
    """A tensor-core tile's width for n output columns: block_n, narrowed to an eighth of n."""
    return min(block_n, max(16, _pow2(n) // 8))


def _dot_block_m(m: int) -> int:
    """The tensor-core gemv's rows a program: more rows take blocks of 64, each streaming W again
    (from L2)."""
    return min(64, max(16, _pow2(m)))


class GemvTable:
    """Per output block: input column, K, activation and weight row, for a grouped gemv.

    groups: (output columns, input column, K, activation, first weight row) in output order; the
    outputs are contiguous, the weight rows need not be (padding rows between groups are never
    read). Every group's width must be a multiple of the block width asked for, every K of 64.
    """

    def __init__(self, groups: list[tuple[int, int, int, int, int]], device: torch.device):
        if any(k % 64 for _, _, k, _, _ in groups):
            raise ValueError("grouped gemv: every K must be a multiple of 64")
        self.groups, self.device = groups, device
        self.width = sum(g[0] for g in groups)
        self.max_k = max(k for _, _, k, _, _ in groups)
        self.ks = {k for _, _, k, _, _ in groups}
        self._blocks: dict[int, torch.Tensor] = {}

    def blocks(self, block_n: int) -> torch.Tensor:
        """[4 · n_blocks] int32: the blocks' input columns, K, activations, then weight rows."""
        if block_n not in self._blocks:
            rows = []
            for width, a_col, k, act, w_row in self.groups:
                if width % block_n:
                    raise ValueError(f"group of width {width}: not a multiple of {block_n}")
                rows += [(a_col, k, act, w_row + j * block_n) for j in range(width // block_n)]
            flat = torch.tensor(list(zip(*rows, strict=True)), dtype=torch.int32).reshape(-1)
            self._blocks[block_n] = flat.to(self.device)
        return self._blocks[block_n]


def gemv(
    a: torch.Tensor, w: torch.Tensor, y: torch.Tensor, m: int, *, table: GemvTable | None = None,
    act: int = ACT_NONE, epi: int = EPI_STORE, n_sm: int = 132, config: GemvConfig | None = None,
) -> torch.Tensor:
    """y[:m] (=|+=) act(a[:m] · wᵀ); a [≥m, ≥K] and y [≥m, N] row-major (any row stride), w [N, K]
    (grouped: y [≥m, table.width], the table says which rows of w and columns of a each block uses).

    Up to FMA_ROWS rows run on the FMA units with fp32 activations; more on the tensor cores, where
    an fp32 `a` is split into hi + lo parts in w's dtype (SPLIT_A), a 16-bit `a` is used as it is.
    block_k is shrunk to divide every K. A config passed in runs its tile as given (narrowed only to
    an eighth of N; a sweep's labels stay true); the default one's width is dot_block_n's.
    """
    N, K = w.shape
    cfg = config or gemv_config(m, w.numel() * w.element_size())
    if table is not None:
        N = table.width
    elif K % 64:
        raise ValueError(f"gemv needs K a multiple of 64, got {K}")
    if cfg.fma:
        block_n = cfg.block_n
    else:
        block_n = dot_block_n(cfg, N, m, epi, n_sm) if config is None else _dot_width(cfg.block_n, N)
    if table is not None:
        blocks = table.blocks(block_n)
        n_blocks, k_max, ks = blocks.shape[0] // 4, table.max_k, table.ks
    else:
        n_blocks, k_max, ks = triton.cdiv(N, block_n), K, {K}
    block_k = cfg.block_k
    while any(k % block_k for k in ks):
        block_k //= 2
    split = 1
    if epi == EPI_ATOMIC_ADD:  # enough programs to keep every multiprocessor streaming
        split = max(1, min(triton.cdiv(cfg.per_sm * n_sm, n_blocks), k_max // block_k))
    rest = (y, y.stride(0), m, N, K, blocks if table is not None else y, n_blocks, act, split)
    if cfg.fma:
        block_m = _pow2(m)
        # at most 128 partial sums a thread (256: a TMA box's longest side)
        block_k = max(64, min(block_k, 256, 4096 * cfg.warps // (block_m * block_n)))
        w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])  # needs w 16-byte aligned
        _gemv_fma_kernel[(n_blocks, split)](  # W's row stride travels in its descriptor
            a, a.stride(0), w_desc, *rest, GROUPED=table is not None, EPI=epi, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, STAGES=cfg.stages, num_warps=cfg.warps, **_pdl(),
        )
        return y
    block_m = _dot_block_m(m)
    _gemv_kernel[(n_blocks, split, triton.cdiv(m, block_m))](
        a, a.stride(0), w, w.stride(0), *rest, GROUPED=table is not None,
        SPLIT_A=a.dtype == torch.float32 and w.dtype != torch.float32, EPI=epi,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=cfg.warps, num_stages=cfg.stages, **_pdl(),
    )
    return y


# --------------------------------------------------------------------------------------------
# The live-rows gemv: y[:m] += a[:m] · W for one or two rows, W stored [K, N] (each input's row of W
# contiguous), reading only the rows of W whose input is not 0 in some row of a.
#   The channel mix's value product (W = value.weightᵀ [F, C]): its input is relu(·)², so at a
#   token many hidden units are exactly 0 (half of a random model's), and their rows of W would add
#   nothing. Decode at one row is bound by the bytes of the weights; these are not read.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveRowsConfig:
    """A live-rows program: block_n of W's columns by a part of its rows (the split aiming at per_sm
    programs a multiprocessor), in blocks of block_k, each a masked load, stages of them in flight."""

    block_k: int
    block_n: int
    per_sm: int
    warps: int
    stages: int


# Per row count, chosen on an H200 (.carry/gpu/live2.py, live3.py: 192 and 132 configurations at one
# row, 121 and 132 at two; cold weights, half the inputs 0 as in a random model). The value product
# at one row, 1.5B (8,192 x 2,048) 8.1 us against the FMA gemv's 11.7 on [C, F]; 7.2B 24.1 against
# 35.1. Two rows (three quarters of the rows live): 11.8 against 13.5, 38.4 against 46.1. With no
# input 0 it runs about as fast as the FMA gemv (1.5B one row 10.5 us).
LIVE_ROWS = {1: LiveRowsConfig(64, 64, 4, 2, 3), 2: LiveRowsConfig(64, 32, 4, 2, 3)}


@triton.jit(do_not_specialize=["M", "N", "K_PER"])
def _gemv_live_rows_kernel(A, lda, W, ldw, Y, ldy, M, N, K_PER, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): columns [i·BLOCK_N, +BLOCK_N) of W by rows [j·K_PER, +K_PER); the launch
    divides W exactly. Each thread keeps partial sums for its part of the [BLOCK_M, BLOCK_K, BLOCK_N]
    tile; one reduction over K at the end, then the atomic add. Nothing is read before the PDL wait:
    which rows to read depends on A."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * K_PER
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = A + offs_m[:, None].to(tl.int64) * lda + offs_k[None, :]
    a_mask = (offs_m < M)[:, None]
    w_rows = W + offs_k[:, None].to(tl.int64) * ldw + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    _after_predecessor(PDL)
    for k0 in tl.range(k_lo, k_lo + K_PER, BLOCK_K, num_stages=STAGES):
        a = tl.load(a_rows + k0, mask=a_mask, other=0.0).to(tl.float32)
        live = (tl.sum((a != 0).to(tl.int32), axis=0) > 0)[:, None]  # [BLOCK_K, 1]: some row of A needs it
        w = tl.load(w_rows + k0 * ldw, mask=live, other=0.0)
        acc += a[:, :, None] * w.to(tl.float32)[None, :, :]
    y_mask = a_mask & (cols < N)[None, :]  # every column is inside N; the term gives the mask Y's tile shape
    tl.atomic_add(Y + offs_m[:, None].to(tl.int64) * ldy + cols[None, :], tl.sum(acc, axis=1), mask=y_mask)


def gemv_live_rows(a: torch.Tensor, wt: torch.Tensor, y: torch.Tensor, m: int, *, n_sm: int = 132,
                   config: LiveRowsConfig | None = None) -> torch.Tensor:
    """y[:m] += a[:m] · wt for the row counts of LIVE_ROWS (1 or 2): a [≥m, K] (fp32 on the FMA units),
    wt [K, N] row-major, y [≥m, N] fp32 (any row strides); rows of wt whose input is 0 in every row
    of a are not read. K and N must be multiples of 64."""
    K, N = wt.shape
    if m not in LIVE_ROWS:
        raise ValueError(f"gemv_live_rows takes {sorted(LIVE_ROWS)} rows, got {m}")
    if K % 64 or N % 64 or wt.numel() >= 2**31:  # (offsets into W are int32)
        raise ValueError(f"gemv_live_rows needs K and N multiples of 64 and under 2**31 entries, got {K} x {N}")
    cfg = config or LIVE_ROWS[m]
    block_k, block_n = math.gcd(cfg.block_k, K), math.gcd(cfg.block_n, N)
    n_blocks = N // block_n
    split = max(1, min(triton.cdiv(cfg.per_sm * n_sm, n_blocks), K // block_k))
    while K % (split * block_k):
        split -= 1
    _gemv_live_rows_kernel[(n_blocks, split)](
        a, a.stride(0), wt, wt.stride(0), y, y.stride(0), m, N, K // split, BLOCK_M=_pow2(m), BLOCK_K=block_k,
        BLOCK_N=block_n, STAGES=cfg.stages, num_warps=cfg.warps, **_pdl(),
    )
    return y


@triton.jit
def _relu2_kernel(x, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _after_predecessor(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.maximum(tl.load(x + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(x + offs, (v * v).to(x.dtype.element_ty), mask=mask)


def relu2_(x: torch.Tensor) -> torch.Tensor:
    """x = relu(x)² in place, one pass (torch: relu_ then square_, two)."""
    n = x.numel()
    _relu2_kernel[(triton.cdiv(n, 4096),)](x, n, BLOCK=4096, num_warps=8, **_pdl())
    return x


# --------------------------------------------------------------------------------------------
# The channel mix's key product with relu² in its epilogue, for the large path's long calls: a
# persistent Triton matmul (TMA loads pipelined three deep, tiles of 128 x 256). On an H200 it runs
# 7.2B's key product (4,096 x 4,096 · 4,096 x 16,384) at cuBLAS's rate, 703-711 TFLOP/s in a burst
# and 617-628 sustained under the 700 W limit against cuBLAS's 701 and 618 (docs/gpu-history.md,
# 12-03b), and leaves out relu²'s own pass (a read and a write of the [T, F] keys). It is not
# warp-specialised: at 8 warps on sm_90 Triton 3.6 compiles `warp_specialize=True` to the same PTX
# as without (its Hopper pass acts at 4 warps only), so the loop does not ask (until 12-08 it did).
# --------------------------------------------------------------------------------------------

MM_RELU2_ROWS = 1024  # calls of at least this many tokens take mm_relu2; fewer, cuBLAS and relu2_


@dataclass(frozen=True)
class MmConfig:
    """A launch of the persistent matmul: tiles of bm rows × bn columns, bk of K a step, `stages`
    of them in flight, `group` row tiles sharing their column tiles in turn (the weights' reuse
    in L2); with `split_store` the tile is stored in two halves of bn/2 columns, so the store's
    shared memory is half as large (room for a fourth stage at 128 x 256)."""
    bm: int = 128
    bn: int = 256
    bk: int = 64
    stages: int = 3
    warps: int = 8
    group: int = 8
    split_store: bool = False


MM = MmConfig()  # 7.2B's key product at cuBLAS's rate on an H200 (above)


@triton.jit
def _mm_kernel(a_desc, w_desc, y_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, GROUP: tl.constexpr, RELU2: tl.constexpr, SPLIT: tl.constexpr,
               PROGRAMS: tl.constexpr):
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), n_m * n_n, PROGRAMS, flatten=True):
        in_group = GROUP * n_n
        first_m = tile // in_group * GROUP
        rows = tl.minimum(n_m - first_m, GROUP)
        i_m, i_n = first_m + tile % in_group % rows, tile % in_group // rows
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
            acc = tl.dot(a_desc.load([i_m * BM, k * BK]), w_desc.load([i_n * BN, k * BK]).T, acc)
        if RELU2:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        if SPLIT:
            left, right = acc.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()
            y_desc.store([i_m * BM, i_n * BN], left.to(y_desc.dtype))
            y_desc.store([i_m * BM, i_n * BN + BN // 2], right.to(y_desc.dtype))
        else:
            y_desc.store([i_m * BM, i_n * BN], acc.to(y_desc.dtype))


def mm_relu2(a: torch.Tensor, w: torch.Tensor, n_sm: int, relu2: bool = True, cfg: MmConfig = MM) -> torch.Tensor:
    """relu(a · wᵀ)² [M, N] in a's dtype (a · wᵀ without relu2), the sums in fp32: a [M, K], w [N, K],
    both contiguous and 16-bit (K a multiple of 8). cfg: the launch (bench/gpu_tune.py --parts mm
    times others)."""
    (M, K), N = a.shape, w.shape[0]
    y = torch.empty(M, N, device=a.device, dtype=a.dtype)
    # a program a multiprocessor whatever the call's tiles (fewer would make a variant a count)
    _mm_kernel[(n_sm,)](
        TensorDescriptor.from_tensor(a, [cfg.bm, cfg.bk]), TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk]),
        TensorDescriptor.from_tensor(y, [cfg.bm, cfg.bn // 2 if cfg.split_store else cfg.bn]), M, N, K, BM=cfg.bm,
        BN=cfg.bn, BK=cfg.bk, STAGES=cfg.stages, GROUP=cfg.group, RELU2=relu2, SPLIT=cfg.split_store,
        PROGRAMS=n_sm, num_warps=cfg.warps)
    return y


@triton.jit
def _activate_in_place(x, n, offs, act):
    mask = offs < n
    y = _activate(tl.load(x + offs, mask=mask, other=0.0).to(tl.float32), act)
    tl.store(x + offs, y.to(x.dtype.element_ty), mask=mask)


@triton.jit
def _lora_act_kernel(w_hidden, n_w, g_hidden, n_g, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _after_predecessor(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(1) == 0:
        _activate_in_place(w_hidden, n_w, offs, 1)  # the decay's hidden: ACT_TANH
    else:
        _activate_in_place(g_hidden, n_g, offs, 2)  # the gate's: ACT_SIGMOID


def lora_act_(w_hidden: torch.Tensor, g_hidden: torch.Tensor) -> None:
    """The LoRA hiddens activated in place in one launch: tanh on the decay's, sigmoid on the
    gate's (each contiguous; torch: two launches)."""
    n_w, n_g = w_hidden.numel(), g_hidden.numel()
    _lora_act_kernel[(triton.cdiv(max(n_w, n_g), 4096), 2)](w_hidden, n_w, g_hidden, n_g, BLOCK=4096, num_warps=8,
                                                            **_pdl())


# --------------------------------------------------------------------------------------------
# The time-mix core for one decode token per row, fused: one program per (row, head).
#   torch (rwkv7.TimeMix.forward, after the projections):
#     w = exp(-0.606531·σ(w0 + wl)); a = σ(a0 + al); kk = normalize(k·k_k); k = k·(1 + (a-1)·k_a)
#     v = v + (v_first - v)·σ(v0 + vl)              (layer 0: v_first = v)
#     S = S·diag(w) + (S·(-kk))(kk·a)ᵀ + v kᵀ;  o = S·r        (the slot's state, in place)
#     y = (GroupNorm_head(o) + Σ(r·k·r_k)·v) · g
#   With SECOND, the LoRAs' second stages too (wl, al, vl, g = hidden · W2ᵀ, this head's rows of
#   each W2 read before the PDL wait): at one or two rows, one kernel fewer in the chain.
# --------------------------------------------------------------------------------------------


@triton.jit
def _time_mix_params(prm, C, c, mask):
    """w0, a0, v0, k_k, k_a, r_k at columns c of the packed [8, C] time-mix parameters."""
    return (tl.load(prm + c, mask=mask, other=0.0), tl.load(prm + C + c, mask=mask, other=0.0),
            tl.load(prm + 2 * C + c, mask=mask, other=0.0), tl.load(prm + 3 * C + c, mask=mask, other=0.0),
            tl.load(prm + 4 * C + c, mask=mask, other=0.0), tl.load(prm + 5 * C + c, mask=mask, other=0.0))


@triton.jit
def _time_mix_inputs(r, k, v, wl, al, vl, vf, w0, a0, v0, k_k, k_a, r_k, AXIS: tl.constexpr, FIRST: tl.constexpr):
    """What the recurrence takes from a token's projections, a head's channels along AXIS: (log
    decay, k', v', a = -κ̂, b = κ̂·gate, the bonus Σ r·k'·r_k as a size-1 axis). On the first layer
    v is v_first itself (vf unused). The chunked form's first kernel calls the parts one by one."""
    k, a, b = _key_inputs(k, al, a0, k_k, k_a, AXIS)
    return _log_decay(wl, w0), k, _value_input(v, vl, vf, v0, FIRST), a, b, _bonus(r, k, r_k, AXIS)


@triton.jit
def _log_decay(wl, w0):
    return -0.606531 * _sigmoid(w0 + wl)


@triton.jit
def _key_inputs(k, al, a0, k_k, k_a, AXIS: tl.constexpr):
    """(k', a = -κ̂, b = κ̂·gate) from k, κ̂ = k·k_k normalized over the head (AXIS)."""
    gate = _sigmoid(a0 + al)
    kk = k * k_k
    kk = kk * _rcp(tl.maximum(tl.sqrt(tl.sum(kk * kk, AXIS, keep_dims=True)), 1e-12))
    return k * (1.0 + (gate - 1.0) * k_a), -kk, kk * gate


@triton.jit
def _value_input(v, vl, vf, v0, FIRST: tl.constexpr):
    """v': v drawn toward v_first (vf), itself on the first layer."""
    if not FIRST:
        v = v + (vf - v) * _sigmoid(v0 + vl)
    return v


@triton.jit
def _bonus(r, k, r_k, AXIS: tl.constexpr):
    return tl.sum(r * k * r_k, AXIS, keep_dims=True)


@triton.jit
def _second_rows(W2, ld2, c, R: tl.constexpr):
    """Rows c of one LoRA's second stage [C, ≥R] (fp16): [len(c), R]."""
    return tl.load(W2 + c[:, None] * ld2 + tl.arange(0, R)[None, :])


@triton.jit
def _lora_out(w2, hidden, R: tl.constexpr):
    """hidden [R] (fp32, activated) · w2ᵀ, w2 a LoRA's rows from _second_rows: one value a row, fp32."""
    return tl.sum(w2.to(tl.float32) * tl.load(hidden + tl.arange(0, R)).to(tl.float32)[None, :], axis=1)


@triton.jit(do_not_specialize=["H"])
def _wkv_decode_kernel(
    R_, K_, V_, ldp, WL, AL, VL, G_, ldl, VF, prm, S, idx, Y, H, C, gn_eps, W2W, W2A, W2V, W2G, ld2,
    N: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr, RW: tl.constexpr, RA: tl.constexpr,
    RV: tl.constexpr, RG: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    i = tl.arange(0, N)
    c = h * N + i
    # before the wait (PDL): the slot's state (only this kernel writes it, a step ago) and the weights
    slot = tl.load(idx + b).to(tl.int64)
    s_ptrs = S + (slot * H + h) * (N * N) + i[:, None] * N + i[None, :]
    st = tl.load(s_ptrs)
    w0, a0, v0, k_k, k_a, r_k = _time_mix_params(prm, C, c, c < C)
    gn_w, gn_b = tl.load(prm + 6 * C + c), tl.load(prm + 7 * C + c)
    if SECOND:
        w2w, w2a = _second_rows(W2W, ld2, c, RW), _second_rows(W2A, ld2, c, RA)
        w2v, w2g = _second_rows(W2V, ld2, c, RV), _second_rows(W2G, ld2, c, RG)
    _after_predecessor(PDL)
    r = tl.load(R_ + b * ldp + c).to(tl.float32)
    k = tl.load(K_ + b * ldp + c).to(tl.float32)
    v = tl.load(V_ + b * ldp + c).to(tl.float32)
    if SECOND:  # WL.. are the hiddens [B, ≥R]
        wl, al = _lora_out(w2w, WL + b * ldl, RW), _lora_out(w2a, AL + b * ldl, RA)
        vl, g = _lora_out(w2v, VL + b * ldl, RV), _lora_out(w2g, G_ + b * ldl, RG)
    else:
        wl = tl.load(WL + b * ldl + c).to(tl.float32)
        al = tl.load(AL + b * ldl + c).to(tl.float32)
        vl = tl.load(VL + b * ldl + c).to(tl.float32)
        g = tl.load(G_ + b * ldl + c).to(tl.float32)
    if FIRST:
        tl.store(VF + b * C + c, v.to(VF.dtype.element_ty))
        vf = v
    else:
        vf = tl.load(VF + b * C + c).to(tl.float32)
    w_log, k, v, a, bb, bonus = _time_mix_inputs(r, k, v, wl, al, vl, vf, w0, a0, v0, k_k, k_a, r_k, 0, FIRST)
    sa = tl.sum(st * a[None, :], axis=1)
    st = st * tl.exp(w_log)[None, :] + sa[:, None] * bb[None, :] + v[:, None] * k[None, :]
    tl.store(s_ptrs, st)
    o = tl.sum(st * r[None, :], axis=1)
    mean = tl.sum(o, 0) / N
    d = o - mean
    var = tl.sum(d * d, 0) / N
    o = d * tl.rsqrt(var + gn_eps) * gn_w + gn_b
    o += bonus * v
    tl.store(Y + b * C + c, (o * g).to(Y.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# Prefill: the same math split around a sequence kernel (chunked, or recurrent below).
#   prepare: per token, all heads: w_log, k', v', a = -kk, b = kk·a, and the bonus Σ(r·k'·r_k)
#   finish:  y = (GroupNorm_head(o) + bonus·v') · g
# --------------------------------------------------------------------------------------------


@triton.jit
def _token_heads(H, C, N: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's token t and all its heads as a [BLOCK_H, N] tile: t, the tile's columns,
    its mask (padding heads), and its offsets in a [T, C] tensor."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)[:, None]
    c = hh * N + tl.arange(0, N)[None, :]
    return t, c, hh < H, t * C + c


@triton.jit(do_not_specialize=["H"])
def _wkv_prepare_kernel(
    Rr, Kk, Vv, ldp, Wl, Al, Vl, ldl, VF, prm, w_out, k_out, v_out, a_out, b_out, bonus, H, C,
    N: tl.constexpr, BLOCK_H: tl.constexpr, FIRST: tl.constexpr, PDL: tl.constexpr,
):
    _after_predecessor(PDL)
    t, c, mask, off = _token_heads(H, C, N, BLOCK_H)
    r = tl.load(Rr + t * ldp + c, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(Kk + t * ldp + c, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(Vv + t * ldp + c, mask=mask, other=0.0).to(tl.float32)
    wl = tl.load(Wl + t * ldl + c, mask=mask, other=0.0).to(tl.float32)
    al = tl.load(Al + t * ldl + c, mask=mask, other=0.0).to(tl.float32)
    vl = tl.load(Vl + t * ldl + c, mask=mask, other=0.0).to(tl.float32)
    if FIRST:
        tl.store(VF + off, v.to(VF.dtype.element_ty), mask=mask)
        vf = v
    else:
        vf = tl.load(VF + off, mask=mask, other=0.0).to(tl.float32)
    w0, a0, v0, k_k, k_a, r_k = _time_mix_params(prm, C, c, mask)
    w_log, k, v, a, b, bo = _time_mix_inputs(r, k, v, wl, al, vl, vf, w0, a0, v0, k_k, k_a, r_k, 1, FIRST)
    tl.store(w_out + off, w_log.to(w_out.dtype.element_ty), mask=mask)
    tl.store(k_out + off, k.to(k_out.dtype.element_ty), mask=mask)
    tl.store(v_out + off, v.to(v_out.dtype.element_ty), mask=mask)
    tl.store(a_out + off, a.to(a_out.dtype.element_ty), mask=mask)
    tl.store(b_out + off, b.to(b_out.dtype.element_ty), mask=mask)
    tl.store(bonus + t * H + tl.arange(0, BLOCK_H)[:, None], bo, mask=tl.arange(0, BLOCK_H)[:, None] < H)


@triton.jit(do_not_specialize=["H"])
def _wkv_finish_kernel(O, V2, G, ldg, bonus, prm, Y, H, C, gn_eps, N: tl.constexpr, BLOCK_H: tl.constexpr,
                       PDL: tl.constexpr):
    _after_predecessor(PDL)
    t, c, mask, off = _token_heads(H, C, N, BLOCK_H)
    o = tl.load(O + off, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(o, 1) / N
    d = o - mean[:, None]
    var = tl.sum(d * d, 1) / N
    o = d * tl.rsqrt(var + gn_eps)[:, None] * tl.load(prm + 6 * C + c, mask=mask, other=0.0)
    o += tl.load(prm + 7 * C + c, mask=mask, other=0.0)
    bo = tl.load(bonus + t * H + tl.arange(0, BLOCK_H), mask=tl.arange(0, BLOCK_H) < H, other=0.0)
    o += bo[:, None] * tl.load(V2 + off, mask=mask, other=0.0).to(tl.float32)
    o *= tl.load(G + t * ldg + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + off, o.to(Y.dtype.element_ty), mask=mask)


def wkv_prepare(r, k, v, wl, al, vl, v_first, prm, H: int, first: bool):
    """-> (w_log, k', v', a, b, bonus [T, H]), all [T, C] but bonus, fp32 (the recurrent kernel's
    inputs; the chunked form computes them in its first kernel).

    r, k, v share one row stride, wl, al, vl another (views into wider buffers are fine).
    """
    T, C = r.shape
    N = C // H
    outs = [torch.empty(T, C, device=r.device, dtype=torch.float32) for _ in range(5)]
    bonus = torch.empty(T, H, device=r.device, dtype=torch.float32)
    _wkv_prepare_kernel[(T,)](r, k, v, r.stride(0), wl, al, vl, wl.stride(0), v_first, prm, *outs, bonus, H, C,
                              N=N, BLOCK_H=_pow2(H), FIRST=first, num_warps=_warps(C), **_pdl())
    return (*outs, bonus)


def wkv_finish(o, v2, g, bonus, prm, H: int, out_dtype: torch.dtype) -> torch.Tensor:
    T, C = v2.shape
    y = torch.empty(T, C, device=v2.device, dtype=out_dtype)
    _wkv_finish_kernel[(T,)](o, v2, g, g.stride(0), bonus, prm, y, H, C, GN_EPS, N=C // H, BLOCK_H=_pow2(H),
                             num_warps=_warps(C), **_pdl())
    return y


# --------------------------------------------------------------------------------------------
# The recurrence over ragged rows, token by token (rwkv7.wkv_reference), in place at the slots.
#   A state's rows (value index) evolve independently, so programs split them: (row, head, block).
#   The portable prefill path and the check on the chunked one; slow for one long row.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["H"])
def _wkv_recurrent_kernel(Rr, ldr, Wl, Kk, Vv, Aa, Bb, O, S, rows, H, C, N: tl.constexpr, BV: tl.constexpr,
                          PDL: tl.constexpr):
    _after_predecessor(PDL)
    row = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(rows + 3 * row).to(tl.int64)
    start = tl.load(rows + 3 * row + 1).to(tl.int64)
    length = tl.load(rows + 3 * row + 2)
    iv = vb * BV + tl.arange(0, BV)
    j = tl.arange(0, N)
    s_ptrs = S + (slot * H + h) * (N * N) + iv[:, None] * N + j[None, :]
    st = tl.load(s_ptrs)
    for n in tl.range(0, length):
        off = (start + n) * C + h * N
        r = tl.load(Rr + (start + n) * ldr + h * N + j).to(tl.float32)
        w = tl.exp(tl.load(Wl + off + j).to(tl.float32))
        k = tl.load(Kk + off + j).to(tl.float32)
        a = tl.load(Aa + off + j).to(tl.float32)
        b = tl.load(Bb + off + j).to(tl.float32)
        v = tl.load(Vv + off + iv).to(tl.float32)
        sa = tl.sum(st * a[None, :], axis=1)
        st = st * w[None, :] + sa[:, None] * b[None, :] + v[:, None] * k[None, :]
        tl.store(O + off + iv, tl.sum(st * r[None, :], axis=1).to(O.dtype.element_ty))
    tl.store(s_ptrs, st)


def wkv_recurrent(r, w_log, k, v, a, b, state: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Advances state [S, H, N, N] at the rows' slots; rows [n_rows, 3] int (slot, start, length).

    All inputs [T, C]; only r may be a view with a wider row stride.
    """
    T, C = r.shape
    H, N = state.shape[1], state.shape[2]
    o = torch.empty(T, C, device=r.device, dtype=torch.float32)
    bv = min(N, 16)
    _wkv_recurrent_kernel[(n_rows, H, N // bv)](r, r.stride(0), w_log, k, v, a, b, o, state, rows, H, C, N=N, BV=bv,
                                                num_warps=2, **_pdl())
    return o


WKV_DECODE_WARPS = 2  # 3% faster than 4 at 256 rows on an H200 (bench/gpu_tune.py), 8 is slower
# With the LoRAs' second stages, a warp for each 16 KiB of a head's rows of them (rounded up to a power
# of 2, at least 4): H200, one row (12-01l), 1.5B's 72 KiB at 4/8/16/32 warps 882/960/941/923 tokens/s,
# 7.2B's 112 KiB 237/252/251/248, 0.1B's 40 KiB 3,765/3,690 at 4/8.
SECOND_BYTES_PER_WARP = 16 << 10


def takes_second(widths) -> bool:
    """Whether wkv_decode can multiply LoRA second stages of these widths itself (its tiles are
    powers of 2)."""
    return all(w > 0 and w & (w - 1) == 0 for w in widths)


def second_warps(head_bytes: int) -> int:
    """Warps of the core's program with the LoRAs' second stages (a head's rows of them: head_bytes)."""
    return max(4, min(16, _pow2(-(-head_bytes // SECOND_BYTES_PER_WARP))))


def wkv_decode(
    rkv: tuple[torch.Tensor, ...], lora: tuple[torch.Tensor, ...], v_first: torch.Tensor, prm: torch.Tensor,
    state: torch.Tensor, idx: torch.Tensor, H: int, first: bool, out_dtype: torch.dtype,
    second: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """One token per row: y [B, C]; the rows' slots of state [S, H, N, N] advance in place.

    rkv: r, k, v [B, C] with one row stride; lora: wl, al, vl, g [B, C] with another. With second
    (the LoRAs' second stages [C, R] fp16 in the same order, one row stride, each R a power of 2):
    lora are instead their hiddens [B, R] (activated), and this kernel multiplies them.
    """
    B = idx.shape[0]
    C = v_first.shape[1]
    y = torch.empty(B, C, device=v_first.device, dtype=out_dtype)
    if second is None:
        ranks, w2, ld2, warps = (1, 1, 1, 1), (prm,) * 4, 0, WKV_DECODE_WARPS  # (w2 unread)
    else:
        ranks, w2, ld2 = tuple(t.shape[1] for t in second), second, second[0].stride(0)
        if not takes_second(ranks) or any(t.stride() != (ld2, 1) for t in second):
            raise ValueError(f"second stages: widths {ranks} must be powers of 2, with one row stride")
        warps = second_warps(C // H * sum(ranks) * second[0].element_size())
    _wkv_decode_kernel[(B * H,)](
        *rkv, rkv[0].stride(0), *lora, lora[0].stride(0), v_first, prm, state, idx, y, H, C, GN_EPS, *w2, ld2,
        N=C // H, FIRST=first, SECOND=second is not None, RW=ranks[0], RA=ranks[1], RV=ranks[2], RG=ranks[3],
        num_warps=warps, **_pdl(),
    )
    return y
