"""Kernels against torch in fp32, each way it can launch.

- gemv: FMA programs (W through a TMA descriptor, one tile or a pipelined loop over K), tensor-core
  tiles; store and atomic-add epilogues; grouped (per-block input columns, K and activation).
- gemv_live_rows (W stored [K, N], one or two rows): the rows of W whose input is 0 are not read.
- mm_relu2: the large path's key product with relu² in its epilogue, tiles cut by the matrix's ends.
- ws_matmul.mm_ws (Hopper only, not in the runner): the warp-specialised matmul in Gluon.
- ln_shift_mix: a program a token (columns spread over programs) and the rows kernel (a program a
  run of tokens), in decode (x and the shift updated in place) and in ragged prefill.

Marked `gpu`; on the CPU it runs under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import CUDA, DEVICE, HOPPER, INTERPRET, KERNEL_MARKS

pytestmark = KERNEL_MARKS
K = pytest.importorskip("replicas.model.kernels") if (CUDA or INTERPRET) else None

CONFIGS = {
    "fma-loop": lambda: K.GemvConfig(True, 8, 64, 4, 3, 4),
    "fma-one-tile": lambda: K.GemvConfig(True, 16, 256, 4, 1, 4),
    "dot": lambda: K.GemvConfig(False, 32, 64, 4, 2, 2),
}


def reference(a, w, act):
    y = a.double() @ w.double().t()
    return {K.ACT_NONE: y, K.ACT_TANH: y.tanh(), K.ACT_SIGMOID: y.sigmoid(), K.ACT_RELU2: y.relu() ** 2}[act]


def close(ours, ref, tol):
    return ((ours.double() - ref).norm() / ref.norm()).item() <= tol


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m", [1, 2, 5, 8])  # (the FMA kernel pads 5 rows to 8)
@pytest.mark.parametrize("shape", [(64, 384), (100, 256)])  # 100 rows: the last block reads past W's end
def test_plain_store_and_atomic_add(config, m, shape):
    torch.manual_seed(0)
    N, Kd = shape
    w = torch.randn(N, Kd, device=DEVICE).half()
    a = torch.randn(m, Kd, device=DEVICE)
    tol = 1e-5 if CONFIGS[config]().fma else 1e-3  # FMA: fp32 activations; dot: hi + lo parts
    y = torch.full((m, N), float("nan"), device=DEVICE)
    K.gemv(a, w, y, m, act=K.ACT_RELU2, config=CONFIGS[config]())
    assert close(y, reference(a, w, K.ACT_RELU2), tol)
    base = torch.randn(m, N, device=DEVICE)
    y = base.clone()
    K.gemv(a, w, y, m, epi=K.EPI_ATOMIC_ADD, n_sm=4, config=CONFIGS[config]())
    assert close(y, base.double() + reference(a, w, K.ACT_NONE), tol)


@pytest.mark.parametrize(("m", "n_sm"), [(8, 8), (24, 132)])
def test_decode_tiles_of_either_width(m, n_sm):
    """The default tensor-core configuration (GEMV_DOT) as decode launches it: dot_block_n halves its
    64-wide tiles for the atomic epilogue at up to 16 rows and for stores that would leave
    multiprocessors without a program; each case here takes one width for the store and the other
    for the atomic add."""
    torch.manual_seed(2)
    N, Kd = 1024, 256
    widths = [K.dot_block_n(K.GEMV_DOT, N, m, epi, n_sm) for epi in (K.EPI_STORE, K.EPI_ATOMIC_ADD)]
    assert sorted(widths) == [32, 64]
    w = torch.randn(N, Kd, device=DEVICE).half()
    a = torch.randn(m, Kd, device=DEVICE)
    y = torch.full((m, N), float("nan"), device=DEVICE)
    K.gemv(a, w, y, m, act=K.ACT_RELU2, n_sm=n_sm)
    assert close(y, reference(a, w, K.ACT_RELU2), 1e-3)
    base = torch.randn(m, N, device=DEVICE)
    y = base.clone()
    K.gemv(a, w, y, m, epi=K.EPI_ATOMIC_ADD, n_sm=n_sm)
    assert close(y, base.double() + reference(a, w, K.ACT_NONE), 1e-3)


@pytest.mark.parametrize("config", CONFIGS)
def test_grouped_blocks_take_their_own_columns_k_and_activation(config):
    torch.manual_seed(1)
    m = 2
    a = torch.randn(m, 320, device=DEVICE)
    w = torch.randn(192, 256, device=DEVICE).half()
    # (width, input column, K, activation, first weight row): K 256 and 64 in one launch
    groups = [(64, 0, 256, K.ACT_NONE, 0), (64, 64, 64, K.ACT_TANH, 64), (64, 256, 64, K.ACT_SIGMOID, 128)]
    y = torch.full((m, 192), float("nan"), device=DEVICE)
    K.gemv(a, w, y, m, table=K.GemvTable(groups, torch.device(DEVICE)), config=CONFIGS[config]())
    tol = 1e-5 if CONFIGS[config]().fma else 1e-3
    for width, col, k, act, row in groups:
        ref = reference(a[:, col:col + k], w[row:row + width, :k], act)
        assert close(y[:, row:row + width], ref, tol), (width, col, k, act)


LIVE_CONFIGS = {
    "one-part": lambda: K.LiveRowsConfig(block_k=64, block_n=32, per_sm=1, warps=2, stages=2),
    "split": lambda: K.LiveRowsConfig(block_k=32, block_n=64, per_sm=4, warps=2, stages=3),
}


def relu2_rows(m, k, seed):
    """m rows of relu(·)² inputs: about half of each row exactly 0, at different places per row."""
    torch.manual_seed(seed)
    return torch.randn(m, k, device=DEVICE).relu() ** 2


@pytest.mark.parametrize("config", LIVE_CONFIGS)
@pytest.mark.parametrize("m", [1, 2])
def test_live_rows_adds_a_times_the_transposed_weight(config, m):
    a = relu2_rows(m, 256, seed=m)
    wt = torch.randn(256, 192, device=DEVICE).half()
    base = torch.randn(m, 192, device=DEVICE)
    y = K.gemv_live_rows(a, wt, base.clone(), m, n_sm=4, config=LIVE_CONFIGS[config]())
    assert close(y, base.double() + a.double() @ wt.double(), 1e-5)


@pytest.mark.parametrize("config", LIVE_CONFIGS)
def test_live_rows_never_read_a_row_whose_input_is_zero_in_every_row(config):
    """Rows of W that no row of a needs are NaN: the result stays finite and right. Row 1 of a is
    live where row 0 is not, so a kernel that looked at one row of a only would go wrong."""
    a = relu2_rows(2, 256, seed=3)
    a[1, :128] = torch.where(a[0, :128] == 0, 1.0, 0.0)
    dead = (a == 0).all(0)
    assert 32 < dead.sum() < 224
    wt = torch.randn(256, 128, device=DEVICE).half()
    ref = a.double() @ wt.double()
    wt[dead] = float("nan")
    y = K.gemv_live_rows(a, wt, torch.zeros(2, 128, device=DEVICE), 2, config=LIVE_CONFIGS[config]())
    assert close(y, ref, 1e-5)


@pytest.mark.parametrize("shape", [(4160, 768, 3072), (200, 128, 320)] if CUDA else [(130, 64, 320)])
def test_mm_relu2_is_the_key_product_then_relu_squared(shape):
    """(M, K, N): 0.1B's key product over 65 blocks of 64 tokens; tiles cut by both ends of M and N."""
    M, K_, N = shape
    torch.manual_seed(M)
    a = torch.randn(M, K_, device=DEVICE).half()
    w = (torch.randn(N, K_, device=DEVICE) / K_**0.5).half()
    y = K.mm_relu2(a, w, n_sm=132 if CUDA else 2)
    assert y.shape == (M, N) and y.dtype == torch.float16
    assert close(y, reference(a, w, K.ACT_RELU2), 1e-3)


