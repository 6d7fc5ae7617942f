"""The chunked recurrence's pass over the chunks (wkv_chunk.state_out) against its definition in
float64, and the whole chunked form (fla's stages + ours) against fla-core's own chunk_dplr_fwd.

Marked `gpu`; the first test also runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import CUDA, DEVICE, INTERPRET, KERNEL_MARKS

pytestmark = KERNEL_MARKS
W = pytest.importorskip("replicas.model.wkv_chunk") if (CUDA or INTERPRET) else None


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


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
    o = W.state_out(qg, kg, bg, w, u, v, gi, A_qk, A_qb, state, slots, cu, n_sm)
    ref_o, ref_state = reference(qg, kg, bg, w, u, v, gi, A_qk, A_qb, before, slots, cu)
    assert rel_err(o, ref_o) <= 3e-3
    assert rel_err(state[slots], ref_state[slots.cpu()]) <= 3e-3
    for s in (2, 4):
        assert torch.equal(state[s], before[s])


def _has_fla() -> bool:
    try:
        import fla  # noqa: F401, PLC0415
    except ImportError:
        return False
    return CUDA


@pytest.mark.skipif(not _has_fla(), reason="needs fla-core on a CUDA GPU")
@pytest.mark.parametrize("lengths", [[4096], [300, 1, 64, 1000]])
def test_chunk_prefill_against_fla(lengths):
    """RWKV-7's inputs (a = -κ̂, b = κ̂·a, log decays in [-0.607, 0]): ours and fla's whole
    chunk_dplr_fwd agree on the outputs and the final states."""
    from fla.ops.generalized_delta_rule.dplr.chunk import chunk_dplr_fwd  # noqa: PLC0415

    W.fla_stages()  # first: pins fla's autotuners (tuning all of them takes minutes)
    torch.manual_seed(1)
    H, N, S = 4, 64, 6
    T, R = sum(lengths), len(lengths)
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    slots = torch.tensor([4, 1, 0, 5][:R], device=DEVICE)
    r, k, v = (torch.randn(T, H, N, device=DEVICE) for _ in range(3))
    kk = torch.nn.functional.normalize(torch.randn(T, H, N, device=DEVICE), dim=-1)
    a_gate = torch.rand(T, H, N, device=DEVICE)
    w_log = -0.606531 * torch.rand(T, H, N, device=DEVICE)
    ins = [t.half().view(T, H * N) for t in (r, k, v, -kk, kk * a_gate)]
    state = 0.1 * torch.randn(S, H, N, N, device=DEVICE)
    s0 = state[slots].transpose(-1, -2).contiguous()
    n_chunks = ((cu[1:] - cu[:-1]) + W.CHUNK - 1) // W.CHUNK
    index = torch.cat([torch.stack([torch.full((int(c),), i), torch.arange(int(c))], 1)
                       for i, c in enumerate(n_chunks)]).to(DEVICE)  # fla's (row, chunk in the row)
    theirs, s1, *_ = chunk_dplr_fwd(*(t.view(1, T, H, N) for t in ins), gk=w_log.view(1, T, H, N), scale=1.0,
                                    initial_state=s0, output_final_state=True, cu_seqlens=cu, chunk_size=W.CHUNK,
                                    safe_gate=True, chunk_indices=index)
    ours = W.chunk_prefill(*ins, w_log.view(T, H * N), state, slots, cu, index, n_sm=132)
    assert rel_err(ours, theirs.view(T, H * N)) <= 2e-3
    assert rel_err(state[slots], s1.transpose(-1, -2)) <= 2e-3
