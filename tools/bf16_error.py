"""Where the bf16 paths' logit error comes from, on the CPU: the benchmark's random models in fp32
math with bf16 rounding put back in one place at a time.

bench/gpu.py's exactness check finds the bf16 paths of the CUDA runner (long prefill, cuBLAS
decode) 4-7e-2 off the fp32 reference on the random 1.5B and 7.2B models, and plain torch in bf16
as far off. This runs the same comparison without a GPU: the benchmark's model (its distributions,
weights rounded to bf16 as the GPU runs them), the benchmark's four rows of 48, 17, 5 and 64
tokens, and rwkv7.py's math in fp32 except where a case rounds to bf16:

    plain bf16          the whole model in bf16 (as torch runs it on the GPU)
    product inputs      the activations entering every rwkv7.Linear (what enters the tensor cores)
    product outputs     every rwkv7.Linear's output (what the runner keeps between kernels)
    inputs and outputs  both

    python tools/bf16_error.py [--model 1.5b] [--threads N]

Prints the relative logit error ‖Δ‖/‖ref‖ of each case, over all rows and per row.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu import EXACTNESS_LENGTHS, SHAPES, random_model  # noqa: E402

from replicas.model import rwkv7  # noqa: E402
from replicas.model.runner import ModelRunner  # noqa: E402


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def prefill(model, chunks: list[list[int]], round_in: bool = False, round_out: bool = False) -> torch.Tensor:
    """Last-token logits of each row from a zero state, products' inputs/outputs rounded as asked."""
    plain = rwkv7.Linear.forward

    def forward(self, x):
        y = F.linear(bf16(x) if round_in else x, self.weight)
        return bf16(y) if round_out else y

    rwkv7.Linear.forward = forward
    try:
        runner = ModelRunner(model, max_slots=len(chunks))
        rows = list(range(len(chunks)))
        for row in rows:
            runner.reset(row)
        return runner.prefill(rows, chunks).float()
    finally:
        rwkv7.Linear.forward = plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    start = time.perf_counter()
    cfg = SHAPES[args.model]
    print(f"building the random {args.model} model on the CPU", file=sys.stderr, flush=True)
    model = random_model(cfg, torch.float32, device="cpu")
    for p in model.parameters():
        p.copy_(bf16(p))  # the weights the GPU runs
    gen = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in EXACTNESS_LENGTHS]
    ref = prefill(model, chunks)
    cases = {
        "product inputs": dict(round_in=True),
        "product outputs": dict(round_out=True),
        "inputs and outputs": dict(round_in=True, round_out=True),
    }
    print(f"| case | all rows | {' | '.join(f'row of {n}' for n in EXACTNESS_LENGTHS)} |")
    print(f"|---|---:|{'---:|' * len(EXACTNESS_LENGTHS)}")
    for label, kwargs in [*cases.items(), ("plain bf16", None)]:
        print(f"[{time.perf_counter() - start:5.1f}s] {label}", file=sys.stderr, flush=True)
        if kwargs is None:
            model = model.to(torch.bfloat16)
            out = prefill(model, chunks)
        else:
            out = prefill(model, chunks, **kwargs)
        rows = [((out[i] - ref[i]).norm() / ref[i].norm()).item() for i in range(len(EXACTNESS_LENGTHS))]
        total = ((out - ref).norm() / ref.norm()).item()
        print(f"| {label} | {total:.1e} | {' | '.join(f'{e:.1e}' for e in rows)} |", flush=True)


if __name__ == "__main__":
    main()
