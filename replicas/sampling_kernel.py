"""The sampler's choice in one launch on a CUDA device: penalties, argmax or temperature, min-p,
top-k, top-p, the inverse CDF, and the penalty counts' update, for every row of a batch.

Computes exactly what sampling.py's torch lines define (they are its reference, and tests/gpu
holds the two against each other); decides nothing of its own. Those lines cost about 130
launches and their host time a step with top-p (2.2-3.5 ms at 64 rows on the H200 machine,
12-01n); this costs one launch, one small upload and the read of the tokens (0.47 ms).

One program per row. It reads the row's logits once for the penalties and the best logit, once
more to write each token's key (sampling._order_keys) and integer mass (sampling._masses) to
scratch rows, then reads those for the cuts: each search settles a few bits of the cut's 32-bit
key a pass, as sampling._select does with histograms, here by summing the weight above a few
candidates. Masses are integers, so every sum is exact in any order, and a token's mass is
computed alike here and in torch (the same exp, IEEE division, no fused multiply-add): the two
choose the same tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import libdevice

from .sampling import _LOWEST, MASS_SCALE, SamplingParams, min_mass, upload

BLOCK = 4096  # tokens a program reads at once (these four: bench sweeps on the H200, 12-01n)
BITS = 2  # key bits a search settles a pass: 2**BITS candidates a pass, 32 / BITS passes
WARPS = 16
STAGES = 2  # the searches' loads in flight ahead of their use (Triton's software pipelining)
_FIELDS = 9  # a slot's parameters, as float64: see SlotParams.row
_SCALE = tl.constexpr(MASS_SCALE)
_KEY_OF_MINUS_INF = tl.constexpr(_LOWEST)
_INT32_MIN, _INT32_MAX, _INT64_MAX = tl.constexpr(-(2**31)), tl.constexpr(2**31 - 1), tl.constexpr(2**63 - 1)


class SlotParams:
    """Each slot's sampling parameters on the device ([slots, 8] float64), rewritten when the
    request a slot serves changes: a step then uploads only its rows' slots and uniform numbers.
    (A row's parameters are one object for its whole request; a per-row table built every step
    cost 0.35 ms of host time at 256 rows on the H200 machine.)"""

    def __init__(self, slots: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.host = np.zeros((slots, _FIELDS))
        self.table = torch.zeros(slots, _FIELDS, dtype=torch.float64, device=device)
        self.held: list[SamplingParams | None] = [None] * slots

    def update(self, slots: Sequence[int], params: Sequence[SamplingParams]) -> None:
        changed = False
        for slot, p in zip(slots, params, strict=True):
            if self.held[slot] is not p:
                self.held[slot], self.host[slot], changed = p, self.row(p), True
        if changed:
            self.table.copy_(upload(self.host, self.table.device))

    def row(self, p: SamplingParams) -> tuple:
        """In _sample_kernel's order. Every value is exact as a float64, and a float field rounds
        to float32 there as torch.tensor rounds it in the torch lines."""
        top_k = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        return (p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty, p.penalty_decay, top_k,
                p.greedy, p.penalized, min_mass(p.min_p))


def sample(x: Tensor, counts: Tensor, table: Tensor, slots: Sequence[int], params: Sequence[SamplingParams],
           uniforms: Sequence[float]) -> Tensor:
    """One token per row of x (float32 [B, V], the biases added; the penalties are subtracted
    from it in place), each row's parameters read from its slot's row of table (SlotParams). Updates
    the penalised rows' counts (float32 [slots, V]). Returns int64 [B] on the device, queued:
    nothing here waits for the GPU."""
    B, V = x.shape
    assert x.is_contiguous() and counts.is_contiguous() and counts.shape[1] == V
    tokens = torch.empty(B, dtype=torch.int64, device=x.device)
    scratch = (B, V) if any(not p.greedy for p in params) else (1,)  # greedy rows need none
    keys = torch.empty(scratch, dtype=torch.int32, device=x.device)  # each token's key
    masses = torch.empty(scratch, dtype=torch.int32, device=x.device)  # and its mass
    rows = upload(np.array([slots, uniforms], dtype=np.float64), x.device)  # [2, B]
    _sample_kernel[(B,)](x, keys, masses, counts, table, rows, tokens, B, V=V, BLOCK=BLOCK, BITS=BITS,
                         STAGES=STAGES, FIELDS=_FIELDS, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
                         num_warps=WARPS, enable_fp_fusion=False)  # torch rounds each product and sum alone
    return tokens


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    """float32 exp as torch computes it on a GPU (the interpreter has numpy's)."""
    if INTERPRET:
        e = tl.exp(x)
    else:
        e = libdevice.exp(x)
    return e


@triton.jit
def _kept(K, M, idx, inside, cut):
    """A block of a row's tokens at or above the cut key (K, M: the row's keys and masses): which
    they are, and their masses as int64 (0 for the others)."""
    kept = (tl.load(K + idx, mask=inside, other=_INT32_MIN) >= cut) & inside
    return kept, tl.where(kept, tl.load(M + idx, mask=inside, other=0).to(tl.int64), 0)


@triton.jit
def _select(K, M, V: tl.constexpr, target, COUNT: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
            STAGES: tl.constexpr):
    """sampling._select for one row (its keys K, masses M): the smallest key a whose heavier tokens
    weigh < target (their masses, or with COUNT their number). Each pass splits the range left
    for a into 2**BITS parts and keeps the first part whose top end satisfies that."""
    CANDIDATES: tl.constexpr = 1 << BITS
    PASSES: tl.constexpr = (32 + BITS - 1) // BITS
    offs = tl.arange(0, BLOCK)
    part = tl.arange(0, CANDIDATES).to(tl.int64)
    base = tl.full([], _INT32_MIN, tl.int64)  # a lies in [base, base + 2**(BITS · passes left))
    for i in range(PASSES):
        shift = BITS * (PASSES - 1 - i)
        top_end = tl.minimum(base + ((part + 1) << shift) - 1, _INT32_MAX).to(tl.int32)
        above = tl.zeros([BLOCK, CANDIDATES], tl.int64)
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            idx = start + offs
            inside = idx < V
            key = tl.load(K + idx, mask=inside, other=_INT32_MIN)  # above no candidate
            if COUNT:
                weight = inside.to(tl.int64)
            else:
                weight = tl.load(M + idx, mask=inside, other=0).to(tl.int64)
            above += tl.where(key[:, None] > top_end[None, :], weight[:, None], 0)
        heavy = tl.sum(above, axis=0) >= target  # the parts whose top end is still too low
        base += tl.sum(heavy.to(tl.int64), axis=0) << shift
    return base.to(tl.int32)


@triton.jit
def _sample_kernel(X, KEYS, MASSES, COUNTS, TABLE, ROWS, TOKENS, B, V: tl.constexpr, BLOCK: tl.constexpr,
                   BITS: tl.constexpr, STAGES: tl.constexpr, FIELDS: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(ROWS + row).to(tl.int64)
    uniform = tl.load(ROWS + B + row)
    P = TABLE + slot * FIELDS
    temperature = tl.load(P + 0).to(tl.float32)
    top_p = tl.load(P + 1)  # float64, as the torch lines' _WindowRows.p
    presence = tl.load(P + 2).to(tl.float32)
    frequency = tl.load(P + 3).to(tl.float32)
    decay = tl.load(P + 4).to(tl.float32)
    top_k = tl.load(P + 5).to(tl.int64)
    greedy = tl.load(P + 6) != 0
    penalized = tl.load(P + 7) != 0
    least = tl.load(P + 8).to(tl.int32)  # min-p's least mass (sampling.min_mass; 0: off)
    Xr, Kr, Mr = X + row.to(tl.int64) * V, KEYS + row.to(tl.int64) * V, MASSES + row.to(tl.int64) * V
    Cr = COUNTS + slot * V
    offs = tl.arange(0, BLOCK)

    # the penalties (Sampler._apply_penalties), in place; the best logit and its first index
    best = tl.full([], -float("inf"), tl.float32)
    token = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        inside = idx < V
        x = tl.load(Xr + idx, mask=inside, other=-float("inf"))
        if penalized:
            c = tl.load(Cr + idx, mask=inside, other=0.0)
            x = x - (presence * (c > 0).to(tl.float32) + frequency * c)
            tl.store(Xr + idx, x, mask=inside)
        block_best = tl.max(x, axis=0)
        first = tl.min(tl.where(x == block_best, idx, V), axis=0).to(tl.int64)
        token = tl.where(block_best > best, first, token)
        best = tl.maximum(best, block_best)
    tl.debug_barrier()  # the penalised logits, written by every thread, are read by any below

    if not greedy:  # sampling._sample_rows
        # each token's key and mass (sampling._order_keys, sampling._masses), and the row's mass
        top = tl.math.div_rn(best, temperature)  # dividing by T > 0 keeps the order
        masses = tl.zeros([BLOCK], tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            inside = idx < V
            y = tl.math.div_rn(tl.load(Xr + idx, mask=inside, other=0.0), temperature)
            bits = y.to(tl.int32, bitcast=True)
            tl.store(Kr + idx, tl.where(bits < 0, _INT32_MIN - bits, bits), mask=inside)
            mass = tl.floor(_exp(tl.maximum(y - top, -80.0), INTERPRET) * _SCALE + 0.5).to(tl.int32)
            mass = tl.where(mass < least, 0, mass)  # min-p
            tl.store(Mr + idx, mass, mask=inside)
            masses += tl.where(inside, mass, 0)
        total = tl.sum(masses, axis=0)
        tl.debug_barrier()

        # top-k: the k-th key, and the best k's mass (sampling._radix_cutoffs)
        kth = tl.full([], _KEY_OF_MINUS_INF, tl.int32)
        top_k_mass = total
        if top_k < V:
            kth = _select(Kr, Mr, V, top_k, True, BLOCK, BITS, STAGES)
            counts = tl.zeros([BLOCK], tl.int64)
            kept_mass = tl.zeros([BLOCK], tl.int64)
            lightest = tl.full([BLOCK], _INT64_MAX, tl.int64)
            for start in range(0, V, BLOCK):
                idx = start + offs
                kept, mass = _kept(Kr, Mr, idx, idx < V, kth)
                counts += kept.to(tl.int64)
                kept_mass += mass
                lightest = tl.minimum(lightest, tl.where(kept, mass, _INT64_MAX))
            past_k = tl.sum(counts, axis=0) - top_k  # copies of the k-th past the best k
            top_k_mass = tl.sum(kept_mass, axis=0) - past_k * tl.min(lightest, axis=0)
        cut = kth
        if top_p < 1.0:
            target = tl.math.ceil(top_p * top_k_mass.to(tl.float64)).to(tl.int64)
            cut = tl.maximum(kth, _select(Kr, Mr, V, target, False, BLOCK, BITS, STAGES))

        # the inverse CDF over the kept tokens' masses, in vocabulary order
        kept_masses = tl.zeros([BLOCK], tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            kept_masses += _kept(Kr, Mr, idx, idx < V, cut)[1]
        kept_total = tl.sum(kept_masses, axis=0)
        target = tl.floor(uniform * kept_total.to(tl.float64)).to(tl.int64)
        below = tl.full([], 0, tl.int64)  # the kept mass before this block
        token = tl.full([], V, tl.int64)  # V: not found yet
        for start in range(0, V, BLOCK):
            idx = start + offs
            mass = _kept(Kr, Mr, idx, idx < V, cut)[1]
            past = (below + tl.cumsum(mass, axis=0)) > target
            token = tl.minimum(token, tl.min(tl.where(past, idx, V), axis=0).to(tl.int64))
            below += tl.sum(mass, axis=0)
    tl.store(TOKENS + row, token)

    if penalized:  # Sampler._record: every count decays, the chosen token's grows by one
        for start in range(0, V, BLOCK):
            idx = start + offs
            inside = idx < V
            c = tl.load(Cr + idx, mask=inside, other=0.0) * decay
            tl.store(Cr + idx, tl.where(idx == token, c + 1.0, c), mask=inside)
