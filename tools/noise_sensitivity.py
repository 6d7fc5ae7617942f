"""How much the long-prefill logits move when the inputs of one kind of product are perturbed by
fp16's rounding size, on the CPU: which activation the CUDA runner should keep most precise.

The benchmark's random model (weights rounded to fp16 as the GPU runs them), its four rows of 48,
17, 5 and 64 tokens from zero states, rwkv7.py's fp32 math; the inputs of one class of products
get a relative perturbation of ±REL with random signs (seeded), and the relative logit error
‖Δ‖/‖ref‖ is printed per seed and as an rms. `all` perturbs every product (about what rounding
every activation to fp16 does); two seeds of the same size differing by 2x show that one reading
of the error is one sample of a wide distribution.

    python tools/noise_sensitivity.py [--model 1.5b] [--rel 2.4e-4] [--seeds 3] [--layers N]

--layers keeps the shape's width with fewer layers: 7.2B's in fp32 needs 29 GB of memory, its
first 12 layers 12 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bf16_error import prefill_with  # noqa: E402
from gpu import EXACTNESS_LENGTHS, SHAPES, random_model  # noqa: E402

CLASSES = ("att-receptance", "att-key", "att-value", "att-output", "ffn-key", "ffn-value", "all")


def label_products(model) -> None:
    for block in model.blocks:
        for name, module in block.att.named_children():
            if isinstance(module, torch.nn.Linear):
                module.noise_class = f"att-{name}"
        block.ffn.key.noise_class, block.ffn.value.noise_class = "ffn-key", "ffn-value"


def prefill(model, chunks, cls: str | None = None, rel: float = 0.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)

    def forward(self, x):
        if cls is not None and (cls == "all" or getattr(self, "noise_class", None) == cls):
            x = x * (1 + rel * (2 * torch.randint(0, 2, x.shape, generator=gen) - 1))
        return F.linear(x, self.weight)

    return prefill_with(model, chunks, forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--rel", type=float, default=2.0**-12, help="relative size (fp16's half-ulp: 2**-12)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (0: all)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    start = time.perf_counter()
    cfg = SHAPES[args.model]
    if args.layers:
        cfg = dataclasses.replace(cfg, n_layer=args.layers)
    print(f"building the random {args.model} model on the CPU", file=sys.stderr, flush=True)
    model = random_model(cfg, torch.float32, device="cpu")
    for p in model.parameters():
        p.copy_(p.half().float())
    label_products(model)
    gen = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in EXACTNESS_LENGTHS]
    ref = prefill(model, chunks)
    print(f"| inputs perturbed (±{args.rel:.1e}) | {' | '.join(f'seed {s}' for s in range(1, args.seeds + 1))} | rms |")
    print(f"|---|{'---:|' * (args.seeds + 1)}")
    for cls in CLASSES:
        print(f"[{time.perf_counter() - start:5.1f}s] {cls}", file=sys.stderr, flush=True)
        errs = [((out - ref).norm() / ref.norm()).item()
                for out in (prefill(model, chunks, cls, args.rel, seed) for seed in range(1, args.seeds + 1))]
        rms = (sum(e * e for e in errs) / len(errs)) ** 0.5
        print(f"| {cls} | {' | '.join(f'{e:.1e}' for e in errs)} | {rms:.1e} |", flush=True)


if __name__ == "__main__":
    main()
