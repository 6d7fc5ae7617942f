"""The CUDA model runner: RWKV-7 over a slot table on one GPU, with the contract of runner.py.

Owns the packed fp16 weights, the fp32 states of `max_slots` slots plus one scratch slot, the
CUDA graphs of the decode step, and the choice of kernels. Knows nothing of requests or
sampling (the engine samples the logits where they are, on the GPU).

Decode (`decode`): one token per row, run as a CUDA graph captured per batch-size bucket
(1, 2, 4, …) and replayed with the rows' tokens and slots copied into its static input; rows that
pad a bucket run on the scratch slot. Per layer:
    small batches (≤ small_batch rows): 8 kernels — LayerNorm + token shift + six mixes; r, k, v
      and the four LoRA first stages (activated) as one grouped gemv; the LoRA second stages as
      another (or the core's, up to second_rows: 7 kernels); the time-mix core (decay, kk, a,
      state update in place at the slots, GroupNorm, bonus, gate); output projection added into
      the fp32 residual (split-K atomics); LayerNorm + shift for the channel mix; key with relu²
      fused; value added into the residual. All products read the weights once: up to four rows
      (kernels.FMA_ROWS) on the FMA units, more on the tensor cores. At one or two rows the value
      product reads only the rows of W_vᵀ whose hidden unit is live (relu² not 0: half of them in
      a random model).
    larger batches: r, k, v as one batched cuBLAS product, the LoRA stages as the two grouped
      products, the other products cuBLAS; the same fused kernels.
Prefill (`prefill`): rows of any lengths, flat on one token axis; products over all tokens (in the
last layer after the time mix, over each row's last two only: see _prefill_body); the
recurrence in the chunked parallel form (wkv_chunk.py: a kernel over chunks, a pass over each
row's chunks, the outputs over chunks again, which end the time mix too) or a Triton recurrence
over the rows (kernels.wkv_recurrent). No Python loop over tokens, no host synchronisation:
inputs reach the GPU in one asynchronous copy per call (and a new prompt's logits are gathered by
an index that goes up the same way). A call is padded to buckets of rows and tokens (rows on
the scratch slot: call_shapes.py), and buckets seen before replay a CUDA graph of the call,
whatever the rows' lengths. A new row's first token (its slot reset) runs first as a gemv decode
step, fp32 activations: see call_shapes.plan. The large path's products are cuBLAS's (the key
product with relu² our own, kernels.mm_relu2), or with large_mm = "ws" the warp-specialised
Gluon matmul of ws_matmul.py (off: not yet measured in the runner; bench/gpu.py --ws).
Kernels launch with programmatic dependent launch where the GPU has it (kernels.PDL): each
starts while its predecessor finishes, reading meanwhile what does not depend on it (weights,
the slots' states).

The math is rwkv7.py's; tests/gpu check every path against it in fp32.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels as K
from . import wkv_chunk
from .call_shapes import AUTO_PATH_MAX, EXACT_PREFILL, buckets, call_shape, plan, row_bucket, warm_up_calls
from .runner import SlotStates
from .rwkv7 import RWKV7
from .state import RNNState

log = logging.getLogger(__name__)

LORA_ALIGN = 64  # LoRA widths are padded to this in the packed weights (gemv blocks never straddle)
LORAS = ("v", "w", "a", "g")  # the mixed buffer's order of their inputs (columns 2C..6C: xv, xw, xa, xg)
# The large path multiplies the LoRAs in batches (consecutive indices into LORAS), one batched
# product a batch and stage, at the batch's widest padded width. Up to LORA_SPLIT_TOKENS tokens one
# batch of all four; more, the gate's LoRA (the widest by far in the released shapes: 1.5B 256
# against 64-128, 7.2B 512 against 128) apart. H200, r/k/v and the LoRAs a layer, CUDA graphs
# (docs/gpu.md): 7.2B 4,096 tokens 740 -> 698 us, 1.5B equal; 64-256 decode rows 9-37% slower.
LORA_ONE = ((0, 1, 2, 3),)
LORA_SPLIT = ((0, 1, 2), (3,))
LORA_SPLIT_TOKENS = 1024  # (measured: one batch faster at <= 256 tokens, two at 4,096 and 16,384)
# Up to how many decode rows the time-mix core multiplies the LoRAs' second stages itself (one
# kernel fewer a layer; where every padded LoRA width is a power of 2, as in the released shapes),
# by the bytes of a head's rows of them, which each of its programs reads once a row: (at most
# these bytes, rows), else SECOND_IN_CORE_ROWS. H100, decode in the graphs, against 4 rows
# (docs/gpu-history.md, 12-07g): 0.1B (40 KiB a head) +4.4% at 8 rows and +4.5% at 16; 1.5B
# (72 KiB) +1.6% at 8, -6% at 16; 7.2B (112 KiB) -4.3% at 8. (2 -> 4 rows: +5% at 1.5B and 0.1B.)
# `python bench/gpu_tune.py --parts second` measures it again.
SECOND_IN_CORE_ROWS = 4
SECOND_IN_CORE_MORE = ((48 << 10, 16), (96 << 10, 8))
PATH_MARGIN = 1.2  # the gemv decode path is kept unless it is this many times slower than cuBLAS
PREFILL_GRAPHS = 64  # prefill shapes (buckets) kept as CUDA graphs, least recently used dropped
# The live-rows value product (kernels.gemv_live_rows) by default where W_v has at least this many
# bytes. H200, one decode row, half the hidden units live (docs/gpu.md): 1.5B (34 MB) 961 -> 1,023
# tokens/s, 7.2B (134 MB) 254 -> 278, 0.1B (4.7 MB) 3,778 -> 3,630 (its programs too small to stream).
LIVE_ROWS_MIN_BYTES = 16 << 20


@dataclass
class _Layer:
    """One block's weights, packed for the kernels (C = n_embd; the four LoRAs in LORAS order, each
    R of them padded to Rmax, the largest LoRA width rounded up to LORA_ALIGN)."""

    ln1: tuple[Tensor, Tensor]  # fp32 [C] weight, bias
    ln2: tuple[Tensor, Tensor]
    mix_att: Tensor  # [6, C] fp32: x_r, x_k, x_v, x_w, x_a, x_g (the mixed buffer's group order)
    mix_ffn: Tensor  # [1, C] fp32
    prm: Tensor  # [8, C] fp32: w0, a0, v0, k_k, k_a, r_k, ln_x.weight, ln_x.bias
    w_in: Tensor  # [3C + 4·Rmax, C]: receptance, key, value, then the LoRAs' first stages (zero rows pad)
    w2: Tensor  # [4C, Rmax]: the LoRAs' second stages, transposed (zero columns pad)
    w_rkv_t: Tensor  # [3, C, C] view of w_in: receptance, key, value, transposed (one batched product)
    second: tuple[Tensor, ...]  # [C, padded width] views of w2, the kernels' order (w, a, v, g)
    # per batching of the LoRAs (LORA_ONE, LORA_SPLIT), per batch: [n, C, width] and [n, width, C]
    # views of the first stages in w_in and of w2 (transposed)
    lora: dict[tuple, tuple[tuple[Tensor, Tensor], ...]]
    wo: Tensor  # [C, C]
    wfk: Tensor  # [F, C]
    wfv: Tensor  # [C, F]
    wfv_t: Tensor | None  # [F, C]: wfv transposed, each hidden unit's row contiguous (with live_rows)


@dataclass
class _Batch:
    """What a prefill call sends to the GPU (one copy), as views."""

    tokens: Tensor  # [T]
    tok_slot: Tensor  # [T] slot on a row's first token, else -1
    tok_row: Tensor  # [T] row on a row's last token, else -1
    slots: Tensor  # [R]
    rows: Tensor  # [R, 3] slot, start, length (the recurrent kernel's view)
    cu_seqlens: Tensor  # [R + 1]
    # the last layer's tail: each row's last token after its predecessor in the row (a row of one
    # token: that token twice), the only tokens whose channel mix the call needs (the predecessor's
    # LayerNorm is the last's shift)
    tail: Tensor  # [2R] their tokens
    tail_slot: Tensor  # [2R] the row's slot on its first entry (both, for a row of one), else -1
    tail_row: Tensor  # [2R] the row on its last entry, else -1 (tok_row of the tail)
    tail_lasts: Tensor  # [R] each row's last entry (its logits' row)
    chunk_indices: Tensor | None  # [n_chunks, 2] (row, chunk in row)
    block_values: int  # the chunked pass's values a program (wkv_chunk.block_values)


_ONE_ZERO = np.zeros(1, dtype=np.int64)  # pads a prefill call's odd-length index field to 16 bytes


class CudaRunner(SlotStates):
    """RWKV-7 on one CUDA device; prefill/decode/read_state/write_state/reset as runner.py says.

    dtype: weights and activations between kernels; states stay fp32. fp16 by default: its three
      more mantissa bits than bf16 make the activations entering the tensor cores 8x closer to fp32
      (the bf16 paths miss 1e-2 of the fp32 logits on random 1.5B/7.2B models; tools/bf16_error.py),
      as fast at one decode row, 2.5% slower at 256 (cuBLAS's kernels; docs/gpu.md). bf16 works too.
    graphs: capture decode steps as CUDA graphs (default: on a CUDA device).
    small_batch: decode batches up to this many rows use the gemv kernels, larger ones cuBLAS
      (when auto_path is off; auto_path, the default with graphs, times both graphs of each
      bucket up to AUTO_PATH_MAX rows once and keeps the faster).
    prefill_wkv: "chunked", "recurrent" (token by token), or "auto" (chunked on a CUDA device).
    live_rows: the value product at one or two rows reads only the rows of W_vᵀ whose hidden unit
      is live (relu² not 0), from a transposed copy of W_v (+26% of the weights' bytes at 1.5B,
      +29% at 7.2B); None: where W_v has LIVE_ROWS_MIN_BYTES. Set False later to compare.
    """

    def __init__(
        self, model: RWKV7, max_slots: int, *, dtype: torch.dtype = torch.float16, graphs: bool | None = None,
        small_batch: int = 16, prefill_wkv: str = "auto", auto_path: bool | None = None,
        live_rows: bool | None = None,
    ):
        self.config = cfg = model.config
        self.device = next(model.parameters()).device
        self.fingerprint = model.fingerprint()
        self.max_slots = max_slots
        self.scratch = max_slots  # the extra slot that padding rows of a graph bucket write to
        self.dtype = dtype
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.small_batch = small_batch
        self.auto_path = self.graphs if auto_path is None else auto_path
        self.path_choice: dict[int, bool] = {}  # bucket -> gemv path (True) or cuBLAS (False)
        self.C, self.H, self.N, self.F = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.ffn_dim
        self.ranks = tuple(getattr(cfg, f"{n}_lora") for n in LORAS)
        self.padded = tuple(-(-r // LORA_ALIGN) * LORA_ALIGN for r in self.ranks)
        self.rmax = max(self.padded)
        self.hidden_cols = tuple(3 * self.C + sum(self.padded[:g]) for g in range(4))  # in the gemv path's proj
        self.n_in = 3 * self.C + sum(self.padded)
        # decode rows up to which the time-mix core multiplies the LoRAs' second stages itself
        self.second_rows = _rows_in_core(self.padded, self.N, dtype.itemsize)
        self.n_sm = (torch.cuda.get_device_properties(self.device).multi_processor_count
                     if self.device.type == "cuda" else 132)
        self.pdl = K.pdl_supported(self.device) and os.environ.get("RWKV_FLEET_PDL") != "0"
        # cuBLAS products whose outputs feed the residual or the recurrence write fp32 (True) or the
        # runner's dtype. H200 (docs/gpu.md): fp32 is 1-7% faster at 64-256 decode rows, fp16 3-6%
        # faster in the prefill of 4,096 tokens; either way the logits' errors differ by < 3e-4
        self.fp32_outputs_decode = True
        self.fp32_outputs_prefill = False
        # the large path's products of calls of MM_RELU2_ROWS tokens or more (r, k, v; the output;
        # the FFN key with relu², value): "cublas" (the key product kernels.mm_relu2) or "ws", the
        # warp-specialised Gluon matmul of ws_matmul.py (Hopper; not yet measured in the runner:
        # bench/gpu.py --ws times it beside cuBLAS)
        self.large_mm = "cublas"
        w_v_bytes = self.C * self.F * dtype.itemsize
        self.live_rows = w_v_bytes >= LIVE_ROWS_MIN_BYTES if live_rows is None else live_rows
        self._pack(model)
        # [L, S + 1, ...] fp32; the scratch slot is never read by the engine
        self.states = RNNState.zeros(cfg, max_slots + 1, self.device)
        self._fresh = set(range(max_slots))  # slots at the zero state (prefill treats their first token apart)
        self._tables()
        self._mm_f32, self._bmm_f32 = self._pick_f32_matmul()
        self.prefill_wkv = self._pick_prefill_wkv(prefill_wkv)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}
        self.prefill_graphs = PREFILL_GRAPHS  # prefill shapes kept as graphs (0: none)
        self._prefill_graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = OrderedDict()
        self._prefill_seen: OrderedDict[tuple, None] = OrderedDict()
        self._pool = None
        self.buckets = buckets(max_slots)

    # -- the contract ------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> Tensor:
        """Advances each row by its chunk (any lengths) in one batched pass; logits [R, V] fp32.

        A call is padded to its buckets (call_shape: rows on the scratch slot), and a call whose
        buckets were seen before runs as a CUDA graph (captured on the second sight, up to
        `prefill_graphs` kept, least recently used dropped): prompts of other lengths share one.
        Other calls launch their kernels one by one, which costs host time for every launch
        (about 15 a layer).
        """
        self._check_rows(rows, len(chunks))
        if any(len(c) == 0 for c in chunks):
            raise ValueError("every chunk needs at least one token")
        fresh = [row in self._fresh for row in rows]
        self._fresh.difference_update(rows)
        groups, rest = plan([len(c) for c in chunks], fresh)
        if not groups:
            return self._prefill_parts([], (rows, chunks))[0]
        outs = self._prefill_parts(
            [([rows[i] for i in group], [chunks[i][0] for i in group], any(len(chunks[i]) == 1 for i in group))
             for group in groups],
            ([rows[i] for i in rest], [chunks[i][1:] if fresh[i] else chunks[i] for i in rest]) if rest else None)
        if len(rest) == len(rows):  # every row went on in the large path: its logits, in order
            return outs[-1]
        # each row's logits: the large path's if it went on there, else its step's
        source: dict[int, int] = {}  # row -> its logits' row among the parts' outputs, stacked
        parts, at = [], 0
        for group, out in zip([*groups, rest], outs, strict=False):  # (rest may be empty)
            if out is not None:
                source.update((i, at + j) for j, i in enumerate(group))
                parts.append(out)
                at += out.shape[0]
        # the order goes up from pinned memory: an index from a list would wait for the GPU
        order = self._to_device(torch.tensor([source[i] for i in range(len(rows))]))
        return torch.cat(parts).index_select(0, order)

    @torch.no_grad()
    def prefill_all(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> Tensor:
        """As prefill, with the logits after every token: [Σ len(chunk), V] fp32, row after row
        (a prompt's every token scored, or speculative decoding's drafts). All rows in one call,
        its kernels launched one by one (a call of EXACT_PREFILL tokens or fewer, padded, replays
        a graph as prefill's do): the last layer and the head run over every token, not the tail.
        New rows' first tokens take the gemv step (fp32 activations) first, as in prefill."""
        self._check_rows(rows, len(chunks))
        if any(len(c) == 0 for c in chunks):
            raise ValueError("every chunk needs at least one token")
        fresh = [row in self._fresh for row in rows]
        self._fresh.difference_update(rows)
        groups, rest = plan([len(c) for c in chunks], fresh)
        went_on = [chunks[i][1:] if groups and fresh[i] else chunks[i] for i in rest]
        steps = [([rows[i] for i in group], [chunks[i][0] for i in group], True) for group in groups]
        outs = self._prefill_parts(steps, ([rows[i] for i in rest], went_on) if rest else None, every=True)
        if not groups:
            return outs[0]
        # each row's logits in order: its first token's from its step, then its call's, row after row
        first, at = {}, 0
        for group, out in zip(groups, outs, strict=False):
            first.update((i, at + j) for j, i in enumerate(group))
            at += out.shape[0]
        order, call = [], {}
        for i, chunk in zip(rest, went_on, strict=True):
            call[i] = range(at, at + len(chunk))
            at += len(chunk)
        for i in range(len(rows)):
            order += [first[i]] if i in first else []
            order += call.get(i, [])
        return torch.cat([out for out in outs if out is not None]).index_select(0, self._to_device(torch.tensor(order)))

    def _prefill_parts(self, steps: Sequence[tuple[Sequence[int], Sequence[int], bool]],
                       call: tuple[Sequence[int], Sequence[Sequence[int]]] | None,
                       every: bool = False) -> list[Tensor | None]:
        """Gemv decode steps (rows, tokens, whether their logits are wanted) of at most
        AUTO_PATH_MAX rows, then a prefill call (rows, chunks), one after the other, each padded
        to its buckets with rows on the scratch slot (one graph for every call of the same
        buckets): the real rows' logits (None for a step that wants none); with `every`, the
        call's are after each of its tokens, and a graph runs it only on the gemv path."""
        real = [len(rows) for rows, _, _ in steps]
        if call is not None:
            real.append(sum(len(c) for c in call[1]) if every else len(call[0]))
        steps = [(_filled(rows, row_bucket(n), self.scratch), _filled(tokens, row_bucket(n), 0), want)
                 for (rows, tokens, want), n in zip(steps, real, strict=False)]
        pieces = [torch.tensor([list(tokens), list(rows)], dtype=torch.int64).view(-1) for rows, tokens, _ in steps]
        layout = None
        if call is not None:
            fields, layout = self._batch_fields(*self._padded_call(*call), real=len(call[0]), every=every)
            pieces.append(fields)
        host, sizes = torch.cat(pieces), [piece.shape[0] for piece in pieces]
        key = (tuple((len(rows), want) for rows, _, want in steps), layout, every,
               self.prefill_wkv, self.fp32_outputs_prefill, self.live_rows, self.second_rows, self.large_mm)

        def body(dev: Tensor) -> list[Tensor | None]:
            views, outs = dev.split(sizes), []
            for view, (rows, _, want) in zip(views, steps, strict=False):  # (views may end with the call's)
                outs.append(self._decode_body(view[:len(rows)], view[len(rows):], len(rows), small=True,
                                              logits=want))
            if call is not None:
                outs.append(self._prefill_body(self._batch_views(views[-1], layout)))
            return outs

        # (`every` only for calls of the gemv path's few tokens, speculative decoding's: a scored
        # prompt's call would hold its [tokens, V] logits in the graphs' pool)
        small = layout is not None and layout[0][0] <= EXACT_PREFILL
        graph = self._prefill_graph(key, host, body) if self.graphs and self.prefill_graphs and (
            small or not every) else None
        if graph is None:
            return [None if out is None else out[:n] for out, n in zip(body(self._to_device(host)), real, strict=True)]
        captured, static, outs = graph
        static.copy_(self._pinned(host), non_blocking=True)
        captured.replay()
        # (rewritten by the next replay)
        return [None if out is None else out[:n].clone() for out, n in zip(outs, real, strict=True)]

    def _padded_call(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> tuple[list[int], list]:
        """A prefill call padded to its buckets (call_shape): rows on the scratch slot, the first
        taking the tokens left over, the others one each. No later layer, and no other row, reads
        a row's tokens but its own; what the padding rows leave in the scratch slot is never read."""
        R, T = len(rows), sum(len(c) for c in chunks)
        R_b, T_b = call_shape(R, T)
        pad = R_b - R
        if pad == 0:
            return list(rows), list(chunks)
        return _filled(rows, R_b, self.scratch), [*chunks, [0] * (T_b - T - pad + 1), *[[0]] * (pad - 1)]

    def _prefill_graph(self, key, host: Tensor, body) -> tuple | None:
        """The graph of a prefill shape seen before (captured now if need be); None on first sight."""
        if key in self._prefill_graphs:
            self._prefill_graphs.move_to_end(key)
            return self._prefill_graphs[key]
        if key not in self._prefill_seen:
            self._prefill_seen[key] = None
            if len(self._prefill_seen) > 4 * self.prefill_graphs:
                self._prefill_seen.popitem(last=False)
            return None
        static = torch.empty_like(host, device=self.device)  # the graph's input, rewritten before each replay
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outs = body(static)
        self._prefill_graphs[key] = (graph, static, outs)
        while len(self._prefill_graphs) > self.prefill_graphs:
            self._prefill_graphs.popitem(last=False)
        return self._prefill_graphs[key]

    @torch.no_grad()
    def decode(self, rows: Sequence[int], tokens: Sequence[int] | Tensor, feed: Tensor | None = None) -> Tensor:
        """Advances each row by one token; logits [R, V] fp32 (a fresh tensor, never overwritten).
        tokens may be on the device (the sampler's, not yet read by the host); a row where feed
        (bool, on the device) is False runs on the scratch slot: its own slot stays as it was."""
        self._check_rows(rows, len(tokens))
        self._fresh.difference_update(rows)  # (a fresh row's first token belongs in prefill: see there)
        B = len(rows)
        on_device = isinstance(tokens, Tensor)
        if not self.graphs:
            idx = torch.tensor(list(rows), dtype=torch.int32).to(self.device)
            tok = tokens.to(torch.int32) if on_device else torch.tensor(list(tokens), dtype=torch.int32).to(self.device)
            if feed is not None:
                idx = idx.masked_fill(~feed, self.scratch)
            return self._decode_body(tok, idx, B, B <= self.small_batch)
        bucket = next(b for b in self.buckets if b >= B)
        graph, io, logits = self._graph(bucket)
        host = torch.empty(2, bucket, dtype=torch.int32, pin_memory=True)  # torch's cached pinned blocks
        host[0].zero_()
        host[1].fill_(self.scratch)
        if not on_device:
            host[0, :B] = torch.tensor(tokens, dtype=torch.int32)
        host[1, :B] = torch.tensor(rows, dtype=torch.int32)
        io.copy_(host, non_blocking=True)  # pinned: a true async copy (pageable memory may sync)
        if on_device:
            io[0, :B].copy_(tokens)
        if feed is not None:
            io[1, :B].masked_fill_(~feed, self.scratch)
        graph.replay()
        return logits[:B].clone()  # the graph's buffer is rewritten by the next replay

    def reset(self, slot: int) -> None:
        super().reset(slot)
        self._fresh.add(slot)

    def write_state(self, slot: int, state: RNNState) -> None:
        super().write_state(slot, state)
        self._fresh.discard(slot)

    def drop_graphs(self) -> None:
        """Forgets every captured graph, decode and prefill (after a launch setting such as `pdl`
        changed: the next calls capture again)."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._prefill_seen.clear()
        self._pool = None  # a pool whose graphs are gone cannot take new captures

    def capture(self, batch_sizes: Sequence[int] | None = None) -> None:
        """Captures the decode graphs of the buckets these batch sizes fall in (default: all)."""
        if self.graphs:
            for size in batch_sizes or self.buckets:
                self._graph(next(b for b in self.buckets if b >= size))

    def warm_up(self, progress: Callable[[str], None] = lambda _: None) -> None:
        """Captures every decode graph and compiles every Triton kernel variant that prefill
        launches, before any request. Otherwise serving waits for the compiler whenever a call of a
        new kind comes (0.2-1 s a variant on the H200 machine: a steady load of 256 requests spent
        11.5 s of its first 13.6 in 19 compiles; docs/gpu.md). Variants follow the calls' shapes,
        so this runs one call of each kind (warm_up_calls) on the slots, which it leaves as it
        found them: at the zero state, new. 1.5B with 256 slots on the H200: 62 calls, 6.3 s with
        Triton's cache warm (before calls were padded to buckets: 457 calls, 28 s warm, 54 cold)."""
        started = time.perf_counter()
        progress(f"warming up: the decode graphs of {len(self.buckets)} batch sizes")
        self.capture()
        calls = warm_up_calls(self.max_slots, self.vocab_size)
        progress(f"warming up: {len(calls)} prefill calls of every kind")
        shown = time.perf_counter()
        for done, rows in enumerate(calls):
            if time.perf_counter() - shown >= 5:  # (the compiler's time, most of it)
                progress(f"warming up: {done}/{len(calls)} prefill calls")
                shown = time.perf_counter()
            for slot, (_, fresh) in enumerate(rows):
                self.reset(slot)
                if not fresh:
                    self._fresh.discard(slot)  # a row going on from a state (here the zero state)
            self.prefill(list(range(len(rows))), [tokens for tokens, _ in rows])
        for slot in range(self.max_slots):
            self.reset(slot)
        self._prefill_seen.clear()  # (each call's shape was seen once: none was captured)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        progress(f"warmed up in {time.perf_counter() - started:.1f} s")

    # -- decode --------------------------------------------------------------------------------

    def _graph(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor]:
        """The decode graph of a bucket, captured on first use along the path chosen for it."""
        small = self._small_path(bucket)
        key = self._decode_key(bucket, small)
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, small)
        return self._graphs[key]

    def _decode_key(self, bucket: int, small: bool) -> tuple:
        """What a decode graph is captured for: its bucket, its path, and the settings it bakes in."""
        return bucket, small, self.fp32_outputs_decode, self.live_rows, self.second_rows

    def _small_path(self, bucket: int) -> bool:
        """gemv or cuBLAS path: by timing both graphs once (auto_path), else by small_batch."""
        if bucket > AUTO_PATH_MAX or (not self.auto_path and bucket > self.small_batch):
            return False
        if not self.auto_path:
            return True
        if bucket not in self.path_choice:
            times = {}
            for small in (True, False):
                key = self._decode_key(bucket, small)
                self._graphs[key] = self._capture(bucket, small)
                times[small] = _replay_ms(self._graphs[key][0])
            # the gemv path keeps activations fp32 (greedy text as on the CPU): it is kept unless
            # cuBLAS is clearly faster
            self.path_choice[bucket] = times[True] <= PATH_MARGIN * times[False]
            log.info("decode bucket %d: gemv %.3f ms, cuBLAS %.3f ms", bucket, times[True], times[False])
        return self.path_choice[bucket]

    def _capture(self, bucket: int, small: bool) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor]:
        io = torch.zeros(2, bucket, dtype=torch.int32, device=self.device)
        io[1].fill_(self.scratch)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile kernels, create cuBLAS handles; writes only the scratch slot
            for _ in range(2):
                self._decode_body(io[0], io[1], bucket, small)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Every graph shares one pool: only temporaries live there besides each graph's logits,
        # which stay referenced, and graphs never run concurrently.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._decode_body(io[0], io[1], bucket, small)
        return graph, io, logits

    def _decode_body(self, tokens: Tensor, idx: Tensor, B: int, small: bool, logits: bool = True) -> Tensor | None:
        """One decode step of B rows: tokens [B], slots idx [B] (device int32) -> logits [B, V]
        (with logits=False the states advance and nothing more: no final LayerNorm, no head, no last
        FFN products).

        small: the gemv path, fp32 between kernels (activations enter the products as hi + lo
        fp16 parts, so only the weights are rounded); else cuBLAS, fp16 between kernels.
        """
        st, C, dev = self.states, self.C, self.device
        act = torch.float32 if small else self.dtype
        # PDL (H200): gemv path 1.1-1.3x at 1-8 rows; cuBLAS path 4% slower at 256 rows
        K.PDL = self.pdl and small
        x = K.embed_ln(tokens, self.emb, *self.ln0)  # [B, C] fp32
        v_first = torch.empty(B, C, device=dev, dtype=act)
        dx = None  # the large path's pending residual update; the small path adds into x directly
        last = len(self.layers) - 1
        for i, lw in enumerate(self.layers):
            # without logits, nothing reads the last channel mix's output: its shift is all it leaves
            ffn = logits or i < last
            mixed = K.ln_shift_mix(x, dx, x, *lw.ln1, st.att_shift[i], lw.mix_att, idx, act)
            if small:
                proj = torch.empty(B, self.n_in, device=dev, dtype=torch.float32)
                K.gemv(mixed, lw.w_in, proj, B, table=self.table_in, n_sm=self.n_sm)
                rkv = tuple(proj[:, j * C:(j + 1) * C] for j in range(3))
                if B <= self.second_rows:
                    hidden = _kernel_order([proj[:, col:col + width]
                                            for col, width in zip(self.hidden_cols, self.padded, strict=True)])
                    y = K.wkv_decode(rkv, hidden, v_first, lw.prm, st.wkv[i], idx, self.H, i == 0, torch.float32,
                                     second=lw.second)
                else:
                    out = torch.empty(B, 4 * C, device=dev, dtype=torch.float32)
                    K.gemv(proj, lw.w2, out, B, table=self.table_lora2, n_sm=self.n_sm)
                    lora = _kernel_order(out.view(B, 4, C).unbind(1))
                    y = K.wkv_decode(rkv, lora, v_first, lw.prm, st.wkv[i], idx, self.H, i == 0, torch.float32)
                K.gemv(y, lw.wo, x, B, epi=K.EPI_ATOMIC_ADD, n_sm=self.n_sm)
                kin = K.ln_shift_mix(x, None, x, *lw.ln2, st.ffn_shift[i], lw.mix_ffn, idx, torch.float32)
                if not ffn:
                    break
                kf = torch.empty(B, self.F, device=dev, dtype=torch.float32)
                K.gemv(kin, lw.wfk, kf, B, act=K.ACT_RELU2, n_sm=self.n_sm)
                self._value(lw, kf, x, B)
            else:
                fp32 = self.fp32_outputs_decode
                rkv, lora = self._projections(lw, mixed, B, fp32)
                y = K.wkv_decode(tuple(rkv), lora, v_first, lw.prm, st.wkv[i], idx, self.H, i == 0,
                                 self.dtype)
                dx = self._mm_out(y, lw.wo.t(), fp32)
                kin = K.ln_shift_mix(x, dx, x, *lw.ln2, st.ffn_shift[i], lw.mix_ffn, idx, self.dtype)
                if not ffn:
                    break
                dx = self._ffn(lw, kin, fp32)
        if not logits:
            return None
        hn = K.add_ln(x, dx, *self.ln_out, None, act)
        if small:
            out = torch.empty(B, self.vocab_size, device=dev, dtype=torch.float32)
            return K.gemv(hn, self.head, out, B, n_sm=self.n_sm)
        return self._mm_f32(hn, self.head.t())

    # -- products of the large path (cuBLAS, or the warp-specialised matmul) ----------------------

    def _projections(self, lw: _Layer, mixed: Tensor, T: int,
                     fp32: bool) -> tuple[Sequence[Tensor], tuple[Tensor, ...]]:
        """r, k, v -> [3, T, C] in one batched cuBLAS product (or [T, C] views of one [T, 3C] grouped
        launch of the warp-specialised matmul, self.large_mm); the LoRA outputs (wl, al, vl, g) as
        [T, C] views, from two batched products a batch of LoRAs (LORA_ONE or LORA_SPLIT) and one
        launch for both activations (eight products of their own widths took ten launches; one
        batch of four was 1.14x at 256 decode rows of the 1.5B shape, the same prefill rate)."""
        C = self.C
        if self._ws(T, fp32):  # r, k, v in one launch: [T, 3C], each a view of C columns
            rkv = self._mm_ws(mixed[:, :3 * C], lw.w_in[:3 * C], groups=3).split(C, dim=1)
        else:
            rkv = self._bmm_out(mixed[:, :3 * C].view(T, 3, C).transpose(0, 1), lw.w_rkv_t, fp32)
        # xv, xw, xa, xg: each batch's inputs are consecutive columns of mixed
        batching = LORA_SPLIT if T > LORA_SPLIT_TOKENS else LORA_ONE
        views = lw.lora[batching]
        hidden = [torch.bmm(mixed[:, (2 + batch[0]) * C:(3 + batch[-1]) * C].view(T, len(batch), C).transpose(0, 1), w1)
                  for batch, (w1, _) in zip(batching, views, strict=True)]  # per batch [n, T, width]
        per_lora = [h for batch in hidden for h in batch.unbind(0)]  # in LORAS order
        K.lora_act_(per_lora[LORAS.index("w")], per_lora[LORAS.index("g")])
        outs = [o for h, (_, w2) in zip(hidden, views, strict=True) for o in self._bmm_out(h, w2, fp32).unbind(0)]
        return rkv, _kernel_order(outs)

    def _ffn(self, lw: _Layer, kin: Tensor, fp32: bool) -> Tensor:
        if self._ws(kin.shape[0], fp32):
            k = self._mm_ws(kin, lw.wfk, relu2=True)
        elif kin.shape[0] >= K.MM_RELU2_ROWS:  # relu² in the key product's epilogue
            k = K.mm_relu2(kin, lw.wfk, self.n_sm)
        else:
            k = K.relu2_(torch.mm(kin, lw.wfk.t()))
        return self._mm_out(k, lw.wfv.t(), fp32)

    def _ws(self, T: int, fp32: bool) -> bool:
        """Whether a product of T token rows takes the warp-specialised matmul (self.large_mm): not
        where its outputs are fp32, nor where r, k and v would not be whole tiles of 256 columns
        each (the released shapes are: C 768, 2,048, 4,096)."""
        return self.large_mm == "ws" and T >= K.MM_RELU2_ROWS and not fp32 and self.C % 256 == 0

    def _mm_ws(self, a: Tensor, w: Tensor, relu2: bool = False, groups: int = 1) -> Tensor:
        from . import ws_matmul  # noqa: PLC0415 (Gluon, which older Tritons lack: imported where asked for)

        return ws_matmul.mm_ws(a, w, self.n_sm, relu2=relu2, groups=groups)

    def _mm_out(self, a: Tensor, b: Tensor, fp32: bool) -> Tensor:
        """a · b from cuBLAS, written in fp32 (one rounding less per product on the way into the
        residual or the recurrence), else in the runner's dtype; b is a weight's transpose, so the
        warp-specialised matmul takes it as the weight (self.large_mm)."""
        if self._ws(a.shape[0], fp32):
            return self._mm_ws(a, b.t())
        return self._mm_f32(a, b) if fp32 else torch.mm(a, b)

    def _bmm_out(self, a: Tensor, b: Tensor, fp32: bool) -> Tensor:
        return self._bmm_f32(a, b) if fp32 else torch.bmm(a, b)

    # -- prefill -------------------------------------------------------------------------------

    def _batch_fields(self, rows: Sequence[int], chunks: Sequence[Sequence[int]], real: int,
                      every: bool = False) -> tuple[Tensor, tuple]:
        """The call's index tensors as one flat int64 host tensor, and the layout that _batch_views
        splits it by. With `every`, the tail (what the last layer's channel mix and the head take)
        is every token. numpy: a Python loop over 16k tokens costs milliseconds, and each of torch's
        small operations microseconds (this is host time before a call's first kernel)."""
        R = len(rows)
        lengths = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=R)
        cu = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        starts, lasts, T = cu[:-1], cu[1:] - 1, int(cu[-1])
        slots = np.asarray(rows, dtype=np.int64)
        tok_slot = np.full(T, -1, dtype=np.int64)
        tok_slot[starts] = slots
        tok_row = np.full(T, -1, dtype=np.int64)
        tok_row[lasts] = np.arange(R)
        tokens = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks])
        every_token = np.arange(T)
        tail = (every_token, tok_slot, tok_row, every_token) if every else _tail_fields(lengths, lasts, slots)
        fields = [tokens, tok_slot, tok_row, slots, np.stack([slots, starts, lengths], 1).reshape(-1), cu, *tail]
        chunked = self.prefill_wkv == "chunked" and T > EXACT_PREFILL
        if chunked:  # as many as the buckets allow (those past the call's chunks cover no token)
            fields.append(wkv_chunk.chunk_indices(lengths, T // wkv_chunk.CHUNK + R).numpy().reshape(-1))
        # each field padded to 16 bytes: Triton specialises a kernel on whether a pointer is 16-byte
        # aligned, so fields at offsets that follow the call's lengths would compile variant after
        # variant while serving (and the warm-up could not meet them all)
        # (np.pad took 160 us a call on the development machine, this 6)
        padded = [part for f in fields for part in ((f, _ONE_ZERO) if f.shape[0] % 2 else (f,))]
        # the pass's block of values as the real rows would have it (padding rows hold a token or
        # few: 1.5B's one long row is fastest at 16 values, two rows at 32; docs/gpu.md)
        bv = wkv_chunk.block_values(real, self.H, self.N, self.n_sm) if chunked else 0
        return torch.from_numpy(np.concatenate(padded)), (tuple(f.shape[0] for f in fields), R, chunked, bv)

    def _pinned(self, host: Tensor) -> Tensor:
        # pinned: a true async copy (from pageable memory it may sync)
        return host.pin_memory() if self.device.type == "cuda" else host

    def _to_device(self, host: Tensor) -> Tensor:
        return self._pinned(host).to(self.device, non_blocking=True)

    @staticmethod
    def _batch_views(dev: Tensor, layout: tuple) -> _Batch:
        """_Batch over the fields of one device tensor."""
        sizes, R, chunked, bv = layout
        views = [v[:n] for v, n in zip(dev.split([n + n % 2 for n in sizes]), sizes, strict=True)]
        return _Batch(
            tokens=views[0], tok_slot=views[1], tok_row=views[2], slots=views[3], rows=views[4].view(R, 3),
            cu_seqlens=views[5], tail=views[6], tail_slot=views[7], tail_row=views[8], tail_lasts=views[9],
            chunk_indices=views[10].view(-1, 2) if chunked else None, block_values=bv,
        )

    def _prefill_body(self, batch: _Batch) -> Tensor:
        """All rows' tokens through the layers. Up to EXACT_PREFILL tokens: the gemv products with
        fp32 between kernels (and the recurrent kernel); more: cuBLAS, fp16, the chunked kernel.

        The last layer's time mix runs over every token (its states need them all); after it only
        the tail goes on (_Batch.tail: each row's last token and its predecessor), since no later
        layer reads the other tokens' outputs: the output projection and the channel mix of the
        rest (at 7.2B 2.3% of a call's products) would be computed and thrown away."""
        st, C, H, dev = self.states, self.C, self.H, self.device
        T, R = batch.tokens.shape[0], batch.slots.shape[0]
        exact = T <= EXACT_PREFILL
        act = torch.float32 if exact else self.dtype
        wkv = "recurrent" if exact else self.prefill_wkv
        K.PDL = self.pdl  # H200, 1.5B, 1 × 4096 launched kernel by kernel: 92k -> 114k tokens/s
        x = K.embed_ln(batch.tokens, self.emb, *self.ln0)
        x_next = torch.empty_like(x)  # x ping-pongs: the shift kernel reads the previous token's x
        v_first = torch.empty(T, C, device=dev, dtype=act)
        # the rows' new shifts, every layer's, go to their slots at the end (two copies, not 2L)
        new_att, new_ffn = (torch.empty(len(self.layers), R, C, device=dev, dtype=torch.float32) for _ in range(2))
        dx = None
        last = len(self.layers) - 1
        for i, lw in enumerate(self.layers):
            mixed, x, x_next = self._shift_mix(x, dx, x_next, lw.ln1, st.att_shift[i], lw.mix_att, act,
                                               batch.tok_slot, batch.tok_row, new_att[i])
            if exact:
                proj = torch.empty(T, self.n_in, device=dev, dtype=torch.float32)
                K.gemv(mixed, lw.w_in, proj, T, table=self.table_in, n_sm=self.n_sm)
                lora_out = torch.empty(T, 4 * C, device=dev, dtype=torch.float32)
                K.gemv(proj, lw.w2, lora_out, T, table=self.table_lora2, n_sm=self.n_sm)
                rkv = [proj[:, j * C:(j + 1) * C] for j in range(3)]
                lora = _kernel_order(lora_out.view(T, 4, C).unbind(1))
            else:
                rkv, lora = self._projections(lw, mixed, T, self.fp32_outputs_prefill)
            if wkv == "chunked":  # its first kernel prepares the inputs, its last ends the time mix
                y = wkv_chunk.chunk_prefill(*rkv, *lora[:3], v_first, lw.prm, i == 0, st.wkv[i], batch.slots,
                                            batch.cu_seqlens, batch.chunk_indices, self.n_sm, self.dtype,
                                            finish=(lora[3], act), bv=batch.block_values)
            else:
                w_log, k, v, a, b, bonus = K.wkv_prepare(*rkv, *lora[:3], v_first, lw.prm, H, i == 0)
                o = K.wkv_recurrent(rkv[0], w_log, k, v, a, b, st.wkv[i], batch.rows, R)
                y = K.wkv_finish(o, v, lora[3], bonus, lw.prm, H, act)
            tok_slot, tok_row, gemv = batch.tok_slot, batch.tok_row, exact
            if i == last:  # from here the tail only; its few rows take the gemv products
                y, x = y.index_select(0, batch.tail), x.index_select(0, batch.tail)
                x_next, tok_slot, tok_row = torch.empty_like(x), batch.tail_slot, batch.tail_row
                gemv = exact or x.shape[0] <= AUTO_PATH_MAX
            dx = self._product(y, lw.wo, gemv)
            kin, x, x_next = self._shift_mix(x, dx, x_next, lw.ln2, st.ffn_shift[i], lw.mix_ffn, act,
                                             tok_slot, tok_row, new_ffn[i])
            if gemv:
                kf = torch.empty(kin.shape[0], self.F, device=dev, dtype=torch.float32)
                K.gemv(kin, lw.wfk, kf, kin.shape[0], act=K.ACT_RELU2, n_sm=self.n_sm)
                dx = self._value(lw, kf, torch.zeros_like(x), kf.shape[0])
            else:
                dx = self._ffn(lw, kin, self.fp32_outputs_prefill)
        st.att_shift.index_copy_(1, batch.slots, new_att)
        st.ffn_shift.index_copy_(1, batch.slots, new_ffn)
        hn = K.add_ln(x, dx, *self.ln_out, batch.tail_lasts, act)
        if exact:  # (a row each, or with prefill_all's tail a token each)
            logits = torch.empty(hn.shape[0], self.vocab_size, device=dev, dtype=torch.float32)
            return K.gemv(hn, self.head, logits, hn.shape[0], n_sm=self.n_sm)
        return self._mm_f32(hn, self.head.t())

    @staticmethod
    def _shift_mix(x, dx, x_next, ln, shift, mix, act, tok_slot, tok_row, new_shift) -> tuple[Tensor, Tensor, Tensor]:
        """x + dx into x_next, its LayerNorm + token shift + mixes; each row's last h goes to
        new_shift (its slot's shift after the call: the caller copies it there, as no later kernel
        of the call reads this layer's shift). Returns (mixes, x_next, x): the residual's new buffer
        first, then the free one."""
        out = K.ln_shift_mix(x, dx, x_next, *ln, shift, mix, tok_slot, act, tok_row, new_shift)
        return out, x_next, x

    def _product(self, a: Tensor, w: Tensor, exact: bool) -> Tensor:
        """a · wᵀ: fp32 from the gemv (split-K, added into zeros), or from cuBLAS (see _mm_out)."""
        if not exact:
            return self._mm_out(a, w.t(), self.fp32_outputs_prefill)
        out = torch.zeros(a.shape[0], w.shape[0], device=self.device, dtype=torch.float32)
        return K.gemv(a, w, out, a.shape[0], epi=K.EPI_ATOMIC_ADD, n_sm=self.n_sm)

    def _value(self, lw: _Layer, kf: Tensor, out: Tensor, rows: int) -> Tensor:
        """out[:rows] += kf[:rows] · W_vᵀ on the gemv path: one or two rows (LIVE_ROWS) reading only the
        rows of W_vᵀ whose hidden unit is live (kernels.gemv_live_rows), more the gemv on W_v."""
        if self.live_rows and rows in K.LIVE_ROWS:
            return K.gemv_live_rows(kf, lw.wfv_t, out, rows, n_sm=self.n_sm)
        return K.gemv(kf, lw.wfv, out, rows, epi=K.EPI_ATOMIC_ADD, n_sm=self.n_sm)

    # -- setup ---------------------------------------------------------------------------------

    def _pack(self, model: RWKV7) -> None:
        dt, C = self.dtype, self.C

        def f32(t: Tensor) -> Tensor:
            return t.detach().float().contiguous()

        def low(t: Tensor) -> Tensor:
            return t.detach().to(dt).contiguous()

        b0 = model.blocks[0]
        self.emb = low(model.emb.weight)
        self.ln0 = (f32(b0.ln0.weight), f32(b0.ln0.bias))
        self.ln_out = (f32(model.ln_out.weight), f32(model.ln_out.bias))
        self.head = low(model.head.weight)
        rmax = self.rmax
        self.layers = []
        for block in model.blocks:
            att, ffn = block.att, block.ffn
            first = [F.pad(getattr(att, f"{n}1").detach().t(), (0, 0, 0, rmax - r))
                     for n, r in zip(LORAS, self.ranks, strict=True)]
            w_in = low(torch.cat([att.receptance.weight, att.key.weight, att.value.weight, *first]))
            second = [F.pad(getattr(att, f"{n}2").detach().t(), (0, rmax - r))
                      for n, r in zip(LORAS, self.ranks, strict=True)]
            w2 = low(torch.cat(second))
            self.layers.append(_Layer(
                ln1=(f32(block.ln1.weight), f32(block.ln1.bias)),
                ln2=(f32(block.ln2.weight), f32(block.ln2.bias)),
                mix_att=f32(torch.stack([att.x_r, att.x_k, att.x_v, att.x_w, att.x_a, att.x_g])),
                mix_ffn=f32(ffn.x_k.view(1, C)),
                prm=f32(torch.stack([att.w0, att.a0, att.v0, att.k_k, att.k_a, att.r_k.reshape(C),
                                     att.ln_x.weight, att.ln_x.bias])),
                w_in=w_in, w2=w2, w_rkv_t=w_in[:3 * C].view(3, C, C).transpose(1, 2),
                second=_kernel_order([w2[g * C:(g + 1) * C, :p] for g, p in enumerate(self.padded)]),
                lora={batching: self._lora_views(w_in, w2, batching) for batching in (LORA_ONE, LORA_SPLIT)},
                wo=low(att.output.weight), wfk=low(ffn.key.weight), wfv=low(ffn.value.weight),
                wfv_t=low(ffn.value.weight.t()) if self.live_rows else None,
            ))

    def _lora_views(self, w_in: Tensor, w2: Tensor, batching: tuple) -> tuple[tuple[Tensor, Tensor], ...]:
        """Per batch of LoRAs: the first stages [n, C, width] and second stages [n, width, C],
        transposed views into the packed weights at the batch's widest padded width."""
        C, rmax = self.C, self.rmax
        first, second = w_in[3 * C:].view(4, rmax, C), w2.view(4, C, rmax)
        views = []
        for batch in batching:
            width = max(self.padded[g] for g in batch)
            views.append((first[batch[0]:batch[-1] + 1, :width].transpose(1, 2),
                          second[batch[0]:batch[-1] + 1, :, :width].transpose(1, 2)))
        return tuple(views)

    def _tables(self) -> None:
        """The gemv path's grouped products: r, k, v and the LoRAs' first stages (activated) into
        one [T, 3C + ΣRp] buffer; the second stages from it into [T, 4C]. Padding rows are skipped."""
        C, R = self.C, self.rmax
        act = {"v": K.ACT_NONE, "w": K.ACT_TANH, "a": K.ACT_NONE, "g": K.ACT_SIGMOID}
        rkv = [(C, j * C, C, K.ACT_NONE, j * C) for j in range(3)]  # r, k, v from xr, xk, xv
        first = [(self.padded[g], (2 + g) * C, C, act[n], 3 * C + g * R) for g, n in enumerate(LORAS)]
        self.table_in = K.GemvTable(rkv + first, self.device)
        self.table_lora2 = K.GemvTable(  # K up to the padded width: w2's padding columns are zero
            [(C, self.hidden_cols[g], self.padded[g], K.ACT_NONE, g * C) for g in range(4)], self.device)

    def _pick_f32_matmul(self):
        """Products (mm, bmm) of the runner's dtype written fp32 in one cuBLAS call where torch offers it."""
        a = torch.ones(2, 2, 32, device=self.device, dtype=self.dtype)
        try:
            torch.mm(a[0], a[0].t(), out_dtype=torch.float32)
            torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32)
            return (lambda x, w: torch.mm(x, w, out_dtype=torch.float32),
                    lambda x, w: torch.bmm(x, w, out_dtype=torch.float32))
        except (TypeError, RuntimeError, NotImplementedError):
            return lambda x, w: torch.mm(x, w).float(), lambda x, w: torch.bmm(x, w).float()

    def _pick_prefill_wkv(self, choice: str) -> str:
        if choice not in ("auto", "chunked", "recurrent"):
            raise ValueError(f"prefill_wkv must be auto, chunked or recurrent, not {choice!r}")
        if choice == "auto":  # the chunked kernels run on the CPU only under Triton's interpreter, slowly
            return "chunked" if self.device.type == "cuda" else "recurrent"
        return choice


def _rows_in_core(padded: Sequence[int], head_size: int, itemsize: int) -> int:
    """Up to how many decode rows the core multiplies LoRA second stages of these padded widths
    (SECOND_IN_CORE_MORE, by the bytes of a head's rows of them); 0 where it cannot."""
    if not K.takes_second(padded):
        return 0
    head_bytes = head_size * sum(padded) * itemsize
    return next((rows for limit, rows in SECOND_IN_CORE_MORE if head_bytes <= limit), SECOND_IN_CORE_ROWS)


def _filled(items: Sequence[int], n: int, fill: int) -> list[int]:
    """items, then fill up to n of them."""
    return [*items, *[fill] * (n - len(items))]


def _tail_fields(lengths: np.ndarray, lasts: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, ...]:
    """_Batch's tail (tail, tail_slot, tail_row, tail_lasts) of rows of these lengths, last tokens
    and slots: two entries a row (a shape that follows the call's buckets), each row's last token
    after its predecessor; a row of one token has that token twice, both shifted from its slot."""
    R = lengths.shape[0]
    single = lengths == 1
    tail = np.stack([np.where(single, lasts, lasts - 1), lasts], 1).reshape(-1)
    tail_slot = np.stack([slots, np.where(single, slots, -1)], 1).reshape(-1)
    tail_row = np.stack([np.full(R, -1), np.arange(R)], 1).reshape(-1)
    return tail, tail_slot, tail_row, 2 * np.arange(R) + 1


def _kernel_order(lora: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The LoRA outputs from LORAS order (v, w, a, g) to the kernels' (w, a, v, g)."""
    v, w, a, g = lora
    return w, a, v, g


def _replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 10) -> float:
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
