"""The chunked recurrence's pass over the chunks (wkv_chunk.state_out) against its definition in
float64; the whole chunked form, from a layer's projections, against RWKV-7's recurrence
(rwkv7.wkv_reference on kernels.wkv_prepare's inputs), and on long rows against fla-core's
chunk_dplr_fwd's error.

Marked `gpu`; all but the comparison with fla also run on the CPU under Triton's interpreter
(TRITON_INTERPRET=1).
"""

from __future__ import annotations

import sys

import pytest
import torch

from replicas.model.rwkv7 import Rows, wkv_reference

from .conftest import CUDA, DEVICE, INTERPRET, KERNEL_MARKS, rel_err

pytestmark = KERNEL_MARKS
W = pytest.importorskip("replicas.model.wkv_chunk") if (CUDA or INTERPRET) else None
K = pytest.importorskip("replicas.model.kernels") if (CUDA or INTERPRET) else None


def reference(qg, kg, bg, w, u, v, gi, A_qk, A_qb, state, slots, cu):
    """state_out's math, chunk by chunk, in float64: (o [T, H, N], state)."""
    BT = W.CHUNK
    d = {name: t.double().cpu().transpose(0, 1) for name, t in  # [H, T, ...]
         {"qg": qg, "kg": kg, "bg": bg, "w": w, "u": u, "v": v, "gi": gi, "aqk": A_qk, "aqb": A_qb}.items()}
    st = state.double().cpu().clone()
    o = torch.zeros(v.shape[1], v.shape[0], v.shape[2], dtype=torch.float64)
    for n, slot in enumerate(slots.tolist()):
        h = st[slot].transpose(-1, -2)  # [H, keys, values]
        for c0 in range(int(cu[n]), int(cu[n + 1]), BT):
            c1 = min(c0 + BT, int(cu[n + 1]))
            t, causal = slice(c0, c1), torch.ones(c1 - c0, c1 - c0, dtype=torch.float64).tril()
            v2 = d["w"][:, t] @ h + d["u"][:, t]
            o[:, t] = (d["qg"][:, t] @ h + (d["aqk"][:, t, :c1 - c0] * causal) @ d["v"][:, t]
                       + (d["aqb"][:, t, :c1 - c0] * causal) @ v2)
            h = (h * torch.exp2(d["gi"][:, c1 - 1])[:, :, None] + d["kg"][:, t].transpose(-1, -2) @ d["v"][:, t]
                 + d["bg"][:, t].transpose(-1, -2) @ v2)
        st[slot] = h.transpose(-1, -2)
    return o.transpose(0, 1), st


@pytest.mark.parametrize("n_sm", [1, 10**6])  # a whole head a program; 16 values a program
def test_state_out_against_its_definition(n_sm):
    """Ragged rows (partial chunks, one token, several chunks), slots out of order, garbage above
    the A matrices' diagonals; the untouched slots keep their states."""
    torch.manual_seed(0)
    H, N, BT = 2, 32, W.CHUNK
    lengths, slots = [64, 1, 130, 7], torch.tensor([3, 0, 5, 1], device=DEVICE)
    T = sum(lengths)
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)

    def half(*shape, scale=0.3):
        return (scale * torch.randn(*shape, device=DEVICE)).half()

    qg, kg, bg, w = (half(T, H, N) for _ in range(4))
    u, v = half(T, H, N), half(T, H, N)
    gi = -0.5 * torch.rand(T, H, N, device=DEVICE)
    A_qk, A_qb = half(T, H, BT, scale=0.1), half(T, H, BT, scale=0.1)
    state = torch.randn(6, H, N, N, device=DEVICE)
    before = state.clone()
    o = W.state_out(qg, kg, bg, w, u, v, gi, A_qk, A_qb, state, slots, cu, chunk_index(cu), n_sm)
    ref_o, ref_state = reference(qg, kg, bg, w, u, v, gi, A_qk, A_qb, before, slots, cu)
    assert rel_err(o, ref_o) <= 3e-3
    assert rel_err(state[slots], ref_state[slots.cpu()]) <= 3e-3
    for s in (2, 4):
        assert torch.equal(state[s], before[s])


