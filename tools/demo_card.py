"""The demo model's card: loss plot, greedy samples and figures, written beside the weights.

Owns models/demo/{README.md, loss.png, training.json, heldout_excerpt.txt}; reads the model
directory the trainer wrote (copied into --model), the trainer's training.json and log.jsonl
(--run), and the corpus folder (--data). Never changes the weights.

    python tools/demo_card.py --model models/demo --run out/demo --data .carry/demo

The samples run on the CPU through the project's ModelRunner (prefill, then greedy decode), from
the shipped bfloat16 weights read in fp32, so anyone can regenerate them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import matplotlib
import numpy as np
import torch
from tokenizers import Tokenizer

from replicas.model.checkpoint import load_model
from replicas.model.runner import ModelRunner
from replicas.model.rwkv7 import RWKV7, wkv_reference

PROMPTS = ("def ", "import os\n", "class ", '    """Return the ', "    for i in range(")
SAMPLE_TOKENS = 48
EXCERPT_ROWS = 4


def greedy(model: RWKV7, tok: Tokenizer, prompt: str, n: int, eos: int) -> str:
    """The prompt's greedy continuation: argmax at each step, up to n tokens or end of text."""
    runner = ModelRunner(model, max_slots=1)
    logits = runner.prefill([0], [tok.encode(prompt, add_special_tokens=False).ids])
    out: list[int] = []
    while len(out) < n:
        token = int(logits[0].argmax())
        if token == eos:
            break
        out.append(token)
        logits = runner.decode([0], [token])
    return tok.decode(out)


def excerpt_windows(ids: torch.Tensor) -> torch.Tensor:
    """The excerpt as EXCERPT_ROWS windows [rows, L + 1] overlapping by one token: read as a batch,
    L steps instead of rows·L, which keeps the unit test fast on a CPU."""
    L = (ids.numel() - 1) // EXCERPT_ROWS
    return torch.stack([ids[i * L: i * L + L + 1] for i in range(EXCERPT_ROWS)])


@torch.no_grad()
def excerpt_nats(model: RWKV7, windows: torch.Tensor) -> float:
    """Mean nats per predicted token, each window from a zero state (reference recurrence)."""
    logits = model.forward_batch(windows[:, :-1], wkv=wkv_reference)
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()))


def unigram_nats(train: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """As demo_corpus.unigram_nats: add-one unigram of the train stream."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    return float(-np.log(counts / counts.sum())[targets].mean())


def read_log(path: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if "train" in r], [r for r in records if "heldout" in r]


def plot(train: list[dict], heldout: list[dict], unigram: float, shipped: float, path: Path) -> None:
    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot([r["step"] for r in train], [r["train"] for r in train], lw=1, label="train (mean of 10 steps)")
    ax.plot([r["step"] for r in heldout], [r["heldout"] for r in heldout], "o-", ms=3,
            label="held-out (64 fixed windows)")
    ax.axhline(unigram, color="grey", ls="--", lw=1, label=f"unigram baseline {unigram:.2f}")
    ax.axhline(unigram / 2, color="grey", ls=":", lw=1, label=f"bar: half the baseline {unigram / 2:.2f}")
    ax.axhline(shipped, color="C3", lw=1, label=f"shipped, whole held-out split {shipped:.3f}")
    ax.set(xlabel="step (65,536 tokens each)", ylabel="cross-entropy (nats/token)", ylim=(1.0, 9.0),
           title="RWKV-7 demo model on the CPython 3.11 standard library")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/demo"))
    parser.add_argument("--run", type=Path, default=Path("out/demo"))
    parser.add_argument("--data", type=Path, default=Path(".carry/demo"))
    parser.add_argument("--heldout-cpu", type=float, default=None,
                        help="held-out loss re-measured on the CPU with wkv_reference, if done")
    args = parser.parse_args()

    record = json.loads((args.run / "training.json").read_text())
    model, card = load_model(args.model)
    tok = Tokenizer.from_file(str(args.model / card.tokenizer))
    shutil.copyfile(args.data / "heldout_excerpt.txt", args.model / "heldout_excerpt.txt")
    ids = tok.encode((args.model / "heldout_excerpt.txt").read_text(), add_special_tokens=False).ids
    windows = excerpt_windows(torch.tensor(ids))
    targets = windows[:, 1:].flatten().numpy()
    unigram = unigram_nats(np.load(args.data / "train.npy"), targets, model.config.vocab_size)
    nats = excerpt_nats(model, windows)
    samples = {p: greedy(model, tok, p, SAMPLE_TOKENS, card.eos_token_id) for p in PROMPTS}
    train, heldout = read_log(args.run / "log.jsonl")
    plot(train, heldout, record["unigram_heldout_nats"], record["heldout_nats"], args.model / "loss.png")

    record["excerpt"] = {
        "path": record["corpus"]["excerpt"]["path"], "tokens": len(ids), "rows": EXCERPT_ROWS,
        "targets": int(targets.size), "model_nats": nats, "unigram_nats": unigram,
    }
    record["heldout_nats_cpu_reference"] = args.heldout_cpu
    record["samples"] = samples
    (args.model / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    for prompt, text in samples.items():
        print(f"--- {prompt!r}\n{prompt}{text}")
    print(f"excerpt: model {nats:.4f} vs unigram {unigram:.4f} nats/token")


if __name__ == "__main__":
    main()