@pytest.mark.parametrize("cfg", [dict(bm=256, bn=128, group=4), dict(bm=128, bn=128, stages=4, warps=4, group=16),
                                 dict(stages=4, split_store=True)])
def test_mm_without_relu2_is_the_product_at_other_launches(cfg):
    """bench/gpu_tune.py --parts mm times the matmul as a plain product at other tiles and depths, and
    storing its tiles in halves."""
    M, K_, N = (4160, 768, 1088) if CUDA else (300, 64, 160)
    torch.manual_seed(1)
    a = torch.randn(M, K_, device=DEVICE).half()
    w = (torch.randn(N, K_, device=DEVICE) / K_**0.5).half()
    y = K.mm_relu2(a, w, n_sm=132 if CUDA else 2, relu2=False, cfg=K.MmConfig(**cfg))
    assert close(y, reference(a, w, K.ACT_NONE), 1e-3)


@pytest.mark.skipif(not HOPPER, reason="Hopper's warpgroup products (sm_90); Gluon has no interpreter")
def test_warp_specialised_matmul_is_the_product():
    """replicas/model/ws_matmul.py at six of the launches bench/gpu_tune.py --parts mm times (the
    first with relu², bf16 and three groups too), in a process of its own: a launch whose barriers
    never complete hangs, and the timeout ends it."""
    from replicas.model.ws_matmul import check_in_child  # noqa: PLC0415

    launches = ["{}", '{"stages": 3, "epi_n": 256, "epi_bufs": 1}', '{"bm": 256, "bn": 128, "stages": 3}',
                '{"bk": 128, "stages": 2}', '{"pingpong": true, "bn": 128, "stages": 5}',
                '{"pingpong": true, "bm": 64, "stages": 5, "epi_bufs": 1}']
    passed, out = check_in_child(launches, timeout=300)
    assert passed is not None and len(passed) == len(launches), out