def recurrence(r, k, v, a, b, w_log, state, slots, cu):
    """RWKV-7's recurrence token by token (rwkv7.wkv_reference, the definition) from the rows'
    slots: (o [T, H, N], every slot's state after it)."""
    rows = Rows((cu[1:] - cu[:-1]).tolist())
    o, new = wkv_reference(state.cpu()[slots.cpu()], *(t.cpu() for t in (r, w_log, k, v, a, b)), rows)
    st = state.cpu().clone()
    st[slots.cpu()] = new
    return o, st


def rwkv7_inputs(T, H, N, seed, first=False):
    """A layer's projections as the runner hands them to chunk_prefill (r, k, v, wl, al, vl in
    fp16), v_first, the packed time-mix parameters [8, C], and the recurrence's inputs they make
    (kernels.wkv_prepare, fp32: w_log, k', v', a, b, bonus)."""
    torch.manual_seed(seed)
    C = H * N
    raw = [torch.randn(T, C, device=DEVICE).half() for _ in range(6)]
    v_first = torch.randn(T, C, device=DEVICE).half()
    prm = torch.randn(8, C, device=DEVICE)
    return raw, v_first, prm, K.wkv_prepare(*raw, v_first.clone(), prm, H, first)


def chunk_index(cu):
    return W.chunk_indices((cu[1:] - cu[:-1]).cpu()).to(DEVICE)


@pytest.mark.parametrize("lengths, first", [([200], False), ([64, 1, 130, 7], True)])
def test_chunk_prefill_against_the_recurrence(lengths, first):
    """The whole chunked form (our three kernels, the inputs' preparation in the first) against the
    recurrence token by token: ragged rows, partial chunks, a one-token row, slots out of order;
    untouched slots keep their states; on the first layer v is v_first."""
    H, N, T = 2, 64, sum(lengths)
    raw, v_first, prm, (w_log, k, v, a, b, _) = rwkv7_inputs(T, H, N, seed=len(lengths), first=first)
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    slots = torch.tensor([3, 0, 5, 1][:len(lengths)], device=DEVICE)
    state = 0.1 * torch.randn(6, H, N, N, device=DEVICE)
    before = state.clone()
    o = W.chunk_prefill(*raw, v_first, prm, first, state, slots, cu, chunk_index(cu), n_sm=8)
    ref_o, ref_state = recurrence(*(t.view(T, H, N) for t in (raw[0].float(), k, v, a, b, w_log)), before, slots, cu)
    assert rel_err(o.view(T, H, N), ref_o) <= 3e-3
    assert rel_err(state[slots], ref_state[slots.cpu()]) <= 3e-3
    for s in (2, 4):
        assert torch.equal(state[s], before[s])
    if first:
        assert torch.equal(v_first, raw[2])


def _has_fla() -> bool:
    try:
        import fla  # noqa: F401, PLC0415
    except ImportError:
        return False
    return CUDA


def fla_chunk_dplr_fwd():
    """fla-core's chunk_dplr_fwd, each of its Triton autotuners given one config (4 warps, 2
    stages, the largest block up to 64): tuning them all costs minutes of compiling."""
    from fla.ops.generalized_delta_rule.dplr.chunk import chunk_dplr_fwd  # noqa: PLC0415
    from triton.runtime.autotuner import Autotuner  # noqa: PLC0415

    def score(config):
        blocks = sum(v for v in config.kwargs.values() if isinstance(v, int) and v <= 64)
        return abs(config.num_warps - 4), abs((config.num_stages or 2) - 2), -blocks

    for name, module in list(sys.modules.items()):
        for value in list(vars(module).values()) if name.startswith("fla.") and module is not None else ():
            for _ in range(4):  # heuristics/autotune wrappers nest through .fn
                if isinstance(value, Autotuner) and len(value.configs) > 1:
                    value.configs = [min(value.configs, key=score)]
                value = getattr(value, "fn", None)
    return chunk_dplr_fwd


