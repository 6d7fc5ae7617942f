"""How exact the chunked prefill's inverse of I - L is, emulated on the CPU.

The chunk prep kernel (replicas/model/wkv_chunk.py) builds w = (I - L)⁻¹ (a·2^ge) for every chunk of
64 tokens and head, its products in fp16 operands with fp32 sums. This runs the demo model in fp32
on prompts whose L grows (repetitive text, runs of one token), takes each layer's decays, a and b,
and computes w per chunk and head three ways against fp64's exact inverse:

    two levels    (I + Ld)(I + Ld²)(I + Ld⁴)(I + Ld⁸) over blocks of 16 tokens, then the chunk
                  (the kernel from 12-07e to 12-07h)
    three levels  (I + L1)(I + L1²) over blocks of 4 tokens, then 16, then the chunk (the kernel's)

each with its operands rounded to fp16 where the kernel rounds them. Prints, per prompt, the
relative error of w (‖Δ‖/‖w‖) over the chunks and heads: the largest and the median.

    python tools/wkv_inverse.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replicas.model.loader import default_model_dir, open_model  # noqa: E402
from replicas.model.rwkv7 import Rows, wkv_reference  # noqa: E402
from replicas.model.state import RNNState  # noqa: E402
from tests.prompts import echo_prompt  # noqa: E402

BT = 64  # tokens a chunk (wkv_chunk.CHUNK)
LOG2E = 1.4426950408889634


def f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def blocks(size: int) -> torch.Tensor:
    """Where a [BT, BT] matrix's entry lies in a block of `size` tokens on the diagonal."""
    t = torch.arange(BT)
    return (t[:, None] // size) == (t[None, :] // size)


def next_level(d_inv: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """wkv_chunk._next_level: (I + M)(I + M²) d_inv, M = d_inv lo, operands in fp16."""
    eye = torch.eye(BT)
    M = d_inv @ f16(lo)
    return f16(f16(f16(eye + M) @ f16(eye + f16(M) @ f16(M))) @ d_inv)


def two_levels(L: torch.Tensor) -> torch.Tensor:
    inside = blocks(16)
    Ld = torch.where(inside, L, 0.0)
    d_inv = torch.eye(BT) + Ld
    for _ in range(3):
        Ld = f16(Ld) @ f16(Ld)
        d_inv = d_inv + f16(d_inv) @ f16(Ld)
    return next_level(f16(d_inv), torch.where(inside, 0.0, L))


def three_levels(L: torch.Tensor) -> torch.Tensor:
    in_4, in_16 = blocks(4), blocks(16)
    L1 = f16(torch.where(in_4, L, 0.0))
    L1_2 = f16(L1 @ L1)
    d_inv = torch.eye(BT) + L1 + L1_2 + L1 @ L1_2
    d_inv = next_level(f16(d_inv), torch.where(in_16 & ~in_4, L, 0.0))
    return next_level(d_inv, torch.where(in_16, 0.0, L))


def layer_inputs(model, tokens: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's (log decays, a, b) [T, H, N] for the prompt, from the fp32 model."""
    seen = []

    def wkv(state, r, w_log, k, v, a, b, rows):
        seen.append((w_log.clone(), a.clone(), b.clone()))
        return wkv_reference(state, r, w_log, k, v, a, b, rows)

    model(torch.tensor(tokens), Rows([len(tokens)]), RNNState.zeros(model.config, 1, "cpu"), wkv=wkv)
    return seen


def errors(model, tokens: list[int]) -> dict[str, torch.Tensor]:
    out: dict[str, list[float]] = {"two levels": [], "three levels": []}
    pad = torch.nn.functional.pad
    for w_log, a, b in layer_inputs(model, tokens):
        for start in range(0, a.shape[0], BT):
            for h in range(a.shape[1]):
                g = (w_log[start:start + BT, h] * LOG2E).double()  # log₂ decays
                n = g.shape[0]
                gi = g.cumsum(0)
                ge, off = gi - g, 0.5 * g.sum(0)  # before each token; the kernel's offset
                a_h, b_h = a[start:start + n, h].double(), b[start:start + n, h].double()
                L = torch.tril((a_h * torch.exp2(ge - off)) @ (b_h * torch.exp2(off - gi)).T, -1)
                rhs = a_h * torch.exp2(ge)
                L, rhs = pad(L, (0, BT - n, 0, BT - n)), pad(rhs, (0, 0, 0, BT - n))  # a chunk's masked rows
                exact = torch.linalg.solve(torch.eye(BT, dtype=torch.float64) - L, rhs)
                if exact.norm() == 0:
                    continue
                for name, inverse in (("two levels", two_levels), ("three levels", three_levels)):
                    w = (inverse(L.float()) @ f16(rhs.float())).double()
                    out[name].append(((w - exact).norm() / exact.norm()).item())
    return {name: torch.tensor(errs) for name, errs in out.items()}


def main() -> None:
    torch.set_grad_enabled(False)
    cpu, tokenizer, _ = open_model(default_model_dir(), max_slots=1, device="cpu")
    model = cpu.model  # fp32 on the CPU
    code = Path(__file__).resolve().parents[1] / "replicas" / "engine.py"
    one = {text: tokenizer.encode(text)[:1] for text in ("x", "\n", " ")}
    prompts = {
        "the echo prompt (tests/prompts.py)": echo_prompt(cpu, tokenizer),
        '130 "x"': one["x"] * 130,
        "520 newlines": one["\n"] * 520,
        "260 spaces": one[" "] * 260,
        "1,024 tokens of replicas/engine.py": tokenizer.encode(code.read_text())[:1024],
    }
    print("| prompt | chunks × heads | two levels: largest / median | three levels: largest / median |")
    print("|---|---:|---:|---:|")
    for name, tokens in prompts.items():
        print(f"emulating {name}", file=sys.stderr, flush=True)
        errs = errors(model, tokens)
        cells = [f"{e.max():.1e} / {e.median():.1e}" for e in errs.values()]
        print(f"| {name} | {len(errs['two levels'])} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