def ln_shift_mix_reference(x, dx, w, b, shift, mix, starts):
    """x + dx, h = LayerNorm, each token's predecessor h (a row's first: its slot's shift), the mixes.
    starts: (first token, slot) of each row, in order."""
    x = x + dx
    h = torch.nn.functional.layer_norm(x, x.shape[1:], w, b, eps=K.LN_EPS)
    prev = torch.cat([h[:1], h[:-1]])
    for first, slot in starts:
        prev[first] = shift[slot]
    return x, h, h[:, None, :] + (prev - h)[:, None, :] * mix[None]


# rows kernel: few programs for these token counts make it take runs of ROWS_TOKENS (the last part-filled)
RUNS = pytest.mark.parametrize("programs", [512, 16], ids=["token-programs", "token-runs"])


@RUNS
@pytest.mark.parametrize("tokens", [5, 70, 203])  # a program a token (few: column blocks); the rows kernel
def test_ln_shift_mix_decode_updates_x_and_the_shift_in_place(tokens, programs, monkeypatch):
    monkeypatch.setattr(K, "ROWS_PROGRAMS", programs)
    torch.manual_seed(2)
    C, G = 192, 6
    x, dx = torch.randn(tokens, C, device=DEVICE), torch.randn(tokens, C, device=DEVICE)
    w, b = torch.rand(C, device=DEVICE) + 0.5, torch.randn(C, device=DEVICE)
    shift, mix = torch.randn(tokens + 3, C, device=DEVICE), torch.rand(G, C, device=DEVICE)
    slots = torch.randperm(tokens + 3, device=DEVICE)[:tokens].int()
    x_ref, h_ref, out_ref = ln_shift_mix_reference(x, dx, w, b, shift, mix, list(enumerate(slots.tolist())))
    shift_ref = shift.clone()
    shift_ref[slots.long()] = h_ref
    out = K.ln_shift_mix(x, dx, x, w, b, shift, mix, slots, torch.float32)
    assert close(x, x_ref.double(), 1e-6)
    assert close(shift, shift_ref.double(), 1e-5)
    assert close(out.view(tokens, G, C), out_ref.double(), 1e-5)


@RUNS
@pytest.mark.parametrize("lengths", [[9, 1, 30], [40, 1, 100, 3, 37]])  # 40 tokens, 181 tokens
def test_ln_shift_mix_prefill_ragged_rows(lengths, programs, monkeypatch):
    monkeypatch.setattr(K, "ROWS_PROGRAMS", programs)
    torch.manual_seed(3)
    C, G, T = 160, 6, sum(lengths)
    x, dx = torch.randn(T, C, device=DEVICE), torch.randn(T, C, device=DEVICE)
    w, b = torch.rand(C, device=DEVICE) + 0.5, torch.randn(C, device=DEVICE)
    shift, mix = torch.randn(8, C, device=DEVICE), torch.rand(G, C, device=DEVICE)
    firsts = [sum(lengths[:r]) for r in range(len(lengths))]
    slots = [7 - r for r in range(len(lengths))]
    tok_slot = torch.full((T,), -1, dtype=torch.int32, device=DEVICE)
    tok_row = torch.full((T,), -1, dtype=torch.int32, device=DEVICE)
    for r, (first, n) in enumerate(zip(firsts, lengths, strict=True)):
        tok_slot[first], tok_row[first + n - 1] = slots[r], r
    x_ref, h_ref, out_ref = ln_shift_mix_reference(x, dx, w, b, shift, mix, list(zip(firsts, slots, strict=True)))
    x_out, new_shift = torch.empty_like(x), torch.empty(len(lengths), C, device=DEVICE)
    out = K.ln_shift_mix(x, dx, x_out, w, b, shift, mix, tok_slot, torch.float32, tok_row, new_shift)
    assert close(x_out, x_ref.double(), 1e-6)
    lasts = [first + n - 1 for first, n in zip(firsts, lengths, strict=True)]
    assert close(new_shift, h_ref[lasts].double(), 1e-5)
    assert close(out.view(T, G, C), out_ref.double(), 1e-5)