@pytest.mark.skipif(not _has_fla(), reason="needs fla-core on a CUDA GPU")
@pytest.mark.parametrize("lengths", [[4096], [300, 1, 64, 1000]])
def test_chunk_prefill_as_exact_as_fla(lengths):
    """On long rows, ours is at least as close to the recurrence token by token as fla-core's own
    chunk_dplr_fwd (the chunked form users run today), outputs and final states alike."""
    chunk_dplr_fwd = fla_chunk_dplr_fwd()
    H, N, S = 4, 64, 6
    T, R = sum(lengths), len(lengths)
    raw, v_first, prm, (w_log, k, v, a, b, _) = rwkv7_inputs(T, H, N, seed=1)
    ins = [t.view(T, H, N) for t in (raw[0].float(), k, v, a, b)]
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    slots = torch.tensor([4, 1, 0, 5][:R], device=DEVICE)
    state = 0.1 * torch.randn(S, H, N, N, device=DEVICE)
    before = state.clone()
    ref_o, ref_state = recurrence(*ins, w_log.view(T, H, N), before, slots, cu)
    # fla's inputs in 16 bits, as it takes them (ours prepares them in fp32 from the 16-bit projections)
    theirs, s1, *_ = chunk_dplr_fwd(*(t.half().view(1, T, H, N) for t in ins), gk=w_log.view(1, T, H, N), scale=1.0,
                                    initial_state=before[slots].transpose(-1, -2).contiguous(),
                                    output_final_state=True, cu_seqlens=cu, chunk_size=W.CHUNK, safe_gate=True,
                                    chunk_indices=chunk_index(cu))
    ours = W.chunk_prefill(*raw, v_first, prm, False, state, slots, cu, chunk_index(cu), n_sm=132)
    err_o, err_s = rel_err(ours.view(T, H, N), ref_o), rel_err(state[slots], ref_state[slots.cpu()])
    fla_o, fla_s = rel_err(theirs.view(T, H, N), ref_o), rel_err(s1.transpose(-1, -2), ref_state[slots.cpu()])
    print(f"errors against the recurrence: ours {err_o:.2e} / {err_s:.2e}, fla {fla_o:.2e} / {fla_s:.2e}")
    assert err_o <= max(1.25 * fla_o, 1e-4) and err_s <= max(1.25 * fla_s, 1e-4)


def test_chunk_prefill_finishes_the_time_mix_as_wkv_finish():
    """With finish, the output kernel ends the time mix itself (GroupNorm, bonus, gate from o in
    fp32): the same as kernels.wkv_finish on the o it returns without, up to o's rounding."""
    lengths, H, N = [64, 1, 130, 7], 2, 64
    T, C = sum(lengths), 2 * 64
    raw, v_first, prm, (_, _, v, _, _, bonus) = rwkv7_inputs(T, H, N, seed=5)
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    slots = torch.tensor([3, 0, 5, 1], device=DEVICE)
    state = 0.1 * torch.randn(6, H, N, N, device=DEVICE)
    before = state.clone()
    g = torch.rand(T, 2 * C, device=DEVICE).half()[:, C:]  # a strided view, as the runner's gate
    o = W.chunk_prefill(*raw, v_first, prm, False, state, slots, cu, chunk_index(cu), n_sm=8)
    expected = K.wkv_finish(o, v, g, bonus, prm, H, torch.float32)
    y = W.chunk_prefill(*raw, v_first, prm, False, before, slots, cu, chunk_index(cu), n_sm=8,
                        finish=(g, torch.float32))
    assert y.dtype == torch.float32 and y.shape == (T, C)
    assert rel_err(y, expected) <= 3e-3
    assert torch.equal(before, state)
