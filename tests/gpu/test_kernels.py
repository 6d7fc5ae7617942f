"""kernels.gemv against torch's product in fp32, for each way it can launch: FMA programs (W through
a TMA descriptor, one tile or a pipelined loop over K), tensor-core tiles; store and atomic-add
epilogues; grouped (per-block input columns, K and activation).

Marked `gpu`; on the CPU it runs under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)"),
]
DEVICE = "cuda" if CUDA else "cpu"
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
@pytest.mark.parametrize("m", [1, 2])
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