def test_lora_act_activates_the_decay_and_gate_hiddens_only():
    """lora_act_ on the decay's and the gate's hiddens, of different widths: tanh on the first,
    sigmoid on the second, their neighbours untouched; lengths that are no multiple of the block."""
    torch.manual_seed(0)
    vwa = (3 * torch.randn(3, 37, 96, device=DEVICE)).half()
    gate = (3 * torch.randn(1, 37, 160, device=DEVICE)).half()
    before_vwa, before_gate = vwa.clone(), gate.clone()
    K.lora_act_(vwa[1], gate[0])
    assert torch.equal(vwa[0], before_vwa[0]) and torch.equal(vwa[2], before_vwa[2])
    torch.testing.assert_close(vwa[1].float(), before_vwa[1].float().tanh(), atol=1e-3, rtol=0)
    torch.testing.assert_close(gate[0].float(), before_gate[0].float().sigmoid(), atol=1e-3, rtol=0)


def test_wkv_decode_multiplies_the_second_stages_itself():
    """wkv_decode given the LoRAs' hiddens and second stages (each its own width, views of one
    padded buffer as the runner packs them) against the same kernel given their products from
    torch: the same outputs and states; the first layer's v_first written alike."""
    torch.manual_seed(2)
    B, H, N, S = 2, 2, 64, 4
    C, widths, rmax = H * N, (128, 64, 64, 256), 256  # w, a, v, g
    w2 = (0.1 * torch.randn(4 * C, rmax, device=DEVICE)).half()
    second = tuple(w2[j * C:(j + 1) * C, :r] for j, r in enumerate(widths))
    proj = torch.randn(B, 3 * C + sum(widths), device=DEVICE)
    rkv = tuple(proj[:, j * C:(j + 1) * C] for j in range(3))
    cols = [3 * C + sum(widths[:j]) for j in range(4)]
    hidden = tuple(proj[:, col:col + r] for col, r in zip(cols, widths, strict=True))
    lora = tuple((h.double() @ w.double().t()).float().contiguous() for h, w in zip(hidden, second, strict=True))
    lora = torch.stack(lora, 1).view(B, 4 * C)  # one row stride, as the gemv writes them
    lora = tuple(lora[:, j * C:(j + 1) * C] for j in range(4))
    prm = torch.randn(8, C, device=DEVICE)
    idx = torch.tensor([3, 1], device=DEVICE, dtype=torch.int32)
    state0, v_first0 = torch.randn(S, H, N, N, device=DEVICE), torch.randn(B, C, device=DEVICE)
    for first in (False, True):
        outs = []
        for lo, sec in ((lora, None), (hidden, second)):
            state, v_first = state0.clone(), v_first0.clone()
            y = K.wkv_decode(rkv, lo, v_first, prm, state, idx, H, first, torch.float32, second=sec)
            outs.append((y, state, v_first))
        (y0, s0, vf0), (y1, s1, vf1) = outs
        assert close(y1, y0.double(), 1e-5) and close(s1, s0.double(), 1e-5)
        assert torch.equal(s1[[0, 2]], state0[[0, 2]])  # slots not in idx untouched
        if first:
            assert torch.equal(vf1, vf0)
    with pytest.raises(ValueError, match="powers of 2"):
        K.wkv_decode(rkv, hidden, v_first, prm, state, idx, H, False, torch.float32,
                     second=(second[0][:, :96],) + second[1:])
